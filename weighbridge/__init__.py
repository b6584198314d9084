"""weighbridge: token-aware multi-tenant fair scheduling, load generation and measurement
for vLLM serving. The shared core lives in submodules (``config``, ``records``).
"""

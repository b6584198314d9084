"""Exporters: the load generator's Prometheus metrics and the queueing-theory checks behind
them (Little's Law, per-tenant token share and Jain's index, offered load against served
throughput). The computations are pure modules; ``weighbridge.exporters.loadgen`` wires them to
``prometheus_client``."""

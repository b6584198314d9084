"""The fair-scheduling sidecar: a pure, clock-injected scheduling core and its HTTP shell.

The core modules (``request``, ``rejection``, ``ratelimit``, ``estimator``, ``queues``,
``drr``, ``tiers``, ``scheduler``, ``predictor``, ``admission``, ``router``, ``ledger`` and
``core``, which composes them) do no I/O and never read a clock: every method that depends on
time takes ``now`` (seconds, any monotonic origin). The same code serves the live proxy, the
hypothesis properties and virtual-time simulations.
"""

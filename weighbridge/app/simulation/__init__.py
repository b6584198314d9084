"""``weighbridge simulate``: the whole sidecar against the engine model in virtual time
(docs/simulate.md). ``loop`` is the discrete-event loop; ``run`` makes one run directory;
``batch`` runs policies side by side and sweeps."""

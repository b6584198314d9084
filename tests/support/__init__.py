"""What the tests share, as plain modules (never imported from a conftest):

- ``stack``: the config pieces of a sidecar test and ``start_stack``, the one factory for
  emulated engines + a sidecar on loopback;
- ``metrics``: the tests' reader of the Prometheus text format (``Scrape``);
- ``ledger``: the sidecar's request ledger and state endpoints, ``settled()``;
- ``wait``: waiting on a condition with a deadline (never a fixed sleep);
- ``answers``: what a served or rejected answer must look like;
- ``raw_client``: a hand-driven HTTP/1.1 client (disconnects under the test's control);
- ``stub_backend``: a vLLM stand-in whose answers and /metrics a test controls;
- ``driver``: asyncio load (open and closed loops, streamed requests, outcomes);
- ``scenarios``: config builders, a background /metrics sampler and drain waits for the
  acceptance scenarios;
- ``locust``: one Locust run of a scenario as a subprocess;
- ``prometheus``: a real Prometheus server's checks and HTTP API;
- ``chaos``: conservation of a generator's outcomes in the ledger, RSS, slowdown;
- ``records``: synthetic run directories for the analysis tests.

Percentiles and Jain's index are the project's own: ``weighbridge.loadgen.measure.percentile`` and
``weighbridge.exporters.share.jain_index``.
"""

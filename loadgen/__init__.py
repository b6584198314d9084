"""weighbridge's Locust load generator: multi-tenant LLM traffic measured per request.

Pure parts (no I/O, seeded): :mod:`weighbridge.loadgen.lengths` (token-length distributions),
:mod:`weighbridge.loadgen.arrivals` (arrival processes), :mod:`weighbridge.loadgen.tenants` (the
tenants file), :mod:`weighbridge.loadgen.scenario` (phases, scenarios),
:mod:`weighbridge.loadgen.plan` (schedules and request sizes), :mod:`weighbridge.loadgen.sessions`
(multi-turn sessions), :mod:`weighbridge.loadgen.trace` (traces made into plans),
:mod:`weighbridge.loadgen.bodies`
(request bodies), :mod:`weighbridge.loadgen.measure` (the streaming measurement),
:mod:`weighbridge.loadgen.lag` (the generator's schedule lag). Shells:
:mod:`weighbridge.loadgen.client` (geventhttpclient), :mod:`weighbridge.loadgen.driver` (greenlets),
:mod:`weighbridge.loadgen.locust_plugin` (Locust). Run it with ``locust -f scenarios/``
(docs/loadgen.md).
"""

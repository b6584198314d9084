"""weighbridge's Locust load generator: multi-tenant LLM traffic measured per request.

Pure parts (no I/O, seeded): :mod:`loadgen.lengths` (token-length distributions),
:mod:`loadgen.arrivals` (arrival processes), :mod:`loadgen.tenants` (the tenants file),
:mod:`loadgen.scenario` (phases, scenarios), :mod:`loadgen.plan` (schedules and request
sizes), :mod:`loadgen.bodies` (request bodies), :mod:`loadgen.measure` (the streaming
measurement), :mod:`loadgen.lag` (the generator's schedule lag). Shells:
:mod:`loadgen.client` (geventhttpclient), :mod:`loadgen.driver` (greenlets),
:mod:`loadgen.locust_plugin` (Locust). Run it with ``locust -f scenarios/`` (docs/loadgen.md).
"""

"""The load scenarios (docs/loadgen.md); installed as the package data
``weighbridge.scenarios``. Locust skips this file (its name starts with an underscore)."""

"""Grafana dashboards for weighbridge, defined in Python and rendered to the JSON files in
``dashboards/json/`` (``weighbridge dashboards generate``); docs/dashboards.md describes
them."""

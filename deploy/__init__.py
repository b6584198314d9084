"""Deployment files: Prometheus configuration and rules, Grafana provisioning, the compose
and local stacks. Installed as the package data ``weighbridge.deploy``; no code."""

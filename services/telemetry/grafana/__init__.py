"""Grafana dashboards (boards.py renders dashboards/*.json) and provisioning files."""

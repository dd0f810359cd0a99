"""Metrics (metrics.py, served by exposition.py), traces (tracing.py), and the Prometheus rules
and Grafana boards over them."""

"""Observability: engine metrics through ray.util.metrics (`metrics`) and the Grafana dashboard (`grafana`,
imported on demand: it needs grafana-foundation-sdk and grafana-client)."""
from .metrics import SERIES, EngineMetrics, replica_name, request_status

__all__ = ["EngineMetrics", "SERIES", "replica_name", "request_status"]

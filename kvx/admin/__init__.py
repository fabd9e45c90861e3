"""The admin REST API of the kvx metadata service (FastAPI, served by uvicorn
on the service's own event loop): health, readiness, agent listing and
eviction, Prometheus metrics. See ``kvx.admin.app``."""

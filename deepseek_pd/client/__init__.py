"""Clients for a deepseek-pd deployment.

- `RouterClient` (router_http.py): HTTP to the router: `/generate` and `/v1/chat/completions`,
  streaming (SSE) or not, with per-token arrival times for benchmarks.
- `SchedulerClient` (scheduler_grpc.py): one worker's SglangScheduler API (health, info, loads).
- `PDClient` (pd_dispatch.py): does the router's PD dual dispatch itself, for tests and benchmarks
  that want no router in the path.
"""
from deepseek_pd.client.router_http import ChatResult, GenerateResult, RouterClient, RouterError

__all__ = ["ChatResult", "GenerateResult", "RouterClient", "RouterError"]

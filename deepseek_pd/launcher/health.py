"""Readiness probes used while a local cluster starts: gRPC HealthCheck and the router's HTTP API."""
from __future__ import annotations

import json
import urllib.error
import urllib.request

import grpc
from smg_grpc_proto import sglang_scheduler_pb2 as pb
from smg_grpc_proto import sglang_scheduler_pb2_grpc as pb_grpc


def worker_is_healthy(address: str, timeout_s: float = 2.0) -> bool:
    """One HealthCheck call against `host:port`; any error counts as not healthy (yet)."""
    with grpc.insecure_channel(address) as channel:
        try:
            reply = pb_grpc.SglangSchedulerStub(channel).HealthCheck(
                pb.HealthCheckRequest(), timeout=timeout_s)
        except grpc.RpcError:
            return False
        return reply.healthy


def worker_kv_tokens(address: str, timeout_s: float = 2.0) -> int | None:
    """The tokens a worker's KV pool holds (GetServerInfo's max_total_num_tokens); None when it does not answer."""
    with grpc.insecure_channel(address) as channel:
        try:
            reply = pb_grpc.SglangSchedulerStub(channel).GetServerInfo(pb.GetServerInfoRequest(), timeout=timeout_s)
        except grpc.RpcError:
            return None
        return reply.max_total_num_tokens


def router_ready_workers(base_url: str, timeout_s: float = 2.0) -> int:
    """How many healthy workers the router has registered; -1 while it is not answering or not ready."""
    try:
        with urllib.request.urlopen(f"{base_url}/readiness", timeout=timeout_s) as reply:
            body = json.loads(reply.read() or b"{}")
    except (urllib.error.URLError, OSError, ValueError):
        return -1
    return int(body.get("healthy_workers", -1))

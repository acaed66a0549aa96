"""Shared settings for the end-to-end tests: the embedded tiny model on the real PD engines.

Small KV pages and a small chunked-prefill budget make modest prompts cross page and chunk
boundaries, so the PD paths that matter (chunked prefill streaming KV, partial last pages,
prefix-cache hits) are exercised on CPU in seconds. Short bootstrap timeouts keep the failure
tests fast; they are still far above what a healthy request needs on this model.
"""
from __future__ import annotations

import asyncio
import threading
from pathlib import Path

from deepseek_pd.client.scheduler_grpc import SchedulerClient
from deepseek_pd.launcher.cluster import ROUTER_LOCAL_FLAGS, ClusterSpec, LocalCluster
from deepseek_pd.launcher.supervisor import Supervisor, SupervisorConfig
from deepseek_pd.launcher.worker_plan import GroupShape

MODEL = "tiny"
PAGE_SIZE = 4
CHUNKED_PREFILL_SIZE = 32
WORKER_ARGS = (
    f"--page-size={PAGE_SIZE}",
    f"--chunked-prefill-size={CHUNKED_PREFILL_SIZE}",
    "--num-pages=2048",
    "--engine-opt=handshake_timeout_s=8",
    "--engine-opt=transfer_timeout_s=20",
    "--drain-timeout=2",
)

# On SIGTERM smg keeps its port open for a load balancer to notice (min(5 s, half its shutdown
# grace)) before it drains. Nothing fronts a test's router and no request is in flight when a test
# stops its cluster, so that window was 5 s of idle time per cluster; a 1 s grace makes it 0 s.
ROUTER_ARGS = (*ROUTER_LOCAL_FLAGS, "--shutdown-grace-period-secs", "1")


def cluster_spec(tmp: Path, num_prefill: int = 1, num_decode: int = 1, kv_transport: str = "grpc",
                 extra_worker_args: tuple[str, ...] = (), prefill_group: GroupShape = GroupShape(),
                 decode_group: GroupShape = GroupShape(), startup_timeout_s: float = 180) -> ClusterSpec:
    return ClusterSpec(model=MODEL, num_prefill=num_prefill, num_decode=num_decode,
                       prefill_group=prefill_group, decode_group=decode_group,
                       kv_transport=kv_transport, log_dir=tmp / "logs",
                       worker_args=WORKER_ARGS + extra_worker_args, startup_timeout_s=startup_timeout_s,
                       router_args=ROUTER_ARGS, stop_grace_s=10)


def supervise(cluster: LocalCluster, stop: threading.Event,
              config: SupervisorConfig | None = None) -> tuple[threading.Thread, Supervisor]:
    """`up`'s loop: supervisor.step() about every 0.2 s until `stop`. The thread must outlive
    every process it restarts: PR_SET_PDEATHSIG fires when the forking *thread* exits."""
    supervisor = cluster.supervisor(config)

    def loop():
        while not stop.wait(0.2):
            supervisor.step()
    thread = threading.Thread(target=loop, daemon=True)
    thread.start()
    return thread, supervisor


def cluster_cli_flags() -> list[str]:
    """The same cluster, as `deepseek-pd up` / `bench serving` flags."""
    return ["--model", MODEL, *[f"--worker-arg={arg}" for arg in WORKER_ARGS]]


async def used_pages(address: str) -> int:
    """KV pages a worker holds for requests (what GetLoads reports), in pages."""
    async with SchedulerClient(address) as client:
        load = await client.loads()
    return load.num_used_tokens // PAGE_SIZE


async def wait_for_pages(address: str, want: int, timeout_s: float) -> int:
    """Polls GetLoads until the worker's used pages equal `want`; returns the last value seen."""
    loop = asyncio.get_running_loop()
    deadline = loop.time() + timeout_s
    while True:
        pages = await used_pages(address)
        if pages == want or loop.time() > deadline:
            return pages
        await asyncio.sleep(0.1)

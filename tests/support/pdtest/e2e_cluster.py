"""Shared settings for the end-to-end tests: the embedded tiny model on the real PD engines.

Small KV pages and a small chunked-prefill budget make modest prompts cross page and chunk
boundaries, so the PD paths that matter (chunked prefill streaming KV, partial last pages,
prefix-cache hits) are exercised on CPU in seconds. Short bootstrap timeouts keep the failure
tests fast; they are still far above what a healthy request needs on this model.
"""
from __future__ import annotations

import asyncio
from pathlib import Path

from deepseek_pd.client.scheduler_grpc import SchedulerClient
from deepseek_pd.launcher.cluster import ClusterSpec

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


def cluster_spec(tmp: Path, num_prefill: int = 1, num_decode: int = 1, kv_transport: str = "grpc",
                 extra_worker_args: tuple[str, ...] = ()) -> ClusterSpec:
    return ClusterSpec(model=MODEL, num_prefill=num_prefill, num_decode=num_decode,
                       kv_transport=kv_transport, log_dir=tmp / "logs",
                       worker_args=WORKER_ARGS + extra_worker_args, startup_timeout_s=180,
                       stop_grace_s=10)


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

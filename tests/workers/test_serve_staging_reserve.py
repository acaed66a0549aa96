"""A worker over Mooncake (decode or prefill) sizes its KV pool with its staging area taken out of the budget.

The chain runs as a worker runs it: the `serve` command line -> the resolved configs
(workers/serve/resolution.py) -> `ModelRunner`, which sizes its pool from the GPU's memory after the
weights load (model/kv/pool_sizing.py) -> the transport's staging area allocated beside the pool
(workers/transport/mooncake.py `staging_for`). The GPU's memory is a drawn reading (this machine has
none; the tiny model runs on the CPU); nothing else is faked. The oracle is the definition of the
budget: weights + headroom + pool + staging fit `mem_fraction_static` x the GPU, and the pool is the
largest that does. Before the staging was counted, the pool filled the budget and the staging
(up to 1.1 GiB on a V3 rank) came out of the 12% outside it.
"""
from __future__ import annotations

import dataclasses
import random

import pytest
import torch

from deepseek_pd.cli import build_parser
from deepseek_pd.commands.serve import flags_from_args
from deepseek_pd.model.kv import pool_sizing
from deepseek_pd.model.kv.memory_budget import budget_bytes
from deepseek_pd.model.runner import ModelRunner
from deepseek_pd.units import GIB
from deepseek_pd.workers.serve.resolution import resolve_serve_config
from deepseek_pd.workers.transport.internal_auth import create_secret_file
from deepseek_pd.workers.transport.mooncake import staging_for

pytestmark = pytest.mark.timeout(300)


def _resolved(role: str, transport: str, protocol: str, staging_tokens: int, monkeypatch, tmp_path):
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    argv = ["serve", role, "--model", "tiny", "--device", "cuda", "--kv-transport", transport,
            "--engine-opt", f"mooncake_staging_tokens={staging_tokens}",
            "--internal-secret-file", str(create_secret_file(tmp_path / "secret"))]
    if role == "decode":
        argv += ["--engine-opt", "cuda_graph=false"]
    if transport == "mooncake":
        argv += ["--kv-protocol", protocol]
    return resolve_serve_config(flags_from_args(build_parser().parse_args(argv)))


@pytest.mark.parametrize("role", ["decode", "prefill"])
def test_a_ranks_pool_and_its_mooncake_staging_fit_the_budget_together(role, monkeypatch, tmp_path) -> None:
    """Decode's staging (what writers reach) and prefill's send staging (where each send is encrypted,
    over TCP too: transport/kv_cipher.py)."""
    rng = random.Random()
    page_size = 16
    staging_tokens = rng.randint(4, 64) * page_size - rng.randrange(page_size)  # rounded up to pages
    resolved = _resolved(role, "mooncake", "tcp", staging_tokens, monkeypatch, tmp_path)
    # The resolved config with the reference kernels; its model is built on the CPU (below), where
    # the runner then allocates its pool.
    runner_config = dataclasses.replace(resolved.runner, attention_backend="torch", moe_backend="torch",
                                        norm_rope_backend="torch")
    headroom = int(runner_config.headroom_gib * GIB)
    weights = rng.randint(1, 64) << 20
    # What the budget leaves for the pool and the staging, in pages: at least twice the staging, so
    # the pool is never smaller than the staging (which `staging_for` would then cap at the pool's
    # size). A budget with no room for a page beside the staging is refused with a UserError,
    # tested in tests/model/kv; seed 812416460 drew 40 pages of room for 61 of staging.
    room_pages = 2 * -(-staging_tokens // page_size) + rng.randint(1, 400)
    reading: dict[str, pool_sizing.GpuMemory] = {}

    def measure(device: str) -> pool_sizing.GpuMemory:  # the GPU right after the weights loaded
        return reading["memory"]

    # The model on the CPU, and the page's bytes from a pool of the same shape.
    probe = ModelRunner(dataclasses.replace(runner_config, device="cpu", num_pages=4, mem_fraction_static=None))
    per_page = probe.kv_pool.bytes_per_page * probe.kv_pool.num_layers
    fraction = runner_config.mem_fraction_static
    total = int((weights + headroom + room_pages * per_page + rng.randrange(per_page)) / fraction) + 1
    reading["memory"] = pool_sizing.GpuMemory(total_bytes=total, free_bytes=total - weights, resident_bytes=weights)
    monkeypatch.setattr(pool_sizing.GpuMemory, "measure", classmethod(lambda cls, device: measure(device)))

    runner = ModelRunner(runner_config, model=probe.model)
    assert runner.kv_pool.device.type == "cpu"
    staging = staging_for(runner.kv_pool, resolved.worker.transport)
    pool_bytes = runner.kv_pool.num_pages * per_page
    staging_bytes = sum(buffer.numel() * buffer.element_size() for buffer in staging.buffers)
    assert staging.num_pages == -(-staging_tokens // page_size)
    assert resolved.runner.mem_reserve_bytes == staging_bytes  # the rule the worker resolved is what it allocates
    budget = budget_bytes(fraction, total)
    used = weights + headroom + pool_bytes + staging_bytes
    assert used <= budget, (f"pool {runner.kv_pool.num_pages} pages + staging {staging.num_pages} pages "
                            f"overflow the budget by {used - budget} bytes")
    assert used + per_page > budget  # and the pool is the largest that fits beside the staging


@pytest.mark.parametrize("role, transport, protocol", [("decode", "grpc", "tcp"), ("prefill", "grpc", "tcp")])
def test_workers_without_a_staging_area_reserve_nothing(role, transport, protocol, monkeypatch, tmp_path) -> None:
    """Only a worker that allocates one keeps it out of its pool (none over gRPC)."""
    resolved = _resolved(role, transport, protocol, random.randint(1, 1 << 16), monkeypatch, tmp_path)
    assert resolved.runner.mem_reserve_bytes == 0

"""`up` on one GPU: its split of the card (launcher/gpu_share.py) plus each worker's Mooncake staging
fits the card's budget (issue 20).

Every worker on the GPU assumes the others reserve what it does (model/kv/memory_budget.py); over
Mooncake every worker allocates a staging area beside its pool (workers/serve/kv_staging.py: decode's
for the writers, prefill's to encrypt each send in), but a staging is capped at its pool's size, so
the workers' reserves can still differ. The chain is followed as it runs, from
random `up` flags: `up`'s plan -> each worker's `serve` command line -> the resolved configs ->
the worker's own pool sizing (`pages_for_gpu`, as `ModelRunner` calls it) -> the staging its own
transport allocates beside that pool (`MooncakeSender`/`MooncakeReceiver` on the stub engine, over
a pool on the meta device: the sizes are real, no byte is). The GPU's memory is a drawn reading (the
weights as torch would measure them after loading); the RDMA device is drawn too where asked for.

The oracle is the definition of the budget: every worker's weights, headroom, pool and staging
together fit `mem_fraction_static` x the card, and what is left unused is at most a page per
worker plus the spread of the workers' reserves (the rule gives a worker whose reserve is below
another's a little less than it could have; before prefill over TCP allocated a staging too, 1 prefill
over TCP and 1 decode left 0.2 x the staging unused).
"""
from __future__ import annotations

import json
import random

import pytest
import torch

from deepseek_pd.cli import build_parser
from deepseek_pd.commands.serve import flags_from_args
from deepseek_pd.launcher.gpu_share import worker_gpu_shares
from deepseek_pd.launcher.worker_plan import GroupShape, ServeSettings, plan_workers, serve_argv
from deepseek_pd.model import runner_config as runner_config_module
from deepseek_pd.model.config import ModelConfig
from deepseek_pd.model.kv.memory_budget import budget_bytes
from deepseek_pd.model.kv.pool import KVPool, bytes_per_pool_page
from deepseek_pd.model.kv.pool_sizing import GpuMemory, pages_for_gpu
from deepseek_pd.model.speculative.mtp_names import kv_layers
from deepseek_pd.operator.known_models import KNOWN_MODELS
from deepseek_pd.units import GIB
from deepseek_pd.workers.serve import resolution
from deepseek_pd.workers.serve.resolution import resolve_serve_config
from deepseek_pd.workers.transport import build_receiver, build_sender
from deepseek_pd.workers.transport.internal_auth import create_secret_file
from pdtest import mooncake_stub

pytestmark = pytest.mark.timeout(120)
CUDA_CONTEXT = GIB // 2  # what each worker's CUDA context holds outside torch's allocator


def _resolved_workers(rng: random.Random, tmp_path, monkeypatch):
    """Random `up` flags -> each worker's resolved `ServeConfig`, as its own `serve` resolves it."""
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(runner_config_module, "_triton_available", lambda: True)
    monkeypatch.setattr(resolution, "usable_rdma_devices", lambda: ("mlx5_0",))  # this machine has none
    name = rng.choice(sorted(KNOWN_MODELS))
    (tmp_path / "config.json").write_text(json.dumps({**KNOWN_MODELS[name], "torch_dtype": "bfloat16"}))
    roles = ["prefill"] * rng.randint(1, 3) + ["decode"] * rng.randint(1, 3)
    rng.shuffle(roles)
    kv_transport = rng.choice(["grpc", "mooncake", "mooncake"])
    worker_args = [f"--page-size={rng.choice([16, 32, 64])}",
                   f"--engine-opt=max_running_requests={rng.choice([32, 128, 256, 512])}"]
    if kv_transport == "mooncake":
        worker_args += [f"--kv-protocol={rng.choice(['tcp', 'rdma'])}",
                        f"--engine-opt=mooncake_staging_tokens={rng.randint(1, 1 << 16)}"]
    steps = rng.choice([0, 1, 2]) if KNOWN_MODELS[name].get("num_nextn_predict_layers") else 0
    fraction = rng.choice([None, round(rng.uniform(0.5, 0.95), 3)])
    plans = plan_workers(roles, [GroupShape() for _ in roles], list(range(20000, 20000 + 3 * len(roles))),
                         worker_gpu_shares("cuda", roles))
    settings = ServeSettings(model_dir=str(tmp_path), served_model_name=name, host="127.0.0.1",
                             kv_transport=kv_transport, device="cuda",
                             secret_file=str(create_secret_file(tmp_path / "secret")),
                             worker_args=tuple(worker_args), mem_fraction_static=fraction,
                             speculative_num_steps=steps)
    resolved = [resolve_serve_config(flags_from_args(build_parser().parse_args(serve_argv(plan, plans, settings)[3:])))
                for plan in plans]
    print(f"{name}, {roles}, {kv_transport}, MTP steps {steps}, fraction {fraction}: {worker_args}")
    return ModelConfig.from_hf(tmp_path), roles, kv_transport, resolved


def _staging_bytes(role: str, kv_transport: str, pool: KVPool, serve_config) -> int:
    """The staging the worker's own transport allocates beside `pool` (0: none)."""
    if kv_transport != "mooncake":
        return 0
    build = build_receiver if role == "decode" else build_sender
    side = build(kv_transport, pool, serve_config.worker.transport)
    try:
        staging = side.staging
        return 0 if staging is None else sum(b.numel() * b.element_size() for b in staging.buffers)
    finally:
        side.close()


@pytest.mark.parametrize("draw", range(6))
def test_ups_split_and_each_workers_staging_fit_the_card_together(draw, tmp_path, monkeypatch) -> None:
    rng = random.Random()
    mooncake_stub.install(monkeypatch)
    config, roles, kv_transport, resolved = _resolved_workers(rng, tmp_path, monkeypatch)
    runners = [serve.runner for serve in resolved]
    fraction = runners[0].mem_fraction_static
    assert all(r.mem_fraction_static == fraction and r.gpu_workers == len(roles) for r in runners)
    weights = rng.randint(1 << 20, 40 * GIB)  # one checkpoint: every worker holds the same
    layers = [kv_layers(config, r.speculative_num_steps > 0) for r in runners]
    per_page = [bytes_per_pool_page(n, r.page_size, config.kv_cache_dim, r.resolve_dtype(config))
                for n, r in zip(layers, runners)]
    headroom = [int(r.headroom_gib * GIB) for r in runners]
    reserves = [weights + h + r.mem_reserve_bytes for h, r in zip(headroom, runners)]
    # Over Mooncake every role reserves the same staging (prefill's send staging over TCP too: it
    # is where each send is encrypted), so workers of the same KV pages reserve alike and no worker
    # sizes below another's reserve (before, 1 prefill over TCP and 1 decode left 0.2 x the staging unused).
    if len({(n, p, h) for n, p, h in zip(layers, per_page, headroom)}) == 1:
        assert len({r.mem_reserve_bytes for r in runners}) == 1, [r.mem_reserve_bytes for r in runners]
    # What the budget leaves for pools. Each worker sizes as if every worker reserved what it does
    # (model/kv/memory_budget.py), so the least room any worker can place a page in is the room less
    # the reserves' spread: drawn below that, a worker refuses to start (a clear UserError, tested in
    # tests/model/kv), which is not what this test is about.
    spread = len(roles) * max(reserves) - sum(reserves)
    room = rng.randint(spread + len(roles) * max(per_page) * 4, spread + len(roles) * 64 * GIB)
    total = int((sum(reserves) + room) / fraction) + 1
    budget = budget_bytes(fraction, total)
    free = total - len(roles) * (weights + CUDA_CONTEXT)  # every worker loads its weights before its pool

    used = unused_reserve = 0
    for role, serve, runner, page, held in zip(roles, resolved, runners, per_page, headroom):
        pages = pages_for_gpu(GpuMemory(total, free, weights), fraction, held, page,
                              min_pages=2 if runner.cuda_graph else 1, share=runner.gpu_share,
                              reserve_bytes=runner.mem_reserve_bytes)
        pool = KVPool(kv_layers(config, runner.speculative_num_steps > 0), pages, runner.page_size,
                      config.kv_cache_dim, dtype=runner.resolve_dtype(config), device="meta")
        staging = _staging_bytes(role, kv_transport, pool, serve)
        # A staging area is at most the pool's size (workers/transport/mooncake.py staging_for): the
        # reserve, sized before the pool, is then more than it takes, and the rest of it goes unused.
        expected = min(runner.mem_reserve_bytes, pages * page)
        assert staging == expected, f"{role}: allocates {staging} bytes of staging, expected {expected} " \
                                    f"(reserved {runner.mem_reserve_bytes}, pool {pages * page})"
        unused_reserve += runner.mem_reserve_bytes - staging
        worker = weights + held + pages * page + staging
        used += worker
        free -= pages * page + held + staging
    assert used <= budget, f"the workers overflow the budget by {used - budget} bytes"
    assert budget - used <= sum(per_page) + max(reserves) - min(reserves) + unused_reserve, \
        f"{budget - used} bytes of the budget are left unused"

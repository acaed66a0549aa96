"""Memory planning counts the weights once per worker (model/kv/memory_budget.py, issue 25).

`up` on one GPU starts a prefill and a decode worker, each loading its own copy of the weights.
The chain is followed as it runs: `up`'s plan -> each worker's `serve` command line -> the
resolved RunnerConfig -> the worker's own pool sizing (`pages_for_gpu`), with the GPU's memory as
torch reports it after the weights load. The oracle is the definition: each worker's KV pool is
positive, the workers' weights + headroom + pools fit the GPU's budget, and the KV room is split
2:3. The operator's memory plan, given the same flags, says the same.
"""
from __future__ import annotations

import json
import logging
import random

import pytest
import torch
import yaml

from deepseek_pd.cli import build_parser
from deepseek_pd.commands.serve import flags_from_args
from deepseek_pd.launcher.gpu_share import worker_gpu_shares
from deepseek_pd.launcher.worker_plan import GroupShape, ServeSettings, plan_workers, serve_argv
from deepseek_pd.model import runner_config as runner_config_module
from deepseek_pd.model.config import ModelConfig
from deepseek_pd.model.kv.pool import bytes_per_pool_page
from deepseek_pd.model.kv.pool_sizing import GpuMemory, pages_for_budget, pages_for_gpu
from deepseek_pd.model.kv.memory_budget import DEFAULT_MEM_FRACTION_STATIC, GpuShare, budget_bytes
from deepseek_pd.operator.gpu_types import product_memory_bytes
from deepseek_pd.operator.known_models import KNOWN_MODELS
from deepseek_pd.operator.memory_plan import plan_memory
from deepseek_pd.operator.spec import DeploymentSpec
from deepseek_pd.operator.weight_bytes import WeightFormat, rank_weights
from deepseek_pd.units import GIB
from deepseek_pd.workers.transport.internal_auth import create_secret_file
from deepseek_pd.workers.serve.resolution import resolve_serve_config

H100_TOTAL = 85_017_493_504  # torch.cuda.mem_get_info on the lent H100 80GB (issue 25)
CARDS = {"H100-80GB": H100_TOTAL, "H200": product_memory_bytes("NVIDIA-H200")}
CUDA_CONTEXT = GIB // 2  # what each worker's CUDA context holds outside torch's allocator


def _seeded() -> random.Random:
    seed = random.randrange(2 ** 32)
    print(f"seed {seed}")
    return random.Random(seed)


@pytest.fixture
def v2_lite(tmp_path, monkeypatch):
    """A GPU machine (nothing is loaded: resolution reads config.json only) and V2-Lite's config."""
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(runner_config_module, "_triton_available", lambda: True)
    (tmp_path / "config.json").write_text(json.dumps({**KNOWN_MODELS["DeepSeek-V2-Lite"], "torch_dtype": "bfloat16"}))
    return tmp_path


def _up_runners(model_dir, roles, kv_transport="grpc"):
    """Each worker's resolved RunnerConfig, from the command line `up` gives it (default memory flags)."""
    shapes = [GroupShape() for _ in roles]
    plans = plan_workers(roles, shapes, list(range(20000, 20000 + 3 * len(roles))), worker_gpu_shares("cuda", roles))
    settings = ServeSettings(model_dir=str(model_dir), served_model_name="v2-lite", host="127.0.0.1",
                             kv_transport=kv_transport, device="cuda",
                             secret_file=str(create_secret_file(model_dir / "secret")))
    runners = []
    for plan in plans:
        args = build_parser().parse_args(serve_argv(plan, plans, settings)[3:])
        runners.append(resolve_serve_config(flags_from_args(args)).runner)
    return runners


@pytest.mark.parametrize("kv_transport", ["grpc", "mooncake"])
@pytest.mark.parametrize("card", sorted(CARDS))
def test_up_starts_v2_lite_on_one_card_with_kv_for_both_workers(card, kv_transport, v2_lite, caplog) -> None:
    total = CARDS[card]
    config = ModelConfig.from_hf(v2_lite)
    weights = rank_weights(config, WeightFormat(2), 1).total_bytes  # bf16, every expert on the one GPU
    assert 28 * GIB < weights < 30 * GIB
    runners = _up_runners(v2_lite, ["prefill", "decode"], kv_transport)
    budget = budget_bytes(DEFAULT_MEM_FRACTION_STATIC, total)
    # Before: each worker's budget was its slice of the card, weights included (0.352 x 79.2 GiB).
    assert int(DEFAULT_MEM_FRACTION_STATIC * 2 / 5 * total) < weights or card == "H200"
    used = 2 * (weights + CUDA_CONTEXT)  # both copies of the weights are loaded before either pool
    kv_bytes = []
    with caplog.at_level(logging.INFO, logger="deepseek_pd.model.kv.pool_sizing"):
        for runner in runners:
            per_page = bytes_per_pool_page(config.num_hidden_layers, runner.page_size, config.kv_cache_dim,
                                           torch.bfloat16)
            headroom = int(runner.headroom_gib * GIB)
            # The worker keeps what it allocates beside the pool (decode's Mooncake staging) out of it.
            pages = pages_for_gpu(GpuMemory(total, total - used, weights), runner.mem_fraction_static, headroom,
                                  per_page, min_pages=2 if runner.cuda_graph else 1, share=runner.gpu_share,
                                  reserve_bytes=runner.mem_reserve_bytes)
            assert pages > 0
            used += pages * per_page + headroom + runner.mem_reserve_bytes
            kv_bytes.append(pages * per_page)
            print(f"{card}: {runner.page_size * pages:,} KV tokens ({pages * per_page / GIB:.1f} GiB)")
    assert used - 2 * CUDA_CONTEXT <= budget <= total
    prefill, decode = kv_bytes
    assert (runners[1].mem_reserve_bytes > 0) == (kv_transport == "mooncake")  # decode stages Mooncake's KV
    if runners[0].mem_reserve_bytes == runners[1].mem_reserve_bytes:
        assert decode / prefill == pytest.approx(1.5, rel=1e-3)
    assert "of the KV room of 2 workers" in caplog.text


def test_worker_budgets_sum_to_the_gpus_budget() -> None:
    """N workers with the same reserve and shares summing to 1 use the whole budget, never more."""
    rng = _seeded()
    for _ in range(2000):
        total, fraction = rng.randint(8 * GIB, 200 * GIB), rng.uniform(0.3, 1.0)
        budget = budget_bytes(fraction, total)
        workers = rng.randint(1, 8)
        weights = [rng.random() for _ in range(workers)]
        shares = [w / sum(weights) for w in weights]
        reserve = rng.randint(0, budget // workers)
        held = [GpuShare(workers, share).worker_budget(budget, reserve) for share in shares]
        assert budget - workers <= sum(held) <= budget
        assert all(r >= reserve for r in held)
    alone = GpuShare()
    assert alone.worker_budget(budget, reserve) == budget and not alone.shared
    with pytest.raises(ValueError):
        GpuShare(2, 0.0)


def test_the_pool_is_the_largest_that_fits_the_share() -> None:
    """pages_for_budget with a share: n pages fit this worker's part, n + 1 do not."""
    rng = _seeded()
    for _ in range(2000):
        per_page = rng.randint(1, 1 << 22)
        workers = rng.randint(1, 4)
        share = GpuShare(workers, rng.uniform(0.05, 1.0))
        weights, headroom = rng.randint(0, 1 << 36), rng.randint(0, 1 << 31)
        budget = workers * (weights + headroom) + rng.randint(0, 1 << 38)
        part = share.share * (budget - workers * (weights + headroom))
        if part < per_page:
            continue
        pages = pages_for_budget(budget, per_page, weights, headroom, share=share)
        assert pages * per_page <= part < (pages + 1) * per_page + 1


@pytest.mark.parametrize("card, product", [("H100-80GB", "NVIDIA-H100-80GB-HBM3"), ("H200", "NVIDIA-H200")])
def test_the_operators_plan_applies_the_same_rule(card, product) -> None:
    """A V2-Lite role with `up`'s flags (--gpu-workers 2 --kv-share S): the plan's budget for the rank
    is what the worker's own sizing fills, and the verdict says whether that holds the plan's minimum."""
    rng = _seeded()
    raw = yaml.safe_load(open("examples/deepseek-v3-h200.yaml"))["spec"]
    raw["model"].update(path="deepseek-ai/DeepSeek-V2-Lite", servedName="v2-lite", architecture="DeepSeek-V2-Lite")
    raw["model"].pop("numRoutedExperts", None)
    raw["scheduling"] = {"nodeSelector": {"nvidia.com/gpu.product": product}}
    raw["decode"].pop("speculative", None)  # V2-Lite has no MTP layer (the V3 example speculates)
    share = round(rng.uniform(0.2, 0.8), 3)
    for role in ("prefill", "decode"):
        raw[role].update(size=1, gpusPerPod=1, parallelism={"tp": 1, "dp": 1, "ep": 1},
                         engineArgs=["--gpu-workers", "2", "--kv-share", str(share)])
    verdict = plan_memory(DeploymentSpec.parse("x", "llm", raw))
    assert len(verdict.ranks) == 2, verdict.message  # fits or not (one 163,840-token request), it is planned
    for rank in verdict.ranks:
        budget = budget_bytes(DEFAULT_MEM_FRACTION_STATIC, product_memory_bytes(product))
        per_page = 16 * rank.kv_bytes_per_token
        pages = pages_for_budget(budget, per_page, rank.weights_bytes, rank.reserve_bytes, share=GpuShare(2, share),
                                 reserve_bytes=rank.staging_bytes)  # the example's Mooncake staging
        spare = rank.budget_bytes - rank.weights_bytes - rank.reserve_bytes - rank.staging_bytes
        assert pages * per_page <= spare < (pages + 1) * per_page
        assert rank.fits == (pages * per_page >= rank.kv_bytes), verdict.message


def test_up_shares_the_kv_room_by_role_and_only_on_cuda() -> None:
    """Each worker's share follows its role's weight (workers/serve/roles.py), the shares sum to 1, every
    worker counts all of them; on the CPU no worker gets any GPU flag (fixed pools)."""
    from deepseek_pd.workers.serve.roles import ROLE_DEFAULTS, ROLES

    rng = _seeded()
    for _ in range(50):
        roles = [rng.choice(ROLES) for _ in range(rng.randint(1, 9))]
        shares = worker_gpu_shares("cuda", roles)
        assert sum(s.share for s in shares) == pytest.approx(1.0) and {s.workers for s in shares} == {len(roles)}
        for role, share in zip(roles, shares):
            for other, other_share in zip(roles, shares):
                ratio = ROLE_DEFAULTS[role].gpu_memory_share / ROLE_DEFAULTS[other].gpu_memory_share
                assert share.share / other_share.share == pytest.approx(ratio)
        assert worker_gpu_shares("cpu", roles) == [None] * len(roles)

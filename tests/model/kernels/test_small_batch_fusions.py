"""The batch-1 decode fusions (issue 21) against their torch oracles, on fresh random inputs from
the run's seed, with every output the kernels allocate poisoned first (NaN / a wild id), so a slot
a kernel forgets to write shows.

- `kernels/router_select.py` against `moe/topk.py` (scoring, the three methods, `finish_weights`)
  plus the fused shared ids, as `DeepseekMoE.select_experts` builds them; on logits full of ties,
  its slots in the order of torch's CUDA top-k rule (GPU: torch's very bits and order);
- `kernels/moe_single_token.py` against `TorchMoEKernel`, foreign (other EP rank) ids included,
  and its launch grids against the card's SM count;
- a tiny model with `small_batch_fusions` on against the same model with it off (Triton backends
  both), greedy tokens equal and logits close, decode at batch 1 and a batch beside it, and the
  launches each fusion saves (bench/decode_kernel_count.py). The kv_a norm fused into the rope
  launch (`kernels/rope_cache.py`) is checked against the torch ops in tests/model/test_norm_rope_triton.py.
CPU: Triton's interpreter; the kernels in fp32 (GPU, marker `gpu`: bf16 at DeepSeek shapes too), the tiny
model in fp32 everywhere. Speed: bench/decode_bs1_gpu.py.
"""
from __future__ import annotations

import contextlib
import random

import pytest
import torch

from pdtest.triton_env import DEVICE, HAS_CUDA, TRITON_RUNS  # noqa: E402 (first: it sets TRITON_INTERPRET)

from deepseek_pd.model.moe.experts import MOE_BACKENDS  # noqa: E402
from deepseek_pd.model.moe.layer import DeepseekMoE  # noqa: E402
from deepseek_pd.model.moe.topk import SCORING, TOPK_METHODS, TopKSpec, finish_weights  # noqa: E402

pytestmark = [pytest.mark.timeout(300),
              pytest.mark.skipif(not TRITON_RUNS, reason="needs a GPU, or Triton whose CPU interpreter runs here")]
requires_cuda = pytest.mark.skipif(not HAS_CUDA, reason="needs a CUDA device")


@pytest.fixture
def poisoned_empty(monkeypatch):
    """`torch.empty` that fills what it returns: NaN for floats, a wild value for ints."""
    plain = torch.empty

    def empty(*args, **kwargs):
        out = plain(*args, **kwargs)
        return out.fill_(float("nan") if out.dtype.is_floating_point else 12345)

    monkeypatch.setattr(torch, "empty", empty)


def _rel_err(got: torch.Tensor, want: torch.Tensor) -> float:
    return float((got.double() - want.double()).norm() / want.double().norm().clamp_min(1e-30))


def _random_router(rng: random.Random, method: str) -> dict:
    n_group = 1 if method == "greedy" else rng.choice([1, 2, 4, 8])
    per_group = rng.choice([2, 3, 5, 8, 20])
    topk_group = rng.randint(1, n_group)
    return dict(method=method, scoring="sigmoid" if method == "noaux_tc" else rng.choice(["softmax", "sigmoid"]),
                n_group=n_group, num_experts=n_group * per_group, topk_group=topk_group,
                top_k=rng.randint(1, min(topk_group * per_group, 9)), norm=rng.random() < 0.5,
                scaling=rng.choice([1.0, 2.5]), shared=rng.choice([0, 1, 2]))


def check_router_select(case: dict, tokens: int) -> None:
    from deepseek_pd.model.kernels.router_select import router_select

    experts, k, shared = case["num_experts"], case["top_k"], case["shared"]
    logits = torch.randn(tokens, experts, device=DEVICE) * 3
    bias = torch.randn(experts, device=DEVICE) * 0.1 if case["method"] == "noaux_tc" else None
    spec = TopKSpec(k, case["n_group"], case["topk_group"], case["norm"], case["scaling"])
    want_w, want_ids = TOPK_METHODS[case["method"]](SCORING[case["scoring"]](logits), bias, spec)
    want_w = finish_weights(want_w, spec)
    got_w, got_ids = router_select(logits, bias, case["method"], case["scoring"], k, case["n_group"],
                                   case["topk_group"], case["norm"], case["scaling"], shared, experts + 3)
    assert got_w.shape == got_ids.shape == (tokens, k + shared) and got_ids.dtype == torch.int64
    # The routed slots' order is free (torch's top-k is unsorted): compare them sorted by id.
    want_sorted, want_order = want_ids.sort(1)
    got_sorted, got_order = got_ids[:, :k].sort(1)
    assert torch.equal(got_sorted, want_sorted), case
    torch.testing.assert_close(got_w[:, :k].gather(1, got_order), want_w.gather(1, want_order),
                               rtol=1e-5, atol=1e-6)
    shared_ids = torch.arange(experts + 3, experts + 3 + shared, device=DEVICE).expand(tokens, -1)
    assert torch.equal(got_ids[:, k:], shared_ids) and torch.equal(got_w[:, k:], torch.ones_like(got_w[:, k:]))


@pytest.mark.parametrize("method", ["greedy", "group_limited_greedy", "noaux_tc"])
def test_router_select_matches_topk_methods(method, poisoned_empty):
    rng = random.Random()
    for _ in range(3):
        check_router_select(_random_router(rng, method), tokens=rng.randint(1, 9))


def _tied_logits(tokens: int, experts: int, near: bool) -> torch.Tensor:
    """Router logits full of exact ties (a grid of about experts / 2 values: each taken ~2 times, so
    a top-k mixes values above the k-th with ties at it) and, with `near`, of 1-ulp near-ties (a
    third of them nudged up by one fp32 step)."""
    grid = torch.randint(0, max(4, experts // 2), (tokens, experts), device=DEVICE).float() * (6.0 / experts)
    if not near:
        return grid
    return torch.where(torch.rand(tokens, experts, device=DEVICE) < 0.3, torch.nextafter(grid, grid + 1), grid)


def _cuda_topk_order(values: torch.Tensor, k: int) -> torch.Tensor:
    """The ids torch's CUDA top-k (sorted=False) returns, by its rule (aten TensorTopK.cu): the k
    largest with ties to the lower id, written above-the-k-th first in id order, then equal to it."""
    best = torch.sort(values, dim=1, descending=True, stable=True).indices[:, :k]
    picked = values.gather(1, best)
    key = best + (picked == picked[:, -1:]).long() * values.shape[1]
    return best.gather(1, key.argsort(1))


@pytest.mark.parametrize("scoring", ["softmax", "sigmoid"])
def test_router_select_ties_fall_as_torch_topk(scoring, poisoned_empty):
    """Greedy routing (V2-Lite's) on logits full of exact ties: the kernel's ids, in their slot
    order, are those of torch's CUDA top-k rule, and its weights (renormalised slot after slot when
    norm is on) those of `finish_weights` in that order. Best-first slots (the order before) fail."""
    from deepseek_pd.model.kernels.router_select import router_select

    rng = random.Random()
    experts, k, tokens = rng.choice([8, 20, 64]), rng.randint(3, 6), rng.randint(16, 32)
    norm, scaling = rng.random() < 0.5, rng.choice([1.0, 2.5])
    logits = _tied_logits(tokens, experts, near=False)
    scores = SCORING[scoring](logits)
    want_ids = _cuda_topk_order(scores, k)
    want_w = finish_weights(scores.gather(1, want_ids), TopKSpec(k, 1, 1, norm, scaling))
    got_w, got_ids = router_select(logits, None, "greedy", scoring, k, 1, 1, norm, scaling)
    assert torch.equal(got_ids, want_ids)
    torch.testing.assert_close(got_w, want_w, rtol=1e-6, atol=0)


@pytest.mark.gpu
@requires_cuda
@pytest.mark.parametrize("shape", ["v2lite", "v2", "v3"])
def test_router_select_is_torch_bit_for_bit_gpu(shape):
    """On CUDA the fused router returns the torch path's very bits (`DeepseekMoE.select_experts`:
    moe/topk.py, then `finish_weights`): ids in torch's slot order and weights, on logits full of
    exact and 1-ulp near ties, at V2-Lite's, V2's and V3's router shapes."""
    from deepseek_pd.model.kernels.router_select import router_select

    experts, method, n_group, topk_group, k, scoring, norm, scaling = {
        "v2lite": (64, "greedy", 1, 1, 6, "softmax", False, 1.0),
        "v2": (160, "group_limited_greedy", 8, 3, 6, "softmax", False, 16.0),
        "v3": (256, "noaux_tc", 8, 4, 8, "sigmoid", True, 2.5)}[shape]
    spec = TopKSpec(k, n_group, topk_group, norm, scaling)
    for logits in (_tied_logits(300, experts, near=True), torch.randn(300, experts, device=DEVICE)):
        bias = torch.randn(experts, device=DEVICE) * 0.1 if method == "noaux_tc" else None
        want_w, want_ids = TOPK_METHODS[method](SCORING[scoring](logits), bias, spec)
        want_w = finish_weights(want_w, spec)
        got_w, got_ids = router_select(logits, bias, method, scoring, k, n_group, topk_group, norm, scaling)
        assert torch.equal(got_ids, want_ids)
        assert torch.equal(got_w, want_w), (got_w - want_w).abs().max()


def test_router_select_refuses_bad_shapes():
    from deepseek_pd.model.kernels.router_select import router_select

    logits = torch.randn(2, 12, device=DEVICE)
    with pytest.raises(ValueError, match="groups"):
        router_select(logits, None, "noaux_tc", "sigmoid", 2, 5, 1, False, 1.0)
    with pytest.raises(ValueError, match="top_k"):
        router_select(logits, None, "greedy", "softmax", 13, 1, 1, False, 1.0)
    with pytest.raises(ValueError, match="dtype"):
        router_select(logits.double(), None, "greedy", "softmax", 2, 1, 1, False, 1.0)


def check_single_token_moe(experts: int, shared: int, k: int, hidden: int, inter: int, dtype: torch.dtype,
                           tol: float, programs_per_sm: int = 4) -> None:
    from deepseek_pd.model.kernels.moe_single_token import SingleTokenTile, fused_moe_single_token

    w13 = torch.randn(experts + shared, 2 * inter, hidden, device=DEVICE, dtype=dtype) / hidden ** 0.5
    w2 = torch.randn(experts + shared, hidden, inter, device=DEVICE, dtype=dtype) / inter ** 0.5
    x = torch.randn(1, hidden, device=DEVICE, dtype=dtype)
    ids = torch.randperm(experts, device=DEVICE)[:k]
    foreign = torch.rand(k, device=DEVICE) < 0.3  # other EP ranks' experts: -1 or past the last
    outside = torch.tensor([-1, experts + shared + 2], device=DEVICE)[torch.arange(k, device=DEVICE) % 2]
    ids = torch.where(foreign, outside, ids)
    ids = torch.cat([ids, torch.arange(experts, experts + shared, device=DEVICE)])[None]
    weights = torch.cat([torch.rand(k, device=DEVICE), torch.ones(shared, device=DEVICE)])[None]
    want = MOE_BACKENDS.build("torch")(x, ids, weights, w13, w2)
    got = fused_moe_single_token(x, ids, weights, w13, w2, SingleTokenTile(programs_per_sm=programs_per_sm))
    assert got.shape == want.shape and got.dtype == dtype and not torch.isnan(got).any()
    assert _rel_err(got, want) < tol, _rel_err(got, want)


def test_single_token_moe_matches_torch_backend(poisoned_empty):
    rng = random.Random()
    for _ in range(2):
        # programs_per_sm 0: the widest tiles; 4: on the interpreter's 132 "SMs", the narrowest.
        check_single_token_moe(rng.randint(2, 9), rng.choice([0, 1, 2]), rng.randint(1, 2), rng.choice([32, 136]),
                               rng.choice([24, 40]), torch.float32, tol=1e-5, programs_per_sm=rng.choice([0, 4]))
    with pytest.raises(ValueError, match="tokens"):
        from deepseek_pd.model.kernels.moe_single_token import fused_moe_single_token

        w = torch.zeros(2, 8, 4, device=DEVICE)
        fused_moe_single_token(torch.zeros(2, 4, device=DEVICE), torch.zeros(2, 1, dtype=torch.long, device=DEVICE),
                               torch.ones(2, 1, device=DEVICE), w, torch.zeros(2, 4, 4, device=DEVICE))


def _greedy_decode(path: str, prompts: list[list[int]], steps: int, dtype: str, fusions: bool):
    """Prefill `prompts`, then `steps` greedy decode steps (Triton backends, shared experts fused):
    (tokens per step, logits per step, launches per op of the MoE layers in the last step, counted
    by bench/decode_kernel_count.py)."""
    from pdtest.bench_scripts import bench_module
    from deepseek_pd.model.config import ModelConfig
    from deepseek_pd.model.runner import DecodeSeq, ExtendSeq, ModelRunner
    from deepseek_pd.model.runner_config import RunnerConfig

    runner = ModelRunner(RunnerConfig(
        model=path, dtype=dtype, device=DEVICE, attention_backend="triton", moe_backend="triton",
        norm_rope_backend="triton", num_fused_shared_experts=ModelConfig.from_hf(path).n_shared_experts,
        small_batch_fusions=fusions))
    moe_layers = [m for m in runner.model.modules() if isinstance(m, DeepseekMoE)]
    assert moe_layers and all((m._fused_select is not None) == fusions for m in moe_layers)
    assert all((m.experts._single_token is not None) == fusions for m in moe_layers)
    assert all(layer.self_attn.norm_in_rope == fusions for layer in runner.model.layers)
    pool = runner.kv_pool
    pages = [pool.alloc(pool.pages_for_tokens(len(p) + steps)) for p in prompts]
    logits = [runner.extend([ExtendSeq(p, 0, pg) for p, pg in zip(prompts, pages)]).float().cpu()]
    tokens = []
    scopes = bench_module("decode_kernel_count").OpScopes(runner.model, experts_read=1)
    for step in range(steps):
        tokens.append(logits[-1].argmax(-1).tolist())
        with scopes.counting() if step == steps - 1 else contextlib.nullcontext():
            logits.append(runner.decode([DecodeSeq(t, len(p) + step, pg)
                                         for t, p, pg in zip(tokens[-1], prompts, pages)]).float().cpu())
    for pg in pages:
        pool.free(pg)
    moe_ids = {i for i, layer in enumerate(runner.model.layers) if layer.is_moe}
    launches = {op: [scopes.counts[f"L{i}.{op}"].launches for i in sorted(moe_ids)]
                for op in ("select_experts", "experts", "attn_prepare")}
    return tokens, logits, launches


def test_single_token_moe_grid_fills_the_card():
    """Each launch of one token's MoE has >= programs_per_sm x SMs programs (a GEMV's speed is its
    bytes in flight per SM) unless its n-tile is at its floor, and its tiles cover every row; at
    V2-Lite's and V3's shapes on an H100 (132 SMs) both launches reach the target."""
    from deepseek_pd.model.kernels.moe_single_token import SingleTokenTile, plan_launch

    rng = random.Random()
    for _ in range(50):
        tile = SingleTokenTile(programs_per_sm=rng.choice([1, 2, 4, 8]))
        sms, top_k = rng.randint(1, 200), rng.randint(1, 12)
        hidden, inter = rng.randint(1, 8192), rng.randint(1, 4096)
        plan = plan_launch(1, top_k, hidden, inter, sms, tile)
        wanted = tile.programs_per_sm * sms
        gate_up, down = plan.programs
        assert gate_up >= wanted or plan.gate_up_block_n == tile.min_block_n_gate_up
        assert down >= wanted or plan.down_block_n == tile.min_block_n_down
        assert plan.gate_up_grid == (top_k, -(-inter // plan.gate_up_block_n))
        assert plan.down_grid == (1, -(-hidden // plan.down_block_n)) and plan.down_block_s >= top_k
    for top_k, hidden, inter in ((6 + 2, 2048, 1408), (8 + 1, 7168, 2048)):  # V2-Lite, V3 (+ fused shared)
        assert min(plan_launch(1, top_k, hidden, inter, 132).programs) >= 4 * 132


def test_tiny_model_fusions_keep_greedy_tokens(tmp_path):
    """The whole model with the fusions on and off: same greedy tokens, close logits, decoding at
    batch 1 (both fusions) and, on the GPU, at batch 2 (the router's alone). The architecture (V3:
    noaux_tc, V2: its own router) is drawn from the seed, to keep the interpreter's run short."""
    from deepseek_pd.model.checkpoint.tiny import make_tiny_model
    from deepseek_pd.model.config import ModelConfig

    torch.set_num_threads(1)
    arch = random.choice(["v3", "v2"])
    path = str(make_tiny_model(tmp_path / arch, arch=arch, seed=random.randrange(1000)))
    vocab = ModelConfig.from_hf(path).vocab_size
    # fp32 on both: a bf16 rounding of the fused sums could flip a near-tie of the random model's logits.
    steps, dtype = (1 if DEVICE == "cpu" else 8), "float32"
    prompts = [[random.randrange(vocab) for _ in range(random.randint(2, 5))] for _ in range(2)]
    for batch in (prompts[:1], prompts) if HAS_CUDA else (prompts[:1],):
        plain_tokens, plain_logits, plain_launches = _greedy_decode(path, batch, steps, dtype, fusions=False)
        tokens, logits, launches = _greedy_decode(path, batch, steps, dtype, fusions=True)
        assert tokens == plain_tokens
        # The launches the fusions save: the router after its GEMM is one, a one-token MoE two.
        assert set(launches["select_experts"]) == {1} and min(plain_launches["select_experts"]) > 1
        if len(batch) == 1:
            assert set(launches["experts"]) == {2} and min(plain_launches["experts"]) > 2
        # The kv_a norm rides in the rope + cache-write launch.
        assert [n + 1 for n in launches["attn_prepare"]] == plain_launches["attn_prepare"]
        errors = [_rel_err(f, p) for f, p in zip(logits, plain_logits)]
        assert max(errors) < 1e-4, errors


@pytest.mark.gpu
@requires_cuda
@pytest.mark.parametrize("shape", ["v2lite", "v3"])
def test_small_batch_fusions_gpu(shape, poisoned_empty):
    experts, shared, k, hidden, inter = {"v2lite": (64, 2, 6, 2048, 1408), "v3": (64, 1, 8, 7168, 2048)}[shape]
    check_single_token_moe(experts, shared, k, hidden, inter, torch.bfloat16, tol=2e-2)
    check_single_token_moe(experts, shared, k, hidden // 4, inter // 4, torch.float32, tol=1e-4)
    method, n_group, topk_group, scoring = {"v2lite": ("greedy", 1, 1, "softmax"),
                                            "v3": ("noaux_tc", 8, 4, "sigmoid")}[shape]
    case = dict(method=method, scoring=scoring, n_group=n_group, num_experts=experts, topk_group=topk_group,
                top_k=k, norm=shape == "v3", scaling=2.5 if shape == "v3" else 1.0, shared=shared)
    for tokens in (1, 7, 300):
        check_router_select(case, tokens)

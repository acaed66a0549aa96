"""The fused Triton RMSNorm (+ residual) and RoPE + latent-cache write against the torch reference.

Fresh random shapes, strided inputs as the model passes them (splits of a wider projection),
poisoned cache rows; through Triton's interpreter on CPU, or on the GPU (bf16 too).
"""
from __future__ import annotations

import random

import pytest
import torch

from pdtest.triton_env import DEVICE, HAS_CUDA, needs_triton  # noqa: E402 (first: it sets TRITON_INTERPRET)

from deepseek_pd.model.norm_rope import NORM_ROPE_BACKENDS  # noqa: E402

pytestmark = [pytest.mark.timeout(300), needs_triton]
DTYPES = [torch.float32] + ([torch.bfloat16] if HAS_CUDA else [])


def rel_err(out: torch.Tensor, ref: torch.Tensor) -> float:
    assert not torch.isnan(out).any(), "NaN in the output"
    return float((out.double() - ref.double()).norm() / ref.double().norm().clamp_min(1e-30))


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("with_residual", [False, True])
def test_rms_norm_matches_reference(dtype, with_residual):
    tokens, dim = random.randint(1, 50), random.choice([16, 48, 512, 2048])
    x = torch.randn(tokens, dim + 64, dtype=dtype, device=DEVICE)[:, :dim]  # a split view: row stride > dim
    residual = torch.randn(tokens, dim, dtype=dtype, device=DEVICE) if with_residual else None
    weight = (1 + 0.1 * torch.randn(dim, device=DEVICE)).to(dtype)
    eps = 1e-6
    want = NORM_ROPE_BACKENDS.build("torch").rms_norm(x, weight, eps, residual)
    got = NORM_ROPE_BACKENDS.build("triton").rms_norm(x, weight, eps, residual)
    tol = 1e-6 if dtype == torch.float32 else 1e-2
    assert rel_err(got[0], want[0]) < tol and torch.equal(got[1], want[1])


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("interleaved", [True, False])
@pytest.mark.parametrize("norm", [False, True])
def test_rope_and_cache_write_matches_reference(dtype, interleaved, norm):
    """`rope_and_write`, and with `norm` `norm_rope_and_write` (the kv_a norm in the same launch,
    whose latent must be bit for bit the Triton norm's)."""
    from deepseek_pd.model.config import ModelConfig
    from deepseek_pd.model.checkpoint.model_dir import resolve_model_dir
    from deepseek_pd.model.rope import RotaryEmbedding
    from dataclasses import replace

    config = replace(ModelConfig.from_hf(resolve_model_dir("tiny") / "config.json"), rope_interleave=interleaved)
    rotary = RotaryEmbedding(config).to(DEVICE)
    tokens, heads, d = random.randint(1, 30), random.choice([1, 3, 16]), config.qk_rope_head_dim
    rank = random.choice([24, 512]) if norm else 24
    q = torch.randn(tokens, heads, 20 + d, dtype=dtype, device=DEVICE)
    latent = torch.randn(tokens, rank + d, dtype=dtype, device=DEVICE)
    q_pe, c_kv, k_pe = q[..., 20:], latent[:, :rank], latent[:, rank:]
    positions = torch.randint(0, 4000, (tokens,), device=DEVICE)
    slots = torch.randperm(tokens + 10, device=DEVICE)[:tokens]
    caches = [torch.full((tokens + 10, rank + d), float("nan"), dtype=dtype, device=DEVICE) for _ in range(2)]
    torch_ops, triton_ops = NORM_ROPE_BACKENDS.build("torch"), NORM_ROPE_BACKENDS.build("triton")
    tol = 1e-5 if dtype == torch.float32 else 1e-2
    if norm:
        weight, eps = (1 + 0.1 * torch.randn(rank, device=DEVICE)).to(dtype), 1e-6
        want = torch_ops.norm_rope_and_write(rotary, positions, q_pe, k_pe, c_kv, weight, eps, caches[0], slots)
        got = triton_ops.norm_rope_and_write(rotary, positions, q_pe, k_pe, c_kv, weight, eps, caches[1], slots)
        assert rel_err(got[2], want[2]) < tol
        assert torch.equal(got[2], triton_ops.rms_norm(c_kv, weight, eps, None)[0])
    else:
        want = torch_ops.rope_and_write(rotary, positions, q_pe, k_pe, c_kv, caches[0], slots)
        got = triton_ops.rope_and_write(rotary, positions, q_pe, k_pe, c_kv, caches[1], slots)
    assert rel_err(got[0], want[0]) < tol and rel_err(got[1], want[1]) < tol
    assert rel_err(caches[1][slots], caches[0][slots]) < tol
    untouched = torch.ones(tokens + 10, dtype=torch.bool, device=DEVICE)
    untouched[slots] = False
    assert torch.isnan(caches[1][untouched]).all()  # nothing written outside the slots


def test_tiny_model_with_triton_norm_rope_matches_torch(tmp_path):
    from deepseek_pd.model.runner import DecodeSeq, ExtendSeq, ModelRunner
    from deepseek_pd.model.runner_config import RunnerConfig
    from deepseek_pd.model.checkpoint.tiny import make_tiny_model

    path = str(make_tiny_model(tmp_path / "v2", arch=random.choice(["v2", "v3"]), seed=random.randrange(1000)))
    prompt = [random.randrange(200) for _ in range(random.randint(4, 30))]
    results = {}
    for backend in ("torch", "triton"):
        runner = ModelRunner(RunnerConfig(model=path, device=DEVICE, dtype="float32", attention_backend="torch",
                                          moe_backend="torch", norm_rope_backend=backend))
        pages = runner.kv_pool.alloc(runner.kv_pool.pages_for_tokens(len(prompt) + 1))
        first = runner.extend([ExtendSeq(prompt, 0, pages)])
        second = runner.decode([DecodeSeq(prompt[0], len(prompt), pages)])
        results[backend] = torch.cat([first, second]).cpu()
    assert rel_err(results["triton"], results["torch"]) < 1e-5

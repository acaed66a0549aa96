"""MLA prefill without the q/k concatenation: the flash kernel reads the no-rope and rope parts
where they are (`RopeSplit`; the keys' rope part one row for all heads), bit for bit what it
computes from the concatenated tensors (the path before), for the causal and the prefix (cross)
attention, and through a whole model's prefill. On the CPU through Triton's interpreter."""
from __future__ import annotations

import random

import pytest
import torch

from pdtest.triton_env import DEVICE, needs_triton  # noqa: E402 (first: it sets TRITON_INTERPRET)

from deepseek_pd.model.attention import ATTENTION_BACKENDS  # noqa: E402
from deepseek_pd.model.attention.backend import RopeSplit  # noqa: E402
from deepseek_pd.model.attention.torch_backend import TorchAttentionBackend  # noqa: E402


def _offsets(lengths: list[int]) -> tuple[int, ...]:
    out = [0]
    for n in lengths:
        out.append(out[-1] + n)
    return tuple(out)


def _split_q(tokens: int, heads: int, nope: int, rope: int, dtype: torch.dtype) -> RopeSplit:
    """As MLA has it: views of one q_b_proj output `[T, H, nope + rope]` (strided rows)."""
    q = torch.randn(tokens, heads, nope + rope, dtype=dtype, device=DEVICE)
    q_nope, q_pe = q.split([nope, rope], dim=-1)
    return RopeSplit(q_nope, q_pe)


def _split_k(tokens: int, heads: int, nope: int, rope: int, dtype: torch.dtype) -> RopeSplit:
    """As MLA has it: per-head k_nope, and k_pe `[S, rope]` a column slice of the latent."""
    latent = torch.randn(tokens, 24 + rope, dtype=dtype, device=DEVICE)
    return RopeSplit(torch.randn(tokens, heads, nope, dtype=dtype, device=DEVICE), latent[:, 24:])


@needs_triton
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("nope,rope", [(32, 16), (128, 64), (16, 16)])
def test_split_q_and_k_are_bit_for_bit_the_concatenated_ones(dtype, nope, rope):
    heads, dv = random.randint(1, 3), random.choice([16, 24, 32])
    lengths = [random.randint(1, 40) for _ in range(random.randint(1, 3))]
    prefixes = [random.choice([0, random.randint(1, 50)]) for _ in lengths]
    qo, kvo = _offsets(lengths), _offsets(prefixes)
    q = _split_q(qo[-1], heads, nope, rope, dtype)
    k, pk = _split_k(qo[-1], heads, nope, rope, dtype), _split_k(kvo[-1], heads, nope, rope, dtype)
    v = torch.randn(qo[-1], heads, dv, dtype=dtype, device=DEVICE)
    pv = torch.randn(kvo[-1], heads, dv, dtype=dtype, device=DEVICE)
    scale = (nope + rope) ** -0.5
    backend = ATTENTION_BACKENDS.build("triton")
    for split, whole in ((backend.mha_causal(q, k, v, qo, scale), backend.mha_causal(q.joined(), k.joined(), v, qo,
                                                                                     scale)),
                         (backend.mha_cross(q, pk, pv, qo, kvo, scale),
                          backend.mha_cross(q.joined(), pk.joined(), pv, qo, kvo, scale))):
        assert torch.equal(split[0], whole[0]) and torch.equal(split[1], whole[1])
    # And the reference joins them: the same result as from the tensors.
    reference = TorchAttentionBackend()
    ref, ref_whole = reference.mha_causal(q, k, v, qo, scale), reference.mha_causal(q.joined(), k.joined(), v, qo, scale)
    assert torch.equal(ref[0], ref_whole[0]) and torch.equal(ref[1], ref_whole[1])


def test_rope_split_joins_as_mla_concatenated():
    q = _split_q(5, 3, 32, 16, torch.float32)
    assert torch.equal(q.joined(), torch.cat([q.nope, q.rope], dim=-1))
    k = _split_k(5, 3, 32, 16, torch.float32)
    assert torch.equal(k.joined(), torch.cat([k.nope, k.rope.unsqueeze(1).expand(-1, 3, -1)], dim=-1))


@needs_triton
def test_kernel_refuses_rope_parts_that_do_not_fit():
    from deepseek_pd.model.kernels.flash_prefill import flash_attention, rope_split_fits

    assert rope_split_fits(128, 64) and rope_split_fits(32, 16) and not rope_split_fits(24, 8)
    q = torch.randn(4, 2, 24, device=DEVICE)
    offsets = torch.tensor([0, 4], dtype=torch.int32, device=DEVICE)
    with pytest.raises(ValueError, match="power-of-two part"):
        flash_attention(q, q, q, offsets, offsets, 4, 0.1, True, q_rope=torch.randn(4, 2, 8, device=DEVICE),
                        k_rope=torch.randn(4, 8, device=DEVICE))
    with pytest.raises(ValueError, match="both rope parts"):
        flash_attention(q, q, q, offsets, offsets, 4, 0.1, True, q_rope=torch.randn(4, 2, 8, device=DEVICE))
    # A width whose no-rope part is not the power-of-two part: the backend joins them (and agrees).
    backend = ATTENTION_BACKENDS.build("triton")
    q2, k2 = RopeSplit(q, torch.randn(4, 2, 8, device=DEVICE)), RopeSplit(q, torch.randn(4, 8, device=DEVICE))
    v = torch.randn(4, 2, 16, device=DEVICE)
    got, want = backend.mha_causal(q2, k2, v, (0, 4), 0.1), backend.mha_causal(q2.joined(), k2.joined(), v, (0, 4), 0.1)
    assert torch.equal(got[0], want[0])


@needs_triton
def test_model_prefill_without_the_concat_is_bit_for_bit_the_concatenated_path(tmp_path, monkeypatch):
    """A tiny model's prefill and its continuation over a cached prefix (MHA, then MHA_CHUNKED_KV),
    Triton attention: the logits with the parts read apart equal those with them joined first."""
    from deepseek_pd.model.attention import triton_backend
    from deepseek_pd.model.checkpoint.tiny import make_tiny_model
    from deepseek_pd.model.runner import ExtendSeq, ModelRunner
    from deepseek_pd.model.runner_config import RunnerConfig

    directory = make_tiny_model(tmp_path / "m", arch=random.choice(["v2", "v3"]), seed=random.randint(0, 10_000))
    prompt = [random.randrange(1, 100) for _ in range(random.randint(20, 40))]
    cut = random.randint(8, len(prompt) - 4)

    def run() -> list[torch.Tensor]:
        runner = ModelRunner(RunnerConfig(model=str(directory), device=DEVICE, num_pages=16, attention_backend="triton",
                                          attention_method="mha_chunked_kv", mha_chunked_kv_threshold=0))
        size = runner.config.page_size
        pages = list(range(-(-len(prompt) // size)))
        return [runner.extend([ExtendSeq(prompt[:cut], 0, pages)]), runner.extend([ExtendSeq(prompt[cut:], cut, pages)])]

    split = run()
    monkeypatch.setattr(triton_backend.TritonAttentionBackend, "_qk",
                        lambda self, q, k: (triton_backend._unit_stride(q.joined()),
                                            triton_backend._unit_stride(k.joined()), {}))
    joined = run()
    for a, b in zip(split, joined):
        assert torch.equal(a, b)

"""The "flashinfer" attention backend: FlashInfer's MLA decode against the torch reference.

- CPU: the backend is a clear UserError where FlashInfer or a Hopper GPU is missing, and the route
  table sends only the shapes it names to FlashInfer.
- GPU (marker `gpu`, needs FlashInfer on a Hopper card): the backend's decode against the torch
  backend at V2-Lite and V3 head counts, page sizes 1 and 64, ragged lengths, with the query views
  the MLA layer passes; the kernel writes into an output poisoned with NaN, so an unwritten row fails.
"""
from __future__ import annotations

import random

import pytest
import torch

from deepseek_pd.errors import UserError
from deepseek_pd.model.attention import ATTENTION_BACKENDS
from deepseek_pd.model.attention.flashinfer_backend import MLADecodeRoute
from deepseek_pd.model.attention.torch_backend import TorchAttentionBackend
from deepseek_pd.model.forward_batch import ForwardBatch, ForwardMode
from deepseek_pd.model.kernels.flashinfer_mla import flashinfer_mla_available
from deepseek_pd.model.kv_pool import KVPool

requires_flashinfer = pytest.mark.skipif(not flashinfer_mla_available(),
                                         reason="needs FlashInfer and a Hopper (sm90) GPU")


def rel_err(out: torch.Tensor, ref: torch.Tensor) -> float:
    return float((out.double() - ref.double()).norm() / ref.double().norm().clamp_min(1e-30))


@pytest.mark.skipif(flashinfer_mla_available(), reason="FlashInfer runs here")
def test_backend_is_a_user_error_without_flashinfer():
    with pytest.raises(UserError, match="flashinfer"):
        ATTENTION_BACKENDS.build("flashinfer")


def test_route_sends_only_large_many_head_batches_to_flashinfer():
    route = MLADecodeRoute(many_heads=64, min_batch_many_heads=8, min_batch_few_heads=200)
    for _ in range(200):
        heads, batch = random.choice([1, 8, 16, 32, 64, 128]), random.randint(1, 512)
        want = batch >= (8 if heads >= 64 else 200)
        assert route.uses_flashinfer(heads, batch) is want, (heads, batch)


def decode_batch(lengths: list[int], page_size: int, dtype: torch.dtype) -> tuple[ForwardBatch, torch.Tensor]:
    """A decode batch over pages drawn at random from a pool (scattered, as a busy pool is)."""
    need = [-(-n // page_size) for n in lengths]
    pool = KVPool(1, sum(need) + 4, page_size, 576, dtype=dtype, device="cuda")
    order = torch.randperm(pool.num_pages).tolist()
    pages, start = [], 0
    for n in need:
        pages.append(order[start:start + n])
        start += n
    pool.buffers[0].copy_(torch.randn(pool.buffers[0].shape, dtype=dtype, device="cuda"))
    batch = ForwardBatch.build(ForwardMode.DECODE, [[0]] * len(lengths), [n - 1 for n in lengths], pages, pool,
                               vocab_size=1, device="cuda")
    return batch, pool.buffers[0]


@pytest.mark.gpu
@requires_flashinfer
@pytest.mark.parametrize("heads", [16, 128])
@pytest.mark.parametrize("batch_size", [1, 9, 64])
@pytest.mark.parametrize("page_size", [1, 64])
def test_flashinfer_mla_decode_matches_torch(heads, batch_size, page_size):
    from deepseek_pd.model.kernels.flashinfer_mla import plan_decode

    lengths = [random.randint(1, 3000) for _ in range(batch_size)]
    batch, cache = decode_batch(lengths, page_size, torch.bfloat16)
    # The views the MLA layer passes: q_latent from a transposed bmm, q_pe a split of q.
    q_latent = torch.randn(heads, batch_size, 512, dtype=torch.bfloat16, device="cuda").transpose(0, 1)
    q_pe = torch.randn(batch_size, heads, 192, dtype=torch.bfloat16, device="cuda")[..., 128:]
    scale = 192 ** -0.5
    want = TorchAttentionBackend().mla_decode(q_latent, q_pe, cache, batch, 512, scale)

    # Pages from the host lists, and compacted from the padded device table: the same plan.
    for lists in (batch.page_lists, ()):
        plan = plan_decode(batch.page_table, batch.seq_lens, heads, 512, 64, page_size, scale, torch.bfloat16,
                           page_lists=lists)
        out = torch.full((batch_size, heads, 512), float("nan"), dtype=torch.bfloat16, device="cuda")
        got = plan.run(q_latent, q_pe, cache, out=out)
        assert got.data_ptr() == out.data_ptr() and not torch.isnan(got).any()
        assert rel_err(got, want) < 2e-2, rel_err(got, want)
    # The plan is reused by every layer of the batch: a second layer's cache, same plan.
    cache2 = torch.randn_like(cache)
    want2 = TorchAttentionBackend().mla_decode(q_latent, q_pe, cache2, batch, 512, scale)
    assert rel_err(plan.run(q_latent, q_pe, cache2), want2) < 2e-2

    # Through the backend, whichever kernel the route picks for this shape.
    backend = ATTENTION_BACKENDS.build("flashinfer", MLADecodeRoute(min_batch_many_heads=1, min_batch_few_heads=1))
    assert rel_err(backend.mla_decode(q_latent, q_pe, cache, batch, 512, scale), want) < 2e-2
    assert any(k[0] == "flashinfer_mla_plan" for k in batch.derived if isinstance(k, tuple))


@pytest.mark.gpu
@requires_flashinfer
def test_flashinfer_plan_refuses_what_it_cannot_run():
    from deepseek_pd.model.kernels.flashinfer_mla import plan_decode

    batch, cache = decode_batch([100, 200], 64, torch.bfloat16)
    with pytest.raises(ValueError, match="widths"):
        plan_decode(batch.page_table, batch.seq_lens, 16, 256, 64, 64, 0.1, torch.bfloat16)
    with pytest.raises(ValueError, match="bf16"):
        plan_decode(batch.page_table, batch.seq_lens, 16, 512, 64, 64, 0.1, torch.float32)
    with pytest.raises(ValueError, match="do not fit"):
        plan_decode(batch.page_table, (100, 64 * 64), 16, 512, 64, 64, 0.1, torch.bfloat16)
    plan = plan_decode(batch.page_table, batch.seq_lens, 16, 512, 64, 64, 0.1, torch.bfloat16)
    with pytest.raises(ValueError, match="planned for"):
        plan.run(torch.zeros(2, 8, 512, dtype=torch.bfloat16, device="cuda"),
                 torch.zeros(2, 8, 64, dtype=torch.bfloat16, device="cuda"), cache)

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
from deepseek_pd.model.kernels.flashinfer_mla import flashinfer_mla_available
from pdtest.mla_decode_cases import decode_batch, graph_against_eager, rel_err

requires_flashinfer = pytest.mark.skipif(not flashinfer_mla_available(),
                                         reason="needs FlashInfer and a Hopper (sm90) GPU")


@pytest.mark.skipif(flashinfer_mla_available(), reason="FlashInfer runs here")
def test_backend_is_a_user_error_without_flashinfer():
    with pytest.raises(UserError, match="flashinfer"):
        ATTENTION_BACKENDS.build("flashinfer")


def test_route_sends_only_large_many_head_batches_to_flashinfer():
    route = MLADecodeRoute(many_heads=64, min_batch_many_heads=8, min_batch_few_heads=200)
    for _ in range(200):
        heads, batch = random.choice([1, 8, 16, 32, 64, 128]), random.randint(1, 512)
        want = batch >= (8 if heads >= 64 else 200)
        assert route.uses_library(heads, batch) is want, (heads, batch)


def test_csr_pages_takes_exactly_the_pages_each_length_needs():
    from deepseek_pd.model.kernels.flashinfer_mla import csr_pages

    rng = random.Random()
    for _ in range(100):
        page_size = rng.choice([1, 4, 16, 64])
        lengths = [rng.randint(1, 300) for _ in range(rng.randint(1, 9))]
        lists = [[rng.randrange(1000) for _ in range(-(-n // page_size) + rng.randint(0, 3))] for n in lengths]
        indptr, indices = csr_pages(lengths, page_size, lists)
        assert indptr[0] == 0 and len(indptr) == len(lengths) + 1
        for i, (n, pages) in enumerate(zip(lengths, lists)):
            assert indices[indptr[i]:indptr[i + 1]] == pages[:-(-n // page_size)]
    with pytest.raises(ValueError, match="needs 2 pages"):
        csr_pages([5], 4, [[3]])
    with pytest.raises(ValueError, match="page lists"):
        csr_pages([5, 1], 4, [[3, 4]])


def test_wrapper_pool_lends_a_wrapper_only_while_no_live_plan_holds_it():
    """Eager batches reuse wrappers: a wrapper comes back when its plan is dropped, never while the
    plan lives (two-batch overlap keeps two plans alive at once); as many are built as plans were
    alive at the busiest moment."""
    from deepseek_pd.model.kernels.flashinfer_mla import WrapperPool

    class Plan:  # what holds a wrapper: any object that can be garbage
        pass

    pool = WrapperPool(object)
    live: dict[int, tuple[Plan, object]] = {}
    peak = 0
    for step in range(300):
        while live and random.random() < 0.5:
            live.pop(random.choice(list(live)))  # the last reference: CPython runs its finalizer now
        wrapper = pool.take()
        assert all(wrapper is not held for _, held in live.values()), "a live plan's wrapper was lent again"
        plan = Plan()
        pool.lend(plan, wrapper)
        live[step] = (plan, wrapper)
        peak = max(peak, len(live))
        # `live` alone holds the plan: a local kept it alive after the next step popped it, and the
        # next take() built a wrapper the pool could have lent (seed 3057777817: 26 built, peak 25)
        del plan
    assert pool.built == peak


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
    # Later eager batches (other lengths) plan the same pooled wrapper once the last batch is dropped.
    del batch
    for _ in range(3):
        lengths = [random.randint(1, 3000) for _ in range(batch_size)]
        batch, cache = decode_batch(lengths, page_size, torch.bfloat16)
        want = TorchAttentionBackend().mla_decode(q_latent, q_pe, cache, batch, 512, scale)
        assert rel_err(backend.mla_decode(q_latent, q_pe, cache, batch, 512, scale), want) < 2e-2
        del batch
    assert backend._eager_wrappers[cache.device].built == 1


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


@pytest.mark.gpu
@requires_flashinfer
def test_flashinfer_decode_in_cuda_graphs_equals_eager(tmp_path):
    """A V3-width model (512 + 64 latent, 128 heads, 2 layers, random weights): decode replayed
    from CUDA graphs with FlashInfer's MLA (re-planned before each replay) against the same
    runner's eager decode, over batches of mixed lengths at several bucket sizes."""
    # buckets 16 and 32: FlashInfer at 128 heads (route: >= 4)
    worst = graph_against_eager(tmp_path, "flashinfer", [9, 16, 32, 13, 31, 24])
    print(f"flashinfer graph vs eager: worst row rel err {worst:.2e}")
    assert worst < 2e-2, worst

"""The extend (prefill-with-prefix) path of the Triton attention backend against the torch reference.

- `mla_extend` (absorbed MLA over the paged cache for new tokens after a cached prefix) and
  `merge_states` (the MHA_CHUNKED_KV merge) no longer fall back to torch: checked here on fresh
  random batches through Triton's interpreter on CPU, or on the GPU.
- `prefix_chunks` (vectorised) against the per-position definition, on CPU always.
- A tiny model whose extends are forced through MLA, Triton vs torch backends.
"""
from __future__ import annotations

import random

import pytest
import torch

from pdtest.triton_env import DEVICE, HAS_CUDA, needs_triton  # noqa: E402 (first: it sets TRITON_INTERPRET)

from deepseek_pd.model.attention import ATTENTION_BACKENDS  # noqa: E402
from deepseek_pd.model.attention.mla import prefix_chunks  # noqa: E402
from deepseek_pd.model.attention.torch_backend import TorchAttentionBackend  # noqa: E402
from deepseek_pd.model.forward_batch import ForwardBatch, ForwardMode  # noqa: E402
from deepseek_pd.model.kv.pool import KVPool  # noqa: E402

pytestmark = pytest.mark.timeout(300)


def rel_err(out: torch.Tensor, ref: torch.Tensor) -> float:
    assert not torch.isnan(out).any(), "NaN in the output"
    return float((out.double() - ref.double()).norm() / ref.double().norm().clamp_min(1e-30))


def extend_batch(prefixes: list[int], news: list[int], page_size: int, kv_dim: int, dtype: torch.dtype):
    """An EXTEND batch over shuffled pages of a one-layer pool full of random latents."""
    need = [-(-(p + n) // page_size) for p, n in zip(prefixes, news)]
    pool = KVPool(1, sum(need) + 2, page_size, kv_dim, dtype=dtype, device=DEVICE)
    perm = torch.randperm(pool.num_pages).tolist()
    pages, start = [], 0
    for n in need:
        pages.append(perm[start:start + n])
        start += n
    pool.buffers[0].copy_(torch.randn(pool.buffers[0].shape, dtype=dtype, device=DEVICE))
    batch = ForwardBatch.build(ForwardMode.EXTEND, [[0] * n for n in news], prefixes, pages, pool,
                               vocab_size=1, device=DEVICE)
    return batch, pool.buffers[0]


@needs_triton
@pytest.mark.parametrize("dtype", [torch.float32] + ([torch.bfloat16] if HAS_CUDA else []))
def test_mla_extend_matches_torch_reference(dtype):
    rng = random.Random()
    seqs = rng.randint(1, 3)
    heads = rng.choice([2, 16] if HAS_CUDA else [2, 3])
    rank, rope = (512, 64) if HAS_CUDA else (32, 8)
    prefixes = [rng.choice([0, rng.randint(1, 90)]) for _ in range(seqs)]
    news = [rng.randint(1, 40) for _ in range(seqs)]
    batch, cache = extend_batch(prefixes, news, rng.choice([4, 16]), rank + rope, dtype)
    tokens = sum(news)
    q_latent = torch.randn(heads, tokens, rank, dtype=dtype, device=DEVICE).transpose(0, 1)  # as the bmm gives it
    q_pe = torch.randn(tokens, heads, rope + 8, dtype=dtype, device=DEVICE)[..., 8:]
    scale = (rank + rope) ** -0.5
    want = TorchAttentionBackend().mla_extend(q_latent, q_pe, cache, batch, rank, scale)
    got = ATTENTION_BACKENDS.build("triton").mla_extend(q_latent, q_pe, cache, batch, rank, scale)
    assert got.shape == want.shape and got.dtype == dtype
    assert rel_err(got, want) < (1e-5 if dtype == torch.float32 else 2e-2)


@needs_triton
def test_merge_states_matches_torch_reference():
    tokens, heads, dim = random.randint(1, 30), random.randint(1, 4), random.choice([16, 40, 128])
    out_a, out_b = (torch.randn(tokens, heads, dim, device=DEVICE) for _ in range(2))
    lse_a, lse_b = (torch.randn(tokens, heads, device=DEVICE) * 3 for _ in range(2))
    lse_a[0, 0] = float("-inf")  # one side saw no key
    lse_b[-1, -1] = float("-inf")
    lse_a[tokens // 2, 0] = lse_b[tokens // 2, 0] = float("-inf")  # neither did
    out_a[tokens // 2, 0] = out_b[tokens // 2, 0] = 0.0
    want = TorchAttentionBackend().merge_states(out_a, lse_a, out_b, lse_b)
    got = ATTENTION_BACKENDS.build("triton").merge_states(out_a, lse_a, out_b, lse_b)
    assert rel_err(got[0], want[0]) < 1e-5
    assert torch.equal(torch.isinf(got[1]), torch.isinf(want[1]))
    finite = ~torch.isinf(want[1])
    assert float((got[1] - want[1])[finite].abs().max()) < 1e-5


def test_prefix_chunks_match_the_per_position_definition():
    rng = random.Random()
    page_size = rng.choice([1, 4, 16])
    prefixes = [rng.choice([0, rng.randint(1, 100)]) for _ in range(rng.randint(1, 4))]
    news = [rng.randint(1, 5) for _ in prefixes]
    batch, _ = extend_batch(prefixes, news, page_size, 8, torch.float32)
    chunk = rng.randint(1, 40)
    got = prefix_chunks(batch, chunk)
    assert len(got) == -(-max(prefixes) // chunk)
    for j, part in enumerate(got):
        slots, offsets = [], [0]
        for pages, prefix in zip(batch.page_lists, prefixes):
            for pos in range(j * chunk, min((j + 1) * chunk, prefix)):
                slots.append(pages[pos // page_size] * page_size + pos % page_size)
            offsets.append(len(slots))
        assert part.slots.tolist() == slots and part.kv_offsets == tuple(offsets)


@needs_triton
@pytest.mark.parametrize("method", ["mla", "mha_chunked_kv"])
def test_tiny_model_extend_over_a_prefix_triton_vs_torch(tmp_path, method):
    """Prompt, then its continuation over the cached prefix through `method`, Triton vs torch attention."""
    from deepseek_pd.model.runner import ExtendSeq, ModelRunner
    from deepseek_pd.model.runner_config import RunnerConfig
    from deepseek_pd.model.checkpoint.tiny import make_tiny_model

    path = str(make_tiny_model(tmp_path / "v3", arch="v3", seed=random.randrange(1000)))
    prompts = [[random.randrange(200) for _ in range(random.randint(6, 40))] for _ in range(2)]
    results = {}
    for backend in ("torch", "triton"):
        runner = ModelRunner(RunnerConfig(model=path, device=DEVICE, dtype="float32", attention_backend=backend,
                                          moe_backend="torch", attention_method=method, prefix_chunk_size=5))
        pool = runner.kv_pool
        pages = [pool.alloc(pool.pages_for_tokens(len(p))) for p in prompts]
        cut = [len(p) // 2 for p in prompts]
        runner.extend([ExtendSeq(p[:c], 0, pg) for p, c, pg in zip(prompts, cut, pages)])
        results[backend] = runner.extend([ExtendSeq(p[c:], c, pg) for p, c, pg in zip(prompts, cut, pages)]).cpu()
    assert rel_err(results["triton"], results["torch"]) < 1e-4


@needs_triton
def test_one_offsets_upload_serves_every_layer_of_a_batch(monkeypatch):
    """Every layer owns a backend, and each passes its batch's one `qo_offsets` tuple: the offsets
    go up once per batch, not once per layer, and a new batch (a new tuple, even of equal values)
    gets its own upload."""
    from deepseek_pd.model.attention import triton_backend

    uploads: list[tuple[int, ...]] = []
    real = triton_backend.upload

    def counting(host, device):
        uploads.append(tuple(host.tolist()))
        return real(host, device)

    monkeypatch.setattr(triton_backend, "upload", counting)
    monkeypatch.setattr(triton_backend.TritonAttentionBackend, "_shared_offsets", None)
    layers = [ATTENTION_BACKENDS.build("triton") for _ in range(random.randint(2, 5))]
    lengths = [random.randint(1, 9) for _ in range(random.randint(1, 4))]
    offsets = tuple([0, *torch.tensor(lengths).cumsum(0).tolist()])
    for backend in layers:
        got = backend._device_offsets(offsets, torch.device(DEVICE))
        assert got.tolist() == list(offsets)
    assert uploads == [offsets]
    again = tuple(list(offsets))  # equal values, another batch's tuple
    assert again is not offsets
    for backend in layers:
        assert backend._device_offsets(again, torch.device(DEVICE)).tolist() == list(offsets)
    assert uploads == [offsets, offsets]

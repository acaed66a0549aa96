"""The "flashmla" attention backend: FlashMLA's sm90 dense MLA decode against the torch reference.

- CPU: where FlashMLA is missing the backend is a clear UserError, and so is a `RunnerConfig`
  naming it (no CUDA, not installed, pages other than 64); the loader imports a package from the
  folder DEEPSEEK_PD_FLASHMLA_DIR names, and says why when there is none; the decode call refuses
  tables and lengths it cannot take before touching the library.
- GPU (marker `gpu`, needs a built FlashMLA on a Hopper card: bench/flashmla_build.sh): the decode
  against the torch backend at 128 and 16 heads, batches 1, 8 and 128, ragged lengths (most not a
  multiple of 64), with the query views the MLA layer passes; the caching allocator's free memory
  and the pages no sequence owns are poisoned with NaN, so an unwritten output row or a stray read
  fails; one call's metadata serves a second layer; a CUDA graph of the call replays at new
  lengths; a V3-width runner's graph replays equal its eager decode.
"""
from __future__ import annotations

import random
import sys

import pytest
import torch

from deepseek_pd.errors import UserError
from deepseek_pd.model import runner_config
from deepseek_pd.model.attention import ATTENTION_BACKENDS
from deepseek_pd.model.attention.torch_backend import TorchAttentionBackend
from deepseek_pd.model.kernels import flashmla_mla
from deepseek_pd.model.kernels.flashmla_mla import MLADecodeCall, flashmla_available
from deepseek_pd.model.kernels.mla_decode_route import AttentionHost, MLADecodeRoute
from deepseek_pd.model.runner_config import RunnerConfig

requires_flashmla = pytest.mark.skipif(not flashmla_available(),
                                       reason="needs FlashMLA built (bench/flashmla_build.sh) and a Hopper (sm90) GPU")


@pytest.mark.skipif(flashmla_available(), reason="FlashMLA runs here")
def test_backend_is_a_user_error_without_flashmla():
    with pytest.raises(UserError, match="attention backend 'flashmla' cannot run here"):
        ATTENTION_BACKENDS.build("flashmla")


def test_runner_config_refuses_flashmla_where_it_cannot_run(monkeypatch):
    with pytest.raises(UserError, match="needs a CUDA device"):
        RunnerConfig(device="cpu", attention_backend="flashmla")
    blocker = f"not installed here ({random.randrange(1 << 20)})"
    monkeypatch.setattr(runner_config, "attention_host",
                        lambda device: AttentionHost(True, True, None, flashmla_blocker=blocker))
    with pytest.raises(UserError, match=f"'flashmla'.*{blocker.replace('(', '.').replace(')', '.')}"):
        RunnerConfig(device="cuda", page_size=64, attention_backend="flashmla")
    monkeypatch.setattr(runner_config, "attention_host", lambda device: AttentionHost(True, True, None, None))
    page_size = random.choice([1, 16, 32, 128])
    with pytest.raises(UserError, match=f"needs page_size 64.*got {page_size}"):
        RunnerConfig(device="cuda", page_size=page_size, attention_backend="flashmla")
    assert RunnerConfig(device="cuda", page_size=64, attention_backend="flashmla").attention_backend == "flashmla"
    with pytest.raises(UserError, match="attention_backend.*flashmla"):  # a typo lists the names, flashmla among them
        RunnerConfig(device="cuda", page_size=64, attention_backend="flash_mla")


@pytest.fixture
def no_flash_mla(monkeypatch):
    """`flash_mla` neither installed nor imported: the loader's own paths are what is tested."""
    monkeypatch.setattr(sys, "path", list(sys.path))  # the loader appends the carried folder
    monkeypatch.delitem(sys.modules, "flash_mla", raising=False)
    if flashmla_mla.importlib.util.find_spec("flash_mla") is not None:
        pytest.skip("flash_mla is installed here")


def test_loader_says_why_without_a_package(no_flash_mla, monkeypatch, tmp_path):
    monkeypatch.delenv("DEEPSEEK_PD_FLASHMLA_DIR", raising=False)
    assert "not installed" in flashmla_mla.flashmla_blocker()
    with pytest.raises(ImportError, match="not installed.*flashmla_build.sh"):
        flashmla_mla.flash_mla_module()
    monkeypatch.setenv("DEEPSEEK_PD_FLASHMLA_DIR", str(tmp_path))  # a folder with no package in it
    assert f"DEEPSEEK_PD_FLASHMLA_DIR={tmp_path} holds no flash_mla package" in flashmla_mla.flashmla_blocker()
    with pytest.raises(ImportError, match="holds no flash_mla package"):
        flashmla_mla.flash_mla_module()


def test_loader_imports_the_carried_package(no_flash_mla, monkeypatch, tmp_path):
    """A built package carried into a folder (what bench/flashmla_build.sh leaves under $OUT) is
    what the loader imports when none is installed."""
    mark = random.randrange(1 << 30)
    (tmp_path / "flash_mla").mkdir()
    (tmp_path / "flash_mla" / "__init__.py").write_text(f"CARRIED = {mark}\n")
    monkeypatch.setenv("DEEPSEEK_PD_FLASHMLA_DIR", str(tmp_path))
    assert flashmla_mla.flashmla_blocker() is None
    assert flashmla_mla.flash_mla_module().CARRIED == mark


def test_decode_call_refuses_what_flashmla_cannot_take():
    table, lengths = torch.zeros(3, 2, dtype=torch.int32), torch.ones(3, dtype=torch.int32)
    with pytest.raises(ValueError, match="int32"):
        MLADecodeCall(table.long(), lengths, 16, 0.1)
    with pytest.raises(ValueError, match=r"lengths \[B\]"):
        MLADecodeCall(table, lengths[:2], 16, 0.1)
    with pytest.raises(ValueError, match="num_heads"):
        MLADecodeCall(table, lengths, 0, 0.1)


# --- GPU ---------------------------------------------------------------------------------------


def _poison_free_memory() -> None:
    """Fills the caching allocator's free blocks with NaN: FlashMLA allocates its output inside the
    call, so a row it never writes reads as NaN instead of as stale, plausible numbers."""
    free = torch.cuda.memory_reserved() - torch.cuda.memory_allocated()
    if free > 0:  # the large pool's free blocks (outputs over 1 MB are cut from them) ...
        torch.empty(free // 2, dtype=torch.bfloat16, device="cuda").fill_(float("nan"))
    # ... and the small pool's 2 MB segments (smaller outputs: batch 1 at 16 heads is 16 KB).
    small = [torch.full((1 << 18,), float("nan"), dtype=torch.bfloat16, device="cuda") for _ in range(16)]
    del small


@pytest.mark.gpu
@requires_flashmla
@pytest.mark.parametrize("heads", [16, 128])
@pytest.mark.parametrize("batch_size", [1, 8, 128])
def test_flashmla_decode_matches_torch(heads, batch_size):
    from pdtest.mla_decode_cases import decode_batch, rel_err

    lengths = [random.randint(1, 3000) for _ in range(batch_size)]
    lengths[0] = random.choice([1, 63, 65, 64 * random.randint(1, 40) + random.randint(1, 63)])
    batch, cache = decode_batch(lengths, 64, torch.bfloat16, spare_pages=8)
    owned = {p for pages in batch.page_lists for p in pages}
    spare = [p for p in range(cache.shape[0]) if p not in owned]
    cache[spare] = float("nan")  # a read of a page no sequence owns turns the output NaN
    # The views the MLA layer passes: q_latent from a transposed bmm, q_pe a split of q.
    q_latent = torch.randn(heads, batch_size, 512, dtype=torch.bfloat16, device="cuda").transpose(0, 1)
    q_pe = torch.randn(batch_size, heads, 192, dtype=torch.bfloat16, device="cuda")[..., 128:]
    scale = 192 ** -0.5
    want = TorchAttentionBackend().mla_decode(q_latent, q_pe, cache, batch, 512, scale)

    backend = ATTENTION_BACKENDS.build("flashmla", MLADecodeRoute(min_batch_many_heads=1, min_batch_few_heads=1))
    _poison_free_memory()
    got = backend.mla_decode(q_latent, q_pe, cache, batch, 512, scale)
    assert any(isinstance(k, tuple) and k[0] == "flashmla_decode_call" for k in batch.derived)
    assert got.shape == want.shape and got.dtype == want.dtype and not torch.isnan(got).any()
    assert rel_err(got, want) < 2e-2, rel_err(got, want)
    # The batch's call (and its metadata) serves every layer: a second layer's cache.
    cache2 = torch.randn_like(cache)
    cache2[spare] = float("nan")
    want2 = TorchAttentionBackend().mla_decode(q_latent, q_pe, cache2, batch, 512, scale)
    _poison_free_memory()
    assert rel_err(backend.mla_decode(q_latent, q_pe, cache2, batch, 512, scale), want2) < 2e-2


@pytest.mark.gpu
@requires_flashmla
def test_flashmla_call_replays_in_a_cuda_graph_at_new_lengths():
    """The call captured in a CUDA graph over static table and length buffers: each replay, with
    new lengths and pages written into them, recomputes the metadata and matches the reference."""
    from pdtest.mla_decode_cases import decode_batch, rel_err

    heads, batch_size, width = 128, 16, 48
    scale = 192 ** -0.5
    table = torch.zeros(batch_size, width, dtype=torch.int32, device="cuda")
    lengths = torch.ones(batch_size, dtype=torch.int32, device="cuda")
    q_latent = torch.randn(batch_size, heads, 512, dtype=torch.bfloat16, device="cuda")
    q_pe = torch.randn(batch_size, heads, 64, dtype=torch.bfloat16, device="cuda")
    first, cache = decode_batch([width * 64] * batch_size, 64, torch.bfloat16)
    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):  # warm-up off the capture, as the graph runner does
        MLADecodeCall(table, lengths, heads, scale).run(q_latent, q_pe, cache)
    torch.cuda.current_stream().wait_stream(side)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        out = MLADecodeCall(table, lengths, heads, scale).run(q_latent, q_pe, cache)
    for _ in range(4):
        step_lengths = [random.randint(1, width * 64) for _ in range(batch_size)]
        batch, fresh = decode_batch(step_lengths, 64, torch.bfloat16)
        cache.zero_()[:fresh.shape[0]].copy_(fresh)
        rows = batch.page_table.to(torch.int32)
        table.zero_()[:, :rows.shape[1]].copy_(rows)
        lengths.copy_(batch.seq_lens_t)
        graph.replay()
        want = TorchAttentionBackend().mla_decode(q_latent, q_pe, fresh, batch, 512, scale)
        assert rel_err(out, want) < 2e-2, (step_lengths, rel_err(out, want))
    del first


@pytest.mark.gpu
@requires_flashmla
def test_flashmla_decode_in_cuda_graphs_equals_eager(tmp_path):
    from pdtest.mla_decode_cases import graph_against_eager

    worst = graph_against_eager(tmp_path, "flashmla", [9, 16, 32, 13, 1, 24])  # FlashMLA from batch 2
    print(f"flashmla graph vs eager: worst row rel err {worst:.2e}")
    assert worst < 2e-2, worst


@pytest.mark.gpu
@requires_flashmla
def test_serve_with_no_page_size_runs_flashmla_on_this_hopper_gpu(tmp_path):
    """`serve decode` given no --page-size on a Hopper GPU with FlashMLA built: 64-token pages and
    FlashMLA's decode, which its real start-up check keeps; `serve prefill` resolves the same page
    (model/kv/page_size.py), so the two sides' KV layouts agree. An explicit 16 is kept (then Triton)."""
    import json

    from deepseek_pd.cli import build_parser
    from deepseek_pd.commands.serve import flags_from_args
    from deepseek_pd.model.checkpoint.tiny import tiny_config
    from deepseek_pd.model.config import ModelConfig
    from deepseek_pd.model.jit_backends import with_compiled_jit_backends
    from deepseek_pd.workers.serve.resolution import resolve_serve_config

    (tmp_path / "config.json").write_text(json.dumps({**tiny_config("v3", 512), "torch_dtype": "bfloat16",
                                                      "kv_lora_rank": 512, "qk_rope_head_dim": 64}))

    def serve(*argv: str):
        return resolve_serve_config(flags_from_args(build_parser().parse_args(
            ["serve", *argv, "--model", str(tmp_path), "--device", "cuda", "--num-pages", "64"])))

    decode = serve("decode").runner
    assert (decode.page_size, decode.attention_backend) == (64, "flashmla")
    assert with_compiled_jit_backends(decode, ModelConfig.from_hf(tmp_path)).attention_backend == "flashmla"
    assert serve("prefill").runner.page_size == 64
    given = serve("decode", "--page-size", "16").runner
    assert (given.page_size, given.attention_backend) == (16, "triton")

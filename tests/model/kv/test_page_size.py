"""The KV page size a worker runs when none is given (model/kv/page_size.py), on CPU with FlashMLA's
availability injected where attention "auto" asks the machine (`runner_config.attention_host`).

The oracle is attention "auto" itself (model/kernels/mla_decode_route.py): the default is 64 exactly
where "auto", at that page size, picks FlashMLA, and where it is 16, no page size would let "auto"
pick FlashMLA. A page size given is kept, and "auto" then says why FlashMLA was not picked.
"""
from __future__ import annotations

import logging
import random
from dataclasses import replace

import pytest
import torch

from deepseek_pd.model import runner_config
from deepseek_pd.model.checkpoint.tiny import tiny_config
from deepseek_pd.model.config import ModelConfig
from deepseek_pd.model.kernels import flashmla_mla
from deepseek_pd.model.kernels.mla_decode_route import FLASHMLA_PAGE_SIZE, AttentionHost, auto_attention_backend
from deepseek_pd.model.kv.page_size import (DEFAULT_PAGE_SIZE, LARGEST_AUTO_PAGE_SIZE, auto_page_size,
                                            page_size_mismatch)
from deepseek_pd.model.runner_config import RunnerConfig

V3_SHAPE = dict(num_attention_heads=128, num_key_value_heads=128, kv_lora_rank=512, qk_rope_head_dim=64)


def _v3_config(**overrides) -> ModelConfig:
    return ModelConfig.from_hf({**tiny_config("v3", 512), **V3_SHAPE, "torch_dtype": "bfloat16", **overrides})


def _random_host() -> AttentionHost:
    return AttentionHost(cuda=random.random() < 0.8, triton=random.random() < 0.9,
                         flashinfer_blocker=random.choice([None, "no FlashInfer here"]),
                         flashmla_blocker=random.choice([None, None, "no flash_mla here", "sm80, not Hopper"]))


def test_the_default_is_flashmlas_page_exactly_where_auto_would_pick_flashmla():
    for _ in range(300):
        host = _random_host()
        widths = random.choice([(512, 64), (512, 64), (64, 16), (256, 64)])
        dtype = random.choice(["bfloat16", "bfloat16", "float16", "float32"])
        heads = random.choice([16, 128])
        size, why = auto_page_size(host, widths=widths, dtype=dtype)
        assert size in (DEFAULT_PAGE_SIZE, FLASHMLA_PAGE_SIZE) and size <= LARGEST_AUTO_PAGE_SIZE and why
        picks = {page: auto_attention_backend(host, heads_per_rank=heads, widths=widths, dtype=dtype,
                                              page_size=page)[0]
                 for page in (size, FLASHMLA_PAGE_SIZE)}
        if size == FLASHMLA_PAGE_SIZE:
            assert picks[size] == "flashmla" or not host.triton, (host, widths, dtype)
        else:  # no page size would have let auto pick FlashMLA: the page is not what stops it
            assert picks[FLASHMLA_PAGE_SIZE] != "flashmla", (host, widths, dtype)
            if host.cuda and host.flashmla_blocker:
                assert host.flashmla_blocker in why


def test_the_default_ignores_role_settings_both_sides_may_not_share():
    """Deterministic mode and the heads per rank change "auto"'s pick, never the page: prefill and
    decode of one model on one kind of machine resolve one page size."""
    host = AttentionHost(True, True, None, flashmla_blocker=None)
    config = RunnerConfig(device="cuda", dtype="bfloat16")
    model = _v3_config()
    assert auto_page_size(host, widths=(512, 64), dtype="bfloat16")[0] == FLASHMLA_PAGE_SIZE
    assert replace(config, deterministic=True, page_size=64).auto_attention(model, host)[0] != "flashmla"
    assert replace(config, tp_size=random.choice([2, 8]), page_size=64).auto_attention(model, host)[0] == "flashmla"


@pytest.fixture
def flashmla_machine(monkeypatch):
    """This CPU machine as `resolve` would see a Hopper one with FlashMLA built (CUDA "available",
    Triton importable): nothing is built or run, only configs resolved."""
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(runner_config, "_triton_available", lambda: True)
    monkeypatch.setattr(runner_config, "attention_host",
                        lambda device: AttentionHost(True, True, "no FlashInfer here", flashmla_blocker=None))


def test_resolve_defaults_to_64_and_picks_flashmla_and_keeps_a_given_page(flashmla_machine, caplog):
    model = _v3_config()
    with caplog.at_level(logging.INFO, logger=runner_config.__name__):
        resolved = RunnerConfig.resolve(model, graphs_by_default=True, device="cuda", dtype="auto",
                                        **random.choice([{}, {"page_size": None}]))
    assert (resolved.page_size, resolved.attention_backend, resolved.dtype) == (64, "flashmla", "bfloat16")
    assert "page size 64 tokens (none given: FlashMLA" in caplog.text
    given = random.choice([1, 8, 16, 32, 128])
    caplog.clear()
    with caplog.at_level(logging.INFO, logger=runner_config.__name__):
        kept = RunnerConfig.resolve(model, graphs_by_default=True, device="cuda", page_size=given)
    assert (kept.page_size, kept.attention_backend) == (given, "triton")
    assert f"takes pages of 64 tokens, not the {given} given" in caplog.text  # auto's log line says why
    # Where FlashMLA cannot read this KV (fp16 here), the default stays 16 and says why.
    fp16 = RunnerConfig.resolve(model, graphs_by_default=True, device="cuda", dtype="float16")
    assert (fp16.page_size, fp16.attention_backend) == (DEFAULT_PAGE_SIZE, "triton")


def test_resolve_on_this_cpu_keeps_16():
    resolved = RunnerConfig.resolve(_v3_config(), graphs_by_default=False, device="cpu")
    assert (resolved.page_size, resolved.attention_backend) == (DEFAULT_PAGE_SIZE, "torch")


def test_flashmla_is_blocked_on_a_gpu_nvml_says_is_not_hopper(monkeypatch, tmp_path):
    """A built FlashMLA on a GPU that is not Hopper: no 64-token default (its start-up check would
    fail there and "auto" run Triton anyway); NVML that cannot tell leaves it to that check."""
    (tmp_path / "flash_mla").mkdir()
    (tmp_path / "flash_mla" / "__init__.py").write_text("")
    monkeypatch.setenv("DEEPSEEK_PD_FLASHMLA_DIR", str(tmp_path))
    major, minor = random.choice([(8, 0), (8, 9), (10, 0), (12, 0)])
    monkeypatch.setattr(flashmla_mla, "compute_capability", lambda device: (major, minor))
    assert f"sm{major}{minor}" in flashmla_mla.flashmla_blocker("cuda:0")
    assert flashmla_mla.flashmla_blocker() is None  # no device asked: the package alone
    monkeypatch.setattr(flashmla_mla, "compute_capability", lambda device: random.choice([(9, 0), None]))
    assert flashmla_mla.flashmla_blocker("cuda:0") is None


def test_prefill_and_decode_page_sizes_must_agree_or_both_be_unset():
    size = random.choice([1, 16, 64, 128])
    assert page_size_mismatch(None, None) is None and page_size_mismatch(size, size) is None
    for prefill, decode in ((size, None), (None, size), (size, size + random.randint(1, 64))):
        why = page_size_mismatch(prefill, decode)
        assert why and "give both the same --page-size, or neither" in why
        assert (f"is {prefill} on prefill" if prefill else "unset (64 where FlashMLA's decode can run, else 16) on prefill") \
            in why


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
def test_nvml_reads_the_compute_capability_torch_reports():
    """The capability the page-size default reads without a CUDA context is the device's own."""
    from deepseek_pd.model.nvml import compute_capability

    index = random.randrange(torch.cuda.device_count())
    assert compute_capability(f"cuda:{index}") == torch.cuda.get_device_capability(index)


def test_a_named_decode_backend_keeps_the_machines_page(flashmla_machine):
    """A decode worker that names Triton (or torch) on a FlashMLA machine, with no page size, gets
    the 64-token pages its prefill peer resolves there (no decode backend on that side): the kept
    rule of model/kv/page_size.py, not a per-backend default that would fail every transfer."""
    model = _v3_config()
    backend = random.choice(["triton", "torch"])
    decode = RunnerConfig.resolve(model, graphs_by_default=True, device="cuda", attention_backend=backend)
    prefill = RunnerConfig.resolve(model, graphs_by_default=True, device="cuda")
    assert decode.attention_backend == backend
    assert decode.page_size == prefill.page_size == FLASHMLA_PAGE_SIZE

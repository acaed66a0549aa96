"""KV pool sizing from a GPU memory budget (model/kv/pool_sizing.py), and the runner that uses it.

The oracle is the definition rather than the formula: the answer n is the largest page count with
n * bytes_per_page + weights + headroom <= budget, checked from both sides on fresh random inputs.
"""
from __future__ import annotations

import logging
import random

import pytest
import torch

from deepseek_pd.units import GIB
from deepseek_pd.errors import UserError
from deepseek_pd.model.kv.pool import KVPool, bytes_per_pool_page
from deepseek_pd.model.kv.pool_sizing import GpuMemory, pages_for_budget, pages_for_gpu


def _fits(pages: int, budget: int, per_page: int, weights: int, headroom: int) -> bool:
    return pages * per_page + weights + headroom <= budget


def test_pages_for_budget_is_the_largest_count_that_fits() -> None:
    rng = random.Random()
    for _ in range(2000):
        per_page = rng.randint(1, 1 << 24)
        weights = rng.randint(0, 1 << 40)
        headroom = rng.randint(0, 1 << 33)
        budget = weights + headroom + rng.randint(per_page, per_page * rng.randint(1, 10**6) + per_page)
        pages = pages_for_budget(budget, per_page, weights, headroom)
        assert pages >= 1
        assert _fits(pages, budget, per_page, weights, headroom)
        assert not _fits(pages + 1, budget, per_page, weights, headroom)


def test_pages_for_budget_edges() -> None:
    rng = random.Random()
    per_page, weights, headroom = rng.randint(2, 1 << 20), rng.randint(0, 1 << 30), rng.randint(0, 1 << 30)
    exact = weights + headroom + per_page
    assert pages_for_budget(exact, per_page, weights, headroom) == 1  # exactly one page
    assert pages_for_budget(exact + per_page - 1, per_page, weights, headroom) == 1  # partial pages don't count
    assert pages_for_budget(exact, per_page, weights, 0) == 1 + headroom // per_page  # headroom is a real cost
    with pytest.raises(UserError, match="no room for the KV pool"):
        pages_for_budget(exact - 1, per_page, weights, headroom)  # one byte short of a page
    with pytest.raises(UserError, match="no room"):
        pages_for_budget(weights // 2, per_page, weights + 1, headroom)  # the weights alone overflow
    with pytest.raises(UserError, match="less than 2 page"):
        pages_for_budget(exact, per_page, weights, headroom, min_pages=2)  # graphs need a scratch page too
    with pytest.raises(ValueError):
        pages_for_budget(exact, 0, weights, headroom)


def test_pages_for_gpu_takes_the_fraction_of_total_memory_and_checks_free() -> None:
    rng = random.Random()
    for _ in range(500):
        total = rng.randint(8, 200) * GIB
        resident = rng.randint(0, total // 4)
        fraction = rng.uniform(0.3, 0.95)
        headroom = rng.randint(0, GIB)
        per_page = rng.randint(1 << 10, 1 << 22)
        budget = int(fraction * total)
        free = total - resident  # a GPU nobody else uses
        if not _fits(1, budget, per_page, resident, headroom):
            # e.g. 0.31 x 9 GiB < 1.84 GiB of weights + 0.98 GiB of headroom (seed 2642486183)
            with pytest.raises(UserError, match="no room for the KV pool"):
                pages_for_gpu(GpuMemory(total, free, resident), fraction, headroom, per_page)
            continue
        pages = pages_for_gpu(GpuMemory(total, free, resident), fraction, headroom, per_page)
        assert _fits(pages, budget, per_page, resident, headroom)
        assert not _fits(pages + 1, budget, per_page, resident, headroom)
        # Someone else holds memory: the budget is the same, but it no longer fits what is free.
        crowded = GpuMemory(total, pages * per_page + headroom - 1, resident)
        with pytest.raises(UserError, match="another process holds the rest"):
            pages_for_gpu(crowded, fraction, headroom, per_page)


def test_pages_for_gpu_error_names_the_fraction() -> None:
    with pytest.raises(UserError, match=r"mem_fraction_static 0.1 x 10.00 GiB"):
        pages_for_gpu(GpuMemory(10 * GIB, 10 * GIB, 2 * GIB), 0.1, 0, 1 << 20)


def test_bytes_per_pool_page_matches_a_built_pool() -> None:
    rng = random.Random()
    for dtype in (torch.float32, torch.bfloat16, torch.float16):
        layers, page_size, kv_dim, pages = rng.randint(1, 5), rng.randint(1, 9), rng.randint(1, 40), rng.randint(1, 9)
        pool = KVPool(layers, pages, page_size, kv_dim, dtype=dtype)
        measured = sum(b.numel() * b.element_size() for b in pool.buffers)
        assert bytes_per_pool_page(layers, page_size, kv_dim, dtype) * pages == measured == pool.total_bytes
        assert pool.describe() == (f"{pages} pages x {page_size} tokens = {pages * page_size} tokens "
                                   f"({measured / GIB:.2f} GiB)")


def test_runner_sizes_its_pool_from_the_measured_budget(monkeypatch, caplog) -> None:
    """ModelRunner measures after the model is built and sizes the pool by the same arithmetic.
    The GPU reading is replaced (this runs on the CPU); everything else is the real runner."""
    from deepseek_pd.model.config import ModelConfig
    from deepseek_pd.model.deepseek import DeepseekForCausalLM
    from deepseek_pd.model.runner import ModelRunner
    from deepseek_pd.model.runner_config import RunnerConfig
    from deepseek_pd.model.checkpoint.tiny import ensure_tiny_model

    rng = random.Random()
    model = DeepseekForCausalLM(ModelConfig.from_hf(ensure_tiny_model()))
    cfg = model.config
    page_size = rng.choice([1, 4, 16])
    per_page = bytes_per_pool_page(cfg.num_hidden_layers, page_size, cfg.kv_cache_dim, torch.float32)
    want_pages = rng.randint(2, 300)
    total = 100 * GIB
    fraction = rng.uniform(0.2, 0.9)
    headroom_gib = rng.choice([0.0, 0.5, 1.0])
    resident = int(fraction * total) - int(headroom_gib * GIB) - want_pages * per_page - rng.randrange(per_page)
    reading = GpuMemory(total_bytes=total, free_bytes=total - resident, resident_bytes=resident)
    monkeypatch.setattr(GpuMemory, "measure", classmethod(lambda cls, device: reading))
    config = RunnerConfig(model="<test>", device="cuda", page_size=page_size, num_pages=None,
                          mem_fraction_static=fraction, mem_headroom_gib=headroom_gib)
    with caplog.at_level(logging.INFO, logger="deepseek_pd.model.runner"):
        runner = ModelRunner.from_model(model, config)
    assert runner.kv_pool.num_pages == want_pages
    line = f"KV pool: {want_pages} pages x {page_size} tokens = {want_pages * page_size} tokens"
    assert any(line in record.getMessage() for record in caplog.records), caplog.text


def test_pool_sizing_fields_are_checked() -> None:
    from deepseek_pd.model.runner_config import DEFAULT_NUM_PAGES, RunnerConfig

    assert RunnerConfig().num_pages == DEFAULT_NUM_PAGES  # the CPU keeps a fixed pool
    with pytest.raises(UserError, match="not both"):
        RunnerConfig(device="cuda", mem_fraction_static=0.5)
    with pytest.raises(UserError, match="not neither"):
        RunnerConfig(device="cuda", num_pages=None)
    with pytest.raises(UserError, match="give the pool size instead"):
        RunnerConfig(device="cpu", num_pages=None, mem_fraction_static=0.5)
    for bad in (0.0, -0.1, 1.5):
        with pytest.raises(UserError, match=r"in \(0, 1\]"):
            RunnerConfig(device="cuda", num_pages=None, mem_fraction_static=bad)
    with pytest.raises(UserError, match="mem_headroom_gib"):
        RunnerConfig(mem_headroom_gib=-1)


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
def test_runner_pool_on_a_real_gpu_fills_its_budget(monkeypatch) -> None:
    """On a GPU: the pool plus what was resident when it was sized stays within the budget, and
    one more page would not have fit (the headroom is the slack). What is resident is the reading
    the runner sized from: allocations after it (other tests' leftovers in this process, the
    runner's own small buffers) belong to the headroom, so they are bounded by it, not zero."""
    from deepseek_pd.model.kv import pool_sizing as kv_pool_sizing
    from deepseek_pd.model.runner import ModelRunner
    from deepseek_pd.model.runner_config import RunnerConfig

    readings: list[kv_pool_sizing.GpuMemory] = []
    measure = kv_pool_sizing.GpuMemory.measure
    monkeypatch.setattr(kv_pool_sizing.GpuMemory, "measure",
                        classmethod(lambda cls, device: readings.append(measure(device)) or readings[-1]))
    fraction, headroom_gib = 0.05, 0.25
    runner = ModelRunner(RunnerConfig(model="tiny", device="cuda", dtype="bfloat16", page_size=16,
                                      num_pages=None, mem_fraction_static=fraction, mem_headroom_gib=headroom_gib))
    assert len(readings) == 1
    reading, pool = readings[0], runner.kv_pool
    per_page = pool.total_bytes // pool.num_pages
    budget = int(fraction * reading.total_bytes) - int(headroom_gib * GIB)
    assert reading.resident_bytes > 0  # the weights were loaded before the pool was sized
    assert pool.total_bytes + reading.resident_bytes <= budget
    assert pool.total_bytes + reading.resident_bytes + per_page > budget
    assert torch.cuda.memory_allocated() <= budget + int(headroom_gib * GIB)

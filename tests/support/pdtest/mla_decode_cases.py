"""Decode cases shared by the MLA-decode library tests (FlashInfer, FlashMLA): a batch over
scattered pages, the relative error, and a V3-width runner's graph replays against its eager
decode. GPU only; the torch attention backend is the oracle."""
from __future__ import annotations

import random
from pathlib import Path

import torch

from deepseek_pd.model.forward_batch import ForwardBatch, ForwardMode
from deepseek_pd.model.kv.pool import KVPool


def rel_err(out: torch.Tensor, ref: torch.Tensor) -> float:
    return float((out.double() - ref.double()).norm() / ref.double().norm().clamp_min(1e-30))


def decode_batch(lengths: list[int], page_size: int, dtype: torch.dtype,
                 spare_pages: int = 4) -> tuple[ForwardBatch, torch.Tensor]:
    """A decode batch over pages drawn at random from a pool (scattered, as a busy pool is), with
    `spare_pages` pages no sequence owns."""
    need = [-(-n // page_size) for n in lengths]
    pool = KVPool(1, sum(need) + spare_pages, page_size, 576, dtype=dtype, device="cuda")
    order = torch.randperm(pool.num_pages).tolist()
    pages, start = [], 0
    for n in need:
        pages.append(order[start:start + n])
        start += n
    pool.buffers[0].copy_(torch.randn(pool.buffers[0].shape, dtype=dtype, device="cuda"))
    batch = ForwardBatch.build(ForwardMode.DECODE, [[0]] * len(lengths), [n - 1 for n in lengths], pages, pool,
                               vocab_size=1, device="cuda")
    return batch, pool.buffers[0]


def graph_against_eager(tmp_path: Path, attention_backend: str, batch_sizes: list[int]) -> float:
    """A V3-width model (512 + 64 latent, 128 heads, 2 layers, random bf16 weights) with
    `attention_backend`: decode replayed from CUDA graphs against the same runner's eager decode,
    over batches of mixed lengths (`batch_sizes`, several buckets); the worst row's relative error."""
    from pdtest.bench_scripts import bench_module

    from deepseek_pd.model.runner import DecodeSeq, ExtendSeq, ModelRunner
    from deepseek_pd.model.runner_config import RunnerConfig

    rng = random.Random()
    random_checkpoint = bench_module("random_checkpoint")
    config = random_checkpoint.v2_lite_config(num_hidden_layers=2, num_attention_heads=128, num_key_value_heads=128,
                                              n_routed_experts=8, torch_dtype="bfloat16")
    path = random_checkpoint.write_random_checkpoint(tmp_path / "v3w", config, device="cuda", seed=rng.randrange(1 << 30))
    runner = ModelRunner(RunnerConfig(model=str(path), dtype="bfloat16", device="cuda",
                                      attention_backend=attention_backend, moe_backend="triton", page_size=64,
                                      num_pages=1024, cuda_graph=True, cuda_graph_max_batch=32,
                                      cuda_graph_max_context=4096))
    assert runner.graphs is not None and runner.config.attention_backend == attention_backend
    vocab, pool = runner.model_config.vocab_size, runner.kv_pool
    lengths = [rng.randrange(1, 3000) for _ in range(40)]
    pages = [pool.alloc(pool.pages_for_tokens(n + 8)) for n in lengths]
    for lo in range(0, len(lengths), 8):
        runner.extend([ExtendSeq([rng.randrange(vocab) for _ in range(lengths[i])], 0, pages[i])
                       for i in range(lo, min(len(lengths), lo + 8))])
    worst = 0.0
    for batch_size in batch_sizes:
        chosen = rng.sample(range(len(lengths)), batch_size)
        batch = [DecodeSeq(rng.randrange(vocab), lengths[i], pages[i]) for i in chosen]
        eager = runner.decode_eager(batch)
        graph = runner.decode(batch)
        worst = max(worst, max(rel_err(g, e) for g, e in zip(graph, eager)))
        for i in chosen:
            lengths[i] += 1
    return worst

"""CUDA bf16 with the plain-torch backends gives the CPU fp32 engine's greedy tokens (tiny checkpoints)."""
from __future__ import annotations

import random

import pytest
import torch

from deepseek_pd.model.runner import DecodeSeq, ExtendSeq, ModelRunner, RunnerConfig
from deepseek_pd.model.tiny import make_tiny_model

pytestmark = [pytest.mark.gpu, pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")]


def _greedy(runner: ModelRunner, prompt: list[int], steps: int) -> list[int]:
    pool = runner.kv_pool
    pages = pool.alloc(pool.pages_for_tokens(len(prompt) + steps))
    out = [int(runner.extend([ExtendSeq(prompt, 0, pages)]).argmax(-1)[0])]
    for i in range(steps - 1):
        out.append(int(runner.decode([DecodeSeq(out[-1], len(prompt) + i, pages)]).argmax(-1)[0]))
    pool.free(pages)
    return out


@pytest.mark.parametrize("arch", ["v3", "v2"])
def test_cuda_bf16_greedy_matches_cpu_fp32(tmp_path, arch: str) -> None:
    path = str(make_tiny_model(tmp_path / arch, arch=arch, seed=random.randrange(1000)))
    cpu = ModelRunner(RunnerConfig(model=path, dtype="float32", device="cpu"))
    vocab = cpu.model_config.vocab_size
    prompt = [random.randrange(vocab) for _ in range(random.randrange(8, 64))]
    expected = _greedy(cpu, prompt, 16)
    got = _greedy(ModelRunner(RunnerConfig(model=path, dtype="bfloat16", device="cuda")), prompt, 16)
    assert got == expected

"""The draft step's static inputs (model/speculative/draft_graph.py) on the CPU, where no graph is
captured: one step's rows land in the bucket's buffers as decode's packing lays them out, the
hidden states in their rows, zeros in the padding rows (even after a larger step), and hidden
states of the wrong shape are refused. The replay itself: tests/model/test_speculative_gpu.py."""
from __future__ import annotations

import random

import pytest
import torch

from deepseek_pd.model.graph_inputs import StaticDecodeInputs
from deepseek_pd.model.kv.pool import KVPool
from deepseek_pd.model.speculative.draft_graph import StaticDraftInputs

PAGE, HIDDEN, BUCKET = 4, 8, 4


def test_a_step_fills_its_rows_and_zeros_the_padding():
    rng = random.Random()
    pool = KVPool(2, 32, PAGE, 6, dtype=torch.float32, device="cpu")
    inputs = StaticDraftInputs(StaticDecodeInputs(BUCKET, 4, pool, scratch_page=31, vocab_size=100), HIDDEN,
                               torch.float32)
    generator = torch.Generator().manual_seed(rng.randrange(1 << 30))
    for n in (BUCKET, rng.randint(1, BUCKET - 1)):  # the larger step first: its rows must not linger
        positions = [rng.randrange(0, 12) for _ in range(n)]
        pages = [[rng.randrange(0, 31) for _ in range(4)] for _ in range(n)]
        tokens = [rng.randrange(0, 100) for _ in range(n)]
        hidden = torch.randn(n, HIDDEN, generator=generator)
        inputs.load(tokens, positions, pages, hidden)
        assert torch.equal(inputs.hidden[:n], hidden) and not inputs.hidden[n:].any()
        assert inputs.decode.input_ids[:n].tolist() == tokens
        assert inputs.decode.positions[:n].tolist() == positions
        assert inputs.decode.seq_lens.tolist() == [p + 1 for p in positions] + [1] * (BUCKET - n)
    with pytest.raises(ValueError, match="hidden states"):
        inputs.load([1], [0], [[0]], torch.zeros(2, HIDDEN))

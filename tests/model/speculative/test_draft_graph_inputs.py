"""The draft step's static inputs (model/speculative/draft_graph.py) on the CPU, where no graph is
captured: one step's rows land in the bucket's buffers as decode's packing lays them out, the
hidden states in their rows, zeros in the padding rows (even after a larger step), and hidden
states of the wrong shape are refused. The replay itself: tests/model/speculative/test_speculative_gpu.py."""
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


def test_verify_inputs_lay_out_real_rows_as_forward_batch_build_does():
    """The verify graph's static batch (model/speculative/verify_graph.py) against the eager
    `ForwardBatch.build` of the same sequences: the same ids, positions, KV slots, lengths and page
    rows for the real rows; padding rows stay on the scratch page."""
    from deepseek_pd.model.forward_batch import ForwardBatch, ForwardMode
    from deepseek_pd.model.speculative.verify_graph import StaticVerifyInputs

    rng = random.Random()
    q, width, scratch, bucket = rng.randint(2, 5), 6, 63, 4
    pool = KVPool(2, 64, PAGE, 6, dtype=torch.float32, device="cpu")
    inputs = StaticVerifyInputs(bucket, q, width, pool, scratch, vocab_size=100)
    n = rng.randint(1, bucket)
    prefixes = [rng.randrange(0, width * PAGE - q + 1) for _ in range(n)]
    pages = [rng.sample(range(scratch), -(-(p + q) // PAGE)) for p in prefixes]
    tokens = [[rng.randrange(100) for _ in range(q)] for _ in range(n)]
    assert inputs.fits(prefixes) and not inputs.fits([width * PAGE - q + 1])
    inputs.load(inputs.pack(tokens, prefixes, pages))
    eager = ForwardBatch.build(ForwardMode.EXTEND, tokens, prefixes, pages, pool, 100, "cpu")
    static = inputs.forward_batch()
    t = n * q
    for name in ("input_ids", "positions", "out_slots", "token_seq"):
        assert torch.equal(getattr(static, name)[:t], getattr(eager, name)), name
    assert torch.equal(static.qo_indptr[:n + 1], eager.qo_indptr)
    assert torch.equal(static.seq_lens_t[:n], eager.seq_lens_t)
    for i, row in enumerate(pages):
        assert static.page_table[i, :len(row)].tolist() == row
    assert set(static.out_slots[t:].div(PAGE, rounding_mode="floor").tolist()) <= {scratch}
    assert set(static.page_table[n:].flatten().tolist()) <= {scratch}
    with pytest.raises(ValueError, match="the graph verifies"):
        inputs.pack([[1] * (q + 1)], [0], [pages[0]])

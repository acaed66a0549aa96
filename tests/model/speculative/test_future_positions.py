"""Future positions (model/speculative/future_positions.py): a batch built on the host from upper
bounds of its prefix lengths, its positions, KV slots and lengths then filled in on the device
from the true ones, equals the batch built from the true lengths (`ForwardBatch.build`, the
oracle), with nothing read back; so do the CUDA graphs' static verify and draft inputs (filled on
the CPU here, where nothing is captured). And the next step's starts are the last step's plus its
emitted counts, clamped into each row's pages.
"""
from __future__ import annotations

import random

import pytest
import torch

from deepseek_pd.model.forward_batch import ForwardBatch, ForwardMode
from deepseek_pd.model.graph_inputs import StaticDecodeInputs
from deepseek_pd.model.kv.pool import KVPool
from deepseek_pd.model.speculative.future_positions import FuturePositions, fill_static, with_device_starts
from deepseek_pd.model.speculative.verify_graph import StaticVerifyInputs
from pdtest.host_reads import HostReads

PAGES, VOCAB = 64, 50


def _rows(rng: random.Random, page: int, n: int, q: int | None = None):
    """n sequences: (new tokens, true prefix, bound >= it, pages that hold the bound's tokens)."""
    rows = []
    for _ in range(n):
        extend = q or rng.randint(1, 5)
        prefix = rng.randint(0, 20)
        bound = prefix + rng.randint(0, 6)
        pages = rng.sample(range(PAGES - 1), -(-(bound + extend) // page) + rng.randint(0, 1))
        rows.append(([rng.randrange(VOCAB) for _ in range(extend)], prefix, bound, pages))
    return rows


@pytest.mark.parametrize("mode", [ForwardMode.EXTEND, ForwardMode.DECODE])
def test_device_starts_give_the_batch_of_the_true_lengths(mode):
    rng = random.Random()
    for _ in range(20):
        page = rng.choice([1, 2, 4, 8])
        pool = KVPool(1, PAGES, page, 4)
        rows = _rows(rng, page, rng.randint(1, 6), 1 if mode is ForwardMode.DECODE else None)
        tokens, prefixes, bounds, pages = map(list, zip(*rows))
        want = ForwardBatch.build(mode, tokens, prefixes, pages, pool, VOCAB, "cpu")
        got = ForwardBatch.build(mode, tokens, bounds, pages, pool, VOCAB, "cpu")
        starts = torch.tensor(prefixes)
        with HostReads() as reads:
            with_device_starts(got, starts)
        assert reads.seen == []
        for name in ("positions", "out_slots", "seq_lens_t", "token_seq", "qo_indptr", "input_ids"):
            assert torch.equal(getattr(got, name), getattr(want, name)), name
        assert all(b >= p for b, p in zip(got.seq_lens, want.seq_lens))  # host lengths only bound


def test_graph_inputs_filled_from_device_starts_equal_the_exact_packing():
    rng = random.Random()
    for _ in range(10):
        page, q, bucket, width = rng.choice([2, 4]), rng.randint(1, 4), 8, 16
        pool = KVPool(1, PAGES, page, 4)
        n = rng.randint(1, bucket)
        tokens, prefixes, bounds, pages = map(list, zip(*_rows(rng, page, n, q)))
        starts = torch.tensor(prefixes)
        if q == 1:  # the draft step's (and decode's) buffer
            exact, future = (StaticDecodeInputs(bucket, width, pool, PAGES - 1, VOCAB) for _ in range(2))
            exact.load(exact.pack([t[0] for t in tokens], prefixes, pages))
            future.load(future.pack([t[0] for t in tokens], bounds, pages))
        else:  # the verify's and the catch-up's
            exact, future = (StaticVerifyInputs(bucket, q, width, pool, PAGES - 1, VOCAB) for _ in range(2))
            exact.load(exact.pack(tokens, prefixes, pages))
            future.load(future.pack(tokens, bounds, pages))
        with HostReads() as reads:
            fill_static(future.positions, future.out_slots, future.seq_lens, future.page_table, starts, q, page)
        assert reads.seen == []
        assert torch.equal(future.packed, exact.packed)


def test_the_next_starts_add_the_emitted_counts_within_each_rows_room():
    rng = random.Random()
    for _ in range(20):
        n = rng.randint(1, 6)
        positions = [rng.randint(0, 30) for _ in range(n)]
        most = [rng.randint(1, 4) for _ in range(n)]
        emitted = [rng.randint(1, m) for m in most]
        room = [p + rng.randint(0, 6) for p in positions]
        now = FuturePositions.known(positions, "cpu")
        with HostReads() as reads:
            nxt = now.advanced(torch.tensor(emitted), most, room)
        assert reads.seen == []
        assert nxt.starts.tolist() == [min(p + e, r) for p, e, r in zip(positions, emitted, room)]
        assert nxt.bounds == tuple(min(p + m, r) for p, m, r in zip(positions, most, room))
        assert all(s <= b for s, b in zip(nxt.starts.tolist(), nxt.bounds))
    with pytest.raises(ValueError, match="counts"):
        FuturePositions.known([1, 2], "cpu").advanced(torch.tensor([1, 1]), [1], [5, 5])
    with pytest.raises(ValueError, match="no room"):
        FuturePositions.known([1], "cpu").advanced(torch.tensor([1]), [1], [-1])
    with pytest.raises(ValueError, match="starts must be"):
        FuturePositions(torch.zeros(2, dtype=torch.long), (0,))

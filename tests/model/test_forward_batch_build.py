"""`ForwardBatch.build` packs a ragged batch: every field against a per-token reference computed
here from the definitions (position = prefix + index, slot = page of the position * page size +
offset), on fresh random batches of scattered pages, extend and decode."""
from __future__ import annotations

import random

import numpy as np
import pytest
import torch

from deepseek_pd.errors import UserError
from deepseek_pd.model.forward_batch import ForwardBatch, ForwardMode
from deepseek_pd.model.kv.pool import KVPool


def _pool(rng: random.Random) -> KVPool:
    return KVPool(num_layers=1, num_pages=rng.randint(64, 256), page_size=rng.choice([1, 2, 4, 16]), kv_dim=8,
                  dtype=torch.float32, device="cpu")


def _batch(rng: random.Random, pool: KVPool, mode: ForwardMode, vocab: int):
    ids, prefixes, pages = [], [], []
    for _ in range(rng.randint(1, 12)):
        new = 1 if mode is ForwardMode.DECODE else rng.randint(1, 40)
        prefix = rng.randint(0, 50)
        need = -(-(prefix + new) // pool.page_size) + rng.randint(0, 2)  # sometimes spare pages
        pages.append(rng.sample(range(pool.num_pages), min(need, pool.num_pages)))
        if len(pages[-1]) * pool.page_size < prefix + new:
            prefix = len(pages[-1]) * pool.page_size - new
        ids.append([rng.randrange(vocab) for _ in range(new)])
        prefixes.append(prefix)
    return ids, prefixes, pages


@pytest.mark.parametrize("mode", [ForwardMode.EXTEND, ForwardMode.DECODE])
def test_every_field_equals_the_per_token_definition(mode) -> None:
    rng = random.Random()
    for _ in range(30):
        pool, vocab = _pool(rng), rng.randint(10, 1000)
        ids, prefixes, pages = _batch(rng, pool, mode, vocab)
        # Callers pass lists, NumPy arrays or tensors: all pack alike.
        as_given = [rng.choice([list, np.array, torch.tensor])(x) for x in ids]
        batch = ForwardBatch.build(mode, as_given, prefixes, [rng.choice([list, tuple])(p) for p in pages],
                                   pool, vocab, "cpu")
        want = {"input_ids": [], "positions": [], "out_slots": [], "token_seq": []}
        for seq, (new, prefix, seq_pages) in enumerate(zip(ids, prefixes, pages)):
            for k, token in enumerate(new):
                position = prefix + k
                want["input_ids"].append(token)
                want["positions"].append(position)
                want["out_slots"].append(seq_pages[position // pool.page_size] * pool.page_size
                                         + position % pool.page_size)
                want["token_seq"].append(seq)
        for name, values in want.items():
            got = getattr(batch, name)
            assert got.dtype == torch.long and got.tolist() == values, name
        offsets = [0]
        for new in ids:
            offsets.append(offsets[-1] + len(new))
        assert batch.qo_indptr.tolist() == offsets and batch.qo_offsets == tuple(offsets)
        width = max(len(p) for p in pages)
        assert batch.page_table.tolist() == [p + [p[-1]] * (width - len(p)) for p in pages]  # own page
        assert batch.seq_lens_t.tolist() == [p + len(n) for p, n in zip(prefixes, ids)]
        assert batch.prefix_lens == tuple(prefixes) and batch.extend_lens == tuple(len(n) for n in ids)
        assert batch.page_lists == tuple(tuple(p) for p in pages)


def test_bad_sequences_name_the_sequence_at_fault() -> None:
    rng = random.Random()
    pool, vocab = _pool(rng), 100
    ids, prefixes, pages = _batch(rng, pool, ForwardMode.EXTEND, vocab)
    bad = rng.randrange(len(ids))
    for corrupt, message in (
            (lambda: ids[bad].__setitem__(0, vocab), "token id outside the vocabulary"),
            (lambda: ids[bad].__setitem__(0, -1), "token id outside the vocabulary"),
            (lambda: pages[bad].__setitem__(0, pool.num_pages), "reach outside the pool"),
            (lambda: pages[bad].__setitem__(0, -2), "reach outside the pool"),
            (lambda: prefixes.__setitem__(bad, -1), "prefix_len -1 < 0"),
            (lambda: ids[bad].__setitem__(0, 1.5), "must be a sequence of integers")):
        saved = ([list(x) for x in ids], list(prefixes), [list(p) for p in pages])
        corrupt()
        with pytest.raises(UserError, match=rf"sequence {bad}: .*{message}|{message}"):
            ForwardBatch.build(ForwardMode.EXTEND, ids, prefixes, pages, pool, vocab, "cpu")
        ids[:], prefixes[:], pages[:] = saved
    with pytest.raises(UserError, match="exactly one new token"):
        ForwardBatch.build(ForwardMode.DECODE, [[1, 2]], [0], [[0, 1, 2]], pool, vocab, "cpu")

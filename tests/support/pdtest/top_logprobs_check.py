"""The check of reported top logprobs against full forwards (`gateway_oracle.reference_logprobs`),
shared by the engine, servicer and gateway tests."""
from __future__ import annotations

import pytest

from pdtest.gateway_oracle import reference_logprobs

TOL = 2e-3  # fp32 on CPU: paged decode vs one full forward differ in summation order


def assert_top_matches(engine, tops, tokens: list[int], prompt: list[int], k: int,
                       temperature: float = 1.0) -> None:
    """`tops`: per output token an object with `token_ids` and `logprobs` (TopLogprobs). `engine`:
    the offline Engine whose runner makes the reference. Each position: k entries, descending,
    each value the reference logprob of its token, and the values the reference's k largest (ids
    may swap where two values tie within TOL)."""
    assert len(tops) == len(tokens)
    wide = reference_logprobs(engine, prompt, tokens, min(engine.vocab_size, k + 8), temperature)
    for position, (top, ref) in enumerate(zip(tops, wide)):
        assert len(top.token_ids) == len(top.logprobs) == k, (position, top)
        assert list(top.logprobs) == sorted(top.logprobs, reverse=True)
        values = dict(ref.top)
        for t, v in zip(top.token_ids, top.logprobs):
            assert t in values and abs(values[t] - v) <= TOL, (position, t, v, ref.top[:k])
        assert list(top.logprobs) == pytest.approx([v for _, v in ref.top[:k]], abs=TOL)

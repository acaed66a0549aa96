"""The decode side's check of the first token's top logprobs from TransferDone (kv_checks.py,
first_token_wire.py): what the prefill side put in comes out unchanged; a wrong count, a token
outside the vocabulary or a non-finite value is a TransferError naming the problem."""
from __future__ import annotations

import math
import random

import pytest

from deepseek_pd.model.sampling.sampled_host import TopLogprobs
from deepseek_pd.proto import bootstrap_pb2 as pb
from deepseek_pd.workers.transport.first_token_wire import first_top_logprobs, put_first_top
from deepseek_pd.workers.engine.request_failure import TransferError
from deepseek_pd.workers.decode.kv_checks import check_first_top


def _done(rng: random.Random, vocab: int, k: int) -> tuple[pb.TransferDone, TopLogprobs]:
    top = TopLogprobs(tuple(rng.sample(range(vocab), k)), tuple(sorted((-rng.random() * 9 for _ in range(k)), reverse=True)))
    done = pb.TransferDone(first_token_id=top.token_ids[0])
    put_first_top(done, top)
    return pb.TransferDone.FromString(done.SerializeToString()), top  # through the wire format


def test_what_prefill_puts_in_comes_out() -> None:
    rng = random.Random()
    vocab, k = rng.randint(30, 1000), rng.randint(1, 20)
    done, top = _done(rng, vocab, k)
    check_first_top(done, vocab, k, "r")
    got = first_top_logprobs(done)
    assert got.token_ids == top.token_ids
    assert got.logprobs == pytest.approx(top.logprobs, abs=1e-6)  # fp32 on the wire
    empty = pb.TransferDone(first_token_id=1)
    put_first_top(empty, None)
    check_first_top(empty, vocab, 0, "r")
    assert first_top_logprobs(empty) is None
    small = rng.randint(2, 9)  # a vocabulary smaller than k: every token
    done, _ = _done(rng, small, small)
    check_first_top(done, small, 20, "r")


@pytest.mark.parametrize("fault", ["count", "missing", "extra", "id", "nan", "inf"])
def test_a_bad_first_top_is_refused(fault: str) -> None:
    rng = random.Random()
    vocab, k = 200, rng.randint(2, 20)
    done, _ = _done(rng, vocab, k)
    want = k
    if fault == "count":
        want = k + 1
    elif fault == "missing":
        del done.first_top_logprobs[-1]
    elif fault == "extra":
        done.first_top_token_ids.append(3)
    elif fault == "id":
        done.first_top_token_ids[rng.randrange(k)] = vocab + rng.randrange(5)
    else:
        done.first_top_logprobs[rng.randrange(k)] = math.nan if fault == "nan" else -math.inf
    with pytest.raises(TransferError, match="top logprobs"):
        check_first_top(done, vocab, want, "r")

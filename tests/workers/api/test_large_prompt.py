"""A prompt far over the context is refused before it is copied out of the parsed message.

The oracle is memory, not time: `tracemalloc` counts every Python object the check allocates
(the parsed protobuf lives in upb's C arena, which it does not count). Copying a 2M-token prompt
into a tuple of Python ints allocates ~70 MB; refusing it on its length allocates next to nothing.
A prompt within the limit is still copied once and range-checked, so the cost of a valid request
is bounded by the context, not by what a client sends.
"""
from __future__ import annotations

import random
import tracemalloc

import pytest
from smg_grpc_proto import sglang_scheduler_pb2 as pb

from deepseek_pd.errors import UserError
from deepseek_pd.workers.api.validation import check_input
from deepseek_pd.workers.api.served_model import ServedModelInfo

pytestmark = pytest.mark.timeout(120)


def info(max_context: int, vocab: int) -> ServedModelInfo:
    return ServedModelInfo(model_path="/m", tokenizer_path="/m", served_model_name="m",
                           max_context_length=max_context, vocab_size=vocab, eos_token_ids=(1,),
                           bos_token_id=0, pad_token_id=-1, architectures=("DeepseekV3ForCausalLM",),
                           model_type="deepseek_v3")


def wire_request(ids: list[int]) -> pb.GenerateRequest:
    """A request as the server sees it: parsed from bytes, the ids held by upb, not by Python."""
    data = pb.GenerateRequest(request_id="big", tokenized=pb.TokenizedInput(input_ids=ids)).SerializeToString()
    return pb.GenerateRequest.FromString(data)


def peak_python_bytes(fn) -> tuple[int, object]:
    tracemalloc.start()
    try:
        try:
            outcome = fn()
        except UserError as exc:
            outcome = exc
        return tracemalloc.get_traced_memory()[1], outcome
    finally:
        tracemalloc.stop()


def test_prompt_over_the_context_is_refused_without_copying_it() -> None:
    rng = random.Random()
    limits = info(max_context=rng.randint(1024, 8192), vocab=rng.randint(5000, 100_000))
    n = rng.randint(2_000_000, 3_000_000)
    start = rng.randrange(1000, 4000)  # ids above 256: CPython caches only small ints
    request = wire_request([start + i % 997 for i in range(n)])
    peak, outcome = peak_python_bytes(lambda: check_input(request, limits))
    assert isinstance(outcome, UserError)
    assert f"prompt has {n} tokens" in str(outcome) and str(limits.max_context_length) in str(outcome)
    # A copy would be >= 8 bytes of tuple slot per token; allow 1% of that for the message text.
    assert peak < n * 8 // 100, f"refusing {n} tokens allocated {peak} bytes of Python objects"


def test_prompt_within_the_limit_is_copied_once_and_range_checked() -> None:
    rng = random.Random()
    limits = info(max_context=rng.randint(2048, 8192), vocab=rng.randint(5000, 100_000))
    ids = [rng.randrange(300, limits.vocab_size) for _ in range(limits.max_request_input_len)]
    request = wire_request(ids)
    assert check_input(request, limits) == tuple(ids)
    bad_at = rng.randrange(len(ids))
    ids[bad_at] = limits.vocab_size + rng.randrange(1000)
    with pytest.raises(UserError, match=rf"token ids \[{ids[bad_at]}\] are outside the vocabulary"):
        check_input(wire_request(ids), limits)
    # One over the limit: refused on its length, naming both numbers.
    with pytest.raises(UserError, match=f"prompt has {len(ids) + 1} tokens.*{limits.max_context_length}"):
        check_input(wire_request(ids + [5]), limits)

"""Rank 0 forwards a follower's requests as protos (`remote_engine.to_proto`) and reads its answers
back: what the follower's servicer makes of them must be the request rank 0 validated, logprob
options included, and the follower's OutputLogProbs must come back as the same TokenChunk."""
from __future__ import annotations

import random

import pytest

from deepseek_pd.model.sampling.sampled_host import TopLogprobs
from deepseek_pd.model.sampling.params import MAX_TOP_LOGPROBS, SamplingParams
from deepseek_pd.workers.engine.interface import DisaggParams, GenerateRequest, TokenChunk
from deepseek_pd.workers.api.proto_convert import chunk_response, to_generate_request
from deepseek_pd.workers.group.remote_engine import _token_chunk, to_proto
from deepseek_pd.workers.api.served_model import ServedModelInfo

VOCAB = 500
INFO = ServedModelInfo(model_path="/m", tokenizer_path="/m", served_model_name="m", max_context_length=256,
                       vocab_size=VOCAB, eos_token_ids=(1,), bos_token_id=0, pad_token_id=-1,
                       architectures=("DeepseekV3ForCausalLM",), model_type="deepseek_v3")


def test_forwarded_requests_keep_their_logprob_options() -> None:
    rng = random.Random()
    for _ in range(20):  # fp32-exact floats: the proto carries fp32
        logprob = rng.random() < 0.7
        sampling = SamplingParams(
            max_new_tokens=rng.randint(1, 50), temperature=rng.choice([0.0, 0.75]), top_p=rng.choice([1.0, 0.875]),
            seed=rng.choice([None, rng.randrange(2**40)]),
            top_logprobs_num=rng.randint(0, MAX_TOP_LOGPROBS) if logprob else 0)
        request = GenerateRequest(rid=f"r{rng.randrange(10**6)}", input_ids=tuple(rng.randrange(VOCAB) for _ in range(9)),
                                  sampling=sampling, stream=True, return_logprob=logprob,
                                  disagg=rng.choice([None, DisaggParams("10.0.0.2", 8998, rng.randrange(2**31))]))
        assert to_generate_request(to_proto(request), INFO) == request


def test_follower_chunks_come_back_with_their_top_logprobs() -> None:
    rng = random.Random()
    ids = tuple(rng.randrange(VOCAB) for _ in range(rng.randint(1, 4)))
    tops = tuple(TopLogprobs(tuple(rng.sample(range(VOCAB), 3)), tuple(sorted((-rng.random() * 5 for _ in range(3)),
                                                                              reverse=True))) for _ in ids)
    logprobs = tuple(-rng.random() for _ in ids)
    chunk = chunk_response("r", ids, logprobs, 9, len(ids), tops).chunk
    back = _token_chunk(chunk.token_ids, chunk.output_logprobs)
    assert back.token_ids == ids and back.logprobs == pytest.approx(logprobs, abs=1e-6)
    assert [t.token_ids for t in back.top_logprobs] == [t.token_ids for t in tops]
    for got, want in zip(back.top_logprobs, tops):  # fp32 on the wire
        assert all(abs(a - b) < 1e-6 for a, b in zip(got.logprobs, want.logprobs))
    assert isinstance(back, TokenChunk)


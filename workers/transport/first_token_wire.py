"""How the first token's top logprobs ride on TransferDone, from the prefill side to the decode side.

In PD mode the prefill worker samples the first token and the decode worker streams it, so its
top logprobs (when the request asked, `SamplingParams.top_logprobs_num` k > 0) travel the way its
id and logprob do: in `TransferDone.first_top_token_ids` / `first_top_logprobs`, covered by the
message's HMAC like every other field. Both sides got the same Generate request, so the decode side
knows k and checks the count (`workers/decode/kv_checks.check_first_top`).
"""
from __future__ import annotations

from deepseek_pd.model.sampling.sampled_host import TopLogprobs
from deepseek_pd.proto import bootstrap_pb2 as pb


def put_first_top(done: pb.TransferDone, top: TopLogprobs | None) -> None:
    """Prefill side: writes the first token's top logprobs (None: the request asked for none)."""
    if top is not None:
        done.first_top_token_ids.extend(top.token_ids)
        done.first_top_logprobs.extend(top.logprobs)


def first_top_logprobs(done: pb.TransferDone) -> TopLogprobs | None:
    """Decode side: the first token's top logprobs, None when none came (after `check_first_top`)."""
    if not done.first_top_token_ids:
        return None
    return TopLogprobs(tuple(done.first_top_token_ids), tuple(done.first_top_logprobs))

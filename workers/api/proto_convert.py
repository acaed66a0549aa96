"""Translation between SGLang's scheduler proto and our engine types (`workers/engine/interface.py`).

Inbound: `to_generate_request` validates and maps a proto GenerateRequest onto `GenerateRequest`.
Proto3 has no "unset" for scalars, so a zero is taken literally: the router always fills
temperature, top_p (1), top_k (-1) and repetition_penalty (1). A hand-made request that leaves
top_p at 0 is nonsense and is refused, not "helpfully" defaulted.

Outbound: chunk and complete messages, and `FailureCode` -> gRPC status code.
"""
from __future__ import annotations

from dataclasses import replace
from typing import Sequence

import grpc
from google.protobuf.json_format import MessageToDict
from smg_grpc_proto import sglang_scheduler_pb2 as pb

from deepseek_pd.errors import UserError
from deepseek_pd.model.sampling.sampled_host import TopLogprobs
from deepseek_pd.workers.engine.request_rules import max_new_tokens
from deepseek_pd.model.sampling.params import DEFAULT_MAX_NEW_TOKENS, SamplingParams
from deepseek_pd.workers.engine.interface import DisaggParams, Failed, FailureCode, Finished, GenerateRequest
from deepseek_pd.workers.api.served_model import ServedModelInfo
from deepseek_pd.workers.api.validation import check_disaggregated, check_input, check_unsupported

STATUS_FOR_FAILURE: dict[FailureCode, grpc.StatusCode] = {
    FailureCode.INVALID_ARGUMENT: grpc.StatusCode.INVALID_ARGUMENT,
    FailureCode.RESOURCE_EXHAUSTED: grpc.StatusCode.RESOURCE_EXHAUSTED,
    FailureCode.DEADLINE_EXCEEDED: grpc.StatusCode.DEADLINE_EXCEEDED,
    FailureCode.UNAVAILABLE: grpc.StatusCode.UNAVAILABLE,
    FailureCode.ABORTED: grpc.StatusCode.ABORTED,
    FailureCode.INTERNAL: grpc.StatusCode.INTERNAL,
}


def to_sampling_params(sp: pb.SamplingParams, input_len: int, info: ServedModelInfo,
                       top_logprobs_num: int = 0) -> SamplingParams:
    """Maps and validates; max_new_tokens is clipped to the context left after the prompt.
    `top_logprobs_num` comes from the GenerateRequest (see `to_generate_request`)."""
    # The router leaves max_new_tokens unset when the client gave none; 0 or less is refused by
    # `validate` below, with the same message as from any other entry point.
    requested = sp.max_new_tokens if sp.HasField("max_new_tokens") else DEFAULT_MAX_NEW_TOKENS
    custom = MessageToDict(sp.custom_params) if sp.HasField("custom_params") else {}
    seed = custom.get("seed")
    if seed is not None:
        if isinstance(seed, bool) or not isinstance(seed, (int, float)) or not float(seed).is_integer():
            raise UserError(f"custom_params.seed={seed!r} must be an integer")
        seed = int(seed)
    params = SamplingParams(
        max_new_tokens=requested,
        temperature=sp.temperature,
        top_p=sp.top_p,
        top_k=sp.top_k,
        min_p=sp.min_p,
        repetition_penalty=sp.repetition_penalty,
        frequency_penalty=sp.frequency_penalty,
        presence_penalty=sp.presence_penalty,
        stop_token_ids=tuple(sp.stop_token_ids),
        stop=tuple(sp.stop),
        ignore_eos=sp.ignore_eos,
        seed=seed,
        skip_special_tokens=sp.skip_special_tokens,
        top_logprobs_num=top_logprobs_num,
    )
    # Like SGLang: the budget never runs past the context window (the engines' own rule).
    params = replace(params, max_new_tokens=max_new_tokens(params, input_len, info.max_context_length))
    return params.validate(vocab_size=info.vocab_size)


def to_generate_request(request: pb.GenerateRequest, info: ServedModelInfo) -> GenerateRequest:
    """Raises UserError (-> INVALID_ARGUMENT) for anything we cannot serve as asked."""
    if not request.request_id:
        raise UserError("request_id is empty")
    input_ids = check_input(request, info)
    check_unsupported(request)
    check_disaggregated(request)
    disagg = None
    if request.HasField("disaggregated_params"):
        dp = request.disaggregated_params
        disagg = DisaggParams(dp.bootstrap_host, dp.bootstrap_port, dp.bootstrap_room)
    return GenerateRequest(
        rid=request.request_id,
        input_ids=input_ids,
        # As SGLang: top logprobs come with return_logprob; without it nothing is reported.
        sampling=to_sampling_params(request.sampling_params, len(input_ids), info,
                                    request.top_logprobs_num if request.return_logprob else 0),
        stream=request.stream,
        disagg=disagg,
        return_logprob=request.return_logprob,
    )


def _fill_logprobs(out: pb.OutputLogProbs, token_ids: Sequence[int], logprobs: Sequence[float],
                   top: Sequence[TopLogprobs]) -> None:
    """OutputLogProbs as SGLang's servicer fills it: one entry per token, one TopLogProbs per token."""
    if logprobs:
        out.token_logprobs.extend(logprobs)
        out.token_ids.extend(token_ids)
    for entry in top:
        out.top_logprobs.add(values=entry.logprobs, token_ids=entry.token_ids)


def chunk_response(rid: str, token_ids: tuple[int, ...], logprobs: tuple[float, ...],
                   prompt_tokens: int, completion_tokens: int,
                   top: Sequence[TopLogprobs] = ()) -> pb.GenerateResponse:
    """One streamed increment; the counts are cumulative, as SGLang sends them."""
    chunk = pb.GenerateStreamChunk(token_ids=token_ids, prompt_tokens=prompt_tokens,
                                   completion_tokens=completion_tokens)
    _fill_logprobs(chunk.output_logprobs, token_ids, logprobs, top)
    return pb.GenerateResponse(request_id=rid, chunk=chunk)


def complete_response(rid: str, output_ids: list[int], logprobs: list[float],
                      finished: Finished, top: Sequence[TopLogprobs] = ()) -> pb.GenerateResponse:
    """The terminal message. `output_ids` is everything not yet sent in chunks (see servicer)."""
    complete = pb.GenerateComplete(
        output_ids=output_ids,
        finish_reason=finished.reason,
        prompt_tokens=finished.prompt_tokens,
        completion_tokens=finished.completion_tokens,
        cached_tokens=finished.cached_tokens,
    )
    _fill_logprobs(complete.output_logprobs, output_ids, logprobs, top)
    if isinstance(finished.matched_stop, int):
        complete.matched_token_id = finished.matched_stop
    elif isinstance(finished.matched_stop, str):
        complete.matched_stop_str = finished.matched_stop
    return pb.GenerateResponse(request_id=rid, complete=complete)


def failure_status(failed: Failed) -> tuple[grpc.StatusCode, str]:
    return STATUS_FOR_FAILURE.get(failed.code, grpc.StatusCode.INTERNAL), failed.message

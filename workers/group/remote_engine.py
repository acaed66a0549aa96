"""`RemoteEngine`: another rank's engine as a `WorkerEngine`, over its internal SglangScheduler port.

Rank 0 of a group hands a request to the DP rank that runs it through this class. The follower
rank serves the same servicer as any worker (validation, one terminal outcome, abort on cancel)
on an internal port, so this is a thin translation: our request types to the proto, the
streamed chunks and the complete message (or the gRPC status) back to events. Requests go out
streaming, so every token arrives as it is produced.
"""
from __future__ import annotations

import logging
from typing import AsyncIterator

import grpc
from google.protobuf.struct_pb2 import Struct
from smg_grpc_proto import sglang_scheduler_pb2 as pb
from smg_grpc_proto import sglang_scheduler_pb2_grpc as pb_grpc

from deepseek_pd.model.sampling.sampled_host import TopLogprobs
from deepseek_pd.workers.engine.interface import (
    Event, Failed, FailureCode, Finished, GenerateRequest, Loads, TokenChunk)
from deepseek_pd.workers.api.proto_convert import STATUS_FOR_FAILURE

log = logging.getLogger(__name__)

_FAILURE_FOR_STATUS = {status: code for code, status in STATUS_FOR_FAILURE.items()}
_CHANNEL_OPTIONS = [("grpc.max_receive_message_length", 64 << 20), ("grpc.max_send_message_length", 64 << 20)]


def to_proto(request: GenerateRequest) -> pb.GenerateRequest:
    """Our validated request as the proto the follower's servicer reads back (lossless for what we use)."""
    sp = request.sampling
    sampling = pb.SamplingParams(
        max_new_tokens=sp.max_new_tokens, temperature=sp.temperature, top_p=sp.top_p, top_k=sp.top_k,
        min_p=sp.min_p, repetition_penalty=sp.repetition_penalty, frequency_penalty=sp.frequency_penalty,
        presence_penalty=sp.presence_penalty, stop_token_ids=list(sp.stop_token_ids), stop=list(sp.stop),
        ignore_eos=sp.ignore_eos, skip_special_tokens=sp.skip_special_tokens, n=1)
    if sp.seed is not None:
        custom = Struct()
        custom.update({"seed": sp.seed})
        sampling.custom_params.CopyFrom(custom)
    message = pb.GenerateRequest(request_id=request.rid, sampling_params=sampling, stream=True,
                                 return_logprob=request.return_logprob, logprob_start_len=-1,
                                 top_logprobs_num=sp.top_logprobs_num)
    message.tokenized.input_ids.extend(request.input_ids)
    if request.disagg is not None:
        d = request.disagg
        message.disaggregated_params.bootstrap_host = d.bootstrap_host
        message.disaggregated_params.bootstrap_port = d.bootstrap_port
        message.disaggregated_params.bootstrap_room = d.bootstrap_room
    return message


def _token_chunk(token_ids, logprobs: pb.OutputLogProbs) -> TokenChunk:
    top = tuple(TopLogprobs(tuple(entry.token_ids), tuple(entry.values)) for entry in logprobs.top_logprobs)
    return TokenChunk(tuple(token_ids), tuple(logprobs.token_logprobs), top)


class RemoteEngine:
    """One follower rank's engine, reached at `address` (host:port of its internal server)."""

    def __init__(self, address: str, rank: int, page_size: int) -> None:
        self.address = address
        self.rank = rank
        self.page_size = page_size  # GetLoads counts tokens; Loads counts pages
        self._channel = grpc.aio.insecure_channel(address, options=_CHANNEL_OPTIONS)
        self._stub = pb_grpc.SglangSchedulerStub(self._channel)
        self.num_running = 0  # requests of this rank in flight (rank 0's view, for loads)
        self.broken: str | None = None

    async def generate(self, request: GenerateRequest) -> AsyncIterator[Event]:
        self.num_running += 1
        call = self._stub.Generate(to_proto(request))
        try:
            async for response in call:
                kind = response.WhichOneof("response")
                if kind == "chunk":
                    chunk = response.chunk
                    yield _token_chunk(chunk.token_ids, chunk.output_logprobs)
                elif kind == "complete":
                    done = response.complete
                    if done.output_ids:  # not sent in chunks (we always ask to stream; be safe)
                        yield _token_chunk(done.output_ids, done.output_logprobs)
                    matched = done.WhichOneof("matched_stop")
                    yield Finished(done.finish_reason, done.prompt_tokens, done.completion_tokens,
                                   cached_tokens=done.cached_tokens,
                                   matched_stop=getattr(done, matched) if matched else None)
                    return
            yield Failed(FailureCode.INTERNAL, f"rank {self.rank} ended request {request.rid} without a result")
        except grpc.aio.AioRpcError as exc:
            code = _FAILURE_FOR_STATUS.get(exc.code(), FailureCode.UNAVAILABLE)
            if exc.code() in (grpc.StatusCode.UNAVAILABLE, grpc.StatusCode.CANCELLED):
                code = FailureCode.UNAVAILABLE
            yield Failed(code, exc.details() or f"rank {self.rank}: {exc.code().name}")
        finally:
            self.num_running -= 1
            call.cancel()  # a consumer that left early aborts the request on the follower

    async def abort(self, rid: str) -> bool:
        try:
            reply = await self._stub.Abort(pb.AbortRequest(request_id=rid, reason="aborted on rank 0"), timeout=5)
        except grpc.aio.AioRpcError:
            return False
        return reply.success

    async def fetch_loads(self) -> Loads | None:
        """The follower's own loads (kv pages included), or None if it does not answer."""
        try:
            reply = await self._stub.GetLoads(pb.GetLoadsRequest(), timeout=2)
        except grpc.aio.AioRpcError:
            return None
        load = reply.loads[0]
        page = self.page_size
        return Loads(load.num_running_reqs, load.num_waiting_reqs, load.num_used_tokens // page,
                     load.max_total_num_tokens // page)

    async def close(self) -> None:
        await self._channel.close()

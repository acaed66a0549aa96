"""The router's PD dual dispatch, done by hand: one Generate to the prefill worker and one to the
decode worker, same request id and bootstrap room, at the same time.

Used by tests and benchmarks that want the worker pair without the router in between. The user
visible result is the decode side's; the prefill side must finish with one token (its own
"length" completion). If either side fails, the other is expected to fail too (that is the
bootstrap channel's job), and both outcomes are reported.
"""
from __future__ import annotations

import asyncio
import random
import time
import uuid
from dataclasses import dataclass

import grpc
from smg_grpc_proto import sglang_scheduler_pb2 as pb

from deepseek_pd.client.router_http import GenerateResult
from deepseek_pd.client.scheduler_grpc import SchedulerClient, collect


@dataclass
class PDResult:
    output_ids: list[int]
    finish_reason: str
    prefill_ids: list[int]
    prefill_error: grpc.aio.AioRpcError | None = None
    decode_error: grpc.aio.AioRpcError | None = None

    @property
    def ok(self) -> bool:
        return self.prefill_error is None and self.decode_error is None


class PDClient:
    def __init__(self, prefill_address: str, bootstrap_host: str, bootstrap_port: int,
                 decode_address: str) -> None:
        self.prefill = SchedulerClient(prefill_address)
        self.decode = SchedulerClient(decode_address)
        self.bootstrap_host = bootstrap_host
        self.bootstrap_port = bootstrap_port

    async def close(self) -> None:
        await self.prefill.close()
        await self.decode.close()

    async def __aenter__(self) -> "PDClient":
        return self

    async def __aexit__(self, *exc_info) -> None:
        await self.close()

    def build_request(self, input_ids: list[int], sampling: pb.SamplingParams, stream: bool = False,
                      request_id: str | None = None, room: int | None = None) -> pb.GenerateRequest:
        return pb.GenerateRequest(
            request_id=request_id or f"pd-{uuid.uuid4().hex}",
            tokenized=pb.TokenizedInput(input_ids=input_ids),
            sampling_params=sampling,
            stream=stream,
            disaggregated_params=pb.DisaggregatedParams(
                bootstrap_host=self.bootstrap_host, bootstrap_port=self.bootstrap_port,
                bootstrap_room=room if room is not None else random.randrange(0, 2**31 - 1)),
        )

    async def generate(self, input_ids: list[int], sampling: pb.SamplingParams, stream: bool = False,
                       timeout_s: float | None = 120.0, request_id: str | None = None,
                       room: int | None = None) -> PDResult:
        request = self.build_request(input_ids, sampling, stream, request_id, room)
        prefill, decode = await asyncio.gather(
            collect(self.prefill.generate(request, timeout_s)),
            collect(self.decode.generate(request, timeout_s)),
            return_exceptions=True)
        result = PDResult(output_ids=[], finish_reason="", prefill_ids=[])
        if isinstance(prefill, grpc.aio.AioRpcError):
            result.prefill_error = prefill
        elif isinstance(prefill, BaseException):
            raise prefill
        else:
            result.prefill_ids = prefill[0]
        if isinstance(decode, grpc.aio.AioRpcError):
            result.decode_error = decode
        elif isinstance(decode, BaseException):
            raise decode
        else:
            result.output_ids, complete = decode
            result.finish_reason = complete.finish_reason
        return result

    async def generate_timed(self, input_ids: list[int], sampling: pb.SamplingParams,
                             timeout_s: float | None = 600.0) -> GenerateResult:
        """Streams from the decode side with arrival times (for benchmarks); raises on failure."""
        request = self.build_request(input_ids, sampling, stream=True)
        result = GenerateResult(start_time=time.perf_counter(), prompt_tokens=len(input_ids))
        prefill = asyncio.create_task(collect(self.prefill.generate(request, timeout_s)))
        try:
            async for response in self.decode.generate(request, timeout_s):
                kind = response.WhichOneof("response")
                ids = response.chunk.token_ids if kind == "chunk" else response.complete.output_ids
                if ids:
                    now = time.perf_counter()
                    if result.first_token_time is None:
                        result.first_token_time = now
                    result.chunk_times.append(now)
                    result.chunk_token_counts.append(len(ids))
                    result.output_ids.extend(ids)
                if kind == "complete":
                    result.finish_reason = response.complete.finish_reason
                    result.completion_tokens = response.complete.completion_tokens
                    result.cached_tokens = response.complete.cached_tokens
            result.end_time = time.perf_counter()
            await prefill  # a prefill-side failure is a failed request too
        finally:
            if not prefill.done():
                prefill.cancel()
        return result

"""Async client for one worker's SglangScheduler API (what the router calls, minus the routing)."""
from __future__ import annotations

from typing import AsyncIterator

import grpc
from smg_grpc_proto import sglang_scheduler_pb2 as pb
from smg_grpc_proto import sglang_scheduler_pb2_grpc as pb_grpc


def sampling_proto(max_new_tokens: int = 16, temperature: float = 0.0, top_p: float = 1.0,
                   top_k: int = -1, repetition_penalty: float = 1.0, **fields) -> pb.SamplingParams:
    """Proto sampling params with SGLang's defaults filled in, as the router fills them."""
    return pb.SamplingParams(max_new_tokens=max_new_tokens, temperature=temperature, top_p=top_p,
                             top_k=top_k, repetition_penalty=repetition_penalty,
                             skip_special_tokens=True, n=1, **fields)


class SchedulerClient:
    def __init__(self, address: str) -> None:
        self.address = address
        self._channel = grpc.aio.insecure_channel(address)
        self.stub = pb_grpc.SglangSchedulerStub(self._channel)

    async def close(self) -> None:
        await self._channel.close()

    async def __aenter__(self) -> "SchedulerClient":
        return self

    async def __aexit__(self, *exc_info) -> None:
        await self.close()

    async def health(self, timeout_s: float = 5.0) -> pb.HealthCheckResponse:
        return await self.stub.HealthCheck(pb.HealthCheckRequest(), timeout=timeout_s)

    async def model_info(self, timeout_s: float = 5.0) -> pb.GetModelInfoResponse:
        return await self.stub.GetModelInfo(pb.GetModelInfoRequest(), timeout=timeout_s)

    async def server_info(self, timeout_s: float = 5.0) -> pb.GetServerInfoResponse:
        return await self.stub.GetServerInfo(pb.GetServerInfoRequest(), timeout=timeout_s)

    async def loads(self, timeout_s: float = 5.0) -> pb.SchedulerLoad:
        reply = await self.stub.GetLoads(pb.GetLoadsRequest(), timeout=timeout_s)
        return reply.loads[0]

    async def abort(self, request_id: str, reason: str = "") -> bool:
        reply = await self.stub.Abort(pb.AbortRequest(request_id=request_id, reason=reason))
        return reply.success

    def generate(self, request: pb.GenerateRequest,
                 timeout_s: float | None = None) -> AsyncIterator[pb.GenerateResponse]:
        """The raw response stream; a failure surfaces as grpc.aio.AioRpcError while iterating."""
        return self.stub.Generate(request, timeout=timeout_s)


async def collect(responses: AsyncIterator[pb.GenerateResponse]) -> tuple[list[int], pb.GenerateComplete]:
    """Output ids (chunks + complete) and the complete message of one Generate call."""
    ids: list[int] = []
    async for response in responses:
        kind = response.WhichOneof("response")
        if kind == "chunk":
            ids.extend(response.chunk.token_ids)
        elif kind == "complete":
            ids.extend(response.complete.output_ids)
            return ids, response.complete
    raise RuntimeError("Generate stream ended without a complete message")

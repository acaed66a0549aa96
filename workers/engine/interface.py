"""The boundary between the gRPC surface and a worker's engine.

The SglangScheduler servicer (workers/api) translates proto messages into these types and
back; the prefill, decode and colocated engines implement `WorkerEngine` and know nothing of
SGLang's proto. That keeps the wire format in one place and lets tests drive an engine directly.

Event stream of one request, as `WorkerEngine.generate` yields it:

    TokenChunk(token_ids=[5])        # zero or more; streaming sends each, unary concatenates
    TokenChunk(token_ids=[9, 17])
    Finished(reason="stop", ...)     # exactly one terminal event: Finished or Failed

Prefill engines in PD mode yield one `TokenChunk` with the first sampled token and then
`Finished(reason="length")`; the decode engine produces the user-visible stream.
"""
from __future__ import annotations

import enum
from dataclasses import dataclass
from typing import AsyncIterator, Protocol, Union

from deepseek_pd.model.sampling.sampled_host import TopLogprobs
from deepseek_pd.model.sampling.params import SamplingParams


@dataclass(frozen=True)
class DisaggParams:
    """Where the decode side finds the prefill side, as the router sets them."""

    bootstrap_host: str
    bootstrap_port: int
    bootstrap_room: int


@dataclass(frozen=True)
class GenerateRequest:
    rid: str
    input_ids: tuple[int, ...]
    sampling: SamplingParams
    stream: bool = True
    disagg: DisaggParams | None = None  # None: colocated generation
    return_logprob: bool = False  # the sampled tokens' logprobs; top logprobs: sampling.top_logprobs_num


@dataclass(frozen=True)
class TokenChunk:
    token_ids: tuple[int, ...]
    logprobs: tuple[float, ...] = ()  # one per token with return_logprob, else empty
    top_logprobs: tuple[TopLogprobs, ...] = ()  # one per token with sampling.top_logprobs_num > 0, else empty


class FailureCode(enum.Enum):
    """Maps onto gRPC status codes at the servicer."""

    INVALID_ARGUMENT = "invalid_argument"
    RESOURCE_EXHAUSTED = "resource_exhausted"  # KV pool cannot admit the request
    DEADLINE_EXCEEDED = "deadline_exceeded"  # handshake or transfer timed out
    UNAVAILABLE = "unavailable"  # peer (prefill/decode/bootstrap) unreachable or died
    ABORTED = "aborted"  # Abort RPC or client cancel
    INTERNAL = "internal"


@dataclass(frozen=True)
class Finished:
    reason: str  # "stop" | "length" | "abort"
    prompt_tokens: int
    completion_tokens: int
    cached_tokens: int = 0
    matched_stop: Union[int, str, None] = None


@dataclass(frozen=True)
class Failed:
    code: FailureCode
    message: str


Event = Union[TokenChunk, Finished, Failed]


@dataclass(frozen=True)
class Loads:
    """A worker's load, as GetLoads and the metrics report it."""

    num_running: int
    num_waiting: int
    kv_used_pages: int  # held by requests (prefix-cache pages excluded)
    kv_total_pages: int
    cached_pages: int = 0  # prefill: held by the prefix cache (evictable)
    reserved_pages: int = 0  # decode: promised to requests whose KV is still arriving
    in_flight_per_dp_rank: tuple[int, ...] = ()  # a multi-rank group's front: requests per DP rank


class WorkerEngine(Protocol):
    """What the servicer needs from a worker; prefill, decode and colocated engines implement it."""

    async def generate(self, request: GenerateRequest) -> AsyncIterator[Event]:
        """Yields the request's events; the last one is Finished or Failed, exactly once."""
        ...

    async def abort(self, rid: str) -> bool:
        """Stops the request and frees its KV pages at once. False if it is unknown."""
        ...

    def loads(self) -> Loads: ...

    def is_healthy(self) -> bool: ...

"""`sglang.grpc.scheduler.SglangScheduler` over a `WorkerEngine`: the surface the router talks to.

One servicer class serves prefill, decode and colocated workers; the role only shows in
GetServerInfo. The wire behaviour follows SGLang's own gRPC server, which the router expects:

- `stream=true`: one `chunk` per engine `TokenChunk`, then one `complete` carrying the finish
  reason and usage with an empty `output_ids` (every token has already gone out in a chunk).
  With logprobs asked for, chunks are cut at whole text pieces instead (text_pieces.py), since
  the router drops the logprobs of a chunk that decodes to no text.
- `stream=false`: a single `complete` with all `output_ids`.
- Errors end the call with a gRPC status (INVALID_ARGUMENT for bad input, FailureCode mapping
  for engine failures), never with a half-written message. Exactly one terminal outcome.
- A client that goes away (router cancel, dropped connection) aborts the request in the engine,
  so its KV pages are freed at once rather than when generation would have ended.
"""
from __future__ import annotations

import asyncio
import datetime
import logging
import time
from dataclasses import asdict, dataclass

import grpc
from google.protobuf.struct_pb2 import Struct
from smg_grpc_proto.generated import common_pb2
from smg_grpc_proto import sglang_scheduler_pb2 as pb
from smg_grpc_proto import sglang_scheduler_pb2_grpc as pb_grpc

from deepseek_pd import __version__ as package_version
from deepseek_pd.errors import UserError
from deepseek_pd.model.checkpoint.model_dir import load_tokenizer
from deepseek_pd.workers.engine.interface import Failed, Finished, TokenChunk, WorkerEngine
from deepseek_pd.workers.metrics.worker_metrics import WorkerMetrics
from deepseek_pd.workers.api.proto_convert import (
    chunk_response, complete_response, failure_status, to_generate_request)
from deepseek_pd.workers.api.served_model import ServedModelInfo
from deepseek_pd.workers.api.text_pieces import TextPieces
from deepseek_pd.workers.api.tokenizer_bundle import build_bundle, iter_chunks

logger = logging.getLogger(__name__)

_NOT_LOADED = object()  # the servicer's tokenizer before its first use (None: the model has none)


@dataclass(frozen=True)
class WorkerIdentity:
    """What GetServerInfo reports about this worker process (SGLang's server_args names).

    Built once by `serve` with the rest of the resolved config (`ServeConfig`); `page_size` is the
    runner's KV page size, which turns the engine's page counts into the tokens GetLoads reports;
    `kv_bytes_per_token` is its KV pool's latent bytes per token in the runtime dtype (a `--dtype`
    that differs from the checkpoint's changes it), reported for `bench serving`; 0: unknown.
    """

    role: str  # "prefill" | "decode" | "colocated"
    kv_transport: str = ""
    bootstrap_port: int = 0
    page_size: int = 1
    host: str = ""
    port: int = 0
    kv_bytes_per_token: int = 0

    def __post_init__(self) -> None:
        if self.page_size < 1:
            raise ValueError(f"WorkerIdentity.page_size must be >= 1, got {self.page_size}")
        if self.kv_bytes_per_token < 0:
            raise ValueError(f"WorkerIdentity.kv_bytes_per_token must be >= 0, got {self.kv_bytes_per_token}")


class SchedulerServicer(pb_grpc.SglangSchedulerServicer):
    """Validates, dispatches to the engine and translates its event stream back to proto."""

    def __init__(self, engine: WorkerEngine, info: ServedModelInfo, identity: WorkerIdentity,
                 metrics: WorkerMetrics | None = None) -> None:
        """`metrics` hears of every request's outcome (one call per request, none per token)."""
        self._engine = engine
        self._metrics = metrics if metrics is not None else WorkerMetrics()
        self._info = info
        self._identity = identity
        self._inflight: set[str] = set()
        self._draining = False
        self._start_time = time.time()
        self._tokenizer_bundle: bytes | None = None  # built on first GetTokenizer
        self._tokenizer = _NOT_LOADED  # loaded for the first streamed request with logprobs

    # -- lifecycle ---------------------------------------------------------------------------
    def start_draining(self) -> None:
        """New requests are refused (UNAVAILABLE) and HealthCheck turns unhealthy; running ones go on."""
        self._draining = True

    @property
    def num_inflight(self) -> int:
        return len(self._inflight)

    # -- Generate ----------------------------------------------------------------------------
    async def Generate(self, request: pb.GenerateRequest, context: grpc.aio.ServicerContext):
        try:
            req = to_generate_request(request, self._info)
        except UserError as exc:
            logger.info("rejected request %s: %s", request.request_id, exc)
            self._metrics.count_failed_request("invalid_argument")
            await context.abort(grpc.StatusCode.INVALID_ARGUMENT, str(exc))
        if self._draining:
            await context.abort(grpc.StatusCode.UNAVAILABLE, "worker is shutting down")
        if req.rid in self._inflight:
            await context.abort(grpc.StatusCode.ALREADY_EXISTS,
                                f"request_id {req.rid!r} is already running on this worker")
        self._inflight.add(req.rid)
        started = time.perf_counter()
        # The headers now, not with the first message: the router's PD dispatch opens the prefill
        # and the decode call together and streams decode's first token only once both calls
        # have their headers. A prefill worker's one message follows decode's confirmed
        # TransferDone, so headers sent with it held the client's first token behind that round
        # trip (bench/ttft_pipeline_cpu.py; errors found above still end the call before headers).
        try:
            await context.send_initial_metadata(())
        except BaseException:  # the client went away already: the request never started
            self._inflight.discard(req.rid)
            raise
        first_token_at: float | None = None
        events = self._engine.generate(req)
        terminal_seen = False
        counted = False  # the outcome went to the metrics
        sent_ids: list[int] = []
        sent_logprobs: list[float] = []
        sent_top: list = []  # TopLogprobs per token, when asked
        pieces = self._text_pieces(req)
        try:
            async for event in events:
                if isinstance(event, TokenChunk):
                    if first_token_at is None:
                        first_token_at = time.perf_counter()
                    if pieces is not None:
                        event = pieces.push(event)
                        if event is None:
                            continue
                    sent_ids.extend(event.token_ids)
                    sent_logprobs.extend(event.logprobs)
                    sent_top.extend(event.top_logprobs)
                    if req.stream:
                        yield chunk_response(req.rid, event.token_ids, event.logprobs,
                                             len(req.input_ids), len(sent_ids), event.top_logprobs)
                elif isinstance(event, Finished):
                    tail = pieces.finish() if pieces is not None else None
                    if tail is not None:
                        sent_ids.extend(tail.token_ids)
                        yield chunk_response(req.rid, tail.token_ids, tail.logprobs,
                                             len(req.input_ids), len(sent_ids), tail.top_logprobs)
                    terminal_seen = counted = True
                    self._metrics.observe_request(
                        event.reason, event.prompt_tokens, event.completion_tokens, event.cached_tokens,
                        None if first_token_at is None else first_token_at - started, time.perf_counter() - started)
                    if req.stream:
                        yield complete_response(req.rid, [], [], event)
                    else:
                        yield complete_response(req.rid, sent_ids, sent_logprobs, event, sent_top)
                    return
                elif isinstance(event, Failed):
                    terminal_seen = counted = True
                    self._metrics.count_failed_request(event.code.value)
                    code, message = failure_status(event)
                    await context.abort(code, message)
            terminal_seen = counted = True
            self._metrics.count_failed_request("internal")
            await context.abort(grpc.StatusCode.INTERNAL,
                                f"engine ended request {req.rid} without a terminal event")
        except (grpc.aio.AbortError, asyncio.CancelledError, GeneratorExit):
            raise
        except Exception as exc:  # an engine bug: one clear status, never a hang
            logger.exception("request %s failed inside the engine", req.rid)
            terminal_seen = False
            counted = True
            self._metrics.count_failed_request("internal")
            await context.abort(grpc.StatusCode.INTERNAL, f"internal error: {type(exc).__name__}: {exc}")
        finally:
            try:
                if not counted:  # the caller left before the engine's terminal event
                    self._metrics.count_failed_request("cancelled")
                if not terminal_seen:
                    # The caller left (or the engine broke): free the request's pages now.
                    logger.info("request %s ended before its engine finished it (client cancelled or "
                                "engine error); aborting it", req.rid)
                    await _shielded(self._engine.abort(req.rid))
                await _shielded(events.aclose())
            finally:
                # Only now may the id be reused: a retry with the same id must not meet our abort.
                self._inflight.discard(req.rid)

    def _text_pieces(self, req) -> TextPieces | None:
        """A streamed request with logprobs is sent in whole text pieces (text_pieces.py says why)."""
        if not (req.stream and req.return_logprob):
            return None
        if self._tokenizer is _NOT_LOADED:
            self._tokenizer = load_tokenizer(self._info.tokenizer_path)
        if self._tokenizer is None:
            return None
        return TextPieces(self._tokenizer, req.sampling.skip_special_tokens)

    # -- management --------------------------------------------------------------------------
    async def HealthCheck(self, request, context) -> pb.HealthCheckResponse:
        if self._draining:
            return pb.HealthCheckResponse(healthy=False, message="shutting down")
        healthy = self._engine.is_healthy()
        return pb.HealthCheckResponse(healthy=healthy, message="ok" if healthy else "engine unhealthy")

    async def Abort(self, request: pb.AbortRequest, context) -> pb.AbortResponse:
        found = await self._engine.abort(request.request_id)
        logger.info("abort %s (%s): %s", request.request_id, request.reason or "no reason",
                    "aborted" if found else "not found")
        return pb.AbortResponse(success=found, message="aborted" if found else "unknown request_id")

    async def GetModelInfo(self, request, context) -> pb.GetModelInfoResponse:
        info = self._info
        return pb.GetModelInfoResponse(
            model_path=info.model_path,
            tokenizer_path=info.tokenizer_path,
            is_generation=True,
            served_model_name=info.served_model_name,
            max_context_length=info.max_context_length,
            vocab_size=info.vocab_size,
            supports_vision=False,
            model_type=info.model_type,
            eos_token_ids=list(info.eos_token_ids),
            pad_token_id=info.pad_token_id,
            bos_token_id=info.bos_token_id,
            max_req_input_len=info.max_request_input_len,
            architectures=list(info.architectures),
        )

    async def GetTokenizer(self, request, context):
        """The tokenizer files as a zip, for a router that does not have the checkpoint."""
        if self._tokenizer_bundle is None:
            self._tokenizer_bundle = build_bundle(self._info.tokenizer_path)
        for data, digest in iter_chunks(self._tokenizer_bundle):
            yield common_pb2.GetTokenizerChunk(data=data, sha256=digest)

    async def GetServerInfo(self, request, context) -> pb.GetServerInfoResponse:
        ident = self._identity
        server_args = Struct()
        server_args.update({
            "model_path": self._info.model_path,
            "tokenizer_path": self._info.tokenizer_path,
            "served_model_name": self._info.served_model_name,
            "disaggregation_mode": "null" if ident.role == "colocated" else ident.role,
            "disaggregation_transfer_backend": ident.kv_transport,
            "disaggregation_bootstrap_port": ident.bootstrap_port,
            "page_size": ident.page_size,
            "host": ident.host,
            "port": ident.port,
            "context_length": self._info.max_context_length,
        })
        loads = self._engine.loads()
        scheduler_info = Struct()
        scheduler_info.update({"identity": asdict(ident), "kv_total_pages": loads.kv_total_pages})
        if ident.kv_bytes_per_token:  # where deepseek_pd/loadgen/target_model.py looks for it
            server_args.update({"kv_bytes_per_token": ident.kv_bytes_per_token})
            scheduler_info.update({"kv_bytes_per_token": ident.kv_bytes_per_token})
        response = pb.GetServerInfoResponse(
            server_args=server_args,
            scheduler_info=scheduler_info,
            active_requests=len(self._inflight),
            is_paused=self._draining,
            uptime_seconds=time.time() - self._start_time,
            sglang_version=f"deepseek-pd {package_version}",
            server_type="grpc",
            max_total_num_tokens=loads.kv_total_pages * ident.page_size,
        )
        response.start_time.FromSeconds(int(self._start_time))
        return response

    async def GetLoads(self, request: pb.GetLoadsRequest, context) -> pb.GetLoadsResponse:
        loads = self._engine.loads()
        page = self._identity.page_size
        used, total = loads.kv_used_pages * page, loads.kv_total_pages * page
        usage = used / total if total else 0.0
        load = pb.SchedulerLoad(
            dp_rank=0,
            num_running_reqs=loads.num_running,
            num_waiting_reqs=loads.num_waiting,
            num_total_reqs=loads.num_running + loads.num_waiting,
            num_used_tokens=used,
            max_total_num_tokens=total,
            token_usage=usage,
            utilization=usage,
        )
        load.disaggregation.mode = "null" if self._identity.role == "colocated" else self._identity.role
        return pb.GetLoadsResponse(
            timestamp=datetime.datetime.now(datetime.timezone.utc).isoformat(),
            version=f"deepseek-pd {package_version}",
            dp_rank_count=1,
            loads=[load],
            aggregate=pb.AggregateMetrics(
                total_running_reqs=loads.num_running,
                total_waiting_reqs=loads.num_waiting,
                total_reqs=loads.num_running + loads.num_waiting,
                avg_token_usage=usage,
                avg_utilization=usage,
            ),
        )


async def _shielded(awaitable) -> None:
    """Cleanup that must finish even though the surrounding call was cancelled."""
    try:
        await asyncio.shield(asyncio.ensure_future(awaitable))
    except asyncio.CancelledError:
        pass
    except Exception:  # cleanup must not mask the original outcome
        logger.exception("cleanup failed")

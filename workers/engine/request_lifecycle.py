"""The part of a request's life that both worker engines share, written once.

Every engine (prefill, decode, colocated) keeps a table of running requests by id and runs one
scheduler task beside the model thread. A request's life in any of them:

    generate(req)  -> `open_request`: a duplicate id, a bad prompt or bad sampling values end it
                      at once with INVALID_ARGUMENT; else its `SamplingState` is built
    its steps      -> each wait goes through `record.watch(...)`, which an abort (or whatever
                      else the role says ends it early, `RequestRecord.stops`) cuts short with
                      the role's `RequestFailure`
    abort(rid)     -> `record.abort(message)`: the role's way of telling its waits to stop
    stop()         -> every request aborted, the scheduler cancelled, the role's transport
                      closed (`_close`), the model thread shut down

What a role does differently sits in the subclasses: which futures end a wait and what failure
that is (`stops`, `interruption`), what an abort sets (`abort`), what the engine closes (`_close`).

    class _Request(RequestRecord):           # decode: the Abort RPC is the one early stop
        def stops(self): return (self.aborted,)
        def interruption(self, stop): return RequestAborted(stop.result())
"""
from __future__ import annotations

import asyncio
from dataclasses import dataclass, field
from typing import Any, Awaitable, Coroutine, Generic, TypeVar

from deepseek_pd.errors import UserError
from deepseek_pd.workers.engine.request_rules import check_prompt
from deepseek_pd.model.runner import ModelRunner
from deepseek_pd.model.sampling.sampler import Sampler, SamplingState
from deepseek_pd.workers.engine.interface import GenerateRequest
from deepseek_pd.workers.metrics.worker_metrics import WorkerMetrics
from deepseek_pd.workers.engine.model_thread import ModelThread
from deepseek_pd.workers.engine.model_warm_up import wants_warm_up, warm_up
from deepseek_pd.workers.engine.prefill_round import PrefillRounds
from deepseek_pd.workers.engine.request_failure import RequestFailure
from deepseek_pd.workers.engine.request_watch import Interrupted, unless

T = TypeVar("T")


@dataclass(eq=False)
class RequestRecord:
    """An engine's record of one running request; a role subclasses it with its own state.

    `ended` is set once `generate` is done with it: its pages go back as soon as no forward uses
    them (each role knows when that is).
    """

    request: GenerateRequest
    sampling: SamplingState
    ended: bool = field(default=False, kw_only=True)

    @property
    def rid(self) -> str:
        return self.request.rid

    def stops(self) -> tuple[asyncio.Future, ...]:
        """Futures whose completion ends any wait of this request early."""
        raise NotImplementedError

    def interruption(self, stop: asyncio.Future) -> RequestFailure:
        """The failure this request ends with because `stop` (one of `stops()`) completed."""
        raise NotImplementedError

    def abort(self, message: str) -> None:
        """Makes the request end with ABORTED: completes one of `stops()` (idempotent)."""
        raise NotImplementedError

    async def watch(self, awaitable: Awaitable[T]) -> T:
        """Awaits `awaitable` unless one of `stops()` completes first: then cancels it and raises
        `interruption(that stop)`."""
        try:
            return await unless(awaitable, *self.stops())
        except Interrupted as exc:
            raise self.interruption(exc.stop) from None


R = TypeVar("R", bound=RequestRecord)


class EngineCore(Generic[R]):
    """The request table, scheduler task and shutdown of a `WorkerEngine`; roles subclass it.

    `model_thread` (default: a `ModelThread` named `thread_name`) is a `LockstepModelThread` when
    the engine is one rank of a group. `metrics` hears of every step and KV transfer.
    """

    def __init__(self, runner: ModelRunner, config: Any, model_thread, metrics: WorkerMetrics | None,
                 thread_name: str) -> None:
        """`config` is the role's `WorkerConfig` (workers/transport/worker_config.py), kept as
        `self.config` for the role: the core reads none of it, so it knows no transport."""
        self.runner = runner
        self.config = config
        self.metrics = metrics if metrics is not None else WorkerMetrics()
        self.metrics.watch_paths("extend", lambda: runner.extend_paths)  # every role extends
        self.pool = runner.kv_pool
        self.sampler = Sampler()
        self.model_thread = model_thread if model_thread is not None else ModelThread(thread_name)
        self._requests: dict[str, R] = {}
        self._wakeup = asyncio.Event()  # set when the scheduler may have work
        self._loop_task: asyncio.Task | None = None

    @property
    def max_context(self) -> int:
        """Prompt plus output tokens one request may hold (the model's position limit)."""
        return self.runner.model_config.max_position_embeddings

    def open_request(self, request: GenerateRequest) -> SamplingState:
        """The checks every engine applies before it holds anything for `request`; its sampling state.

        Raises UserError (-> INVALID_ARGUMENT) for an id that is already running, a prompt no forward
        may see, or sampling values the model cannot honour.
        """
        if request.rid in self._requests:
            raise UserError(f"request id {request.rid!r} is already running")
        model_config = self.runner.model_config
        check_prompt(request.input_ids, model_config.vocab_size, self.max_context)
        request.sampling.validate(model_config.vocab_size)
        return SamplingState.create(request.sampling, request.input_ids, model_config.vocab_size,
                                    device=self.runner.model.options.device)

    async def _warm_up_model(self, rounds: PrefillRounds) -> None:
        """Before serving, the model thread runs the extends the first requests would, through the
        role's `rounds` (workers/engine/model_warm_up.py), where its rule says so; both roles call
        this in `start`."""
        if wants_warm_up(self.runner):
            await self.model_thread.run(warm_up, rounds)

    def _start_scheduler(self, loop: Coroutine, name: str) -> None:
        self._loop_task = asyncio.create_task(loop, name=name)

    async def abort(self, rid: str) -> bool:
        """Ends request `rid` with ABORTED; False if it is not running here."""
        state = self._requests.get(rid)
        if state is None:
            return False
        state.abort(f"request {rid} aborted")
        return True

    def is_healthy(self) -> bool:
        return self._loop_task is not None and not self._loop_task.done()

    async def stop(self) -> None:
        """Aborts every request, stops the scheduler, closes the role's transport, then the model thread."""
        for rid in list(self._requests):
            await self.abort(rid)
        if self._loop_task is not None:
            self._loop_task.cancel()
            await asyncio.gather(self._loop_task, return_exceptions=True)
        await self._close()
        self.model_thread.close()

    async def _close(self) -> None:
        """The role's own shutdown (bootstrap server, KV sender or receiver), after the scheduler stopped."""

"""The decode worker's engine: PD requests (KV from a prefill worker) and colocated ones.

PD request (`disagg` set):
    admit    -> pages for the prompt + a decode reserve (PageBudget), or wait / RESOURCE_EXHAUSTED
    pull     -> handshake with the prefill bootstrap for the room; KV lands in the prompt pages;
                TransferDone brings the first token
    decode   -> joins the continuous batch (absorbed MLA over up to max_running_requests requests)
Colocated request (`disagg` None): the same, with the prompt prefilled here in chunked rounds
(`PrefillRounds`, the prefill worker's; `_AdmitHooks` admits a completed prompt into the batch) that
alternate with decode steps; it is the single-worker reference for PD parity.

The decode loop (`_decode_round`, see decode_step.py) overlaps the host with the GPU when
`scheduler.overlap_schedule` is on: step N+1 is planned and launched (its input tokens gathered
from step N's samples on the device) before step N's tokens are collected, so the GPU never waits
for the host's bookkeeping (token streaming, stop checks, page growth). A request that stops at
step N has already been launched in step N+1; that extra token is dropped. Requests that will
reach their length limit are known on the host and are not launched past it. Both schedules give
the same tokens (a tested property).

Every request ends with one Finished or Failed; its pages go back on every path, and never
while a launched step still uses them. Pages whose transfer did not pass its checks (failed,
refused, aborted) go back zeroed if the transfer may have written into them (its sink's
`exposure`, kv_transfer/exposure.py), else at once as they are. A one-sided transport's pages
wait out its late-write grace first: the zeroing happens then, not when the transfer failed, so a
write that lands late is wiped too. The zeroing runs in a worker thread, never on the event loop
(on CUDA it waits for its stream), and the pages go back to the pool once it has returned.
"""
from __future__ import annotations

import asyncio
import functools
import logging
import time
from typing import AsyncIterator, Sequence

from deepseek_pd.errors import UserError
from deepseek_pd.workers.engine.request_rules import max_new_tokens
from deepseek_pd.model.runner import ModelRunner
from deepseek_pd.model.sampling.sampled_host import SampledTokens, TopLogprobs
from deepseek_pd.model.sampling.sampler import StopChecker
from deepseek_pd.model.speculative.rules import draft_len
from deepseek_pd.workers.engine.interface import (
    Event, Failed, FailureCode, Finished, GenerateRequest, Loads, TokenChunk)
from deepseek_pd.workers.transport.first_token_wire import first_top_logprobs
from deepseek_pd.workers.transport import build_receiver
from deepseek_pd.workers.metrics.worker_metrics import WorkerMetrics
from deepseek_pd.workers.engine.prefill_round import FirstToken, PrefillRounds, RoundHooks
from deepseek_pd.workers.engine.request_failure import RequestFailure
from deepseek_pd.workers.engine.request_lifecycle import EngineCore
from deepseek_pd.workers.transport.worker_config import WorkerConfig
from deepseek_pd.workers.decode.bootstrap_client import BootstrapClient
from deepseek_pd.workers.decode.decode_step import DecodeRow, DecodeStepper, LaunchedStep
from deepseek_pd.workers.decode.kv_checks import scrub_pages
from deepseek_pd.workers.decode.kv_pull import pull_kv
from deepseek_pd.workers.decode.page_budget import PageBudget, decode_reserve_pages
from deepseek_pd.workers.decode.request_state import DecodeRequest
from deepseek_pd.workers.decode.speculative_step import PendingSpecStep, SpecRow, SpeculativeStepper, wire_draft

log = logging.getLogger(__name__)


class DecodeEngine(EngineCore[DecodeRequest]):
    """`WorkerEngine` of a decode (or colocated) worker."""

    def __init__(self, runner: ModelRunner, config: WorkerConfig, tokenizer=None, model_thread=None,
                 metrics: WorkerMetrics | None = None) -> None:
        """`tokenizer` (a `tokenizers.Tokenizer`, for stop strings; the builder passes the checkpoint's):
        without one, stop strings are refused per request. `model_thread` (default: a `ModelThread`)
        is a `LockstepModelThread` when this engine is one rank of a group. `metrics` hears of every
        step (one call per batch) and KV pull."""
        super().__init__(runner, config, model_thread, metrics, "decode-model")
        self.metrics.watch_paths("decode", lambda: runner.decode_paths)
        self.tokenizer = tokenizer
        self.stepper = DecodeStepper(runner)
        self._prefilling: list[DecodeRequest] = []
        self._running: list[DecodeRequest] = []
        self._batch: list[DecodeRequest] = []  # rows of the last launched step, in the sampling batch's order
        self._pending: LaunchedStep | None = None
        # With speculative_overlap: the launched speculative step's requests and launch, not yet collected.
        self._spec_pending: tuple[list[DecodeRequest], PendingSpecStep] | None = None
        self._background: set[asyncio.Task] = set()
        self.budget: PageBudget | None = None
        self.receiver = None
        self.client: BootstrapClient | None = None
        # Speculative decoding (workers/decode/speculative_step.py) when the runner has its MTP layer;
        # its steps replace the plain (and overlapped) decode steps.
        self.speculation: SpeculativeStepper | None = None
        if runner.model.mtp is not None:
            self.speculation = SpeculativeStepper(runner, runner.config.speculative_num_steps, self.sampler)
        # Colocated prompts are prefilled here, in rounds between decode steps.
        self.rounds = PrefillRounds(runner, self.sampler, config.scheduler.chunked_prefill_size, _AdmitHooks(self),
                                    on_step=functools.partial(self.metrics.observe_step, "prefill"),
                                    aligned=config.scheduler.deterministic)

    # ---- lifecycle -------------------------------------------------------------------------
    async def start(self) -> None:
        await self._warm_up_model(self.rounds)  # its colocated rounds' extends (decode's own: the graph capture)
        self.budget = PageBudget(self.pool, self.config.scheduler.admission_timeout_s)
        self.receiver = build_receiver(self.config.kv_transport, self.pool, self.config.transport)
        self.client = BootstrapClient(self.config.bootstrap, identity=f"decode@{self.config.transport.advertise_host}")
        if self.speculation is not None and self.runner.config.speculative_adaptive:
            costs = await self.model_thread.run(self.speculation.calibrate, self.config.scheduler.max_running_requests)
            log.info("speculative step costs (ms) at batches %s, rows k = 0..%d: %s", costs.batches,
                     costs.max_steps, [[round(ms, 2) for ms in row] for row in costs.ms])
        self._start_scheduler(self._schedule_loop(), "decode-scheduler")
        log.info("decode engine: KV transport %s, %d bytes of latent KV per token, %s schedule",
                 self.config.kv_transport, self.pool.bytes_per_token,
                 "overlap" if self.config.scheduler.overlap_schedule else "plain")

    async def _close(self) -> None:
        await asyncio.gather(*self._background, return_exceptions=True)
        if self.client is not None:
            await self.client.close()
        if self.receiver is not None:
            self.receiver.close()

    # ---- WorkerEngine ----------------------------------------------------------------------
    async def generate(self, request: GenerateRequest) -> AsyncIterator[Event]:
        prompt_len = len(request.input_ids)
        model_config = self.runner.model_config
        try:
            sampling = self.open_request(request)
            max_new = max_new_tokens(request.sampling, prompt_len, self.max_context)
            stop = StopChecker(request.sampling, model_config.eos_token_ids, self.tokenizer, max_new_tokens=max_new)
        except UserError as exc:  # bad values; stop strings without a tokenizer
            yield Failed(FailureCode.INVALID_ARGUMENT, str(exc))
            return
        state = DecodeRequest(request, sampling, stop, max_new)
        if self.speculation is not None:
            state.spec = SpecRow(list(request.input_ids), [], max_new, sampling)
        self._requests[request.rid] = state
        transfer_done = request.disagg is None
        joins_after_first = False
        try:
            prompt_pages = self.pool.pages_for_tokens(prompt_len)
            reserve = decode_reserve_pages(self.pool, prompt_len, max_new, self.config.scheduler.decode_reserve_tokens)
            state.reservation = await state.watch(self.budget.admit(prompt_pages, reserve))
            if request.disagg is not None:
                transport = self.config.kv_transport
                pages = state.reservation.pages[:prompt_pages]
                sink = self.receiver.open_sink(pages, request.disagg.bootstrap_host)
                state.unchecked_kv = sink.exposure
                try:
                    began = time.perf_counter()
                    done = await state.watch(pull_kv(
                        self.client, self.receiver, request.disagg, request.rid, prompt_len, pages,
                        model_config.vocab_size, request.sampling.top_logprobs_num, sink))
                    self.metrics.observe_kv_transfer(transport, done.bytes_sent, time.perf_counter() - began)
                except RequestFailure as exc:  # an abort too: a one-sided write may still be landing
                    self.metrics.count_kv_transfer_failure(transport, exc.code.value)
                    transfer_done = exc.peer_knows  # nothing to tell the prefill side then
                    raise
                transfer_done = True
                state.unchecked_kv = None
                # Attention TP: the other TP ranks get these pages before the next forward (model/distributed/tp_replay.py).
                self.runner.kv_written_externally(pages)
                state.cached_tokens = done.cached_tokens
                # The prefill side sampled token 1 at step 0 of the same seed; continue at step 1.
                state.sampling.record(done.first_token_id)
                state.launched = 1
                state.last_token_at = time.perf_counter()
                self._accept(state, done.first_token_id, done.first_token_logprob, first_top_logprobs(done))
                if state.spec is not None:  # drafts from the first step, when the prefill sent its draft
                    state.spec.wire_draft = wire_draft(done, model_config.vocab_size, model_config.hidden_size)
                # It joins the decode batch once its first token is out (below), not now: a step
                # launched at once holds the GIL and this loop while that token's message and the
                # prefill side's confirmation wait behind it (bench/ttft_pipeline_cpu.py).
                joins_after_first = not state.finished
            else:
                state.progress = self.rounds.start(state, request.input_ids, state.reservation.pages)
                self._prefilling.append(state)
            self._wakeup.set()
            while True:
                event = await state.watch(state.events.get())
                if isinstance(event, (Finished, Failed)):
                    terminal = event
                    break
                yield event
                if joins_after_first:  # the consumer took the first token and asks for more
                    joins_after_first = False
                    if not state.finished and not state.ended:
                        self._running.append(state)
                        self._wakeup.set()
        except RequestFailure as exc:
            terminal = Failed(exc.code, exc.message)
        except Exception as exc:
            log.exception("decode request %s failed", request.rid)
            terminal = Failed(FailureCode.INTERNAL, f"decode failed: {exc!r}")
        finally:
            # Pages go back before the terminal event is out, whatever the consumer does next.
            self._end(state)
            if not transfer_done:
                self._tell_prefill(request, "decode request ended before its KV arrived")
        yield terminal

    def _tell_prefill(self, request: GenerateRequest, reason: str) -> None:
        """Best effort, in the background: the prefill side drops the room now, not at its timeout."""
        task = asyncio.create_task(self.client.abort(request.disagg, reason))
        self._background.add(task)
        task.add_done_callback(self._background.discard)

    def loads(self) -> Loads:
        # Waiting: admitted or not, every request that is not in the decode batch yet.
        return Loads(num_running=len(self._running), num_waiting=len(self._requests) - len(self._running),
                     kv_used_pages=self.pool.num_used_pages, kv_total_pages=self.pool.num_pages,
                     reserved_pages=self.budget.reserved if self.budget else 0)

    # ---- request bookkeeping (event loop) --------------------------------------------------
    def _accept(self, state: DecodeRequest, token: int, logprob: float, top: TopLogprobs | None) -> None:
        """Records a collected token, streams it, and ends the request if it stops here."""
        state.output_ids.append(token)
        finish = state.stop.append(token)
        logprobs = (logprob,) if state.request.return_logprob else ()
        state.events.put_nowait(TokenChunk((token,), logprobs, (top,) if top is not None else ()))
        if finish is not None:
            state.finished = True
            state.events.put_nowait(Finished(finish.reason, len(state.request.input_ids), len(state.output_ids),
                                             cached_tokens=state.cached_tokens, matched_stop=finish.matched_stop))

    def _fail(self, state: DecodeRequest, code: FailureCode, message: str) -> None:
        state.finished = True
        state.events.put_nowait(Failed(code, message))

    def _end(self, state: DecodeRequest) -> None:
        if state.ended:
            return
        state.ended = True
        self._requests.pop(state.request.rid, None)
        for queue in (self._running, self._prefilling):
            if state in queue:
                queue.remove(state)
        if state.in_flight == 0:
            self._release(state)

    def _release(self, state: DecodeRequest) -> None:
        if state.spec is not None:  # no step uses it any more (in_flight is 0)
            self.speculation.forget(state.spec)
        if state.reservation is None:
            return
        exposure = state.unchecked_kv
        if exposure is None or not exposure.may_be_written:
            self.budget.release(state.reservation)
            return
        # Zeroed in a worker thread before they go back, and after any late one-sided write.
        self.budget.release(state.reservation,
                            delay_s=self.receiver.late_write_grace_s if exposure.late_writes else 0.0,
                            scrub=functools.partial(asyncio.to_thread, scrub_pages, self.pool))

    def _done_with(self, states) -> None:
        """A launched step (or prefill round) that used `states`' pages has finished."""
        for state in states:
            state.in_flight -= 1
            if state.ended and state.in_flight == 0:
                self._release(state)

    # ---- scheduling ------------------------------------------------------------------------
    async def _schedule_loop(self) -> None:
        while True:
            if not self._prefilling and not self._running and self._pending is None and self._spec_pending is None:
                self._wakeup.clear()
                await self._wakeup.wait()
                continue
            try:
                if self._prefilling:
                    await self._drain()  # prefill rounds are not overlapped with decode steps
                    await self._prefill_round()
                if self._running or self._pending is not None or self._spec_pending is not None:
                    await self._decode_round()
            except Exception:  # a bug in a round must fail the requests it held, never strand them
                log.exception("decode scheduler round failed; failing the requests in flight")
                self._fail_in_flight("decode scheduler error (see the worker log)")
            await asyncio.sleep(0)  # let transfers, new requests and aborts in between rounds

    def _fail_in_flight(self, message: str, held: Sequence[DecodeRequest] = ()) -> None:
        """Ends every scheduled request with INTERNAL; their consumers then free the pages (`_end`).
        `held`: the requests of the steps the failed round had taken out of the engine (a request
        aborted while its step was pending is in no queue now, and only this frees its pages)."""
        pending, self._pending = self._pending, None
        spec_pending, self._spec_pending = self._spec_pending, None
        states = list(dict.fromkeys(self._running + self._prefilling + (pending.owners if pending else [])
                                    + (spec_pending[0] if spec_pending else []) + list(held)))
        self._running.clear()
        self._prefilling.clear()
        self._batch = []
        self.stepper.reset()
        if self.speculation is not None:
            self.speculation.reset()
        for state in states:
            state.in_flight = 0
            if not state.finished:
                self._fail(state, FailureCode.INTERNAL, message)
            if state.ended:
                self._release(state)

    async def _drain(self) -> None:
        """Collects the pending decode step, if any."""
        if self._spec_pending is not None:
            await self._speculative_round(launch=False)
        if self._pending is not None:
            pending, self._pending = self._pending, None
            try:
                collected = await self._model_call(pending.owners, pending.collect)
            except Exception:
                self._fail_in_flight("decode step failed (see the worker log)", pending.owners)
                return
            self._process(pending, collected)

    async def _model_call(self, owners, fn, *args):
        """Runs `fn` in the model thread; a failure fails `owners` (one INTERNAL each) and re-raises."""
        try:
            return await self.model_thread.run(fn, *args)
        except Exception as exc:
            log.exception("forward failed")
            for state in owners:
                if not state.ended and not state.finished:
                    self._fail(state, FailureCode.INTERNAL, f"forward failed: {exc!r}")
            raise

    async def _prefill_round(self) -> None:
        await self.rounds.run_in(self.model_thread, [s.progress for s in self._prefilling])
        # Prompts the round completed moved on to the decode batch (or finished), failed ones ended.
        self._prefilling = [s for s in self._prefilling if not s.finished and s.progress.remaining > 0]

    async def _decode_round(self) -> None:
        """Plans and launches the next step, then collects the pending one (overlap), or launches and
        collects the same step (plain)."""
        if self.speculation is not None:
            await self._speculative_round()
            return
        owners, rows = self._plan_step()
        pending, self._pending = self._pending, None
        overlap = self.config.scheduler.overlap_schedule
        everyone = list(dict.fromkeys(owners + (pending.owners if pending else [])))
        try:
            began = time.perf_counter()
            launched, collected = await self._model_call(everyone, self._step, owners, rows, pending, overlap)
            if owners:  # a round that only collects the last pending step forwards nothing
                self.metrics.observe_step("decode", time.perf_counter() - began, len(owners), len(owners))
        except Exception:
            # The stepper's device state is unknown now: every row it held starts over, failed.
            self._fail_in_flight("decode step failed (see the worker log)", everyone)
            return
        # Kept before any streaming: a failure in it (the scheduler's `_fail_in_flight`) still sees the step.
        self._pending = launched if overlap else None
        if pending is not None:
            self._process(pending, collected)
        if launched is not None and not overlap:
            self._process(launched, launched.collect() if collected is None else collected)

    async def _speculative_round(self, launch: bool = True) -> None:
        """One speculative step (draft, verify, accept, catch up) over the running requests, then
        their tokens streamed in order. With `speculative_overlap` the model thread launches the
        next step and collects the pending one in the same call (the launch first while the rows stay
        the same: `SpeculativeStepper.collect_and_launch`), so the device runs step N+1 while the
        event loop streams step N's tokens (`launch` False: only collect, `_drain`)."""
        overlap = self.config.scheduler.speculative_overlap
        pending, self._spec_pending = self._spec_pending, None
        ahead = {id(s) for s in pending[0]} if pending is not None else set()
        chosen = self._plan_speculative(ahead) if launch else []
        if not chosen and pending is None:
            return
        stats = self.speculation.stats
        before = stats.snapshot()
        rows = [s.spec for s in chosen]
        done = chosen if not overlap else pending[0] if pending is not None else []
        try:
            began = time.perf_counter()
            if overlap:
                # Rows of the pending step whose request stopped when the step before it was streamed
                # (a stop token or string: the model thread knows only budgets) are void there.
                stopped = [s.spec for s in done if s.finished or s.ended]
                emitted, launched = await self._model_call(
                    list(dict.fromkeys(done + chosen)), self.speculation.collect_and_launch,
                    None if pending is None else pending[1], rows, stopped)
                if launched is not None:
                    self._spec_pending = (chosen, launched)
            else:
                emitted = await self._model_call(chosen, self.speculation.step, rows)
            if done:
                self.metrics.observe_step("decode", time.perf_counter() - began, len(done),
                                          sum(len(tokens) for tokens in emitted))
                # From the decoder's own counts: a void row of a step launched ahead (its request ended
                # in the step before: by budget, or by a stop the event loop saw, `stopped`) verified
                # nothing for anyone, and counts in neither.
                step = stats.since(before)
                self.metrics.observe_speculative(step.drafted, step.accepted, step.accept_lengths())
        except Exception:
            self._fail_in_flight("speculative decode step failed (see the worker log)", done + chosen)
            return
        now = time.perf_counter()
        gaps = []
        try:
            for state, tokens in zip(done, emitted):
                state.launched += len(tokens)
                for token, logprob, top in tokens:
                    if state.ended or state.finished:
                        break  # past a stop: the tokens after it are dropped
                    gaps.append(now - state.last_token_at)
                    state.last_token_at = now
                    self._accept(state, token, logprob, top)
                if state.finished and state in self._running:
                    self._running.remove(state)
            self.metrics.observe_inter_token_latency(gaps)
        finally:  # the step is over even if streaming raised: an ended request's pages go back
            self._done_with(done)

    def _plan_speculative(self, ahead: set[int]) -> list[DecodeRequest]:
        """The next speculative step's requests, their pages grown for its drafts. A request in the
        pending step (`ahead`, by id) may be up to num_steps + 1 tokens further in the model thread
        than streamed here: its pages are grown for that too, and its row's output is the model
        thread's (not reset from here)."""
        steps = self.speculation.decoder.num_steps
        chosen: list[DecodeRequest] = []
        for state in list(self._running)[:self.config.scheduler.max_running_requests]:
            if state.finished:
                continue
            in_flight = id(state) in ahead
            # Room for the verify forward's drafts (speculative_rules.draft_len keeps them in the budget).
            k = draft_len(steps, state.max_new - len(state.output_ids))
            end = min(state.next_position + k + 1 + (steps + 1 if in_flight else 0),
                      len(state.request.input_ids) + state.max_new - 1)
            needed = self.pool.pages_for_tokens(end) - len(state.reservation.pages)
            if needed > 0:
                try:
                    self.budget.grow(state.reservation, needed)
                except RequestFailure as exc:
                    self._running.remove(state)
                    self._fail(state, exc.code, exc.message)
                    continue
            state.spec.pages = state.reservation.pages
            if not in_flight:
                state.spec.output_ids = list(state.output_ids)
            state.in_flight += 1
            chosen.append(state)
        return chosen

    def _step(self, owners, rows, pending, overlap):
        """Model thread: launch the planned step (if any), then collect the previous one (overlap) or
        this one (plain)."""
        launched = self.stepper.launch(owners, rows, pending) if owners else None
        if pending is not None:
            return launched, pending.collect()
        if launched is not None and not overlap:
            return launched, launched.collect()
        return launched, None

    def _plan_step(self) -> tuple[list[DecodeRequest], list[DecodeRow]]:
        """The rows of the next step: running requests that still need a token, capped, with pages."""
        chosen: list[DecodeRequest] = []
        cap = self.config.scheduler.max_running_requests
        for state in list(self._running):
            if len(chosen) >= cap:
                break
            if state.finished or state.launched >= state.max_new:
                continue  # its last token is in flight: collecting it ends the request
            needed = self.pool.pages_for_tokens(state.next_position + 1) - len(state.reservation.pages)
            if needed > 0:
                try:
                    self.budget.grow(state.reservation, needed)
                except RequestFailure as exc:  # AdmissionRefused: the pool is full
                    self._running.remove(state)
                    self._fail(state, exc.code, exc.message)
                    continue
            chosen.append(state)
        # Row order = the sampling batch's: rows that stay keep theirs, new rows go last.
        keep = set(chosen)
        ordered = [s for s in self._batch if s in keep]
        staying = set(ordered)
        ordered += [s for s in chosen if s not in staying]
        self._batch = ordered
        # A row of the pending (not yet collected) step takes its input from that step's samples on
        # the device; any other row's last token is already on the host.
        pending_rows = {id(s): row for row, s in enumerate(self._pending.owners)} if self._pending else {}
        rows = []
        for state in ordered:
            prev_row = pending_rows.get(id(state), -1)
            token = state.output_ids[-1] if prev_row < 0 else 0
            rows.append(DecodeRow(token, prev_row, state.next_position, state.reservation.pages, state.sampling))
            state.launched += 1
            state.in_flight += 1
        return ordered, rows

    def _process(self, step: LaunchedStep, sampled: SampledTokens) -> None:
        """Host bookkeeping of a collected step: stream the tokens, apply stops, free what ended.
        Every token streamed here has a predecessor: its gap goes to the inter-token latency, one
        metrics call for the whole step."""
        now = time.perf_counter()
        gaps = []
        try:
            for row, state in enumerate(step.owners):
                if state.ended or state.finished:
                    continue
                gaps.append(now - state.last_token_at)
                state.last_token_at = now
                self._accept(state, sampled.token_ids[row], sampled.logprobs[row], sampled.top[row])
                if state.finished:
                    self._running.remove(state)
            self.metrics.observe_inter_token_latency(gaps)
        finally:  # the step is over even if streaming raised: an ended request's pages go back
            self._done_with(step.owners)


class _AdmitHooks(RoundHooks[DecodeRequest]):
    """Decode's side of a colocated prefill round: a completed prompt streams its first token and
    joins the continuous batch; a failed forward fails the requests it held."""

    def __init__(self, engine: DecodeEngine) -> None:
        self.engine = engine

    def first_token(self, owner: DecodeRequest, first: FirstToken) -> None:
        engine = self.engine
        if first.draft is not None:  # the MTP layer's first draft seeds its speculative steps
            engine.speculation.seed(owner.spec, *first.draft)
        owner.launched = 1
        owner.last_token_at = time.perf_counter()
        engine._accept(owner, first.token_id, first.logprob, first.top)
        if not owner.finished:
            engine._running.append(owner)

    def release(self, owner: DecodeRequest) -> None:
        self.engine._release(owner)

    def failed(self, owners: Sequence[DecodeRequest], error: Exception) -> None:
        for state in owners:
            if not state.finished:
                self.engine._fail(state, FailureCode.INTERNAL, f"forward failed: {error!r}")

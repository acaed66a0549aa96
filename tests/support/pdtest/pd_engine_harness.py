"""Prefill and decode engines (tiny model, fp32, CPU unless told) in one asyncio loop, no router.

Used by test_pd_engines.py (fake and grpc transports) and netns_pd_mooncake.py (mooncake, in a
network namespace). The offline `Engine` is the oracle.
"""
from __future__ import annotations

import asyncio
import contextlib
import dataclasses
import time
from dataclasses import dataclass

import torch

from deepseek_pd.workers.engine.offline import Engine
from deepseek_pd.model.runner import ModelRunner
from deepseek_pd.model.runner_config import RunnerConfig
from deepseek_pd.model.sampling.params import SamplingParams
from deepseek_pd.workers.engine.interface import DisaggParams, Failed, Finished, GenerateRequest, TokenChunk
from deepseek_pd.workers.transport import TransportConfig
from deepseek_pd.workers.engine.scheduler_config import SchedulerConfig
from deepseek_pd.workers.transport.bootstrap_config import BootstrapConfig
from deepseek_pd.workers.transport.worker_config import WorkerConfig
from deepseek_pd.workers.decode.engine import DecodeEngine
from deepseek_pd.workers.prefill.engine import PrefillEngine

PAGE_SIZE = 4
CHUNK = 16  # small prefill chunks, so prompts of 20+ tokens are chunked

torch.set_num_threads(1)


def runner(num_pages: int = 256, device: str = "cpu") -> ModelRunner:
    """The tiny model; on CUDA in fp32 with the plain-torch backends (no kernel compiles)."""
    on_gpu = {} if device == "cpu" else dict(device=device, dtype="float32", attention_backend="torch",
                                             moe_backend="torch")
    return ModelRunner(RunnerConfig(model="tiny", page_size=PAGE_SIZE, num_pages=num_pages, **on_gpu))


_ORACLE: Engine | None = None


def oracle() -> Engine:
    global _ORACLE
    if _ORACLE is None:
        _ORACLE = Engine("tiny", page_size=PAGE_SIZE, chunked_prefill_size=CHUNK)
    return _ORACLE


def worker_config(transport: str, same_host_direct: str = "auto", **bootstrap) -> WorkerConfig:
    """`same_host_direct="on"`: grpc with direct copies between the two pools (one process here)."""
    settings = dict(port=0, handshake_timeout_s=10, claim_timeout_s=10, transfer_timeout_s=30)
    settings.update(bootstrap)
    return WorkerConfig(kv_transport=transport,
                        transport=TransportConfig(send_timeout_s=10, same_host_direct=same_host_direct),
                        bootstrap=BootstrapConfig(**settings),
                        scheduler=SchedulerConfig(chunked_prefill_size=CHUNK, admission_timeout_s=10))


@dataclass
class Outcome:
    tokens: list[int]
    terminal: object  # Finished | Failed
    logprobs: list[float] = dataclasses.field(default_factory=list)
    top_logprobs: list = dataclasses.field(default_factory=list)  # TopLogprobs per token, when asked

    @property
    def ok(self) -> bool:
        return isinstance(self.terminal, Finished)


async def collect(engine, request: GenerateRequest, on_event=None) -> Outcome:
    tokens, terminals, logprobs, tops = [], [], [], []
    async for event in engine.generate(request):
        if isinstance(event, TokenChunk):
            assert not terminals, "a token after the terminal event"
            tokens += event.token_ids
            logprobs += event.logprobs
            tops += event.top_logprobs
        else:
            assert isinstance(event, (Finished, Failed)), event
            terminals.append(event)
        if on_event is not None:
            await on_event(event)
    assert len(terminals) == 1, f"{request.rid}: {len(terminals)} terminal events"
    return Outcome(tokens, terminals[0], logprobs, tops)


async def pages_back(engine: DecodeEngine, timeout_s: float = 5.0) -> None:
    """Asserts the decode pool ends empty and nothing stays reserved. A request that ended while a
    step was pending keeps its pages until that step is collected (the next round, on a loaded
    machine later still): a bounded wait, not a fixed sleep."""
    deadline = time.monotonic() + timeout_s
    while engine.pool.num_used_pages or engine.budget.reserved:
        if time.monotonic() > deadline:
            break
        await asyncio.sleep(0.02)
    assert engine.pool.num_used_pages == 0 and engine.budget.reserved == 0, "pages leaked"


async def abort_after_first_event(engine, request: GenerateRequest, *others: GenerateRequest,
                                  timeout_s: float = 60.0, events: int = 1) -> tuple[Outcome, list[Outcome]]:
    """Starts `request` (and `others` beside it), aborts it once its first `events` events have
    arrived (the engine knows it by the first; past it, a decode step of it is likely in flight),
    and returns its outcome and the others'."""
    started = asyncio.Event()
    seen = []

    async def on_event(event) -> None:
        seen.append(event)
        if len(seen) >= events:
            started.set()

    tasks = [asyncio.ensure_future(collect(engine, request, on_event)),
             *(asyncio.ensure_future(collect(engine, other)) for other in others)]
    await asyncio.wait_for(started.wait(), 30)
    assert await engine.abort(request.rid)
    outcome, *rest = await asyncio.wait_for(asyncio.gather(*tasks), timeout_s)
    return outcome, rest


@contextlib.contextmanager
def device_fails_once_ended(engine, rid: str):
    """Within: every model-thread call fails (a device error) once request `rid` has ended here, so
    the first to fail is the round that collects the step it was still in."""
    model_run = engine.model_thread.run

    async def run(fn, *args):
        if rid not in engine._requests:
            raise RuntimeError("injected device failure")
        return await model_run(fn, *args)

    engine.model_thread.run = run
    try:
        yield
    finally:
        engine.model_thread.run = model_run


@contextlib.contextmanager
def streaming_fails_once_ended(engine, rid: str):
    """Within: streaming a decoded token raises (a bug in the host's bookkeeping) once, the first time
    after request `rid` has ended here and the step just launched (`_pending`, `_spec_pending`) no
    longer holds it, so it hits the round that collects the last step `rid` was in, while streaming
    another request's token (an ended request's are dropped). Yields the list of requests whose
    token raised, to check that it did."""
    accept = engine._accept
    raised: list[str] = []

    def launched_holds_it() -> bool:
        step = engine._spec_pending[0] if engine._spec_pending else engine._pending.owners if engine._pending else []
        return any(state.request.rid == rid for state in step)

    def failing(state, *args):
        if rid not in engine._requests and not launched_holds_it() and state.output_ids and not raised:
            raised.append(state.request.rid)
            raise RuntimeError("injected streaming failure")
        return accept(state, *args)

    engine._accept = failing
    try:
        yield raised
    finally:
        engine._accept = accept


class PDPair:
    """A started prefill + decode engine; `run(prompt, params)` sends one PD request to both."""

    def __init__(self, transport: str, prefill_config: WorkerConfig | None = None,
                 decode_config: WorkerConfig | None = None, device: str = "cpu",
                 runners: tuple[ModelRunner, ModelRunner] | None = None) -> None:
        """`runners`: (prefill's, decode's) instead of the tiny model's (another checkpoint, or two
        sides that run it differently); the tokenizer is the tiny model's either way."""
        prefill_runner, decode_runner = runners or (runner(device=device), runner(device=device))
        self.prefill = PrefillEngine(prefill_runner, prefill_config or worker_config(transport))
        self.decode = DecodeEngine(decode_runner, decode_config or worker_config(transport),
                                   tokenizer=oracle().tokenizer)
        self._room = 1000

    async def __aenter__(self) -> "PDPair":
        await self.prefill.start()
        await self.decode.start()
        return self

    async def __aexit__(self, *exc) -> None:
        await self.decode.stop()
        await self.prefill.stop()

    def requests(self, prompt, params: SamplingParams, rid: str, return_logprob: bool = False,
                 prefill_params: SamplingParams | None = None, prefill: PrefillEngine | None = None
                 ) -> tuple[GenerateRequest, GenerateRequest]:
        """`prefill_params`: what the prefill side gets instead of `params` (a peer that disagrees);
        `prefill`: another prefill engine the request names instead of this pair's."""
        self._room += 1
        disagg = DisaggParams("127.0.0.1", (prefill or self.prefill).bootstrap_port, self._room)
        base = GenerateRequest(rid=rid, input_ids=tuple(prompt), sampling=params, disagg=disagg,
                               return_logprob=return_logprob)
        return (dataclasses.replace(base, rid=rid + "-p", sampling=prefill_params or params),
                dataclasses.replace(base, rid=rid + "-d"))

    async def run(self, prompt, params: SamplingParams, rid: str, return_logprob: bool = False,
                  prefill_params: SamplingParams | None = None) -> tuple[Outcome, Outcome]:
        p_req, d_req = self.requests(prompt, params, rid, return_logprob, prefill_params)
        return tuple(await asyncio.gather(collect(self.prefill, p_req), collect(self.decode, d_req)))

    async def wait_pools_clean(self, timeout_s: float = 5.0) -> None:
        """`assert_pools_clean` within `timeout_s`: pages a running forward or transfer still
        reads come back when it returns, which on a loaded machine takes longer than a fixed nap;
        a real leak still fails (with the last assertion)."""
        deadline = time.monotonic() + timeout_s
        while True:
            try:
                return self.assert_pools_clean()
            except AssertionError:
                if time.monotonic() > deadline:
                    raise
            await asyncio.sleep(0.05)

    def assert_pools_clean(self) -> None:
        assert self.decode.pool.num_used_pages == 0, f"decode pool leaks {self.decode.pool.num_used_pages} pages"
        assert self.decode.budget.reserved == 0
        cache = self.prefill.cache
        cached = cache.num_pages if cache is not None else 0
        assert self.prefill.pool.num_used_pages == cached, "prefill pool leaks pages outside the cache"
        if cache is not None:
            assert cache.num_pinned_nodes == 0
        assert self.prefill.registry.num_active == 0, "a bootstrap room leaked"
        staging = getattr(self.prefill.sender, "staging", None)  # mooncake: each send's (pulled: until read)
        assert staging is None or staging.num_used == 0, f"the prefill send staging holds {staging.num_used} slots"


def timed_emits(prefill: PrefillEngine) -> tuple[list[float], list[str]]:
    """From now on, each KV chunk `prefill`'s channels emit appends its time (time.monotonic) to the
    first list, and each channel it opens its class name to the second."""
    emitted: list[float] = []
    channels: list[str] = []
    open_channel = prefill.sender.open

    def traced_open(handshake, emit, streams=1):
        channel = open_channel(handshake, emit, streams)
        channels.append(type(channel).__name__)
        real_emit = channel.emit

        async def traced_emit(chunk):
            emitted.append(time.monotonic())
            await real_emit(chunk)
        channel.emit = traced_emit
        return channel
    prefill.sender.open = traced_open
    return emitted, channels


@contextlib.contextmanager
def recorded_pulls():
    """Within it, every decode engine's KV pull records its pages: yields {decode rid: pages}."""
    from deepseek_pd.workers.decode import engine as decode_engine

    pulled: dict[str, list[int]] = {}
    pull_kv = decode_engine.pull_kv

    def recording_pull(client, receiver, disagg, rid, num_tokens, pages, *rest, **kw):
        pulled[rid] = list(pages)
        return pull_kv(client, receiver, disagg, rid, num_tokens, pages, *rest, **kw)
    decode_engine.pull_kv = recording_pull
    try:
        yield pulled
    finally:
        decode_engine.pull_kv = pull_kv

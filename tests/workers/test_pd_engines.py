"""Prefill and decode engines against each other through the real bootstrap service on 127.0.0.1.

Oracle: the offline single-process `Engine` (same tiny model, fp32, CPU). Greedy tokens must
match token for token, with chunked prompts and prefix-cache hits; failures must end each side
with exactly one terminal event and give every KV page back.
"""
from __future__ import annotations

import asyncio
import dataclasses
import random
import socket
import time

import pytest

from deepseek_pd.model.sampling.params import SamplingParams
from deepseek_pd.workers.engine.interface import DisaggParams, Failed, FailureCode, GenerateRequest
from deepseek_pd.workers.decode.engine import DecodeEngine
from deepseek_pd.workers.prefill.engine import PrefillEngine
from pdtest.pd_engine_harness import CHUNK, PDPair, collect, oracle, runner, worker_config

pytestmark = [pytest.mark.timeout(120)]

GREEDY = SamplingParams(temperature=0.0, max_new_tokens=6, ignore_eos=True)


def random_prompt(rng: random.Random, low: int = 3, high: int = 50) -> list[int]:
    vocab = oracle().vocab_size
    return [rng.randrange(2, vocab) for _ in range(rng.randrange(low, high))]


@pytest.mark.parametrize("transport", ["fake", "grpc", "grpc-direct"])
def test_pd_greedy_equals_offline_with_chunking_prefix_hits_and_concurrency(transport):
    rng = random.Random()
    shared = random_prompt(rng, 20, 30)  # > CHUNK: chunked; shared prefix: cache hits
    prompts = [random_prompt(rng) for _ in range(3)] + [shared + random_prompt(rng, 1, 10) for _ in range(3)]
    prompts.append(random_prompt(rng, CHUNK * 2 + 1, CHUNK * 3))
    prompts += [random_prompt(rng, 1, 2), random_prompt(rng, 2 * CHUNK, 2 * CHUNK + 1)]  # 1 token; whole pages
    expected = [oracle().generate(p, GREEDY).output_ids for p in prompts]

    direct = transport == "grpc-direct"  # grpc, the pages copied straight into decode's pool
    configs = dict(prefill_config=worker_config("grpc", "on"), decode_config=worker_config("grpc", "on")) if direct else {}

    async def run():
        async with PDPair("grpc" if direct else transport, **configs) as pair:
            if direct:
                assert pair.decode.receiver.direct is not None
            # First the shared prefix alone, so the concurrent wave can hit the prefix cache.
            first_p, first_d = await pair.run(shared, GREEDY, "warm")
            assert first_d.tokens == oracle().generate(shared, GREEDY).output_ids
            outcomes = await asyncio.gather(*(pair.run(p, GREEDY, f"r{i}") for i, p in enumerate(prompts)))
            await pair.wait_pools_clean()
            if direct:  # the prefill side did open the decode pool: no KV bytes went over the stream
                assert [e.buffers is not None for e in pair.prefill.sender.direct._opened.values()] == [True]
            return first_p, outcomes

    warm_prefill, outcomes = asyncio.run(run())
    assert warm_prefill.ok and warm_prefill.terminal.completion_tokens == 1
    for i, (prefill, decode) in enumerate(outcomes):
        assert prefill.ok, prefill.terminal
        assert decode.ok, decode.terminal
        assert prefill.terminal.reason == "length" and prefill.tokens == expected[i][:1]
        assert decode.tokens == expected[i], f"prompt {i}: PD {decode.tokens} != offline {expected[i]}"
        assert decode.terminal.completion_tokens == len(expected[i])
    hits = [outcomes[i][1].terminal.cached_tokens for i in range(3, 6)]
    assert len(prompts[-2]) == 1 and len(prompts[-1]) % 4 == 0
    assert all(h >= 20 for h in hits), f"shared-prefix prompts missed the prefix cache: {hits}"


def test_pd_seeded_sampling_and_stops_equal_offline():
    rng = random.Random()
    prompt = random_prompt(rng, 10, 30)
    sampled = SamplingParams(temperature=0.9, top_p=0.9, seed=rng.randrange(1 << 20), max_new_tokens=8,
                             ignore_eos=True)
    greedy_ids = oracle().generate(prompt, GREEDY).output_ids
    stop_at = SamplingParams(temperature=0.0, max_new_tokens=6, stop_token_ids=(greedy_ids[2],), ignore_eos=True)
    one = SamplingParams(temperature=0.0, max_new_tokens=1)

    async def run():
        async with PDPair("grpc") as pair:
            results = [await pair.run(prompt, sampled, "seeded", return_logprob=True),
                       await pair.run(prompt, stop_at, "stop"),
                       await pair.run(prompt, one, "one")]
            await pair.wait_pools_clean()
            return results

    (_, seeded), (_, stopped), (_, single) = asyncio.run(run())
    assert single.tokens == greedy_ids[:1] and single.terminal.reason in ("length", "stop")
    seeded_reference = oracle().generate(prompt, sampled)
    assert seeded.tokens == seeded_reference.output_ids
    assert seeded.logprobs == pytest.approx(seeded_reference.output_logprobs, abs=1e-4)
    reference = oracle().generate(prompt, stop_at)
    assert stopped.tokens == reference.output_ids and stopped.terminal.reason == "stop"
    assert stopped.terminal.matched_stop == greedy_ids[2]


def test_colocated_decode_engine_equals_offline():
    rng = random.Random()
    prompts = [random_prompt(rng, 3, 45) for _ in range(4)]
    expected = [oracle().generate(p, GREEDY).output_ids for p in prompts]

    async def run():
        engine = DecodeEngine(runner(), worker_config("fake"), tokenizer=oracle().tokenizer)
        await engine.start()
        try:
            outcomes = await asyncio.gather(*(collect(engine, GenerateRequest(f"c{i}", tuple(p), GREEDY))
                                              for i, p in enumerate(prompts)))
            assert engine.pool.num_used_pages == 0 and engine.budget.reserved == 0
            return outcomes
        finally:
            await engine.stop()

    for outcome, want in zip(asyncio.run(run()), expected):
        assert outcome.ok and outcome.tokens == want


class Phase:
    """Hooks that hold a PD request in one phase and say when it is there."""

    def __init__(self, pair: PDPair, phase: str) -> None:
        self.reached = asyncio.Event()
        loop = asyncio.get_running_loop()
        if phase == "prefill_forward":  # abort while the model thread runs this request's forward
            extend = pair.prefill.runner.extend

            def slow_extend(seqs, **kwargs):  # progress= (layer-wise streaming) passes through
                loop.call_soon_threadsafe(self.reached.set)
                time.sleep(0.2)
                return extend(seqs, **kwargs)
            pair.prefill.runner.extend = slow_extend
        elif phase == "transfer":  # abort while KV chunks are on the wire
            open_channel = pair.prefill.sender.open

            def slow_open(handshake, emit, streams=1):
                async def slow_emit(chunk):
                    self.reached.set()
                    await asyncio.sleep(0.05)
                    await emit(chunk)
                return open_channel(handshake, slow_emit, streams)
            pair.prefill.sender.open = slow_open
        self.phase = phase

    async def on_decode_event(self, event) -> None:
        if self.phase == "decode":
            self.reached.set()


@pytest.mark.parametrize("side", ["prefill", "decode"])
@pytest.mark.parametrize("phase", ["before_peer", "prefill_forward", "transfer", "decode"])
def test_abort_in_every_phase_ends_both_sides_once_and_frees_both_pools(side, phase):
    rng = random.Random()
    prompt = random_prompt(rng, CHUNK * 3, CHUNK * 4)
    params = SamplingParams(temperature=0.0, max_new_tokens=300, ignore_eos=True)

    async def run():
        async with PDPair("grpc") as pair:
            p_req, d_req = pair.requests(prompt, params, "victim")
            hooks = Phase(pair, phase)
            engine, rid = (pair.prefill, p_req.rid) if side == "prefill" else (pair.decode, d_req.rid)
            start = time.monotonic()
            if phase == "before_peer":  # the aborted side's peer has not even arrived yet
                first = asyncio.ensure_future(collect(engine, p_req if side == "prefill" else d_req))
                await asyncio.sleep(0.05)
                assert await engine.abort(rid)
                aborted = await first
                peer = pair.decode if side == "prefill" else pair.prefill
                late = await collect(peer, d_req if side == "prefill" else p_req)
                results = (aborted, late) if side == "prefill" else (late, aborted)
            else:
                tasks = [asyncio.ensure_future(collect(pair.prefill, p_req)),
                         asyncio.ensure_future(collect(pair.decode, d_req, hooks.on_decode_event))]
                await asyncio.wait_for(hooks.reached.wait(), 30)
                late_prefill_abort = phase == "decode" and side == "prefill"
                if late_prefill_abort:
                    # Decode streams its first token while prefill may still await decode's
                    # confirmation of the transfer: let prefill's part end first (was flaky).
                    await asyncio.wait({tasks[0]}, timeout=30)
                assert await engine.abort(rid) != late_prefill_abort  # a finished request is unknown
                if late_prefill_abort:
                    await pair.decode.abort(d_req.rid)  # end the long decode; its result is not under test
                results = await asyncio.wait_for(asyncio.gather(*tasks), 30)
            assert time.monotonic() - start < 5, "a side waited for a timeout instead of hearing of the abort"
            # Pages a running forward reads are freed as soon as it returns (0.2 s in "prefill_forward").
            await pair.wait_pools_clean()
            return results

    prefill, decode = asyncio.run(run())
    if phase == "decode" and side == "prefill":
        assert prefill.ok and len(decode.tokens) >= 1
        return
    aborted = prefill if side == "prefill" else decode
    assert isinstance(aborted.terminal, Failed) and aborted.terminal.code == FailureCode.ABORTED
    if phase == "decode":
        assert prefill.ok  # the prefill side had already finished its part
    else:
        assert not decode.ok  # the decode side never got (all) the KV


def test_handshake_that_never_arrives_fails_prefill_within_timeout():
    async def run():
        engine = PrefillEngine(runner(), worker_config("grpc", handshake_timeout_s=0.5))
        await engine.start()
        try:
            request = GenerateRequest("lonely", (5, 6, 7, 8, 9), GREEDY, disagg=DisaggParams("127.0.0.1", 1, 77))
            start = time.monotonic()
            outcome = await collect(engine, request)
            assert time.monotonic() - start < 5
            assert engine.pool.num_used_pages == 0 and engine.registry.num_active == 0
            return outcome
        finally:
            await engine.stop()

    outcome = asyncio.run(run())
    assert isinstance(outcome.terminal, Failed) and outcome.terminal.code == FailureCode.DEADLINE_EXCEEDED


def test_unreachable_bootstrap_fails_decode_unavailable_within_timeout():
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]

    async def run():
        engine = DecodeEngine(runner(), worker_config("grpc", handshake_timeout_s=0.8))
        await engine.start()
        try:
            request = GenerateRequest("orphan", (5, 6, 7), GREEDY, disagg=DisaggParams("127.0.0.1", port, 78))
            start = time.monotonic()
            outcome = await collect(engine, request)
            assert time.monotonic() - start < 5
            assert engine.pool.num_used_pages == 0 and engine.budget.reserved == 0
            return outcome
        finally:
            await engine.stop()

    outcome = asyncio.run(run())
    assert isinstance(outcome.terminal, Failed) and outcome.terminal.code == FailureCode.UNAVAILABLE


def test_decode_without_prefill_request_fails_with_a_clear_status():
    """The decode side reaches the bootstrap, but prefill never receives the request (claim timeout)."""
    async def run():
        async with PDPair("grpc", prefill_config=worker_config("grpc", claim_timeout_s=0.5)) as pair:
            _, d_req = pair.requests([5, 6, 7, 8], GREEDY, "half")
            outcome = await collect(pair.decode, d_req)
            await pair.wait_pools_clean()
            return outcome

    outcome = asyncio.run(run())
    assert isinstance(outcome.terminal, Failed) and outcome.terminal.code == FailureCode.DEADLINE_EXCEEDED


def test_killing_the_prefill_bootstrap_mid_transfer_fails_decode_and_frees_pages():
    prompt = random_prompt(random.Random(), CHUNK * 4, CHUNK * 5)

    async def run():
        config = worker_config("grpc")
        async with PDPair("grpc", prefill_config=config) as pair:
            p_req, d_req = pair.requests(prompt, GREEDY, "killed")
            started = asyncio.Event()
            original = pair.prefill.sender.open

            def open_and_signal(handshake, emit, streams=1):
                async def slow_emit(chunk):  # slow the stream so the kill lands mid-transfer
                    started.set()
                    await asyncio.sleep(0.05)
                    await emit(chunk)
                return original(handshake, slow_emit, streams)

            pair.prefill.sender.open = open_and_signal
            tasks = [asyncio.ensure_future(collect(pair.prefill, p_req)),
                     asyncio.ensure_future(collect(pair.decode, d_req))]
            await asyncio.wait_for(started.wait(), 10)
            await pair.prefill.server.stop(0)  # the prefill worker's bootstrap dies
            prefill, decode = await asyncio.wait_for(asyncio.gather(*tasks), 30)
            await pair.wait_pools_clean()  # a forward in flight frees its pages when it returns
            return prefill, decode

    prefill, decode = asyncio.run(run())
    assert isinstance(decode.terminal, Failed) and decode.terminal.code == FailureCode.UNAVAILABLE, decode.terminal
    assert isinstance(prefill.terminal, Failed)


def test_decode_going_away_mid_transfer_fails_prefill_and_frees_pages():
    prompt = random_prompt(random.Random(), CHUNK * 4, CHUNK * 5)

    async def run():
        async with PDPair("grpc") as pair:
            p_req, d_req = pair.requests(prompt, GREEDY, "gone")
            hooks = Phase(pair, "transfer")
            prefill_task = asyncio.ensure_future(collect(pair.prefill, p_req))
            decode_events = pair.decode.generate(d_req)
            decode_task = asyncio.ensure_future(decode_events.__anext__())
            await asyncio.wait_for(hooks.reached.wait(), 30)
            decode_task.cancel()  # the decode worker's caller disappears mid-transfer
            await asyncio.gather(decode_task, return_exceptions=True)
            await decode_events.aclose()
            start = time.monotonic()
            prefill = await asyncio.wait_for(prefill_task, 30)
            assert time.monotonic() - start < 5
            await pair.wait_pools_clean()  # a forward in flight frees its pages when it returns
            return prefill

    prefill = asyncio.run(run())
    # The closed stream (UNAVAILABLE) or the decode side's Abort (ABORTED), whichever lands first.
    assert isinstance(prefill.terminal, Failed), prefill.terminal
    assert prefill.terminal.code in (FailureCode.UNAVAILABLE, FailureCode.ABORTED)


def test_pool_too_small_is_resource_exhausted():
    async def run():
        engine = DecodeEngine(runner(num_pages=4), worker_config("grpc"))
        await engine.start()
        try:
            request = GenerateRequest("huge", tuple(range(2, 40)), GREEDY)
            return await collect(engine, request)
        finally:
            await engine.stop()

    outcome = asyncio.run(run())
    assert isinstance(outcome.terminal, Failed) and outcome.terminal.code == FailureCode.RESOURCE_EXHAUSTED
    assert isinstance(outcome.terminal, Failed) and "pages" in outcome.terminal.message



def test_pd_without_prefix_cache_equals_offline_and_returns_every_prefill_page():
    rng = random.Random()
    shared = random_prompt(rng, CHUNK + 4, CHUNK + 8)
    prompts = [shared + random_prompt(rng, 1, 6) for _ in range(3)]
    config = worker_config("fake")
    no_cache = dataclasses.replace(config, scheduler=dataclasses.replace(config.scheduler, prefix_cache=False))

    async def run():
        async with PDPair("fake", prefill_config=no_cache) as pair:
            outcomes = await asyncio.gather(*(pair.run(p, GREEDY, f"n{i}") for i, p in enumerate(prompts)))
            assert pair.prefill.cache is None and pair.prefill.pool.num_used_pages == 0
            await pair.wait_pools_clean()
            return outcomes

    for p, (prefill, decode) in zip(prompts, asyncio.run(run())):
        assert prefill.ok and decode.ok and decode.terminal.cached_tokens == 0
        assert decode.tokens == oracle().generate(p, GREEDY).output_ids


def test_a_direct_transfer_aborted_midway_holds_its_pages_for_the_grace_then_zeroes_them():
    """Same-host direct writes make a transfer one-sided: after an abort the prefill side may still
    be copying into the decode pages, so decode keeps them for the late-write grace (the send
    timeout) and zeroes them before they go back; nothing of the request stays in the pool."""
    rng = random.Random()
    prompt = random_prompt(rng, CHUNK * 3, CHUNK * 4)
    params = SamplingParams(temperature=0.0, max_new_tokens=50, ignore_eos=True)
    grace = rng.uniform(0.8, 1.5)
    configs = {side: dataclasses.replace(worker_config("grpc", "on"), transport=dataclasses.replace(
        worker_config("grpc", "on").transport, send_timeout_s=grace)) for side in ("prefill", "decode")}

    async def run():
        async with PDPair("grpc", prefill_config=configs["prefill"], decode_config=configs["decode"]) as pair:
            p_req, d_req = pair.requests(prompt, params, "victim")
            hooks = Phase(pair, "transfer")
            tasks = [asyncio.ensure_future(collect(pair.prefill, p_req)),
                     asyncio.ensure_future(collect(pair.decode, d_req))]
            await asyncio.wait_for(hooks.reached.wait(), 30)  # a chunk was written directly
            assert await pair.decode.abort(d_req.rid)
            aborted_at = time.monotonic()
            await asyncio.wait_for(asyncio.gather(*tasks), 30)
            assert pair.decode.pool.num_used_pages > 0, "pages a peer may still write went back at once"
            await pair.wait_pools_clean(timeout_s=grace + 5)
            assert time.monotonic() - aborted_at >= grace * 0.9
            assert all(not buffer.any() for buffer in pair.decode.pool.buffers), "written pages were not zeroed"
            return tasks[1].result()

    decode = asyncio.run(run())
    assert isinstance(decode.terminal, Failed) and decode.terminal.code == FailureCode.ABORTED


def test_first_token_goes_out_before_a_decode_step_takes_the_request():
    """A transferred request joins the decode batch only once its consumer has taken the first
    token: a step launched at once held that token's message (and the prefill side's confirmation)
    behind it. The tokens still equal the offline engine's."""
    rng = random.Random()
    prompt = random_prompt(rng)
    budget = rng.randint(3, 6)
    params = dataclasses.replace(GREEDY, max_new_tokens=budget)
    expected = oracle().generate(prompt, params).output_ids

    async def run():
        async with PDPair("grpc") as pair:
            steps_with_it: list[int] = []
            step = pair.decode._step

            def counting_step(owners, *rest):
                steps_with_it.extend(1 for state in owners if state.request.rid == "first-d")
                return step(owners, *rest)

            pair.decode._step = counting_step
            seen_at_first: list[int] = []

            async def on_event(event) -> None:
                if not seen_at_first:
                    await asyncio.sleep(0.2)  # a slow consumer: the first token is not taken yet
                    seen_at_first.append(len(steps_with_it))

            p_req, d_req = pair.requests(prompt, params, "first")
            prefill, decode = await asyncio.gather(collect(pair.prefill, p_req),
                                                   collect(pair.decode, d_req, on_event))
            await pair.wait_pools_clean()
            return prefill, decode, seen_at_first[0], len(steps_with_it)

    prefill, decode, at_first, total = asyncio.run(run())
    assert prefill.ok and decode.ok, (prefill.terminal, decode.terminal)
    assert decode.tokens == expected
    assert at_first == 0, f"{at_first} decode step(s) took the request before its first token was taken"
    assert total >= budget - 1

"""The prefill engine on its own: KV it pushes (chunked, cached) vs a single-process extend."""
from __future__ import annotations

import asyncio
import dataclasses
import random

import pytest
import torch

from deepseek_pd.model.kv.pool import KVPool
from deepseek_pd.model.runner import ExtendSeq
from deepseek_pd.model.sampling.params import SamplingParams
from deepseek_pd.workers.engine.interface import DisaggParams, Failed, FailureCode, GenerateRequest
from deepseek_pd.workers.transport import TransportConfig, build_receiver
from deepseek_pd.workers.engine.request_failure import TransferError
from deepseek_pd.workers.engine.scheduler_config import SchedulerConfig
from deepseek_pd.workers.decode.bootstrap_client import BootstrapClient
from deepseek_pd.workers.decode.kv_pull import pull_kv
from deepseek_pd.workers.prefill.engine import PrefillEngine
from pdtest.pd_engine_harness import CHUNK, PAGE_SIZE, collect, oracle, runner, worker_config

pytestmark = pytest.mark.timeout(120)
GREEDY = SamplingParams(temperature=0.0, max_new_tokens=4)


class FakeDecode:
    """Just the decode side of the transfer: pulls KV into its own pool."""

    def __init__(self, like: KVPool, config) -> None:
        self.pool = KVPool(like.num_layers, 64, like.page_size, like.kv_dim, dtype=like.dtype)
        self.receiver = build_receiver("grpc", self.pool, TransportConfig())
        self.client = BootstrapClient(config.bootstrap)

    async def pull(self, port: int, room: int, prompt: list[int]):
        pages = self.pool.alloc(self.pool.pages_for_tokens(len(prompt)))
        done = await pull_kv(self.client, self.receiver, DisaggParams("127.0.0.1", port, room), "d",
                             len(prompt), pages)
        kv = [buffer[pages].reshape(-1, self.pool.kv_dim)[:len(prompt)].clone() for buffer in self.pool.buffers]
        self.pool.free(pages)
        return done, kv


def reference_kv(prompt: list[int]) -> list[torch.Tensor]:
    """Latent KV of the whole prompt from one unchunked extend in a fresh runner."""
    ref = runner(64)
    pages = ref.kv_pool.alloc(ref.kv_pool.pages_for_tokens(len(prompt)))
    ref.extend([ExtendSeq(prompt, 0, pages)])
    return [buffer[pages].reshape(-1, ref.kv_pool.kv_dim)[:len(prompt)] for buffer in ref.kv_pool.buffers]


@pytest.mark.parametrize("layerwise", [True, False])
def test_pushed_kv_equals_a_single_extend_with_chunks_and_with_a_prefix_hit(layerwise):
    rng = random.Random()
    prompt = [rng.randrange(2, oracle().vocab_size) for _ in range(rng.randrange(2 * CHUNK + 1, 4 * CHUNK))]
    config = worker_config("grpc")
    config = dataclasses.replace(config, scheduler=dataclasses.replace(config.scheduler, layerwise_transfer=layerwise))

    async def run():
        engine = PrefillEngine(runner(), config)
        await engine.start()
        decode = FakeDecode(engine.pool, config)
        sends: list[tuple[int, int]] = []
        original_open = engine.sender.open

        def spying_open(handshake, emit, streams=1):
            channel = original_open(handshake, emit, streams)
            send = channel.send

            async def spy(src_pages, page_begin, layer_begin=0, layer_end=None, ready=None):
                sends.append((page_begin, len(src_pages)))
                await send(src_pages, page_begin, layer_begin, layer_end, ready)
            channel.send = spy
            return channel

        engine.sender.open = spying_open
        try:
            results = []
            for room in (1, 2):  # the second run hits the prefix cache
                request = GenerateRequest(f"p{room}", tuple(prompt), GREEDY,
                                          disagg=DisaggParams("127.0.0.1", engine.bootstrap_port, room))
                outcome, (done, kv) = await asyncio.gather(collect(engine, request),
                                                           decode.pull(engine.bootstrap_port, room, prompt))
                results.append((outcome, done, kv, list(sends)))
                sends.clear()
            assert engine.pool.num_used_pages == engine.cache.num_pages and engine.cache.num_pinned_nodes == 0
            return results
        finally:
            await decode.client.close()
            await engine.stop()

    (first, done1, kv1, sends1), (second, done2, kv2, sends2) = asyncio.run(run())
    expected_first = oracle().generate(prompt, GREEDY).output_ids[0]
    for outcome, done in ((first, done1), (second, done2)):
        assert outcome.ok and outcome.tokens == [expected_first] and done.first_token_id == expected_first
        assert outcome.terminal.reason == "length" and outcome.terminal.completion_tokens == 1
    # Chunked prefill streams pages as chunks complete: the first send is the first chunk's pages.
    assert len(sends1) >= 3 and sends1[0] == (0, CHUNK // PAGE_SIZE)
    cached = (len(prompt) - 1) // PAGE_SIZE * PAGE_SIZE
    assert second.terminal.cached_tokens == done2.cached_tokens == cached
    assert sends2[0] == (0, cached // PAGE_SIZE)  # cached pages go out before any compute
    reference = reference_kv(prompt)
    for layer in range(len(reference)):
        torch.testing.assert_close(kv1[layer], reference[layer], rtol=1e-4, atol=1e-5)
        assert torch.equal(kv2[layer][:cached], kv1[layer][:cached])  # the very same cached bytes
        torch.testing.assert_close(kv2[layer], reference[layer], rtol=1e-4, atol=1e-5)


def test_requests_without_disagg_params_are_refused():
    async def run():
        engine = PrefillEngine(runner(), worker_config("grpc"))
        await engine.start()
        try:
            return await collect(engine, GenerateRequest("x", (3, 4, 5), GREEDY))
        finally:
            await engine.stop()

    outcome = asyncio.run(run())
    assert isinstance(outcome.terminal, Failed) and outcome.terminal.code == FailureCode.INVALID_ARGUMENT
    assert "disaggregated_params" in outcome.terminal.message


def test_prompt_length_mismatch_between_the_sides_fails_both():
    config = worker_config("grpc")

    async def run():
        engine = PrefillEngine(runner(), config)
        await engine.start()
        decode = FakeDecode(engine.pool, config)
        try:
            request = GenerateRequest("p", tuple(range(2, 12)), GREEDY,
                                      disagg=DisaggParams("127.0.0.1", engine.bootstrap_port, 5))
            outcome, pulled = await asyncio.gather(collect(engine, request),
                                                   decode.pull(engine.bootstrap_port, 5, list(range(2, 30))),
                                                   return_exceptions=True)
            assert engine.pool.num_used_pages == 0
            return outcome, pulled
        finally:
            await decode.client.close()
            await engine.stop()

    outcome, pulled = asyncio.run(run())
    assert isinstance(outcome.terminal, Failed) and outcome.terminal.code == FailureCode.INVALID_ARGUMENT
    assert isinstance(pulled, TransferError) and pulled.code == FailureCode.INVALID_ARGUMENT


def test_requests_wait_for_pages_and_evict_the_cache_when_the_pool_is_short():
    rng = random.Random()
    vocab = oracle().vocab_size
    prompts = [[rng.randrange(2, vocab) for _ in range(40)] for _ in range(3)]  # 10 pages each
    config = worker_config("grpc")

    async def run():
        engine = PrefillEngine(runner(num_pages=16), config)  # fits one prompt at a time
        await engine.start()
        decode = FakeDecode(engine.pool, config)
        try:
            jobs = []
            for room, prompt in enumerate(prompts, start=10):
                request = GenerateRequest(f"p{room}", tuple(prompt), GREEDY,
                                          disagg=DisaggParams("127.0.0.1", engine.bootstrap_port, room))
                jobs += [collect(engine, request), decode.pull(engine.bootstrap_port, room, prompt)]
            results = await asyncio.gather(*jobs)
            too_big = GenerateRequest("big", tuple([5] * 100), GREEDY,
                                      disagg=DisaggParams("127.0.0.1", engine.bootstrap_port, 99))
            big, _ = await asyncio.gather(collect(engine, too_big), decode.pull(engine.bootstrap_port, 99, [5] * 100),
                                          return_exceptions=True)
            assert engine.pool.num_used_pages == engine.cache.num_pages
            return results[0::2], big
        finally:
            await decode.client.close()
            await engine.stop()

    outcomes, big = asyncio.run(run())
    for prompt, outcome in zip(prompts, outcomes):
        assert outcome.ok and outcome.tokens == oracle().generate(prompt, GREEDY).output_ids[:1]
    assert isinstance(big.terminal, Failed) and big.terminal.code == FailureCode.RESOURCE_EXHAUSTED


def test_prompt_larger_than_the_usable_pool_fails_at_once():
    """`--engine-opt cuda_graph=true` makes the runner keep one KV page: a prompt needing all of
    pool.num_pages can never be admitted and must fail now, not after admission_timeout_s
    (holding the head of the admission queue all that time)."""
    import dataclasses

    rng = random.Random()
    num_pages = rng.randrange(8, 16)
    prompt = [rng.randrange(2, oracle().vocab_size) for _ in range(num_pages * PAGE_SIZE - rng.randrange(PAGE_SIZE))]
    config = dataclasses.replace(worker_config("grpc"), scheduler=SchedulerConfig(
        chunked_prefill_size=CHUNK, admission_timeout_s=600))

    async def run():
        model_runner = runner(num_pages)
        scratch = model_runner.kv_pool.alloc(1)  # what DecodeGraphRunner takes at construction
        engine = PrefillEngine(model_runner, config)
        await engine.start()
        decode = FakeDecode(engine.pool, config)
        try:
            request = GenerateRequest("big", tuple(prompt), GREEDY,
                                      disagg=DisaggParams("127.0.0.1", engine.bootstrap_port, 5))
            outcome, _ = await asyncio.wait_for(asyncio.gather(
                collect(engine, request), decode.pull(engine.bootstrap_port, 5, prompt),
                return_exceptions=True), 30)
            assert engine.pool.num_used_pages == 1 + engine.cache.num_pages
            return outcome
        finally:
            await decode.client.close()
            await engine.stop()
            engine.pool.free(scratch)

    outcome = asyncio.run(run())
    assert isinstance(outcome.terminal, Failed) and outcome.terminal.code == FailureCode.RESOURCE_EXHAUSTED


def test_scheduler_config_rejects_nonsense():
    from deepseek_pd.errors import UserError
    with pytest.raises(UserError, match="chunked_prefill_size"):
        SchedulerConfig(chunked_prefill_size=0)

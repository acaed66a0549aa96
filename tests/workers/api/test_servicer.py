"""The SglangScheduler servicer over real gRPC on 127.0.0.1, with a scripted engine behind it.

Each test starts a grpc.aio server on a free port and talks to it with our `SchedulerClient`, the
same way the router does: proto in, proto out, gRPC status codes for errors.
"""
from __future__ import annotations

import asyncio
import contextlib
import random

import grpc
import pytest
from smg_grpc_proto import sglang_scheduler_pb2 as pb

from deepseek_pd.client.scheduler_grpc import SchedulerClient, collect, sampling_proto
from deepseek_pd.workers.api.served_model import ServedModelInfo
from deepseek_pd.workers.api.server import ServerConfig, WorkerServer
from deepseek_pd.workers.api.servicer import WorkerIdentity
from pdtest.servicer_fakes import CRASH_TOKEN, EOS, FAIL_TOKEN, FAILURE_CODES, PAGE_SIZE, SLOW_TOKEN, FakeEngine, expected_tokens, \
    make_tokenizer_model_dir

pytestmark = pytest.mark.timeout(60)


@pytest.fixture(scope="module")
def model_info(tmp_path_factory) -> ServedModelInfo:
    return ServedModelInfo.from_model_dir(make_tokenizer_model_dir(tmp_path_factory.mktemp("m")), "fake")


@contextlib.asynccontextmanager
async def serving(info: ServedModelInfo, engine: FakeEngine | None = None):
    engine = engine or FakeEngine()
    server = WorkerServer(engine, info, WorkerIdentity("decode", "grpc", 0, PAGE_SIZE),
                          ServerConfig("127.0.0.1", 0, drain_timeout_s=1.0, stop_grace_s=0.5))
    port = await server.start()
    client = SchedulerClient(f"127.0.0.1:{port}")
    try:
        yield server, client, engine
    finally:
        await client.close()
        await server.shutdown()


def request(input_ids: list[int], stream: bool, rid: str | None = None, **sampling) -> pb.GenerateRequest:
    return pb.GenerateRequest(request_id=rid or f"r{random.randrange(10**9)}",
                              tokenized=pb.TokenizedInput(input_ids=input_ids),
                              sampling_params=sampling_proto(**sampling), stream=stream)


def random_prompt(rng: random.Random, low: int = 1, high: int = 30) -> list[int]:
    return [rng.randrange(9, 300) for _ in range(rng.randint(low, high))]


@pytest.mark.parametrize("stream", [False, True])
def test_generate_returns_engine_tokens(model_info, stream: bool) -> None:
    rng = random.Random()
    prompts = [random_prompt(rng) for _ in range(4)]

    async def main():
        async with serving(model_info) as (_, client, engine):
            for prompt in prompts:
                budget = rng.randint(1, 12)
                responses = [r async for r in client.generate(request(prompt, stream, max_new_tokens=budget))]
                kinds = [r.WhichOneof("response") for r in responses]
                assert kinds == ["chunk"] * (budget if stream else 0) + ["complete"]
                ids, complete = await collect(_aiter(responses))
                assert ids == expected_tokens(tuple(prompt), budget)
                assert complete.finish_reason == "length"
                assert (complete.prompt_tokens, complete.completion_tokens) == (len(prompt), budget)
                if stream:  # every token went out in a chunk; counts are cumulative
                    assert list(complete.output_ids) == []
                    assert [r.chunk.completion_tokens for r in responses[:-1]] == list(range(1, budget + 1))
            assert engine.pages_in_use == {}

    asyncio.run(main())


async def _aiter(items):
    for item in items:
        yield item


@pytest.mark.parametrize("mutate,words", [
    (lambda r: r.tokenized.ClearField("input_ids"), "prompt is empty"),
    (lambda r: r.tokenized.input_ids.extend([9] * 80), "maximum context is"),
    (lambda r: setattr(r.sampling_params, "max_new_tokens", 0), "max_new_tokens"),
    (lambda r: setattr(r.sampling_params, "top_p", 0.0), "top_p"),
    (lambda r: setattr(r.sampling_params, "top_p", 1.01), "top_p"),
    (lambda r: setattr(r.sampling_params, "n", 3), "n=3"),
    (lambda r: setattr(r.sampling_params, "json_schema", '{"type": "object"}'), "structured output"),
])
def test_bad_requests_get_invalid_argument_with_message(model_info, mutate, words) -> None:
    async def main():
        async with serving(model_info) as (_, client, engine):
            req = request(random_prompt(random.Random()), stream=True)
            mutate(req)
            with pytest.raises(grpc.aio.AioRpcError) as info:
                await collect(client.generate(req))
            assert info.value.code() == grpc.StatusCode.INVALID_ARGUMENT
            assert words in info.value.details()
            assert engine.requests == []  # never reached the engine

    asyncio.run(main())


@pytest.mark.parametrize("code_index", range(len(FAILURE_CODES)))
def test_engine_failure_maps_to_status_once(model_info, code_index: int) -> None:
    failure = FAILURE_CODES[code_index]

    async def main():
        async with serving(model_info) as (_, client, engine):
            responses, error = [], None
            try:
                async for response in client.generate(request([FAIL_TOKEN, code_index, 30], True,
                                                              max_new_tokens=8)):
                    responses.append(response)
            except grpc.aio.AioRpcError as exc:
                error = exc
            # FailureCode members are named after the gRPC status they stand for.
            assert error is not None and error.code() == getattr(grpc.StatusCode, failure.name)
            assert f"scripted failure {failure.name}" in error.details()
            # Two tokens streamed before the failure, and no complete message after it.
            assert [r.WhichOneof("response") for r in responses] == ["chunk", "chunk"]
            for _ in range(100):  # the status can reach us before the server's cleanup has run
                if not engine.pages_in_use:
                    break
                await asyncio.sleep(0.02)
            assert engine.pages_in_use == {}

    asyncio.run(main())


def test_engine_exception_becomes_internal_and_aborts_the_request(model_info) -> None:
    async def main():
        async with serving(model_info) as (_, client, engine):
            with pytest.raises(grpc.aio.AioRpcError) as info:
                await collect(client.generate(request([CRASH_TOKEN, 5], False, rid="crash", max_new_tokens=5)))
            assert info.value.code() == grpc.StatusCode.INTERNAL
            assert "scripted engine bug" in info.value.details()
            for _ in range(100):
                if "crash" in engine.aborted:
                    break
                await asyncio.sleep(0.02)
            assert "crash" in engine.aborted
            # The worker keeps serving.
            ids, _ = await collect(client.generate(request([20, 21], False, max_new_tokens=3)))
            assert ids == expected_tokens((20, 21), 3)

    asyncio.run(main())


def test_client_cancel_aborts_request_and_frees_pages(model_info) -> None:
    async def main():
        async with serving(model_info) as (_, client, engine):
            call = client.generate(request([SLOW_TOKEN, 11], True, rid="cancel-me", max_new_tokens=200))
            got = 0
            async for _ in call:
                got += 1
                if got == 3:
                    assert engine.pages_in_use.get("cancel-me", 0) > 0
                    call.cancel()
                    break
            for _ in range(100):
                if "cancel-me" in engine.aborted and not engine.pages_in_use:
                    break
                await asyncio.sleep(0.02)
            assert "cancel-me" in engine.aborted
            assert engine.pages_in_use == {}
            loads = await client.loads()
            assert loads.num_used_tokens == 0 and loads.num_running_reqs == 0

    asyncio.run(main())


def test_abort_rpc_ends_stream_with_abort_reason(model_info) -> None:
    async def main():
        async with serving(model_info) as (_, client, engine):
            call = client.generate(request([SLOW_TOKEN, 12], True, rid="abort-me", max_new_tokens=200))
            responses = []
            async for response in call:
                responses.append(response)
                if len(responses) == 2:
                    assert await client.abort("abort-me", "test") is True
            assert responses[-1].complete.finish_reason == "abort"
            assert len(responses) < 200
            assert await client.abort("no-such-request") is False

    asyncio.run(main())


def test_duplicate_request_id_is_refused(model_info) -> None:
    async def main():
        async with serving(model_info) as (_, client, _engine):
            first = client.generate(request([SLOW_TOKEN, 13], True, rid="dup", max_new_tokens=50))
            await first.read()  # the first request is running now
            with pytest.raises(grpc.aio.AioRpcError) as info:
                await collect(client.generate(request([14], True, rid="dup")))
            assert info.value.code() == grpc.StatusCode.ALREADY_EXISTS
            first.cancel()

    asyncio.run(main())


def test_model_info_loads_and_health(model_info) -> None:
    async def main():
        async with serving(model_info) as (server, client, engine):
            info = await client.model_info()
            assert info.served_model_name == "fake" and info.model_path == model_info.model_path
            assert info.tokenizer_path == model_info.tokenizer_path and info.is_generation
            assert list(info.eos_token_ids) == [EOS] and info.vocab_size == model_info.vocab_size
            assert info.max_context_length == model_info.max_context_length
            assert info.max_req_input_len == model_info.max_context_length - 1
            assert list(info.architectures) == ["DeepseekV3ForCausalLM"]
            server_info = await client.server_info()
            assert server_info.server_args["disaggregation_mode"] == "decode"
            assert server_info.server_type == "grpc"

            call = client.generate(request([SLOW_TOKEN, 15, 16], True, max_new_tokens=100))
            await call.read()
            loads = await client.loads()
            assert loads.num_running_reqs == 1
            assert loads.num_used_tokens == sum(engine.pages_in_use.values()) * PAGE_SIZE > 0
            assert loads.max_total_num_tokens == engine.total_pages * PAGE_SIZE
            call.cancel()
            assert (await client.health()).healthy

            server.servicer.start_draining()
            assert not (await client.health()).healthy
            with pytest.raises(grpc.aio.AioRpcError) as err:
                await collect(client.generate(request([17], False)))
            assert err.value.code() == grpc.StatusCode.UNAVAILABLE

    asyncio.run(main())


def test_concurrent_streams_are_independent(model_info) -> None:
    rng = random.Random()
    jobs = [(random_prompt(rng), rng.randint(1, 20), rng.random() < 0.5) for _ in range(40)]

    async def main():
        async with serving(model_info) as (_, client, engine):
            async def one(prompt, budget, stream):
                ids, _ = await collect(client.generate(request(prompt, stream, max_new_tokens=budget)))
                return ids
            results = await asyncio.gather(*(one(*job) for job in jobs))
            for (prompt, budget, _), ids in zip(jobs, results):
                assert ids == expected_tokens(tuple(prompt), budget)
            assert engine.pages_in_use == {}

    asyncio.run(main())


def test_get_tokenizer_streams_a_verified_zip(model_info, tmp_path) -> None:
    import hashlib
    import io
    import zipfile
    from pathlib import Path

    from smg_grpc_proto.generated import common_pb2

    async def main():
        async with serving(model_info) as (_, client, _engine):
            chunks = [c async for c in client.stub.GetTokenizer(common_pb2.GetTokenizerRequest())]
            return chunks

    chunks = asyncio.run(main())
    data = b"".join(c.data for c in chunks)
    assert [bool(c.sha256) for c in chunks] == [False] * (len(chunks) - 1) + [True]
    assert chunks[-1].sha256 == hashlib.sha256(data).hexdigest()
    with zipfile.ZipFile(io.BytesIO(data)) as archive:
        for name in ("tokenizer.json", "tokenizer_config.json", "config.json"):
            assert archive.read(name) == (Path(model_info.tokenizer_path) / name).read_bytes()


class _HeldEngine(FakeEngine):
    """A FakeEngine whose requests start only once `release` is set: as a prefill worker's one
    message waits for decode's confirmed TransferDone."""

    def __init__(self) -> None:
        super().__init__()
        self.release = asyncio.Event()

    async def generate(self, request):
        await self.release.wait()
        async for event in super().generate(request):
            yield event


def test_headers_go_out_before_the_first_token(model_info) -> None:
    """The router's PD dispatch waits for both calls' headers before it streams decode's first
    token; a worker that sent them only with its first message held that token back."""
    rng = random.Random()
    prompt = random_prompt(rng)
    budget = rng.randint(1, 8)

    async def main():
        engine = _HeldEngine()
        async with serving(model_info, engine) as (_, client, _engine):
            call = client.generate(request(prompt, True, max_new_tokens=budget))
            await asyncio.wait_for(call.initial_metadata(), 5.0)  # before any token exists
            assert not engine.release.is_set()
            engine.release.set()
            ids, complete = await collect(call)
            assert ids == expected_tokens(tuple(prompt), budget)
            assert complete.finish_reason == "length"

    asyncio.run(main())

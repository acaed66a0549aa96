"""Top logprobs over real gRPC: the SglangScheduler servicer in front of a real colocated decode
engine (tiny model, CPU), asked the way smg asks (`return_logprob`, `logprob_start_len=-1`,
`top_logprobs_num`). OutputLogProbs carries one TopLogProbs per token in chunks (streamed) or in
the complete message (not), checked against full forwards (pdtest.gateway_oracle). Out-of-range
counts and prompt logprobs are INVALID_ARGUMENT naming the field."""
from __future__ import annotations

import asyncio
import contextlib
import random

import grpc
import pytest
from smg_grpc_proto import sglang_scheduler_pb2 as pb

from deepseek_pd.client.scheduler_grpc import SchedulerClient, sampling_proto
from deepseek_pd.model.sampling.sampled_host import TopLogprobs
from deepseek_pd.model.sampling.params import MAX_TOP_LOGPROBS, SamplingParams
from deepseek_pd.workers.api.served_model import ServedModelInfo
from deepseek_pd.workers.api.server import ServerConfig, WorkerServer
from deepseek_pd.workers.api.servicer import WorkerIdentity
from deepseek_pd.workers.decode.engine import DecodeEngine
from pdtest.pd_engine_harness import PAGE_SIZE, oracle, runner, worker_config
from pdtest.top_logprobs_check import assert_top_matches

pytestmark = pytest.mark.timeout(180)


@contextlib.asynccontextmanager
async def serving():
    engine = DecodeEngine(runner(), worker_config("fake"), tokenizer=oracle().tokenizer)
    await engine.start()
    info = ServedModelInfo.from_model_dir(oracle().model_path, "tiny")
    server = WorkerServer(engine, info, WorkerIdentity("decode", "grpc", 0, PAGE_SIZE),
                          ServerConfig("127.0.0.1", 0, drain_timeout_s=1.0, stop_grace_s=0.5))
    port = await server.start()
    client = SchedulerClient(f"127.0.0.1:{port}")
    try:
        yield client, engine
    finally:
        await client.close()
        await server.shutdown()
        await engine.stop()


def request(prompt: list[int], stream: bool, k: int, start: int = -1, **sampling) -> pb.GenerateRequest:
    return pb.GenerateRequest(request_id=f"r{random.randrange(10**9)}", tokenized=pb.TokenizedInput(input_ids=prompt),
                              sampling_params=sampling_proto(**sampling), stream=stream, return_logprob=True,
                              logprob_start_len=start, top_logprobs_num=k)


def _tops(out: pb.OutputLogProbs) -> list[TopLogprobs]:
    return [TopLogprobs(tuple(e.token_ids), tuple(e.values)) for e in out.top_logprobs]


@pytest.mark.parametrize("stream", [False, True])
def test_top_logprobs_reach_the_proto_per_token(stream: bool) -> None:
    rng = random.Random()
    cases = [([rng.randrange(2, oracle().vocab_size) for _ in range(rng.randint(3, 40))],
              rng.randint(1, MAX_TOP_LOGPROBS), rng.randint(2, 6)) for _ in range(3)]

    async def main():
        results = []
        async with serving() as (client, engine):
            for prompt, k, budget in cases:
                responses = [r async for r in client.generate(request(
                    prompt, stream, k, max_new_tokens=budget, temperature=0.0, ignore_eos=True))]
                ids, logprobs, tops = [], [], []
                for r in responses:
                    part = r.chunk if r.WhichOneof("response") == "chunk" else r.complete
                    ids += list(part.token_ids if r.WhichOneof("response") == "chunk" else part.output_ids)
                    logprobs += list(part.output_logprobs.token_logprobs)
                    tops += _tops(part.output_logprobs)
                    if r.WhichOneof("response") == "chunk":  # each chunk's entries are its own tokens'
                        assert len(part.output_logprobs.top_logprobs) == len(part.token_ids)
                results.append((ids, logprobs, tops))
            assert engine.pool.num_used_pages == 0
        return results

    for (prompt, k, budget), (ids, logprobs, tops) in zip(cases, asyncio.run(main())):
        assert ids == oracle().generate(prompt, SamplingParams(temperature=0.0, max_new_tokens=budget, ignore_eos=True)).output_ids
        assert len(logprobs) == len(ids)
        assert_top_matches(oracle(), tops, ids, prompt, k)


@pytest.mark.parametrize("k,start,field", [(MAX_TOP_LOGPROBS + 1, -1, "top_logprobs_num"),
                                           (-3, -1, "top_logprobs_num"), (2, 0, "logprob_start_len")])
def test_unsupported_logprob_requests_are_invalid_argument(k: int, start: int, field: str) -> None:
    async def main():
        async with serving() as (client, _):
            with pytest.raises(grpc.aio.AioRpcError) as caught:
                async for _ in client.generate(request([5, 6, 7], False, k, start, max_new_tokens=2)):
                    pass
            return caught.value

    error = asyncio.run(main())
    assert error.code() == grpc.StatusCode.INVALID_ARGUMENT and field in error.details(), error.details()

"""The real router (sgl-model-gateway, unchanged) in front of our real prefill and decode workers.

One 1P1D cluster on the tiny model serves the whole module. What must hold:
- greedy output through `/generate` (streaming and not) equals the offline single-process Engine
  token for token, for prompts that are chunked and for prompts that share a prefix (cache hits);
- `/v1/chat/completions` works streaming and not, and the two agree;
- 200 concurrent requests of mixed lengths each complete exactly once with the right length, and
  both KV pools are back to empty afterwards (GetLoads);
- a request the workers reject comes back from the router as an error carrying our message;
- a client that drops its connection mid-stream gets its request aborted and its KV freed;
- the same parity with the Mooncake transport, inside a private network namespace.
"""
from __future__ import annotations

import asyncio
import random

import pytest

from deepseek_pd.client.router_http import RouterClient, RouterError
from deepseek_pd.client.scheduler_grpc import SchedulerClient
from deepseek_pd.launcher.cluster import LocalCluster
from pdtest.e2e_cluster import CHUNKED_PREFILL_SIZE, PAGE_SIZE, cluster_spec, wait_for_pages

pytestmark = [pytest.mark.timeout(300), pytest.mark.slow]


@pytest.fixture(scope="module")
def cluster(tmp_path_factory):
    with LocalCluster(cluster_spec(tmp_path_factory.mktemp("e2e"))) as running:
        yield running


@pytest.fixture(scope="module")
def offline_engine():
    from deepseek_pd.workers.engine.offline import Engine

    return Engine(model="tiny", chunked_prefill_size=CHUNKED_PREFILL_SIZE, page_size=PAGE_SIZE)


def offline_greedy(engine, input_ids: list[int], max_new_tokens: int) -> list[int]:
    from deepseek_pd.model.sampling.params import SamplingParams

    result = engine.generate(input_ids, SamplingParams(max_new_tokens=max_new_tokens, temperature=0.0))
    return list(result.output_ids), list(result.output_logprobs)


def parity_prompts(rng: random.Random, vocab: int) -> list[list[int]]:
    def tokens(n: int) -> list[int]:
        return [rng.randrange(3, vocab) for _ in range(n)]

    short = tokens(rng.randint(3, 9))
    chunked = tokens(CHUNKED_PREFILL_SIZE * 2 + rng.randint(1, 9))  # three prefill chunks
    shared_prefix = tokens(CHUNKED_PREFILL_SIZE + 8)
    # The second and third share the first's prefix, so the prefill worker's cache hits.
    return [short, chunked, shared_prefix + tokens(5), shared_prefix + tokens(11), shared_prefix]


def test_generate_matches_offline_engine(cluster, offline_engine) -> None:
    rng = random.Random()
    vocab = offline_engine.vocab_size
    prompts = parity_prompts(rng, vocab)
    max_new = 8
    expected = [offline_greedy(offline_engine, p, max_new) for p in prompts]

    async def main():
        async with RouterClient(cluster.router_url, cluster.served_model_name) as client:
            shared_len = len(prompts[-1])
            for stream in (False, True):
                for index, (prompt, (want, want_logprobs)) in enumerate(zip(prompts, expected)):
                    got = await client.generate(input_ids=prompt, stream=stream, return_logprob=True,
                                                max_new_tokens=max_new, temperature=0.0)
                    assert got.output_ids == want, (stream, len(prompt))
                    assert got.output_logprobs == pytest.approx(want_logprobs, abs=1e-4)
                    assert got.finish_reason in ("length", "stop")
                    assert got.prompt_tokens == len(prompt)
                    # The prefix cache really was hit (the count comes back from the prefill side).
                    if index == 3 and not stream:
                        assert got.cached_tokens >= shared_len // PAGE_SIZE * PAGE_SIZE
                    if stream and len(prompt) > PAGE_SIZE:
                        assert got.cached_tokens > 0

    asyncio.run(main())


def test_chat_completions_streaming_and_not_agree(cluster) -> None:
    messages = [{"role": "user", "content": f"Tell me about disaggregation, take {random.randrange(10**6)}"}]

    async def main():
        async with RouterClient(cluster.router_url, cluster.served_model_name) as client:
            whole = await client.chat(messages, stream=False, max_tokens=12, temperature=0.0)
            pieces: list[str] = []
            streamed = await client.chat(messages, stream=True, on_text=pieces.append,
                                         max_tokens=12, temperature=0.0)
            assert whole.finish_reason in ("length", "stop")
            assert streamed.content == whole.content == "".join(pieces)
            assert whole.completion_tokens >= 1
            if whole.finish_reason == "length":
                assert whole.completion_tokens == 12

    asyncio.run(main())


def test_two_hundred_concurrent_requests(cluster) -> None:
    rng = random.Random()
    jobs = [([rng.randrange(3, 200) for _ in range(rng.randint(1, 90))], rng.randint(1, 12),
             rng.random() < 0.5) for _ in range(200)]

    async def main():
        async with RouterClient(cluster.router_url, cluster.served_model_name, timeout_s=240) as client:
            async def one(prompt, budget, stream):
                return await client.generate(input_ids=prompt, stream=stream, max_new_tokens=budget,
                                             temperature=0.0, ignore_eos=True)
            results = await asyncio.gather(*(one(*job) for job in jobs))
        for (prompt, budget, _), result in zip(jobs, results):
            assert len(result.output_ids) == budget and result.finish_reason == "length"
            assert result.prompt_tokens == len(prompt)
        for worker in cluster.workers:
            address = worker.address(cluster.spec.host)
            pages = await wait_for_pages(address, 0, timeout_s=20)
            assert pages == 0, f"{worker.process.name} still holds {pages} KV pages"
            async with SchedulerClient(address) as scheduler:
                load = await scheduler.loads()
            assert load.num_running_reqs == load.num_waiting_reqs == 0, worker.process.name

    asyncio.run(main())


def test_rejected_request_reaches_the_client_with_our_message(cluster) -> None:
    async def main():
        async with RouterClient(cluster.router_url, cluster.served_model_name) as client:
            with pytest.raises(RouterError) as info:
                await client.generate(input_ids=[5, 6, 7], max_new_tokens=4, top_p=0.0)
            # The router reports a worker-side INVALID_ARGUMENT as a 5xx but keeps our text.
            assert info.value.status >= 400
            assert "top_p" in info.value.message and "invalid" in info.value.message.lower()
            # ...and the worker pair still serves the next request.
            ok = await client.generate(input_ids=[5, 6, 7], max_new_tokens=3, temperature=0.0)
            assert len(ok.output_ids) >= 1

    asyncio.run(main())


@pytest.mark.netns
@pytest.mark.timeout(400)
def test_mooncake_transport_parity_in_private_netns(tmp_path) -> None:
    """Mooncake binds 0.0.0.0 whatever it is told, so the whole cluster runs in its own netns."""
    import json
    from pathlib import Path

    from pdtest.netns import run_in_netns

    out = tmp_path / "report.json"
    run_in_netns(Path(__file__).with_name("netns_parity_script.py"), "mooncake", str(out), timeout_s=380)
    report = json.loads(out.read_text())
    assert report["transport_logged"], "workers did not report the mooncake transport"
    assert report["checked"] == 8 and report["mismatches"] == []
    assert set(report["used_pages"].values()) == {0}, report["used_pages"]


def test_client_disconnect_mid_stream_frees_kv_on_both_workers(cluster) -> None:
    """A user who closes the connection must not leave a decode running to max_new_tokens."""
    import aiohttp

    worker = cluster.decode_workers()[0]
    log_offset = len(worker.process.log_path.read_text())

    async def main():
        body = {"model": cluster.served_model_name, "input_ids": [9, 10, 11, 12, 13],
                "sampling_params": {"max_new_tokens": 3000, "temperature": 0.0, "ignore_eos": True},
                "stream": True}
        async with aiohttp.ClientSession() as session:
            response = await session.post(f"{cluster.router_url}/generate", json=body)
            assert response.status == 200
            received = 0
            async for line in response.content:
                received += line.startswith(b"data:")
                if received == 3:
                    break
            response.close()  # drop the connection mid-stream
        decode = worker.address(cluster.spec.host)
        pages = await wait_for_pages(decode, 0, timeout_s=20)
        # Freed by the abort, not by running out its 3000 tokens.
        log = worker.process.log_path.read_text()[log_offset:]
        # smg 1.13 sends an Abort RPC when the client's stream drops ("Stream dropped"), then
        # cancels the call; sglang-router 0.3.2 only cancelled it. Either way the engine stops.
        assert "ended before its engine finished it" in log or "(Stream dropped): aborted" in log, log[-2000:]
        assert pages == 0, f"decode still holds {pages} pages of an abandoned request"
        async with SchedulerClient(decode) as scheduler:
            assert (await scheduler.loads()).num_running_reqs == 0

    asyncio.run(main())

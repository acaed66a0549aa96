"""`WorkerMetrics` as the servicer feeds it: every outcome counted once under its name, over the real
gRPC servicer and the real /metrics endpoint (`MetricsServer`), with the scripted engine of
pdtest.servicer_fakes behind it.

Oracle: the script. A random mix of requests whose outcome the fake engine decides from the prompt
(tokens, a failure with a given code, an engine crash), plus client cancels and requests the
servicer refuses; the test tallies what each must count and compares with the scrape.
"""
from __future__ import annotations

import asyncio
import collections
import contextlib
import random
import socket

import aiohttp
import grpc
import pytest
from prometheus_client.parser import text_string_to_metric_families

from deepseek_pd.client.scheduler_grpc import SchedulerClient, collect, sampling_proto
from deepseek_pd.errors import UserError
from deepseek_pd.workers.metrics.worker_metrics import MetricLabels, WorkerMetrics
from deepseek_pd.workers.metrics.server import MetricsConfig, MetricsServer
from deepseek_pd.workers.api.served_model import ServedModelInfo
from deepseek_pd.workers.api.server import ServerConfig, WorkerServer
from deepseek_pd.workers.api.servicer import WorkerIdentity
from pdtest.servicer_fakes import (
    CRASH_TOKEN, FAIL_TOKEN, FAILURE_CODES, PAGE_SIZE, SLOW_TOKEN, FakeEngine, expected_tokens,
    make_tokenizer_model_dir)
from smg_grpc_proto import sglang_scheduler_pb2 as pb

pytestmark = pytest.mark.timeout(60)
P = "deepseek_pd:"


@pytest.fixture(scope="module")
def model_info(tmp_path_factory) -> ServedModelInfo:
    return ServedModelInfo.from_model_dir(make_tokenizer_model_dir(tmp_path_factory.mktemp("m")), "fake")


@contextlib.asynccontextmanager
async def serving(info: ServedModelInfo, labels: MetricLabels):
    engine = FakeEngine(total_pages=random.randint(100, 1000))
    metrics = WorkerMetrics(labels)
    metrics.watch_loads(engine.loads)
    server = WorkerServer(engine, info, WorkerIdentity("decode", "grpc", 0, PAGE_SIZE),
                          ServerConfig("127.0.0.1", 0, drain_timeout_s=1.0, stop_grace_s=0.5), metrics)
    exporter = MetricsServer(metrics, MetricsConfig("127.0.0.1", 0))
    port = await server.start()
    metrics_port = await exporter.start()
    client = SchedulerClient(f"127.0.0.1:{port}")
    try:
        yield client, engine, f"http://127.0.0.1:{metrics_port}/metrics"
    finally:
        await client.close()
        await server.shutdown()
        await exporter.stop()


async def scrape(url: str) -> tuple[dict, list[dict]]:
    async with aiohttp.ClientSession() as session, session.get(url) as response:
        assert response.status == 200 and response.headers["Content-Type"].startswith("text/plain")
        text = await response.text()
    samples, label_sets = {}, []
    for family in text_string_to_metric_families(text):
        for sample in family.samples:
            label_sets.append(sample.labels)
            rest = frozenset((k, v) for k, v in sample.labels.items() if k not in ("role", "model_name", "rank"))
            samples[(sample.name, rest)] = sample.value
    return samples, label_sets


def value(samples, name: str, **labels) -> float:
    return samples.get((P + name, frozenset(labels.items())), 0.0)


def request(input_ids, max_new: int, stream: bool, rid: str) -> pb.GenerateRequest:
    return pb.GenerateRequest(request_id=rid, tokenized=pb.TokenizedInput(input_ids=input_ids),
                              sampling_params=sampling_proto(max_new), stream=stream)


def test_every_outcome_is_counted_once_under_its_name(model_info) -> None:
    rng = random.Random()
    labels = MetricLabels(role=rng.choice(["prefill", "decode"]), model_name="fake", rank=rng.randrange(4))
    plan = [rng.choice(["ok", "ok", "fail", "crash", "cancel", "invalid"]) for _ in range(rng.randint(10, 20))]
    want_failed: collections.Counter = collections.Counter()
    want = dict(ok=0, prompt=0, generated=0, tpot=0)

    async def main():
        async with serving(model_info, labels) as (client, engine, url):
            before, _ = await scrape(url)
            assert value(before, "kv_pool_total_pages") == engine.total_pages

            async def one(i: int, kind: str) -> None:
                prompt = [rng.randrange(9, 300) for _ in range(rng.randint(2, 20))]
                max_new = rng.randint(1, 12)
                if kind == "ok":
                    ids, complete = await collect(client.generate(request(prompt, max_new, bool(i % 2), f"r{i}")))
                    assert ids == expected_tokens(tuple(prompt), max_new)
                    want["ok"] += 1
                    want["prompt"] += len(prompt)
                    want["generated"] += max_new
                    want["tpot"] += max_new > 1
                    return
                if kind == "cancel":
                    call = client.generate(request([SLOW_TOKEN] + prompt, 200, True, f"r{i}"))
                    async for _ in call:
                        call.cancel()
                        break
                    want_failed["cancelled"] += 1
                    return
                if kind == "invalid":  # refused by the servicer, never reaching the engine
                    bad = request(prompt, max_new, True, f"r{i}")
                    bad.sampling_params.top_p = 0.0
                    code, name = grpc.StatusCode.INVALID_ARGUMENT, "invalid_argument"
                elif kind == "crash":
                    bad = request([CRASH_TOKEN] + prompt, 5, True, f"r{i}")
                    code, name = grpc.StatusCode.INTERNAL, "internal"
                else:
                    index = rng.randrange(len(FAILURE_CODES))
                    bad = request([FAIL_TOKEN, index] + prompt, 5, True, f"r{i}")
                    code, name = None, FAILURE_CODES[index].value
                with pytest.raises(grpc.aio.AioRpcError) as failed:
                    await collect(client.generate(bad))
                assert code is None or failed.value.code() == code
                want_failed[name] += 1

            # A request in flight shows in the gauges read at scrape time.
            slow = asyncio.ensure_future(collect(client.generate(request([SLOW_TOKEN, 10], 20, True, "slow"))))
            while "slow" not in engine.pages_in_use:
                await asyncio.sleep(0.01)
            during, _ = await scrape(url)
            assert value(during, "num_running_reqs") == 1
            assert value(during, "kv_pool_used_pages") == engine.pages_in_use["slow"] > 0
            await slow
            want.update(ok=want["ok"] + 1, prompt=want["prompt"] + 2, generated=want["generated"] + 20,
                        tpot=want["tpot"] + 1)
            await asyncio.gather(*(one(i, kind) for i, kind in enumerate(plan)))
            for _ in range(100):  # cancels end asynchronously on the server
                after, label_sets = await scrape(url)
                if sum(value(after, "num_failed_requests_total", code=c) for c in want_failed) == sum(
                        want_failed.values()) and not engine.pages_in_use:
                    break
                await asyncio.sleep(0.02)
            return after, label_sets

    after, label_sets = asyncio.run(main())
    assert value(after, "num_requests_total", finish_reason="length") == want["ok"]
    assert value(after, "prompt_tokens_total") == want["prompt"]
    assert value(after, "generation_tokens_total") == want["generated"]
    assert value(after, "e2e_request_latency_seconds_count") == want["ok"]
    assert value(after, "time_to_first_token_seconds_count") == want["ok"]
    assert value(after, "time_per_output_token_seconds_count") == want["tpot"]
    for name in {c.value for c in FAILURE_CODES} | {"cancelled"}:
        assert value(after, "num_failed_requests_total", code=name) == want_failed[name], name
    assert value(after, "kv_pool_used_pages") == 0 and value(after, "num_running_reqs") == 0
    assert all(s["role"] == labels.role and s["rank"] == str(labels.rank) and s["model_name"] == "fake"
               for s in label_sets)


def test_a_taken_metrics_port_is_a_clear_error() -> None:
    async def main():
        with socket.socket() as holder:
            holder.bind(("127.0.0.1", 0))
            holder.listen()
            port = holder.getsockname()[1]
            with pytest.raises(UserError, match=f"cannot serve metrics on 127.0.0.1:{port}"):
                await MetricsServer(WorkerMetrics(), MetricsConfig("127.0.0.1", port)).start()

    asyncio.run(main())


@pytest.mark.parametrize("port", [-1, 65536])
def test_a_bad_metrics_port_is_refused(port: int) -> None:
    with pytest.raises(UserError, match="--metrics-port"):
        MetricsConfig("127.0.0.1", port)


def test_ranks_get_consecutive_ports_and_zero_stays_zero() -> None:
    base = random.randrange(1024, 60000)
    assert [MetricsConfig("h", base).for_local_rank(k).port for k in range(4)] == [base, base + 1, base + 2, base + 3]
    assert MetricsConfig("h", 0).for_local_rank(3).port == 0
    assert MetricsConfig("h", None).for_local_rank(3).port is None
    with pytest.raises(UserError):
        MetricsConfig("h", 65535).for_local_rank(1)

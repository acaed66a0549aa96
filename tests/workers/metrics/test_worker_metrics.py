"""A worker's /metrics after real traffic equals what was sent to it and what it generated.

The real path: `deepseek-pd up`'s launcher (tiny model, CPU, one prefill + one decode worker, each
with `--metrics-port`, and the router with its own Prometheus port). N random PD requests go
straight to the workers (PDClient), K more through the router's /generate (`up` runs it with
retries off, so each reaches each worker once), plus one colocated request and one transfer that
must fail. The oracle is the client's own record: prompts sent, tokens received, and the KV bytes
the pool geometry implies; the router's own exporter must count the K requests it routed.
"""
from __future__ import annotations

import asyncio
import random
import urllib.request

import grpc
import pytest
from prometheus_client.parser import text_string_to_metric_families

from deepseek_pd.client.pd_dispatch import PDClient
from deepseek_pd.client.router_http import RouterClient
from deepseek_pd.client.scheduler_grpc import SchedulerClient, collect, sampling_proto
from deepseek_pd.launcher.cluster import LocalCluster
from deepseek_pd.model.config import ModelConfig
from deepseek_pd.model.checkpoint.model_dir import resolve_model_dir
from pdtest.e2e_cluster import PAGE_SIZE, cluster_spec, wait_for_pages

pytestmark = [pytest.mark.timeout(300), pytest.mark.slow]

NUM_PAGES = 2048  # e2e_cluster's --num-pages
P = "deepseek_pd:"


def scrape(url: str) -> dict[tuple[str, frozenset], float]:
    """{(sample name, labels other than the constant ones): value} of one /metrics page."""
    with urllib.request.urlopen(url, timeout=10) as response:
        assert response.headers["Content-Type"].startswith("text/plain")
        text = response.read().decode()
    samples = {}
    for family in text_string_to_metric_families(text):
        for sample in family.samples:
            labels = {k: v for k, v in sample.labels.items() if k not in ("role", "model_name", "rank")}
            samples[(sample.name, frozenset(labels.items()))] = sample.value
    return samples


def value(samples, name: str, **labels) -> float:
    return samples.get((P + name, frozenset(labels.items())), 0.0)


def kv_bytes(prompt_len: int, model: ModelConfig) -> int:
    """What one transfer moves: every prompt page of every layer (fp32 on CPU)."""
    pages = -(-prompt_len // PAGE_SIZE)
    return pages * model.num_hidden_layers * PAGE_SIZE * model.kv_cache_dim * 4


def test_metrics_after_pd_traffic_equal_what_was_sent(tmp_path):
    rng = random.Random()
    model = ModelConfig.from_hf(resolve_model_dir("tiny"))
    shared = [rng.randrange(2, model.vocab_size) for _ in range(rng.randrange(24, 40))]  # prefix-cache hits
    prompts = []
    for _ in range(rng.randrange(8, 13)):
        tail = [rng.randrange(2, model.vocab_size) for _ in range(rng.randrange(1, 60))]
        prompts.append((shared if rng.random() < 0.4 else []) + tail)
    max_new = [rng.randrange(1, 9) for _ in prompts]
    routed = [[rng.randrange(2, model.vocab_size) for _ in range(rng.randrange(1, 50))]
              for _ in range(rng.randrange(2, 5))]
    routed_new = [rng.randrange(1, 9) for _ in routed]
    colocated_prompt = [rng.randrange(2, model.vocab_size) for _ in range(rng.randrange(5, 40))]
    spec = cluster_spec(tmp_path, extra_worker_args=("--engine-opt=claim_timeout_s=2",))

    with LocalCluster(spec) as cluster:
        host = spec.host
        prefill, decode = cluster.prefill_workers()[0], cluster.decode_workers()[0]
        before = scrape(decode.metrics_url(host))
        assert value(before, "kv_pool_total_pages") == NUM_PAGES and value(before, "num_requests_total",
                                                                           finish_reason="length") == 0

        async def traffic():
            async with PDClient(prefill.address(host), host, prefill.bootstrap_port, decode.address(host)) as pd:
                gate = asyncio.Semaphore(4)

                async def one(i):
                    async with gate:
                        return await pd.generate(prompts[i], sampling_proto(max_new[i], ignore_eos=True),
                                                 stream=bool(i % 2))
                results = await asyncio.gather(*(one(i) for i in range(len(prompts))))
                async with RouterClient(cluster.router_url, model=cluster.served_model_name) as router:
                    via_router = [await router.generate(input_ids=p, max_new_tokens=m, ignore_eos=True,
                                                        temperature=0.0, stream=bool(m % 2))
                                  for p, m in zip(routed, routed_new)]
                # A transfer that must fail: decode is sent a room the prefill worker never gets.
                orphan = pd.build_request([5, 6, 7, 8, 9], sampling_proto(4, ignore_eos=True))
                with pytest.raises(grpc.aio.AioRpcError) as failed:
                    await collect(pd.decode.generate(orphan, 30))
                assert failed.value.code() == grpc.StatusCode.DEADLINE_EXCEEDED
                colocated = pd.build_request(colocated_prompt, sampling_proto(3, ignore_eos=True))
                colocated.ClearField("disaggregated_params")
                colocated_ids, _ = await collect(pd.decode.generate(colocated, 60))
            for address in (prefill.address(host), decode.address(host)):
                assert await wait_for_pages(address, 0, 10) == 0
            return results, [r.output_ids for r in via_router], colocated_ids

        results, routed_ids, colocated_ids = asyncio.run(traffic())
        assert all(r.ok for r in results), [(r.prefill_error, r.decode_error) for r in results]
        assert [len(r.output_ids) for r in results] == max_new and len(colocated_ids) == 3
        d = scrape(decode.metrics_url(host))
        p = scrape(prefill.metrics_url(host))
        r = scrape(f"http://{host}:{cluster.metrics_port}/metrics")  # the router's own exporter (smg)
        decode_url = f"grpc://{decode.address(host)}"

    assert [len(ids) for ids in routed_ids] == routed_new
    k = len(routed)
    generate_route = frozenset({"method": "POST", "path": "/generate"}.items())
    assert r[("smg_http_request_duration_seconds_count", generate_route)] == k
    assert r[("smg_worker_requests_total", frozenset({"worker": decode_url, "model": "tiny"}.items()))] == k
    # From here on every PD request counts, whichever way it came.
    prompts, n = prompts + routed, len(prompts) + k
    max_new = max_new + routed_new
    sent_prompt_tokens = sum(map(len, prompts))
    received = sum(len(r.output_ids) for r in results) + sum(map(len, routed_ids))
    transferred = sum(kv_bytes(len(prompt), model) for prompt in prompts)

    # decode: the user-visible stream (PD requests + the colocated one), one failed transfer
    assert value(d, "num_requests_total", finish_reason="length") == n + 1
    assert value(d, "prompt_tokens_total") == sent_prompt_tokens + len(colocated_prompt)
    assert value(d, "generation_tokens_total") == received + len(colocated_ids)
    assert value(d, "time_to_first_token_seconds_count") == n + 1
    assert value(d, "e2e_request_latency_seconds_count") == n + 1
    assert value(d, "time_per_output_token_seconds_count") == sum(m > 1 for m in max_new) + 1
    assert value(d, "e2e_request_latency_seconds_sum") >= value(d, "time_to_first_token_seconds_sum") > 0
    assert value(d, "kv_transfer_bytes_total", transport="grpc") == transferred
    assert value(d, "kv_transfer_seconds_count", transport="grpc") == n
    assert value(d, "kv_transfer_failures_total", transport="grpc", code="deadline_exceeded") == 1
    assert value(d, "num_failed_requests_total", code="deadline_exceeded") == 1
    # Steps count whole batches: every decode row yields one token (the first came from prefill);
    # the colocated prompt is prefilled by the decode worker's own extend steps.
    assert value(d, "step_tokens_total", mode="decode") == received - n + len(colocated_ids) - 1
    assert value(d, "step_requests_total", mode="decode") == value(d, "step_tokens_total", mode="decode")
    assert value(d, "step_tokens_total", mode="prefill") == len(colocated_prompt)
    assert value(d, "decode_steps_total", path="eager") == value(d, "step_seconds_count", mode="decode") > 0
    assert value(d, "decode_steps_total", path="cuda_graph") == 0  # CPU: no graphs
    # Every streamed token after a request's first has one inter-token gap; the failed transfer streamed none.
    streamed = [len(r.output_ids) for r in results] + [len(ids) for ids in routed_ids] + [len(colocated_ids)]
    assert value(d, "inter_token_latency_seconds_count") == sum(t - 1 for t in streamed)
    assert 0 < value(d, "inter_token_latency_seconds_sum") < value(d, "e2e_request_latency_seconds_sum")
    # prefill: one token per request, every prompt token either computed or served from the cache
    assert value(p, "num_requests_total", finish_reason="length") == n
    assert value(p, "prompt_tokens_total") == sent_prompt_tokens
    assert value(p, "generation_tokens_total") == n
    assert value(p, "time_to_first_token_seconds_count") == n
    assert value(p, "time_per_output_token_seconds_count") == 0
    assert value(p, "kv_transfer_bytes_total", transport="grpc") == transferred
    assert value(p, "kv_transfer_seconds_count", transport="grpc") == n
    assert value(p, "prefix_cache_queries_total") == sent_prompt_tokens
    assert value(p, "prefix_cache_hits_total") == value(p, "cached_tokens_total")
    assert value(p, "step_tokens_total", mode="prefill") == sent_prompt_tokens - value(p, "prefix_cache_hits_total")
    assert value(p, "num_failed_requests_total", code="deadline_exceeded") == 0  # the orphan never reached it
    assert value(p, "inter_token_latency_seconds_count") == 0  # one token per request
    # ... but its handshake did: a room no prefill request claimed within claim_timeout_s, and nothing else.
    assert value(p, "bootstrap_handshake_failures_total", reason="timeout") == 1
    assert sum(v for (name, _), v in p.items() if name == P + "bootstrap_handshake_failures_total") == 1
    # after completion: nothing held, nothing running or queued
    for samples in (d, p):
        assert value(samples, "kv_pool_used_pages") == 0
        assert value(samples, "num_running_reqs") == 0 and value(samples, "num_queue_reqs") == 0
        assert value(samples, "kv_pool_total_pages") == NUM_PAGES
        # The startup heap (model, libraries) was frozen before serving, and serving's own
        # allocations were collected (and timed) meanwhile.
        assert value(samples, "gc_frozen_objects") > 10_000
        assert sum(value(samples, "gc_pause_seconds_count", generation=str(g)) for g in range(3)) > 0

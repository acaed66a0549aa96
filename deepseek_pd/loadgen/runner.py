"""Sends a workload: open loop (Poisson arrivals at --request-rate) or closed loop (at most
--max-concurrency in flight), or both. Every request streams, so TTFT and ITL are measured.

A target is anything that turns one `BenchRequest` into a timed `GenerateResult`: the router over
HTTP (`router_target`), or prefill/decode pairs over gRPC with no router (`pd_direct_target`),
which shows what the router itself adds.
"""
from __future__ import annotations

import asyncio
import itertools
import random
import time
from typing import Awaitable, Callable, Sequence

from tqdm import tqdm

from deepseek_pd.client.pd_dispatch import PDClient
from deepseek_pd.client.router_http import GenerateResult, RouterClient
from deepseek_pd.client.scheduler_grpc import sampling_proto
from deepseek_pd.loadgen.metrics import RequestRecord
from deepseek_pd.loadgen.workload import BenchRequest

Target = Callable[[BenchRequest], Awaitable[GenerateResult]]


def router_target(client: RouterClient) -> Target:
    async def send(request: BenchRequest) -> GenerateResult:
        return await client.generate(input_ids=request.input_ids, stream=True,
                                     max_new_tokens=request.output_len, temperature=0.0,
                                     ignore_eos=True)
    return send


def pd_direct_target(pairs: Sequence[PDClient]) -> Target:
    """Round-robin over (prefill, decode) pairs, as a router with round_robin policy would."""
    cycle = itertools.cycle(pairs)

    async def send(request: BenchRequest) -> GenerateResult:
        sampling = sampling_proto(max_new_tokens=request.output_len, ignore_eos=True)
        return await next(cycle).generate_timed(list(request.input_ids), sampling)
    return send


async def _one(send: Target, request: BenchRequest, t0: float) -> RequestRecord:
    record = RequestRecord(prompt_len=len(request.input_ids), expected_output_len=request.output_len,
                           start_offset=time.perf_counter() - t0)
    try:
        result = await send(request)
    except Exception as exc:  # HTTP, gRPC and payload errors alike: count it, keep the run going
        record.error = f"{type(exc).__name__}: {exc}"[:300]
        return record
    record.success = True
    record.output_len = len(result.output_ids)
    record.ttft = result.ttft
    record.latency = result.latency
    times = result.chunk_times
    record.itls = [b - a for a, b in zip(times, times[1:])]
    return record


async def run_load(send: Target, requests: list[BenchRequest], request_rate: float,
                   max_concurrency: int | None, seed: int = 0,
                   show_progress: bool = True) -> tuple[list[RequestRecord], float]:
    """Returns the records (in request order) and the wall time of the whole run."""
    rng = random.Random(seed)
    limit = asyncio.Semaphore(max_concurrency) if max_concurrency else None
    bar = tqdm(total=len(requests), desc="requests", unit="req", disable=not show_progress)

    async def guarded(request: BenchRequest, t0: float) -> RequestRecord:
        if limit is None:
            record = await _one(send, request, t0)
        else:
            async with limit:
                record = await _one(send, request, t0)
        bar.update(1)
        return record

    t0 = time.perf_counter()
    tasks = []
    for request in requests:
        tasks.append(asyncio.create_task(guarded(request, t0)))
        if request_rate != float("inf"):
            await asyncio.sleep(rng.expovariate(request_rate))
    records = await asyncio.gather(*tasks)
    duration = time.perf_counter() - t0
    bar.close()
    return list(records), duration

"""Sends a workload to the router: open loop (Poisson arrivals at --request-rate) or closed loop
(at most --max-concurrency in flight), or both; every request streams so TTFT/ITL are measured."""
from __future__ import annotations

import asyncio
import random
import time

from tqdm import tqdm

from deepseek_pd.client.router_http import RouterClient, RouterError
from deepseek_pd.loadgen.metrics import RequestRecord
from deepseek_pd.loadgen.workload import BenchRequest


async def _one(client: RouterClient, request: BenchRequest, t0: float) -> RequestRecord:
    record = RequestRecord(prompt_len=len(request.input_ids), expected_output_len=request.output_len,
                           start_offset=time.perf_counter() - t0)
    try:
        result = await client.generate(input_ids=request.input_ids, stream=True,
                                       max_new_tokens=request.output_len, temperature=0.0,
                                       ignore_eos=True)
    except (RouterError, OSError, asyncio.TimeoutError) as exc:
        record.error = f"{type(exc).__name__}: {exc}"[:300]
        return record
    except Exception as exc:  # aiohttp payload errors and the like: count, do not crash the run
        record.error = f"{type(exc).__name__}: {exc}"[:300]
        return record
    record.success = True
    record.output_len = len(result.output_ids)
    record.ttft = result.ttft
    record.latency = result.latency
    times = result.chunk_times
    record.itls = [b - a for a, b in zip(times, times[1:])]
    return record


async def run_load(client: RouterClient, requests: list[BenchRequest], request_rate: float,
                   max_concurrency: int | None, seed: int = 0,
                   show_progress: bool = True) -> tuple[list[RequestRecord], float]:
    """Returns the records (in request order) and the wall time of the whole run."""
    rng = random.Random(seed)
    limit = asyncio.Semaphore(max_concurrency) if max_concurrency else None
    bar = tqdm(total=len(requests), desc="requests", unit="req", disable=not show_progress)

    async def guarded(request: BenchRequest, t0: float) -> RequestRecord:
        if limit is None:
            record = await _one(client, request, t0)
        else:
            async with limit:
                record = await _one(client, request, t0)
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

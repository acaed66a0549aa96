"""What a served worker reports about its KV pool equals the pool it built.

The real path of `deepseek-pd serve`: flags -> `resolve_serve_config` -> the role's default builder
(tiny model, CPU) -> `serve_worker` -> GetServerInfo / GetLoads over gRPC. The page size and the
token capacity the router reads must be the engine's own `pool.page_size` and
`pool.num_pages * pool.page_size` (the identity is resolved with the runner config, not read back
from the engine).
"""
from __future__ import annotations

import asyncio
import os
import random
import signal

import pytest

from deepseek_pd.client.scheduler_grpc import SchedulerClient
from deepseek_pd.ports import pick_free_ports
from deepseek_pd.workers.serve.builders import BUILDERS
from deepseek_pd.workers.serve.worker_main import serve_worker
from deepseek_pd.workers.serve.resolution import ServeFlags, resolve_serve_config

pytestmark = [pytest.mark.timeout(120)]


@pytest.mark.parametrize("role", ["prefill", "decode"])
def test_reported_page_size_and_capacity_are_the_pools(role: str) -> None:
    rng = random.Random()
    port, bootstrap_port = pick_free_ports(2)
    flags = ServeFlags(role=role, model="tiny", port=port, bootstrap_port=bootstrap_port, device="cpu",
                       page_size=rng.choice([1, 2, 3, 4, 8, 32]),  # never the default, 16
                       num_pages=rng.randint(8, 400), drain_timeout_s=0.5)
    config = resolve_serve_config(flags)
    built = []

    def builder(cfg, metrics):
        built.append(BUILDERS[cfg.role](cfg, metrics))
        return built[-1]

    async def main():
        serving = asyncio.create_task(serve_worker(config, builder))
        try:
            async with SchedulerClient(f"127.0.0.1:{port}") as client:
                for _ in range(600):
                    if serving.done():
                        serving.result()  # a start-up error surfaces here
                    try:
                        if (await client.health(timeout_s=1.0)).healthy:
                            break
                    except Exception:  # not listening yet
                        pass
                    await asyncio.sleep(0.1)
                info, load = await client.server_info(), await client.loads()
        finally:
            os.kill(os.getpid(), signal.SIGTERM)  # serve_worker's own handler: drain and stop
            await asyncio.wait_for(serving, 30)
        return info, load

    info, load = asyncio.run(main())
    pool = built[0].pool
    assert pool.page_size == flags.page_size and pool.num_pages == flags.num_pages
    assert info.server_args["page_size"] == pool.page_size
    assert info.server_args["disaggregation_mode"] == role
    assert info.max_total_num_tokens == pool.num_pages * pool.page_size
    assert load.max_total_num_tokens == pool.num_pages * pool.page_size
    assert load.num_used_tokens == pool.num_used_pages * pool.page_size

"""GetServerInfo reports the KV pool's bytes per token, in the dtype the worker runs (a `--dtype`
that differs from the checkpoint's included), under `kv_bytes_per_token` in both scheduler_info
and server_args, where `bench serving` looks (deepseek_pd/loadgen/target_model.py).

The oracle is the worker's own `ModelRunner` KV pool, built from the same resolved `ServeConfig`
by the role's builder; the checkpoint is a fresh, non-tiny random one in float32, so a worker
that echoed config.json would report twice the bf16 figure."""
from __future__ import annotations

import asyncio
import json
import random
from pathlib import Path

import pytest
from google.protobuf.json_format import MessageToDict

from deepseek_pd.client.scheduler_grpc import SchedulerClient
from deepseek_pd.ports import pick_free_ports
from deepseek_pd.workers.serve.builders import BUILDERS
from deepseek_pd.workers.api.server import ServerConfig, WorkerServer
from deepseek_pd.workers.serve.resolution import ServeFlags, resolve_serve_config
from pdtest.bench_scripts import bench_module

pytestmark = pytest.mark.timeout(180)


def random_checkpoint(tmp_path: Path, rng: random.Random) -> tuple[Path, dict]:
    module = bench_module("random_checkpoint")
    config = {**module.V2_MINI, "vocab_size": rng.randint(120, 400), "num_hidden_layers": rng.choice([2, 3]),
              "kv_lora_rank": rng.choice([16, 24, 48]), "qk_rope_head_dim": rng.choice([8, 16]),
              "torch_dtype": "float32"}
    return module.write_random_checkpoint(tmp_path / "model", config, seed=rng.randrange(1 << 30)), config


async def serve_and_ask(config, serve=None):
    """Builds the role's engine (a real runner and pool), serves it, and returns (engine, reply)."""
    engine = BUILDERS[config.role](config)
    await engine.start()
    server = WorkerServer(engine, config.model, config.identity, ServerConfig("127.0.0.1", 0, 1.0, 0.5))
    port = await server.start()
    try:
        async with SchedulerClient(f"127.0.0.1:{port}") as client:
            reply = await client.server_info(timeout_s=10)
        if serve is not None:
            return engine, reply, await serve(f"grpc://127.0.0.1:{port}")
        return engine, reply, None
    finally:
        await server.shutdown()
        await engine.stop()


@pytest.mark.parametrize("role, dtype", [("decode", "bfloat16"), ("prefill", "auto")])
def test_server_info_reports_the_pools_bytes_per_token(tmp_path: Path, role: str, dtype: str) -> None:
    rng = random.Random()
    model_dir, hf = random_checkpoint(tmp_path, rng)
    config = resolve_serve_config(flags_for(role, model_dir, dtype))
    engine, reply, _ = asyncio.run(serve_and_ask(config))
    pool = engine.pool
    assert config.identity.kv_bytes_per_token == pool.bytes_per_token
    width = 2 if dtype == "bfloat16" else 4  # auto on the CPU: float32
    assert pool.bytes_per_token == hf["num_hidden_layers"] * (hf["kv_lora_rank"] + hf["qk_rope_head_dim"]) * width
    for part in (reply.scheduler_info, reply.server_args):
        assert MessageToDict(part)["kv_bytes_per_token"] == pool.bytes_per_token


def flags_for(role: str, model_dir: Path, dtype: str) -> ServeFlags:
    """`serve ROLE --model DIR --device cpu --dtype DTYPE`, with free ports (the prefill worker
    binds its bootstrap port)."""
    port, bootstrap_port = pick_free_ports(2)
    return ServeFlags(role=role, model=str(model_dir), device="cpu", dtype=dtype, page_size=4, num_pages=64,
                      port=port, bootstrap_port=bootstrap_port)


def test_bench_discovery_believes_the_worker_not_the_config(tmp_path: Path) -> None:
    """`bench serving --url` discovery (router /v1/models + /workers, then the workers'
    GetServerInfo) in front of a real decode worker serving a float32 checkpoint in bfloat16."""
    from aiohttp import web

    from deepseek_pd.loadgen.target_model import discover_target_model, kv_bytes_per_token_from_config

    rng = random.Random()
    model_dir, hf = random_checkpoint(tmp_path, rng)
    config = resolve_serve_config(flags_for("decode", model_dir, "bfloat16"))

    async def discover(grpc_url: str):
        name = config.model.served_model_name
        meta = {"served_model_name": name, "vocab_size": str(hf["vocab_size"]),
                "max_context_length": str(config.model.max_context_length), "model_path": str(model_dir)}
        routes = {"/v1/models": json.dumps({"object": "list", "data": [{"id": name}]}),
                  "/workers": json.dumps({"workers": [{"url": grpc_url, "model_id": name, "worker_type": "decode",
                                                       "labels": meta}]})}

        async def handle(request: web.Request) -> web.Response:
            if request.path not in routes:
                return web.Response(status=404)
            return web.Response(body=routes[request.path].encode(), content_type="application/json")
        app = web.Application()
        app.router.add_get("/{tail:.*}", handle)
        runner = web.AppRunner(app)
        await runner.setup()
        site = web.TCPSite(runner, "127.0.0.1", 0)
        await site.start()
        port = site._server.sockets[0].getsockname()[1]
        try:
            return await discover_target_model(f"http://127.0.0.1:{port}", grpc_timeout_s=5.0)
        finally:
            await runner.cleanup()

    engine, _, target = asyncio.run(serve_and_ask(config, serve=discover))
    from_config, _ = kv_bytes_per_token_from_config(hf)
    assert target.kv_bytes_per_token == engine.pool.bytes_per_token == from_config // 2
    assert "GetServerInfo" in target.kv_bytes_source and target.vocab_size == hf["vocab_size"]

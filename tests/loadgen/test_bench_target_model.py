"""`bench serving --url` learns the served model from the router, not from `--model`.

- Against the real router (`up`'s smg, and a second smg started by the test; sglang-router 0.3.2
  labelled its JSON `text/plain`) in front of real workers serving a freshly drawn, NOT-tiny checkpoint: a
  vocabulary smaller than the tokenizer's (tiny's ids would be rejected by the workers), and a
  random layer count and latent width, so the KV bytes per token differ from tiny's. The run must
  succeed, use that vocabulary and report `layers x (kv_lora_rank + qk_rope_head_dim) x 4` (fp32).
- The router's answers are parsed by content: JSON labelled text/plain is JSON, a non-JSON body
  is a clear `UserError`, not a crash.
"""
from __future__ import annotations

import asyncio
import dataclasses
import json
import os
import random
import subprocess
import sys
import time
from pathlib import Path

import pytest

from deepseek_pd.errors import UserError
from pdtest.bench_scripts import bench_module


pytestmark = pytest.mark.timeout(300)


def random_non_tiny_config(rng: random.Random) -> dict:
    V2_MINI = bench_module("random_checkpoint").V2_MINI

    return {**V2_MINI, "vocab_size": rng.randint(120, 400), "num_hidden_layers": rng.choice([2, 3, 5]),
            "kv_lora_rank": rng.choice([16, 24, 48]), "qk_rope_head_dim": rng.choice([8, 16]),
            "torch_dtype": "float32"}


def start_smg(cluster, log_path: Path) -> tuple[subprocess.Popen, str]:
    """PyPI smg (the router's successor) in front of the same workers, on free ports."""
    from deepseek_pd.launcher.health import router_ready_workers
    from deepseek_pd.ports import pick_free_ports

    host = cluster.spec.host
    port, metrics_port = pick_free_ports(2, host)
    argv = [sys.executable, "-m", "smg.launch_router", "--pd-disaggregation"]
    for w in cluster.prefill_workers():
        argv += ["--prefill", f"grpc://{w.address(host)}", str(w.bootstrap_port)]
    for w in cluster.decode_workers():
        argv += ["--decode", f"grpc://{w.address(host)}"]
    argv += ["--host", host, "--port", str(port), "--model-path", str(cluster.model_dir),
             "--prometheus-host", host, "--prometheus-port", str(metrics_port), "--disable-retries",
             "--disable-circuit-breaker",
             # nothing in flight when the test stops it: no 5 s load-balancer settle (pdtest.e2e_cluster)
             "--shutdown-grace-period-secs", "1"]
    proc = subprocess.Popen(argv, stdout=log_path.open("w"), stderr=subprocess.STDOUT)
    url = f"http://{host}:{port}"
    deadline = time.monotonic() + 60
    while router_ready_workers(url) < len(cluster.workers):
        if proc.poll() is not None or time.monotonic() > deadline:
            proc.kill()
            raise AssertionError(f"smg did not become ready:\n{log_path.read_text()[-3000:]}")
        time.sleep(0.3)
    return proc, url


@pytest.fixture(scope="module")
def served(tmp_path_factory):
    """One cluster for both routers below (they only read from it): workers serving a freshly
    drawn non-tiny checkpoint, and that checkpoint's config."""
    from deepseek_pd.launcher.cluster import LocalCluster
    from pdtest.e2e_cluster import cluster_spec

    write_random_checkpoint = bench_module("random_checkpoint").write_random_checkpoint
    tmp = tmp_path_factory.mktemp("target-model")
    rng = random.Random()
    config = random_non_tiny_config(rng)
    model_dir = write_random_checkpoint(tmp / "model", config, seed=rng.randrange(1 << 30))
    with LocalCluster(dataclasses.replace(cluster_spec(tmp), model=str(model_dir))) as cluster:
        yield cluster, config, model_dir


@pytest.mark.slow
@pytest.mark.parametrize("router", ["up", "smg"])  # up's own router, a second smg started here
def test_bench_url_uses_the_served_models_vocabulary_and_kv_size(tmp_path: Path, router: str, served) -> None:
    if router == "smg":
        pytest.importorskip("smg")
    cluster, config, model_dir = served
    rng = random.Random()
    expected_kv = config["num_hidden_layers"] * (config["kv_lora_rank"] + config["qk_rope_head_dim"]) * 4
    out_json = tmp_path / "bench.json"
    smg = None
    url = cluster.router_url
    if router == "smg":
        smg, url = start_smg(cluster, tmp_path / "smg.log")
    try:
        num_prompts, input_len, output_len = 6, 40, 4
        argv = [sys.executable, "-m", "deepseek_pd.cli", "bench", "serving", "--url", url,
                "--num-prompts", str(num_prompts), "--dataset", "fixed", "--input-len", str(input_len),
                "--output-len", str(output_len), "--max-concurrency", "3", "--no-progress",
                "--output-json", str(out_json), "--output-png", str(tmp_path / "bench.png"),
                "--seed", str(rng.randrange(1000))]
        if router == "up":  # up locks its gateway's control plane (/workers) with this key
            argv += ["--admin-key-file", str(cluster.log_dir / "control-plane-key")]
        proc = subprocess.run(argv, capture_output=True, text=True, timeout=180)
    finally:
        if smg is not None:
            smg.terminate()
            smg.wait(timeout=10)
    assert proc.returncode == 0, proc.stdout + proc.stderr
    result = json.loads(out_json.read_text())
    summary, target = result["summary"], result["config"]["target_model"]
    # Every prompt token was below the served vocabulary, or the workers would have refused it.
    assert summary["completed"] == num_prompts and summary["failed"] == 0, summary["errors"]
    assert target["vocab_size"] == config["vocab_size"]
    assert target["max_context_length"] == config["max_position_embeddings"]
    assert target["name"] == model_dir.name == result["config"]["model"]
    assert summary["kv_bytes_per_token"] == expected_kv
    assert f"KV bytes per token: {expected_kv}" in proc.stdout
    # The workers' own figures, read with the control plane: each one's KV capacity (GetLoads).
    from pdtest.e2e_cluster import PAGE_SIZE, WORKER_ARGS
    pages = int(next(arg for arg in WORKER_ARGS if arg.startswith("--num-pages=")).split("=")[1])
    assert sorted(w["kind"] for w in summary["workers"]) == ["decode", "prefill"], summary["workers"]
    assert all(w["kv_capacity_tokens"] == pages * PAGE_SIZE for w in summary["workers"]), summary["workers"]
    assert summary["left_out"] is None


# -- the router's answers, parsed by content ------------------------------------------------
async def _serve(routes: dict[str, tuple[str, str]]):
    """A throwaway HTTP server: path -> (content type, body); anything else 404."""
    from aiohttp import web

    async def handle(request: web.Request) -> web.Response:
        if request.path not in routes:
            return web.Response(status=404)
        content_type, body = routes[request.path]
        return web.Response(body=body.encode(), headers={"Content-Type": content_type})

    app = web.Application()
    app.router.add_route("GET", "/{tail:.*}", handle)
    runner = web.AppRunner(app)
    await runner.setup()
    site = web.TCPSite(runner, "127.0.0.1", 0)
    await site.start()
    port = site._server.sockets[0].getsockname()[1]
    return runner, f"http://127.0.0.1:{port}"


def _workers_body(rng: random.Random, name: str, vocab: int, context: int, model_path: str,
                  flavour: str) -> str:
    """/workers as each router writes it (seen from 0.3.2 and smg 1.13 in front of our workers)."""
    meta = {"served_model_name": name, "vocab_size": str(vocab), "max_context_length": str(context),
            "model_path": model_path, "architectures": json.dumps(["DeepseekV2ForCausalLM"])}
    workers = []
    for kind in ("prefill", "decode"):
        port = rng.randrange(20000, 60000)
        worker = {"url": f"grpc://127.0.0.1:{port}", "model_id": name, "worker_type": kind,
                  "is_healthy": True}
        if flavour == "0.3.2":
            worker["metadata"] = meta
        else:
            worker["labels"] = {**meta, "page_size": "16"}
            worker["models"] = [{"id": name, "context_length": context}]
        workers.append(worker)
    return json.dumps({"workers": workers, "total": len(workers)})


@pytest.mark.parametrize("flavour", ["0.3.2", "smg"])
def test_discovery_parses_json_by_content_not_label(tmp_path: Path, flavour: str) -> None:
    write_random_checkpoint = bench_module("random_checkpoint").write_random_checkpoint

    from deepseek_pd.loadgen.target_model import discover_target_model

    rng = random.Random()
    config = random_non_tiny_config(rng)
    model_dir = write_random_checkpoint(tmp_path / f"m{rng.randrange(10**6)}", config)
    name = f"model-{rng.randrange(10**6)}"
    context = rng.randint(500, 5000)
    label = "text/plain; charset=utf-8" if flavour == "0.3.2" else "application/json"
    models = json.dumps({"object": "list", "data": [{"id": name, "object": "model"}]})
    routes = {"/v1/models": (label, models),
              "/workers": ("application/json",
                           _workers_body(rng, name, config["vocab_size"], context, str(model_dir), flavour))}

    async def go():
        runner, url = await _serve(routes)
        try:
            return await discover_target_model(url, grpc_timeout_s=0.5)
        finally:
            await runner.cleanup()

    target = asyncio.run(go())
    assert (target.name, target.vocab_size, target.max_context_length) == (name, config["vocab_size"], context)
    assert target.kv_bytes_per_token == (
        config["num_hidden_layers"] * (config["kv_lora_rank"] + config["qk_rope_head_dim"]) * 4)


@pytest.mark.parametrize("body", ["<html>502 Bad Gateway</html>", "", "{\"object\": \"list\", \"data\": []}"])
def test_non_json_or_empty_model_list_is_a_clear_error(body: str) -> None:
    from deepseek_pd.loadgen.target_model import discover_target_model

    async def go():
        runner, url = await _serve({"/v1/models": ("text/plain", body)})
        try:
            with pytest.raises(UserError, match="/v1/models") as exc:
                await discover_target_model(url)
            return exc.value
        finally:
            await runner.cleanup()

    error = asyncio.run(go())
    assert "Traceback" not in str(error)


def test_a_router_without_workers_listing_needs_model(tmp_path: Path) -> None:
    """No /workers (another gateway): the error says to pass --model; with --model it works."""
    write_random_checkpoint = bench_module("random_checkpoint").write_random_checkpoint

    from deepseek_pd.loadgen.target_model import discover_target_model

    rng = random.Random()
    config = random_non_tiny_config(rng)
    model_dir = write_random_checkpoint(tmp_path / "m", config)
    models = json.dumps({"object": "list", "data": [{"id": "served", "object": "model"}]})

    async def go():
        runner, url = await _serve({"/v1/models": ("application/json", models)})
        try:
            with pytest.raises(UserError, match="--model"):
                await discover_target_model(url)
            return await discover_target_model(url, model_override=str(model_dir))
        finally:
            await runner.cleanup()

    target = asyncio.run(go())
    assert target.name == "served" and target.vocab_size == config["vocab_size"]
    assert os.path.samefile(target.model_path, model_dir)


def test_a_worker_reported_kv_size_wins_over_the_config(tmp_path: Path) -> None:
    """A worker that reports `kv_bytes_per_token` in GetServerInfo (its runtime dtype may differ
    from config.json's) is believed; the router's /workers names it by its grpc:// URL."""
    import grpc
    from google.protobuf.struct_pb2 import Struct
    write_random_checkpoint = bench_module("random_checkpoint").write_random_checkpoint
    from smg_grpc_proto import sglang_scheduler_pb2 as pb
    from smg_grpc_proto import sglang_scheduler_pb2_grpc as pb_grpc

    from deepseek_pd.loadgen.target_model import discover_target_model

    rng = random.Random()
    config = random_non_tiny_config(rng)
    model_dir = write_random_checkpoint(tmp_path / "m", config)
    reported = rng.randrange(1000, 10**6)

    class Reporting(pb_grpc.SglangSchedulerServicer):
        async def GetServerInfo(self, request, context):
            info = Struct()
            info.update({"kv_bytes_per_token": reported})
            return pb.GetServerInfoResponse(scheduler_info=info)

    async def go():
        server = grpc.aio.server()
        pb_grpc.add_SglangSchedulerServicer_to_server(Reporting(), server)
        port = server.add_insecure_port("127.0.0.1:0")
        await server.start()
        body = json.loads(_workers_body(rng, "served", config["vocab_size"], 4096, str(model_dir), "0.3.2"))
        body["workers"][1]["url"] = f"grpc://127.0.0.1:{port}"
        models = json.dumps({"object": "list", "data": [{"id": "served"}]})
        runner, url = await _serve({"/v1/models": ("text/plain", models),
                                    "/workers": ("application/json", json.dumps(body))})
        try:
            return await discover_target_model(url, grpc_timeout_s=2.0)
        finally:
            await runner.cleanup()
            await server.stop(None)

    target = asyncio.run(go())
    assert target.kv_bytes_per_token == reported and "GetServerInfo" in target.kv_bytes_source

"""The router command line the operator renders (Static discovery), run for real against our gRPC
workers: sgl-model-gateway 0.3.2 must register both workers through the `grpc://<hostname>:<port>`
URLs once they come up after it (a cluster starts a new deployment's pods together), within its
startup check interval, report ready, and route a request whose answer only the decode worker can produce. Then the
decode group is restarted in place (same name, as a gang restart or rolling upgrade does): the
router, unchanged, must notice, and serve again once the leader is back.

Only what a cluster provides is swapped: each leader's DNS name becomes `localhost` (a name, so
the gateway still resolves it), the listen address becomes 127.0.0.1 and the checkpoint path a
local tokenizer directory. The workers are our real gRPC servers around the deterministic fake
engine of the worker tests (its output is a pure function of the prompt).
"""
from __future__ import annotations

import asyncio
import contextlib
import pathlib
import random
import subprocess
import sys
import urllib.error
import urllib.parse

import aiohttp
import pytest
import yaml

from deepseek_pd.ports import pick_free_ports
from deepseek_pd.operator.build_router import WORKER_STARTUP_CHECK_SECONDS, build_router_args
from deepseek_pd.operator.spec import DeploymentSpec

from pdtest.servicer_fakes import PAGE_SIZE, FakeEngine, expected_tokens, make_tokenizer_model_dir

ROOT = pathlib.Path(__file__).resolve().parents[2]

pytestmark = pytest.mark.timeout(120)
READY_TIMEOUT_S = 60.0


def _spec(ports: dict[str, int], bootstrap_port: int) -> DeploymentSpec:
    raw = yaml.safe_load((ROOT / "examples" / "cpu-minimal.yaml").read_text())["spec"]
    raw["router"] = {"workerDiscovery": "Static"}
    raw["prefill"].update(port=ports["prefill"], bootstrapPort=bootstrap_port)
    raw["decode"].update(port=ports["decode"])  # Static allows a port per role
    return DeploymentSpec.parse("reach", "llm", raw)


def _localise(args: list[str], model_dir: pathlib.Path, router_port: int) -> list[str]:
    """Cluster DNS names -> localhost; listen on loopback; the local tokenizer directory."""
    out = list(args)
    for i, arg in enumerate(out):
        if arg.startswith("grpc://"):
            url = urllib.parse.urlsplit(arg)
            assert url.hostname.endswith(".llm.svc"), arg
            out[i] = f"grpc://localhost:{url.port}"
    for flag, value in (("--host", "127.0.0.1"), ("--port", str(router_port)),
                        ("--model-path", str(model_dir))):
        out[out.index(flag) + 1] = value
    # Health checks every second instead of every minute, and one result is enough, so the
    # restart is noticed quickly. A 1 s shutdown grace: smg's load-balancer settle after SIGTERM
    # is min(5 s, half the grace), idle here (nothing in flight, nothing in front).
    return out + ["--prometheus-host", "127.0.0.1", "--prometheus-port", str(pick_free_ports(1)[0]),
                  "--health-check-interval-secs", "1", "--health-failure-threshold", "1",
                  "--health-success-threshold", "1", "--shutdown-grace-period-secs", "1"]


async def _wait_readiness(session: aiohttp.ClientSession, url: str, router: subprocess.Popen,
                          status: int) -> None:
    loop = asyncio.get_running_loop()
    deadline = loop.time() + READY_TIMEOUT_S
    while loop.time() < deadline:
        assert router.poll() is None, f"router exited with {router.returncode}"
        with contextlib.suppress(aiohttp.ClientError):
            async with session.get(f"{url}/readiness") as reply:
                if reply.status == status:
                    return
        await asyncio.sleep(0.2)
    pytest.fail(f"router /readiness not {status} within {READY_TIMEOUT_S:.0f}s")


async def _generate(session: aiohttp.ClientSession, url: str, rng: random.Random) -> list[int]:
    prompt = [rng.randrange(3, 250) for _ in range(rng.randint(3, 12))]
    budget = rng.randint(2, 6)
    body = {"model": "tiny", "input_ids": prompt, "stream": False,
            "sampling_params": {"max_new_tokens": budget, "temperature": 0.0}}
    async with session.post(f"{url}/generate", json=body) as reply:
        assert reply.status == 200, await reply.text()
        payload = await reply.json()
    item = payload[0] if isinstance(payload, list) else payload
    assert item["output_ids"] == expected_tokens(tuple(prompt), budget)
    return prompt


def test_rendered_static_router_reaches_our_grpc_workers_and_survives_a_restart(tmp_path):
    from deepseek_pd.workers.api.served_model import ServedModelInfo
    from deepseek_pd.workers.api.server import ServerConfig, WorkerServer
    from deepseek_pd.workers.api.servicer import WorkerIdentity

    rng = random.Random()
    model_dir = make_tokenizer_model_dir(tmp_path / "model")
    info = ServedModelInfo.from_model_dir(model_dir, "tiny")
    bootstrap_port = pick_free_ports(1)[0]
    log_path = tmp_path / "router.log"

    async def start(role: str, port: int = 0) -> tuple[WorkerServer, FakeEngine, int]:
        engine = FakeEngine(scripted=False)  # random prompts may start with a script token (6..8)
        identity = WorkerIdentity(role, "grpc", bootstrap_port if role == "prefill" else 0, PAGE_SIZE)
        server = WorkerServer(engine, info, identity,
                              ServerConfig("127.0.0.1", port, drain_timeout_s=1.0, stop_grace_s=0.5))
        return server, engine, await server.start()

    async def main() -> None:
        # The router starts first, as in a cluster where a new deployment's pods start together:
        # it must register the workers within its startup check interval of their coming up.
        ports = dict(zip(("prefill", "decode"), pick_free_ports(2)))
        router_port = pick_free_ports(1)[0]
        argv = _localise(build_router_args(_spec(ports, bootstrap_port)), model_dir, router_port)
        url = f"http://127.0.0.1:{router_port}"
        with open(log_path, "wb") as log:
            router = subprocess.Popen([sys.executable, *argv], stdout=log, stderr=subprocess.STDOUT)
        workers: dict = {}
        try:
            async with aiohttp.ClientSession(timeout=aiohttp.ClientTimeout(total=30)) as session:
                await _wait_readiness(session, f"http://127.0.0.1:{router_port}", router, 503)  # up, no worker yet
                workers.update({role: await start(role, ports[role]) for role in ("prefill", "decode")})
                up = asyncio.get_running_loop().time()
                await _wait_readiness(session, url, router, 200)
                waited = asyncio.get_running_loop().time() - up
                # One missed check and one more, plus start-up slack on a loaded machine (smg's own
                # 30 s interval left the router unready for ~30 s here).
                assert waited < 2 * WORKER_STARTUP_CHECK_SECONDS + 5, f"router ready {waited:.1f} s after its workers"
                prompt = await _generate(session, url, rng)
                # Both legs of the PD pair got the request, each through its own gRPC URL.
                for role in ("prefill", "decode"):
                    assert [list(r.input_ids) for r in workers[role][1].requests] == [prompt]

                await workers["decode"][0].shutdown()  # the decode group restarts in place
                await _wait_readiness(session, url, router, 503)
                workers["decode"] = await start("decode", ports["decode"])
                await _wait_readiness(session, url, router, 200)
                prompt = await _generate(session, url, rng)
                assert [list(r.input_ids) for r in workers["decode"][1].requests] == [prompt]
        finally:
            router.terminate()
            try:
                router.wait(timeout=10)
            except subprocess.TimeoutExpired:
                router.kill()
                router.wait(timeout=10)
            for server, _, _ in workers.values():
                await server.shutdown()

    try:
        asyncio.run(main())
    except BaseException:
        if log_path.exists():  # shown by pytest with the failure
            print(log_path.read_text(errors="replace")[-4000:])
        raise


def test_the_rendered_post_start_hook_guards_the_rendered_router(tmp_path):
    """The router container's postStart hook, run as the kubelet would (the container's env holding
    the control-plane key, `$(VAR)` in the args expanded), loads the n guard into the gateway the
    rendered args start: a huge `n` is then refused at once (without it smg 1.13 swells on it)."""
    import json
    import os
    import time
    import urllib.request

    from deepseek_pd.gateway import new_key
    from deepseek_pd.operator.build_router import build_router_deployment
    from deepseek_pd.operator.router_keys import CONTROL_PLANE_ENV
    from deepseek_pd.workers.api.served_model import ServedModelInfo
    from deepseek_pd.workers.api.server import ServerConfig, WorkerServer
    from deepseek_pd.workers.api.servicer import WorkerIdentity

    rng = random.Random()
    model_dir = make_tokenizer_model_dir(tmp_path / "model")
    info = ServedModelInfo.from_model_dir(model_dir, "tiny")
    bootstrap_port, router_port = pick_free_ports(2)
    key = new_key()

    async def main() -> None:
        servers = {}
        for role in ("prefill", "decode"):
            identity = WorkerIdentity(role, "grpc", bootstrap_port if role == "prefill" else 0, PAGE_SIZE)
            server = WorkerServer(FakeEngine(scripted=False), info, identity,
                                  ServerConfig("127.0.0.1", 0, drain_timeout_s=1.0, stop_grace_s=0.5))
            servers[role] = (server, await server.start())
        spec = _spec({role: port for role, (_, port) in servers.items()}, bootstrap_port)
        argv = [arg.replace(f"$({CONTROL_PLANE_ENV})", key)
                for arg in _localise(build_router_args(spec), model_dir, router_port)]
        (container,) = build_router_deployment(spec)["spec"]["template"]["spec"]["containers"]
        hook = container["lifecycle"]["postStart"]["exec"]["command"]
        assert hook[0] == "python3" and hook[hook.index("--port") + 1] == str(spec.router.port)
        assert any(e["name"] == hook[hook.index("--key-env") + 1] for e in container["env"])
        hook = [sys.executable, *hook[1:]]
        hook[hook.index("--port") + 1] = str(router_port)
        url = f"http://127.0.0.1:{router_port}"
        with open(tmp_path / "router.log", "wb") as log:
            router = subprocess.Popen([sys.executable, *argv], stdout=log, stderr=subprocess.STDOUT)
        try:
            ran = subprocess.run(hook, env={**os.environ, CONTROL_PLANE_ENV: key}, capture_output=True,
                                 text=True, timeout=90)
            assert ran.returncode == 0, ran.stderr
            async with aiohttp.ClientSession(timeout=aiohttp.ClientTimeout(total=30)) as session:
                await _wait_readiness(session, url, router, 200)
                body = json.dumps({"model": "tiny", "input_ids": [5, 6, 7], "sampling_params": {
                    "max_new_tokens": 2, "n": rng.randint(10**5, 10**7)}}).encode()
                started = time.monotonic()
                request = urllib.request.Request(f"{url}/generate", body, {"Content-Type": "application/json"})
                with pytest.raises(urllib.error.HTTPError) as refused:
                    urllib.request.urlopen(request, timeout=10)
                assert refused.value.code == 400 and time.monotonic() - started < 2.0
                await _generate(session, url, rng)
        finally:
            router.kill()
            router.wait(timeout=10)
            for server, _ in servers.values():
                await server.shutdown()

    asyncio.run(main())

"""SLO autoscaling end to end against the emulated API server: the real kopf operator scrapes a
real worker metrics exporter (workers/metrics/server.py, fed the way the servicer feeds
it), scales decode up under slow TPOT and back to the minimum when idle, records each decision
in status.autoscaling, posts an Event per change; bad autoscaling specs become InvalidSpec.
Prefill's decision reads real PD traffic: a prefill worker (the real engine behind our gRPC
servicer, in this process) whose TTFT p90 the operator scrapes adds a group, and idleness
removes it."""
from __future__ import annotations

import asyncio
import random
import re
import threading
import time

import pytest
from test_operator_kopf import (
    _bring_up, _condition, _deployment, _router_rolled_out, _start_pods, _statefulset, _status,
)

from deepseek_pd.ports import pick_free_ports
from deepseek_pd.operator import names
from deepseek_pd.operator.autoscale_metrics import QUANTILE
from deepseek_pd.workers.metrics.worker_metrics import TTFT_BUCKETS, MetricLabels, WorkerMetrics
from deepseek_pd.workers.metrics.server import MetricsConfig, MetricsServer

pytestmark = [pytest.mark.timeout(120)]


class Exporter:
    """A decode worker's metrics exporter on 127.0.0.1 (every test pod's IP), in its own loop."""

    def __init__(self) -> None:
        self.metrics = WorkerMetrics(MetricLabels(role="decode", model_name="tiny"))
        # Not a worker port of the example (the CRD refuses a metrics port on them): 8998, 30000.
        self.port = next(p for p in iter(lambda: pick_free_ports(1)[0], None) if p not in (8998, 30000))
        self._loop = asyncio.new_event_loop()
        self._server = MetricsServer(self.metrics, MetricsConfig("127.0.0.1", self.port))
        self._thread = threading.Thread(target=self._loop.run_forever, daemon=True)

    def __enter__(self) -> "Exporter":
        self._thread.start()
        asyncio.run_coroutine_threadsafe(self._server.start(), self._loop).result(10)
        return self

    def __exit__(self, *exc: object) -> None:
        asyncio.run_coroutine_threadsafe(self._server.stop(), self._loop).result(10)
        self._loop.call_soon_threadsafe(self._loop.stop)
        self._thread.join(10)

    def finish_requests(self, rng: random.Random, tpot_s: float, count: int) -> None:
        """What the servicer reports per finished request: TPOT = (e2e - ttft) / (tokens - 1)."""
        for _ in range(count):
            tokens = rng.randint(8, 64)
            ttft = rng.uniform(0.01, 0.05)
            self.metrics.observe_request("stop", 16, tokens, 0, ttft, ttft + tpot_s * (tokens - 1))


class ServedPD:
    """A real PD pair (pdtest.pd_engine_harness: the tiny model on CPU, KV over grpc), each engine
    behind our gRPC server as `serve` wires a worker (servicer and engine feed one WorkerMetrics),
    the prefill worker's metrics exported on 127.0.0.1 (every emulated pod's IP); in a loop of its
    own, in a thread, as the operator's scrapes come from another."""

    def __init__(self) -> None:
        self.port = next(p for p in iter(lambda: pick_free_ports(1)[0], None) if p not in (8998, 30000))
        self._loop = asyncio.new_event_loop()
        self._thread = threading.Thread(target=self._loop.run_forever, daemon=True)
        self.addresses: dict[str, str] = {}

    def _run(self, coroutine, timeout_s: float = 60.0):
        return asyncio.run_coroutine_threadsafe(coroutine, self._loop).result(timeout_s)

    def __enter__(self) -> "ServedPD":
        self._thread.start()
        self._run(self._start())
        return self

    def __exit__(self, *exc: object) -> None:
        self._run(self._stop())
        self._loop.call_soon_threadsafe(self._loop.stop)
        self._thread.join(10)

    async def _start(self) -> None:
        from deepseek_pd.workers.api.served_model import ServedModelInfo
        from deepseek_pd.workers.api.server import ServerConfig, WorkerServer
        from deepseek_pd.workers.api.servicer import WorkerIdentity
        from pdtest.pd_engine_harness import PAGE_SIZE, PDPair, oracle

        self.pair = await PDPair("grpc").__aenter__()
        info = ServedModelInfo.from_model_dir(oracle().model_path, "tiny")
        self.servers = []
        for role, engine in (("prefill", self.pair.prefill), ("decode", self.pair.decode)):
            identity = WorkerIdentity(role, "grpc", self.pair.prefill.bootstrap_port if role == "prefill" else 0,
                                      PAGE_SIZE)
            server = WorkerServer(engine, info, identity, ServerConfig("127.0.0.1", 0, drain_timeout_s=1.0,
                                                                       stop_grace_s=0.5), engine.metrics)
            self.addresses[role] = f"127.0.0.1:{await server.start()}"
            self.servers.append(server)
        self.pair.prefill.metrics.watch_loads(self.pair.prefill.loads)
        self.exporter = MetricsServer(self.pair.prefill.metrics, MetricsConfig("127.0.0.1", self.port))
        await self.exporter.start()

    async def _stop(self) -> None:
        await self.exporter.stop()
        for server in self.servers:
            await server.shutdown()
        await self.pair.__aexit__(None, None, None)

    def requests(self, rng: random.Random, count: int) -> list[float]:
        """`count` greedy PD requests one after another, dispatched as the router does (both
        workers at once, one bootstrap room); each one's wall seconds, which bound its prefill TTFT."""
        from deepseek_pd.client.pd_dispatch import PDClient
        from deepseek_pd.client.scheduler_grpc import sampling_proto

        async def send() -> list[float]:
            seconds = []
            async with PDClient(self.addresses["prefill"], "127.0.0.1", self.pair.prefill.bootstrap_port,
                                self.addresses["decode"]) as pd:
                for _ in range(count):
                    prompt = [rng.randrange(3, 256) for _ in range(rng.randint(2, 30))]
                    began = time.perf_counter()
                    result = await pd.generate(prompt, sampling_proto(max_new_tokens=rng.randint(1, 4)), timeout_s=30)
                    seconds.append(time.perf_counter() - began)
                    assert result.ok and result.output_ids, result
            return seconds
        return self._run(send())


def _with_ips(cluster, pod_names: list[str]) -> None:
    for pod in pod_names:
        cluster.patch("Pod", pod, {"status": {"podIP": "127.0.0.1"}}, "status")


def _replicas(cluster, name: str, role: str = "decode") -> int:
    return cluster.get(names.KIND, name)["spec"][role].get("replicas", 1)  # the emulator does not default


def _events(cluster, name: str) -> list[dict]:
    return [e for e in cluster._request("GET", f"api/v1/namespaces/{cluster.namespace}/events").get("items", [])
            if e.get("involvedObject", {}).get("name") == name]


def _scaled(cluster, name: str, start: str) -> str | None:
    """The message of the first Scaled Event that begins with `start`, else None."""
    return next((e["message"] for e in _events(cluster, name) if e["reason"] == "Scaled"
                 and e["message"].startswith(start)), None)


def test_slow_tpot_adds_decode_groups_and_idleness_removes_them(cluster):
    rng = random.Random(random.randrange(2**32))
    name = "auto"
    with Exporter() as exporter:
        body = _deployment(name, autoscaling={
            "minReplicas": 1, "maxReplicas": 3, "metrics": [{"name": "tpotP90Seconds", "target": 0.05}],
            "scaleUpStabilizationSeconds": 0, "scaleDownStabilizationSeconds": 2})
        body["spec"]["metrics"] = {"port": exporter.port}
        cluster.create(body)
        _bring_up(cluster, name, {"prefill": 1, "decode": 1})
        for role in ("prefill", "decode"):
            _with_ips(cluster, [names.pod_name(name, role, 0, 0)])
        cluster.wait_for("a first decision", lambda: _status(cluster, name).get("autoscaling", {}).get("decode"))

        exporter.finish_requests(rng, tpot_s=0.2, count=50)  # 4x the target: wants ceil(1 * 4) -> max 3
        spec = cluster.wait_for("decode scaled up", lambda: _replicas(cluster, name) == 3 and cluster.get(names.KIND, name))
        # The operator patches spec.decode.replicas, then the status that explains it (two writes), and a
        # later pass may record a hold over it: its Scaled Event is what stays (a loaded CI run read the
        # status between the writes).
        scaled = cluster.wait_for("the scale-up Event", lambda: _scaled(cluster, name, "decode: scale up 1 -> 3"))
        assert "tpotP90Seconds" in scaled and "clamped to [1, 3]" in scaled, scaled
        assert float(re.search(r"tpotP90Seconds=([0-9.e-]+)", scaled).group(1)) > 0.1, scaled
        assert "replicas" not in spec["spec"]["prefill"]  # prefill does not autoscale: untouched
        for index in (1, 2):  # the planner adds whole groups
            sts = cluster.wait_for(f"decode group {index}", lambda: _statefulset(cluster, name, "decode", index))
            _with_ips(cluster, _start_pods(cluster, sts))
        # Idle (nothing finishes): after the 2 s scale-down window it goes back to the minimum.
        cluster.wait_for("decode scaled down", lambda: _replicas(cluster, name) == 1, timeout=60)
        scaled = cluster.wait_for("the scale-down Event", lambda: _scaled(cluster, name, "decode: scale down 3 -> 1"))
        assert "tpotP90Seconds=0.0" in scaled, scaled
        # Whole groups leave, highest first, and the router stops listing them first (Static discovery).
        def retired() -> bool:
            _router_rolled_out(cluster, name)  # the Deployment controller: the router runs without them
            return _statefulset(cluster, name, "decode", 2) is None and _statefulset(cluster, name, "decode", 1) is None
        cluster.wait_for("groups 1 and 2 retired", retired, timeout=60)
        # The status keeps why the groups last changed, while later passes record holds over lastDecision.
        def held_after_the_change() -> dict | None:
            auto = _status(cluster, name).get("autoscaling", {}).get("decode", {})
            return auto if auto.get("lastDecision", {}).get("reason", "").startswith("hold") else None
        auto = cluster.wait_for("a hold after the scale-down", lambda: (
            (a := held_after_the_change()) and (a.get("lastScale") or {}).get("to") == 1 and a))
        assert auto["lastScale"]["from"] == 3 and auto["lastScale"]["reason"].startswith("scale down 3 -> 1"), auto


def test_slow_ttft_read_from_a_real_prefill_worker_adds_a_group_and_idleness_removes_it(cluster):
    """Prefill's decision on the real metrics path: PD requests through the real prefill engine and
    servicer, the TTFT histogram they feed, the /metrics text, the operator's scrape and p90, the
    decision, spec.prefill.replicas, the Event. The target lies below any p90 a finished request
    can read (all of them in the first bucket read QUANTILE of its bound), so traffic scales up;
    the reading must lie between that floor and the bucket holding the slowest request's wall time."""
    rng = random.Random(random.randrange(2**32))
    name = "auto-prefill"
    floor = TTFT_BUCKETS[0] * QUANTILE
    with ServedPD() as served:
        body = _deployment(name)
        body["spec"]["prefill"]["autoscaling"] = {
            "minReplicas": 1, "maxReplicas": 2, "metrics": [{"name": "ttftP90Seconds", "target": floor / 2}],
            "scaleUpStabilizationSeconds": 0, "scaleDownStabilizationSeconds": 2}
        body["spec"]["metrics"] = {"port": served.port}
        cluster.create(body)
        _bring_up(cluster, name, {"prefill": 1, "decode": 1})
        _with_ips(cluster, [names.pod_name(name, "prefill", 0, 0)])  # the only pod scraped
        cluster.wait_for("a first decision", lambda: _status(cluster, name).get("autoscaling", {}).get("prefill"))
        seconds: list[float] = []

        def traffic_scaled_up() -> bool:
            seconds.extend(served.requests(rng, 2))
            return _replicas(cluster, name, "prefill") == 2
        cluster.wait_for("prefill scaled up", traffic_scaled_up)
        scaled = cluster.wait_for("the scale-up Event", lambda: _scaled(cluster, name, "prefill: scale up 1 -> 2"))
        reading = float(re.search(r"ttftP90Seconds=([0-9.e-]+)", scaled).group(1))
        ceiling = next((b for b in TTFT_BUCKETS if b >= max(seconds)), float("inf"))
        assert floor <= reading <= ceiling and "clamped to [1, 2]" in scaled, (scaled, max(seconds))
        assert "replicas" not in cluster.get(names.KIND, name)["spec"]["decode"]  # decode does not autoscale
        # Group 1 runs (not scraped: it has no IP); with no traffic the 2 s window brings prefill back to 1.
        _start_pods(cluster, cluster.wait_for("prefill group 1", lambda: _statefulset(cluster, name, "prefill", 1)))
        cluster.wait_for("prefill scaled down", lambda: _replicas(cluster, name, "prefill") == 1, timeout=60)
        scaled = cluster.wait_for("the scale-down Event", lambda: _scaled(cluster, name, "prefill: scale down 2 -> 1"))
        assert "ttftP90Seconds=0.0" in scaled, scaled

        def retired() -> bool:
            _router_rolled_out(cluster, name)  # the Deployment controller: the router runs without it
            return _statefulset(cluster, name, "prefill", 1) is None
        cluster.wait_for("group 1 retired", retired, timeout=60)


@pytest.mark.parametrize("autoscaling, message", [
    ({"minReplicas": 3, "maxReplicas": 2, "metrics": [{"name": "tpotP90Seconds", "target": 0.05}]},
     "decode.autoscaling.minReplicas must be <= maxReplicas"),
    ({"maxReplicas": 2, "metrics": [{"name": "ttftP90Seconds", "target": 0.5}]},
     "'ttftP90Seconds' is not one of ['tpotP90Seconds', 'kvCacheUsage']"),
    ({"maxReplicas": 2, "metrics": [{"name": "tokensPerSecond", "target": 100}]},
     "'tokensPerSecond' is not one of"),
])
def test_bad_autoscaling_specs_get_a_clear_invalid_spec_condition(cluster, autoscaling, message):
    name = f"bad-{random.randrange(10**6)}"
    cluster.create(_deployment(name, autoscaling=autoscaling))
    condition = cluster.wait_for("InvalidSpec", lambda: _condition(cluster, name, "InvalidSpec").get("status") == "True"
                                 and _condition(cluster, name, "InvalidSpec"))
    assert message in condition["message"], condition
    assert _statefulset(cluster, name, "decode", 0) is None  # nothing was created


def test_autoscaling_without_metrics_is_refused(cluster):
    name = "nometrics"
    body = _deployment(name, autoscaling={"maxReplicas": 2, "metrics": [{"name": "kvCacheUsage", "target": 0.8}]})
    body["spec"]["metrics"] = {"enabled": False}
    cluster.create(body)
    condition = cluster.wait_for("InvalidSpec", lambda: _condition(cluster, name, "InvalidSpec").get("status") == "True"
                                 and _condition(cluster, name, "InvalidSpec"))
    assert "decode.autoscaling reads the workers' metrics: it needs metrics.enabled" in condition["message"]


def test_whole_number_targets_are_accepted_as_numbers():
    """YAML/JSON `target: 4` arrives as an integer; the CEL rule compared it with 0.0 and failed
    with a type error (seen live: the e2e's target 1000 made the spec invalid)."""
    import yaml as _yaml

    from deepseek_pd.operator.validation import validate_spec
    from test_operator_kopf import EXAMPLES

    raw = _yaml.safe_load((EXAMPLES / "cpu-minimal.yaml").read_text())["spec"]
    raw["prefill"]["autoscaling"] = {"maxReplicas": 3, "metrics": [{"name": "queueDepthPerGroup", "target": 4}]}
    raw["decode"]["autoscaling"] = {"maxReplicas": 2, "metrics": [{"name": "tpotP90Seconds", "target": random.randint(1, 9)}]}
    assert validate_spec("whole", raw) == []

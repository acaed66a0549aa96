"""SLO autoscaling end to end against the emulated API server: the real kopf operator scrapes a
real worker metrics exporter (workers/metrics/server.py, fed the way the servicer feeds
it), scales decode up under slow TPOT and back to the minimum when idle, records each decision
in status.autoscaling, posts an Event per change; bad autoscaling specs become InvalidSpec."""
from __future__ import annotations

import asyncio
import random
import re
import threading

import pytest
from test_operator_kopf import (
    _bring_up, _condition, _deployment, _router_rolled_out, _start_pods, _statefulset, _status,
)

from deepseek_pd.ports import pick_free_ports
from deepseek_pd.operator import names
from deepseek_pd.workers.metrics.worker_metrics import MetricLabels, WorkerMetrics
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


def _with_ips(cluster, pod_names: list[str]) -> None:
    for pod in pod_names:
        cluster.patch("Pod", pod, {"status": {"podIP": "127.0.0.1"}}, "status")


def _replicas(cluster, name: str) -> int:
    return cluster.get(names.KIND, name)["spec"]["decode"].get("replicas", 1)  # the emulator does not default


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

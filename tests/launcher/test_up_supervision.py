"""`up`'s gateway and supervision on a real process tree: smg in front of scripted-engine workers.

- the control plane (`/workers`) refuses a caller without the cluster's key, and accepts the key;
- a worker killed with SIGKILL is restarted by the supervisor and requests succeed again;
- a SIGSTOPped (hung) router is detected by its /liveness probe and replaced.
"""
from __future__ import annotations

import json
import os
import signal
import time
import urllib.error
import urllib.request
from pathlib import Path

import pytest

from deepseek_pd.launcher.cluster import ClusterSpec, LocalCluster
from deepseek_pd.launcher.supervisor import SupervisorConfig
from pdtest import servicer_fakes
from pdtest.e2e_cluster import ROUTER_ARGS
from pdtest.servicer_fakes import expected_tokens, make_tokenizer_model_dir

pytestmark = [pytest.mark.timeout(180), pytest.mark.slow]

FAKE_FACTORY = f"{Path(servicer_fakes.__file__)}:build_fake_engine"  # tests/support/pdtest/
FAST = SupervisorConfig(initial_backoff_s=0.2, probe_interval_s=0.5, probe_timeout_s=0.5, probe_failures=2)


def call(url: str, method: str = "GET", body: dict | None = None, key: str | None = None) -> tuple[int, bytes]:
    headers = {"Content-Type": "application/json", **({"Authorization": f"Bearer {key}"} if key else {})}
    request = urllib.request.Request(url, json.dumps(body).encode() if body else None, headers, method=method)
    try:
        with urllib.request.urlopen(request, timeout=10) as reply:
            return reply.status, reply.read()
    except urllib.error.HTTPError as exc:
        return exc.code, exc.read()
    except (urllib.error.URLError, OSError) as exc:
        return -1, str(exc).encode()


@pytest.fixture()
def cluster(tmp_path):
    model_dir = make_tokenizer_model_dir(tmp_path / "fake-model")
    spec = ClusterSpec(model=str(model_dir), num_prefill=1, num_decode=2, log_dir=tmp_path / "logs",
                       worker_args=(f"--engine-factory={FAKE_FACTORY}",), startup_timeout_s=90,
                       router_args=ROUTER_ARGS)  # up's flags, without the idle settle at teardown
    with LocalCluster(spec) as running:
        yield running


def generate_ok(url: str, prompt: list[int]) -> bool:
    status, body = call(f"{url}/generate", "POST", {"model": "fake-model", "input_ids": prompt,
                                                   "sampling_params": {"max_new_tokens": 3, "temperature": 0}})
    if status != 200:
        return False
    payload = json.loads(body)
    payload = payload[0] if isinstance(payload, list) else payload
    return payload["output_ids"] == expected_tokens(tuple(prompt), 3)


def step_until(supervisor, predicate, timeout_s: float) -> bool:
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        supervisor.step()
        if predicate():
            return True
        time.sleep(0.2)
    return False


def test_control_plane_needs_the_key(cluster) -> None:
    url, key = cluster.router_url, cluster.control_plane_key
    worker = {"url": "grpc://127.0.0.1:1", "worker_type": "decode"}
    assert call(f"{url}/workers")[0] == 401
    assert call(f"{url}/workers", "POST", worker)[0] == 401
    assert call(f"{url}/workers", "POST", worker, key="not-the-key")[0] == 401
    status, body = call(f"{url}/workers", key=key)
    assert status == 200 and len(json.loads(body)["workers"]) == 3
    assert (cluster.log_dir / "control-plane-key").read_text().strip() == key
    assert generate_ok(url, [11, 12, 13])  # the client API stays open


def test_killed_worker_is_restarted_and_serves_again(cluster) -> None:
    supervisor = cluster.supervisor(FAST)
    victim = cluster.decode_workers()[0].process
    old_pid = victim.pid
    os.kill(old_pid, signal.SIGKILL)
    assert step_until(supervisor, lambda: victim.is_alive() and victim.pid != old_pid, 30)
    assert supervisor.restart_counts[victim.name] == 1
    # Back in the router's rotation: every request succeeds (both decode workers get some).
    assert step_until(supervisor, lambda: all(generate_ok(cluster.router_url, [20 + i, 5]) for i in range(6)), 60)


def test_hung_router_is_detected_and_replaced(cluster) -> None:
    supervisor = cluster.supervisor(FAST)
    router = cluster.router
    old_pid = router.pid
    os.kill(old_pid, signal.SIGSTOP)
    try:
        assert step_until(supervisor, lambda: router.pid != old_pid, 30)
    finally:
        try:
            os.kill(old_pid, signal.SIGCONT)
        except ProcessLookupError:
            pass
    assert supervisor.restart_counts["router"] == 1
    assert step_until(supervisor, lambda: generate_ok(cluster.router_url, [30, 31]), 60)

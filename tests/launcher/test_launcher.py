"""`deepseek-pd up` as a user runs it: a real process tree (workers + the real router), then
SIGINT / SIGTERM / SIGKILL of the launcher, and a check that no descendant survives.

Workers serve the scripted engine from pdtest/servicer_fakes.py (`--engine-factory`), so these tests are
about process supervision, not the model; the router and the gRPC path are the real ones.
"""
from __future__ import annotations

import json
import os
import re
import signal
import subprocess
import sys
import time
import urllib.request
from pathlib import Path

import pytest

from deepseek_pd.ports import is_port_free, pick_free_ports
from pdtest import servicer_fakes
from pdtest.process_tree import alive, descendants, wait_gone
from pdtest.servicer_fakes import expected_tokens, make_tokenizer_model_dir

pytestmark = [pytest.mark.timeout(120), pytest.mark.slow]

FAKE_FACTORY = f"{servicer_fakes.__file__}:build_fake_engine"  # loaded by path in each worker


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory) -> Path:
    return make_tokenizer_model_dir(tmp_path_factory.mktemp("m") / "fake-model")


def start_up(model_dir: Path, tmp_path: Path, *extra: str) -> tuple[subprocess.Popen, str]:
    argv = [sys.executable, "-m", "deepseek_pd.cli", "up", "--model", str(model_dir),
            "--prefill", "1", "--decode", "2", "--log-dir", str(tmp_path / "logs"),
            f"--worker-arg=--engine-factory={FAKE_FACTORY}", *extra]
    proc = subprocess.Popen(argv, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    deadline = time.monotonic() + 90
    output = []
    while time.monotonic() < deadline:
        line = proc.stdout.readline()
        if not line:
            break
        output.append(line)
        match = re.search(r"router ready at (http://\S+)", line)
        if match:
            return proc, match.group(1)
    proc.kill()
    raise AssertionError("`up` did not become ready:\n" + "".join(output))


def generate(url: str, input_ids: list[int], max_new_tokens: int) -> dict:
    body = json.dumps({"model": "fake-model", "input_ids": input_ids,
                       "sampling_params": {"max_new_tokens": max_new_tokens, "temperature": 0}})
    request = urllib.request.Request(f"{url}/generate", body.encode(), {"Content-Type": "application/json"})
    with urllib.request.urlopen(request, timeout=30) as reply:
        payload = json.loads(reply.read())
    return payload[0] if isinstance(payload, list) else payload


@pytest.mark.parametrize("sig", [signal.SIGINT, signal.SIGTERM])
def test_up_serves_then_stops_cleanly_without_orphans(model_dir, tmp_path, sig) -> None:
    proc, url = start_up(model_dir, tmp_path)
    try:
        tree = descendants(proc.pid)
        assert len(tree) >= 4, f"expected 3 workers + the router, found pids {tree}"
        prompt = [11, 42, 99, 7 + sig]
        reply = generate(url, prompt, 6)
        assert reply["output_ids"] == expected_tokens(tuple(prompt), 6)
        logs = tmp_path / "logs"
        credentials = [logs / "internal.secret", logs / "control-plane-key"]
        assert all(path.is_file() for path in credentials)
        proc.send_signal(sig)
        out, _ = proc.communicate(timeout=60)
        assert proc.returncode == 0, out
        assert "stopped" in out
        assert wait_gone(tree, 10) == set(), f"orphans left behind: {alive(tree)}"
        # A clean stop leaves the logs and takes the run's secret and router key away.
        assert not any(path.exists() for path in credentials), [p for p in credentials if p.exists()]
        assert any(logs.glob("*.log"))
    finally:
        if proc.poll() is None:
            proc.kill()


def test_killed_launcher_takes_its_children_down(model_dir, tmp_path) -> None:
    proc, _ = start_up(model_dir, tmp_path)
    tree = descendants(proc.pid)
    try:
        proc.kill()  # no cleanup possible in the launcher: PR_SET_PDEATHSIG must do it
        proc.wait(10)
        assert wait_gone(tree, 30) == set(), f"orphans left behind: {alive(tree)}"
    finally:
        for pid in alive(tree):
            os.kill(pid, signal.SIGKILL)


def test_worker_that_cannot_start_fails_up_with_its_log(model_dir, tmp_path) -> None:
    argv = [sys.executable, "-m", "deepseek_pd.cli", "up", "--model", str(model_dir),
            "--log-dir", str(tmp_path / "logs"), "--worker-arg=--engine-factory=no_such_module:build"]
    proc = subprocess.run(argv, capture_output=True, text=True, timeout=90)
    assert proc.returncode == 2
    assert "exited with code" in proc.stderr and "no_such_module" in proc.stderr


def test_bad_flags_are_one_line_errors(model_dir) -> None:
    for flags, words in [(["--prefill", "0"], "at least one prefill"), (["--port", "70000"], "TCP port"),
                         (["--decode-ranks", "2", "--dp", "3"], "--dp 3 must divide --decode-ranks 2")]:
        proc = subprocess.run([sys.executable, "-m", "deepseek_pd.cli", "up", "--model", str(model_dir),
                               *flags], capture_output=True, text=True, timeout=60)
        assert proc.returncode == 2 and words in proc.stderr and "Traceback" not in proc.stderr


def test_picked_ports_are_distinct_and_free() -> None:
    ports = pick_free_ports(16)
    assert len(set(ports)) == 16
    assert all(is_port_free(p) for p in ports)


def test_serve_drains_running_requests_on_sigterm(model_dir, tmp_path) -> None:
    """SIGTERM: refuse new work, let the running stream finish, exit 0."""
    import asyncio

    from deepseek_pd.client.scheduler_grpc import SchedulerClient, collect, sampling_proto
    from deepseek_pd.launcher.health import worker_is_healthy
    from pdtest.servicer_fakes import SLOW_TOKEN
    from smg_grpc_proto import sglang_scheduler_pb2 as pb

    port = pick_free_ports(1)[0]
    log = open(tmp_path / "serve.log", "w")
    proc = subprocess.Popen([sys.executable, "-m", "deepseek_pd.cli", "serve", "decode", "--model",
                             str(model_dir), "--port", str(port), "--engine-factory", FAKE_FACTORY,
                             "--drain-timeout", "20"], stdout=log, stderr=subprocess.STDOUT)
    try:
        deadline = time.monotonic() + 60
        while not worker_is_healthy(f"127.0.0.1:{port}"):
            assert proc.poll() is None and time.monotonic() < deadline, (tmp_path / "serve.log").read_text()
            time.sleep(0.2)

        async def main():
            async with SchedulerClient(f"127.0.0.1:{port}") as client:
                prompt = [SLOW_TOKEN, 21, 22]
                call = client.generate(pb.GenerateRequest(
                    request_id="draining", tokenized=pb.TokenizedInput(input_ids=prompt),
                    sampling_params=sampling_proto(max_new_tokens=40), stream=True))
                first = await call.read()
                proc.send_signal(signal.SIGTERM)
                await asyncio.sleep(0.3)
                assert not (await client.health()).healthy  # draining: the router stops sending
                ids, complete = await collect(_read_all(first, call))
                assert ids == expected_tokens(tuple(prompt), 40)
                assert complete.finish_reason == "length"

        asyncio.run(main())
        assert proc.wait(30) == 0
        assert "stopped" in (tmp_path / "serve.log").read_text()
    finally:
        if proc.poll() is None:
            proc.kill()
        log.close()


async def _read_all(first, call):
    """The rest of a stream that was started with read() (grpc forbids mixing in async for)."""
    import grpc

    yield first
    while (item := await call.read()) is not grpc.aio.EOF:
        yield item


def test_demo_streams_a_chat_answer_and_cleans_up(tmp_path) -> None:
    """`make demo`'s command on the embedded tiny model and the real engines."""
    proc = subprocess.Popen([sys.executable, "-m", "deepseek_pd.cli", "demo", "--max-tokens", "12",
                             "--log-dir", str(tmp_path / "logs")],
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    tree: set[int] = set()
    deadline = time.monotonic() + 100
    while proc.poll() is None and time.monotonic() < deadline:
        tree |= descendants(proc.pid)
        time.sleep(0.2)
    out, err = proc.communicate(timeout=30)
    assert proc.returncode == 0, out + err
    answer = out.split("assistant:", 1)[1].strip()
    assert answer, out
    assert "12 tokens" in err and "cluster stopped" in err
    assert wait_gone(tree, 10) == set()


def test_serve_accepts_every_flag_the_operator_renders() -> None:
    """The operator's pods run `deepseek-pd serve` with these flags; none may be unknown here."""
    from deepseek_pd.cli import build_parser
    from deepseek_pd.operator.crd_spec import MANAGED_FLAGS

    serve = build_parser()._subparsers._group_actions[0].choices["serve"]
    known = {option for action in serve._actions for option in action.option_strings}
    assert {f"--{flag}" for flag in MANAGED_FLAGS} <= known
    args = build_parser().parse_args(
        ["serve", "prefill", "--model", "/m", "--host", "0.0.0.0", "--port", "30001",
         "--bootstrap-port", "8998", "--kv-transport", "mooncake", "--tp", "2", "--dp", "1", "--ep", "2",
         "--served-model-name", "ds", "--device", "cuda", "--nnodes", "2", "--node-rank", "1",
         "--dist-init-addr", "leader:5000", "--deepep-mode", "auto"])
    assert (args.tp, args.ep, args.nnodes, args.node_rank, args.deepep_mode) == (2, 2, 2, 1, "auto")

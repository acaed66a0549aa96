"""bench/mooncake_gpu.py's CPU path (`--device cpu --tiny`, inside `unshare -n`: Mooncake binds
0.0.0.0) with the installed Mooncake: every repeat arrives bit for bit, the JSON's check is raw
best / ours best of the seconds it recorded, its verdict and ratio follow from that value, and the
target table (card, commit, Mooncake build) is printed last. The GPU run is test_mooncake_gpu_cuda.py."""
from __future__ import annotations

import importlib.metadata
import json
import random
import subprocess
from pathlib import Path

import pytest

from pdtest.netns import run_in_netns

pytestmark = [pytest.mark.netns, pytest.mark.timeout(120)]

SCRIPT = Path(__file__).resolve().parents[2] / "bench" / "mooncake_gpu.py"


def test_the_cpu_path_checks_ours_against_raw_mooncake_and_prints_the_table_last(tmp_path) -> None:
    rng = random.Random()
    seed, repeats, direction = rng.randrange(1 << 30), rng.randint(2, 3), rng.choice(["pull", "write"])
    stdout = run_in_netns(SCRIPT, "--device", "cpu", "--tiny", "--repeats", str(repeats), "--direction", direction,
                          "--seed", str(seed), "--out", str(tmp_path), timeout_s=100)
    lines = stdout.strip().splitlines()
    # (ours with the secret, then without it)
    assert sum(1 for line in lines if line.startswith("repeat ") and ", exact; raw " in line) == 2 * repeats, stdout

    result = json.loads((tmp_path / "mooncake_gpu.json").read_text())
    run = result["kv_transfer"]["runs"][0]
    assert (result["seed"], result["direction"], len(run["seconds"]), len(run["raw_seconds"]),
            len(run["raw_read_seconds"])) == (seed, direction, repeats, repeats, repeats)
    assert result["raw_read_gbps"] == pytest.approx(result["bytes"] / min(run["raw_read_seconds"]) / 1e9)
    verdict = result["check"]
    assert verdict["value"] == pytest.approx(min(run["raw_seconds"]) / min(run["seconds"]))
    assert verdict["result"] == ("PASS" if verdict["value"] >= 0.8 else "MISS")
    assert verdict["ratio"] == pytest.approx(verdict["value"] / 0.8)
    assert result["bytes"] == result["tokens"] * result["bytes_per_token"] == result["kv_transfer"]["bytes"]
    # Where each side's time went (secured: the cipher's stage and the MAC on both sides), the CPU
    # per transfer, and the run without the secret (no MAC) against its own raw writes.
    stages = run["stage_ms"]
    mover = "decode" if direction == "pull" else "prefill"  # whose engine calls Mooncake
    assert {"stage", "mac"} <= set(stages["prefill"]) and {"write", "mac"} <= set(stages["decode"])
    assert "network" in stages[mover]
    assert len(run["cpu_seconds"]) == repeats and all(cpu > 0 for cpu in run["cpu_seconds"])
    clear = result["clear"]["runs"][0]
    assert "mac" not in clear["stage_ms"]["prefill"] and "mac" not in clear["stage_ms"]["decode"]
    assert result["clear_vs_raw"] == pytest.approx(min(clear["raw_seconds"]) / min(clear["seconds"]))
    assert sum(1 for line in lines if line.startswith("prefill, per transfer, ms")) == 2

    commit = subprocess.run(["git", "-C", str(SCRIPT.parent), "rev-parse", "--short", "HEAD"], capture_output=True,
                            text=True).stdout.strip()
    installed = {dist.metadata["Name"] for dist in importlib.metadata.distributions()}
    assert result["card"] == "cpu" and result["commit"] == commit
    assert result["mooncake"].split()[0] in {name.lower().replace("_", "-") for name in installed}
    header, row = lines[-5], lines[-1]
    assert f"card cpu, commit {commit}, {result['mooncake']}" in header
    cells = [cell.strip() for cell in row.strip("|").split("|")]
    assert cells[0] == verdict["check"] and cells[4:] == [">= 0.8", f"{verdict['ratio']:.2f}", verdict["result"]]
    assert float(cells[3]) == pytest.approx(verdict["value"], abs=0.005)

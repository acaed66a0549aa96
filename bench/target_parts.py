"""The parts of issue 7's targets that run without the serving cluster, each its own child process.

`bench/serving_gpu.py` runs them between the runner-alone timing and `deepseek-pd up` (each exits
before the workers take the GPU), so one device call answers all six targets:

| part | script | answers |
|---|---|---|
| kv_transfer | `bench/kv_transfer.py --device cuda --streams 1,4` | gRPC KV, GPU pool -> GPU pool, 4k tokens, >= 2 GB/s |
| mooncake | `bench/kv_transfer.py --transport mooncake --netns` | Mooncake TCP on CPU >= 0.8x raw Mooncake |
| layerwise | `bench/layerwise_ttft.py --model <the run's checkpoint>` | 8k prompt: PD TTFT <= 1.1x prefill compute |

Each part writes its JSON (with its check, `bench/target_check.py`) under the run's directory and
runs under a wall-clock cap; a part that does not fit in what the budget leaves is skipped and
says so. Mooncake runs in a private network namespace (it binds 0.0.0.0) when `unshare -n`
works on the machine, otherwise on the host's loopback, and the note says which.
"""
from __future__ import annotations

import shutil
import subprocess
import sys
from dataclasses import dataclass
from pathlib import Path
from typing import Callable

BENCH = Path(__file__).resolve().parent
NAMES = ("kv_transfer", "mooncake", "layerwise")


@dataclass(frozen=True)
class Part:
    name: str  # one of NAMES
    script: str  # under bench/
    argv: tuple[str, ...]
    cap_s: float  # wall-clock limit of the child
    min_s: float  # below this much time left, the part is skipped rather than started


_V2_LITE_KV = ("--tokens", "4096")  # kv_transfer.py's defaults are the V2-Lite layers, latent width and page 64
_TINY_KV = ("--tokens", "300", "--layers", "3", "--kv-dim", "40", "--page-size", "4", "--repeats", "2")

GPU_PARTS = (
    Part("kv_transfer", "kv_transfer.py", ("--device", "cuda", "--streams", "1,4", *_V2_LITE_KV), 120, 40),
    Part("mooncake", "kv_transfer.py", ("--transport", "mooncake", "--device", "cpu", *_V2_LITE_KV), 90, 30),
    Part("layerwise", "layerwise_ttft.py", ("--device", "cuda", "--tokens", "8192", "--chunk", "8192",
                                            "--page-size", "64", "--repeats", "2"), 150, 60),
)
TINY_PARTS = (
    Part("kv_transfer", "kv_transfer.py", ("--device", "cpu", "--streams", "1,2", "--chunk-mb", "0.01", *_TINY_KV),
         90, 10),
    Part("mooncake", "kv_transfer.py", ("--transport", "mooncake", "--device", "cpu", *_TINY_KV), 90, 10),
    Part("layerwise", "layerwise_ttft.py", ("--device", "cpu", "--tokens", "128", "--chunk", "64",
                                            "--page-size", "16", "--repeats", "1"), 120, 10),
)


def netns_problem() -> str | None:
    """None when `unshare -n` can make a namespace with loopback up here, else why not."""
    if shutil.which("unshare") is None or shutil.which("ip") is None:
        return "unshare or ip is not installed"
    try:
        probe = subprocess.run(["unshare", "-n", "sh", "-c", "ip link set lo up"], capture_output=True,
                               text=True, timeout=30)
    except (OSError, subprocess.TimeoutExpired) as exc:
        return f"unshare -n failed: {exc}"
    return None if probe.returncode == 0 else f"unshare -n failed: {probe.stderr.strip()[-200:]}"


def mooncake_problem() -> str | None:
    probe = subprocess.run([sys.executable, "-c", "from mooncake.engine import TransferEngine"],
                           capture_output=True, text=True, timeout=60)
    if probe.returncode == 0:
        return None
    return ("mooncake is not importable (put the mooncake-transfer-engine-non-cuda wheel in bench/wheels/ "
            f"and carry that folder): {probe.stderr.strip().splitlines()[-1:]}")


def part_argv(part: Part, model_dir: Path, json_path: Path, netns: bool) -> list[str]:
    argv = [sys.executable, str(BENCH / part.script), *part.argv, "--json", str(json_path)]
    if part.name == "layerwise":
        argv += ["--model", str(model_dir)]  # the run's checkpoint: V2-Lite on the GPU
    if part.name == "mooncake" and netns:
        argv.append("--netns")
    return argv


RunStep = Callable[[str, list[str], float, Path], tuple[bool, float, str]]


def run_parts(parts: tuple[Part, ...], wanted: set[str], model_dir: Path, out: Path,
              time_left: Callable[[], float], run_step: RunStep, notes: list[str], skipped: dict[str, str]) -> dict:
    """Runs the wanted parts in order; returns {name: its JSON, with "seconds_wall"}, and puts why
    each other wanted part has no result in `skipped`. `time_left()` is what may still be spent
    here (the caller keeps back what the serving levels need)."""
    import json

    found: dict = {}
    out.mkdir(parents=True, exist_ok=True)
    for part in parts:
        if part.name not in wanted:
            continue
        netns = False
        if part.name == "mooncake":
            problem = mooncake_problem()
            if problem:
                skipped[part.name] = problem
                continue
            why_not = netns_problem()
            netns = why_not is None
            notes.append("mooncake ran in a private network namespace (unshare -n)" if netns else
                         f"mooncake ran on the host's loopback, not in a namespace: {why_not}")
        left = time_left()
        if left < part.min_s:
            skipped[part.name] = f"skipped for time: {left:.0f}s left, it needs {part.min_s:.0f}s or more"
            continue
        json_path = out / f"{part.name}.json"
        limit = min(part.cap_s, left)
        ok, secs, _ = run_step(part.name, part_argv(part, model_dir, json_path, netns), limit,
                               out / f"{part.name}.log")
        if not ok or not json_path.exists():
            skipped[part.name] = f"failed or ran past {limit:.0f}s: see {out / part.name}.log"
            continue
        found[part.name] = {**json.loads(json_path.read_text()), "seconds_wall": secs}
    for name, why in skipped.items():
        notes.append(f"{name}: {why}")
    return found

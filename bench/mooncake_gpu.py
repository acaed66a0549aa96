"""Mooncake TCP, GPU pool to GPU pool on one machine: our transport against raw Mooncake (issue 25: >= 0.8).

    python bench/mooncake_gpu.py --device cuda --out $OUT     # the GPU run (bench/mooncake_gpu_session.sh)
    .venv/bin/python bench/mooncake_gpu.py --device cpu --tiny --netns --out /tmp   # checks the script on CPU

One 4k-token DeepSeek-V2-Lite request (27 layers x 576 bf16 = 31.1 KiB/token, 127 MB) moves per
repeat through the project's Mooncake KV path, exactly as `bench/kv_transfer.py --transport
mooncake` runs it: the real bootstrap server and client, `KVPush` (prefill) and `pull_kv` (decode),
two TransferEngines in one process on loopback TCP, the KV encrypted and MACed, pulled by decode
(`--direction`), scattered and permuted pages on both sides, the destination checked bit for bit.
Between our repeats, raw Mooncake moves the same bytes between the same two engines: one
`batch_transfer_sync_write` from the prefill pool's pages into the decode side's staging (its
registered GPU memory on a CUDA pool). value = raw best / ours best, the check of
`bench/target_check.py`; the card's name, the commit and the Mooncake build go with it. Printed
beside it, not checked: a raw `batch_transfer_sync_read` of the same pages into the same staging
(what a pulled transfer's reads cost without its staging, cipher and MAC), and ours again without
the deployment secret (no cipher, no MAC) against its own raw writes; each side's stage breakdown
(stats.py's phases) and the process CPU per transfer come with each run's report.

A GPU pool over TCP needs a CUDA build of Mooncake (`mooncake-transfer-engine-cuda13`; the engine
refuses the `-non-cuda` wheel with a message, workers/transport/mooncake_build.py). Mooncake binds
0.0.0.0: on a shared machine pass --netns (a private network namespace with loopback only).
Writes DIR/mooncake_gpu.json (`--out`) and prints the one-row target table last.
"""
from __future__ import annotations

import argparse
import asyncio
import importlib
import json
import random
import secrets
import subprocess
import sys
from pathlib import Path

import torch

BENCH = Path(__file__).resolve().parent
sys.path.insert(0, str(BENCH))  # kv_transfer.py and target_check.py beside this script

import kv_transfer  # noqa: E402
from target_check import check  # noqa: E402

from deepseek_pd.errors import UserError  # noqa: E402
from deepseek_pd.model.kv.mooncake_direction import MOONCAKE_KV_DIRECTIONS  # noqa: E402
from deepseek_pd.workers.transport.mooncake_build import imported_build  # noqa: E402
from deepseek_pd.workers.transport import kv_mac  # noqa: E402

TARGET = 0.8  # issue 25: Mooncake TCP on the GPU machine, GPU pool to GPU pool, ours / raw Mooncake
V2_LITE = ("--tokens", "4096", "--layers", "27", "--kv-dim", "576", "--page-size", "64")
TINY = ("--tokens", "300", "--layers", "3", "--kv-dim", "40", "--page-size", "4")
DIRECTIONS = {"pull": "ours read by decode", "write": "ours written by prefill"}


def parse_args(argv: list[str]) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--device", default="cuda", help="cuda[:N] or cpu (both pools on it)")
    parser.add_argument("--tiny", action="store_true", help="3 layers, 300 tokens: checks the script")
    parser.add_argument("--repeats", type=int, default=5)
    parser.add_argument("--direction", default="pull", choices=MOONCAKE_KV_DIRECTIONS,
                        help="ours: decode reads the KV (pull, the default) or prefill writes it")
    parser.add_argument("--seed", type=int, default=None, help="the pools' contents and page lists (default: random)")
    parser.add_argument("--commit", default=None, help="commit to record when the copy has no .git")
    parser.add_argument("--out", type=Path, default=Path("."), help="folder for mooncake_gpu.json")
    parser.add_argument("--netns", action="store_true", help="re-run inside a private network namespace")
    parser.add_argument("--kv-mac", default=None, choices=kv_mac.algorithms(),
                        help="the KV MAC both sides use (default: the preferred, as workers negotiate it)")
    args = parser.parse_args(argv)
    if args.repeats < 1:
        parser.error("--repeats needs a value >= 1")
    return args


def transfer_args(args: argparse.Namespace) -> argparse.Namespace:
    """kv_transfer.py's settings for this run (its staging default holds the whole 4k prompt, so
    the raw write lands in one piece)."""
    shape = TINY if args.tiny else V2_LITE
    return kv_transfer.parse_args(["--transport", "mooncake", "--device", args.device, *shape,
                                   "--repeats", str(args.repeats), "--mooncake-direction", args.direction])


def commit() -> str:
    try:
        return subprocess.run(["git", "-C", str(BENCH), "rev-parse", "--short", "HEAD"], capture_output=True,
                              text=True, timeout=10).stdout.strip() or "unknown"
    except (OSError, subprocess.SubprocessError):
        return "unknown"


def measure(args: argparse.Namespace, seed: int) -> dict:
    """One run: our repeats, each followed by a raw write of the same bytes; every figure in a dict."""
    settings = transfer_args(args)
    setup = kv_transfer.Setup(settings, seed)
    results = kv_transfer.Results()
    where = "both sides in one process"
    asyncio.run(kv_transfer.run_together(setup, results, None, 1, secrets.token_bytes(32)))
    kv_transfer.report(setup, results, where)
    # The same without a deployment secret (no cipher, no MAC), its own raw writes beside it: what
    # the security costs, apart from the rest of the path.
    clear = kv_transfer.Results()
    asyncio.run(kv_transfer.run_together(setup, clear, None, 1, None))
    kv_transfer.report(setup, clear, where + ", without the secret (no cipher, no MAC)")
    ours, raw = min(results.seconds), min(results.ceilings)
    pairs = sorted(r / o for r, o in zip(results.ceilings, results.seconds))
    name = f"Mooncake TCP {setup.src.device.type} pool -> pool, {settings.tokens} tokens: ours / raw (best)"
    verdict = check(name, raw / ours, ">=", TARGET)
    verdict["ratio"] = verdict["value"] / TARGET
    return {"seed": seed, "bytes": setup.bytes, "bytes_per_token": setup.src.bytes_per_token,
            "tokens": settings.tokens, "layers": settings.layers, "direction": args.direction,
            "ours_gbps": setup.bytes / ours / 1e9, "raw_gbps": setup.bytes / raw / 1e9,
            "raw_read_gbps": setup.bytes / min(results.read_ceilings) / 1e9,
            "paired_median": pairs[len(pairs) // 2],
            "clear_gbps": setup.bytes / min(clear.seconds) / 1e9,
            "clear_vs_raw": min(clear.ceilings) / min(clear.seconds),
            "clear": kv_transfer.result_json(setup, {1: clear}, {}, where),
            "kv_transfer": kv_transfer.result_json(setup, {1: results}, {}, where), "check": verdict}


def table(result: dict) -> str:
    c = result["check"]
    return "\n".join([
        f"issue 25 Mooncake GPU, card {result['card']}, commit {result['commit']}, {result['mooncake']}; "
        f"{result['bytes'] / 1e6:.1f} MB ({result['bytes_per_token']} B/token), {DIRECTIONS[result['direction']]}, "
        f"KV MAC {result.get('kv_mac', '?')}, "
        f"ratio = value / target",
        f"(raw read, the pulled direction's ceiling: {result['raw_read_gbps']:.3f} GB/s; ours without the "
        f"secret, no cipher or MAC: {result['clear_gbps']:.3f} GB/s, {result['clear_vs_raw']:.2f} of its raw write)",
        f"| {'check':<62} | {'ours GB/s':>9} | {'raw GB/s':>8} | {'value':>5} | {'target':>6} | {'ratio':>5} "
        f"| result |",
        f"|{'-' * 64}|{'-' * 11}|{'-' * 10}|{'-' * 7}|{'-' * 8}|{'-' * 7}|--------|",
        f"| {c['check']:<62} | {result['ours_gbps']:>9.3f} | {result['raw_gbps']:>8.3f} | {c['value']:>5.2f} | "
        f"{c['target']:>6} | {c['ratio']:>5.2f} | {c['result']:<6} |"])


def main(argv: list[str] | None = None) -> dict | None:
    argv = sys.argv[1:] if argv is None else argv
    args = parse_args(argv)
    if args.netns:
        raise SystemExit(kv_transfer.reexec_in_netns(argv, Path(__file__)))
    device = torch.device(args.device)
    if device.type == "cuda" and not torch.cuda.is_available():
        raise SystemExit("--device cuda: no CUDA device here (use --device cpu --tiny on a CPU machine)")
    try:
        build = imported_build(importlib.import_module("mooncake.engine"))
    except (ImportError, OSError) as exc:
        raise SystemExit(f"mooncake is not importable: {exc} (bench/mooncake_gpu_session.sh installs the CUDA build)")
    if args.kv_mac:
        kv_mac.offer_only([args.kv_mac])
    seed = random.randrange(1 << 30) if args.seed is None else args.seed
    print(f"seed {seed}; mooncake: {build}; KV MAC {kv_mac.algorithms()[0]}", flush=True)
    try:
        result = measure(args, seed)
    except UserError as exc:  # e.g. a GPU pool with the -non-cuda wheel: the engine says what to install
        raise SystemExit(f"error: {exc}")
    result.update(card=torch.cuda.get_device_name(device) if device.type == "cuda" else "cpu",
                  commit=args.commit or commit(), mooncake=str(build), device=args.device,
                  kv_mac=kv_mac.algorithms()[0])
    args.out.mkdir(parents=True, exist_ok=True)
    (args.out / "mooncake_gpu.json").write_text(json.dumps(result, indent=2))
    print()
    print(table(result), flush=True)
    return result


if __name__ == "__main__":
    main()

"""Serving on one GPU, end to end, in one unattended run: is PD serving as fast as its runner?

    python bench/serving_gpu.py --out $OUT [--profile] [--worker-args "--flag=value ..."]
    python bench/serving_gpu.py --tiny --out /tmp/x          # the same path on CPU, tiny shapes
    python bench/serving_gpu.py --tiny --out /tmp/x --parts serving     # only the serving levels

It answers all six targets of issue 7 in one run (`bash bench/serving_session.sh` on the device).
Steps, each timed, all inside a time budget (default 530 s):
1. a DeepSeek-V2-Lite-shaped checkpoint with random bf16 weights and the tiny tokenizer's
   vocabulary (`bench/random_checkpoint.py`, drawn on the GPU; reused when already there);
2. the runner alone at the workload's shapes, in its own process so its memory is back before
   the workers start (`bench/runner_steps.py`): one-prompt prefill at the c=1 workload's exact
   prompt lengths, and the CUDA-graph decode step at each benchmarked concurrency;
2b. the transfer parts, each in its own process with its own cap (`bench/target_parts.py`): the
   gRPC KV transfer GPU pool -> GPU pool vs raw gRPC, Mooncake TCP vs raw Mooncake (in a network
   namespace where `unshare -n` works), and layer-wise PD TTFT for an 8k prompt on this checkpoint;
   they leave `serving_min_s` of the budget to the serving levels, and say what they skipped;
3. `deepseek-pd up --prefill 1 --decode 1 --kv-transport grpc` with the GPU worker flags;
4. `deepseek-pd bench serving --url` random 1024/128 (prompts 512..1024, exactly 128 output
   tokens, ignore_eos) at each concurrency after a warm-up; request counts shrink (whole waves) if
   the remaining budget cannot fit them; with --profile, py-spy records the decode and the
   prefill worker for 10 s during the c=64 run;
5. the serving table (per concurrency, then the checks of `bench/serving_report.py`), then, last,
   ONE table of the six targets (`bench/targets_table.py`: value, target, ratio, PASS/MISS, the
   commit), serving_gpu.json (commit, date, shapes, flags, every number, each part's JSON),
   targets.txt and serving_gpu.png under --out;
6. with `--parts prefill_only,decode_only` (not in the default run: a device call has room for one
   of the two sets), issue 25's loads apart on the same cluster (`bench/solo_levels.py`): 1024-token
   prompts with 1 output token against the runner's round of them, and 32-token prompts with 1,024
   output tokens at c=64 and c=128 against the runner's graph step there; their table (value,
   runner, ratio, target, PASS/MISS, card, commit) comes last, and in solo_targets.txt.
"""
from __future__ import annotations

import argparse
import datetime
import json
import shlex
import subprocess
import sys
import time
from dataclasses import asdict, dataclass, field
from pathlib import Path

BENCH = Path(__file__).resolve().parent
REPO = BENCH.parent
sys.path.insert(0, str(BENCH))

from serving_report import Checks, ceilings, evaluate, format_table, level_row, write_plot  # noqa: E402
from solo_levels import NAMES as SOLO_NAMES, SoloLoads, format_solo_targets, solo_checks  # noqa: E402
import worker_metrics  # noqa: E402
from target_parts import GPU_PARTS, NAMES, TINY_PARTS, Part, run_parts  # noqa: E402
from targets_table import format_targets, target_rows  # noqa: E402

PARTS = ("serving", *SOLO_NAMES, *NAMES)
LEVEL_PARTS = {"serving", *SOLO_NAMES}  # the parts that need the runner alone and `up`


@dataclass(frozen=True)
class Plan:
    shape: str  # bench/random_checkpoint.py --shape
    device: str
    dtype: str
    page_size: int
    cuda_graph: bool
    backend: str  # attention and MoE backend, runner and workers alike
    num_pages: int  # worker KV pool (0: leave the flag out)
    input_len: int = 1024
    output_len: int = 128
    range_ratio: float = 0.5  # prompts in [input_len * (1 - ratio), input_len]
    levels: tuple[tuple[int, int], ...] = ((1, 24), (16, 64), (64, 256), (128, 384))  # (concurrency, requests)
    warmup: tuple[int, int] = (16, 32)
    solo: SoloLoads = field(default_factory=SoloLoads)  # the prefill-only and decode-only loads
    checks: Checks = field(default_factory=Checks)
    runner_steps: int = 32
    budget_s: float = 530.0
    parts: tuple[Part, ...] = GPU_PARTS
    serving_min_s: float = 200.0  # kept for up and the levels while the transfer parts run
    startup_timeout_s: float = 300.0
    profile_level: int = 64
    profile_delay_s: float = 8.0  # into the profiled run, so the decode batch is full
    profile_seconds: int = 10


GPU = Plan("v2-lite", "cuda", "bfloat16", 64, True, "triton", 0)  # pools sized by up (--mem-fraction-static)
TINY = Plan("v2-mini", "cpu", "float32", 16, False, "auto", 1024, input_len=64, output_len=8,
            levels=((1, 4), (2, 8), (4, 8), (8, 16)), warmup=(2, 2), runner_steps=4,
            checks=Checks(tpot_level=4, throughput_targets=((4, 4000.0), (8, 6000.0))), budget_s=420.0,
            solo=SoloLoads(prefill_len=64, prefill_rounds=3, decode_input_len=8, decode_output_len=32,
                           decode_levels=((4, 4), (8, 8))),
            parts=TINY_PARTS, serving_min_s=120.0,
            startup_timeout_s=180.0, profile_level=8, profile_delay_s=0.2, profile_seconds=3)
# V2-Lite's two shared experts fused into the routed MoE: the workers and the runner alone alike.
FUSED_SHARED_EXPERTS = 2
RESERVE_S = 45.0  # kept back for stopping the cluster and writing the report


def worker_flags(plan: Plan, extra: list[str]) -> list[str]:
    flags = [f"--device={plan.device}", f"--dtype={plan.dtype}", f"--page-size={plan.page_size}",
             f"--engine-opt=attention_backend={plan.backend}", f"--engine-opt=moe_backend={plan.backend}",
             f"--engine-opt=num_fused_shared_experts={FUSED_SHARED_EXPERTS}",
             # The decode batch cap must reach the highest concurrency.
             f"--engine-opt=max_running_requests={max(c for c, _ in (*plan.levels, *plan.solo.decode_levels))}"]
    if plan.num_pages:
        flags.append(f"--num-pages={plan.num_pages}")
    # CUDA graphs: on by default for the decode worker on CUDA, never captured by the prefill worker.
    return flags + extra  # later flags win, so --worker-args can override any of the above


def git_commit() -> dict:
    def git(*args: str) -> str:
        return subprocess.run(["git", "-C", str(REPO), *args], capture_output=True, text=True,
                              timeout=10, check=True).stdout.strip()
    try:
        return {"commit": git("rev-parse", "HEAD"), "dirty": bool(git("status", "--porcelain"))}
    except (OSError, subprocess.SubprocessError):
        return {"commit": "unknown", "dirty": None}


class Budget:
    def __init__(self, total_s: float) -> None:
        self.start, self.total_s = time.monotonic(), total_s

    def elapsed(self) -> float:
        return time.monotonic() - self.start

    def left(self) -> float:
        return self.total_s - self.elapsed() - RESERVE_S


def run_step(name: str, argv: list[str], timeout_s: float, log: Path) -> tuple[bool, float, str]:
    """Runs a child to completion; (ok, seconds, last lines of its output)."""
    t0 = time.monotonic()
    print(f"[{name}] {' '.join(argv)}", flush=True)
    with log.open("w") as out:
        try:
            rc = subprocess.run(argv, stdout=out, stderr=subprocess.STDOUT,
                                timeout=max(timeout_s, 1)).returncode
        except subprocess.TimeoutExpired:
            rc = None
    tail = "\n".join(log.read_text(errors="replace").splitlines()[-15:])
    ok = rc == 0
    if not ok:
        print(f"[{name}] {'timed out' if rc is None else f'exit {rc}'}; last lines:\n{tail}", flush=True)
    return ok, time.monotonic() - t0, tail


def level_seed(base: int, index: int) -> int:
    return base + 1000 * (index + 1)  # fresh prompts per level: no prefix-cache hits across levels


def c1_prompt_lengths(plan: Plan, vocab: int, n: int, seed: int) -> list[int]:
    """The prompt lengths `bench serving` will send at c=1 (same spec, same seed, same vocab)."""
    from deepseek_pd.loadgen.workload import WorkloadSpec, build_requests

    spec = WorkloadSpec(n, "random", plan.input_len, plan.output_len, plan.range_ratio, seed,
                        output_range_ratio=0.0)
    return [len(r.input_ids) for r in build_requests(spec, vocab)]


def bench_argv(url: str, plan: Plan, concurrency: int, requests: int, seed: int, out: Path,
               admin_key_file: Path, fixed: tuple[int, int] | None = None) -> list[str]:
    """The mixed workload's `bench serving`, or with `fixed` (input, output) exactly those lengths."""
    shape = (["--dataset", "fixed", "--input-len", str(fixed[0]), "--output-len", str(fixed[1])] if fixed else
             ["--dataset", "random", "--input-len", str(plan.input_len), "--range-ratio", str(plan.range_ratio),
              "--output-len", str(plan.output_len)])
    return [sys.executable, "-m", "deepseek_pd.cli", "bench", "serving", "--url", url,
            "--admin-key-file", str(admin_key_file), *shape, "--output-range-ratio", "0",
            "--num-prompts", str(requests), "--max-concurrency", str(concurrency), "--seed", str(seed),
            "--no-progress", "--output-json", str(out.with_suffix(".json")),
            "--output-png", str(out.with_suffix(".png"))]


def fit_requests(concurrency: int, wanted: int, left_s: float, previous: dict | None, output_len: int) -> int:
    """Whole waves of `concurrency` that the budget still fits, judged by the previous level's
    throughput (a higher concurrency is not slower per token, so this errs on the safe side)."""
    if previous is None or not previous["output_tok_s"]:
        return wanted
    ttft_s = (previous["ttft_p99_ms"] or 0.0) / 1e3
    fits = int((left_s - ttft_s) * previous["output_tok_s"] / output_len)
    return min(wanted, fits // concurrency * concurrency)


def profile_workers(up, plan: Plan, out_dir: Path, notes: list[str]) -> list[tuple[str, Path, object]]:
    from pyspy_profile import pyspy_binary, start_recording

    if pyspy_binary() is None:
        notes.append("--profile: py-spy is not installed; no profile recorded")
        return []
    out_dir.mkdir(parents=True, exist_ok=True)
    started = []
    for name, pid in sorted(up.worker_pids().items()):
        path = out_dir / f"{name}.speedscope.json"
        started.append((name, path, start_recording(pid, path, plan.profile_seconds)))
    return started


def finish_profiles(started, notes: list[str]) -> dict:
    from pyspy_profile import summarize

    result = {}
    for name, path, proc in started:
        if proc is None:
            continue
        try:
            proc.wait(timeout=60)
        except subprocess.TimeoutExpired:
            proc.kill()
        if path.exists():
            result[name] = {"file": str(path), **summarize(path)}
        else:
            log = path.with_suffix(".log")
            notes.append(f"py-spy on {name} wrote nothing: {log.read_text(errors='replace')[-300:]!r}")
    return result


def run_level(name: str, argv: list[str], stem: Path, budget: Budget, urls: list[str], notes: list[str]
              ) -> tuple[dict, dict] | None:
    """One `bench serving` run: (its JSON, the workers' own metrics over it), or None (noted)."""
    before = worker_metrics.scrape(urls)
    run_step(name, argv, budget.left(), stem.with_suffix(".log"))
    if not stem.with_suffix(".json").exists():
        notes.append(f"{name}: bench serving wrote no result (see {stem}.log)")
        return None
    level = json.loads(stem.with_suffix(".json").read_text())
    return level, worker_metrics.breakdown(before, worker_metrics.scrape(urls))


def solo_levels(url: str, plan: Plan, flags: list[str], seed: int, levels_dir: Path, key_file: Path,
                urls: list[str], budget: Budget, parts: set[str], result: dict) -> None:
    """The prefill-only and decode-only loads (bench/solo_levels.py) that `parts` names, on the
    running cluster; each skipped, and noted, when the budget cannot fit it."""
    loads, notes, solo = plan.solo, result["notes"], result["solo"]
    shapes = []
    if "prefill_only" in parts:
        concurrency, requests = loads.prefill_load(prefill_round_tokens(flags, plan.device))
        shapes.append(("prefill_only", concurrency, requests, (loads.prefill_len, 1)))
    if "decode_only" in parts:
        shapes += [("decode_only", c, n, (loads.decode_input_len, loads.decode_output_len))
                   for c, n in loads.decode_levels]
    steps = {d["batch"]: d["step_ms"] for d in (result["runner"] or {}).get("decode_only", [])}
    for index, (kind, concurrency, requests, fixed) in enumerate(shapes):
        # A decode-only wave takes its output length in steps of about the runner's (x2 for safety).
        needs = 2 * fixed[1] * steps.get(concurrency, 0) / 1e3 * -(-requests // concurrency) + 10
        if budget.left() < needs:
            notes.append(f"{kind} c={concurrency} skipped: {budget.left():.0f}s left, about {needs:.0f}s needed")
            continue
        name, stem = f"{kind} c={concurrency}", levels_dir / f"{kind}-c{concurrency}"
        argv = bench_argv(url, plan, concurrency, requests, level_seed(seed, 100 + index), stem, key_file, fixed)
        measured = run_level(name, argv, stem, budget, urls, notes)
        if measured is None:
            continue
        level, workers = measured
        row = {**level_row(concurrency, level["summary"]), "json": str(stem.with_suffix(".json")), "workers": workers}
        if kind == "prefill_only":
            solo["prefill_only"] = row
        else:
            solo["decode_only"][concurrency] = row
        print(f"[{name}] the workers' own metrics (means):\n{worker_metrics.describe(workers)}", flush=True)
        print(f"[{name}] {json.dumps(row)}", flush=True)


def serve_levels(plan: Plan, model_dir: Path, out: Path, flags: list[str], profile: bool, seed: int,
                 budget: Budget, result: dict, parts: set[str]) -> None:
    from up_process import UpProcess, UpSpec

    notes, rows, levels_dir = result["notes"], result["levels"], out / "levels"
    levels_dir.mkdir(parents=True, exist_ok=True)
    spec = UpSpec(model_dir, out / "logs", tuple(flags),
                  startup_timeout_s=min(plan.startup_timeout_s, max(budget.left(), 10)))
    t0 = time.monotonic()
    up = UpProcess(spec)
    try:
        url = up.start()
        result["phases"]["startup_s"] = time.monotonic() - t0
        print(f"[up] ready at {url} after {result['phases']['startup_s']:.1f}s", flush=True)
        c, n = plan.warmup
        ok, secs, _ = run_step("warmup", bench_argv(url, plan, c, n, seed, levels_dir / "warmup", up.control_plane_key_file),
                               budget.left(), levels_dir / "warmup.log")
        result["phases"]["warmup_s"] = secs
        for index, (concurrency, wanted) in enumerate(plan.levels if "serving" in parts else ()):
            n = fit_requests(concurrency, wanted, budget.left(), rows[-1] if rows else None, plan.output_len)
            if n < concurrency:
                notes.append(f"c={concurrency} skipped: {budget.left():.0f}s left in the budget")
                continue
            if n < wanted:
                notes.append(f"c={concurrency}: {n} requests instead of {wanted} (time budget)")
            stem = levels_dir / f"c{concurrency}"
            argv = bench_argv(url, plan, concurrency, n, level_seed(seed, index), stem,
                              up.control_plane_key_file)
            urls = worker_metrics.metrics_urls(spec.log_dir)
            before = worker_metrics.scrape(urls)
            if profile and concurrency == plan.profile_level:
                child = subprocess.Popen(argv, stdout=stem.with_suffix(".log").open("w"),
                                         stderr=subprocess.STDOUT)
                time.sleep(plan.profile_delay_s)
                started = profile_workers(up, plan, out / "profile", notes)
                try:
                    child.wait(timeout=max(budget.left(), 1))
                except subprocess.TimeoutExpired:
                    child.kill()
                    child.wait()
                result["profile"] = finish_profiles(started, notes)
            else:
                run_step(f"c={concurrency}", argv, budget.left(), stem.with_suffix(".log"))
            if not stem.with_suffix(".json").exists():
                notes.append(f"c={concurrency}: bench serving wrote no result (see {stem}.log)")
                continue
            level = json.loads(stem.with_suffix(".json").read_text())
            workers = worker_metrics.breakdown(before, worker_metrics.scrape(urls))
            rows.append({**level_row(concurrency, level["summary"]), "json": str(stem.with_suffix(".json")),
                         "workers": workers})
            print(f"[c={concurrency}] the workers' own metrics (means):\n{worker_metrics.describe(workers)}", flush=True)
            if index == 0:
                result["c1_prompt_lengths_sent"] = sorted(r["prompt_len"] for r in level["requests"])
            print(f"[c={concurrency}] {json.dumps(rows[-1])}", flush=True)
        solo_levels(url, plan, flags, seed, levels_dir, up.control_plane_key_file,
                    worker_metrics.metrics_urls(spec.log_dir), budget, parts, result)
    except RuntimeError as exc:  # up did not start: report what there is
        notes.append(str(exc)[-2000:])
    finally:
        up.stop()


def versions() -> dict:
    from importlib import metadata

    found = {}
    for name in ("deepseek-pd", "smg", "smg-grpc-proto", "grpcio", "torch", "triton"):
        try:
            found[name] = metadata.version(name)
        except metadata.PackageNotFoundError:
            found[name] = None
    return found


def prefill_round_tokens(flags: list[str], device: str) -> int:
    """The prefill worker's chunked_prefill_size: `serve`'s own reading of `flags` on `device`
    (--chunked-prefill-size, else the device's default; workers/serve/resolution.py)."""
    from deepseek_pd.commands import serve
    from deepseek_pd.workers.serve.resolution import chunked_prefill_size

    parser = argparse.ArgumentParser(add_help=False)
    serve.register(parser.add_subparsers())
    args, _ = parser.parse_known_args(["serve", "prefill", *flags])
    return chunked_prefill_size(serve.flags_from_args(args), device)


def measure_runner(plan: Plan, model_dir: Path, out: Path, seed: int, budget: Budget, result: dict,
                   flags: list[str], parts: set[str]) -> None:
    """Step 2, in a child process; the c=1 workload's prompt lengths are computed here, exactly."""
    from random_checkpoint import num_parameters

    config = json.loads((model_dir / "config.json").read_text())
    result["meta"]["shapes"] = {**config, "parameters": num_parameters(config)}
    lengths = c1_prompt_lengths(plan, config["vocab_size"], plan.levels[0][1], level_seed(seed, 0))
    result["c1_prompt_lengths_planned"] = sorted(lengths)
    runner_json = out / "runner_steps.json"
    argv = [sys.executable, str(BENCH / "runner_steps.py"), "--model", str(model_dir),
            "--device", plan.device, "--dtype", plan.dtype, "--page-size", str(plan.page_size),
            "--backend", plan.backend, "--num-fused-shared-experts", str(FUSED_SHARED_EXPERTS),
            "--prefill-lengths", ",".join(map(str, lengths)),
            "--batches", ",".join(str(c) for c, _ in plan.levels),
            "--context-min", str(int(plan.input_len * (1 - plan.range_ratio))),
            "--context-max", str(plan.input_len), "--decode-offset", str(plan.output_len // 2),
            "--steps", str(plan.runner_steps), "--prefill-round-tokens", str(prefill_round_tokens(flags, plan.device)),
            "--out", str(runner_json)]
    if "prefill_only" in parts:
        argv += ["--prefill-only-len", str(plan.solo.prefill_len)]
    if "decode_only" in parts:
        argv += ["--decode-only-context", str(plan.solo.decode_context),
                 "--decode-only-batches", ",".join(str(c) for c, _ in plan.solo.decode_levels)]
    if plan.cuda_graph:
        argv.append("--cuda-graph")
    ok, secs, _ = run_step("runner", argv, min(budget.left(), 300), out / "runner_steps.log")
    result["phases"]["runner_s"] = secs
    if ok:
        result["runner"] = json.loads(runner_json.read_text())
    else:
        result["notes"].append("the runner-alone measurement failed (see runner_steps.log)")


def parse_args() -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", type=Path, required=True, help="results directory")
    parser.add_argument("--tiny", action="store_true",
                        help="CPU, tiny shapes, small counts (a check of the script itself)")
    parser.add_argument("--profile", action="store_true", help="py-spy the workers during one level's run")
    parser.add_argument("--profile-level", type=int, default=None,
                        help="the concurrency level --profile records (default 64; 8 with --tiny)")
    parser.add_argument("--worker-args", default="",
                        help="extra `deepseek-pd serve` flags as one string; they override the defaults")
    parser.add_argument("--num-pages", type=int, default=None,
                        help="worker KV pages (default 2048; 0 leaves --num-pages out)")
    parser.add_argument("--levels", default=None,
                        help="concurrency:requests,... (default 1:24,16:64,64:256,128:384)")
    parser.add_argument("--budget-s", type=float, default=None, help="wall-clock budget of the whole run")
    parser.add_argument("--model-dir", type=Path, default=None,
                        help="checkpoint directory (written unless it already holds this checkpoint)")
    parser.add_argument("--parts", default=",".join(("serving", *NAMES)),
                        help=f"comma-separated, of {','.join(PARTS)} (default: issue 7's six targets, "
                             f"serving and {','.join(NAMES)}; {','.join(SOLO_NAMES)}: issue 25's loads apart, "
                             f"bench/solo_levels.py)")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--commit", default=None,
                        help="commit to record when the copy has no .git (default: git rev-parse HEAD)")
    args = parser.parse_args()
    args.parts = {p.strip() for p in args.parts.split(",") if p.strip()}
    if not args.parts or args.parts - set(PARTS):
        parser.error(f"--parts {sorted(args.parts)}: a non-empty subset of {','.join(PARTS)}")
    if args.profile_level is not None and not args.profile:
        parser.error("--profile-level goes with --profile")
    return args


def plan_from_args(args: argparse.Namespace) -> Plan:
    fields = dict((TINY if args.tiny else GPU).__dict__)
    if args.num_pages is not None:
        fields["num_pages"] = args.num_pages
    if args.levels:
        fields["levels"] = tuple(tuple(int(x) for x in item.split(":")) for item in args.levels.split(","))
    if args.budget_s is not None:
        fields["budget_s"] = args.budget_s
    if args.profile_level is not None:
        fields["profile_level"] = args.profile_level
    return Plan(**fields)


def report(plan: Plan, out: Path, result: dict, tiny: bool, budget: Budget) -> tuple[str, str, str]:
    """(the serving table, issue 7's targets, the loads apart: each "" when not run), also under `out`."""
    sent, planned = result.get("c1_prompt_lengths_sent"), result.get("c1_prompt_lengths_planned")
    if sent is not None and sent != planned:
        result["notes"].append("c=1 sent other prompt lengths than the runner timed: "
                               "the TTFT check is approximate")
    serving = "serving" in result["meta"]["parts"]
    result["checks"] = evaluate(result["levels"], result["runner"], plan.checks)  # all n/a without levels
    result["ceilings"] = ceilings(result["levels"], result["runner"])
    missing = {**{p: "not in --parts" for p in PARTS if p not in result["meta"]["parts"]}, **result["skipped"]}
    result["targets"] = target_rows(result["checks"], result["parts"], missing)
    result["phases"]["total_s"] = budget.elapsed()
    title = f"{plan.shape} random, {plan.device}, 1P1D grpc, random {plan.input_len}/{plan.output_len}"
    plot_note = (write_plot(out / "serving_gpu.png", result["levels"], result["runner"], title)
                 if result["levels"] else "no serving level ran: no PNG written")
    if plot_note:
        result["notes"].append(plot_note)
    (out / "serving_gpu.json").write_text(json.dumps(result, indent=2))
    note = "tiny CPU run: the targets are the H200's, PASS/MISS here mean nothing" if tiny else ""
    table = format_table(result["levels"], result["checks"], result["runner"], note) if serving else ""
    (out / "table.txt").write_text(table + "\n")
    meta = result["meta"]
    commit = meta["commit"] + (" (uncommitted changes)" if meta["dirty"] else "")
    card = (result["runner"] or {}).get("device_name")
    targets = format_targets(result["targets"], commit, note, card)
    (out / "targets.txt").write_text(targets + "\n")
    solo = ""
    if set(SOLO_NAMES) & set(result["meta"]["parts"]):
        kinds = [kind for kind in SOLO_NAMES if kind in result["meta"]["parts"]]
        result["solo_checks"] = solo_checks(result["solo"], result["runner"], plan.solo, kinds)
        solo = format_solo_targets(result["solo_checks"], card or "unknown", commit, note)
        (out / "solo_targets.txt").write_text(solo + "\n")
        (out / "serving_gpu.json").write_text(json.dumps(result, indent=2))
    return table, targets, solo


def all_measured(parts: set[str], result: dict) -> bool:
    """The exit code's question: did every part in `parts` give its figures? The mixed levels when
    "serving" is named, each check of the loads apart that ran, each transfer part's JSON."""
    levels_ran = ("serving" not in parts or bool(result["levels"])) and all(
        c["value"] is not None for c in result.get("solo_checks", []))
    return levels_ran and set(result["parts"]) == parts - LEVEL_PARTS


def main() -> int:
    args = parse_args()
    try:
        import deepseek_pd.cli  # noqa: F401
    except ImportError:
        sys.exit("deepseek_pd is not importable: install it first "
                 "(source bench/gpu_setup.sh, or pip install -e .)")
    plan = plan_from_args(args)
    budget = Budget(plan.budget_s)
    out = args.out
    out.mkdir(parents=True, exist_ok=True)
    model_dir = args.model_dir or Path(f"/tmp/deepseek-pd-bench/{plan.shape}-random")
    flags = worker_flags(plan, shlex.split(args.worker_args))
    now = datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds")
    commit = {"commit": args.commit, "dirty": None} if args.commit else git_commit()
    result: dict = {"meta": {**commit, "date": now, "mode": "tiny-cpu" if args.tiny else "gpu",
                             "argv": sys.argv[1:], "versions": versions(), "plan": asdict(plan),
                             "worker_flags": flags, "model_dir": str(model_dir), "parts": sorted(args.parts)},
                    "phases": {}, "runner": None, "levels": [], "parts": {}, "skipped": {}, "notes": [],
                    "solo": {"prefill_only": None, "decode_only": {}}}
    argv = [sys.executable, str(BENCH / "random_checkpoint.py"), str(model_dir), "--shape", plan.shape,
            "--device", plan.device, "--seed", str(args.seed)]
    ok, secs, _ = run_step("checkpoint", argv, budget.left(), out / "checkpoint.log")
    result["phases"]["checkpoint_s"] = secs
    serving = bool(LEVEL_PARTS & args.parts)  # the runner alone and `up`
    if ok:
        if serving:
            measure_runner(plan, model_dir, out, args.seed, budget, result, flags, args.parts)
        keep = plan.serving_min_s if serving else 0.0
        t0 = time.monotonic()
        result["parts"] = run_parts(plan.parts, args.parts, model_dir, out / "parts", lambda: budget.left() - keep,
                                    run_step, result["notes"], result["skipped"])
        result["phases"]["parts_s"] = time.monotonic() - t0
        if serving:
            serve_levels(plan, model_dir, out, flags, args.profile, args.seed, budget, result, args.parts)
    else:
        result["notes"].append("writing the checkpoint failed (see checkpoint.log)")
    table, targets, solo = report(plan, out, result, args.tiny, budget)
    for line in result["notes"]:
        print(f"note: {line}")
    phases = ", ".join(f"{k} {v:.0f}s" for k, v in result["phases"].items() if k != "total_s")
    print(f"commit {result['meta']['commit']}, {now}, total {result['phases']['total_s']:.0f}s ({phases})")
    print("\n".join(text for text in (table, targets, solo) if text), flush=True)
    return 0 if all_measured(args.parts, result) else 1


if __name__ == "__main__":
    sys.exit(main())

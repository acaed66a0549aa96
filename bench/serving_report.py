"""The serving benchmark's verdict: one table per run, the issue's ratios with PASS/MISS, a plot.

Rows come from `bench serving` summaries (one per concurrency); the checks set serving against
the runner alone, measured in the same run (`bench/runner_steps.py`):

| check | target |
|---|---|
| TPOT p50 at c=64 / runner decode step at batch 64 | <= 1.3 (the serving loop adds at most 30%) |
| output tok/s at c=64 | >= 4000 |
| output tok/s at c=128 | >= 6000 |
| TTFT p50 at c=1 - runner prefill of one prompt (ms) | <= 15 (router + transfer + scheduling) |

The concurrencies are parameters (`Checks`), so a tiny CPU run exercises the same code at its
own levels; its PASS/MISS mean nothing, and the table says so.

Each level also gets its one-GPU ceiling (`ceilings`): with prefill and decode on one GPU, every
prompt token is computed and every output token decoded there, so at the runner's own rates
output X tok/s takes X * (in/out) / prefill_round_tok_s + X * step_ms(c) / c / 1000 GPU-seconds a
second, at most 1. `in/out` is the level's measured input/output token ratio, `prefill_round_tok_s`
the runner's rate on one prefill worker round, `step_ms(c)` its decode step at batch c. Serving
above the ceiling is impossible; a target above it needs faster kernels, not a faster serving path.
"""
from __future__ import annotations

import sys
from dataclasses import dataclass
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
from target_check import check as _check  # noqa: E402


@dataclass(frozen=True)
class Checks:
    tpot_level: int = 64
    throughput_targets: tuple[tuple[int, float], ...] = ((64, 4000.0), (128, 6000.0))
    ttft_level: int = 1
    tpot_ratio_max: float = 1.3
    ttft_overhead_ms_max: float = 15.0


def level_row(concurrency: int, summary: dict) -> dict:
    return {"concurrency": concurrency, "requests": summary["num_requests"], "failed": summary["failed"],
            "req_s": summary["request_throughput"], "output_tok_s": summary["output_throughput"],
            "input_tok_s": summary["input_throughput"],
            "ttft_p50_ms": summary["ttft_ms"]["p50"], "ttft_p99_ms": summary["ttft_ms"]["p99"],
            "tpot_p50_ms": summary["tpot_ms"]["p50"], "itl_p50_ms": summary["itl_ms"]["p50"],
            "duration_s": summary["duration_s"]}


def evaluate(rows: list[dict], runner: dict | None, checks: Checks = Checks()) -> list[dict]:
    by_level = {row["concurrency"]: row for row in rows}
    steps = {d["batch"]: d["step_ms"] for d in (runner or {}).get("decode", [])}
    prefill = (runner or {}).get("prefill_ms_median")
    c = checks.tpot_level
    tpot = by_level.get(c, {}).get("tpot_p50_ms")
    ratio = tpot / steps[c] if tpot is not None and steps.get(c) else None
    out = [_check(f"TPOT p50 @c={c} / runner step @bs{c}", ratio, "<=", checks.tpot_ratio_max)]
    for level, target in checks.throughput_targets:
        throughput = by_level.get(level, {}).get("output_tok_s")
        out.append(_check(f"output tok/s @c={level}", throughput, ">=", target))
    ttft = by_level.get(checks.ttft_level, {}).get("ttft_p50_ms")
    overhead = ttft - prefill if ttft is not None and prefill is not None else None
    out.append(_check(f"TTFT p50 @c={checks.ttft_level} - runner prefill (ms)", overhead, "<=",
                      checks.ttft_overhead_ms_max))
    return out


def ceilings(rows: list[dict], runner: dict | None) -> list[dict]:
    """Per level with a runner step at its batch: the one-GPU output ceiling (module docstring), the
    GPU shares of prefill and decode at that ceiling, and the level's throughput as a fraction of it."""
    steps = {d["batch"]: d["step_ms"] for d in (runner or {}).get("decode", [])}
    round_tok_s = ((runner or {}).get("prefill_round") or {}).get("tok_s")
    out = []
    for row in rows:
        c, step_ms = row["concurrency"], steps.get(row["concurrency"])
        if not (round_tok_s and step_ms and row.get("output_tok_s") and row.get("input_tok_s") is not None):
            continue
        prefill_s = row["input_tok_s"] / row["output_tok_s"] / round_tok_s  # GPU-seconds per output token
        decode_s = step_ms / 1e3 / c
        ceiling = 1.0 / (prefill_s + decode_s)
        out.append({"concurrency": c, "ceiling_tok_s": ceiling, "prefill_share": prefill_s * ceiling,
                    "decode_share": decode_s * ceiling, "of_ceiling": row["output_tok_s"] / ceiling})
    return out


def _fmt(value: float | None, width: int, digits: int = 1) -> str:
    return f"{'-':>{width}}" if value is None else f"{value:>{width}.{digits}f}"


def format_table(rows: list[dict], verdicts: list[dict], runner: dict | None, note: str = "") -> str:
    lines = [f"{'conc':>5} {'reqs':>5} {'fail':>4} {'req/s':>7} {'out tok/s':>10} {'TTFT p50':>9} "
             f"{'TTFT p99':>9} {'TPOT p50':>9} {'runner step':>11}   (ms)"]
    steps = {d["batch"]: d["step_ms"] for d in (runner or {}).get("decode", [])}
    for row in rows:
        lines.append(f"{row['concurrency']:>5} {row['requests']:>5} {row['failed']:>4} "
                     f"{_fmt(row['req_s'], 7, 2)} {_fmt(row['output_tok_s'], 10)} "
                     f"{_fmt(row['ttft_p50_ms'], 9)} {_fmt(row['ttft_p99_ms'], 9)} {_fmt(row['tpot_p50_ms'], 9, 2)} "
                     f"{_fmt(steps.get(row['concurrency']), 11, 2)}")
    if runner:
        lines.append(f"runner: prefill of one prompt {runner['prefill_ms_median']:.2f} ms (median over "
                     f"{len(runner['prefill'])} lengths); decode step " +
                     ", ".join(f"bs{d['batch']} {d['step_ms']:.2f} ms" for d in runner["decode"]))
        prefill_round = runner.get("prefill_round")
        if prefill_round:
            lines.append(f"runner: a prefill round of {prefill_round['tokens']} tokens "
                         f"({len(prefill_round['lengths'])} prompts) {prefill_round['ms']:.2f} ms, "
                         f"{prefill_round['tok_s']:.0f} tok/s")
    lines += prefill_worker_lines(rows, runner)
    for cap in ceilings(rows, runner):
        lines.append(f"one-GPU ceiling @c={cap['concurrency']}: {cap['ceiling_tok_s']:.0f} out tok/s "
                     f"(prefill {cap['prefill_share']:.0%} + decode {cap['decode_share']:.0%} of the GPU); "
                     f"serving at {cap['of_ceiling']:.2f} of it")
    lines.append(f"{'check':<44} {'value':>10} {'target':>9}  result")
    for v in verdicts:
        lines.append(f"{v['check']:<44} {_fmt(v['value'], 10, 2)} {v['target']:>9}  {v['result']}")
    if note:
        lines.append(note)
    return "\n".join(lines)


def _prefill_worker(row: dict) -> dict | None:
    """The prefill worker's metrics of a level row (bench/worker_metrics.py breakdown), if any."""
    return next((w for name, w in sorted((row.get("workers") or {}).items())
                 if name.startswith("prefill") and "prefill_step_ms" in w), None)


def prefill_worker_lines(rows: list[dict], runner: dict | None) -> list[str]:
    """Per level, the prefill worker's own step (p50 and mean, from its metrics) against the
    runner's (issue 25): at c=1 against the runner's prefill of one prompt of the same lengths, at
    higher levels per token against the runner's prefill round; then where the round's mean went."""
    lines = []
    one = (runner or {}).get("prefill_ms_median")
    round_tok_s = ((runner or {}).get("prefill_round") or {}).get("tok_s")
    for row in rows:
        worker = _prefill_worker(row)
        if worker is None:
            continue
        mean, p50, tokens = worker["prefill_step_ms"], worker.get("prefill_step_p50_ms"), worker.get(
            "prefill_tokens_per_step", 0.0)
        line = (f"prefill worker @c={row['concurrency']}: step p50 ~{_fmt(p50, 0)} ms, mean {mean:.1f} ms, "
                f"{tokens:.0f} tokens a round")
        if row["concurrency"] == 1 and one:
            line += f"; / runner prefill {one:.1f} ms: p50 {_ratio(p50, one)}, mean {_ratio(mean, one)}"
        elif round_tok_s and tokens:
            rate = tokens / mean * 1e3
            line += f"; {rate:.0f} tok/s (by the mean) = {rate / round_tok_s:.2f} of the runner's round"
        lines.append(line)
        if worker.get("prefill_phases_ms"):
            lines.append("  round (means, ms): " + ", ".join(f"{k} {v:.1f}" for k, v in worker["prefill_phases_ms"].items())
                         + f"; unattributed {worker.get('prefill_unattributed_ms', 0.0):.1f}")
        if worker.get("prefill_request_phases_ms"):  # (its TTFT here: until the handshake, the first token, the done)
            lines.append("  request (means, ms): " + ", ".join(
                f"{k} {v:.1f}" for k, v in worker["prefill_request_phases_ms"].items()))
    return lines


def _ratio(value: float | None, reference: float) -> str:
    return "-" if value is None else f"{value / reference:.2f}x"


def write_plot(path, rows: list[dict], runner: dict | None, title: str) -> str | None:
    """A PNG of throughput, TTFT and TPOT against concurrency; returns a note when skipped."""
    try:
        import matplotlib
    except ImportError:
        return "matplotlib is not importable: no PNG written"
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    conc = [r["concurrency"] for r in rows]
    fig, axes = plt.subplots(1, 3, figsize=(15, 4.5))
    axes[0].plot(conc, [r["output_tok_s"] for r in rows], "o-", label="serving")
    if runner:
        points = [(d["batch"], d["tok_s"]) for d in runner["decode"]]
        axes[0].plot([b for b, _ in points], [t for _, t in points], "s--", label="runner alone")
    axes[0].set(title="output tok/s", xlabel="concurrency (runner: batch)", xscale="log")
    axes[0].legend()
    axes[1].plot(conc, [r["ttft_p50_ms"] for r in rows], "o-", label="p50")
    axes[1].plot(conc, [r["ttft_p99_ms"] for r in rows], "o--", label="p99")
    if runner:
        axes[1].axhline(runner["prefill_ms_median"], color="gray", ls=":", label="runner prefill")
    axes[1].set(title="TTFT (ms)", xlabel="concurrency", xscale="log", yscale="log")
    axes[1].legend()
    axes[2].plot(conc, [r["tpot_p50_ms"] for r in rows], "o-", label="TPOT p50")
    if runner:
        axes[2].plot([d["batch"] for d in runner["decode"]], [d["step_ms"] for d in runner["decode"]], "s--",
                     label="runner step")
    axes[2].set(title="per-token time (ms)", xlabel="concurrency", xscale="log")
    axes[2].legend()
    for ax in axes:
        ax.set_xticks(conc, [str(c) for c in conc])
        ax.minorticks_off()
    fig.suptitle(title)
    fig.tight_layout()
    fig.savefig(path, dpi=100)
    plt.close(fig)
    return None

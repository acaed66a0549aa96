"""Each worker against its own runner, apart from the sharing: the prefill-only and decode-only loads.

The mixed levels (random 1024/128) measure 1P1D as a whole, with prefill and decode taking turns
on one GPU. These two loads leave one worker nearly idle, so each ratio is one worker's own
efficiency (issue 25's targets), read against the runner alone in the same run
(`bench/runner_steps.py`):

| load | requests | value | against the runner's | target |
|---|---|---|---|---|
| prefill-only | 1024-token prompts, 1 output token | input tok/s | prefill rate at the worker's round size, rounds of 1024-token prompts (`prefill_only_round`) | >= 0.9 |
| decode-only | 32-token prompts, 1,024 output tokens, c=64 and c=128 | TPOT p50 | graph step at that batch, every context 32 + 512 (the load's mean; `decode_only`) | <= 1.1 |

`SoloLoads` holds the shapes (a tiny CPU run uses its own), `solo_checks` the verdicts (each a
`bench/target_check.py` check of the ratio, with the two figures it divides), `format_solo_targets`
the table: value, the runner's figure, ratio, target, PASS/MISS, under the card's name and the commit.
"""
from __future__ import annotations

import sys
from dataclasses import dataclass
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
from target_check import check as _check  # noqa: E402

NAMES = ("prefill_only", "decode_only")  # serving_gpu.py --parts


@dataclass(frozen=True)
class SoloLoads:
    prefill_len: int = 1024
    prefill_rounds: int = 12  # requests: this many full rounds of the prefill worker
    decode_input_len: int = 32
    decode_output_len: int = 1024
    decode_levels: tuple[tuple[int, int], ...] = ((64, 64), (128, 128))  # (concurrency, requests): one wave
    prefill_ratio_min: float = 0.9
    decode_ratio_max: float = 1.1

    def prefill_load(self, round_tokens: int) -> tuple[int, int]:
        """(concurrency, requests) of the prefill-only load for a worker of `round_tokens` per round:
        two rounds of prompts in flight, so the worker never waits for the next; `prefill_rounds`
        rounds in all. Example: 8192-token rounds of 1024-token prompts -> (16, 96)."""
        per_round = max(1, round_tokens // self.prefill_len)
        return 2 * per_round, self.prefill_rounds * per_round

    @property
    def decode_context(self) -> int:
        """The decode-only load's mean context over its output: the runner times its step there."""
        return self.decode_input_len + self.decode_output_len // 2


def prefill_label(loads: SoloLoads) -> str:
    return f"prefill-only {loads.prefill_len}/1: input tok/s / runner round"


def decode_label(concurrency: int) -> str:
    return f"decode-only @c={concurrency}: TPOT p50 / runner graph step @bs{concurrency}"


def solo_checks(rows: dict, runner: dict | None, loads: SoloLoads, kinds=NAMES) -> list[dict]:
    """`rows`: {"prefill_only": level row or None, "decode_only": {concurrency: level row}} (rows as
    `serving_report.level_row` makes them). One check per target of the loads in `kinds`, n/a
    where a figure is missing."""
    runner = runner or {}
    out = []
    if "prefill_only" in kinds:
        out.append(_prefill_check(rows.get("prefill_only"), runner, loads))
    if "decode_only" in kinds:
        out += _decode_checks(rows.get("decode_only", {}), runner, loads)
    return out


def _prefill_check(prefill_row: dict | None, runner: dict, loads: SoloLoads) -> dict:
    measured = prefill_row.get("input_tok_s") if prefill_row else None
    reference = (runner.get("prefill_only_round") or {}).get("tok_s")
    ratio = measured / reference if measured is not None and reference else None
    # Whether the worker's rounds were as full as the runner's: a ratio below target with thin
    # rounds points at admission (handshakes, pages), not at the forward.
    workers = (prefill_row or {}).get("workers") or {}
    worker_round = next((w.get("prefill_tokens_per_step") for name, w in sorted(workers.items())
                         if name.startswith("prefill")), None)
    return {**_check(prefill_label(loads), ratio, ">=", loads.prefill_ratio_min),
            "measured": measured, "reference": reference, "unit": "tok/s",
            "worker_round_tokens": worker_round,
            "runner_round_tokens": (runner.get("prefill_only_round") or {}).get("tokens")}


def _decode_checks(rows: dict, runner: dict, loads: SoloLoads) -> list[dict]:
    steps = {d["batch"]: d["step_ms"] for d in runner.get("decode_only", [])}
    out = []
    for concurrency, _ in loads.decode_levels:
        row = rows.get(concurrency)
        measured = row.get("tpot_p50_ms") if row else None
        reference = steps.get(concurrency)
        ratio = measured / reference if measured is not None and reference else None
        out.append({**_check(decode_label(concurrency), ratio, "<=", loads.decode_ratio_max),
                    "measured": measured, "reference": reference, "unit": "ms"})
    return out


def _fmt(value: float | None, width: int, digits: int) -> str:
    return f"{'-':>{width}}" if value is None else f"{value:>{width}.{digits}f}"


def format_solo_targets(checks: list[dict], card: str, commit: str, note: str = "") -> str:
    """The loads-apart table; "value" is the serving figure, "runner" what it is divided by."""
    lines = [f"issue 25 loads apart, card {card}, commit {commit}; ratio = value / runner",
             f"{'what':<58} {'value':>10} {'runner':>10} {'ratio':>7} {'target':>8}  result"]
    for c in checks:
        digits = 0 if c["unit"] == "tok/s" else 2
        lines.append(f"{c['check']:<58} {_fmt(c['measured'], 10, digits)} {_fmt(c['reference'], 10, digits)} "
                     f"{_fmt(c['value'], 7, 2)} {c['target']:>8}  {c['result']}")
    for c in checks:
        if c.get("worker_round_tokens") is not None:
            lines.append(f"prefill-only rounds: the worker's averaged {c['worker_round_tokens']:.0f} tokens, "
                         f"the runner's {c['runner_round_tokens']}")
    if note:
        lines.append(note)
    return "\n".join(lines)

"""Issue 7's six targets in one table: the serving checks and the three transfer parts of one run.

Rows, in the issue's order (the serving checks count output tok/s at two levels, so 7 lines):

| row | from |
|---|---|
| TPOT p50 @c=64 / runner step, output tok/s @c=64 and @c=128, TTFT p50 @c=1 - runner prefill | `bench/serving_report.py` |
| gRPC KV, GPU pool -> GPU pool (GB/s) | `bench/kv_transfer.py --json` (part kv_transfer) |
| Mooncake TCP, ours / raw | `bench/kv_transfer.py --transport mooncake --json` (part mooncake) |
| layer-wise PD TTFT / prefill compute | `bench/layerwise_ttft.py --json` (part layerwise) |

Every row is a check of `bench/target_check.py`; "ratio" is value / target, so a "<=" row passes
at ratio <= 1 and a ">=" row at ratio >= 1. The TTFT row's value is the overhead over the
runner's prefill against the 15 ms allowance, so its ratio is overhead / 15 ms (below 0 when
serving beat the runner's own timing). A row that was not measured keeps its place, with the
reason in the result column.
"""
from __future__ import annotations

import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
from target_parts import NAMES  # noqa: E402

SERVING_ROWS = 4
_PART_LABELS = {"kv_transfer": "gRPC KV, GPU pool -> GPU pool (GB/s)", "mooncake": "Mooncake TCP: ours / raw",
                "layerwise": "layer-wise PD TTFT / prefill compute"}


def target_rows(serving_checks: list[dict], parts: dict[str, dict], missing: dict[str, str]) -> list[dict]:
    """The serving checks (`serving_report.evaluate`, n/a where not measured), then one row per
    part of NAMES: its JSON's check, or an n/a row; `missing` says why, by part ("serving" too)."""
    if len(serving_checks) != SERVING_ROWS:
        raise ValueError(f"{len(serving_checks)} serving checks; serving_report.evaluate gives {SERVING_ROWS}")
    rows = [dict(c) for c in serving_checks]
    for name in NAMES:
        if name in parts:
            rows.append({**parts[name]["check"], "part": name})
        else:
            rows.append({"check": _PART_LABELS[name], "value": None, "result": "n/a", "part": name,
                         "why": missing.get(name, "not run")})
    for row in rows:
        if row["value"] is None:
            row.setdefault("why", missing.get(row.get("part", "serving"), "not measured"))
        limit = row.get("limit")
        row["ratio"] = row["value"] / limit if row["value"] is not None and limit else None
    return rows


def format_targets(rows: list[dict], commit: str, note: str = "", card: str | None = None) -> str:
    """`card`: the GPU's name (the runner's), named in the header when known."""
    on = f", card {card}" if card else ""
    lines = [f"issue 7 targets, commit {commit}{on}; ratio = value / target",
             f"{'what':<58} {'value':>10} {'target':>9} {'ratio':>7}  result"]
    for row in rows:
        if row["value"] is None:
            lines.append(f"{row['check']:<58} {'-':>10} {row.get('target', '-'):>9} {'-':>7}  "
                         f"{row['result']} ({row['why']})")
        else:
            lines.append(f"{row['check']:<58} {row['value']:>10.3f} {row['target']:>9} {row['ratio']:>7.2f}  "
                         f"{row['result']}")
    if note:
        lines.append(note)
    return "\n".join(lines)

"""One target check as every bench script reports it, so one table can hold them all.

A check is a dict: {"check": what was measured, "value": the number (None when not measured),
"op": "<=" or ">=", "limit": the target, "target": "<= 1.3" for display, "result": PASS, MISS
or n/a}. Example: check("TPOT p50 @c=64 / runner step @bs64", 1.37, "<=", 1.3) -> result MISS.
`bench/serving_report.py`, `bench/kv_transfer.py --json` and `bench/layerwise_ttft.py --json`
write them; `bench/targets_table.py` merges them into issue 7's six rows.
"""
from __future__ import annotations

import operator

_COMPARE = {"<=": operator.le, ">=": operator.ge}


def check(name: str, value: float | None, op: str, limit: float) -> dict:
    if op not in _COMPARE:
        raise ValueError(f"op {op!r}: one of {sorted(_COMPARE)}")
    status = "n/a" if value is None else ("PASS" if _COMPARE[op](value, limit) else "MISS")
    return {"check": name, "value": value, "op": op, "limit": limit, "target": f"{op} {limit:g}", "result": status}

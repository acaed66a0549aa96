"""`bench/gc_pauses.py` on the small shape: it builds the module tree, times full collections,
and what it froze leaves the collector (its own tracked-object counts are the check)."""
from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

REPO = Path(__file__).resolve().parents[2]


def test_the_script_reports_the_heap_it_froze(tmp_path: Path) -> None:
    out = tmp_path / "gc.json"
    proc = subprocess.run([sys.executable, str(REPO / "bench" / "gc_pauses.py"), "--shape", "v2-mini",
                           "--repeats", "2", "--out", str(out)], capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stderr[-3000:]
    result = json.loads(out.read_text())
    before, after = result["before_freeze"], result["after_freeze"]
    assert result["frozen_objects"] >= before["tracked_objects"] - 10 > 10_000
    assert after["tracked_objects"] < 100 and before["median_ms"] > 0 and after["median_ms"] >= 0

"""`bench/kv_mac_finish.py --tiny`: on both sides the tag built as the sends go (prefill) and land
(decode) equals the one-shot tag, and after the last send only a digest is left at `finish` and at
decode's check (the bench's own timings; the exit status says whether the tags were equal)."""
from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

REPO = Path(__file__).resolve().parents[2]


def test_the_script_reports_both_sides_with_only_a_digest_left(tmp_path: Path) -> None:
    out = tmp_path / "kv_mac.json"
    proc = subprocess.run([sys.executable, str(REPO / "bench" / "kv_mac_finish.py"), "--tiny", "--json", str(out)],
                          capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    result = json.loads(out.read_text())
    decode = result["decode"]
    assert result["tags_equal"] and result["layerwise"] and result["tokens"] == 1024
    # A digest is far below a read of the prompt's KV, on either side (1 MB of 9.4 MB read at least).
    assert result["finish_ms"] < result["one_shot_ms"] / 10 and decode["check_ms"] < decode["one_shot_ms"] / 10

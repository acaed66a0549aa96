"""bench/owed_session.sh: every part names scripts and tests that exist, and a wrong part is refused.

The owed GPU runs are kept for a later session's device time; a renamed script or test would only
show there, minutes into a call. The dry run prints each step's command without running it.
"""
from __future__ import annotations

import re
import subprocess
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[2]
SCRIPT = REPO / "bench" / "owed_session.sh"


def _dry_run(*args: str) -> subprocess.CompletedProcess:
    return subprocess.run(["bash", str(SCRIPT), "--dry-run", *args], cwd=REPO, capture_output=True,
                          text=True, timeout=30)


@pytest.mark.parametrize("part", ["A", "B", "C", "D", "E"])
def test_each_part_names_paths_that_exist(part: str) -> None:
    done = _dry_run(part)
    assert done.returncode == 0, done.stderr
    steps = [line for line in done.stdout.splitlines() if line.startswith("== ")]
    assert steps, done.stdout
    paths = re.findall(r"(?:bench|tests|scripts)/[\w/.-]+\.(?:sh|py)", done.stdout)
    assert paths, done.stdout
    missing = [path for path in paths if not (REPO / path).is_file()]
    assert not missing, f"part {part} names missing files: {missing}"


def test_an_unknown_part_is_refused_with_usage() -> None:
    done = _dry_run("F")
    assert done.returncode == 2 and "usage" in done.stdout

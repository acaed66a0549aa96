"""Where a run's time went, by test folder (pytest plugin, loaded by tests/conftest.py): the end of
a run with more than one folder prints each folder's setup + call + teardown seconds, largest
first, beside pytest's 15 slowest tests. The suite has a 30-minute bar on two cores (issue 19);
this line in CI's output says which folder to make cheaper.

    time by folder (s): tests/workers 401, tests/k8s 297, tests/operator 180, ...
"""
from __future__ import annotations

from collections import defaultdict
from typing import Any

import pytest

_SECONDS: dict[str, float] = defaultdict(float)  # folder -> seconds, this test process


def folder_of(nodeid: str) -> str:
    """'tests/workers/common/test_x.py::test_y' -> 'tests/workers'; a top-level file is 'tests'."""
    parts = nodeid.split("::", 1)[0].split("/")
    return "/".join(parts[:2]) if len(parts) > 2 else parts[0] if len(parts) > 1 else "."


def pytest_runtest_logreport(report: pytest.TestReport) -> None:
    _SECONDS[folder_of(report.nodeid)] += getattr(report, "duration", 0.0) or 0.0


@pytest.hookimpl(trylast=True)
def pytest_terminal_summary(terminalreporter: Any) -> None:
    if len(_SECONDS) > 1:
        ranked = sorted(_SECONDS.items(), key=lambda kv: -kv[1])
        terminalreporter.write_line("time by folder (s): " + ", ".join(f"{k} {v:.0f}" for k, v in ranked))

"""On a failed e2e test, the tail of every process log of the module's cluster goes into the report.

A module that runs a `LocalCluster` marks it with `pytest.mark.usefixtures("cluster_logs_on_failure")`
and provides a `cluster` fixture: a worker that died mid-test (an h2 error at the gateway) otherwise
leaves nothing to read once the temporary directory is gone.
"""
from __future__ import annotations

import pytest

LOG_TAIL_LINES = 60


@pytest.hookimpl(wrapper=True)
def pytest_runtest_makereport(item, call):
    report = yield
    setattr(item, f"report_{report.when}", report)
    return report


@pytest.fixture
def cluster_logs_on_failure(request, cluster):
    yield
    report = getattr(request.node, "report_call", None)
    if report is None or not report.failed:
        return
    for process in cluster.processes():
        path = process.log_path
        try:
            lines = path.read_text(errors="replace").splitlines()[-LOG_TAIL_LINES:]
        except OSError as error:
            lines = [f"(unreadable: {error})"]
        report.sections.append((f"log of {process.name} ({path})", "\n".join(lines)))

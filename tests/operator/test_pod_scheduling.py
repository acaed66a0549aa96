"""The Available condition names pods the scheduler cannot place (operator/pod_scheduling.py)."""
from __future__ import annotations

import random

from deepseek_pd.operator.pod_scheduling import REASON, explain_unavailable, unschedulable_pods


def _pod(name: str, scheduled: str, reason: str = "", message: str = "", deleting: bool = False) -> dict:
    meta = {"name": name, **({"deletionTimestamp": "2026-01-01T00:00:00Z"} if deleting else {})}
    return {"metadata": meta, "status": {"conditions": [
        {"type": "PodScheduled", "status": scheduled, "reason": reason, "message": message}]}}


def _status(available: str) -> dict:
    return {"phase": "Pending", "conditions": [
        {"type": "Available", "status": available, "reason": "GroupsUnavailable", "message": "x",
         "lastTransitionTime": "2026-01-01T00:00:00Z"},
        {"type": "Degraded", "status": "False", "reason": "AsExpected", "message": ""}]}


def test_unschedulable_pods_are_named_with_the_schedulers_message():
    gpus = random.randint(2, 64)
    message = f"0/3 nodes are available: 3 Insufficient nvidia.com/gpu ({gpus})."
    pods = [_pod("v3-prefill-0-1", "False", "Unschedulable", message),
            _pod("v3-prefill-0-0", "False", "Unschedulable", message),
            _pod("v3-decode-0-0", "True"),
            _pod("v3-decode-1-0", "False", "Unschedulable", "gone", deleting=True),
            _pod("v3-router-abc", "False", "SchedulerError", "other")]
    assert unschedulable_pods(pods) == [("v3-prefill-0-0", message), ("v3-prefill-0-1", message)]
    before = _status("False")
    after = explain_unavailable(before, pods)
    available = after["conditions"][0]
    assert available["reason"] == REASON and available["status"] == "False"
    assert available["message"] == f"2 pod(s) cannot be scheduled; v3-prefill-0-0: {message}"
    assert available["lastTransitionTime"] == before["conditions"][0]["lastTransitionTime"]
    assert after["conditions"][1] == before["conditions"][1] and before["conditions"][0]["reason"] == "GroupsUnavailable"


def test_nothing_changes_when_available_or_all_scheduled():
    stuck = [_pod("a-0", "False", "Unschedulable", "no nodes")]
    assert explain_unavailable(_status("True"), stuck) == _status("True")
    assert explain_unavailable(_status("False"), [_pod("a-0", "True")]) == _status("False")

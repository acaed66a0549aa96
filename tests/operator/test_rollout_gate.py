"""The verified-rollout gate in the live operator (kopf against the emulated API server), for each
role: a new group whose greedy tokens could not be checked (the emulator's pods have no IP, so no
worker answers) stays out of the router and out of the availability count, the rollout waits with
RolloutVerified False saying why, and `rolloutStrategy.verify: false` lets it go on. The check
itself, against real workers, is tests/operator/test_rollout_verify.py."""
from __future__ import annotations

import pytest
from leader_urls import router_worker_urls
from test_operator_kopf import _bring_up, _condition, _deployment, _full_pass, _revision, _start_pods, _statefulset

from deepseek_pd.operator import names

pytestmark = [pytest.mark.timeout(120)]


@pytest.mark.parametrize("role", names.ROLES)
def test_an_unchecked_new_group_neither_serves_nor_lets_the_rollout_continue(cluster, role):
    name = f"gate-{role}"
    body = _deployment(name)
    body["spec"][role]["replicas"] = 2
    cluster.create(body)
    _bring_up(cluster, name, {r: 2 if r == role else 1 for r in names.ROLES})
    old = _revision(_statefulset(cluster, name, role, 0))
    # A change of this role's pods alone: the other role does not roll.
    cluster.patch(names.KIND, name, {"spec": {role: {"resources": {"requests": {"cpu": "2", "memory": "2Gi"}}}}})

    def replaced() -> list[int]:
        return [i for i in range(2) if _revision(_statefulset(cluster, name, role, i)) not in (old, None)]

    [first] = cluster.wait_for("the first group replaced", replaced)
    sts = cluster.wait_for("its StatefulSet", lambda: _statefulset(cluster, name, role, first))
    cluster.wait_for("its old pods gone", lambda: names.pod_name(name, role, first, 0) not in cluster.names("Pod"))
    _start_pods(cluster, sts)  # ready on the new revision, but nobody can check its tokens
    condition = cluster.wait_for("RolloutVerified", lambda: _condition(cluster, name, "RolloutVerified")
                                 .get("reason") == "CheckFailed" and _condition(cluster, name, "RolloutVerified"))
    assert condition["status"] == "False" and f"checking {role} group {first}" in condition["message"], condition
    for _ in range(2):
        _full_pass(cluster, name)
        assert replaced() == [first]  # the other old group is not touched
        urls = router_worker_urls(cluster.get("Deployment", names.router_name(name)))[role]
        assert not any(names.group_name(name, role, first) in u for u in urls), urls  # not routed to

    cluster.patch(names.KIND, name, {"spec": {role: {"rolloutStrategy": {"verify": False}}}})
    cluster.wait_for("the second group replaced", lambda: len(replaced()) == 2)

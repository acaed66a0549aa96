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


def test_each_verified_group_and_each_stopped_rollout_is_one_event():
    """Over a random sequence of passes' status.rollout (groups verified one by one, a revision
    that fails, a new revision, the state removed when the rollout ends), every group verified
    under a revision gives exactly one GroupVerified Event and every failure one TokensDiffer,
    however often a pass repeats the same state."""
    import random

    from deepseek_pd.operator.rollout_reconcile import rollout_events

    rng = random.Random()
    passes: list[dict] = []
    expected: list[tuple[str, str, str]] = []  # (reason, role, revision/group) in order
    for revision in (f"r{k}" for k in range(rng.randint(2, 4))):
        role = rng.choice(names.ROLES)
        verified: list[int] = []
        for index in rng.sample(range(6), rng.randint(1, 4)):
            verified = sorted({*verified, index})
            passes += [{role: {"revision": revision, "verified": verified}}] * rng.randint(1, 3)
            expected.append(("GroupVerified", role, f"group {index} (revision {revision})"))
        if rng.random() < 0.5:
            failed = {"revision": revision, "verified": verified, "failed": f"{role} group 9 differs"}
            passes += [{role: failed}] * rng.randint(1, 3)
            expected.append(("TokensDiffer", role, f"{role} group 9 differs"))
        passes.append({role: None})  # the rollout ended: a merge patch removes it
    got = []
    before: dict = {}
    for after in passes:
        for type_, reason, message in rollout_events(before, after):
            assert type_ == ("Normal" if reason == "GroupVerified" else "Warning")
            got.append((reason, message))
        before = after
    assert len(got) == len(expected), (got, expected)
    for (reason, message), (want, role, part) in zip(got, expected):
        assert reason == want and message.startswith(f"rollout stopped: {role}" if want == "TokensDiffer" else role) \
            and part in message, (message, part)

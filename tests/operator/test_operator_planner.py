"""The pure planner and status: decisions checked against a simulated StatefulSet controller."""
from __future__ import annotations

import dataclasses
import random

import pytest

from deepseek_pd.operator.observed import GroupState, PodState, groups_of_role
from deepseek_pd.operator.planner import (
    CreateGroup, DeleteGroup, ReplaceGroup, RestartGroup, RoleTarget, plan_role,
)
from deepseek_pd.operator.status import RouterState, build_invalid_status, build_status

pytestmark = pytest.mark.timeout(60)


def _group(index: int, revision: str, size: int, ready: bool = True, failed_rank: int | None = None,
           restarts: int = 0) -> GroupState:
    pods = tuple(PodState(name=f"g{index}-{r}", rank=r, revision=revision,
                          phase="Failed" if r == failed_rank else "Running",
                          ready=ready and r != failed_rank, restarts=restarts if r == 0 else 0)
                 for r in range(size))
    return GroupState(index=index, revision=revision, terminating=False, pods=pods)


def _target(replicas: int, size: int = 2, revision: str = "new", surge: int = 0,
            unavailable: int = 1, gang: bool = True) -> RoleTarget:
    return RoleTarget("decode", replicas, size, revision, surge, unavailable, gang)


class FakeController:
    """Plays the StatefulSet controller: applies actions; groups become ready when told."""

    def __init__(self, groups: dict[int, GroupState], size: int) -> None:
        self.groups = dict(groups)
        self.size = size

    def apply(self, actions, revision: str) -> None:
        for action in actions:
            if isinstance(action, (CreateGroup, ReplaceGroup)):
                self.groups[action.index] = _group(action.index, revision, self.size, ready=False)
            elif isinstance(action, RestartGroup):
                old = self.groups[action.index]
                self.groups[action.index] = _group(action.index, old.revision, self.size, ready=False)
            elif isinstance(action, DeleteGroup):
                del self.groups[action.index]

    def become_ready(self, rng: random.Random) -> None:
        waiting = [i for i, g in self.groups.items() if not g.is_ready(self.size)]
        for index in rng.sample(waiting, k=rng.randint(1, len(waiting))) if waiting else []:
            self.groups[index] = _group(index, self.groups[index].revision, self.size)

    def ready_count(self) -> int:
        return sum(g.is_ready(self.size) for g in self.groups.values())


@pytest.mark.parametrize("trial", range(25))
def test_rollouts_keep_the_availability_floor_and_finish(trial):
    rng = random.Random()
    replicas = rng.randint(1, 6)
    surge, unavailable = rng.randint(0, 2), rng.randint(0, 2)
    if surge == unavailable == 0:
        unavailable = 1
    size = rng.randint(1, 3)
    target = _target(replicas, size, "new", surge, unavailable)
    sim = FakeController({i: _group(i, "old", size) for i in range(replicas)}, size)
    floor = replicas - unavailable
    for _ in range(200):
        plan = plan_role(target, sim.groups)
        sim.apply(plan.actions, target.revision)
        assert plan.serving == set(sim.groups)  # the router lists exactly the groups that exist
        assert sim.ready_count() >= min(floor, replicas), (plan.actions, sim.groups)
        assert len(sim.groups) <= replicas + surge
        if not plan.actions and plan.updated == plan.ready == replicas and not plan.rolling:
            break
        sim.become_ready(rng)
    else:
        pytest.fail("rollout never finished")
    assert sorted(sim.groups) == list(range(replicas))
    assert {g.revision for g in sim.groups.values()} == {"new"}


def test_default_strategy_replaces_exactly_one_ready_group():
    groups = {i: _group(i, "old", 2) for i in range(3)}
    plan = plan_role(_target(3), groups)
    assert plan.actions == (ReplaceGroup("decode", 0, "new revision"),)
    assert plan.rolling and plan.updated == 1 and plan.ready == 2  # group 0 goes down, comes back new


def test_broken_outdated_groups_are_replaced_first_without_budget():
    groups = {0: _group(0, "old", 2), 1: _group(1, "old", 2, ready=False), 2: _group(2, "old", 2)}
    plan = plan_role(_target(3, unavailable=1), groups)
    assert [a.index for a in plan.actions if isinstance(a, ReplaceGroup)] == [1]


def test_surge_creates_new_groups_first_and_retires_them():
    groups = {i: _group(i, "old", 1) for i in range(2)}
    target = _target(2, size=1, surge=1, unavailable=0)
    assert plan_role(target, groups).actions == (CreateGroup("decode", 2),)
    groups[2] = _group(2, "new", 1)
    assert plan_role(target, groups).actions == (ReplaceGroup("decode", 0, "new revision"),)
    done = {0: _group(0, "new", 1), 1: _group(1, "new", 1), 2: _group(2, "new", 1)}
    assert plan_role(target, done).actions == (DeleteGroup("decode", 2),)


def test_scaling_adds_and_removes_whole_groups_from_the_top():
    current = random.randint(1, 4)
    groups = {i: _group(i, "new", 2) for i in range(current)}
    up = random.randint(current + 1, 8)
    assert plan_role(_target(up), groups).actions == tuple(CreateGroup("decode", i) for i in range(current, up))
    down = random.randint(0, current - 1)
    assert plan_role(_target(down), groups).actions == \
        tuple(DeleteGroup("decode", i) for i in reversed(range(down, current)))


def test_router_stops_listing_retired_groups_but_keeps_replaced_ones():
    replicas = random.randint(1, 4)
    groups = {i: _group(i, "new", 2) for i in range(replicas + 2)}
    scaled_down = plan_role(_target(replicas), groups)
    assert scaled_down.serving == set(range(replicas))
    # Next pass: the retired groups are still terminating, a replaced group too (same index).
    replaced = random.randrange(replicas)
    for index in (replaced, replicas, replicas + 1):
        groups[index] = dataclasses.replace(groups[index], terminating=True)
    later = plan_role(_target(replicas), groups)
    assert later.serving == set(range(replicas))
    assert {replicas, replicas + 1} <= later.group_indices  # their Services stay until they are gone


@pytest.mark.parametrize("failure", ["phase", "restart"])
def test_a_failed_rank_restarts_its_whole_group(failure):
    size = random.randint(2, 4)
    bad = random.randrange(3)
    groups = {i: _group(i, "new", size) for i in range(3)}
    groups[bad] = _group(bad, "new", size, failed_rank=size - 1 if failure == "phase" else None,
                         restarts=1 if failure == "restart" else 0)
    plan = plan_role(_target(3, size), groups)
    assert [(type(a), a.index) for a in plan.actions] == [(RestartGroup, bad)]
    assert plan.restarted == (bad,)
    assert plan_role(_target(3, size, gang=False), groups).actions == ()


def test_observed_state_from_objects_ignores_terminating_pods():
    labels = {"deepseek-pd.io/role": "prefill", "deepseek-pd.io/group-index": "0",
              "deepseek-pd.io/revision": "r1"}
    sts = {"metadata": {"name": "x-prefill-0", "labels": labels,
                        "annotations": {"deepseek-pd.io/revision": "r1"}}}
    ready = {"phase": "Running", "conditions": [{"type": "Ready", "status": "True"}]}
    pods = [{"metadata": {"name": "x-prefill-0-0", "labels": {**labels, "apps.kubernetes.io/pod-index": "0"}},
             "status": ready},
            {"metadata": {"name": "x-prefill-0-1", "labels": labels, "deletionTimestamp": "now"},
             "status": {"phase": "Failed"}}]
    groups = groups_of_role("prefill", [sts], pods)
    assert list(groups) == [0] and [p.name for p in groups[0].pods] == ["x-prefill-0-0"]
    assert groups[0].is_ready(1) and not groups[0].is_ready(2)
    assert groups_of_role("decode", [sts], pods) == {}


def _status(plans, previous=None, router_ready=1):
    return build_status(plans, {r: "rev" for r in plans}, {r: p.replicas - 1 for r, p in plans.items()},
                        RouterState(1, router_ready, "http://r"), 3, previous or {}, "T1")


def test_status_phases_and_conditions():
    ready = {i: _group(i, "new", 1) for i in range(2)}
    full = {"prefill": plan_role(_target(2, 1), ready), "decode": plan_role(_target(2, 1), ready)}
    first = _status(full)
    assert first["phase"] == "Available" and first["observedGeneration"] == 3
    assert first["decode"] == {"replicas": 2, "readyReplicas": 2, "updatedReplicas": 2,
                               "ready": "2/2", "revision": "rev"}
    conditions = {c["type"]: c for c in first["conditions"]}
    assert conditions["Available"]["status"] == "True" and conditions["Degraded"]["status"] == "False"

    starting = {"prefill": plan_role(_target(2, 1), {}), "decode": plan_role(_target(2, 1), {})}
    assert _status(starting)["phase"] == "Pending"

    failed = dict(ready)
    failed[1] = _group(1, "new", 1, failed_rank=0)
    broken = {"prefill": full["prefill"], "decode": plan_role(_target(2, 1), failed)}
    later = build_status(broken, {"prefill": "rev", "decode": "rev"}, {"prefill": 1, "decode": 1},
                         RouterState(1, 1, "http://r"), 3, first, "T2")
    degraded = {c["type"]: c for c in later["conditions"]}["Degraded"]
    assert later["phase"] == "Degraded" and degraded["reason"] == "GroupRestarted"
    assert "decode group(s) [1]" in degraded["message"] and degraded["lastTransitionTime"] == "T2"
    available = {c["type"]: c for c in later["conditions"]}["Available"]
    assert available["lastTransitionTime"] == "T1"  # unchanged status keeps its transition time

    rolling = {"prefill": full["prefill"],
               "decode": plan_role(_target(2, 1, revision="newer"), ready)}
    assert _status(rolling, previous=first)["phase"] == "Progressing"
    assert _status(full, previous=first, router_ready=0)["phase"] == "Degraded"


def test_a_deployment_without_a_router_is_judged_by_its_groups_and_says_so():
    """router.replicas 0 (`make fuzz`, seed 12): the second pass of a start where nothing was ready
    yet read the first pass's Available=True (one replica, maxUnavailable 1: a floor of 0 groups,
    and no router to wait for) as "was up", and called the deployment Degraded."""
    def status(plans, previous=None):
        return build_status(plans, {r: "rev" for r in plans}, {r: p.replicas - 1 for r, p in plans.items()},
                            RouterState(0, 0, ""), 3, previous or {}, "T1")

    starting = {r: plan_role(_target(1, 1), {}) for r in ("prefill", "decode")}
    first = status(starting)
    second = status(starting, previous=first)
    assert first["phase"] == second["phase"] == "Pending", (first, second)
    available = {c["type"]: c for c in second["conditions"]}["Available"]
    assert available["status"] == "False" and "no router (router.replicas 0)" in available["message"]

    ready = {r: plan_role(_target(1, 1), {0: _group(0, "new", 1)}) for r in ("prefill", "decode")}
    up = status(ready, previous=second)
    conditions = {c["type"]: c for c in up["conditions"]}
    assert up["phase"] == "Available" and conditions["Available"]["status"] == "True"
    assert conditions["Degraded"]["status"] == "False" and "no router" in conditions["Available"]["message"]
    unready = {r: plan_role(_target(1, 1), {0: _group(0, "new", 1, ready=False)}) for r in ("prefill", "decode")}
    down = status(unready, previous=up)  # the groups stopped being ready: Degraded for them, not the router
    degraded = {c["type"]: c for c in down["conditions"]}["Degraded"]
    assert down["phase"] == "Degraded" and "router" not in degraded["message"], degraded


def test_invalid_status_names_the_field_and_keeps_availability():
    previous = _status({"decode": plan_role(_target(1, 1), {0: _group(0, "new", 1)})})
    status = build_invalid_status("spec.decode.size: 0 is less than the minimum of 1", 4, previous, "T9")
    conditions = {c["type"]: c for c in status["conditions"]}
    assert status["phase"] == "Failed" and status["observedGeneration"] == 4
    assert conditions["InvalidSpec"]["status"] == "True"
    assert "spec.decode.size" in conditions["InvalidSpec"]["message"]
    assert conditions["Available"]["status"] == "True"


def test_a_failed_outdated_group_is_replaced_not_restarted_and_uses_the_budget():
    groups = {i: _group(i, "old", 2) for i in range(3)}
    groups[2] = _group(2, "old", 2, restarts=1)  # restarted but still Ready: broken all the same
    plan = plan_role(_target(3, unavailable=1), groups)
    assert plan.actions == (ReplaceGroup("decode", 2, "pod g2-0 restarted"),)  # 2 of 3 stay up
    assert plan.restarted == (2,) and plan.ready == 2
    wider = plan_role(_target(3, unavailable=2), groups)
    assert wider.actions == (ReplaceGroup("decode", 2, "pod g2-0 restarted"),
                             ReplaceGroup("decode", 0, "new revision"))


def test_unverified_new_groups_do_not_serve_or_count_and_a_failed_check_stops_the_rollout():
    """Verified rollouts (rollout_reconcile.py): group 0 runs the new revision and is ready, but
    its greedy tokens are not checked yet; with maxUnavailable 1 of 3 the next old group may not go."""
    import dataclasses
    groups = {0: _group(0, "new", 2), 1: _group(1, "old", 2), 2: _group(2, "old", 2)}
    checked = dataclasses.replace(_target(3), unverified=frozenset({0}))
    plan = plan_role(checked, groups)
    assert 0 not in plan.serving and plan.serving == {1, 2}  # the router does not send to it yet
    assert not any(isinstance(a, ReplaceGroup) for a in plan.actions) and plan.ready == 2
    verified = plan_role(_target(3), groups)  # once it answered as the old revision
    assert 0 in verified.serving and [a.index for a in verified.actions if isinstance(a, ReplaceGroup)] == [1]
    failed = dataclasses.replace(_target(3, unavailable=2), unverified=frozenset({0}), verification_failed=True)
    plan = plan_role(failed, groups)  # even with budget to spare: nothing more is replaced
    assert not any(isinstance(a, ReplaceGroup) for a in plan.actions) and plan.serving == {1, 2}

"""A rollback after a stopped (or not yet checked) rollout: the spec goes back to the revision the
serving group runs, while the refused surge group of the left revision still exists. The serving
group is no new group to check, and the refused one, which never served, is no reference: no
check runs, the serving group stays in the router, and the planner retires the refused group.

Before the fix the verifier took the refused group for the "old" one, checked the serving group
against it, found the difference it had already found, and took the serving group out of the
router (every group of the role, with one replica: an outage until the refused group was gone).

RolloutVerifier.run and plan_role on observed objects, pass after pass, the workers faked by
their answers (the check against real workers: test_rollout_verify.py; on the control plane:
tests/k8s/test_verified_rollout_e2e.py rolls prefill back so)."""
from __future__ import annotations

import asyncio
import dataclasses
import pathlib
import random

import pytest
import yaml
from test_rollout_model_change import _objects

from deepseek_pd.operator import names
from deepseek_pd.operator.observed import groups_of_role
from deepseek_pd.operator.planner import DeleteGroup, plan_role
from deepseek_pd.operator.reconcile import role_target
from deepseek_pd.operator.rollout_reconcile import RolloutVerifier
from deepseek_pd.operator.rollout_verify import Mismatch
from deepseek_pd.operator.spec import DeploymentSpec

EXAMPLES = pathlib.Path(__file__).resolve().parents[2] / "examples"


def _spec(role: str) -> DeploymentSpec:
    raw = yaml.safe_load((EXAMPLES / "cpu-minimal.yaml").read_text())["spec"]
    raw[role].update(replicas=1, rolloutStrategy={"maxSurge": 1, "maxUnavailable": 0})
    return DeploymentSpec.parse("demo", "llm", raw)


@pytest.mark.parametrize("role", names.ROLES)
def test_a_rollback_keeps_the_serving_group_and_retires_the_refused_one_without_a_check(role):
    rng = random.Random()
    spec = _spec(role)
    ips = {0: f"10.0.0.{rng.randrange(1, 100)}", 1: f"10.0.1.{rng.randrange(1, 100)}"}
    statefulsets, pods = _objects(role, {0: "r0", 1: "r1"}, ips)
    if role == "prefill":  # the prefill check pairs with a ready decode group
        more = _objects("decode", {0: "d0"}, {0: f"10.0.2.{rng.randrange(1, 100)}"})
        statefulsets, pods = statefulsets + more[0], pods + more[1]
    checked = []

    async def check(*groups) -> Mismatch:  # the refused group answers differently, as it did
        checked.append(groups)
        return Mismatch(prompt=rng.randrange(4), position=rng.randrange(8), old=1, new=2)

    async def model_of(address: str) -> str:
        return "/models/tiny"

    verifier = RolloutVerifier(check=check, check_prefill=check, model_of=model_of)
    # The rollout to r1 left behind: stopped by a difference, or its group not checked yet.
    left = {"revision": "r1", "verified": []}
    if rng.random() < 0.5:
        left["failed"] = f"{role} group 1 (revision r1) differs from group 0: ..."
    previous = {"rollout": {role: left}}
    target = dataclasses.replace(role_target(spec, role), revision="r0")
    for _ in range(3):  # passes while the refused group is still there
        result = asyncio.run(verifier.run(spec, role, "r0", statefulsets, pods, previous))
        assert checked == [] and result.unverified == frozenset() and not result.failed, result
        assert result.condition[:2] == (True, "NotNeeded"), result
        assert result.state == left  # remembered while the refused group exists
        plan = plan_role(dataclasses.replace(target, unverified=result.unverified,
                                             verification_failed=result.failed),
                         groups_of_role(role, statefulsets, pods))
        assert plan.serving == {0} and DeleteGroup(role, 1) in plan.actions, plan
        previous = {"rollout": {role: result.state}}

    # Gone: nothing left to remember.
    keep = [o for o in statefulsets + pods if o["metadata"]["labels"][names.LABEL_GROUP_INDEX] == "0"]
    result = asyncio.run(verifier.run(spec, role, "r0", [o for o in keep if "annotations" in o["metadata"]],
                                      [o for o in keep if "status" in o], previous))
    assert result.state is None and result.condition[:2] == (True, "NotNeeded") and checked == [], result

    # A group of the left revision that passed its check did serve: it is compared as any old group.
    previous = {"rollout": {role: {"revision": "r1", "verified": [1]}}}
    result = asyncio.run(verifier.run(spec, role, "r0", statefulsets, pods, previous))
    assert len(checked) == 1 and result.condition[:2] == (False, "TokensDiffer"), result

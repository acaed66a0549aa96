"""Verified rollouts, per reconcile pass and role (the check itself: rollout_verify.py).

While groups of an older revision of a role are still ready (a rollout is under way), each ready
group of the current revision is checked once, before it is added to the router: decode, its
leader and an old-revision leader answer PROMPTS at the same time, over the pod IPs; prefill, the
old and then the new leader answer them as PD requests paired with one ready decode group (none
ready: CheckFailed, retried). One check per role per pass.

    status.rollout.<role>  {revision, verified: [group indices], failed: message or absent}
    RolloutVerified        True Verified / NotNeeded, False TokensDiffer (naming the prompt and
                           token) or CheckFailed (a call failed; retried next pass)

A rollback (the spec back to the revision the serving groups run, while groups of the rollout
it left still exist) checks nothing: a group of the left rollout that never passed its check never
served, so it is no reference (`_never_served`), and the planner retires it.

A different model on the two sides (GetModelInfo's model_path: another checkpoint or revision)
skips the check: new weights may change tokens legitimately. The RolloutVerified condition is the
worst of the two roles' (`combined_condition`); each outcome is also an Event
(`rollout_events`: Normal GroupVerified per group, Warning TokensDiffer once), so a rollout that
has completed, and whose status.rollout is gone, still says which groups were checked. `rolloutStrategy.verify: false`
turns it off. The planner (planner.RoleTarget.unverified / verification_failed) keeps unchecked
groups out of the router and out of the availability count, and stops replacing groups after a
difference, so the old groups keep serving.
"""
from __future__ import annotations

import asyncio
from dataclasses import dataclass, field
from typing import Any, Awaitable, Callable

from deepseek_pd.client.scheduler_grpc import SchedulerClient
from deepseek_pd.operator import names
from deepseek_pd.operator.observed import groups_of_role
from deepseek_pd.operator.rollout_verify import Mismatch, PrefillGroup, verify, verify_prefill
from deepseek_pd.operator.spec import DeploymentSpec

CONDITION = "RolloutVerified"


async def model_path(address: str) -> str:
    async with SchedulerClient(address) as client:
        return (await client.model_info()).model_path


@dataclass(frozen=True)
class Verification:
    unverified: frozenset[int]
    failed: bool
    state: dict[str, Any] | None                # status.rollout.<role>; None: no rollout to check
    condition: tuple[bool, str, str] | None      # (ok, reason, message); None: verify is off


# Worst first: the condition of a pass over both roles is the worst of theirs.
_SEVERITY = ("TokensDiffer", "CheckFailed", "Verified", "NotNeeded")


def combined_condition(checks: dict[str, Verification]) -> tuple[bool, str, str] | None:
    """RolloutVerified over both roles: the worst role's (ok, reason, message); None: verify is off."""
    conditions = [c.condition for c in checks.values() if c.condition is not None]
    return min(conditions, key=lambda c: _SEVERITY.index(c[1])) if conditions else None


def rollout_events(before: dict[str, Any], after: dict[str, Any]) -> list[tuple[str, str, str]]:
    """(type, reason, message) of the Events to post, from status.rollout of the previous and this
    pass: one per group newly verified, one per check newly failed."""
    events = []
    for role, state in sorted((after or {}).items()):
        if not state:
            continue
        old = (before or {}).get(role) or {}
        same = old.get("revision") == state.get("revision")
        for index in sorted(set(state.get("verified") or []) - set((old.get("verified") or []) if same else [])):
            events.append(("Normal", "GroupVerified",
                           f"{role} group {index} (revision {state['revision']}) answered the check's greedy "
                           "requests with the old revision's tokens; it joins the router"))
        if state.get("failed") and not (same and old.get("failed")):
            events.append(("Warning", "TokensDiffer", f"rollout stopped: {state['failed']}"))
    return events


def _never_served(state: dict[str, Any], revision: str, index: int, group_revision: str) -> bool:
    """Whether group `index` belongs to the rollout the spec has just left (`state`, the last
    pass's status.rollout.<role>, of another revision) and never passed its check: refused or
    not yet checked, it never joined the router, so it is no reference for the groups that
    serve. A rollback after a stopped rollout (the spec back to what the serving groups run) is
    then no rollout at all; before, the serving groups were checked against the refused group,
    "differed" from it and left the router. Only the rollout just left is remembered: once the
    spec moves on to a third revision with old groups to check, its record is replaced."""
    return (state.get("revision") not in (None, revision) and group_revision == state["revision"]
            and index not in (state.get("verified") or []))


@dataclass
class RolloutVerifier:
    check: Callable[[str, str], Awaitable[Mismatch | None]] = verify
    check_prefill: Callable[[PrefillGroup, PrefillGroup, str], Awaitable[Mismatch | None]] = verify_prefill
    model_of: Callable[[str], Awaitable[str]] = model_path
    _lock: asyncio.Lock = field(default_factory=asyncio.Lock)

    async def run(self, spec: DeploymentSpec, role_name: str, revision: str, statefulsets: list[dict],
                  pods: list[dict], previous: dict[str, Any]) -> Verification:
        role = spec.role(role_name)
        if not role.rollout.verify:
            return Verification(frozenset(), False, None, None)
        groups = {i: g for i, g in groups_of_role(role_name, statefulsets, pods).items() if not g.terminating}
        ready = {i for i, g in groups.items() if g.is_ready(role.size)}
        state = ((previous.get("rollout") or {}).get(role_name) or {})
        left = {i for i, g in groups.items() if _never_served(state, revision, i, g.revision)}
        old = sorted(i for i in ready - left if groups[i].revision != revision)
        new = {i for i in ready if groups[i].revision == revision}
        if not old:
            # The left rollout's record stays while its groups do (the planner retires them): a
            # pass that still sees one must not take it for a reference.
            return Verification(frozenset(), False, state if left else None, (True, "NotNeeded", "no rollout to check"))
        if state.get("revision") != revision:
            state = {"revision": revision, "verified": []}
        state = {**state, "verified": sorted(set(state["verified"]) & set(groups))}
        if state.get("failed"):
            return Verification(frozenset(new - set(state["verified"])), True, state,
                                (False, "TokensDiffer", state["failed"]))
        pending = sorted(new - set(state["verified"]))
        condition = (True, "Verified", f"{role_name} groups {state['verified']} answered as the old revision")
        if pending:
            index = pending[0]
            new_leader = self._leader(spec, role_name, pods, index)
            old_leader = self._leader(spec, role_name, pods, old[0])
            try:
                async with self._lock:
                    if new_leader and old_leader and \
                            await self.model_of(new_leader) != await self.model_of(old_leader):
                        result = None  # another checkpoint: its tokens may differ by design
                    elif not (new_leader and old_leader):
                        result = RuntimeError("no pod IP yet")
                    elif role_name == "decode":
                        result = await self.check(new_leader, old_leader)
                    else:
                        result = await self._check_prefill(spec, statefulsets, pods, new_leader, old_leader)
            except Exception as exc:  # noqa: BLE001 - a failed call is reported and retried
                result = exc
            if isinstance(result, Mismatch):
                state["failed"] = (f"{role_name} group {index} (revision {revision}) differs from group "
                                   f"{old[0]}: {result}")
                return Verification(frozenset(pending), True, state, (False, "TokensDiffer", state["failed"]))
            if isinstance(result, Exception):
                condition = (False, "CheckFailed", f"checking {role_name} group {index}: {result}")
            else:
                state["verified"] = sorted({*state["verified"], index})
        unverified = frozenset(new - set(state["verified"]))
        return Verification(unverified, False, state, condition)

    async def _check_prefill(self, spec: DeploymentSpec, statefulsets: list[dict], pods: list[dict],
                             new_leader: str, old_leader: str) -> Mismatch | None | Exception:
        decode = spec.role("decode")
        ready = sorted(i for i, g in groups_of_role("decode", statefulsets, pods).items()
                       if not g.terminating and g.is_ready(decode.size))
        decode_leader = self._leader(spec, "decode", pods, ready[0]) if ready else None
        if decode_leader is None:
            return RuntimeError("no ready decode group to pair the prefill groups with")

        def group(leader: str) -> PrefillGroup:
            return PrefillGroup(leader, leader.rsplit(":", 1)[0], spec.prefill.bootstrap_port)
        return await self.check_prefill(group(new_leader), group(old_leader), decode_leader)

    @staticmethod
    def _leader(spec: DeploymentSpec, role: str, pods: list[dict], index: int) -> str | None:
        for pod in pods:
            labels = pod["metadata"].get("labels") or {}
            if labels.get(names.LABEL_ROLE) == role and labels.get(names.LABEL_GROUP_INDEX) == str(index) \
                    and labels.get(names.LABEL_POD_INDEX, "0") == "0":
                ip = (pod.get("status") or {}).get("podIP")
                return f"{ip}:{spec.role(role).port}" if ip else None
        return None

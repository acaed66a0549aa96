"""Verified rollouts, per reconcile pass (the check itself: rollout_verify.py).

While decode groups of an older revision are still ready (a rollout is under way), each ready
group of the current revision is checked once, before it is added to the router: its leader and
an old-revision leader answer PROMPTS at the same time, over the pod IPs. One check per pass.

    status.rollout.decode  {revision, verified: [group indices], failed: message or absent}
    RolloutVerified        True Verified / NotNeeded, False TokensDiffer (naming the prompt and
                           token) or CheckFailed (a call failed; retried next pass)

A different model on the two sides (GetModelInfo's model_path: another checkpoint or revision)
skips the check: new weights may change tokens legitimately. `rolloutStrategy.verify: false`
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
from deepseek_pd.operator.rollout_verify import Mismatch, verify
from deepseek_pd.operator.spec import DeploymentSpec

ROLE = "decode"  # a prefill worker cannot answer a request alone
CONDITION = "RolloutVerified"


async def model_path(address: str) -> str:
    async with SchedulerClient(address) as client:
        return (await client.model_info()).model_path


@dataclass(frozen=True)
class Verification:
    unverified: frozenset[int]
    failed: bool
    state: dict[str, Any] | None                # status.rollout.decode; None: no rollout to check
    condition: tuple[bool, str, str] | None      # (ok, reason, message); None: verify is off


@dataclass
class RolloutVerifier:
    check: Callable[[str, str], Awaitable[Mismatch | None]] = verify
    model_of: Callable[[str], Awaitable[str]] = model_path
    _lock: asyncio.Lock = field(default_factory=asyncio.Lock)

    async def run(self, spec: DeploymentSpec, revision: str, statefulsets: list[dict], pods: list[dict],
                  previous: dict[str, Any]) -> Verification:
        role = spec.role(ROLE)
        if not role.rollout.verify:
            return Verification(frozenset(), False, None, None)
        groups = {i: g for i, g in groups_of_role(ROLE, statefulsets, pods).items() if not g.terminating}
        ready = {i for i, g in groups.items() if g.is_ready(role.size)}
        old = sorted(i for i in ready if groups[i].revision != revision)
        new = {i for i in ready if groups[i].revision == revision}
        if not old:
            return Verification(frozenset(), False, None, (True, "NotNeeded", "no rollout to check"))
        state = ((previous.get("rollout") or {}).get(ROLE) or {})
        if state.get("revision") != revision:
            state = {"revision": revision, "verified": []}
        state = {**state, "verified": sorted(set(state["verified"]) & set(groups))}
        if state.get("failed"):
            return Verification(frozenset(new - set(state["verified"])), True, state,
                                (False, "TokensDiffer", state["failed"]))
        pending = sorted(new - set(state["verified"]))
        condition = (True, "Verified", f"decode groups {state['verified']} answered as the old revision")
        if pending:
            index = pending[0]
            new_leader, old_leader = self._leader(spec, pods, index), self._leader(spec, pods, old[0])
            try:
                async with self._lock:
                    if new_leader and old_leader and \
                            await self.model_of(new_leader) != await self.model_of(old_leader):
                        result = None  # another checkpoint: its tokens may differ by design
                    else:
                        result = await self.check(new_leader, old_leader) if new_leader and old_leader \
                            else RuntimeError("no pod IP yet")
            except Exception as exc:  # noqa: BLE001 - a failed call is reported and retried
                result = exc
            if isinstance(result, Mismatch):
                state["failed"] = f"decode group {index} (revision {revision}) differs from group {old[0]}: {result}"
                return Verification(frozenset(pending), True, state, (False, "TokensDiffer", state["failed"]))
            if isinstance(result, Exception):
                condition = (False, "CheckFailed", f"checking decode group {index}: {result}")
            else:
                state["verified"] = sorted({*state["verified"], index})
        unverified = frozenset(new - set(state["verified"]))
        return Verification(unverified, False, state, condition)

    @staticmethod
    def _leader(spec: DeploymentSpec, pods: list[dict], index: int) -> str | None:
        for pod in pods:
            labels = pod["metadata"].get("labels") or {}
            if labels.get(names.LABEL_ROLE) == ROLE and labels.get(names.LABEL_GROUP_INDEX) == str(index) \
                    and labels.get(names.LABEL_POD_INDEX, "0") == "0":
                ip = (pod.get("status") or {}).get("podIP")
                return f"{ip}:{spec.decode.port}" if ip else None
        return None

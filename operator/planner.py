"""The pure planner: desired groups of a role vs the observed groups -> actions.

It decides, the executor applies (after LWS DisaggregatedSet's planner/executor). Every call is
level-triggered: it looks only at the current state, so a crash or a missed event is repaired by
the next call, and repeating a call while an action is in flight issues nothing new.

Rollout, worked example: replicas=3, maxUnavailable=1, maxSurge=0, image changed.
    pass 1: groups 0,1,2 ready, old revision   -> ReplaceGroup(0)          (3 - 1 >= 3 - 1)
    pass 2: group 0 recreated, not ready       -> nothing (2 available, cannot drop to 1)
    pass 3: group 0 ready on the new revision  -> ReplaceGroup(1)
With maxSurge=1 a new-revision group 3 is created first; once it is ready it lends its capacity,
and it is removed when groups 0..2 all run the new revision.
"""
from __future__ import annotations

from dataclasses import dataclass

from deepseek_pd.operator.observed import GroupState


@dataclass(frozen=True)
class RoleTarget:
    """The desired state of one role, resolved to numbers."""

    role: str
    replicas: int
    size: int
    revision: str
    max_surge: int
    max_unavailable: int
    recreate_group_on_restart: bool
    # Verified rollouts (rollout_verify.py): current-revision groups that are ready but whose
    # greedy tokens have not been checked yet count as not ready and do not serve; after a failed
    # check no further group is replaced.
    unverified: frozenset[int] = frozenset()
    verification_failed: bool = False


@dataclass(frozen=True)
class CreateGroup:
    role: str
    index: int


@dataclass(frozen=True)
class ReplaceGroup:
    """Delete the group's StatefulSet and pods, then create it from the current revision."""

    role: str
    index: int
    reason: str


@dataclass(frozen=True)
class RestartGroup:
    """Delete every pod of the group; its StatefulSet recreates them together (gang restart)."""

    role: str
    index: int
    reason: str


@dataclass(frozen=True)
class DeleteGroup:
    role: str
    index: int


Action = CreateGroup | ReplaceGroup | RestartGroup | DeleteGroup


@dataclass(frozen=True)
class RolePlan:
    actions: tuple[Action, ...]
    replicas: int          # desired groups
    ready: int             # ready groups among the desired indices
    updated: int           # desired indices running the current revision
    rolling: bool          # a rollout or a scale change is in flight
    restarted: tuple[int, ...]  # groups restarted in this pass because a pod failed
    group_indices: frozenset[int]  # groups that exist once the actions are applied (their Services)
    serving: frozenset[int]  # groups the router should send to: existing and not being retired


def plan_role(target: RoleTarget, groups: dict[int, GroupState]) -> RolePlan:
    replicas, revision = target.replicas, target.revision
    live = {i: g for i, g in groups.items() if not g.terminating}
    ready = {i for i, g in live.items() if g.is_ready(target.size)} - target.unverified
    outdated = sorted(i for i in range(replicas) if i in live and live[i].revision != revision)
    rolling = bool(outdated)
    actions: list[Action] = []
    after = set(groups)

    # Scale up, or bring back a group whose StatefulSet vanished. A terminating one is awaited.
    wanted = set(range(replicas))
    if rolling:  # surge groups run the new revision and lend capacity while old ones are replaced
        wanted |= set(range(replicas, replicas + target.max_surge))
    for index in sorted(wanted - set(groups)):
        actions.append(CreateGroup(target.role, index))
        after.add(index)

    # Scale down (and retire surge groups once the rollout is over): the highest indices go.
    # Surge groups stay until every regular group runs the new revision *and* is ready.
    settled = all(i in ready and live[i].revision == revision for i in range(replicas))
    surge_range = set(range(replicas, replicas + target.max_surge))
    keep = set(wanted)
    if not settled:
        keep |= {i for i in live if i in surge_range and live[i].revision == revision}
    for index in sorted(set(live) - keep, reverse=True):
        actions.append(DeleteGroup(target.role, index))
        ready.discard(index)
        after.discard(index)
    for index in sorted(set(live) & wanted - set(range(replicas))):
        if live[index].revision != revision:  # a surge group left over from an older rollout
            actions.append(ReplaceGroup(target.role, index, "surge group of an older revision"))
            ready.discard(index)

    # Gang semantics: one failed rank takes the whole group down and up again.
    # An outdated group is replaced rather than restarted: it has to move to the new revision anyway.
    restarted = []
    if target.recreate_group_on_restart:
        for index, group in sorted(live.items()):
            if index in keep and group.failed_pods:
                pod = group.failed_pods[0]
                why = f"pod {pod.name} {'failed' if pod.phase == 'Failed' else 'restarted'}"
                if index in outdated:
                    actions.append(ReplaceGroup(target.role, index, why))
                    outdated.remove(index)
                else:
                    actions.append(RestartGroup(target.role, index, why))
                ready.discard(index)
                restarted.append(index)

    # Rollout: replace outdated groups, broken ones first, without dropping below the floor.
    available = len(ready)
    floor = replicas - target.max_unavailable
    for index in sorted(outdated, key=lambda i: (i in ready, i)):
        if target.verification_failed:
            break  # the new revision answered differently: the old groups keep serving
        if index not in ready:
            actions.append(ReplaceGroup(target.role, index, "new revision (group not ready)"))
        elif available - 1 >= floor:
            actions.append(ReplaceGroup(target.role, index, "new revision"))
            ready.discard(index)
            available -= 1
        else:
            break

    in_range = range(replicas)
    renewed = {a.index for a in actions if isinstance(a, (CreateGroup, ReplaceGroup))}
    return RolePlan(
        actions=tuple(actions),
        replicas=replicas,
        ready=sum(1 for i in in_range if i in ready),
        # Groups created or replaced in this pass run the current revision from now on.
        updated=sum(1 for i in in_range if i in renewed or (i in live and live[i].revision == revision)),
        rolling=rolling or bool(keep ^ set(live)) or any(g.terminating for g in groups.values()),
        restarted=tuple(restarted),
        group_indices=frozenset(after),
        # A group replaced in place keeps its index (and leader DNS name), so it stays listed;
        # a retired one (scale-down, surge after the rollout) leaves the list in the same pass
        # its deletion starts, and a terminating one never comes back on a later pass.
        serving=frozenset(after & keep) - target.unverified,
    )

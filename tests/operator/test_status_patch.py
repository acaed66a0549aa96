"""The status merge patch (operator/status_patch.py) against RFC 7386's own merge algorithm: on
random nested statuses, the server's merge of the patch into the current status reads back as
the pass's status for every key the pass names, and other keys are left alone."""
from __future__ import annotations

import copy
import random
from typing import Any

from deepseek_pd.operator.status_patch import status_patch


def _merge(target: Any, patch: Any) -> Any:
    """RFC 7386 section 2, MergePatch(Target, Patch), as the API server applies it."""
    if not isinstance(patch, dict):
        return patch
    out = dict(target) if isinstance(target, dict) else {}
    for key, value in patch.items():
        if value is None:
            out.pop(key, None)
        else:
            out[key] = _merge(out.get(key), value)
    return out


def _value(rng: random.Random, depth: int) -> Any:
    kind = rng.randrange(4 if depth < 3 else 3)
    if kind == 0:
        return rng.choice(["r1", "r2", "prompt 0: token 2", ""])
    if kind == 1:
        return rng.randrange(3)
    if kind == 2:
        return [rng.randrange(3) for _ in range(rng.randrange(3))]
    return _object(rng, depth + 1)


def _object(rng: random.Random, depth: int = 0) -> dict:
    return {k: _value(rng, depth) for k in rng.sample("abcdef", rng.randrange(5))}


def test_the_merged_status_is_the_pass_status_for_the_keys_it_names(rng=random.Random()):
    for _ in range(300):
        current, desired = _object(rng), _object(rng)
        if rng.random() < 0.5:  # a near neighbour, as passes usually are
            desired = copy.deepcopy(current)
            desired.update(_object(rng, 1))
        merged = _merge(current, status_patch(current, desired))
        for key in set(current) | set(desired):
            assert merged.get(key) == (desired[key] if key in desired else current[key]), (current, desired, merged)
        assert status_patch(merged, desired) == {}  # steady state: nothing to send


def test_a_reset_rollout_state_drops_the_old_failure():
    current = {"phase": "Progressing", "rollout": {"decode": {"revision": "r2", "verified": [], "failed": "prompt 0"}}}
    desired = {"phase": "Progressing", "rollout": {"decode": {"revision": "r3", "verified": []}}}
    assert status_patch(current, desired) == {"rollout": {"decode": {"revision": "r3", "failed": None}}}

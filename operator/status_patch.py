"""The merge patch (RFC 7386) that writes a pass's status over the one the API server holds.

A merge patch merges objects key by key, so a nested key the new status no longer has stays on
the server unless the patch says `null` for it. The status is the operator's alone (handlers.py
writes all of it from one pass), so every key the pass names is written whole: nested keys it
dropped are nulled, lists are replaced. Keys the pass does not name at all are left alone.

    current  {"rollout": {"decode": {"revision": "r2", "verified": [], "failed": "prompt 0 ..."}}}
    desired  {"rollout": {"decode": {"revision": "r3", "verified": []}}}
    patch    {"rollout": {"decode": {"revision": "r3", "failed": None}}}

Without the None, a rollout stopped by a failed check stayed stopped after the spec was fixed:
the next revision's state was read back with the old `failed` (tests/k8s/test_verified_rollout_e2e.py).
"""
from __future__ import annotations

from typing import Any


def status_patch(current: dict[str, Any], desired: dict[str, Any]) -> dict[str, Any]:
    """What to send so that every key of `desired` reads back as `desired` holds it ({}: nothing)."""
    patch: dict[str, Any] = {}
    for key, want in desired.items():
        have = current.get(key)
        if isinstance(want, dict) and isinstance(have, dict):
            nested = _diff(have, want)
            if nested:
                patch[key] = nested
        elif have != want:
            patch[key] = want
    return patch


def _diff(have: dict[str, Any], want: dict[str, Any]) -> dict[str, Any]:
    out = {key: None for key in have if key not in want}
    out.update(status_patch(have, want))
    return out

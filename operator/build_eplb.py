"""EPLB's static placement in a worker pod: a role's `eplb.initExpertLocation` (a ConfigMap key)
mounted read-only and named to `serve --init-expert-location`.

Example: `decode.eplb.initExpertLocation: {configMapName: v3-placement, key: decode.json}` gives
every decode pod the volume `expert-location` (ConfigMap v3-placement, item decode.json ->
expert-location.json), mounted at /etc/deepseek-pd-eplb, and the flags
`--init-expert-location /etc/deepseek-pd-eplb/expert-location.json`. Every rank of a group reads
the same file and checks that all agree (workers/serve/group_main.py `agreement_of`).
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from deepseek_pd.operator.spec import RoleSpec

# Not under /etc/deepseek-pd: that is the worker-config ConfigMap's read-only mount, and the
# runtime cannot create a mount point inside it.
MOUNT_DIR = "/etc/deepseek-pd-eplb"
FILE_NAME = "expert-location.json"
VOLUME_NAME = "expert-location"


@dataclass(frozen=True)
class EplbPodParts:
    """What a role's placement adds to its pods (all empty without one)."""

    volumes: list[dict[str, Any]]
    mounts: list[dict[str, Any]]
    location: str | None  # `serve --init-expert-location`


def eplb_pod_parts(role: RoleSpec) -> EplbPodParts:
    location = role.expert_location
    if location is None:
        return EplbPodParts([], [], None)
    volume = {"name": VOLUME_NAME, "configMap": {"name": location.name,
                                                 "items": [{"key": location.key, "path": FILE_NAME}]}}
    mount = {"name": VOLUME_NAME, "mountPath": MOUNT_DIR, "readOnly": True}
    return EplbPodParts([volume], [mount], f"{MOUNT_DIR}/{FILE_NAME}")

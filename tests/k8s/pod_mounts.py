"""A container's volumeMounts as the sandbox's mounts (pod_sandbox.Mount), subPath included."""
from __future__ import annotations

import os

from pdtest.pod_inputs import InputError, Obj, VolumeSource
from pod_sandbox import Mount


def container_mounts(container: Obj, volumes: dict[str, VolumeSource]) -> list[Mount]:
    mounts = []
    for mount in container.get("volumeMounts") or []:
        source = volumes.get(mount["name"])
        if source is None:
            raise InputError(f"volumeMount {mount['name']!r} names no volume of the pod")
        if source.tmpfs_size:
            mounts.append(Mount(mount["mountPath"], tmpfs_size=source.tmpfs_size))
            continue
        path = os.path.join(source.path, mount["subPath"]) if mount.get("subPath") else source.path
        mounts.append(Mount(mount["mountPath"], path, bool(mount.get("readOnly"))))
    return mounts

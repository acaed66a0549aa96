"""What a container is given: its environment and its volumes, resolved the way a kubelet does.

    container_env(kube, pod, container, base)  -> dict   value, $(VAR) expansion, fieldRef
                                                          (metadata.*, spec.*, status.podIP/hostIP),
                                                          resourceFieldRef, secretKeyRef,
                                                          configMapKeyRef, envFrom
    prepare_volumes(kube, pod, dir, ...)      -> {name: VolumeSource}  files written under `dir`

Volume sources: configMap, secret, downwardAPI, projected (serviceAccountToken through a real
TokenRequest, configMap, secret, downwardAPI), emptyDir (Memory: a tmpfs), hostPath, and
persistentVolumeClaim as a per-claim directory under the kubelet's root (no provisioner: the
claim's data lives as long as the kubelet). Files are written once when the pod starts (a
kubelet would refresh them; nothing here rotates a Secret under a running pod). Anything else
raises InputError: the pod reports CreateContainerConfigError instead of running half-configured.

`kube` is anything with the two calls used here (`Objects`): the process kubelet passes its REST
client (tests/k8s), the rendered-pod tests a store of the operator's built objects (no cluster).
How the sandbox mounts the volumes is the kubelet's (tests/k8s/pod_mounts.py).
"""
from __future__ import annotations

import base64
import math
import os
import pathlib
import re
from dataclasses import dataclass
from typing import Any, Protocol

Obj = dict[str, Any]


class Objects(Protocol):
    """Where Secrets, ConfigMaps (and, for projected tokens, TokenRequests) come from."""

    def get(self, path: str) -> Obj | None: ...

    def create(self, path: str, obj: Obj) -> Obj: ...




class InputError(Exception):
    """A referenced Secret/ConfigMap/key is missing or a source is unsupported (the message says)."""


def _get(kube: Objects, kind: str, namespace: str, name: str, optional: bool) -> Obj | None:
    obj = kube.get(f"/api/v1/namespaces/{namespace}/{kind}/{name}")
    if obj is None and not optional:
        raise InputError(f"{kind[:-1]} {namespace}/{name} not found")
    return obj


def _key_values(kind: str, obj: Obj | None) -> dict[str, bytes]:
    if obj is None:
        return {}
    if kind == "secrets":
        return {k: base64.b64decode(v) for k, v in (obj.get("data") or {}).items()}
    values = {k: v.encode() for k, v in (obj.get("data") or {}).items()}
    values.update({k: base64.b64decode(v) for k, v in (obj.get("binaryData") or {}).items()})
    return values


def _field(pod: Obj, path: str) -> str:
    meta, spec, status = pod["metadata"], pod["spec"], pod.get("status") or {}
    labelled = re.fullmatch(r"metadata\.(labels|annotations)\['([^']+)'\]", path)
    if labelled:
        return (meta.get(labelled.group(1)) or {}).get(labelled.group(2), "")
    simple = {
        "metadata.name": meta.get("name", ""), "metadata.namespace": meta.get("namespace", ""),
        "metadata.uid": meta.get("uid", ""), "spec.nodeName": spec.get("nodeName", ""),
        "spec.serviceAccountName": spec.get("serviceAccountName", ""),
        "status.podIP": status.get("podIP", ""), "status.hostIP": status.get("hostIP", ""),
        "status.podIPs": ",".join(p["ip"] for p in status.get("podIPs") or []),
        "status.hostIPs": ",".join(p["ip"] for p in status.get("hostIPs") or []),
    }
    if path in ("metadata.labels", "metadata.annotations"):
        items = meta.get(path.split(".")[1]) or {}
        return "\n".join(f'{k}="{v}"' for k, v in sorted(items.items()))
    if path not in simple:
        raise InputError(f"fieldRef {path!r} is not supported")
    return simple[path]


_QUANTITY = re.compile(r"^([0-9.]+)(m|k|M|G|T|Ki|Mi|Gi|Ti)?$")
_FACTORS = {None: 1, "m": 1e-3, "k": 1e3, "M": 1e6, "G": 1e9, "T": 1e12,
            "Ki": 2**10, "Mi": 2**20, "Gi": 2**30, "Ti": 2**40}


def quantity(text: str) -> float:
    match = _QUANTITY.match(str(text))
    if not match:
        raise InputError(f"quantity {text!r} is not understood")
    return float(match.group(1)) * _FACTORS[match.group(2)]


def _resource_field(container: Obj, ref: Obj) -> str:
    section, _, resource = ref["resource"].partition(".")
    value = ((container.get("resources") or {}).get(section) or {}).get(resource)
    if value is None:  # a kubelet reports node allocatable; this node claims 1 CPU, 8Gi
        value = "1" if resource == "cpu" else "8Gi"
    divisor = quantity(ref.get("divisor", "1"))
    return str(math.ceil(quantity(value) / divisor))


_VAR = re.compile(r"\$\(([A-Za-z_][A-Za-z0-9_.-]*)\)|\$\$")


def expand(text: str, env: dict[str, str]) -> str:
    """Kubernetes' $(VAR) syntax: known names are replaced, unknown ones kept, $$ is a $."""
    def one(match: re.Match) -> str:
        if match.group(0) == "$$":
            return "$"
        return env.get(match.group(1), match.group(0))
    return _VAR.sub(one, text)


def container_env(kube: Objects, pod: Obj, container: Obj, base: dict[str, str]) -> dict[str, str]:
    """`base` (what the image would set: PATH, HOME) overlaid by envFrom, then env in order."""
    namespace = pod["metadata"]["namespace"]
    env = dict(base)
    for source in container.get("envFrom") or []:
        kind, ref = ("configmaps", source["configMapRef"]) if "configMapRef" in source \
            else ("secrets", source["secretRef"])
        obj = _get(kube, kind, namespace, ref["name"], ref.get("optional", False))
        for key, value in _key_values(kind, obj).items():
            env[source.get("prefix", "") + key] = value.decode()
    for var in container.get("env") or []:
        if "valueFrom" not in var:
            env[var["name"]] = expand(var.get("value", ""), env)
            continue
        source = var["valueFrom"]
        if "fieldRef" in source:
            env[var["name"]] = _field(pod, source["fieldRef"]["fieldPath"])
        elif "resourceFieldRef" in source:
            env[var["name"]] = _resource_field(container, source["resourceFieldRef"])
        else:
            kind, ref = ("secrets", source["secretKeyRef"]) if "secretKeyRef" in source \
                else ("configmaps", source["configMapKeyRef"])
            values = _key_values(kind, _get(kube, kind, namespace, ref["name"], ref.get("optional", False)))
            if ref["key"] in values:
                env[var["name"]] = values[ref["key"]].decode()
            elif not ref.get("optional", False):
                raise InputError(f"key {ref['key']!r} not in {kind[:-1]} {namespace}/{ref['name']}")
    return env


@dataclass(frozen=True)
class VolumeSource:
    """Where a volume's files are on the host, or a tmpfs size for emptyDir medium Memory."""

    path: str = ""
    tmpfs_size: str = ""


def _write_files(directory: pathlib.Path, files: dict[str, bytes], mode: int) -> None:
    for rel, data in files.items():
        target = directory / rel
        target.parent.mkdir(parents=True, exist_ok=True)
        target.write_bytes(data)
        target.chmod(mode)


def _key_files(kube: Objects, kind: str, namespace: str, source: Obj, name_key: str) -> tuple[dict[str, bytes], int | None]:
    obj = _get(kube, kind, namespace, source[name_key], source.get("optional", False))
    values = _key_values(kind, obj)
    if not source.get("items"):
        return values, None
    files = {}
    for item in source["items"]:
        if item["key"] in values:
            files[item["path"]] = values[item["key"]]
        elif not source.get("optional", False):
            raise InputError(f"key {item['key']!r} not in {kind[:-1]} {namespace}/{source[name_key]}")
    return files, None


def _downward_files(pod: Obj, source: Obj) -> dict[str, bytes]:
    return {item["path"]: _field(pod, item["fieldRef"]["fieldPath"]).encode()
            for item in source.get("items") or [] if "fieldRef" in item}


def _token(kube: Objects, pod: Obj, source: Obj) -> bytes:
    meta = pod["metadata"]
    account = pod["spec"].get("serviceAccountName") or "default"
    body = {"apiVersion": "authentication.k8s.io/v1", "kind": "TokenRequest",
            "spec": {"audiences": [source["audience"]] if source.get("audience") else None,
                     "expirationSeconds": source.get("expirationSeconds", 3600),
                     "boundObjectRef": {"apiVersion": "v1", "kind": "Pod", "name": meta["name"],
                                        "uid": meta["uid"]}}}
    answer = kube.create(f"/api/v1/namespaces/{meta['namespace']}/serviceaccounts/{account}/token", body)
    return answer["status"]["token"].encode()


def _projected_files(kube: Objects, pod: Obj, source: Obj) -> dict[str, bytes]:
    namespace = pod["metadata"]["namespace"]
    files: dict[str, bytes] = {}
    for part in source.get("sources") or []:
        if "serviceAccountToken" in part:
            files[part["serviceAccountToken"]["path"]] = _token(kube, pod, part["serviceAccountToken"])
        elif "configMap" in part:
            files.update(_key_files(kube, "configmaps", namespace, part["configMap"], "name")[0])
        elif "secret" in part:
            files.update(_key_files(kube, "secrets", namespace, part["secret"], "name")[0])
        elif "downwardAPI" in part:
            files.update(_downward_files(pod, part["downwardAPI"]))
        else:
            raise InputError(f"projected source {sorted(part)} is not supported")
    return files


def prepare_volumes(kube: Objects, pod: Obj, directory: pathlib.Path,
                    claims_dir: pathlib.Path) -> dict[str, VolumeSource]:
    """Writes every volume's files under `directory/<volume>`; returns where each one is."""
    namespace = pod["metadata"]["namespace"]
    out: dict[str, VolumeSource] = {}
    for volume in pod["spec"].get("volumes") or []:
        name = volume["name"]
        path = directory / name
        if "emptyDir" in volume:
            empty = volume["emptyDir"] or {}
            if empty.get("medium") == "Memory":
                size = quantity(empty.get("sizeLimit") or "64Mi")  # tmpfs takes bytes, not "1Gi"
                out[name] = VolumeSource(tmpfs_size=str(int(size)))
                continue
            path.mkdir(parents=True, exist_ok=True)
        elif "hostPath" in volume:
            host = volume["hostPath"]
            kind = host.get("type", "")
            if kind == "DirectoryOrCreate":
                os.makedirs(host["path"], exist_ok=True)
            elif kind == "Directory" and not os.path.isdir(host["path"]):
                raise InputError(f"hostPath {host['path']!r} is not a directory")
            path = pathlib.Path(host["path"])
        elif "persistentVolumeClaim" in volume:
            path = claims_dir / namespace / volume["persistentVolumeClaim"]["claimName"]
            path.mkdir(parents=True, exist_ok=True)
        elif "configMap" in volume or "secret" in volume:
            kind, source, key = ("configmaps", volume["configMap"], "name") if "configMap" in volume \
                else ("secrets", volume["secret"], "secretName")
            files, _ = _key_files(kube, kind, namespace, source, key)
            path.mkdir(parents=True, exist_ok=True)
            _write_files(path, files, source.get("defaultMode", 0o644))
        elif "downwardAPI" in volume:
            path.mkdir(parents=True, exist_ok=True)
            _write_files(path, _downward_files(pod, volume["downwardAPI"]), 0o644)
        elif "projected" in volume:
            path.mkdir(parents=True, exist_ok=True)
            _write_files(path, _projected_files(kube, pod, volume["projected"]),
                         volume["projected"].get("defaultMode", 0o644))
        else:
            raise InputError(f"volume {name!r}: source {sorted(set(volume) - {'name'})} is not supported")
        out[name] = VolumeSource(path=str(path))
    return out

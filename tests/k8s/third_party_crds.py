"""Third-party CRDs (ServiceMonitor: scripts/third-party-crds.txt) installed into the
tests' kube-apiserver, and the server's own verdict on an object of their kinds.

    crds = ThirdPartyCrds.install(admin_kube)  creates the CRDs, waits until they are Established
    crds.admit(obj)                            a server-side dry-run create (fieldValidation=Strict)
                                               in obj's namespace: returns what the server would
                                               store, raises KubeError (422) if it refuses obj

The `third_party_crds` session fixture (conftest.py) gives one. The operator's tests use it for
every object whose kind a CRD defines; a kind no installed CRD defines raises KeyError.
"""
from __future__ import annotations

import time
from dataclasses import dataclass

from kube_rest import Kube, KubeError, Obj

from pdtest.crd_schemas import CrdSchemas, third_party_crd_files

CRD_PATH = "/apis/apiextensions.k8s.io/v1/customresourcedefinitions"
ESTABLISHED_TIMEOUT_S = 60.0


def _established(crd: Obj | None) -> bool:
    conditions = ((crd or {}).get("status") or {}).get("conditions") or []
    return any(c["type"] == "Established" and c["status"] == "True" for c in conditions)


@dataclass(frozen=True)
class ThirdPartyCrds:
    kube: Kube
    paths: dict[tuple[str, str], str]  # (apiVersion, kind) -> "/apis/<group>/<version>/namespaces/{ns}/<plural>"

    @classmethod
    def install(cls, kube: Kube) -> ThirdPartyCrds:
        crds = CrdSchemas.from_files(third_party_crd_files()).crds
        for crd in crds:
            try:
                kube.create(CRD_PATH, crd)
            except KubeError as exc:
                if exc.status != 409:  # installed by an earlier call in this session
                    raise
        deadline = time.monotonic() + ESTABLISHED_TIMEOUT_S
        for crd in crds:
            while not _established(kube.get(f"{CRD_PATH}/{crd['metadata']['name']}")):
                if time.monotonic() > deadline:
                    raise TimeoutError(f"CRD {crd['metadata']['name']} not Established in {ESTABLISHED_TIMEOUT_S:.0f}s")
                time.sleep(0.2)
        paths = {}
        for crd in crds:
            group, plural, kind = crd["spec"]["group"], crd["spec"]["names"]["plural"], crd["spec"]["names"]["kind"]
            for version in crd["spec"]["versions"]:
                if version.get("served"):
                    paths[(f"{group}/{version['name']}", kind)] = f"/apis/{group}/{version['name']}/namespaces/{{ns}}/{plural}"
        return cls(kube, paths)

    def knows(self, obj: Obj) -> bool:
        return (obj.get("apiVersion"), obj.get("kind")) in self.paths

    def admit(self, obj: Obj) -> Obj:
        key = (obj.get("apiVersion"), obj.get("kind"))
        if key not in self.paths:
            raise KeyError(f"no installed CRD defines {key[0]} {key[1]} (scripts/third-party-crds.txt)")
        meta = obj.get("metadata")
        namespace = (meta.get("namespace") if isinstance(meta, dict) else None) or "default"
        self.ensure_namespace(namespace)
        return self.kube.request("POST", self.paths[key].format(ns=namespace), obj,
                                 params={"dryRun": "All", "fieldValidation": "Strict"})

    def ensure_namespace(self, name: str) -> None:
        """Creates the namespace objects are admitted in, if missing."""
        if self.kube.get(f"/api/v1/namespaces/{name}") is None:
            try:
                self.kube.create("/api/v1/namespaces", {"apiVersion": "v1", "kind": "Namespace",
                                                        "metadata": {"name": name}})
            except KubeError as exc:
                if exc.status != 409:
                    raise

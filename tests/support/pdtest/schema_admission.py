"""The API server's schema check of any object the operator renders, in-process (no server):

    from pdtest.schema_admission import Refused, validate
    validate(obj)        raises Refused (with the server-like message) if the server would refuse it

Built-in kinds go to kubernetes-validate (the 1.37 OpenAPI schemas, strict: unknown fields are
errors). The project's own DeepSeekRoleScale goes to its CRD (operator/role_scale.py); kinds defined by a third-party CRD (ServiceMonitor) go to that CRD's own schema
(pdtest.crd_schemas, the files tests/k8s installs into the real kube-apiserver). A kind neither
knows fails the test loudly (LookupError, never Refused): no object passes unchecked.
Against a real server, use the `third_party_crds` fixture of tests/k8s instead.
"""
from __future__ import annotations

import functools
from typing import Any

import kubernetes_validate
import kubernetes_validate.utils

from pdtest.crd_schemas import CrdSchemas, CrdViolation, third_party_schemas

K8S_VERSION = "1.37"

# kubernetes-validate parses the kind's schema and the shared definitions (1.8 MB of JSON) from its
# package files on every validate(): ~0.08 s a call, most of the CR fuzz's time (tests/operator).
# The files do not change during a run and nothing writes to the parsed schemas, so each file is
# parsed once; a file that is missing still raises, every time (exceptions are not cached).
kubernetes_validate.utils.schema_contents = functools.cache(kubernetes_validate.utils.schema_contents)


class Refused(ValueError):
    """What the API server would answer with 422 Invalid; `message` says which field and why."""

    def __init__(self, message: str) -> None:
        super().__init__(message)
        self.message = message


@functools.cache
def own_schemas() -> CrdSchemas:
    """The project's own CRDs that the operator creates objects of (DeepSeekRoleScale)."""
    from deepseek_pd.operator.role_scale import build_role_scale_crd

    return CrdSchemas([build_role_scale_crd()])


def validate(obj: dict[str, Any]) -> None:
    schemas = own_schemas() if own_schemas().knows(obj) else third_party_schemas()
    try:
        if schemas.knows(obj):
            schemas.validate(obj)
        else:
            kubernetes_validate.validate(obj, K8S_VERSION, strict=True)
    except (CrdViolation, kubernetes_validate.ValidationError) as exc:
        raise Refused(exc.message) from None
    except kubernetes_validate.SchemaNotFoundError:
        raise LookupError(f"no schema for {obj.get('apiVersion')} {obj.get('kind')}: neither Kubernetes "
                          f"{K8S_VERSION} nor a CRD of scripts/third-party-crds.txt defines it") from None

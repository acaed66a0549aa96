"""Names, labels and API coordinates shared by the CRD, the builders and the handlers.

Every child object has a deterministic name derived from the custom resource's name, so a
reconcile that crashed half-way finds what it created last time instead of creating twins:

    DeepSeekDeployment "v3" in namespace "llm", decode role, group 1 of size 2
      StatefulSet + headless Service  v3-decode-1        (pods v3-decode-1-0, v3-decode-1-1)
      leader address                  v3-decode-1-0.v3-decode-1.llm.svc
      worker ConfigMap                v3-decode-config
      model cache (model.cache.size)  v3-model-cache     (PersistentVolumeClaim)
      router                          v3-router (Deployment, Service, ServiceAccount, Role, RoleBinding)
      secrets (created once)          v3-internal (workers' HMAC secret), v3-router-control-plane
      worker NetworkPolicy            v3-workers
      every prefill pod (headless)    v3-prefill-peers (decode's allowlist resolves it)
"""
from __future__ import annotations

from typing import Literal

GROUP = "deepseek-pd.io"
VERSION = "v1alpha1"
API_VERSION = f"{GROUP}/{VERSION}"
KIND = "DeepSeekDeployment"
PLURAL = "deepseekdeployments"
SINGULAR = "deepseekdeployment"
SHORT_NAMES = ("dsd",)
CRD_NAME = f"{PLURAL}.{GROUP}"

Role = Literal["prefill", "decode"]
ROLES: tuple[Role, ...] = ("prefill", "decode")

# A StatefulSet's name ends up in its pods' `controller-revision-hash` label (63 chars max)
# followed by a hash and the pod index, so the CR name leaves room for "-prefill-NN".
MAX_NAME_LENGTH = 40
# What a Service name must match (and so the CR name, which starts every child's name).
DNS_1035_LABEL = "^[a-z]([-a-z0-9]*[a-z0-9])?$"

LABEL_NAME = "app.kubernetes.io/name"
LABEL_INSTANCE = "app.kubernetes.io/instance"
LABEL_COMPONENT = "app.kubernetes.io/component"
LABEL_MANAGED_BY = "app.kubernetes.io/managed-by"
LABEL_DEPLOYMENT = f"{GROUP}/deployment"
LABEL_ROLE = f"{GROUP}/role"
LABEL_GROUP_INDEX = f"{GROUP}/group-index"
LABEL_REVISION = f"{GROUP}/revision"
# Set by Kubernetes (>= 1.28) on every StatefulSet pod; the router selects rank 0 (the leader) by it.
LABEL_POD_INDEX = "apps.kubernetes.io/pod-index"

ANNOTATION_APPLIED_HASH = f"{GROUP}/applied-hash"
ANNOTATION_REVISION = f"{GROUP}/revision"
# sgl-model-gateway reads the prefill bootstrap port from this pod annotation.
ANNOTATION_BOOTSTRAP_PORT = "sglang.ai/bootstrap-port"

MANAGED_BY = "deepseek-pd-operator"
APP_NAME = "deepseek-pd"
WORKER_CONFIG_FILE = "worker.json"
WORKER_CONFIG_DIR = "/etc/deepseek-pd"
MODEL_MOUNT = "/models"
MODEL_CACHE_MOUNT = "/model-cache"  # a huggingFace source's cache volume (weights/layout.snapshot_dir)


def group_name(deployment: str, role: str, index: int) -> str:
    """StatefulSet and headless Service of one group: `<cr>-<role>-<index>`."""
    return f"{deployment}-{role}-{index}"


def pod_name(deployment: str, role: str, index: int, rank: int) -> str:
    """Pod `rank` of a group, as the StatefulSet controller names it."""
    return f"{group_name(deployment, role, index)}-{rank}"


def leader_address(deployment: str, role: str, index: int, namespace: str) -> str:
    """DNS name of rank 0 through the group's headless Service (resolvable before it is Ready)."""
    group = group_name(deployment, role, index)
    return f"{group}-0.{group}.{namespace}.svc"


def config_map_name(deployment: str, role: str) -> str:
    return f"{deployment}-{role}-config"


def model_cache_claim_name(deployment: str) -> str:
    """The PVC the operator creates for model.cache.size."""
    return f"{deployment}-model-cache"


def router_name(deployment: str) -> str:
    return f"{deployment}-router"


def control_plane_secret_name(deployment: str) -> str:
    return f"{deployment}-router-control-plane"


def network_policy_name(deployment: str) -> str:
    return f"{deployment}-workers"


def prefill_peers_service_name(deployment: str) -> str:
    return f"{deployment}-prefill-peers"


def base_labels(deployment: str, component: str) -> dict[str, str]:
    """Labels on every child: the standard app.kubernetes.io set plus our deployment key."""
    return {
        LABEL_NAME: APP_NAME,
        LABEL_INSTANCE: deployment,
        LABEL_COMPONENT: component,
        LABEL_MANAGED_BY: MANAGED_BY,
        LABEL_DEPLOYMENT: deployment,
    }


def role_selector(deployment: str, role: str) -> dict[str, str]:
    """Selects every pod of one role of one deployment."""
    return {LABEL_DEPLOYMENT: deployment, LABEL_ROLE: role}


def group_selector(deployment: str, role: str, index: int) -> dict[str, str]:
    """Selects the pods of one group; also the StatefulSet's immutable selector."""
    return {**role_selector(deployment, role), LABEL_GROUP_INDEX: str(index)}


def router_pod_selector(deployment: str, role: str) -> dict[str, str]:
    """What the router watches: the leader (rank 0) pod of every group of a role."""
    return {**role_selector(deployment, role), LABEL_POD_INDEX: "0"}


def selector_string(labels: dict[str, str]) -> str:
    """`k=v,k2=v2`, the labelSelector query syntax."""
    return ",".join(f"{key}={value}" for key, value in sorted(labels.items()))

# One DeepSeekRoleScale per role of each deployment (operator/role_scale.py): a CRD version has a
# single scale subresource (decode's, on the DeepSeekDeployment), so each role's own lives here.
SCALE_KIND = "DeepSeekRoleScale"
SCALE_PLURAL = "deepseekrolescales"
SCALE_CRD_NAME = f"{SCALE_PLURAL}.{GROUP}"


def role_scale_name(deployment: str, role: str) -> str:
    """`v3-prefill`: the DeepSeekRoleScale an HPA or `kubectl scale` targets for one role."""
    return f"{deployment}-{role}"

"""The DeepSeekDeployment spec as frozen dataclasses: parsed once, after defaulting and validation.

`DeploymentSpec.parse(name, namespace, raw_spec)` raises `InvalidSpecError` naming the first bad
field; builders and the planner only ever see a spec that is whole and consistent.
"""
from __future__ import annotations

import hashlib
import json
from dataclasses import asdict, dataclass
from typing import Any

from deepseek_pd.errors import UserError
from deepseek_pd.operator import names
from deepseek_pd.operator.autoscaler import AutoscalingSpec, MetricTarget
from deepseek_pd.operator.crd_spec import DEFAULT_RUN_AS_USER, spec_schema
from deepseek_pd.operator.defaults import apply_defaults
from deepseek_pd.operator.validation import Violation, validate_spec
from deepseek_pd.weights.layout import snapshot_dir


class InvalidSpecError(UserError):
    """A spec the operator cannot act on; `violations` name every bad field."""

    def __init__(self, violations: list[Violation]) -> None:
        self.violations = violations
        super().__init__("; ".join(str(v) for v in violations))


@dataclass(frozen=True)
class Parallelism:
    """How a group's ranks split the model, rendered as `serve --tp/--dp/--ep` (world = tp * dp).

    `tp` is attention tensor parallelism within each DP group (workers/group/layout.py).
    Neither given: tp 1, dp = world (DP attention, what an unset CR always meant); one given: the
    other is world divided by it.
    """

    tp: int
    dp: int
    ep: int

    @classmethod
    def resolve(cls, par: dict[str, Any], world: int) -> "Parallelism":
        if "dp" in par:
            return cls(tp=par.get("tp", world // par["dp"]), dp=par["dp"], ep=par["ep"])
        tp = par.get("tp", 1)
        return cls(tp=tp, dp=world // tp, ep=par["ep"])


@dataclass(frozen=True)
class RolloutStrategy:
    """Resolved to group counts for a given number of replicas (percentages as in Deployments)."""

    max_surge: int | str
    max_unavailable: int | str
    verify: bool = True  # rollout_verify.py: new groups answer as the old revision first

    def resolve(self, replicas: int) -> tuple[int, int]:
        """(surge, unavailable), each at most `replicas` (more surge groups than the groups they
        replace would hold GPUs for nothing; the CRD bounds neither: `make fuzz` drew maxSurge
        2**31 - 1 and the planner's set of surge indices took the test host's 24 GB); surge rounds
        up, unavailable down; never both 0."""
        surge = min(_resolve(self.max_surge, replicas, up=True), replicas)
        unavailable = min(_resolve(self.max_unavailable, replicas, up=False), replicas)
        if surge == 0 and unavailable == 0:
            unavailable = 1  # e.g. 10% of 3 groups: progress beats a rollout that never starts
        return surge, unavailable


def _resolve(value: int | str, replicas: int, *, up: bool) -> int:
    if isinstance(value, str):  # in integers: a float of "10**400%" would overflow
        scaled = int(value.rstrip("%")) * replicas
        return -(-scaled // 100) if up else scaled // 100
    return value


@dataclass(frozen=True)
class ConfigMapKey:
    """One key of a ConfigMap in the deployment's namespace (e.g. eplb.initExpertLocation)."""

    name: str
    key: str


@dataclass(frozen=True)
class RoleSpec:
    """One role (prefill or decode). `world_size` ranks per group, one process per GPU."""

    role: str
    replicas: int
    size: int
    gpus_per_pod: int
    parallelism: Parallelism
    deepep_mode: str
    engine_args: tuple[str, ...]
    env: tuple[dict, ...]
    resources: dict
    port: int
    bootstrap_port: int
    startup_timeout_seconds: int
    rollout: RolloutStrategy
    recreate_group_on_restart: bool
    expert_location: ConfigMapKey | None = None  # eplb.initExpertLocation (operator/build_eplb.py)
    autoscaling: AutoscalingSpec | None = None  # None: replicas is the user's (or an HPA's)

    @property
    def world_size(self) -> int:
        return self.size * max(self.gpus_per_pod, 1)

    @classmethod
    def parse(cls, role: str, raw: dict[str, Any]) -> RoleSpec:
        par = raw["parallelism"]
        world = raw["size"] * max(raw["gpusPerPod"], 1)
        return cls(
            role=role,
            replicas=raw["replicas"],
            size=raw["size"],
            gpus_per_pod=raw["gpusPerPod"],
            parallelism=Parallelism.resolve(par, world),
            deepep_mode=raw["deepepMode"],
            engine_args=tuple(raw["engineArgs"]),
            env=tuple(raw["env"]),
            resources=raw.get("resources", {}),
            port=raw["port"],
            bootstrap_port=raw["bootstrapPort"],
            startup_timeout_seconds=raw["startupTimeoutSeconds"],
            rollout=RolloutStrategy(raw["rolloutStrategy"]["maxSurge"],
                                    raw["rolloutStrategy"]["maxUnavailable"],
                                    raw["rolloutStrategy"]["verify"]),
            recreate_group_on_restart=raw["restartPolicy"] == "RecreateGroupOnPodRestart",
            expert_location=_config_map_key(raw.get("eplb", {}).get("initExpertLocation")),
            autoscaling=_autoscaling(raw.get("autoscaling")),
        )


def _autoscaling(raw: dict[str, Any] | None) -> AutoscalingSpec | None:
    if raw is None:
        return None
    return AutoscalingSpec(raw["minReplicas"], raw["maxReplicas"],
                           tuple(MetricTarget(m["name"], float(m["target"])) for m in raw["metrics"]),
                           raw["scaleUpStabilizationSeconds"], raw["scaleDownStabilizationSeconds"])


def _config_map_key(raw: dict[str, Any] | None) -> ConfigMapKey | None:
    return None if raw is None else ConfigMapKey(raw["configMapName"], raw["key"])


@dataclass(frozen=True)
class HubModel:
    """model.source.huggingFace: what the download init container fetches."""

    repo: str
    revision: str
    endpoint: str | None         # HF_ENDPOINT (a mirror); None: huggingface_hub's default
    token_secret: str | None
    token_key: str


@dataclass(frozen=True)
class ModelCache:
    """model.cache: the volume a huggingFace source is downloaded into (one of four kinds)."""

    claim_name: str | None       # an existing PVC
    size: str | None             # a PVC the operator creates (names.model_cache_claim_name)
    storage_class: str | None
    access_mode: str
    host_path: str | None
    size_limit: str              # the emptyDir's, when none of the above is set

    @classmethod
    def parse(cls, raw: dict[str, Any]) -> ModelCache:
        size = raw.get("size")
        return cls(raw.get("claimName"), None if size is None else str(size), raw.get("storageClassName"),
                   raw["accessMode"], raw.get("hostPath"), str(raw["sizeLimit"]))


@dataclass(frozen=True)
class ModelSpec:
    volume: dict | None          # pvc/hostPath: a core Volume source ({"persistentVolumeClaim": ...})
    path: str                    # what the worker's `--model` receives inside the pod
    served_name: str
    hub: HubModel | None         # huggingFace: downloaded into `cache` at path (layout.snapshot_dir)
    cache: ModelCache
    architecture: str | None = None  # a known_models entry for the memory plan; None: by name

    @property
    def hf_token_secret(self) -> str | None:
        return self.hub.token_secret if self.hub else None

    @property
    def tokenizer_path(self) -> str:
        """The router's --model-path: the checkpoint on the pvc/hostPath volume it mounts, or the
        Hub repo id (the gateway fetches the tokenizer itself; the cache may be a pod's emptyDir)."""
        return self.hub.repo if self.hub else self.path

    @classmethod
    def parse(cls, raw: dict[str, Any]) -> ModelSpec:
        source = raw["source"]
        cache = ModelCache.parse(raw["cache"])
        architecture = raw.get("architecture")
        if "huggingFace" in source:
            hf = source["huggingFace"]
            hub = HubModel(hf["id"], hf["revision"], hf.get("endpoint"), hf.get("tokenSecret"),
                           hf["tokenSecretKey"])
            path = str(snapshot_dir(names.MODEL_CACHE_MOUNT, hub.repo, hub.revision))
            return cls(None, path, raw["servedName"], hub, cache, architecture)
        if "pvc" in source:
            volume = {"persistentVolumeClaim": {"claimName": source["pvc"]["claimName"], "readOnly": True}}
        else:
            volume = {"hostPath": {"path": source["hostPath"]["path"], "type": "Directory"}}
        path = f"{names.MODEL_MOUNT}/{raw['path']}".rstrip("/")
        return cls(volume, path, raw["servedName"], None, cache, architecture)


@dataclass(frozen=True)
class KVTransferSpec:
    backend: str
    protocol: str
    devices: tuple[str, ...]
    tcp_fallback: bool


@dataclass(frozen=True)
class SecretKeyRef:
    """A key of a user's Secret in the deployment's namespace."""

    name: str
    key: str


@dataclass(frozen=True)
class PodSecuritySpec:
    run_as_user: int             # 0: root (runAsNonRoot off)
    read_only_root_filesystem: bool


@dataclass(frozen=True)
class NetworkPolicySpec:
    enabled: bool
    additional_ingress: tuple[dict, ...]


@dataclass(frozen=True)
class RouterSpec:
    replicas: int
    worker_discovery: str        # "Static" or "Selector" (crd_spec.WORKER_DISCOVERY_MODES)
    policy: str
    port: int
    service_type: str
    image: str
    resources: dict
    extra_args: tuple[str, ...]
    api_key_secret: SecretKeyRef | None = None
    client_budget: ClientBudget | None = None


@dataclass(frozen=True)
class ClientBudget:
    """router.clientBudget: each client's requests per minute; `client_header` names the client."""

    requests_per_minute: int
    client_header: str | None = None


@dataclass(frozen=True)
class RdmaSpec:
    resource_name: str | None
    resources_per_pod: int
    capabilities: tuple[str, ...]
    host_network: bool


@dataclass(frozen=True)
class MetricsSpec:
    enabled: bool
    port: int  # workers: rank r of a pod serves port + r
    router_port: int
    service_monitor: bool
    allow_from: tuple[dict, ...]  # NetworkPolicyPeers that may scrape the workers; () = any

    @classmethod
    def parse(cls, raw: dict[str, Any]) -> MetricsSpec:
        return cls(raw["enabled"], raw["port"], raw["routerPort"], raw["serviceMonitor"], tuple(raw["allowFrom"]))


@dataclass(frozen=True)
class DeploymentSpec:
    """Everything the builders need, for one DeepSeekDeployment."""

    name: str
    namespace: str
    model: ModelSpec
    image: str
    image_pull_policy: str
    image_pull_secrets: tuple[str, ...]
    prefill: RoleSpec
    decode: RoleSpec
    kv_transfer: KVTransferSpec
    router: RouterSpec
    scheduling: dict
    shared_memory_size: str
    rdma: RdmaSpec
    env: tuple[dict, ...]
    metrics: MetricsSpec
    pod_security: PodSecuritySpec = PodSecuritySpec(DEFAULT_RUN_AS_USER, True)
    network_policy: NetworkPolicySpec = NetworkPolicySpec(True, ())
    # decode.speculative.numSteps: rendered into both roles (a PD prefill worker runs the MTP layer
    # too), so it sits with the shared fields and changing it rolls both.
    speculative_num_steps: int = 0

    @property
    def rdma_enabled(self) -> bool:
        return self.kv_transfer.backend == "mooncake" and self.kv_transfer.protocol == "rdma"

    def role(self, role: str) -> RoleSpec:
        return {"prefill": self.prefill, "decode": self.decode}[role]

    def role_revision(self, role: str) -> str:
        """Hash of everything that shapes a role's pods; replicas and rollout settings excluded,
        so scaling or tuning the rollout never restarts running groups."""
        role_spec = asdict(self.role(role))
        for key in ("replicas", "rollout", "recreate_group_on_restart", "autoscaling"):
            role_spec.pop(key)
        shared = asdict(self)
        for key in ("prefill", "decode", "router", "network_policy"):
            shared.pop(key)
        shared["model"].pop("architecture")  # only the operator's memory plan reads it
        if not self.scheduling.get("topologyKey"):
            # It shapes no pod without a topologyKey, so its default rolls no group of a resource
            # that never set one when an operator that knows the field takes over.
            shared["scheduling"].pop("placement", None)
        blob = json.dumps({"role": role_spec, "shared": shared}, sort_keys=True, default=str)
        return hashlib.sha256(blob.encode()).hexdigest()[:10]

    @classmethod
    def parse(cls, name: str, namespace: str, raw_spec: Any) -> DeploymentSpec:
        """Defaults, validates (schema + CEL) and freezes; raises InvalidSpecError, also for a
        raw_spec that is not an object (None counts as an empty spec)."""
        violations = validate_spec(name, {} if raw_spec is None else raw_spec)
        if violations:
            raise InvalidSpecError(violations)
        raw = apply_defaults(spec_schema(), raw_spec)
        router = raw["router"]
        rdma = raw["rdma"]
        return cls(
            name=name,
            namespace=namespace,
            model=ModelSpec.parse(raw["model"]),
            image=raw["image"],
            image_pull_policy=raw["imagePullPolicy"],
            image_pull_secrets=tuple(s["name"] for s in raw["imagePullSecrets"]),
            prefill=RoleSpec.parse("prefill", raw["prefill"]),
            decode=RoleSpec.parse("decode", raw["decode"]),
            kv_transfer=KVTransferSpec(raw["kvTransfer"]["backend"], raw["kvTransfer"]["protocol"],
                                       tuple(raw["kvTransfer"]["devices"]), raw["kvTransfer"]["tcpFallback"]),
            router=RouterSpec(router["replicas"], router["workerDiscovery"], router["policy"],
                              router["port"], router["serviceType"], router.get("image", raw["image"]),
                              router.get("resources", {}), tuple(router["extraArgs"]),
                              SecretKeyRef(router["apiKeySecret"]["name"], router["apiKeySecret"]["key"])
                              if "apiKeySecret" in router else None,
                              ClientBudget(router["clientBudget"]["requestsPerMinute"],
                                           router["clientBudget"].get("clientHeader"))
                              if "clientBudget" in router else None),
            scheduling=raw["scheduling"],
            shared_memory_size=str(raw["sharedMemorySize"]),
            rdma=RdmaSpec(rdma.get("resourceName"), rdma["resourcesPerPod"],
                          tuple(rdma["capabilities"]), rdma["hostNetwork"]),
            env=tuple(raw["env"]),
            metrics=MetricsSpec.parse(raw["metrics"]),
            pod_security=PodSecuritySpec(raw["podSecurity"]["runAsUser"],
                                         raw["podSecurity"]["readOnlyRootFilesystem"]),
            network_policy=NetworkPolicySpec(raw["networkPolicy"]["enabled"],
                                             tuple(raw["networkPolicy"]["additionalIngress"])),
            speculative_num_steps=raw["decode"]["speculative"]["numSteps"],
        )

"""The OpenAPI v3 schema of `DeepSeekDeployment.spec`: the single source of fields and defaults.

The CRD (`crd.py`), the in-operator validation (`validation.py`) and the defaults the operator
applies when an API server did not (`defaults.py`) all read this one tree.

Parallelism, worked example (DeepSeek-V3 decode on 2 nodes of 8 H200):
    size=2, gpusPerPod=8  -> world = 16 GPUs per group
    tp=1, dp=16, ep=16    -> DP attention on 16 ranks, experts spread over 16 ranks (256/16 = 16 each)
    tp*dp must equal world; ep is 1 or world, and divides the routed-expert count.
"""
from __future__ import annotations

from deepseek_pd.model.speculative.rules import MAX_SPECULATIVE_NUM_STEPS
from deepseek_pd.operator.autoscaling_schema import autoscaling_schema
from deepseek_pd.operator.known_models import KNOWN_MODELS
from deepseek_pd.operator.port_rules import port_rules
from deepseek_pd.operator.schema_types import (
    Schema, array, boolean, env_var, int_or_percent, integer, obj, opaque_object, quantity,
    resource_requirements, rule, string, string_map,
)
from deepseek_pd.weights.layout import REPO_PATTERN
# The flags the operator renders itself (the serve contract's `managed` ones); engineArgs may not
# repeat them (two values, one wins silently).
from deepseek_pd.workers.serve.flags import MANAGED_FLAGS

_MANAGED_FLAG_REGEX = "^--(" + "|".join(MANAGED_FLAGS) + ")(=.*)?$"
_WORLD = "(self.size * (self.gpusPerPod == 0 ? 1 : self.gpusPerPod))"
# The uid every rendered pod runs as by default, and the images' USER (Dockerfile, Dockerfile.cuda,
# the chart's podSecurity.runAsUser): >= 10000, so it matches no account of a node (checkov CKV_K8S_40).
DEFAULT_RUN_AS_USER = 10001
# router.workerDiscovery: listed by the operator (Static) or found by label selector (Selector).
WORKER_DISCOVERY_MODES = ("Static", "Selector")
# scheduling.placement: a role's groups over the topologyKey's domains (operator/pod_placement.py).
PLACEMENTS = ("Spread", "Pack")


def _is_zero(field: str) -> str:
    return f"(type({field}) == string ? {field} == '0%' : {field} == 0)"


def _rollout_strategy() -> Schema:
    return obj(
        "How a spec change rolls through the groups; whole groups are replaced, one budget at a time.",
        {
            "maxSurge": int_or_percent(
                "Extra groups (or % of replicas, rounded up) created with the new revision during a "
                "rollout, so old groups can be replaced without losing capacity.", default=0),
            "maxUnavailable": int_or_percent(
                "Groups (or % of replicas, rounded down) that may be down at once during a rollout.",
                default=1),
            "verify": boolean(
                "Before a new-revision group joins the router, it and an old-revision group answer "
                "fixed greedy prompts over gRPC (prefill: as PD requests through one ready decode "
                "group); a difference stops the rollout (RolloutVerified False names the prompt and "
                "token) and the old groups keep serving. Skipped when the model itself changed "
                "(operator/rollout_verify.py).",
                default=True),
        },
        rules=[rule(f"!({_is_zero('self.maxSurge')} && {_is_zero('self.maxUnavailable')})",
                    "maxSurge and maxUnavailable cannot both be 0: the rollout could never start",
                    ".maxUnavailable")],
        default={},
    )


def _parallelism() -> Schema:
    return obj("How the ranks of one group split the model.", {
        "tp": integer("Attention tensor parallelism: ranks of one DP group that split the MLA heads "
                      "and run the same batch (each keeps a copy of its group's KV). Default: "
                      "(size * gpusPerPod) / dp when dp is set, else 1.", minimum=1, maximum=1024),
        "dp": integer("Data-parallel attention groups inside the group (DP attention: each attends "
                      "its own requests and holds their KV). Default: (size * gpusPerPod) / tp, "
                      "every rank its own DP group when tp is not set either.", minimum=1, maximum=1024),
        "ep": integer("Expert-parallel width of the MoE layers.", minimum=1, maximum=1024, default=1),
    }, default={})


# The rule Kubernetes applies to ConfigMap names (a DNS subdomain) and keys.
_DNS_SUBDOMAIN = "^[a-z0-9]([-a-z0-9]*[a-z0-9])?(\\.[a-z0-9]([-a-z0-9]*[a-z0-9])?)*$"
_CONFIG_MAP_KEY = "^[-._a-zA-Z0-9]+$"


def _eplb() -> Schema:
    return obj("Expert-parallel load balancing (docs/operations.md, EPLB).", {
        "initExpertLocation": obj(
            "A static expert placement (`deepseek-pd eplb plan` output) kept under a key of a "
            "ConfigMap in the deployment's namespace: mounted read-only into every worker pod of "
            "the role and passed as --init-expert-location. Workers read it when their group "
            "starts: an edited ConfigMap takes effect as groups restart (rename the ConfigMap or "
            "the key to roll every group). Redundant experts: --ep-num-redundant-experts in "
            "engineArgs, matching the file.", {
                "configMapName": string("The ConfigMap's name.", min_length=1, max_length=253,
                                        pattern=_DNS_SUBDOMAIN),
                "key": string("The key holding the placement JSON.", min_length=1, max_length=253,
                              pattern=_CONFIG_MAP_KEY),
            }, required=["configMapName", "key"]),
    })


def _speculative() -> Schema:
    return obj(
        "Speculative decoding with the checkpoint's multi-token-prediction (MTP) layer as the draft "
        "model (DeepSeek-V3/R1 ship one): each decode step drafts numSteps tokens and verifies them "
        "in one forward; greedy outputs stay identical, sampled ones keep the model's distribution. "
        "Rendered as `serve --speculative-num-steps` into the decode pods and the prefill pods (a "
        "prefill worker runs the MTP layer over the prompt and sends its KV), so changing it rolls "
        "both roles. The memory plan counts the MTP layer's weights and its latent KV.", {
            "numSteps": integer(
                "Draft tokens per decode step (0: off). SGLang's DeepSeek-V3 recipe uses 1-3; "
                "a checkpoint without an MTP layer fails at start-up with a message.",
                minimum=0, maximum=MAX_SPECULATIVE_NUM_STEPS, default=0),
        }, default={})


def role_schema(role: str) -> Schema:
    """Prefill and decode share one shape; names follow LeaderWorkerSet where they overlap (decode
    adds `speculative`)."""
    extra = {"speculative": _speculative()} if role == "decode" else {}
    return obj(
        f"The {role} workers: `replicas` groups of `size` pods each (a gang; pod index = rank).",
        {
            "replicas": integer("Number of groups (model replicas).", minimum=0, maximum=1000, default=1),
            "size": integer("Pods per group (nodes one model replica spans).", minimum=1, maximum=64,
                            default=1),
            "gpusPerPod": integer("GPUs requested per pod (nvidia.com/gpu); 0 runs on CPU.",
                                  minimum=0, maximum=16, default=8),
            "parallelism": _parallelism(),
            "deepepMode": string("DeepEP all-to-all mode for expert parallelism.",
                                 enum=["none", "auto", "normal", "low_latency"], default="auto"),
            "engineArgs": array("Extra `deepseek-pd serve` flags, e.g. --chunked-prefill-size=8192.",
                                string("One argument.", max_length=256), default=[], max_items=64),
            "env": array("Extra environment variables (core EnvVar objects).",
                         env_var("An EnvVar."), default=[]),
            "resources": resource_requirements(
                "Extra resource requests/limits; GPUs and the RDMA resource are added from the spec."),
            "port": integer("gRPC port of the SglangScheduler service.", minimum=1, maximum=65535,
                            default=30000),
            "bootstrapPort": integer("Prefill bootstrap (KV handshake) port; unused by decode.",
                                     minimum=1, maximum=65535, default=8998),
            "startupTimeoutSeconds": integer(
                "How long a pod may take to load weights before the startup probe fails it.",
                minimum=60, maximum=86400, default=3600),
            "rolloutStrategy": _rollout_strategy(),
            "eplb": _eplb(),
            "autoscaling": autoscaling_schema(role),
            "restartPolicy": string(
                "RecreateGroupOnPodRestart: a failed or restarted pod recreates its whole group "
                "(ranks of one model replica live and die together). None: leave the group alone.",
                enum=["RecreateGroupOnPodRestart", "None"], default="RecreateGroupOnPodRestart"),
            **extra,
        },
        rules=[
            rule(f"has(self.parallelism.tp) && has(self.parallelism.dp) ? "
                 f"self.parallelism.tp * self.parallelism.dp == {_WORLD} : "
                 f"has(self.parallelism.dp) ? {_WORLD} % self.parallelism.dp == 0 : "
                 f"!has(self.parallelism.tp) || {_WORLD} % self.parallelism.tp == 0",
                 "parallelism.tp * parallelism.dp must equal size * gpusPerPod (GPUs per group; 1 "
                 "process per pod when gpusPerPod is 0)", ".parallelism"),
            # The workers spread experts over all ranks of a group or replicate them
            # (workers/group/layout.py); any other ep would pass here and crash-loop there.
            rule(f"self.parallelism.ep == 1 || self.parallelism.ep == {_WORLD}",
                 "parallelism.ep must be 1 (experts replicated) or size * gpusPerPod (experts spread "
                 "over every rank of the group)", ".parallelism.ep"),
            rule("self.deepepMode in ['none', 'auto'] || self.gpusPerPod > 0",
                 "deepepMode normal/low_latency needs GPUs (gpusPerPod > 0)", ".deepepMode"),
            rule("!has(self.eplb) || !has(self.eplb.initExpertLocation) || "
                 "self.engineArgs.all(a, !a.matches('^--init-expert-location(=.*)?$'))",
                 "eplb.initExpertLocation and --init-expert-location in engineArgs name two placements: "
                 "keep one", ".eplb.initExpertLocation"),
            rule(f"self.engineArgs.all(a, !a.matches('{_MANAGED_FLAG_REGEX}'))",
                 "engineArgs must not set flags the operator manages: --"
                 + ", --".join(MANAGED_FLAGS), ".engineArgs"),
        ],
        default={},
    )


def _model() -> Schema:
    source = obj("Where the weights come from: exactly one of pvc, hostPath, huggingFace.", {
        "pvc": obj("A PersistentVolumeClaim holding the checkpoint (mounted read-only).", {
            "claimName": string("Name of the claim in the deployment's namespace.", min_length=1),
        }, required=["claimName"]),
        "hostPath": obj("A directory present on every node.", {
            "path": string("Absolute path on the node.", pattern="^/"),
        }, required=["path"]),
        "huggingFace": obj("A Hugging Face Hub repository, downloaded by an init container of every "
                           "worker pod (`deepseek-pd download`) into model.cache; resumable, and "
                           "fetched once per cache volume.", {
            "id": string("Repository id, e.g. deepseek-ai/DeepSeek-V3.", min_length=1, max_length=200,
                         pattern=REPO_PATTERN),
            "revision": string("Branch, tag or commit.", default="main", min_length=1, max_length=200),
            "tokenSecret": string("Secret (in the deployment's namespace) holding the token for gated "
                                  "or private models; given to the download init container only.",
                                  min_length=1),
            "tokenSecretKey": string("Key of the token in tokenSecret.", default="HF_TOKEN",
                                     min_length=1),
            "endpoint": string("Hub URL for a mirror or a self-hosted hub (HF_ENDPOINT of the download "
                               "and of the router's tokenizer fetch); default https://huggingface.co.",
                               pattern="^https?://[^\\s]+$"),
        }, required=["id"]),
    }, rules=[rule("(has(self.pvc) ? 1 : 0) + (has(self.hostPath) ? 1 : 0)"
                   " + (has(self.huggingFace) ? 1 : 0) == 1",
                   "model.source needs exactly one of pvc, hostPath, huggingFace")])
    return obj("The checkpoint to serve.", {
        "source": source,
        "cache": _model_cache(),
        "path": string("Checkpoint directory inside the pvc/hostPath volume ('' = its root).",
                       default="", pattern="^[^/]|^$"),
        "servedName": string("Model name clients put in requests (`model` field).", default="deepseek",
                             min_length=1, max_length=253),
        "numRoutedExperts": integer("Routed experts (n_routed_experts) of the checkpoint; when given,"
                                    " every role's ep must divide it. DeepSeek-V3: 256.", minimum=1),
        "architecture": string(
            "Which known checkpoint shape this is, for the memory plan (the MemoryPlanFits "
            "condition: do the weights, the KV pool and the graphs fit each GPU?). Default: "
            "recognised from huggingFace.id, path or servedName (e.g. DeepSeek-V3-0324, "
            "DeepSeek-R1 -> DeepSeek-V3); a model recognised by none is not checked.",
            enum=list(KNOWN_MODELS)),
    }, required=["source"], rules=[
        rule("has(self.source.huggingFace) || (!has(self.cache.claimName) && !has(self.cache.size) "
             "&& !has(self.cache.hostPath))",
             "model.cache only applies to a huggingFace source (pvc and hostPath are read in place)",
             ".cache"),
    ])


def _model_cache() -> Schema:
    return obj(
        "Where a huggingFace source is downloaded to, mounted at /model-cache: an existing claim, "
        "a claim the operator creates, a node directory, or (default) an emptyDir per pod. A "
        "shared volume downloads once (the other pods wait on per-file locks, then verify); an "
        "emptyDir downloads in every pod, again after every restart.", {
            "claimName": string("An existing PersistentVolumeClaim. ReadWriteMany (or every pod on "
                                "one node) lets all groups share one download.", min_length=1),
            "size": quantity("Create the claim <name>-model-cache of this size (owned by the "
                             "deployment: deleted with it), e.g. 1Ti for DeepSeek-V3."),
            "storageClassName": string("StorageClass of the created claim; default: the cluster's.",
                                       min_length=1),
            "accessMode": string("Access mode of the created claim; ReadWriteOnce only works when "
                                 "every worker pod lands on one node.",
                                 enum=["ReadWriteMany", "ReadWriteOnce", "ReadWriteOncePod"],
                                 default="ReadWriteMany"),
            "hostPath": string("A directory on each node (created if missing): one download per "
                               "node, kept across pod restarts.", pattern="^/"),
            "sizeLimit": quantity("sizeLimit of the emptyDir used when none of claimName, size, "
                                  "hostPath is set.", default="1Ti"),
        },
        rules=[
            rule("(has(self.claimName) ? 1 : 0) + (has(self.size) ? 1 : 0)"
                 " + (has(self.hostPath) ? 1 : 0) <= 1",
                 "model.cache takes at most one of claimName, size, hostPath"),
            rule("!has(self.storageClassName) || has(self.size)",
                 "model.cache.storageClassName only applies with size (a claim the operator creates)",
                 ".storageClassName"),
        ],
        default={},
    )


def _kv_transfer() -> Schema:
    return obj("How prefill writes latent KV into decode's pages.", {
        "backend": string("mooncake (TransferEngine, zero-copy) or grpc (streamed over the bootstrap "
                          "port, no extra dependency).", enum=["mooncake", "grpc"], default="mooncake"),
        "protocol": string("Mooncake transport: rdma (GPUDirect, production) or tcp.",
                           enum=["rdma", "tcp"], default="tcp"),
        "devices": array("RDMA NICs Mooncake may use, e.g. [mlx5_0, mlx5_1]; empty = all. Listed in GPU "
                         "order: they are split over a pod's ranks, local rank i getting those at positions "
                         "[i*n/gpusPerPod, (i+1)*n/gpusPerPod), at least one (8 NICs, 8 GPUs: one each). A named "
                         "device the pod cannot use stops the worker with an error naming it.",
                         string("A device name.", min_length=1, pattern="^[A-Za-z0-9_.:-]+$"),
                         default=[]),
        "tcpFallback": boolean("protocol rdma: a worker that finds no usable RDMA device starts "
                               "over tcp with a warning instead of refusing to start. Both ends of a "
                               "transfer must agree: a prefill/decode pair on different protocols "
                               "fails its requests with a message naming both.", default=False),
    }, rules=[
        rule("self.protocol == 'tcp' || self.backend == 'mooncake'",
             "kvTransfer.protocol rdma needs backend mooncake", ".protocol"),
        rule("size(self.devices) == 0 || self.protocol == 'rdma'",
             "kvTransfer.devices only applies to protocol rdma", ".devices"),
        rule("!self.tcpFallback || self.protocol == 'rdma'",
             "kvTransfer.tcpFallback only applies to protocol rdma", ".tcpFallback"),
    ], default={})


def _router() -> Schema:
    return obj("The sgl-model-gateway in PD mode, sending SglangScheduler gRPC calls to the leader "
               "(rank 0) of every group.", {
        "replicas": integer("Router pods.", minimum=0, maximum=100, default=1),
        "workerDiscovery": string(
            "How the router finds the workers. Static (default): the operator lists every group's "
            "leader as grpc://<group>-0.<group>.<namespace>.svc:<port> in the router's arguments, "
            "so adding or removing groups rolls the router; the router needs no Kubernetes API "
            "access. Selector: the router watches the leader pods by label "
            "(--service-discovery) and needs get/list/watch on pods; only for gateway versions "
            "whose discovery connects over gRPC (sgl-model-gateway 0.3.2 builds http:// URLs).",
            enum=list(WORKER_DISCOVERY_MODES), default="Static"),
        "policy": string("Load-balancing policy for both roles.",
                         enum=["random", "round_robin", "cache_aware", "power_of_two"],
                         default="cache_aware"),
        "port": integer("HTTP port of the OpenAI-compatible API.", minimum=1, maximum=65535,
                        default=8000),
        "serviceType": string("Type of the router Service.",
                              enum=["ClusterIP", "NodePort", "LoadBalancer"], default="ClusterIP"),
        "image": string("Router image; default: spec.image."),
        "resources": resource_requirements("Router container resources."),
        "extraArgs": array("Extra launch_router flags.", string("One argument."), default=[]),
        "apiKeySecret": obj(
            "A Secret (in the deployment's namespace) holding the client API key: every serving "
            "route of the router then needs `Authorization: Bearer <key>` (health routes stay "
            "open). Unset: the OpenAI API is open to whoever reaches the router Service. A missing "
            "Secret or key keeps the router from starting and sets the SecretsReady condition.", {
                "name": string("Secret name.", min_length=1, max_length=253),
                "key": string("Key inside the Secret.", default="api-key", min_length=1,
                              max_length=253),
            }, required=["name"]),
        "clientBudget": obj(
            "A per-client request budget (smg's tenant rate limit): past it a client gets 429 with "
            "Retry-After while others are served. A client is its address, which behind an ingress is "
            "the ingress's: there set clientHeader to a header the ingress sets (and overwrites) with "
            "the real client, e.g. X-Real-IP.", {
                "requestsPerMinute": integer("Requests each client may send per minute.", minimum=1,
                                             maximum=1_000_000),
                "clientHeader": string("Request header naming the client, trusted by the router "
                                       "(only safe behind an ingress that overwrites it).",
                                       pattern=r"^[A-Za-z0-9-]+$", max_length=128),
            }, required=["requestsPerMinute"]),
    }, default={})


def _metrics() -> Schema:
    return obj("Prometheus metrics of the workers and the router (docs/operations.md lists them).", {
        "enabled": boolean("Workers serve /metrics (serve --metrics-port), the router its exporter; pods get "
                           "prometheus.io/scrape, port and path annotations and named container ports.",
                           default=True),
        "port": integer("Workers' metrics port; a pod running several ranks (gpusPerPod > 1) serves rank r "
                        "of the pod on port + r (container ports metrics, metrics-r1, ...).",
                        minimum=1024, maximum=65000, default=30090),
        "routerPort": integer("The router's Prometheus exporter port.", minimum=1, maximum=65535,
                              default=29000),
        "serviceMonitor": boolean("Also create a monitoring.coreos.com/v1 ServiceMonitor for the worker "
                                  "and router Services (needs the Prometheus Operator's CRDs).",
                                  default=False),
        "allowFrom": array("Who may reach the workers' metrics ports through the deployment's NetworkPolicy "
                           "(core NetworkPolicyPeer objects, e.g. the monitoring namespace); empty = any source.",
                           opaque_object("A NetworkPolicyPeer."), default=[]),
    }, default={})


def _toleration() -> Schema:
    # Typed, not passed through: a wrong type would otherwise surface only when the API server
    # refuses the StatefulSet.
    return obj("A core Toleration.", {
        "key": string("Taint key; empty with operator Exists matches every taint."),
        "operator": string("Exists or Equal (default Equal).", enum=["Exists", "Equal"]),
        "value": string("Taint value (operator Equal)."),
        "effect": string("Taint effect; empty matches all.", enum=["NoSchedule", "PreferNoSchedule", "NoExecute", ""]),
        "tolerationSeconds": {"type": "integer", "format": "int64",
                              "description": "How long a NoExecute taint is tolerated."},
    })


def _scheduling() -> Schema:
    return obj("Where worker pods may run (applied to both roles).", {
        "nodeSelector": string_map("Node labels a worker node must have."),
        "tolerations": array("Tolerations (core Toleration objects).", _toleration()),
        "affinity": opaque_object("Core Affinity object."),
        "priorityClassName": string("PriorityClass of worker pods."),
        "gang": boolean("Gang-schedule each group (operator/pod_placement.py): a PodGroup "
                        "(scheduling.k8s.io/v1beta1, Kubernetes' in-tree gang scheduling, feature "
                        "gate GenericWorkload) per group with gang minCount = its pods, named in each "
                        "pod's spec.schedulingGroup; the scheduler binds a group's pods all together "
                        "or none. The GangScheduling condition says when the cluster does not serve "
                        "it, no scheduler answers, or a group waits for room.", default=False),
        "schedulerName": string("The scheduler of the worker pods; default: the cluster's.",
                                min_length=1, max_length=253),
        "topologyKey": string("A node label (e.g. a rack or NVLink-domain label): each group's pods "
                              "share one value of it (required pod affinity; with gang, also the "
                              "PodGroup's schedulingConstraints.topology, so the scheduler searches "
                              "for a domain that holds the group whole); `placement` says where a "
                              "role's groups go relative to one another.", min_length=1,
                              max_length=317, pattern="^([a-z0-9]([-a-z0-9.]*[a-z0-9])?/)?[A-Za-z0-9]([-A-Za-z0-9_.]*[A-Za-z0-9])?$"),
        "placement": string("With topologyKey, where a role's groups go relative to one another. "
                            "Spread: over the domains as failure domains (a topology spread "
                            "constraint, DoNotSchedule: no domain holds more of the role's groups "
                            "than another eligible domain plus one; a group waits rather than break "
                            "that). Pack: into as few domains as hold them (preferred pod affinity "
                            "between the role's groups; with gang, kube-scheduler's placement "
                            "scoring packs by itself), keeping whole domains free.",
                            enum=list(PLACEMENTS), default="Spread"),
    }, default={})


def _rdma() -> Schema:
    return obj("RDMA access for Mooncake (used when kvTransfer.protocol is rdma).", {
        "resourceName": string("Device-plugin resource that exposes the HCAs, e.g. rdma/ib or "
                               "nvidia.com/hostdev; unset when the nodes use host networking."),
        "resourcesPerPod": integer("How many of resourceName each pod requests.", minimum=1,
                                   default=1),
        "capabilities": array("Linux capabilities added to worker containers (IPC_LOCK pins "
                              "registered memory).", string("A capability.", pattern="^[A-Z_]+$"),
                              default=["IPC_LOCK"]),
        "hostNetwork": boolean("Run worker pods on the host network (RoCE without a CNI plugin).",
                               default=False),
    }, default={})


def _pod_security() -> Schema:
    return obj("The security context of worker and router pods (operator/pod_security.py).", {
        "runAsUser": integer("UID (and GID, fsGroup) the containers run as; 0 runs them as root, "
                             "e.g. for an image whose files only root can read.", minimum=0,
                             maximum=2147483647, default=DEFAULT_RUN_AS_USER),
        "readOnlyRootFilesystem": boolean(
            "Mount the image read-only; /tmp (and HOME=/tmp) is a writable emptyDir.",
            default=True),
    }, default={})


def _network_policy() -> Schema:
    return obj("A NetworkPolicy on the worker pods (operator/build_network_policy.py): gRPC only "
               "from the router, the bootstrap port only from decode, other ports only between "
               "the deployment's workers.", {
        "enabled": boolean("Create the NetworkPolicy.", default=True),
        "additionalIngress": array(
            "Extra ingress rules (core NetworkPolicyIngressRule objects) for the worker pods, e.g. "
            "a Prometheus scraper.", opaque_object("A NetworkPolicyIngressRule."), default=[]),
    }, default={})


def spec_schema() -> Schema:
    """`DeepSeekDeployment.spec`, with cross-field CEL rules."""
    return obj("Desired state of a prefill/decode-disaggregated DeepSeek deployment.", {
        "model": _model(),
        "image": string("Worker image (installs deepseek-pd).", min_length=1),
        "imagePullPolicy": string("Image pull policy of every container.",
                                  enum=["Always", "IfNotPresent", "Never"], default="IfNotPresent"),
        "imagePullSecrets": array("Secrets for pulling the images.", obj("A Secret reference.", {
            "name": string("Secret name.", min_length=1)}, required=["name"]), default=[]),
        "prefill": role_schema("prefill"),
        "decode": role_schema("decode"),
        "kvTransfer": _kv_transfer(),
        "router": _router(),
        "scheduling": _scheduling(),
        "sharedMemorySize": quantity("Size of the memory-backed /dev/shm (NCCL, DeepEP buffers).",
                                     default="16Gi"),
        "rdma": _rdma(),
        "metrics": _metrics(),
        "env": array("Environment variables for every worker pod (core EnvVar objects), e.g. "
                     "MC_GID_INDEX.", env_var("An EnvVar."), default=[]),
        "podSecurity": _pod_security(),
        "networkPolicy": _network_policy(),
    }, required=["model", "image"], rules=[
        rule("self.router.workerDiscovery != 'Selector' || self.prefill.port == self.decode.port",
             "prefill.port and decode.port must be equal with router.workerDiscovery Selector: the "
             "router's service discovery uses one port for every worker", ".decode.port"),
        rule("!has(self.model.numRoutedExperts) || "
             "self.model.numRoutedExperts % self.prefill.parallelism.ep == 0",
             "prefill.parallelism.ep must divide model.numRoutedExperts", ".prefill.parallelism.ep"),
        rule("!has(self.model.numRoutedExperts) || "
             "self.model.numRoutedExperts % self.decode.parallelism.ep == 0",
             "decode.parallelism.ep must divide model.numRoutedExperts", ".decode.parallelism.ep"),
        *port_rules(),
        *[rule(f"!has(self.{role}.autoscaling) || self.metrics.enabled",
               f"{role}.autoscaling reads the workers' metrics: it needs metrics.enabled",
               f".{role}.autoscaling") for role in ("prefill", "decode")],
    ])

"""`ModelReady` on the emulated API server with the real kopf operator: the test plays the
StatefulSet controller and the kubelet, writing the `model` init container's states the way the
kubelet reports them, and the termination messages the way `deepseek-pd download` writes them
(the real weights.failures.DownloadError)."""
from __future__ import annotations

import copy
import random

import pytest
from operator_harness import OperatorHarness
from pdtest.hub_specs import hub_spec

from deepseek_pd.operator import names
from deepseek_pd.operator.build_model import INIT_CONTAINER
from deepseek_pd.weights.failures import EXIT_CODES, DownloadError

pytestmark = [pytest.mark.timeout(180)]


@pytest.fixture(scope="module")
def cluster():
    """This module's own emulated cluster, resyncing every 0.2 s (the folder's: 0.5 s): each of its
    ~30 waits is one pass (a pod's state reaches the status at the next one), 20.8 s -> 10.4 s.
    Not the folder's default: under 3x load a resync that fast starves test_operator_kopf's held pass."""
    with OperatorHarness(resync_seconds=0.2) as harness:
        yield harness


def _condition(cluster, name: str, type_: str) -> dict:
    status = (cluster.get(names.KIND, name) or {}).get("status") or {}
    return next((c for c in status.get("conditions", []) if c["type"] == type_), {})


def _pods(cluster, name: str) -> list[str]:
    """One pending pod per rank of group 0 of each role, as the StatefulSet controller makes them."""
    created = []
    for role in names.ROLES:
        group = names.group_name(name, role, 0)
        sts = cluster.wait_for(f"StatefulSet {group}", lambda: cluster.get("StatefulSet", group))
        template = sts["spec"]["template"]
        for rank in range(sts["spec"]["replicas"]):
            pod = {"apiVersion": "v1", "kind": "Pod",
                   "metadata": {"name": f"{group}-{rank}", "namespace": "llm",
                                "labels": {**template["metadata"]["labels"], names.LABEL_POD_INDEX: str(rank)},
                                "annotations": template["metadata"]["annotations"]},
                   "spec": copy.deepcopy(template["spec"]),
                   "status": {"phase": "Pending"}}
            cluster.create(pod)
            created.append(pod["metadata"]["name"])
    return created


def _init_status(cluster, pod: str, state: dict, last: dict | None = None, phase: str = "Pending") -> None:
    status = {"name": INIT_CONTAINER, "ready": "terminated" in state and state["terminated"]["exitCode"] == 0,
              "restartCount": 1 if last else 0, "state": state, "lastState": last or {}}
    cluster.patch("Pod", pod, {"status": {"phase": phase, "initContainerStatuses": [status]}}, "status")


def _wait_condition(cluster, name: str, status: str, reason: str, message: str | None = None) -> dict:
    def check():
        c = _condition(cluster, name, "ModelReady")
        ok = c.get("status") == status and c.get("reason") == reason
        return c if ok and (message is None or c.get("message") == message) else None
    return cluster.wait_for(f"ModelReady {status}/{reason}", check)


def _words(rng: random.Random) -> str:
    return " ".join(rng.choice(["shard", "hub", "HTTP", "401", "disk", "/model-cache", "gated"])
                    for _ in range(rng.randint(2, 6)))


def test_model_ready_follows_the_download_through_every_failure_reason(cluster):
    rng = random.Random()
    name = f"hf-{rng.randrange(10**6)}"
    raw = hub_spec(rng, "size")
    cluster.create({"apiVersion": names.API_VERSION, "kind": names.KIND,
                    "metadata": {"name": name, "namespace": "llm"}, "spec": raw})
    claim = cluster.wait_for("the cache claim", lambda: cluster.get(
        "PersistentVolumeClaim", names.model_cache_claim_name(name)))
    assert claim["spec"]["resources"]["requests"]["storage"] == raw["model"]["cache"]["size"]
    assert claim["metadata"]["ownerReferences"][0]["kind"] == names.KIND
    _wait_condition(cluster, name, "False", "Pending", "no worker pod has started yet")

    pods = _pods(cluster, name)
    for pod in pods:
        _init_status(cluster, pod, {"running": {"startedAt": "2026-01-01T00:00:00Z"}})
    _wait_condition(cluster, name, "False", "Downloading", f"model ready in 0/{len(pods)} worker pod(s)")

    # Every reason `deepseek-pd download` exits with, in a random order, on a random pod.
    for reason in rng.sample(sorted(EXIT_CODES), len(EXIT_CODES)):
        pod, text = rng.choice(pods), _words(rng)
        written = DownloadError(reason, text).termination_message()
        _init_status(cluster, pod, {"terminated": {"exitCode": EXIT_CODES[reason], "reason": "Error",
                                                   "message": written}})
        _wait_condition(cluster, name, "False", reason, f"{pod}: {text}")
        degraded = _condition(cluster, name, "Degraded")
        assert degraded["status"] == "True" and degraded["reason"] == "ModelNotReady"
        assert (cluster.get(names.KIND, name)["status"]["phase"]) == "Degraded"
        _init_status(cluster, pod, {"running": {}})  # the kubelet's next attempt, before the failure shows
        _init_status(cluster, pod, {"waiting": {"reason": "CrashLoopBackOff"}},
                     last={"terminated": {"exitCode": EXIT_CODES[reason], "message": written}})
        _wait_condition(cluster, name, "False", reason,
                        f"{pod}: {text} (the kubelet is retrying; the download resumes)")
        _init_status(cluster, pod, {"running": {}})
        _wait_condition(cluster, name, "False", "Downloading")

    # Killed before it wrote a message: FallbackToLogsOnError leaves the log's tail; the exit code says why.
    pod, tail = rng.choice(pods), f"Traceback ... {_words(rng)}"
    _init_status(cluster, pod, {"terminated": {"exitCode": EXIT_CODES["NoSpace"], "message": tail}})
    _wait_condition(cluster, name, "False", "NoSpace", f"{pod}: {tail}")
    # The token Secret does not exist: the kubelet never starts the download.
    missing = f'secret "{raw["model"]["source"]["huggingFace"]["tokenSecret"]}" not found'
    _init_status(cluster, pod, {"waiting": {"reason": "CreateContainerConfigError", "message": missing}})
    _wait_condition(cluster, name, "False", "CreateContainerConfigError", f"{pod}: {missing}")

    failed_since = _condition(cluster, name, "ModelReady")["lastTransitionTime"]
    for p in pods:
        _init_status(cluster, p, {"terminated": {"exitCode": 0, "reason": "Completed"}}, phase="Running")
    ready = _wait_condition(cluster, name, "True", "Ready", f"model ready in {len(pods)}/{len(pods)} worker pod(s)")
    assert ready["lastTransitionTime"] >= failed_since
    assert _condition(cluster, name, "Degraded").get("reason") != "ModelNotReady"

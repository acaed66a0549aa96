"""The `ModelReady` condition, from what the kubelet reports about the `model` init containers.

Pure: `model_state(pods, revisions)` reads the pods a reconcile pass listed. Only pods of the
current revision of their role count (an old revision may name another model), terminating ones
do not. For each pod the init container's latest attempt decides:

    terminated, exit 0                      done
    terminated, exit != 0                   failed: weights.failures.parse_termination(exit code,
    waiting/running after such an attempt   termination message) -> ("TokenRefused", "...")
    waiting: CreateContainerConfigError,    failed, with the kubelet's reason (e.g. the token
      ErrImagePull, ImagePullBackOff, ...   Secret does not exist)
    running                                 downloading
    no status yet                           pending

ModelReady is True once some pod is done and none has failed; False with the first failure's
reason (TokenRefused, RepoNotFound, RevisionNotFound, ModelNotFound, ChecksumMismatch, NoSpace,
NetworkError, DownloadFailed, or the kubelet's) and "<pod>: <message>"; otherwise False with
reason Downloading (an init container runs) or Pending. The kubelet retries a failed init
container with backoff, and every retry resumes the download, so a failure can clear by itself.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from deepseek_pd.operator import names
from deepseek_pd.operator.build_model import INIT_CONTAINER
from deepseek_pd.weights.failures import parse_termination

# Waiting reasons of a container the kubelet cannot start: the download never ran.
START_FAILURES = ("CreateContainerConfigError", "CreateContainerError", "ErrImagePull",
                  "ImagePullBackOff", "InvalidImageName", "ErrImageNeverPull")


@dataclass(frozen=True)
class ModelState:
    ready: bool
    reason: str
    message: str

    @property
    def failed(self) -> bool:
        return not self.ready and self.reason not in ("Downloading", "Pending")


@dataclass(frozen=True)
class _PodModel:
    pod: str
    outcome: str  # "done" | "failed" | "running" | "pending"
    reason: str = ""
    message: str = ""


def _failure(pod: str, terminated: dict[str, Any], retrying: bool) -> _PodModel:
    code = int(terminated.get("exitCode") or 0)
    reason, message = parse_termination(code, terminated.get("message"))
    if terminated.get("reason") == "OOMKilled":
        message = f"OOMKilled (exit code {code}); {message}"
    if retrying:
        message += " (the kubelet is retrying; the download resumes)"
    return _PodModel(pod, "failed", reason, message)


def _pod_model(pod: dict[str, Any]) -> _PodModel:
    name = pod.get("metadata", {}).get("name", "")
    statuses = (pod.get("status") or {}).get("initContainerStatuses") or []
    status = next((s for s in statuses if s.get("name") == INIT_CONTAINER), None)
    if status is None:
        return _PodModel(name, "pending")
    state, last = status.get("state") or {}, status.get("lastState") or {}
    last_failed = "terminated" in last and int(last["terminated"].get("exitCode") or 0) != 0
    if "terminated" in state:
        if int(state["terminated"].get("exitCode") or 0) == 0:
            return _PodModel(name, "done")
        return _failure(name, state["terminated"], retrying=False)
    if last_failed:  # waiting in CrashLoopBackOff, or running the next attempt
        return _failure(name, last["terminated"], retrying=True)
    waiting = state.get("waiting") or {}
    if waiting.get("reason") in START_FAILURES:
        return _PodModel(name, "failed", waiting["reason"], waiting.get("message") or waiting["reason"])
    return _PodModel(name, "running" if "running" in state else "pending")


def _current(pod: dict[str, Any], revisions: dict[str, str]) -> bool:
    meta = pod.get("metadata", {})
    labels = meta.get("labels", {}) or {}
    role = labels.get(names.LABEL_ROLE)
    return role in revisions and labels.get(names.LABEL_REVISION) == revisions[role] \
        and not meta.get("deletionTimestamp")


def model_state(pods: list[dict[str, Any]], revisions: dict[str, str]) -> ModelState:
    """ModelReady from the worker pods (see the module docstring); `revisions[role]` is current."""
    seen = [_pod_model(p) for p in sorted(pods, key=lambda p: p.get("metadata", {}).get("name", ""))
            if _current(p, revisions)]
    failed = [p for p in seen if p.outcome == "failed"]
    done = sum(1 for p in seen if p.outcome == "done")
    if failed:
        first = failed[0]
        more = f" ({len(failed) - 1} more pod(s) failing)" if len(failed) > 1 else ""
        return ModelState(False, first.reason, f"{first.pod}: {first.message}{more}")
    progress = f"model ready in {done}/{len(seen)} worker pod(s)"
    if done:
        return ModelState(True, "Ready", progress)
    if any(p.outcome == "running" for p in seen):
        return ModelState(False, "Downloading", progress)
    return ModelState(False, "Pending", progress if seen else "no worker pod has started yet")

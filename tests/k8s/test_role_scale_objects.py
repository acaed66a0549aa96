"""Each role's scale subresource on a REAL kube-apiserver, driven by `kubectl scale`-style PATCHes and
by the REAL HorizontalPodAutoscaler controller of kube-controller-manager.

The operator's own pass (Reconciler, written through /status as in test_autoscaling_objects.py)
creates a DeepSeekRoleScale per role; a PATCH of its /scale moves spec.<role>.replicas of the
DeepSeekDeployment, an edit of the deployment moves it back. An HPA (autoscaling/v2) targeting
the prefill DeepSeekRoleScale, or the DeepSeekDeployment itself (decode), reads their /scale
(AbleToScale=True, SucceededGetScale) and, with the role below its minReplicas, writes /scale up
to it without any metric (the controller's own rule), which the operator carries into the spec.
Last, the live operator (kopf, in a thread) follows an HPA up and down through its watch on
DeepSeekRoleScale.
"""
from __future__ import annotations

import asyncio
import contextlib
import random
import threading
import time

import kopf
import pytest
import yaml
from test_autoscaling_objects import _spec
from test_weights_objects import _pass, apply_crd, dsd_path  # noqa: F401 - the CRD, installed or updated

from deepseek_pd.operator import names
from deepseek_pd.operator.handlers import OperatorConfig, run_operator
from deepseek_pd.operator.reconcile import Reconciler
from deepseek_pd.operator.role_scale import role_scale_crd_yaml
from pdtest.waiting import wait_until

pytestmark = [pytest.mark.timeout(600), pytest.mark.slow]


@pytest.fixture(scope="module")
def scales_path(admin_kube, dsd_path):  # noqa: F811
    """The DeepSeekRoleScale CRD as the chart ships it, installed; the path of dsd_path's namespace."""
    apply_crd(admin_kube, yaml.safe_load(role_scale_crd_yaml()))
    path = dsd_path.rsplit("/", 1)[0] + f"/{names.SCALE_PLURAL}"

    def served() -> bool:
        try:
            return admin_kube.list(path) is not None
        except Exception:  # noqa: BLE001 - 404 until the CRD is established
            return False
    wait_until(served, 30, "DeepSeekRoleScale CRD not served")
    return path


def _create(admin_kube, dsd_path: str, **decode: object) -> str:  # noqa: F811
    name = f"r{random.randrange(10**6)}"
    admin_kube.create(dsd_path, {"apiVersion": names.API_VERSION, "kind": names.KIND,
                                 "metadata": {"name": name}, "spec": _spec(**decode)})
    return name


def test_each_role_scale_follows_and_drives_its_role(admin_kube, dsd_path, scales_path):  # noqa: F811
    name = _create(admin_kube, dsd_path)
    status = _pass(admin_kube, dsd_path, name)
    for role in names.ROLES:
        scale = admin_kube.get(f"{scales_path}/{name}-{role}/scale")
        assert scale["spec"]["replicas"] == 1 and scale["status"]["replicas"] == status[role]["replicas"]
        assert scale["status"]["selector"] == status[role]["selector"]
        owner = admin_kube.get(f"{scales_path}/{name}-{role}")["metadata"]["ownerReferences"][0]
        assert owner["kind"] == names.KIND and owner["name"] == name  # collected with its deployment

    prefill = random.randint(2, 4)  # what `kubectl scale dsrs/<name>-prefill --replicas N` sends
    admin_kube.merge_patch(f"{scales_path}/{name}-prefill/scale", {"spec": {"replicas": prefill}})
    _pass(admin_kube, dsd_path, name)
    spec = admin_kube.get(f"{dsd_path}/{name}")["spec"]
    assert spec["prefill"]["replicas"] == prefill and spec["decode"]["replicas"] == 1
    status = _pass(admin_kube, dsd_path, name)  # the deployment's own pass creates the groups
    assert status["prefill"]["replicas"] == prefill
    assert admin_kube.get(f"{scales_path}/{name}-prefill/scale")["status"]["replicas"] == prefill

    edited = random.choice([n for n in range(1, 5) if n != prefill])  # the deployment edited directly
    admin_kube.merge_patch(f"{dsd_path}/{name}", {"spec": {"prefill": {"replicas": edited}}})
    _pass(admin_kube, dsd_path, name)
    assert admin_kube.get(f"{scales_path}/{name}-prefill/scale")["spec"]["replicas"] == edited
    assert admin_kube.get(f"{dsd_path}/{name}")["spec"]["prefill"]["replicas"] == edited


def _hpa(name: str, target_kind: str, target: str, minimum: int) -> dict:
    return {"apiVersion": "autoscaling/v2", "kind": "HorizontalPodAutoscaler", "metadata": {"name": name},
            "spec": {"scaleTargetRef": {"apiVersion": names.API_VERSION, "kind": target_kind, "name": target},
                     "minReplicas": minimum, "maxReplicas": minimum + 2,
                     "metrics": [{"type": "Resource", "resource": {
                         "name": "cpu", "target": {"type": "Utilization", "averageUtilization": 80}}}]}}


@pytest.mark.parametrize("role", names.ROLES)
def test_the_real_hpa_reads_and_writes_the_role_scale(admin_kube, dsd_path, scales_path, role):  # noqa: F811
    name = _create(admin_kube, dsd_path)
    _pass(admin_kube, dsd_path, name)
    minimum = random.randint(2, 3)
    # Decode also has the DeepSeekDeployment's own scale subresource; prefill only its DeepSeekRoleScale.
    kind, target = (names.KIND, name) if role == "decode" else (names.SCALE_KIND, f"{name}-{role}")
    hpas = dsd_path.split(f"/apis/{names.API_VERSION}")[1].rsplit("/", 1)[0]
    hpas = f"/apis/autoscaling/v2{hpas}/horizontalpodautoscalers"
    admin_kube.create(hpas, _hpa(f"{name}-{role}", kind, target, minimum))

    def condition(kind_: str) -> dict:
        hpa = admin_kube.get(f"{hpas}/{name}-{role}") or {}
        return next((c for c in (hpa.get("status") or {}).get("conditions") or [] if c["type"] == kind_), {})
    wait_until(lambda: condition("AbleToScale").get("status") == "True", 60,
               "HPA AbleToScale=True",
               lambda: str(admin_kube.get(f"{hpas}/{name}-{role}")))
    assert condition("AbleToScale")["reason"] in ("SucceededGetScale", "SucceededRescale"), condition("AbleToScale")
    path = f"{scales_path}/{name}-{role}" if role == "prefill" else f"{dsd_path}/{name}"
    # Below minReplicas the controller scales up without a metric: the real HPA wrote /scale.
    wait_until(lambda: admin_kube.get(f"{path}/scale")["spec"]["replicas"] == minimum, 60,
               f"HPA scaled to {minimum}",
               lambda: str(admin_kube.get(f"{hpas}/{name}-{role}")))
    _pass(admin_kube, dsd_path, name)
    assert admin_kube.get(f"{dsd_path}/{name}")["spec"][role]["replicas"] == minimum
    assert _pass(admin_kube, dsd_path, name)[role]["replicas"] == minimum  # the operator made the groups
    admin_kube.delete(f"{hpas}/{name}-{role}")


@contextlib.contextmanager
def _live_operator(admin_kube, namespace: str, resync_seconds: float):
    """The operator's kopf process (handlers.run_operator) in a thread, watching `namespace` of the
    real API server as the admin; stopped (and waited for) on exit."""
    creds = admin_kube.creds
    info = kopf.ConnectionInfo(server=creds.server, token=creds.token, ca_path=str(creds.ca_path))
    stop, ready = threading.Event(), threading.Event()
    errors: list[BaseException] = []

    def run() -> None:
        async def main() -> None:
            started = asyncio.Event()
            waiter = asyncio.create_task(started.wait())
            waiter.add_done_callback(lambda _: ready.set())
            await run_operator(OperatorConfig(resync_seconds=resync_seconds, login=lambda **_: info),
                               namespaces=(namespace,), stop_flag=stop, ready_flag=started)
        try:
            asyncio.run(main())
        except BaseException as exc:  # noqa: BLE001 - reported by the test, not lost in the thread
            errors.append(exc)
            ready.set()
    thread = threading.Thread(target=run, name="live-operator", daemon=True)
    thread.start()
    try:
        assert ready.wait(60) and not errors, errors
        yield
    finally:
        stop.set()
        thread.join(30)
        assert not errors, errors


def test_the_live_operator_follows_an_hpa_on_a_role_scale_at_once(admin_kube, dsd_path, scales_path,  # noqa: F811
                                                                   monkeypatch):
    """The real HPA controller moves the prefill DeepSeekRoleScale up (its minReplicas) and then
    down (its maxReplicas); the live operator, whose resync timer is far beyond the test, carries
    each write into spec.prefill.replicas and makes the groups within seconds: its watch on
    DeepSeekRoleScale, not the timer, picked the write up (before the watch: not for 10 minutes).
    Afterwards the operator is quiet: its own writes to the DeepSeekRoleScales run no more passes."""
    passes: list[float] = []
    reconcile = Reconciler.reconcile

    async def counted(self, body, logger):
        passes.append(time.monotonic())
        return await reconcile(self, body, logger)
    monkeypatch.setattr(Reconciler, "reconcile", counted)
    namespace = dsd_path.split("/namespaces/")[1].split("/")[0]
    hpas = f"/apis/autoscaling/v2/namespaces/{namespace}/horizontalpodautoscalers"
    with _live_operator(admin_kube, namespace, resync_seconds=600):
        name = _create(admin_kube, dsd_path)
        scale = f"{scales_path}/{name}-prefill"
        wait_until(lambda: ((admin_kube.get(scale) or {}).get("status") or {}).get("syncedReplicas") == 1, 30,
                   "the live operator's DeepSeekRoleScale")
        high = random.randint(2, 3)
        hpa = _hpa(f"{name}-prefill", names.SCALE_KIND, f"{name}-prefill", high)
        admin_kube.create(hpas, hpa)

        def follows(groups: int) -> bool:
            body = admin_kube.get(f"{dsd_path}/{name}")
            return body["spec"]["prefill"]["replicas"] == groups and \
                (body.get("status") or {}).get("prefill", {}).get("replicas") == groups
        wait_until(lambda: admin_kube.get(f"{scale}/scale")["spec"]["replicas"] == high, 60,
                   f"the HPA's write of {high} to /scale", lambda: str(admin_kube.get(f"{hpas}/{name}-prefill")))
        started = time.monotonic()  # from the HPA's write on: the operator's part
        wait_until(lambda: follows(high), 15, f"spec.prefill.replicas and its groups at the HPA's {high}",
                   lambda: str((admin_kube.get(f"{dsd_path}/{name}"), admin_kube.get(f"{hpas}/{name}-prefill"))))
        up_s = time.monotonic() - started
        # Down: an HPA above its maxReplicas scales down to it, metrics or not.
        admin_kube.merge_patch(f"{hpas}/{name}-prefill", {"spec": {"minReplicas": 1, "maxReplicas": 1}})
        wait_until(lambda: admin_kube.get(f"{scale}/scale")["spec"]["replicas"] == 1, 60,
                   "the HPA's write of 1 to /scale", lambda: str(admin_kube.get(f"{hpas}/{name}-prefill")))
        started = time.monotonic()
        wait_until(lambda: follows(1), 15, "spec.prefill.replicas and its groups back at 1",
                   lambda: str(admin_kube.get(f"{dsd_path}/{name}")))
        print(f"from the HPA's write to the operator's groups: up {up_s:.1f} s, down {time.monotonic() - started:.1f} s")
        time.sleep(1)  # a pass that the last writes queued may still run
        quiet = time.monotonic()
        time.sleep(3)  # the HPA controller syncs every 3 s meanwhile, writing nothing new
        assert len([t for t in passes if t >= quiet]) <= 1, f"{len(passes)} passes in all; a loop of passes"
        admin_kube.delete(f"{hpas}/{name}-prefill")

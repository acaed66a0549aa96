"""The process kubelet against the real control plane: what a pod is given (env, downward API,
Secret and ConfigMap volumes), its own IP (two pods bind the same port), cluster DNS through a
headless Service, probes, restarts, the `kubernetes` Service with a mounted service-account
token, scheduling refusals and deletion."""
from __future__ import annotations

import json
import os
import random
import urllib.request

import pytest

from pdtest.waiting import wait_until as _wait

pytestmark = [pytest.mark.timeout(600), pytest.mark.slow]

# Serves, on 0.0.0.0:8080, what the pod sees: its env, its mounted files, and (with PEER set) what
# the peer's /  answers through cluster DNS.
SERVER = r"""
import json, os, pathlib, sys, urllib.request
from http.server import BaseHTTPRequestHandler, HTTPServer
def read(path):
    p = pathlib.Path(path)
    return {"text": p.read_text(), "mode": oct(p.stat().st_mode & 0o777)} if p.exists() else None
class H(BaseHTTPRequestHandler):
    def do_GET(self):
        body = {"env": dict(os.environ), "config": read("/etc/app/config/greeting"),
                "secret": read("/etc/app/secret/token"), "hostname": os.uname().nodename,
                "sa_namespace": read("/var/run/secrets/kubernetes.io/serviceaccount/namespace")}
        if self.path == "/peer" and os.environ.get("PEER"):
            body["peer"] = json.loads(urllib.request.urlopen(os.environ["PEER"], timeout=5).read())
        if self.path == "/whoami":  # the mounted token, through the kubernetes Service
            import ssl
            sa = "/var/run/secrets/kubernetes.io/serviceaccount"
            req = urllib.request.Request(
                f"https://{os.environ['KUBERNETES_SERVICE_HOST']}:{os.environ['KUBERNETES_SERVICE_PORT']}"
                "/apis/authentication.k8s.io/v1/selfsubjectreviews", method="POST",
                data=json.dumps({"apiVersion": "authentication.k8s.io/v1", "kind": "SelfSubjectReview"}).encode(),
                headers={"Authorization": "Bearer " + open(f"{sa}/token").read(), "Content-Type": "application/json"})
            ctx = ssl.create_default_context(cafile=f"{sa}/ca.crt")
            body["whoami"] = json.loads(urllib.request.urlopen(req, context=ctx, timeout=10).read())
        data = json.dumps(body).encode()
        self.send_response(200); self.send_header("Content-Length", str(len(data))); self.end_headers()
        self.wfile.write(data)
    def log_message(self, *a): pass
HTTPServer(("0.0.0.0", 8080), H).serve_forever()
"""




@pytest.fixture
def namespace(admin_kube):
    name = f"kubelet-{random.randrange(10**6)}"
    admin_kube.create("/api/v1/namespaces", {"apiVersion": "v1", "kind": "Namespace", "metadata": {"name": name}})
    # Pods are refused until the service-account controller made the namespace's "default".
    _wait(lambda: admin_kube.get(f"/api/v1/namespaces/{name}/serviceaccounts/default"), 30, "no default ServiceAccount")
    yield name
    admin_kube.delete(f"/api/v1/namespaces/{name}")


def _pod(name: str, env: list[dict], labels: dict | None = None, **spec) -> dict:
    container = {"name": "app", "image": "example.invalid/app:1", "command": ["python3", "-c", SERVER],
                 "env": env, "ports": [{"name": "http", "containerPort": 8080}],
                 "readinessProbe": {"httpGet": {"path": "/", "port": "http"}, "periodSeconds": 5},
                 "volumeMounts": [{"name": "config", "mountPath": "/etc/app/config", "readOnly": True},
                                  {"name": "secret", "mountPath": "/etc/app/secret", "readOnly": True}]}
    return {"apiVersion": "v1", "kind": "Pod", "metadata": {"name": name, "labels": labels or {}},
            "spec": {"containers": [container], "terminationGracePeriodSeconds": 5,
                     "volumes": [{"name": "config", "configMap": {"name": "settings"}},
                                 {"name": "secret", "secret": {"secretName": "creds", "defaultMode": 0o400}}],
                     **spec}}


def _ready_pod(kube, namespace: str, name: str, timeout_s: float = 60) -> dict:
    def ready():
        pod = kube.get(f"/api/v1/namespaces/{namespace}/pods/{name}")
        conditions = {c["type"]: c["status"] for c in (pod or {}).get("status", {}).get("conditions", [])}
        return pod if conditions.get("Ready") == "True" else None
    return _wait(ready, timeout_s, f"pod {name} not Ready")


def _get(url: str) -> dict:
    with urllib.request.urlopen(url, timeout=10) as resp:
        return json.loads(resp.read())


def test_pods_get_their_inputs_own_ips_and_cluster_dns(admin_kube, process_kubelet, namespace):
    greeting, token, label = (f"{random.getrandbits(64):x}" for _ in range(3))
    api = f"/api/v1/namespaces/{namespace}"
    admin_kube.create(f"{api}/configmaps", {"apiVersion": "v1", "kind": "ConfigMap",
                                            "metadata": {"name": "settings"}, "data": {"greeting": greeting}})
    admin_kube.create(f"{api}/secrets", {"apiVersion": "v1", "kind": "Secret", "metadata": {"name": "creds"},
                                         "stringData": {"token": token}})
    admin_kube.create(f"{api}/services", {"apiVersion": "v1", "kind": "Service", "metadata": {"name": "peers"},
                                          "spec": {"clusterIP": "None", "selector": {"app": "first"},
                                                   "ports": [{"port": 8080}]}})
    env = [{"name": "POD_IP", "valueFrom": {"fieldRef": {"fieldPath": "status.podIP"}}},
           {"name": "LABEL", "valueFrom": {"fieldRef": {"fieldPath": "metadata.labels['tag']"}}},
           {"name": "TOKEN", "valueFrom": {"secretKeyRef": {"name": "creds", "key": "token"}}},
           {"name": "GREETING", "valueFrom": {"configMapKeyRef": {"name": "settings", "key": "greeting"}}},
           {"name": "BOTH", "value": "$(LABEL)-$(TOKEN)-$$(LABEL)"}]
    admin_kube.create(f"{api}/pods", _pod("first", env, {"app": "first", "tag": label},
                                          hostname="first", subdomain="peers"))
    peer = f"http://first.peers.{namespace}.svc:8080/"
    admin_kube.create(f"{api}/pods", _pod("second", env + [{"name": "PEER", "value": peer}], {"tag": label}))
    first, second = (_ready_pod(admin_kube, namespace, n) for n in ("first", "second"))
    assert first["status"]["podIP"] != second["status"]["podIP"]  # both bind 0.0.0.0:8080
    seen = _get(f"http://{first['status']['podIP']}:8080/")
    assert seen["env"]["POD_IP"] == first["status"]["podIP"]
    assert (seen["env"]["LABEL"], seen["env"]["TOKEN"], seen["env"]["GREETING"]) == (label, token, greeting)
    assert seen["env"]["BOTH"] == f"{label}-{token}-$(LABEL)"
    assert seen["config"]["text"] == greeting
    assert seen["secret"] == {"text": token, "mode": "0o400"}
    assert seen["hostname"] == "first"
    assert seen["sa_namespace"]["text"] == namespace  # the automounted service-account volume
    # ... mounted inside the pod's root only: the host gets no token directory.
    assert not os.path.exists("/var/run/secrets/kubernetes.io/serviceaccount/namespace")
    # The second pod reaches the first by its StatefulSet-style name through the headless Service.
    through_dns = _wait(lambda: _try(f"http://{second['status']['podIP']}:8080/peer"), 30, "peer not resolvable")
    assert through_dns["peer"]["env"]["POD_IP"] == first["status"]["podIP"]
    # The same names over DNS, from the node's server the pods' resolv.conf names (c-ares asks it).
    gateway = process_kubelet.network.gateway
    name = f"first.peers.{namespace}.svc.cluster.local"
    assert _dns_query(gateway, name) == [first["status"]["podIP"]]
    assert _dns_query(gateway, f"nothing-{random.randrange(10**6)}.{namespace}.svc") is None
    whoami = _get(f"http://{first['status']['podIP']}:8080/whoami")["whoami"]
    assert whoami["status"]["userInfo"]["username"] == f"system:serviceaccount:{namespace}:default"
    status = first["status"]["containerStatuses"][0]
    assert status["ready"] and status["restartCount"] == 0 and "running" in status["state"]


def _dns_query(server: str, name: str) -> list[str] | None:
    """A records of `name` (None for NXDOMAIN), asked over UDP like a stub resolver."""
    import socket
    import struct

    ident = random.randrange(65536)
    question = b"".join(bytes([len(p)]) + p.encode() for p in name.split(".")) + b"\0" + struct.pack("!HH", 1, 1)
    with socket.socket(socket.AF_INET, socket.SOCK_DGRAM) as sock:
        sock.settimeout(5)
        sock.sendto(struct.pack("!HHHHHH", ident, 0x0100, 1, 0, 0, 0) + question, (server, 53))
        reply = sock.recv(4096)
    got_id, flags, _, answers = struct.unpack("!HHHH", reply[:8])
    assert got_id == ident
    if flags & 0xF == 3:
        return None
    records, offset = [], 12 + len(question)
    for _ in range(answers):  # each: name pointer, type, class, ttl, rdlength, rdata
        _, _, _, _, length = struct.unpack("!HHHIH", reply[offset:offset + 12])
        records.append(socket.inet_ntoa(reply[offset + 12:offset + 12 + length]))
        offset += 12 + length
    return records


def _try(url: str):
    try:
        return _get(url)
    except OSError:
        return None


def test_restarts_follow_the_policy_and_delete_kills_the_process(admin_kube, process_kubelet, namespace):
    api = f"/api/v1/namespaces/{namespace}/pods"
    code = random.randint(2, 100)
    crash = {"apiVersion": "v1", "kind": "Pod", "metadata": {"name": "crash"},
             "spec": {"containers": [{"name": "c", "image": "none", "command": ["sh", "-c", f"sleep 0.3; exit {code}"]}]}}
    admin_kube.create(api, crash)
    pod = _wait(lambda: _restarted(admin_kube.get(f"{api}/crash"), 2), 60, "crash pod not restarted twice")
    status = pod["status"]["containerStatuses"][0]
    assert status["lastState"]["terminated"]["exitCode"] == code
    once = dict(crash, metadata={"name": "once"})
    once["spec"] = dict(crash["spec"], restartPolicy="Never")
    admin_kube.create(api, once)
    done = _wait(lambda: (p := admin_kube.get(f"{api}/once")) and p["status"].get("phase") == "Failed" and p, 60,
                 "a failed restartPolicy=Never pod did not become Failed")
    assert done["status"]["containerStatuses"][0]["state"]["terminated"]["exitCode"] == code
    assert done["status"]["containerStatuses"][0]["restartCount"] == 0

    sleeper = {"apiVersion": "v1", "kind": "Pod", "metadata": {"name": "sleeper"},
               "spec": {"terminationGracePeriodSeconds": 30,
                        "containers": [{"name": "c", "image": "none", "command": ["sleep", "3600"],
                                        "startupProbe": {"exec": {"command": ["true"]}}}]}}
    admin_kube.create(api, sleeper)
    running = _ready_pod(admin_kube, namespace, "sleeper")
    pid = int(running["status"]["containerStatuses"][0]["containerID"].removeprefix("process://"))
    os.kill(pid, 0)
    admin_kube.delete(f"{api}/sleeper")  # graceful: the kubelet stops it, then removes the object
    _wait(lambda: admin_kube.get(f"{api}/sleeper") is None, 30, "deleted pod still listed")
    with pytest.raises(ProcessLookupError):
        os.kill(pid, 0)


def _restarted(pod, times: int):
    statuses = (pod or {}).get("status", {}).get("containerStatuses") or []
    return pod if statuses and statuses[0]["restartCount"] >= times else None


def test_pods_that_do_not_fit_stay_pending_with_the_schedulers_reason(admin_kube, process_kubelet, namespace):
    api = f"/api/v1/namespaces/{namespace}/pods"
    gpu = {"apiVersion": "v1", "kind": "Pod", "metadata": {"name": "gpu"},
           "spec": {"containers": [{"name": "c", "image": "none", "command": ["true"],
                                    "resources": {"limits": {"nvidia.com/gpu": "8"}}}]}}
    admin_kube.create(api, gpu)

    def unschedulable():
        pod = admin_kube.get(f"{api}/gpu")
        return next((c for c in pod["status"].get("conditions", []) if c["type"] == "PodScheduled"
                     and c["status"] == "False"), None)
    condition = _wait(unschedulable, 30, "no Unschedulable condition")
    assert condition["reason"] == "Unschedulable" and "Insufficient nvidia.com/gpu" in condition["message"]
    assert not admin_kube.get(f"{api}/gpu")["spec"].get("nodeName")


def test_an_image_the_registry_lacks_waits_in_image_pull_backoff_until_pushed(admin_kube, process_kubelet, namespace):
    api = f"/api/v1/namespaces/{namespace}/pods"
    image = f"example.invalid/app:unpushed-{random.randrange(10**9)}"  # fresh: no earlier test pushed it
    pod = {"apiVersion": "v1", "kind": "Pod", "metadata": {"name": "puller"},
           "spec": {"containers": [{"name": "c", "image": image, "command": ["sleep", "3600"],
                                    "startupProbe": {"exec": {"command": ["true"]}}}]}}
    admin_kube.create(api, pod)
    seen: list[str] = []

    def backing_off():
        status = (admin_kube.get(f"{api}/puller") or {}).get("status", {})
        waiting = next(iter(status.get("containerStatuses") or []), {}).get("state", {}).get("waiting", {})
        if waiting.get("reason") and waiting["reason"] not in seen:
            seen.append(waiting["reason"])
        return status if waiting.get("reason") == "ImagePullBackOff" else None
    status = _wait(backing_off, 30, "no ImagePullBackOff for an image the registry lacks")
    waiting = status["containerStatuses"][0]["state"]["waiting"]
    # ErrImagePull at the failed pull, ImagePullBackOff while retrying (a slow poll may miss the first).
    assert set(seen) <= {"ContainerCreating", "ErrImagePull", "ImagePullBackOff"}, seen
    assert image in waiting["message"] and "not found" in waiting["message"]
    assert status["phase"] == "Pending" and not status["containerStatuses"][0].get("containerID")  # never started
    process_kubelet.registry.push(image)  # the next retry (back-off capped at 5 s) pulls it
    running = _ready_pod(admin_kube, namespace, "puller", timeout_s=30)
    assert running["status"]["containerStatuses"][0]["restartCount"] == 0
    assert running["status"]["containerStatuses"][0]["image"] == image

"""The real kopf operator on the emulated API server: Secrets created once and never rotated by a
reconcile, a missing API-key Secret reported as a condition, the NetworkPolicy kept in step."""
from __future__ import annotations

import base64
import pathlib
import random

import pytest
import yaml
from leader_urls import router_flags

from deepseek_pd.operator import names

pytestmark = [pytest.mark.timeout(120)]
EXAMPLES = pathlib.Path(__file__).resolve().parents[2] / "examples"
GENERATED = {"internal": "internal.secret", "router-control-plane": "control-plane-key"}


def _deployment(name: str) -> dict:
    body = yaml.safe_load((EXAMPLES / "cpu-minimal.yaml").read_text())
    body["metadata"] = {"name": name, "namespace": "llm"}
    return body


def _condition(cluster, name: str, type_: str) -> dict:
    status = (cluster.get(names.KIND, name) or {}).get("status") or {}
    return next((c for c in status.get("conditions", []) if c["type"] == type_), {})


def _secret_values(cluster, name: str) -> dict[str, bytes]:
    values = {}
    for suffix, key in GENERATED.items():
        secret = cluster.get("Secret", f"{name}-{suffix}")
        if secret is None:
            return {}
        values[suffix] = base64.b64decode(secret["data"][key])
    return values


def test_secrets_are_created_once_owned_mounted_and_removed_with_the_deployment(cluster):
    name = f"sec{random.randint(0, 9999)}"
    cluster.create(_deployment(name))
    uid = cluster.wait_for("the CR", lambda: cluster.get(names.KIND, name))["metadata"]["uid"]
    first = cluster.wait_for("generated secrets", lambda: _secret_values(cluster, name))
    assert len(first["internal"]) >= 32 and len(first["router-control-plane"]) >= 32
    for suffix in GENERATED:
        refs = cluster.get("Secret", f"{name}-{suffix}")["metadata"]["ownerReferences"]
        assert [(r["uid"], r["kind"], r["controller"]) for r in refs] == [(uid, names.KIND, True)]
    assert cluster.wait_for("SecretsReady", lambda: _condition(cluster, name, "SecretsReady"))["status"] == "True"

    sts = cluster.wait_for("decode group", lambda: cluster.get("StatefulSet", names.group_name(name, "decode", 0)))
    volumes = sts["spec"]["template"]["spec"]["volumes"]
    assert {"name": "internal-secret", "secret": {"secretName": f"{name}-internal", "defaultMode": 0o400}} in volumes
    router = cluster.get("Deployment", names.router_name(name))
    env = router["spec"]["template"]["spec"]["containers"][0]["env"]
    refs = [e["valueFrom"]["secretKeyRef"]["name"] for e in env if "valueFrom" in e]
    assert f"{name}-router-control-plane" in refs
    assert cluster.get("NetworkPolicy", names.network_policy_name(name)) is not None
    assert cluster.get("Service", names.prefill_peers_service_name(name)) is not None

    # A spec change that rolls everything leaves the secrets alone (no silent rotation).
    cluster.patch(names.KIND, name, {"spec": {"image": "ghcr.io/deepseek-pd/deepseek-pd:next",
                                              "router": {"policy": "round_robin"}}})
    cluster.wait_for("router patched", lambda: "round_robin" in cluster.get(
        "Deployment", names.router_name(name))["spec"]["template"]["spec"]["containers"][0]["args"])
    assert _secret_values(cluster, name) == first
    # Deleting a Secret is the documented rotation: the next pass creates a fresh one.
    cluster.delete("Secret", f"{name}-internal")
    fresh = cluster.wait_for("a fresh internal secret",
                             lambda: (_secret_values(cluster, name) or {}).get("internal"))
    assert fresh != first["internal"]

    cluster.delete(names.KIND, name)
    cluster.wait_for("the CR to go", lambda: cluster.get(names.KIND, name) is None)
    for suffix in GENERATED:
        assert cluster.get("Secret", f"{name}-{suffix}") is None
    assert cluster.get("NetworkPolicy", names.network_policy_name(name)) is None


def test_missing_api_key_secret_is_a_condition_until_it_exists(cluster):
    name = f"key{random.randint(0, 9999)}"
    user_secret = f"{name}-client-keys"
    body = _deployment(name)
    body["spec"]["router"] = {"apiKeySecret": {"name": user_secret, "key": "token"}}
    cluster.create(body)
    missing = cluster.wait_for("SecretsReady False",
                               lambda: _condition(cluster, name, "SecretsReady").get("status") == "False"
                               and _condition(cluster, name, "SecretsReady"))
    assert user_secret in missing["message"] and "not found" in missing["message"]
    # The router is rendered locked: it cannot start until the Secret exists, never open.
    router = cluster.wait_for("router", lambda: cluster.get("Deployment", names.router_name(name)))
    assert router_flags(router).api_key == "$(DEEPSEEK_PD_API_KEY)"
    assert cluster.get("StatefulSet", names.group_name(name, "prefill", 0)) is not None

    cluster.create({"apiVersion": "v1", "kind": "Secret", "metadata": {"name": user_secret, "namespace": "llm"},
                    "data": {"other": base64.b64encode(b"x").decode()}})
    wrong_key = cluster.wait_for("key missing reported", lambda: "no key 'token'" in
                                 _condition(cluster, name, "SecretsReady").get("message", ""))
    assert wrong_key
    token = b"sk-" + random.randbytes(8).hex().encode()
    cluster.patch("Secret", user_secret, {"data": {"token": base64.b64encode(token).decode()}})
    cluster.wait_for("SecretsReady True", lambda: _condition(cluster, name, "SecretsReady").get("status") == "True")
    cluster.delete(names.KIND, name)
    cluster.wait_for("the CR to go", lambda: cluster.get(names.KIND, name) is None)
    assert cluster.get("Secret", user_secret) is not None  # the user's Secret is never deleted


def test_disabling_the_network_policy_deletes_it(cluster):
    name = f"np{random.randint(0, 9999)}"
    cluster.create(_deployment(name))
    cluster.wait_for("NetworkPolicy", lambda: cluster.get("NetworkPolicy", names.network_policy_name(name)))
    cluster.patch(names.KIND, name, {"spec": {"networkPolicy": {"enabled": False}}})
    cluster.wait_for("NetworkPolicy gone",
                     lambda: cluster.get("NetworkPolicy", names.network_policy_name(name)) is None)
    cluster.delete(names.KIND, name)

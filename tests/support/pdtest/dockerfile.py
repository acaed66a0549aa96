"""Reading the Dockerfiles and the Makefile's image targets without docker (tests/docker).

- `instructions`: (stage, INSTRUCTION, arguments), continuation lines joined, comments dropped.
- `global_args` / `stage_args`: the ARG defaults before the first FROM, and the ARGs each stage
  declares (a global ARG is visible inside a stage only once the stage declares it again).
- `pip_requirements`: what the `pip install` lines of a stage ask for, with ${ARG}s filled in.
- `third_party_imports` / `installed_closure`: what the package imports, and what a `pip install`
  of a requirement installs on the image's platform (from the metadata installed here).
- `make_builds`: the `docker build` commands `make -n <target>` would run: Dockerfile and tags.
"""
from __future__ import annotations

import ast
import importlib.metadata
import pathlib
import re
import shlex
import subprocess
import sys

from packaging.markers import default_environment
from packaging.requirements import Requirement
from packaging.utils import canonicalize_name

ROOT = pathlib.Path(__file__).resolve().parents[3]
# The images' platform, for requirement markers (amd64 Linux; the CPU image's python:3.11-slim).
IMAGE_MARKERS = {**default_environment(), "python_version": "3.11", "platform_machine": "x86_64",
                 "sys_platform": "linux", "platform_system": "Linux"}


# ---- Dockerfile parsing ----------------------------------------------------------------------
def instructions(text: str) -> list[tuple[str, str, str]]:
    """(stage, INSTRUCTION, arguments) with continuation lines joined and comments dropped;
    instructions before the first FROM belong to stage ""."""
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


def global_args(text: str) -> dict[str, str]:
    """NAME -> default of every `ARG NAME=default` before the first FROM."""
    found = {}
    for stage, name, args in instructions(text):
        if name == "FROM":
            break
        if name == "ARG":
            key, _, value = args.partition("=")
            found[key] = value
    return found


def stage_args(text: str) -> dict[str, set[str]]:
    """stage -> the ARG names it declares (after its FROM)."""
    declared: dict[str, set[str]] = {}
    seen_from = False
    for stage, name, args in instructions(text):
        seen_from = seen_from or name == "FROM"
        if seen_from:
            declared.setdefault(stage, set())
            if name == "ARG":
                declared[stage].add(args.partition("=")[0])
    return declared


def used_args(text: str) -> dict[str, set[str]]:
    """stage -> the ${NAME} references of its RUN instructions, less the names an ENV sets (PATH)
    and the shell variables an earlier command of the same RUN assigns (`X=...; ... ${X}`)."""
    assigned = re.compile(r"\b([A-Za-z_][A-Za-z0-9_]*)=")
    env_names = {m for _, name, args in instructions(text) if name == "ENV" for m in assigned.findall(args)}
    used: dict[str, set[str]] = {}
    for stage, name, args in instructions(text):
        if name != "RUN" or not stage:
            continue
        shell_vars: set[str] = set()
        for command in re.split(r"&&|\|\||;", args):
            refs = set(re.findall(r"\$\{([A-Za-z_][A-Za-z0-9_]*)\}", command))
            used.setdefault(stage, set()).update(refs - env_names - shell_vars)
            leading = re.match(r"\s*([A-Za-z_][A-Za-z0-9_]*)=", command)
            if leading:
                shell_vars.add(leading.group(1))
    return used


def wheel_stage_sources(text: str) -> list[str]:
    """What the first stage that runs `pip wheel` (the package's) COPYs from the build context."""
    steps = instructions(text)
    stage = next(s for s, name, args in steps if name == "RUN" and "pip wheel" in args)
    sources = []
    for s, name, args in steps:
        if s == stage and name == "COPY" and "--from=" not in args:
            sources += shlex.split(args)[:-1]
    return sources


def image_extras(text: str) -> set[str]:
    """The extras of the `pip install` of the deepseek_pd wheel."""
    match = re.search(r"deepseek_pd-\*\.whl\)\[([A-Za-z0-9_,-]+)\]", text)
    assert match, "the Dockerfile installs no deepseek_pd wheel with extras"
    return set(match.group(1).split(","))


# pip options that take a value (the value is no requirement).
_PIP_VALUE_OPTIONS = {"-i", "--index-url", "--extra-index-url", "-w", "--wheel-dir", "-r", "--requirement",
                      "-c", "--constraint", "-t", "--target", "-f", "--find-links"}


def pip_requirements(text: str, stage: str) -> list[Requirement]:
    """The requirements of `stage`'s `pip install` commands, ${ARG}s replaced by their global
    defaults; wheel files installed by path or by `$(...)` are left out."""
    defaults = global_args(text)
    out = []
    for s, name, args in instructions(text):
        if s != stage or name != "RUN":
            continue
        words = shlex.split(args)
        i = 0
        while i < len(words) - 1:
            if words[i] != "pip" or words[i + 1] != "install":
                i += 1
                continue
            i += 2
            while i < len(words) and words[i] not in ("&&", "||", ";", "}"):
                word = words[i]
                if word in _PIP_VALUE_OPTIONS:
                    i += 2
                    continue
                i += 1
                last = word.endswith(";")  # a command's last word inside `{ ...; }`
                word = word.rstrip(";")
                if not (word.startswith("-") or "$(" in word or "/" in word):
                    out.append(Requirement(re.sub(r"\$\{([A-Za-z_0-9]+)\}", lambda m: defaults[m.group(1)], word)))
                if last:
                    break
    return out


# ---- what the package imports ----------------------------------------------------------------
def mapped_folders() -> tuple[str, ...]:
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
    for folder in ("deepseek_pd", *mapped_folders()):
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


def unprovided_modules(closure: set[str], not_from_the_image: dict[str, str]) -> dict[str, str]:
    """Imported top-level modules that no distribution of `closure` provides (as installed here)."""
    providers = importlib.metadata.packages_distributions()
    missing = {}
    for module, where in third_party_imports().items():
        dists = {canonicalize_name(d) for d in providers.get(module, [])}
        if module not in not_from_the_image and not dists & closure:
            missing[module] = f"{where} (provided by {sorted(dists) or 'nothing installed'})"
    return missing


# ---- the Makefile ----------------------------------------------------------------------------
def make_builds(target: str, *variables: str) -> dict[str, list[str]]:
    """Dockerfile -> the tags of each `docker build` that `make -n <target>` runs (context: the
    repository)."""
    proc = subprocess.run(["make", "-n", "-s", target, *variables], cwd=ROOT, capture_output=True,
                          text=True, timeout=60)
    assert proc.returncode == 0, proc.stderr
    builds: dict[str, list[str]] = {}
    for line in proc.stdout.splitlines():
        if " build " not in line:
            continue
        words = shlex.split(line)
        assert words[-1] == ".", line  # the repository as the context
        dockerfile = words[words.index("-f") + 1] if "-f" in words else "Dockerfile"
        builds.setdefault(dockerfile, []).extend(words[i + 1] for i, w in enumerate(words) if w == "-t")
    return builds

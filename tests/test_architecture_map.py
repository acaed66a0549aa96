"""docs/architecture.md stays a true map of the tree (STYLE.md: one line per package; issue 24:
the doc opens with the map): every folder of the package is in the map, every module is named
somewhere in the page, and every file the page names exists. A moved, renamed or added module
that the page does not follow fails here, with the names to fix."""
from __future__ import annotations

import re
import subprocess
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
DOC = REPO / "docs" / "architecture.md"
PACKAGE_FOLDERS = ("deepseek_pd", "model", "workers", "operator", "proto")
# Named by a rule rather than one by one: "`commands/`, one module per sub-command"; `python -m`.
NAMED_BY_RULE = re.compile(r"^deepseek_pd/commands/|__main__\.py$|__init__\.py$|_pb2(_grpc)?\.py$")
_PATH = re.compile(r"(?<![\w./-])((?:[\w-]+/)*[\w-]+\.(?:py|sh|proto))\b")


def _tracked() -> list[str]:
    out = subprocess.run(["git", "ls-files", "--cached", "--others", "--exclude-standard"], cwd=REPO,
                         capture_output=True, text=True, check=True).stdout
    return [f for f in out.split() if (REPO / f).exists()]


def _modules(files: list[str]) -> list[str]:
    return [f for f in files if f.endswith(".py") and f.split("/")[0] in PACKAGE_FOLDERS
            and not NAMED_BY_RULE.search(f)]


def _map_block(text: str) -> str:
    """The fenced tree under "## The map"."""
    section = text.split("## The map", 1)[1]
    return section.split("```", 2)[1]


def test_every_module_is_named():
    text = DOC.read_text()
    missing = [m for m in _modules(_tracked())
               if not re.search(r"(?<![\w])" + re.escape(Path(m).stem) + r"(?![\w])", text)]
    assert not missing, f"docs/architecture.md names none of these modules (add a line where they live): {missing}"


def test_every_package_folder_is_in_the_map():
    block = _map_block(DOC.read_text())
    folders = sorted({str(Path(m).parent) for m in _modules(_tracked())
                      if len(Path(m).parts) > 2 and Path(m).parts[0] in ("model", "workers")})
    unmapped = [f for f in folders if f"{Path(f).name}/" not in block]
    assert not unmapped, f"the map in docs/architecture.md lacks these folders: {unmapped}"


def test_every_file_the_page_names_exists():
    files = _tracked()
    named = {n for n in _PATH.findall(DOC.read_text()) if not n.startswith("deepseek_pd.")}  # `deepseek_pd.proto`: a package
    stale = sorted(n for n in named if not any(f == n or f.endswith("/" + n) for f in files))
    assert not stale, f"docs/architecture.md names files that do not exist (moved? renamed?): {stale}"


def test_the_checks_see_a_stale_name(tmp_path):
    """The matchers themselves: a path in prose is found, a module's stem is found only as a word."""
    assert _PATH.findall("see `workers/engine/gone.py` and bench/x.sh, not a.pyc") == ["workers/engine/gone.py",
                                                                                       "bench/x.sh"]
    assert _modules(["model/kv/pool.py", "model/__init__.py", "deepseek_pd/commands/up.py"]) == ["model/kv/pool.py"]

"""`deepseek-pd operator ...` commands and the image recipe that ships them."""
from __future__ import annotations

import pathlib
import re
import subprocess
import sys

import pytest
import yaml

from deepseek_pd.cli import main
from deepseek_pd.operator.crd import build_crd, crd_yaml
from deepseek_pd.operator.crd_spec import DEFAULT_RUN_AS_USER

pytestmark = pytest.mark.timeout(120)
ROOT = pathlib.Path(__file__).resolve().parents[2]


def test_crd_command_prints_the_generated_crd(capsys, tmp_path):
    assert main(["operator", "crd"]) == 0
    printed = capsys.readouterr().out
    assert printed == crd_yaml() and yaml.safe_load(printed) == build_crd()
    target = tmp_path / "crd.yaml"
    assert main(["operator", "crd", "--output", str(target)]) == 0
    assert target.read_text() == printed


def test_bad_flags_are_one_line_errors():
    result = subprocess.run([sys.executable, "-m", "deepseek_pd.cli", "operator", "run",
                             "--resync-seconds", "-5"], capture_output=True, text=True, timeout=60)
    assert result.returncode == 2
    assert result.stderr.strip() == "deepseek-pd operator: error: --resync-seconds must be > 0, got -5.0"


def test_run_without_a_watch_scope_is_refused():
    """Cluster-wide is asked for (--all-namespaces), never the silent default of no --namespace."""
    result = subprocess.run([sys.executable, "-m", "deepseek_pd.cli", "operator", "run"],
                            capture_output=True, text=True, timeout=60)
    assert result.returncode == 2
    assert result.stderr.strip() == ("deepseek-pd operator: error: name the namespaces to watch: "
                                     "--namespace NS (repeatable) or --all-namespaces")
    both = subprocess.run([sys.executable, "-m", "deepseek_pd.cli", "operator", "run", "--namespace", "a",
                           "--all-namespaces"], capture_output=True, text=True, timeout=60)
    assert both.returncode == 2 and "not allowed with argument" in both.stderr


def test_dockerfile_installs_every_mapped_package_and_the_pinned_torch():
    dockerfile = (ROOT / "Dockerfile").read_text()
    copied = set(re.findall(r"^COPY (\S+) \1$", dockerfile, flags=re.M))
    setup = (ROOT / "setup.py").read_text()
    mapped = set(re.search(r"MAPPED_FOLDERS = \(([^)]*)\)", setup).group(1).replace('"', "").replace(" ", "")
                 .strip(",").split(","))
    assert mapped | {"deepseek_pd"} <= copied
    makefile_torch = re.search(r"torch==([\d.]+)", (ROOT / "Makefile").read_text()).group(1)
    assert f"ARG TORCH_VERSION={makefile_torch}" in dockerfile
    assert "[serve,operator]" in dockerfile and f"USER {DEFAULT_RUN_AS_USER}\n" in dockerfile

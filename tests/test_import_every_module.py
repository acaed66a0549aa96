"""Every module of the installed package imports, each one first in a fresh package state.

A folder move can leave a name that no test happens to import (a patch target, a module loaded by
name), and a package `__init__` that imports its submodules can make an import circle that shows
only when one particular module is imported first. So each module is imported with every
`deepseek_pd` module dropped from `sys.modules` before it (third-party modules such as torch stay
loaded, which keeps this to seconds), in one child interpreter so that nothing leaks into the
test session.
"""
from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

from test_import_graph import package_modules

REPO = Path(__file__).resolve().parents[1]

_CHILD = r"""
import importlib, json, sys
failures = {}
for name in json.loads(sys.argv[1]):
    for loaded in [m for m in sys.modules if m == "deepseek_pd" or m.startswith("deepseek_pd.")]:
        del sys.modules[loaded]
    try:
        importlib.import_module(name)
    except BaseException as error:  # an import may raise anything; each one is reported
        failures[name] = f"{type(error).__name__}: {error}"
print(json.dumps(failures))
"""


def test_every_module_imports_first():
    names = sorted(package_modules())
    assert len(names) > 200, "the module walk found too few modules"
    out = subprocess.run([sys.executable, "-c", _CHILD, json.dumps(names)], cwd=REPO, check=True,
                         capture_output=True, text=True, timeout=540)
    failures = json.loads(out.stdout.strip().splitlines()[-1])
    assert not failures, "modules that do not import:\n" + "\n".join(f"  {k}: {v}" for k, v in failures.items())

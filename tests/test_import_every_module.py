"""Every module of the installed package imports, each one first in a fresh package state.

A folder move can leave a name that no test happens to import (a patch target, a module loaded by
name), and a package `__init__` that imports its submodules can make an import circle that shows
only when one particular module is imported first. So each module is imported with every
`deepseek_pd` module dropped from `sys.modules` before it (third-party modules such as torch stay
loaded, which keeps this to seconds), in child interpreters so that nothing leaks into the
test session. The modules are dealt round-robin to one child per core, which run at once: each
module is still imported first in a fresh package state, and the suite's serial run leaves the
second core idle otherwise (15 s in one child, ~8 s in two on CI's two cores).
"""
from __future__ import annotations

import json
import os
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


def _children() -> int:
    """One child per core this process may use, at least one and at most two (CI has two)."""
    return max(1, min(2, len(os.sched_getaffinity(0))))


def test_every_module_imports_first():
    names = sorted(package_modules())
    assert len(names) > 200, "the module walk found too few modules"
    count = _children()
    children = [subprocess.Popen([sys.executable, "-c", _CHILD, json.dumps(names[i::count])], cwd=REPO,
                                 stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True) for i in range(count)]
    failures: dict[str, str] = {}
    try:
        for child in children:
            out, err = child.communicate(timeout=540)
            assert child.returncode == 0, err[-3000:]
            failures.update(json.loads(out.strip().splitlines()[-1]))
    finally:
        for child in children:
            child.kill()  # a no-op on one that has exited; a stuck one goes with the test
    assert not failures, "modules that do not import:\n" + "\n".join(f"  {k}: {v}" for k, v in failures.items())

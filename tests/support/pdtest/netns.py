"""Runs a Python script inside a private network namespace (`unshare -n`), for Mooncake.

Mooncake's TransferEngine binds 0.0.0.0 whatever it is asked, so its tests get a namespace with
only a loopback interface. Skips (with the reason) where namespaces or libibverbs are missing.
"""
from __future__ import annotations

import ctypes.util
import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

SUPPORT_ROOT = Path(__file__).resolve().parents[1]  # the folder that holds `pdtest`


def skip_unless_netns_and_mooncake() -> None:
    if shutil.which("unshare") is None or shutil.which("ip") is None:
        pytest.skip("needs unshare and ip (util-linux, iproute2: scripts/system-deps.sh)")
    probe = subprocess.run(["unshare", "-n", "true"], capture_output=True, timeout=30)
    if probe.returncode != 0:
        pytest.skip(f"unshare -n is not permitted here: {probe.stderr.decode().strip()}")
    if ctypes.util.find_library("ibverbs") is None:
        pytest.skip("libibverbs.so.1 is missing (Debian libibverbs1; scripts/system-deps.sh installs it)")
    try:
        import mooncake.engine  # noqa: F401
    except (ImportError, OSError) as exc:
        pytest.skip(f"mooncake is not importable: {exc}")


def run_in_netns(script: Path, *args: str, timeout_s: float = 240) -> str:
    """Runs `script` with this interpreter in a fresh namespace; returns its stdout.

    The script is run by path, so `pdtest` reaches it through PYTHONPATH, as pytest's own
    `pythonpath` setting gives it to the tests.
    """
    skip_unless_netns_and_mooncake()
    command = " ".join([sys.executable, str(script), *args])
    env = dict(os.environ)
    env["PYTHONPATH"] = os.pathsep.join(filter(None, [str(SUPPORT_ROOT), env.get("PYTHONPATH")]))
    result = subprocess.run(["unshare", "-n", "sh", "-c", f"ip link set lo up && exec {command}"],
                            capture_output=True, text=True, timeout=timeout_s, cwd=script.parent, env=env)
    assert result.returncode == 0, f"{script.name} failed ({result.returncode}):\n{result.stdout}\n{result.stderr[-12000:]}"
    return result.stdout

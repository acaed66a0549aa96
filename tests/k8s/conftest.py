"""Session fixtures of the end-to-end tests against a real control plane (control_plane.py).

`control_plane` builds the binaries on first use (scripts/build-control-plane.sh; `make test`
runs it before pytest) and starts etcd + kube-apiserver + kube-controller-manager once per session.
"""
from __future__ import annotations

import pathlib
import sys

import pytest

sys.path.insert(0, str(pathlib.Path(__file__).resolve().parent))  # kube_rest, pki, control_plane

from control_plane import ControlPlane, ControlPlaneUnavailable, control_plane_binaries  # noqa: E402
from kube_rest import Kube  # noqa: E402


@pytest.fixture(scope="session")
def control_plane(tmp_path_factory):
    try:
        bin_dir = control_plane_binaries()
    except ControlPlaneUnavailable as exc:
        pytest.skip(f"no Kubernetes control plane: {exc}")
    plane = ControlPlane(tmp_path_factory.mktemp("control-plane"), bin_dir)
    plane.start()
    try:
        yield plane
    finally:
        plane.stop()


@pytest.fixture(scope="session")
def admin_kube(control_plane) -> Kube:
    return Kube(control_plane.admin)


@pytest.fixture(scope="session")
def process_kubelet(control_plane, admin_kube, tmp_path_factory):
    """One Node whose pods run as local processes (process_kubelet.py); skips without root."""
    import os
    import urllib.parse

    from process_kubelet import KubeletConfig, ProcessKubelet, sandbox_support

    reason = sandbox_support()
    if reason:
        pytest.skip(f"no process kubelet here: {reason}")
    server = urllib.parse.urlsplit(control_plane.server)
    # What an image of this project would give: its Python environment first on PATH.
    image_env = {"PATH": f"{pathlib.Path(sys.executable).parent}:/usr/local/bin:/usr/bin:/bin:/usr/sbin:/sbin",
                 "HOME": os.environ.get("HOME", "/root"), "PYTHONUNBUFFERED": "1"}
    kubelet = ProcessKubelet(admin_kube, KubeletConfig(
        workdir=tmp_path_factory.mktemp("kubelet"), image_env=image_env,
        apiserver=(server.hostname, server.port))).start()
    try:
        yield kubelet
    finally:
        kubelet.stop()

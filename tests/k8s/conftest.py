"""Session fixtures of the end-to-end tests against a real control plane (control_plane.py).

`control_plane` builds the binaries on first use (scripts/build-control-plane.sh, started in the
background once tests of this folder are collected, and these tests run last: background_build.py)
and starts etcd + kube-apiserver + kube-controller-manager once per session.
They, and the process kubelet, stop as soon as the run leaves this directory (`_leave_directory`):
a session fixture would otherwise keep them, and the pods the kubelet still runs, busy through
every later test folder.
"""
from __future__ import annotations

import pathlib
import sys
from typing import Callable

import pytest

HERE = pathlib.Path(__file__).resolve().parent
sys.path.insert(0, str(HERE))  # kube_rest, pki, control_plane

_stops: list[Callable[[], None]] = []  # stop functions of the running session fixtures, in start order


def _stop_once(stop: Callable[[], None]) -> Callable[[], None]:
    done = False

    def once() -> None:
        nonlocal done
        if not done:
            done = True
            stop()
    _stops.append(once)
    return once


def _leave_directory() -> None:
    while _stops:
        _stops.pop()()  # the kubelet before the control plane it talks to


@pytest.hookimpl(trylast=True)  # after pytest has finalised the module's fixtures (they still use the API)
def pytest_runtest_teardown(item, nextitem) -> None:
    if nextitem is None or HERE not in pathlib.Path(str(nextitem.path)).resolve().parents:
        _leave_directory()

from background_build import BACKGROUND  # noqa: E402
from control_plane import ControlPlane, ControlPlaneUnavailable, control_plane_binaries  # noqa: E402
from kube_rest import Kube  # noqa: E402


@pytest.hookimpl(trylast=True)  # after -m/-k deselection: only tests that will run count
def pytest_collection_modifyitems(session, config, items) -> None:
    """Tests of this folder run last, and the control-plane build starts now, behind the others."""
    mine = [item for item in items if HERE in pathlib.Path(str(item.path)).resolve().parents]
    if not mine or config.option.collectonly:
        return
    ours = set(map(id, mine))
    items[:] = [item for item in items if id(item) not in ours] + mine
    BACKGROUND.start()


def pytest_sessionfinish(session, exitstatus) -> None:
    BACKGROUND.stop()


def pytest_terminal_summary(terminalreporter) -> None:
    if BACKGROUND.waited is not None:  # where a cold build's time went (issue 19: the 30-minute bar)
        terminalreporter.write_line(f"control-plane build: started in the background at collection; "
                                    f"the tests of tests/k8s waited {BACKGROUND.waited:.0f}s for it")


@pytest.fixture(scope="session")
def control_plane(tmp_path_factory):
    BACKGROUND.wait()
    try:
        bin_dir = control_plane_binaries()
    except ControlPlaneUnavailable as exc:
        pytest.skip(f"no Kubernetes control plane: {exc}")
    plane = ControlPlane(tmp_path_factory.mktemp("control-plane"), bin_dir)
    stop = _stop_once(plane.stop)
    plane.start()
    try:
        yield plane
    finally:
        stop()


@pytest.fixture(scope="session")
def real_scheduler(control_plane) -> str:
    """The real kube-scheduler, running in the session's control plane; its schedulerName."""
    from control_plane import REAL_SCHEDULER

    control_plane.start_scheduler()
    return REAL_SCHEDULER


@pytest.fixture(scope="session")
def admin_kube(control_plane) -> Kube:
    return Kube(control_plane.admin)


@pytest.fixture(scope="session")
def process_kubelet(control_plane, admin_kube, tmp_path_factory):
    """One Node whose pods run as local processes (process_kubelet.py); skips without root."""
    import os
    import urllib.parse

    from image_registry import PLACEHOLDER_IMAGES, made_images
    from process_kubelet import KubeletConfig, ProcessKubelet, sandbox_support

    reason = sandbox_support()
    if reason:
        pytest.skip(f"no process kubelet here: {reason}")
    server = urllib.parse.urlsplit(control_plane.server)
    # What an image of this project would give: its Python environment first on PATH. The node's
    # registry holds what `make image` tags (the chart's and the example's images).
    # OMP_NUM_THREADS=1: the node's pods share two real cores (as pdtest.local_pods' node does);
    # each worker's torch would otherwise run a thread per core, and the threads of a dozen
    # processes spinning at OpenMP barriers made a tiny model's step ~25x slower under load.
    image_env = {"PATH": f"{pathlib.Path(sys.executable).parent}:/usr/local/bin:/usr/bin:/bin:/usr/sbin:/sbin",
                 "HOME": os.environ.get("HOME", "/root"), "PYTHONUNBUFFERED": "1", "OMP_NUM_THREADS": "1"}
    kubelet = ProcessKubelet(admin_kube, KubeletConfig(
        workdir=tmp_path_factory.mktemp("kubelet"), image_env=image_env,
        apiserver=(server.hostname, server.port), images=made_images() | PLACEHOLDER_IMAGES))
    stop = _stop_once(kubelet.stop)
    kubelet.start()
    try:
        yield kubelet
    finally:
        stop()


@pytest.fixture(scope="session")
def models(tmp_path_factory) -> pathlib.Path:
    """The hostPath the examples mount at /models: the tiny checkpoint, written by the CLI once
    for every module (its weights come from a fixed seed, and the pods only read it). In this
    process: a child's start-up (torch) would cost seconds."""
    from deepseek_pd.cli import main

    directory = tmp_path_factory.mktemp("models")
    assert main(["make-tiny-model", str(directory / "tiny")]) == 0
    return directory


@pytest.fixture(scope="session")
def offline_engine(models):
    """The single-process engine whose greedy tokens the router must give (e2e page/chunk sizes);
    one for every module: greedy answers do not depend on what it served before."""
    from deepseek_pd.workers.engine.offline import Engine
    from pdtest.e2e_cluster import CHUNKED_PREFILL_SIZE, PAGE_SIZE

    return Engine(model=str(models / "tiny"), chunked_prefill_size=CHUNKED_PREFILL_SIZE, page_size=PAGE_SIZE)


@pytest.fixture(scope="session", autouse=True)
def one_torch_thread_beside_the_pods():
    """The oracles these tests compute in-process (offline engines) run on one torch thread, as the
    node's pods do (OMP_NUM_THREADS above): 8 greedy answers of 24 tokens took 50-180 s on two
    threads beside the pods under load, and under a second on one."""
    import torch

    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(threads)


@pytest.fixture(scope="session")
def third_party_crds(admin_kube):
    """The pinned third-party CRDs (ServiceMonitor) installed into the control plane:
    `third_party_crds.admit(obj)` is the server's own verdict on an object of their kinds."""
    from third_party_crds import ThirdPartyCrds

    return ThirdPartyCrds.install(admin_kube)

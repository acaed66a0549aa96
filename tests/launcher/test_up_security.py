"""What `up` does about local exposure: the router's key file is this user's alone, and
`--kv-transport mooncake` says that Mooncake listens beyond `--host`."""
from __future__ import annotations

import os
import random
import stat

import pytest

from deepseek_pd.launcher import cluster as cluster_module
from deepseek_pd.launcher.cluster import ClusterSpec, LocalCluster


class _Started(Exception):
    pass


def test_up_with_mooncake_warns_that_it_listens_on_every_interface(tmp_path, monkeypatch, caplog):
    def stop_here(model):
        raise _Started
    monkeypatch.setattr(cluster_module, "resolve_model_dir", stop_here)
    for transport in ("grpc", "mooncake"):
        caplog.clear()
        with caplog.at_level("WARNING"), pytest.raises(_Started):
            LocalCluster(ClusterSpec(kv_transport=transport, log_dir=tmp_path)).start()
        warned = [r.getMessage() for r in caplog.records if "ALL interfaces" in r.getMessage()]
        assert len(warned) == (transport == "mooncake"), warned
        assert all("127.0.0.1" in w for w in warned)


def test_ups_mooncake_warning_names_the_ports_a_firewall_must_close(tmp_path, monkeypatch, caplog):
    """Mooncake cannot be told to bind one address, so what `up` can do is name the ports that a
    firewall must keep other hosts off: the range its engines draw from under MC_MIN/MAX_RPC_PORT,
    both ends (netns_mooncake_ports.py checks that range against the real engine)."""
    def stop_here(model):
        raise _Started
    monkeypatch.setattr(cluster_module, "resolve_model_dir", stop_here)
    low = random.randrange(18000, 30000)
    high = low + random.randrange(1, 2000)
    monkeypatch.setenv("MC_MIN_RPC_PORT", str(low))
    monkeypatch.setenv("MC_MAX_RPC_PORT", str(high))
    with caplog.at_level("WARNING"), pytest.raises(_Started):
        LocalCluster(ClusterSpec(kv_transport="mooncake", log_dir=tmp_path)).start()
    [warned] = [r.getMessage() for r in caplog.records if "ALL interfaces" in r.getMessage()]
    assert f"{low}-{high}" in warned, warned


def test_the_control_plane_key_file_is_private_even_if_it_existed(tmp_path, monkeypatch):
    class NoProcess:
        def __init__(self, *args) -> None:
            pass

        def start(self) -> None:
            pass
    monkeypatch.setattr(cluster_module, "ManagedProcess", NoProcess)
    key_file = tmp_path / "control-plane-key"
    key_file.write_text("an old key, readable by everyone\n")
    os.chmod(key_file, random.choice([0o644, 0o666, 0o604, 0o640]))
    cluster = LocalCluster(ClusterSpec(log_dir=tmp_path))
    cluster.model_dir = tmp_path
    cluster._start_router()
    assert stat.S_IMODE(key_file.stat().st_mode) == 0o600
    assert key_file.read_text() == cluster.control_plane_key + "\n"


def test_a_secret_file_that_existed_readable_by_others_is_rewritten_private(tmp_path):
    from deepseek_pd.workers.transport.internal_auth import create_secret_file, read_secret_file

    path = tmp_path / "internal.secret"
    path.write_text("x" * 64)
    os.chmod(path, 0o644)
    assert read_secret_file(create_secret_file(path)) != b"x" * 64
    assert stat.S_IMODE(path.stat().st_mode) == 0o600
    link = tmp_path / "link"
    link.symlink_to(tmp_path / "elsewhere")
    with pytest.raises(OSError):
        create_secret_file(link)

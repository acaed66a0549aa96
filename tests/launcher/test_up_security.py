"""What `up` does about local exposure: the router's key file is this user's alone, and
`--kv-transport mooncake` says that Mooncake listens beyond `--host`."""
from __future__ import annotations

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


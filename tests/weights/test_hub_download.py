"""`deepseek-pd download` against a local stand-in for the Hub (hub_server.FakeHub), offline.

The oracle is the checkpoint directory the server serves: the downloaded snapshot must equal it
byte for byte, however the transfer was cut.
"""
from __future__ import annotations

import os
import random
import subprocess
import sys
from pathlib import Path

import pytest
from hub_server import COMMIT, FakeHub

from deepseek_pd.weights.failures import EXIT_CODES, DownloadError
from deepseek_pd.weights.hub_download import DownloadConfig, HubSource, download_snapshot
from deepseek_pd.weights.layout import STATE_DIR, snapshot_dir

pytestmark = pytest.mark.timeout(120)
REPO = "tiny-org/tiny-v3"
# A shard bigger than huggingface_hub's read chunk (10 MiB): it writes a download in whole chunks,
# so a cut inside the first chunk would leave nothing to resume from.
WEIGHTS = "model-extra.safetensors"


def _chunk() -> int:
    from huggingface_hub import constants

    return constants.DOWNLOAD_CHUNK_SIZE


@pytest.fixture(scope="module")
def checkpoint(tmp_path_factory) -> Path:
    """The tiny checkpoint (random arch and seed) plus a random shard of 2.5 read chunks."""
    from deepseek_pd.model.checkpoint.tiny import make_tiny_model

    directory = tmp_path_factory.mktemp("ckpt") / "tiny"
    make_tiny_model(directory, arch=random.choice(["v2", "v3"]), seed=random.randrange(1 << 30))
    (directory / WEIGHTS).write_bytes(random.randbytes(_chunk() * 5 // 2))
    return directory


def _cut_point(checkpoint: Path) -> tuple[int, int]:
    """A random cut after the first read chunk, and where huggingface_hub resumes it (the bytes it
    had written: whole chunks)."""
    size = (checkpoint / WEIGHTS).stat().st_size
    cut = random.randrange(_chunk() + 1, size - 1)
    return cut, cut // _chunk() * _chunk()


def _assert_same_files(original: Path, downloaded: Path) -> None:
    expected = {p.relative_to(original).as_posix(): p.read_bytes() for p in original.rglob("*") if p.is_file()}
    got = {p.relative_to(downloaded).as_posix(): p.read_bytes() for p in downloaded.rglob("*")
           if p.is_file() and STATE_DIR not in p.relative_to(downloaded).parts}
    assert got.keys() == expected.keys()
    for name, data in expected.items():
        assert got[name] == data, name


def _config(cache: Path, **kw) -> DownloadConfig:
    return DownloadConfig(cache, retry_wait_s=0.01, progress_interval_s=0.0, **kw)


def test_download_equals_the_served_files_and_a_second_run_fetches_nothing(checkpoint, tmp_path):
    token = f"hf_{random.randrange(1 << 60):x}"
    with FakeHub(REPO, checkpoint, token=token) as hub:
        dest = download_snapshot(HubSource(REPO, "main", hub.url), _config(tmp_path, token=token))
        assert dest == Path(snapshot_dir(tmp_path, REPO, "main"))
        _assert_same_files(checkpoint, dest)
        fetched = [r for r in hub.requests if "/resolve/" in r[1]]
        assert len(fetched) == len(hub.files)
        assert download_snapshot(HubSource(REPO, "main", hub.url), _config(tmp_path, token=token)) == dest
        assert [r for r in hub.requests if "/resolve/" in r[1]] == fetched  # nothing downloaded again


def test_connection_cut_mid_file_is_resumed_with_range(checkpoint, tmp_path):
    cut, resumed_at = _cut_point(checkpoint)
    with FakeHub(REPO, checkpoint) as hub:
        hub.cut[WEIGHTS] = cut
        dest = download_snapshot(HubSource(REPO, "main", hub.url), _config(tmp_path))
        assert hub.ranges(WEIGHTS) == [None, f"bytes={resumed_at}-"]
    _assert_same_files(checkpoint, dest)


def test_a_run_cut_off_is_resumed_by_the_next_run(checkpoint, tmp_path):
    """Run 1 loses the connection mid-file and then the Hub is down: it fails with NetworkError,
    keeping the partial file. Run 2 asks only for the rest of that file (Range) and nothing else."""
    cut, resumed_at = _cut_point(checkpoint)
    with FakeHub(REPO, checkpoint) as hub:
        source = HubSource(REPO, "main", hub.url)
        hub.cut[WEIGHTS] = cut
        hub.outage_after_cut = True
        with pytest.raises(DownloadError) as failed:
            download_snapshot(source, _config(tmp_path, attempts=1))
        assert failed.value.reason == "NetworkError" and "503" in failed.value.message
        partial = list((Path(snapshot_dir(tmp_path, REPO, "main")) / STATE_DIR / "partial").iterdir())
        assert [p.stat().st_size for p in partial] == [resumed_at]
        hub.heal()
        before = len(hub.requests)
        dest = download_snapshot(source, _config(tmp_path))
        second_run = [r for r in hub.requests[before:] if "/resolve/" in r[1]]
        assert second_run == [("GET", f"/{REPO}/resolve/{COMMIT}/{WEIGHTS}", f"bytes={resumed_at}-")]
    _assert_same_files(checkpoint, dest)


@pytest.mark.parametrize("status", [401, 403])
def test_a_refused_token_exits_with_its_reason_through_the_cli(checkpoint, tmp_path, status):
    log = tmp_path / "termination-log"
    with FakeHub(REPO, checkpoint, token="the-right-one", refuse_status=status) as hub:
        env = {**os.environ, "HF_ENDPOINT": hub.url, "HF_TOKEN": "a-wrong-one", "HF_HUB_OFFLINE": "0"}
        proc = subprocess.run([sys.executable, "-m", "deepseek_pd.cli", "download", "--source", "huggingFace",
                               "--repo", REPO, "--cache-dir", str(tmp_path / "cache"), "--termination-log",
                               str(log)], env=env, capture_output=True, text=True, timeout=60)
        assert not [r for r in hub.requests if "/resolve/" in r[1]]
    assert proc.returncode == EXIT_CODES["TokenRefused"], proc.stderr
    assert f"HTTP {status}" in proc.stderr and "tokenSecret" in proc.stderr
    assert log.read_text().startswith(f"TokenRefused: {REPO}@main: the Hub refused the token (HTTP {status})")


def test_cli_downloads_through_hf_endpoint_and_prints_the_directory(checkpoint, tmp_path):
    with FakeHub(REPO, checkpoint) as hub:
        env = {**os.environ, "HF_ENDPOINT": hub.url, "HF_HUB_OFFLINE": "0"}
        env.pop("HF_TOKEN", None)
        proc = subprocess.run([sys.executable, "-m", "deepseek_pd.cli", "download", "--source", "huggingFace",
                               "--repo", REPO, "--revision", "main", "--cache-dir", str(tmp_path)],
                              env=env, capture_output=True, text=True, timeout=60)
    assert proc.returncode == 0, proc.stderr
    dest = Path(proc.stdout.strip().splitlines()[-1])
    assert dest == Path(snapshot_dir(tmp_path, REPO, "main"))
    assert "model download: done" in proc.stderr
    _assert_same_files(checkpoint, dest)


def test_local_sources_are_checked_not_downloaded(checkpoint, tmp_path):
    ok = subprocess.run([sys.executable, "-m", "deepseek_pd.cli", "download", "--source", "pvc", "--path",
                         str(checkpoint)], capture_output=True, text=True, timeout=60)
    assert ok.returncode == 0 and ok.stdout.strip() == str(checkpoint), ok.stderr
    (tmp_path / "empty").mkdir()
    log = tmp_path / "log"
    bad = subprocess.run([sys.executable, "-m", "deepseek_pd.cli", "download", "--source", "hostPath", "--path",
                          str(tmp_path / "empty"), "--termination-log", str(log)],
                         capture_output=True, text=True, timeout=60)
    assert bad.returncode == EXIT_CODES["ModelNotFound"]
    assert log.read_text().startswith("ModelNotFound: hostPath source:") and "config.json" in log.read_text()


def test_a_groups_init_containers_at_once_fetch_each_file_once(checkpoint, tmp_path):
    """Every pod of a group runs the same init container on the group's cache volume at the same
    time: all of them exit 0 with the same snapshot, and the Hub serves each file exactly once (the
    per-file lock; the others find it verified)."""
    pods = random.randint(2, 4)
    with FakeHub(REPO, checkpoint) as hub:
        env = {**os.environ, "HF_ENDPOINT": hub.url, "HF_HUB_OFFLINE": "0"}
        env.pop("HF_TOKEN", None)
        argv = [sys.executable, "-m", "deepseek_pd.cli", "download", "--source", "huggingFace", "--repo", REPO,
                "--cache-dir", str(tmp_path / "volume")]
        procs = [subprocess.Popen(argv, env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
                 for _ in range(pods)]
        outputs = [proc.communicate(timeout=90) for proc in procs]
        fetched = sorted(r[1] for r in hub.requests if "/resolve/" in r[1])
    assert [proc.returncode for proc in procs] == [0] * pods, [err[-2000:] for _, err in outputs]
    assert {out.strip().splitlines()[-1] for out, _ in outputs} == {str(snapshot_dir(tmp_path / "volume", REPO, "main"))}
    assert fetched == sorted(f"/{REPO}/resolve/{COMMIT}/{name}" for name in hub.files), fetched
    _assert_same_files(checkpoint, Path(snapshot_dir(tmp_path / "volume", REPO, "main")))

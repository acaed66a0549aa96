"""The FlashMLA build's CPU side: scripts/fetch-flashmla.sh refuses what is not a git dir (and,
where the FlashMLA and CUTLASS snapshots are on this machine, finds the pinned commits and the
sm90 dense kernel in them); bench/flashmla_build.sh --dry-run unpacks packed sources, checks
that every file the build compiles is in them, and stops where nvcc is needed, or says to run
the fetch script when there are none."""
from __future__ import annotations

import io
import random
import subprocess
import tarfile
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[2]
MIRRORS = Path("/work/.mirror")
# What the build compiles or includes first: the dry run must find each.
NEEDED = ("csrc/api/dense_decode.h", "csrc/sm90/decode/dense/instantiations/bf16.cu",
          "csrc/smxx/decode/combine/combine.cu", "csrc/smxx/decode/get_decoding_sched_meta/get_decoding_sched_meta.cu",
          "csrc/cutlass/include/cute/tensor.hpp", "csrc/cutlass/include/cutlass/cutlass.h", "flash_mla/__init__.py")


def _run(args: list[str], **env: str) -> subprocess.CompletedProcess:
    return subprocess.run(["bash", *args], cwd=REPO, capture_output=True, text=True, timeout=60,
                          env={"PATH": "/usr/bin:/bin", **env})


def _pack(folder: Path, names: tuple[str, ...]) -> None:
    with tarfile.open(folder / "flashmla-0000000.tar.gz", "w:gz") as tar:
        for name in (*names, "COMMITS"):
            data = f"flashmla {random.randrange(1 << 40):x}\n".encode() if name == "COMMITS" else b""
            info = tarfile.TarInfo(f"FlashMLA/{name}")
            info.size = len(data)
            tar.addfile(info, io.BytesIO(data))


def test_fetch_refuses_what_is_not_a_git_dir(tmp_path):
    proc = _run(["scripts/fetch-flashmla.sh", "--check", str(tmp_path), str(tmp_path)])
    assert proc.returncode == 2 and f"{tmp_path} is not a git dir" in proc.stderr, proc.stderr


@pytest.mark.skipif(not (MIRRORS / "deepseek-ai+FlashMLA" / "repo").is_dir()
                    or not (MIRRORS / "NVIDIA+cutlass" / "repo").is_dir(),
                    reason="the FlashMLA and CUTLASS snapshots are not on this machine")
def test_fetch_finds_the_pinned_commits_and_the_dense_kernel():
    proc = _run(["scripts/fetch-flashmla.sh", "--check"])
    assert proc.returncode == 0, proc.stderr
    assert "(its submodule pin)" in proc.stdout


def test_dry_run_checks_the_sources_and_stops_before_nvcc(tmp_path):
    src, build = tmp_path / "src", tmp_path / "build"
    src.mkdir()
    proc = _run(["bench/flashmla_build.sh", "--dry-run"], FLASHMLA_SRC_DIR=str(src), FLASHMLA_BUILD_DIR=str(build))
    assert proc.returncode == 1 and "run scripts/fetch-flashmla.sh" in proc.stderr, proc.stderr
    missing = random.choice(NEEDED)
    _pack(src, tuple(n for n in NEEDED if n != missing))
    proc = _run(["bench/flashmla_build.sh", "--dry-run"], FLASHMLA_SRC_DIR=str(src), FLASHMLA_BUILD_DIR=str(build))
    assert proc.returncode == 1 and f"{missing} is missing" in proc.stderr, proc.stderr
    _pack(src, NEEDED)
    proc = _run(["bench/flashmla_build.sh", "--dry-run"], FLASHMLA_SRC_DIR=str(src), FLASHMLA_BUILD_DIR=str(build))
    assert proc.returncode == 0, proc.stderr
    assert "would run: " in proc.stdout and "scripts/flashmla_setup.py" in proc.stdout
    assert all((build / "FlashMLA" / name).is_file() for name in NEEDED)

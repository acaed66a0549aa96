"""A Hugging Face Hub snapshot into the model cache volume, resumable byte by byte, once per volume.

huggingface_hub does the talking: `HfApi` resolves the revision to a commit and lists the files
(`/api/models/{repo}/revision/{rev}`, `/api/models/{repo}/tree/{commit}`), its `http_get` streams
each file (`/{repo}/resolve/{commit}/{file}`) with the token, retries, and `Range` to continue a
connection cut mid-file; its errors name what the Hub refused. What we add:

- **Resume across runs.** huggingface_hub 2.x deletes a partial file when its process fails, so
  a pod restarted after 3 of 4 GiB would start that shard again. Here a file grows in
  `.deepseek-pd/partial/<digest>.part` and the next run asks for `Range: bytes=<size>-`.
- **Once per volume.** Every rank's init container runs the same command; a per-file lock in the
  volume makes the others wait, then find the file verified (a shared PVC downloads once).
- **Verification.** Each file is checked against the listing's sha256 (LFS files) or git blob
  hash before it is moved into place; a mismatch is refetched once, then `ChecksumMismatch`.
- **A progress log** and failures as `DownloadError` reasons (failures.py).

    download_snapshot(HubSource("deepseek-ai/DeepSeek-V3", "main"), DownloadConfig(Path("/model-cache")))
        -> /model-cache/hub/deepseek-ai--DeepSeek-V3/main   (layout.snapshot_dir)
"""
from __future__ import annotations

import errno
import hashlib
import json
import logging
import os
import re
import shutil
import time
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from deepseek_pd.units import GIB, MIB, gib
from deepseek_pd.weights.failures import DownloadError
from deepseek_pd.weights.layout import COMPLETE_FILE, STATE_DIR, snapshot_dir
from deepseek_pd.weights.progress import ProgressLog

log = logging.getLogger("deepseek_pd.download")
_COMMIT = re.compile(r"^[0-9a-f]{40}$")
_HASH_BLOCK = 8 << 20


@dataclass(frozen=True)
class HubSource:
    """A repository at a revision (branch, tag or commit) on a Hub endpoint."""

    repo: str
    revision: str = "main"
    endpoint: str | None = None  # None: huggingface_hub's default, which honours HF_ENDPOINT


@dataclass(frozen=True)
class DownloadConfig:
    cache_dir: Path
    token: str | None = None  # None: anonymous (the Hub answers 401 for gated and private repos)
    max_workers: int = 8  # files fetched at once
    attempts: int = 3  # whole passes; each resumes what the previous one left
    retry_wait_s: float = 5.0
    progress_interval_s: float = 10.0

    def __post_init__(self) -> None:
        if self.max_workers < 1 or self.attempts < 1:
            raise ValueError("max_workers and attempts must be >= 1")


@dataclass(frozen=True)
class RemoteFile:
    path: str
    size: int
    sha256: str | None  # LFS files
    blob_id: str | None  # git blob sha1 (what the tree lists for every file)

    @property
    def digest(self) -> str:
        return self.sha256 or self.blob_id or f"size-{self.size}"


def download_snapshot(source: HubSource, config: DownloadConfig) -> Path:
    """Makes `layout.snapshot_dir(cache_dir, repo, revision)` a complete, verified checkpoint;
    returns it. Raises DownloadError."""
    dest = Path(snapshot_dir(config.cache_dir, source.repo, source.revision))
    if _COMMIT.fullmatch(source.revision) and _completed_commit(dest) == source.revision:
        log.info("model: %s@%s already complete in %s (no Hub request)", source.repo, source.revision, dest)
        return dest
    for attempt in range(1, config.attempts + 1):
        try:
            return _download_once(source, config, dest)
        except DownloadError as exc:
            if exc.reason not in ("NetworkError", "ChecksumMismatch") or attempt == config.attempts:
                raise
            log.warning("model download attempt %d/%d failed (%s: %s); resuming in %.0fs", attempt,
                        config.attempts, exc.reason, exc.message, config.retry_wait_s)
            time.sleep(config.retry_wait_s)
    raise AssertionError("unreachable")


def _download_once(source: HubSource, config: DownloadConfig, dest: Path) -> Path:
    from huggingface_hub import HfApi
    from huggingface_hub.hf_api import RepoFile

    api = HfApi(endpoint=source.endpoint, token=config.token or False)
    with _hub_errors(source):
        commit = api.model_info(source.repo, revision=source.revision).sha
        files = [_remote_file(f) for f in api.list_repo_tree(source.repo, recursive=True, revision=commit)
                 if isinstance(f, RepoFile)]
    if not files:
        raise DownloadError("DownloadFailed", f"{source.repo}@{source.revision} lists no files")
    if _completed_commit(dest) == commit and all(_is_verified(dest, f) for f in files):
        log.info("model: %s@%s (commit %s) already complete in %s", source.repo, source.revision,
                 commit[:12], dest)
        return dest
    for sub in ("partial", "locks", "verified"):
        (dest / STATE_DIR / sub).mkdir(parents=True, exist_ok=True)
    _check_space(dest, sum(f.size for f in files if not _is_verified(dest, f)))
    progress = ProgressLog(sum(f.size for f in files), len(files), config.progress_interval_s)
    log.info("model: downloading %s@%s (commit %s): %d files, %.2f GiB into %s", source.repo,
             source.revision, commit[:12], len(files), progress.total_bytes / GIB, dest)
    fetch = _Fetcher(source, config, dest, commit, progress)
    with _hub_errors(source), ThreadPoolExecutor(config.max_workers, thread_name_prefix="download") as pool:
        for future in [pool.submit(fetch, f) for f in files]:
            future.result()
    _write_complete(dest, source, commit, files)
    progress.finish()
    return dest


class _Fetcher:
    """Fetches one file into place (called from the thread pool)."""

    def __init__(self, source: HubSource, config: DownloadConfig, dest: Path, commit: str,
                 progress: ProgressLog) -> None:
        self.source, self.config, self.dest, self.commit, self.progress = source, config, dest, commit, progress

    def __call__(self, remote: RemoteFile) -> None:
        from filelock import FileLock

        if _is_verified(self.dest, remote):
            self.progress.add_present(remote.size)
            return
        with FileLock(str(self.dest / STATE_DIR / "locks" / f"{remote.digest}.lock")):
            if _is_verified(self.dest, remote):  # another pod fetched it while we waited
                self.progress.add_present(remote.size)
                return
            part = self.dest / STATE_DIR / "partial" / f"{remote.digest}.part"
            self._fetch(remote, part)
            if _file_digest(part, remote) != remote.digest:
                part.unlink()
                self._fetch(remote, part)  # once more from scratch; a second mismatch is reported
                if _file_digest(part, remote) != remote.digest:
                    part.unlink()
                    raise DownloadError("ChecksumMismatch", f"{remote.path}: the downloaded bytes do not "
                                        f"match the Hub's hash {remote.digest} (twice)")
            target = self.dest / remote.path
            target.parent.mkdir(parents=True, exist_ok=True)
            os.replace(part, target)
            _verified_marker(self.dest, remote).touch()
        self.progress.file_done()

    def _fetch(self, remote: RemoteFile, part: Path) -> None:
        from huggingface_hub import hf_hub_url
        from huggingface_hub.file_download import http_get
        from huggingface_hub.utils import build_hf_headers

        resume = part.stat().st_size if part.exists() else 0
        if resume > remote.size:
            part.unlink()
            resume = 0
        if resume:
            log.info("model: resuming %s at %.1f MiB of %.1f MiB", remote.path, resume / MIB,
                     remote.size / MIB)
            self.progress.add_resumed(resume)
        url = hf_hub_url(self.source.repo, remote.path, revision=self.commit, endpoint=self.source.endpoint)
        headers = build_hf_headers(token=self.config.token or False, library_name="deepseek-pd")
        with part.open("ab") as out:
            http_get(url, out, resume_size=resume, headers=headers, expected_size=remote.size,
                     displayed_filename=remote.path, tqdm_class=self.progress.byte_counter())


def _remote_file(entry: Any) -> RemoteFile:
    lfs = getattr(entry, "lfs", None)
    sha256 = lfs.sha256 if lfs is not None else None
    return RemoteFile(entry.path, int(entry.size), sha256, entry.blob_id)


def _file_digest(path: Path, remote: RemoteFile) -> str:
    """sha256 for LFS files, else the git blob hash (sha1 of "blob <size>\\0" + content)."""
    if remote.sha256:
        digest = hashlib.sha256()
    elif remote.blob_id:
        digest = hashlib.sha1()
        digest.update(f"blob {path.stat().st_size}\0".encode())
    else:
        return f"size-{path.stat().st_size}"
    with path.open("rb") as handle:
        while block := handle.read(_HASH_BLOCK):
            digest.update(block)
    return digest.hexdigest()


def _verified_marker(dest: Path, remote: RemoteFile) -> Path:
    return dest / STATE_DIR / "verified" / f"{remote.digest}-{remote.path.replace('/', '--')}"


def _is_verified(dest: Path, remote: RemoteFile) -> bool:
    target = dest / remote.path
    return target.is_file() and target.stat().st_size == remote.size and _verified_marker(dest, remote).exists()


def _completed_commit(dest: Path) -> str | None:
    try:
        return json.loads((dest / STATE_DIR / COMPLETE_FILE).read_text()).get("commit")
    except (OSError, ValueError):
        return None


def _write_complete(dest: Path, source: HubSource, commit: str, files: list[RemoteFile]) -> None:
    record = {"repo": source.repo, "revision": source.revision, "commit": commit,
              "files": {f.path: f.size for f in files}}
    tmp = dest / STATE_DIR / f"{COMPLETE_FILE}.{os.getpid()}.tmp"
    tmp.write_text(json.dumps(record, indent=2, sort_keys=True))
    os.replace(tmp, dest / STATE_DIR / COMPLETE_FILE)


def _check_space(dest: Path, needed: int) -> None:
    free = shutil.disk_usage(dest).free
    if needed > free:
        raise DownloadError("NoSpace", f"{dest}: {gib(needed, 1)} still to download, "
                            f"{gib(free, 1)} free on the cache volume")


class _hub_errors:
    """Maps huggingface_hub/httpx2/OS errors to DownloadError reasons (failures.py)."""

    def __init__(self, source: HubSource) -> None:
        self.source = source

    def __enter__(self) -> None:
        return None

    def __exit__(self, exc_type: type | None, exc: BaseException | None, tb: Any) -> bool:
        if exc is None or isinstance(exc, DownloadError):
            return False
        import httpx2
        from huggingface_hub.errors import (
            GatedRepoError, HfHubHTTPError, RepositoryNotFoundError, RevisionNotFoundError)

        where = f"{self.source.repo}@{self.source.revision}"
        status = getattr(getattr(exc, "response", None), "status_code", None)
        if isinstance(exc, RevisionNotFoundError):
            raise DownloadError("RevisionNotFound", f"{where}: no such revision on the Hub") from exc
        if isinstance(exc, GatedRepoError) or (isinstance(exc, HfHubHTTPError) and status in (401, 403)
                                               and not isinstance(exc, RepositoryNotFoundError)):
            raise DownloadError("TokenRefused", f"{where}: the Hub refused the token (HTTP {status}); "
                                "check the Secret named by model.source.huggingFace.tokenSecret (key "
                                "HF_TOKEN) and that it may read this repo") from exc
        if isinstance(exc, RepositoryNotFoundError):
            raise DownloadError("RepoNotFound", f"{where}: repository not found (HTTP {status}), or it is "
                                "private/gated and the token has no access") from exc
        if isinstance(exc, HfHubHTTPError) and status == 404:
            raise DownloadError("RepoNotFound", f"{where}: {_first_line(exc)}") from exc
        if isinstance(exc, (httpx2.TransportError, HfHubHTTPError)):
            raise DownloadError("NetworkError", f"{where}: {_first_line(exc)}") from exc
        if isinstance(exc, OSError) and exc.errno == errno.ENOSPC:
            raise DownloadError("NoSpace", f"{where}: the cache volume is full ({exc})") from exc
        if isinstance(exc, OSError) and "Consistency check failed" in str(exc):
            raise DownloadError("NetworkError", f"{where}: {_first_line(exc)}") from exc
        return False


def _first_line(exc: BaseException) -> str:
    text = " ".join(str(exc).split()) or type(exc).__name__
    return text[:300]

"""Where a Hugging Face Hub snapshot lives inside the model cache volume: one rule, two users.

`deepseek-pd download` writes there and the operator hands the same directory to the workers
(`--model`), so neither needs to ask the other:

    snapshot_dir("/model-cache", "deepseek-ai/DeepSeek-V3", "main")
        -> /model-cache/hub/deepseek-ai--DeepSeek-V3/main
    snapshot_dir("/model-cache", "org/m", "refs/pr/1")  -> /model-cache/hub/org--m/refs--pr--1

The directory holds the repository's files as they are named in the repo (a plain HF checkpoint
directory); our bookkeeping lives in its `.deepseek-pd/` subfolder.
"""
from __future__ import annotations

import re
from pathlib import PurePosixPath

from deepseek_pd.errors import UserError

STATE_DIR = ".deepseek-pd"  # inside a snapshot: partial files, locks, the completion record
COMPLETE_FILE = "complete.json"
# `org/name` or `name`; the CRD's model.source.huggingFace.id pattern is this string too.
REPO_PATTERN = r"^[A-Za-z0-9][A-Za-z0-9._-]*(/[A-Za-z0-9][A-Za-z0-9._-]*)?$"
_REPO = re.compile(REPO_PATTERN)
_UNSAFE = re.compile(r"[^A-Za-z0-9._-]+")


def check_repo_id(repo: str) -> str:
    """`org/name` (or `name`), as the Hub spells repository ids; anything else is a UserError."""
    if not _REPO.fullmatch(repo) or ".." in repo:
        raise UserError(f"Hugging Face repo id {repo!r} is not of the form org/name")
    return repo


def revision_dirname(revision: str) -> str:
    """A revision (branch, tag, commit; may contain '/') as one safe path component."""
    if not revision.strip():
        raise UserError("the Hugging Face revision is empty")
    name = _UNSAFE.sub("--", revision.replace("/", "--")).strip(".")
    return name or "--"


def snapshot_dir(cache_dir: str | PurePosixPath, repo: str, revision: str) -> PurePosixPath:
    """The checkpoint directory of `repo` at `revision` under `cache_dir` (see module docstring)."""
    return PurePosixPath(cache_dir) / "hub" / check_repo_id(repo).replace("/", "--") / revision_dirname(revision)

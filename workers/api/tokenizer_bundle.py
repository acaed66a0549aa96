"""The tokenizer files a worker hands to the router (GetTokenizer), so that a router without the
checkpoint on its disk (a Kubernetes router pod) can still tokenise and apply the chat template.

The bundle is a zip of the files that exist among `TOKENIZER_FILES`, built once and streamed in
chunks; the last chunk carries the SHA-256 of the whole zip, which the router checks.
"""
from __future__ import annotations

import hashlib
import io
import zipfile
from pathlib import Path
from typing import Iterator

TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json", "special_tokens_map.json",
                   "generation_config.json", "config.json", "chat_template.jinja", "chat_template.json",
                   "tokenizer.model", "vocab.json", "merges.txt")
CHUNK_BYTES = 1 << 20


def build_bundle(tokenizer_dir: str | Path) -> bytes:
    root = Path(tokenizer_dir)
    buffer = io.BytesIO()
    with zipfile.ZipFile(buffer, "w", compression=zipfile.ZIP_DEFLATED) as archive:
        for name in TOKENIZER_FILES:
            path = root / name
            if path.is_file():
                # A fixed timestamp keeps the bytes (and the hash) identical across workers.
                info = zipfile.ZipInfo(name, date_time=(1980, 1, 1, 0, 0, 0))
                info.compress_type = zipfile.ZIP_DEFLATED
                archive.writestr(info, path.read_bytes())
    return buffer.getvalue()


def iter_chunks(bundle: bytes, chunk_bytes: int = CHUNK_BYTES) -> Iterator[tuple[bytes, str]]:
    """(data, sha256) pairs; sha256 is empty except on the last chunk."""
    digest = hashlib.sha256(bundle).hexdigest()
    pieces = [bundle[i:i + chunk_bytes] for i in range(0, len(bundle), chunk_bytes)] or [b""]
    for index, piece in enumerate(pieces):
        yield piece, digest if index == len(pieces) - 1 else ""

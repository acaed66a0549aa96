"""Files only this user may read (the deployment secret, the router's control-plane key)."""
from __future__ import annotations

import os
from pathlib import Path


def write_private_file(path: str | Path, data: bytes) -> Path:
    """Writes `data` to `path` with mode 0600, whatever mode an existing file had: `touch(mode=)`
    and `open(..., 0o600)` keep an existing file's mode, so the mode is set on the open file,
    before anything is written. A symlink at `path` is refused (it could point anywhere)."""
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_TRUNC | os.O_NOFOLLOW, 0o600)
    with os.fdopen(fd, "wb") as out:
        os.fchmod(out.fileno(), 0o600)
        out.write(data)
    return path

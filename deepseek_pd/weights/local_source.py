"""A checkpoint already on a volume (model.source pvc or hostPath): nothing to download, but the
directory is checked, so a wrong `model.path` fails the init container with `ModelNotFound`
instead of every worker failing to load later."""
from __future__ import annotations

import logging
from pathlib import Path

from deepseek_pd.units import GIB
from deepseek_pd.weights.failures import DownloadError

log = logging.getLogger("deepseek_pd.download")
WEIGHT_SUFFIXES = (".safetensors", ".bin")


def check_local_checkpoint(directory: str | Path, source: str = "pvc") -> Path:
    """`directory` must hold an HF checkpoint: config.json plus at least one weight file."""
    path = Path(directory)
    if not path.is_dir():
        parent = path.parent
        listing = sorted(p.name for p in parent.iterdir())[:20] if parent.is_dir() else []
        raise DownloadError("ModelNotFound", f"{source} source: {path} is not a directory"
                            + (f"; {parent} holds: {', '.join(listing)}" if listing else ""))
    if not (path / "config.json").is_file():
        raise DownloadError("ModelNotFound", f"{source} source: {path} has no config.json "
                            "(model.path must name the checkpoint directory inside the volume)")
    weights = [p for p in path.iterdir() if p.suffix in WEIGHT_SUFFIXES]
    if not weights:
        raise DownloadError("ModelNotFound", f"{source} source: {path} has no *.safetensors weights")
    size = sum(p.stat().st_size for p in weights)
    log.info("model: %s source %s is ready (%d weight files, %.1f GiB)", source, path, len(weights),
             size / GIB)
    return path

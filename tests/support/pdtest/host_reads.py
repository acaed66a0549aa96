"""`HostReads`: counts every way code reads a tensor's values back to the host, on the CPU too.

On a GPU each of these waits for the device (CUDA's sync debug mode would flag them); on the
CPU nothing waits, so a test of "no host sync inside the step" must catch the reads themselves:

- through the dispatcher (a `TorchDispatchMode`): `aten._local_scalar_dense` (`.item()`,
  `int(t)`, `float(t)`, `bool(t)`, `if t:`) and the ops whose output size depends on values
  (`nonzero`, `masked_select`, `unique`, boolean-mask indexing, `repeat_interleave` by a tensor);
- around the dispatcher (patched for the duration): `Tensor.tolist`, `.numpy`, `.cpu`,
  `__array__`, which read memory directly.

    with HostReads() as reads:
        with reads.allowed():     # e.g. the model's own forward, counted apart
            ...
        step()
    assert reads.seen == []       # each entry: (what, the innermost frame outside torch)

Only the thread that entered counts (the patched methods are global while it runs).
"""
from __future__ import annotations

import contextlib
import threading
import traceback
from typing import Iterator

import torch
from torch.utils._python_dispatch import TorchDispatchMode

_VALUE_SIZED = {"nonzero", "masked_select", "unique", "_unique", "_unique2", "unique_consecutive",
                "unique_dim", "argwhere", "nonzero_static"}
_PATCHED = ("tolist", "numpy", "cpu", "__array__")


class HostReads(TorchDispatchMode):
    def __init__(self) -> None:
        super().__init__()
        self.seen: list[tuple[str, str]] = []
        self.allowed_reads: list[tuple[str, str]] = []
        self._allowed = 0
        self._thread = threading.get_ident()
        self._saved: dict[str, object] = {}

    @contextlib.contextmanager
    def allowed(self) -> Iterator[None]:
        """Reads inside are counted in `allowed_reads`, not `seen`."""
        self._allowed += 1
        try:
            yield
        finally:
            self._allowed -= 1

    def _note(self, what: str) -> None:
        if threading.get_ident() != self._thread:
            return
        frame = next((f for f in reversed(traceback.extract_stack()[:-2])
                      if "/torch/" not in f.filename and not f.filename.endswith("host_reads.py")), None)
        where = f"{frame.filename}:{frame.lineno}" if frame else "?"
        (self.allowed_reads if self._allowed else self.seen).append((what, where))

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        name = func.overloadpacket.__name__
        if name == "_local_scalar_dense" or name in _VALUE_SIZED:
            self._note(name)
        elif name == "repeat_interleave" and isinstance(args[0] if args else None, torch.Tensor) and (
                len(args) > 1 and isinstance(args[1], torch.Tensor) or func is torch.ops.aten.repeat_interleave.Tensor):
            if (kwargs or {}).get("output_size") is None:
                self._note("repeat_interleave")
        elif name == "index" and any(isinstance(i, torch.Tensor) and i.dtype == torch.bool
                                     for i in (args[1] if len(args) > 1 else ()) if i is not None):
            self._note("index by a boolean mask")
        return func(*args, **(kwargs or {}))

    def __enter__(self):
        for name in _PATCHED:
            original = getattr(torch.Tensor, name)
            self._saved[name] = original

            def patched(tensor, *args, _original=original, _name=name, **kwargs):
                self._note(f"Tensor.{_name}")
                return _original(tensor, *args, **kwargs)

            setattr(torch.Tensor, name, patched)
        return super().__enter__()

    def __exit__(self, *exc):
        try:
            return super().__exit__(*exc)
        finally:
            for name, original in self._saved.items():
                setattr(torch.Tensor, name, original)
            self._saved.clear()

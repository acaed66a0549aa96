"""`DirectUploads`: records, on the CPU, every place that would copy host data to the device
WITHOUT `model/host_copy.upload` if the device were CUDA.

On CUDA such a copy reads pageable memory: the driver stages it through its shared buffers, held
until the copy has run on the GPU, so every other thread's copy waits behind the forward queued
before it. On the CPU there is no device to copy to, so the mode follows where data comes from:

- a tensor is *host-made* when a factory made it without a `device=` (`torch.tensor(list)`,
  `torch.arange(n)`, `torch.from_numpy`), or an op made it from host-made tensors only;
- `upload` (patched in every module that imported it) turns a host tensor into a device one;
- a direct copy is any other way host data reaches the device: `.to(device)` / `.copy_` of a
  host-made tensor, `torch.tensor(data, device=...)` / `torch.as_tensor(data, device=...)` of host
  data, indexing with a Python list, and an op that mixes host-made (non-scalar) tensors with
  device ones (on CUDA an implicit copy or an error).

Each record is `(what, "file:line")`, the line being the first frame in the repository outside
this module and torch.
"""
from __future__ import annotations

import sys
from pathlib import Path
from typing import Any, Iterable

import torch
from torch.overrides import TorchFunctionMode

from deepseek_pd.model import host_copy

_REPO = Path(__file__).resolve().parents[3]
_FACTORIES = {"tensor", "as_tensor", "from_numpy", "frombuffer", "arange", "zeros", "ones", "empty", "full",
              "randn", "rand", "randint", "linspace"}


def _tensors(values: Iterable[Any]) -> list[torch.Tensor]:
    out: list[torch.Tensor] = []
    for v in values:
        if isinstance(v, torch.Tensor):
            out.append(v)
        elif isinstance(v, (list, tuple)):
            out.extend(_tensors(v))
    return out


def _host(t: Any) -> bool:
    """Whether `t` is a tensor made on the host (see the module docstring)."""
    return isinstance(t, torch.Tensor) and getattr(t, "_pdtest_host_made", False)


def _marking(factory: Any) -> Any:
    def made_on_host(*args: Any, **kwargs: Any) -> torch.Tensor:
        out = factory(*args, **kwargs)
        out._pdtest_host_made = True
        return out
    return made_on_host


def _has_list(index: Any) -> bool:
    return isinstance(index, list) or (isinstance(index, tuple) and any(_has_list(i) for i in index))


class DirectUploads(TorchFunctionMode):
    """Use as `with DirectUploads() as mode:`; then `mode.records` and `mode.uploads` (calls of `upload`)."""

    def __init__(self) -> None:
        super().__init__()
        self.records: list[tuple[str, str]] = []
        self.uploads = 0
        self._patched: list[Any] = []
        self._patched_torch: list[tuple[str, Any]] = []
        self._real = host_copy.upload

    def __enter__(self) -> "DirectUploads":
        def counted(host: torch.Tensor, device: torch.device | str) -> torch.Tensor:
            self.uploads += 1
            on_device = self._real(host, device).clone()  # on the CPU `upload` returns its input
            on_device._pdtest_host_made = False
            return on_device

        for module in list(sys.modules.values()):
            if getattr(module, "__name__", "").startswith("deepseek_pd") and getattr(module, "upload", None) is self._real:
                self._patched.append(module)
                module.upload = counted
        # Factories that torch function modes do not see.
        for name in ("from_numpy", "frombuffer"):
            self._patched_torch.append((name, getattr(torch, name)))
            setattr(torch, name, _marking(getattr(torch, name)))
        return super().__enter__()

    def __exit__(self, *exc: Any) -> None:
        super().__exit__(*exc)
        for module in self._patched:
            module.upload = self._real
        for name, real in self._patched_torch:
            setattr(torch, name, real)

    def _where(self) -> str:
        frame = sys._getframe(2)
        while frame is not None:
            path = Path(frame.f_code.co_filename).resolve()
            if path.is_relative_to(_REPO) and ".venv" not in path.parts and path != Path(__file__).resolve():
                return f"{path.relative_to(_REPO)}:{frame.f_lineno}"
            frame = frame.f_back
        return "?"

    def _direct_copy(self, name: str, args: tuple, kwargs: dict, tensors: list[torch.Tensor]) -> str | None:
        """What `name(*args, **kwargs)` copies from host to device directly, or None."""
        host = [t for t in tensors if _host(t)]
        if name in ("tensor", "as_tensor"):
            return f"torch.{name}(device=)" if kwargs.get("device") is not None and (not tensors or host) else None
        if name == "to":
            target = [a for a in args[1:] if isinstance(a, (str, torch.device, torch.Tensor))]
            moves = "device" in kwargs or any(not (isinstance(a, torch.Tensor) and _host(a)) for a in target)
            return "Tensor.to(device)" if _host(args[0]) and moves else None
        if name == "cuda":
            return "Tensor.cuda" if _host(args[0]) else None
        if name == "copy_":
            return "device.copy_(host)" if _host(args[1]) and not _host(args[0]) else None
        if name in ("__getitem__", "__setitem__", "index_put_") and not _host(args[0]) and _has_list(args[1:2]):
            return f"Tensor.{name}(list)"
        if host and len(host) < len(tensors) and any(t.dim() > 0 for t in host):
            return f"{name}(host and device tensors)"
        return None

    def _host_made(self, name: str, args: tuple, kwargs: dict, tensors: list[torch.Tensor]) -> bool:
        if name in _FACTORIES:
            return kwargs.get("device") is None and all(_host(t) for t in tensors)
        if name in ("to", "cuda", "copy_"):
            return _host(args[0]) and name == "to" and not self._direct_copy(name, args, kwargs, tensors)
        return bool(tensors) and all(_host(t) for t in tensors)

    def __torch_function__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        name = getattr(func, "__name__", "")
        tensors = _tensors(args) + _tensors(kwargs.values())
        copy = self._direct_copy(name, args, kwargs, tensors)
        if copy is not None:
            self.records.append((copy, self._where()))
        host_made = self._host_made(name, args, kwargs, tensors)
        out = func(*args, **kwargs)
        if copy is not None and out is args[0]:
            out = out.clone()  # on the CPU `.to` returns its input: the copy's result is a device tensor
        if host_made:
            for t in _tensors(out if isinstance(out, (list, tuple)) else [out]):
                t._pdtest_host_made = True
        return out

"""Name → factory registries for swappable backends (attention kernel, MoE kernel, EP dispatcher).

A backend is chosen once, when the owning object is built (`registry.build(name, ...)`), and the
object keeps the built instance; nothing branches on a backend name inside `forward`.

Example:
    ATTENTION_BACKENDS = Registry("attention backend")
    @ATTENTION_BACKENDS.register("torch")
    class TorchAttentionBackend: ...
    backend = ATTENTION_BACKENDS.build("torch")      # UserError lists the names if unknown
"""
from __future__ import annotations

from typing import Any, Callable, Generic, TypeVar

from deepseek_pd.errors import UserError

T = TypeVar("T")


class Registry(Generic[T]):
    def __init__(self, kind: str) -> None:
        self.kind = kind
        self._factories: dict[str, Callable[..., T]] = {}

    def register(self, name: str) -> Callable[[Callable[..., T]], Callable[..., T]]:
        def add(factory: Callable[..., T]) -> Callable[..., T]:
            if name in self._factories:
                raise ValueError(f"{self.kind} {name!r} registered twice")
            self._factories[name] = factory
            return factory
        return add

    def names(self) -> list[str]:
        return sorted(self._factories)

    def get(self, name: str) -> Callable[..., T]:
        try:
            return self._factories[name]
        except KeyError:
            raise UserError(f"unknown {self.kind} {name!r}; available: {', '.join(self.names())}") from None

    def build(self, name: str, *args: Any, **kwargs: Any) -> T:
        return self.get(name)(*args, **kwargs)

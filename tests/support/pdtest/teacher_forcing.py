"""Comparing two runs of one model whose backends differ by rounding: each module of the given types
in the second run gets the inputs that module got in the first (teacher forcing).

Why: an FP8 (or any quantising) layer rounds its input to a grid. Two backends whose upstream
arithmetic differs only in summation order can put a value on either side of a rounding boundary,
and that one flip changes the model's output by a whole grid step, far above the backends' own
difference. Forcing the quantising modules' inputs removes the flips and keeps everything the test
means to compare: each module's own arithmetic, and that both runs call the same modules, in the
same order, with the same shapes (a mismatch is an AssertionError naming the module).
"""
from __future__ import annotations

import contextlib
from typing import Iterator

import torch
from torch import nn


class TeacherForcing:
    """`record(model)` stores the inputs of every module of `types`; `replay(model)` hands the same
    modules of another model (same names) those inputs, call by call."""

    def __init__(self, *types: type[nn.Module]) -> None:
        self.types = types
        self.inputs: dict[str, list[tuple[tuple, dict]]] = {}
        self.replayed: dict[str, int] = {}

    def _modules(self, model: nn.Module) -> Iterator[tuple[str, nn.Module]]:
        return ((name, module) for name, module in model.named_modules() if isinstance(module, self.types))

    @contextlib.contextmanager
    def _hooked(self, model: nn.Module, make_hook) -> Iterator[None]:
        """`make_hook(name)`'s forward pre-hook on every module of `types`, for the `with` block."""
        handles = [module.register_forward_pre_hook(make_hook(name), with_kwargs=True)
                   for name, module in self._modules(model)]
        try:
            yield
        finally:
            for handle in handles:
                handle.remove()

    @contextlib.contextmanager
    def record(self, model: nn.Module) -> Iterator[None]:
        def hook(name):
            def store(module, args, kwargs):
                self.inputs.setdefault(name, []).append((_clone(args), _clone(kwargs)))
            return store
        with self._hooked(model, hook):
            yield

    @contextlib.contextmanager
    def replay(self, model: nn.Module) -> Iterator[None]:
        def hook(name):
            def force(module, args, kwargs):
                calls = self.inputs.get(name, [])
                index = self.replayed.get(name, 0)
                assert index < len(calls), f"{name}: called more often than in the recorded run"
                self.replayed[name] = index + 1
                recorded_args, recorded_kwargs = calls[index]
                _check_alike(name, (args, kwargs), (recorded_args, recorded_kwargs))
                return _clone(recorded_args), _clone(recorded_kwargs)
            return force
        with self._hooked(model, hook):
            yield
        missing = {name: len(calls) - self.replayed.get(name, 0) for name, calls in self.inputs.items()
                   if len(calls) != self.replayed.get(name, 0)}
        assert not missing, f"modules called fewer times than in the recorded run: {missing}"


def _clone(value):
    if isinstance(value, torch.Tensor):
        return value.detach().clone()
    if isinstance(value, (tuple, list)):
        return type(value)(_clone(v) for v in value)
    if isinstance(value, dict):
        return {k: _clone(v) for k, v in value.items()}
    return value


def _check_alike(name: str, got, recorded) -> None:
    """The same structure, tensor shapes and dtypes, and equal non-tensor values."""
    if isinstance(recorded, torch.Tensor):
        assert isinstance(got, torch.Tensor) and got.shape == recorded.shape and got.dtype == recorded.dtype, (
            f"{name}: input {tuple(got.shape) if isinstance(got, torch.Tensor) else got!r} where the recorded "
            f"run had {tuple(recorded.shape)} {recorded.dtype}")
    elif isinstance(recorded, (tuple, list)):
        assert isinstance(got, (tuple, list)) and len(got) == len(recorded), f"{name}: arguments differ"
        for g, r in zip(got, recorded):
            _check_alike(name, g, r)
    elif isinstance(recorded, dict):
        assert isinstance(got, dict) and got.keys() == recorded.keys(), f"{name}: keyword arguments differ"
        for key in recorded:
            _check_alike(name, got[key], recorded[key])
    else:
        assert got == recorded, f"{name}: argument {got!r} where the recorded run had {recorded!r}"

"""Kernels per layer op of one decode step, what weights each op reads, and (on a GPU) each op's
kernel time: the count behind bench/decode_bs1_gpu.py (issue 21, batch-1 decode).

`OpScopes` wraps every layer op of the plain op-list loop (`deepseek.run_layer_ops`) in a scope
named `L<layer>.<op>`; what runs outside the layers (embedding, final norm, lm_head) is `head`.
Inside a scope it counts:
    launches   torch ops that launch a kernel (a `TorchDispatchMode` sees each op the graph would
               capture; views, allocations and metadata ops launch none) plus Triton launches (their
               `run`); on a GPU a cuBLAS GEMM or a sort may launch more than one: the profiler's
               count is the truth there
    bytes      bytes of model parameters the op's kernels read, each parameter once per op; stacked
               experts `[E, ...]` count `experts_read` of their routed slices and every fused shared
               one (what a one-token step reads; bench/param_reads.py `expert_slots`)
On a GPU `profile_ops` adds, from torch.profiler over one eager step, each scope's kernels and
their summed device time (the kernels the profiler links to launches inside the scope's range: a
Triton launch, through the driver API, often is not linked, so a scope's time can miss its Triton
kernels), and the step's totals from every device event, linked or not.
"""
from __future__ import annotations

import contextlib
import sys
from collections import defaultdict
from dataclasses import dataclass, field
from pathlib import Path

import torch
from torch.utils._python_dispatch import TorchDispatchMode

sys.path.insert(0, str(Path(__file__).parent))
from param_reads import step_reads  # noqa: E402

_NO_KERNEL = ("empty", "empty_strided", "empty_like", "new_empty", "new_empty_strided", "promote_types", "lift_fresh",
              "detach", "alias", "_local_scalar_dense")


@dataclass
class OpCount:
    launches: int = 0
    weight_bytes: int = 0
    kernels: int = 0  # the profiler's (GPU)
    kernel_us: float = 0.0
    params: set = field(default_factory=set)
    names: list = field(default_factory=list)  # what launched, in order (torch op or Triton kernel)


class OpScopes:
    """Scope names and per-scope counts for one model; `with scopes.counting(): step()` counts."""

    def __init__(self, model: torch.nn.Module, experts_read: int) -> None:
        self.model = model
        self.counts: dict[str, OpCount] = defaultdict(OpCount)
        self.current = "head"
        self.step_kernels, self.step_kernel_us = 0, 0.0  # the whole profiled step's (GPU), every device event
        self.linked_kernels, self.linked_kernel_us = 0, 0.0  # those linked to a launch (what the scopes sum)
        self.in_triton = False  # the interpreter's own torch ops are no launches
        # storage pointer -> (parameter name, bytes it reads in one step)
        self.params: dict[int, tuple[str, int]] = {}
        for name, p in model.named_parameters():
            read = step_reads(model, name, p, experts_read)
            self.params[p.untyped_storage().data_ptr()] = (name, read)

    def _note(self, tensors) -> None:
        count = self.counts[self.current]
        for t in tensors:
            if isinstance(t, torch.Tensor) and t.device.type != "meta":
                hit = self.params.get(t.untyped_storage().data_ptr())
                if hit is not None and hit[0] not in count.params:
                    count.params.add(hit[0])
                    count.weight_bytes += hit[1]

    def launch(self, name: str, tensors) -> None:
        self.counts[self.current].launches += 1
        self.counts[self.current].names.append(name)
        self._note(tensors)

    @contextlib.contextmanager
    def scope(self, name: str):
        outer, self.current = self.current, name
        try:
            with torch.profiler.record_function(name):
                yield
        finally:
            self.current = outer

    @contextlib.contextmanager
    def counting(self):
        """Counts launches and weight bytes per scope of whatever runs inside (eager forwards)."""
        import deepseek_pd.model.deepseek as deepseek

        plain_run = deepseek.run_layer_ops
        scopes = self

        def scoped_run(layer, state, batch, progress=None):
            for name, op in zip(layer.op_names, layer.ops):
                with scopes.scope(f"L{layer.layer_id}.{name}"):
                    op(state, batch)
            if progress is not None:
                plain_run(layer, state, batch, progress)  # never on decode: kept for completeness

        class Dispatch(TorchDispatchMode):
            def __torch_dispatch__(self, func, types, args=(), kwargs=None):
                out = func(*args, **(kwargs or {}))
                schema = func._schema
                is_view = bool(schema.returns) and schema.returns[0].alias_info is not None and \
                    not schema.returns[0].alias_info.is_write
                namespace, _, op_name = schema.name.partition("::")
                if not (is_view or scopes.in_triton or namespace == "profiler" or op_name in _NO_KERNEL):
                    scopes.launch(op_name, torch.utils._pytree.tree_leaves((args, kwargs)))
                return out

        with contextlib.ExitStack() as stack:
            deepseek.run_layer_ops = scoped_run
            stack.callback(setattr, deepseek, "run_layer_ops", plain_run)
            for cls in _triton_launchers():
                plain = cls.run

                def run(self, *args, _plain=plain, **kwargs):
                    scopes.launch(getattr(self, "__name__", "triton"), list(args) + list(kwargs.values()))
                    scopes.in_triton = True
                    try:
                        return _plain(self, *args, **kwargs)
                    finally:
                        scopes.in_triton = False

                cls.run = run
                stack.callback(setattr, cls, "run", plain)
            stack.enter_context(Dispatch())
            yield self


def _triton_launchers() -> list[type]:
    """The Triton classes whose `run` launches a kernel: compiled and interpreted."""
    try:
        from triton.runtime.jit import JITFunction
    except ImportError:
        return []
    classes = [JITFunction]
    try:
        from triton.runtime.interpreter import InterpretedFunction
        classes.append(InterpretedFunction)
    except ImportError:
        pass
    return classes


def _kernels_below(event) -> list:
    """The device kernels launched inside a CPU event (the profiler links each launch to its kernel)."""
    found = list(getattr(event, "kernels", []))
    for child in event.cpu_children:
        found += _kernels_below(child)
    return found


def profile_ops(scopes: OpScopes, step) -> None:
    """One eager `step()` under torch.profiler (no kernels on a CPU, the counts alone): per scope, the kernels its launches ran (a
    `record_function` range's CPU subtree), their count and summed device time; and the step's."""
    from torch.profiler import ProfilerActivity, profile

    cuda = torch.cuda.is_available()
    with profile(activities=[ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if cuda else [])) as prof:
        with scopes.counting():
            step()
        if cuda:
            torch.cuda.synchronize()
    cpu_events = [e for e in prof.events() if e.device_type == torch.autograd.DeviceType.CPU]
    # A scope's device-side annotation may come linked like a kernel, under the scope's name: not one.
    real = lambda kernels: [k for k in kernels if k.name not in scopes.counts]  # noqa: E731
    linked = real(k for e in cpu_events for k in getattr(e, "kernels", []))
    scopes.linked_kernels, scopes.linked_kernel_us = len(linked), sum(k.duration for k in linked)
    # The step's totals from every device event: Triton's driver-API launches often come unlinked
    # to a CPU op, so the scopes' sums (linked kernels only) can leave them out.
    every = [e for e in prof.events()
             if e.device_type == torch.autograd.DeviceType.CUDA and e.name not in scopes.counts]
    scopes.step_kernels = len(every)
    scopes.step_kernel_us = sum(e.time_range.end - e.time_range.start for e in every)
    for event in cpu_events:
        if event.name in scopes.counts:
            count = scopes.counts[event.name]
            kernels = real(_kernels_below(event))
            count.kernels += len(kernels)
            count.kernel_us += sum(k.duration for k in kernels)


def layer_rows(scopes: OpScopes) -> dict[int, dict]:
    """Per layer: launches, kernels and kernel time (profiler), weight bytes; and its ops'."""
    layers: dict[int, dict] = {}
    for name, count in scopes.counts.items():
        if not name.startswith("L"):
            continue
        layer, op = name[1:].split(".", 1)
        row = layers.setdefault(int(layer), {"launches": 0, "kernels": 0, "kernel_us": 0.0, "weight_bytes": 0,
                                             "ops": {}})
        row["ops"][op] = {"launches": count.launches, "names": count.names, "kernels": count.kernels,
                          "kernel_us": round(count.kernel_us, 1), "weight_bytes": count.weight_bytes}
        for key in ("launches", "kernels", "kernel_us", "weight_bytes"):
            row[key] += getattr(count, key)
    return layers

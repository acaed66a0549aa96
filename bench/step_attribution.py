"""Where a traced step's time goes, from a torch.profiler run over every thread (bench/prefill_step_ratio.py).

A window is a `record_function` range (`WINDOWS`: the runner alone, the worker's round in its model
thread, and inside the round the extend and the first token). For each window, in its own thread:
    gpu_busy_ms     the union of the device's kernels and copies inside it (any stream)
    gpu_idle_ms     the window's length less that: the GPU waited for the host
    sync_ms         time in the thread's CUDA calls that block the host (stream, event, device
                    synchronizes and the synchronous copies), and `syncs` their count
    launches        kernel launches the thread made (the host-bound part's count)
    other_threads_ms CPU ops of other threads inside it (the GIL's other takers: the event loop,
                    the transport's gathers and copies), by thread
The medians per window name go to `attribute`'s result; `--trace DIR` writes them as
prefill_step_attribution.json next to the trace.
"""
from __future__ import annotations

import statistics
from collections import defaultdict
from typing import Any, Iterable

WINDOWS = ("pd::runner_alone", "pd::worker_round", "pd::extend", "pd::first_token")
# Host-blocking runtime calls by name (a synchronous copy from pageable memory is a cudaMemcpyAsync
# followed by one of the synchronizes: torch's `copy_` without non_blocking).
_SYNC_CALLS = frozenset(("cudaStreamSynchronize", "cudaEventSynchronize", "cudaDeviceSynchronize", "cudaMemcpy",
                         "cuStreamSynchronize", "cuEventSynchronize", "cuCtxSynchronize"))
_LAUNCHES = ("cudaLaunchKernel", "cuLaunchKernel", "cudaLaunchKernelExC", "cuLaunchKernelEx", "cudaGraphLaunch")


def _union_ms(intervals: Iterable[tuple[float, float]], start: float, end: float) -> float:
    """Length (ms) of the union of `intervals` (µs) clipped to [start, end]."""
    total, reach = 0.0, start
    for begin, finish in sorted((max(b, start), min(f, end)) for b, f in intervals):
        if finish <= reach:
            continue
        total += finish - max(begin, reach)
        reach = finish
    return total / 1e3


def _span(event) -> tuple[float, float]:
    return event.time_range.start, event.time_range.end


def _is_device(event) -> bool:
    return str(getattr(event, "device_type", "")).endswith("CUDA")


def attribute(events: Iterable[Any]) -> dict[str, dict[str, Any]]:
    """Per window name of `WINDOWS` present in `events` (profiler FunctionEvents): the medians of the
    figures of the module docstring over its windows, and their count."""
    events = list(events)
    device = [_span(e) for e in events if _is_device(e)]
    host = [e for e in events if not _is_device(e)]
    by_thread: dict[int, list] = defaultdict(list)
    for event in host:
        by_thread[event.thread].append(event)
    rows: dict[str, list[dict[str, Any]]] = defaultdict(list)
    for window in (e for e in host if e.name in WINDOWS):
        start, end = _span(window)
        inside = [e for e in by_thread[window.thread] if start <= e.time_range.start and e.time_range.end <= end]
        busy = _union_ms(device, start, end)
        syncs = [e for e in inside if e.name in _SYNC_CALLS]
        others = {}
        for thread, thread_events in by_thread.items():
            if thread != window.thread:
                spent = _union_ms((_span(e) for e in thread_events), start, end)
                if spent > 0:
                    others[str(thread)] = spent
        rows[window.name].append({
            "ms": (end - start) / 1e3, "gpu_busy_ms": busy, "gpu_idle_ms": (end - start) / 1e3 - busy,
            "sync_ms": _union_ms(map(_span, syncs), start, end), "syncs": len(syncs),
            "sync_calls": sorted({e.name for e in syncs}),
            "launches": sum(e.name.startswith(_LAUNCHES) for e in inside),
            "other_threads_ms": sum(others.values()), "by_other_thread_ms": others})
    result = {}
    for name, windows in rows.items():
        numeric = [key for key, value in windows[0].items() if isinstance(value, (int, float))]
        result[name] = {"windows": len(windows), **{key: statistics.median(w[key] for w in windows) for key in numeric},
                        "sync_calls": sorted({call for w in windows for call in w["sync_calls"]})}
    return result


def table(result: dict[str, dict[str, Any]]) -> str:
    """The medians as a text table, one row per window name."""
    columns = ("ms", "gpu_busy_ms", "gpu_idle_ms", "sync_ms", "syncs", "launches", "other_threads_ms")
    lines = [f"{'window':<20}" + "".join(f"{c:>17}" for c in columns) + "   sync calls"]
    for name in WINDOWS:
        if name in result:
            row = result[name]
            lines.append(f"{name:<20}" + "".join(f"{row[c]:>17.2f}" for c in columns)
                         + "   " + ",".join(row["sync_calls"]))
    return "\n".join(lines)

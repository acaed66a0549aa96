"""Where a batch-1 graph decode step's time goes (issue 21): the host's share, the graph replay's
device time, and the kernels and idle gaps inside the replay.

Three measures of one runner, each over `steps` teacher-forced steps:
    host_ms      `runner.decode` per step with the GPU left to run behind it (one sync at the end):
                 packing, the pinned upload, the replay launch, the logits clone; when it is
                 close to the step time the step is host-bound
    replay_ms    CUDA events around `graph.replay()` alone (inputs loaded beforehand): the device
                 time of the captured forward
    timeline     torch.profiler over a few replays (CUPTI reports each kernel node of a graph):
                 per-kernel device time inside the graph, the busy union of the kernels and the
                 idle fraction of the replay window (launch gaps between dependent nodes)

`timeline_stats` is pure (intervals in, figures out) so the CPU tests check it on made-up
intervals; the rest needs CUDA.
"""
from __future__ import annotations

import time
from collections import defaultdict
from dataclasses import dataclass
from typing import Callable, Iterable


@dataclass(frozen=True)
class KernelSpan:
    """One device kernel (or memcpy/memset) of a trace: its name and [start, end) in microseconds."""

    name: str
    start_us: float
    end_us: float


def timeline_stats(spans: Iterable[KernelSpan], replays: int, top: int = 12) -> dict:
    """Per replay: kernels, their summed time, the busy union, the window (first start to last
    end) and the idle fraction of that window; the `top` kernel names by summed time.

    Example: spans (a, 0, 2), (b, 3, 4), one replay → kernel_us 3, busy_us 3, window_us 4, idle 0.25.
    """
    spans = sorted(spans, key=lambda s: s.start_us)
    if not spans or replays < 1:
        return {"kernels": 0, "kernel_us": 0.0, "busy_us": 0.0, "window_us": 0.0, "idle_fraction": 0.0, "top": []}
    busy, run_start, run_end = 0.0, spans[0].start_us, spans[0].end_us
    for span in spans[1:]:
        if span.start_us > run_end:
            busy += run_end - run_start
            run_start, run_end = span.start_us, span.end_us
        else:
            run_end = max(run_end, span.end_us)
    busy += run_end - run_start
    window = max(s.end_us for s in spans) - spans[0].start_us
    by_name: dict[str, list[float]] = defaultdict(lambda: [0, 0.0])
    for span in spans:
        by_name[span.name][0] += 1
        by_name[span.name][1] += span.end_us - span.start_us
    ranked = sorted(by_name.items(), key=lambda item: -item[1][1])[:top]
    return {"kernels": len(spans) / replays, "kernel_us": sum(v[1] for v in by_name.values()) / replays,
            "busy_us": busy / replays, "window_us": window / replays,
            "idle_fraction": 1.0 - busy / window if window > 0 else 0.0,
            "top": [{"name": name, "count": count / replays, "us": us / replays} for name, (count, us) in ranked]}


def device_spans(events) -> list[KernelSpan]:
    """The device-side events of a torch.profiler run (every kernel, memcpy and memset, linked to a
    CPU launch or not: Triton's driver-API launches and graph nodes are often unlinked)."""
    import torch

    return [KernelSpan(e.name, e.time_range.start, e.time_range.end) for e in events
            if e.device_type == torch.autograd.DeviceType.CUDA]


def host_ms(step: Callable[[int], None], steps: int) -> float:
    """Mean host time of `step(i)` without waiting for the device (synced before and after only)."""
    import torch

    torch.cuda.synchronize()
    start = time.perf_counter()
    for i in range(steps):
        step(i)
    host = (time.perf_counter() - start) / steps
    torch.cuda.synchronize()
    return host * 1e3


def replay_ms(replay: Callable[[], None], steps: int) -> float:
    """Median device time of `replay()` between two CUDA events."""
    import torch

    times = []
    for _ in range(steps):
        begin, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        begin.record()
        replay()
        end.record()
        end.synchronize()
        times.append(begin.elapsed_time(end))
    return sorted(times)[len(times) // 2]


def profile_replays(replay: Callable[[], None], replays: int) -> dict:
    """`timeline_stats` of `replays` graph replays under torch.profiler (CUDA activity only)."""
    import torch
    from torch.profiler import ProfilerActivity, profile

    torch.cuda.synchronize()
    with profile(activities=[ProfilerActivity.CUDA]) as prof:
        for _ in range(replays):
            replay()
        torch.cuda.synchronize()
    return timeline_stats(device_spans(prof.events()), replays)


def split_graph_step(runner, decode_step: Callable[[int], None], bucket: int, steps: int) -> dict:
    """host_ms of `decode_step`, then replay_ms and the timeline of the bucket's captured graph
    replayed on the inputs the last step loaded."""
    graph = runner.graphs._graphs[bucket]  # the bench's reach inside: the replay alone, no upload
    result = {"host_ms": host_ms(decode_step, steps)}
    graph.replay()  # warm
    result["replay_ms"] = replay_ms(graph.replay, steps)
    result["timeline"] = profile_replays(graph.replay, min(steps, 5))
    return result


def print_split(head: str, split: dict, step_ms: float | None) -> None:
    """One summary line, then the top kernels inside the graph."""
    t = split["timeline"]
    step = f", step {step_ms:.3f} ms" if step_ms else ""
    print(f"{head} split: host {split['host_ms']:.3f} ms/step, replay {split['replay_ms']:.3f} ms (events){step}; "
          f"in the graph {t['kernels']:.0f} kernels, {t['kernel_us'] / 1e3:.3f} ms of kernel time, busy "
          f"{t['busy_us'] / 1e3:.3f} of {t['window_us'] / 1e3:.3f} ms (idle {t['idle_fraction']:.0%})")
    for row in t["top"]:
        print(f"    {row['us']:>8.1f} us  x{row['count']:<5.0f} {row['name'][:110]}")

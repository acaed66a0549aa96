"""Shared pieces of `bench/kernels_gpu.py`: H200 ceilings, timing, the reference check, the final table.

A `Row` is one kernel (or runner step) at one shape: its time, the floor its bytes and FLOPs allow
on the H200 (`floor_ms`, from ../shared/FACTS.md), its error against the torch reference, and an
optional baseline time (bf16, torch) for a speed-up. `% roof` = floor / time.
"""
from __future__ import annotations

import time
from dataclasses import asdict, dataclass, field

import torch

COPY_GBS = 4136.0  # device-to-device copy, bytes read + written
BF16_TFLOPS = 758.0  # bf16 GEMM 8192^3
FP8_TFLOPS = 1325.0  # torch._scaled_mm 8192^3
TOL_BF16 = 2e-2


def floor_ms(flops: float = 0.0, nbytes: float = 0.0, tflops: float = BF16_TFLOPS) -> float:
    """The roofline time: the larger of compute at `tflops` and traffic at copy bandwidth."""
    return max(flops / tflops / 1e9, nbytes / COPY_GBS / 1e6)


def rel_err(out: torch.Tensor, ref: torch.Tensor) -> float:
    """‖out − ref‖ / ‖ref‖ in float64; NaN anywhere in `out` (e.g. a poisoned, unwritten cell) is NaN."""
    if torch.isnan(out).any():
        return float("nan")
    return float((out.double() - ref.double()).norm() / ref.double().norm().clamp_min(1e-30))


def poisoned_copy(out: torch.Tensor) -> torch.Tensor:
    """`out` copied over a NaN-filled buffer: a kernel that left cells unwritten would show NaN there
    only if it wrote in place; the copy also checks shape and dtype."""
    buf = torch.full_like(out, float("nan"))
    buf.copy_(out)
    return buf


@dataclass
class Timer:
    """Median milliseconds of `fn()`: `triton.testing.do_bench` on CUDA, a perf_counter loop on CPU."""

    device: str
    rep_ms: int = 50

    def __call__(self, fn) -> float:
        if self.device == "cuda":
            import triton.testing

            return float(triton.testing.do_bench(fn, warmup=10, rep=self.rep_ms, return_mode="median"))
        fn()  # CPU (--tiny, Triton's interpreter): one warm-up and one timed call; only the path is checked
        start = time.perf_counter()
        fn()
        return (time.perf_counter() - start) * 1e3


@dataclass
class Context:
    device: str
    tiny: bool
    timer: Timer
    notes: list[str] = field(default_factory=list)


@dataclass
class Row:
    part: str
    case: str
    impl: str
    ms: float | None
    floor_ms: float | None
    err: float | None = None  # vs the torch reference
    base: str = ""  # what `base_ms` times
    base_ms: float | None = None
    note: str = ""

    @property
    def pct_roof(self) -> float | None:
        return None if not self.ms or self.floor_ms is None else 100.0 * self.floor_ms / self.ms

    def ok(self, tol: float = TOL_BF16) -> bool:
        return self.err is None or (self.err == self.err and self.err < tol)

    def to_json(self) -> dict:
        return {**asdict(self), "pct_roof": self.pct_roof, "ok": self.ok()}


def _fmt(value: float | None, spec: str) -> str:
    return "-" if value is None else format(value, spec)


def format_table(rows: list[Row]) -> str:
    head = ("part", "case", "impl", "ms", "floor ms", "% roof", "err vs ref", "check", "baseline", "base ms",
            "speed-up", "note")
    lines = [head]
    for r in rows:
        speed = r.base_ms / r.ms if r.base_ms and r.ms else None
        lines.append((r.part, r.case, r.impl, _fmt(r.ms, ".3f"), _fmt(r.floor_ms, ".3f"), _fmt(r.pct_roof, ".0f"),
                      _fmt(r.err, ".1e"), "ok" if r.ok() else "FAIL", r.base or "-", _fmt(r.base_ms, ".3f"),
                      _fmt(speed, ".2f"), r.note))
    widths = [max(len(str(line[i])) for line in lines) for i in range(len(head))]
    out = ["| " + " | ".join(str(c).ljust(w) for c, w in zip(line, widths)) + " |" for line in lines]
    out.insert(1, "|" + "|".join("-" * (w + 2) for w in widths) + "|")
    return "\n".join(out)

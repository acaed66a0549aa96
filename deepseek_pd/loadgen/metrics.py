"""Per-request measurements and the summary a serving benchmark reports.

Definitions (as in SGLang's and vLLM's bench_serving):
- TTFT: request sent -> first token received.
- TPOT: (latency - TTFT) / (output tokens - 1), per request; undefined for one-token outputs.
- ITL: gap between consecutive streamed pieces, over all requests.
- Goodput: completed requests per second whose TTFT and TPOT are within the SLOs given.
"""
from __future__ import annotations

from dataclasses import asdict, dataclass, field

import numpy as np

PERCENTILES = (50, 90, 99)


@dataclass
class RequestRecord:
    prompt_len: int
    expected_output_len: int
    success: bool = False
    output_len: int = 0
    ttft: float | None = None
    latency: float = 0.0
    itls: list[float] = field(default_factory=list)
    start_offset: float = 0.0  # seconds since the benchmark started, for the timeline plot
    error: str = ""

    @property
    def tpot(self) -> float | None:
        if not self.success or self.ttft is None or self.output_len < 2:
            return None
        return (self.latency - self.ttft) / (self.output_len - 1)


@dataclass(frozen=True)
class SLO:
    ttft_ms: float | None = None
    tpot_ms: float | None = None

    def met_by(self, record: RequestRecord) -> bool:
        if not record.success:
            return False
        if self.ttft_ms is not None and (record.ttft is None or record.ttft * 1e3 > self.ttft_ms):
            return False
        tpot = record.tpot
        if self.tpot_ms is not None and tpot is not None and tpot * 1e3 > self.tpot_ms:
            return False
        return True


def _stats_ms(values: list[float]) -> dict[str, float | None]:
    if not values:
        return {"mean": None, **{f"p{p}": None for p in PERCENTILES}}
    arr = np.asarray(values, dtype=np.float64) * 1e3
    out = {"mean": float(arr.mean())}
    out.update({f"p{p}": float(np.percentile(arr, p)) for p in PERCENTILES})
    return out


def summarize(records: list[RequestRecord], duration_s: float, slo: SLO) -> dict:
    done = [r for r in records if r.success]
    input_tokens = sum(r.prompt_len for r in done)
    output_tokens = sum(r.output_len for r in done)
    duration_s = max(duration_s, 1e-9)
    return {
        "num_requests": len(records),
        "completed": len(done),
        "failed": len(records) - len(done),
        "errors": sorted({r.error for r in records if r.error})[:10],
        "duration_s": duration_s,
        "total_input_tokens": input_tokens,
        "total_output_tokens": output_tokens,
        "request_throughput": len(done) / duration_s,
        "input_throughput": input_tokens / duration_s,
        "output_throughput": output_tokens / duration_s,
        "goodput": sum(slo.met_by(r) for r in records) / duration_s,
        "slo": asdict(slo),
        "ttft_ms": _stats_ms([r.ttft for r in done if r.ttft is not None]),
        "tpot_ms": _stats_ms([r.tpot for r in done if r.tpot is not None]),
        "itl_ms": _stats_ms([gap for r in done for gap in r.itls]),
        "e2e_latency_ms": _stats_ms([r.latency for r in done]),
    }

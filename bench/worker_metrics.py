"""The workers' own /metrics around one serving level: where a request's time went, per worker.

A client's TTFT is router + prefill worker + transfer + decode worker; the workers already keep
histograms of their side (workers/metrics/worker_metrics.py). Scraping them before and after a level and
taking the difference gives, per worker, the mean of what that level added:

    prefill-0: ttft 89.1 ms, prefill step 86.3 ms x 1.0 requests (771 tokens), KV send 3.2 ms,
               GC 41 pauses, 3.0 ms in all
               prefill step p50 ~33.5 ms (its histogram's buckets; the mean above counts every slow one)
               prefill round (means): hop_in 0.2, prepare 1.1, launch 82.0, sample 0.4, gpu_wait 2.4,
               other 0.1, hop_out 0.1 ms; unattributed 0.0 ms
               prefill request (means): handshake 1.9, prefill 85.0, finish 2.2 ms
    decode-0:  ttft 95.2 ms, decode step 10.9 ms x 31.5 requests, KV receive 94.8 ms,
               GC 310 pauses, 20.5 ms in all (1 full, mean 8.2 ms)

(a worker's TTFT runs from its Generate to its first token; decode's "KV receive" from its
handshake to the checked TransferDone, so it holds the prefill's compute). The prefill round's
phases (workers/engine/round_clock.py) are means per round, so they add up to the step's mean;
"unattributed" is what they leave of it (0 but for rounding, unless some round reported none).
A prefill request's phases (until decode's handshake, until its first token, until TransferDone
is through) are means per request and add up to about the prefill worker's TTFT.
A mean is moved by a few slow steps (a kernel first loaded mid-run, a full GC) where a median is
not: the step's p50 is interpolated within its histogram bucket, as Prometheus'
`histogram_quantile` does. The metrics URLs come from the workers' start logs, as `up` writes them.
"""
from __future__ import annotations

import re
import urllib.request
from pathlib import Path

from prometheus_client.parser import text_string_to_metric_families

from deepseek_pd.workers.engine.round_clock import PHASES

PREFIX = "deepseek_pd:"
_URL = re.compile(r"Prometheus metrics on (http://\S+/metrics)")
_WORKER_LOG = re.compile(r"(prefill|decode)-\d+")
# what -> (histogram, label filter): its _sum and _count, summed over the matching samples
_SAMPLES = {
    "ttft": ("time_to_first_token_seconds", {}),
    "kv": ("kv_transfer_seconds", {}),
    "prefill_step": ("step_seconds", {"mode": "prefill"}),
    "decode_step": ("step_seconds", {"mode": "decode"}),
    "gc": ("gc_pause_seconds", {}),  # every generation: the process stood still this long
    "gc2": ("gc_pause_seconds", {"generation": "2"}),  # full collections
}
PHASES_HISTOGRAM = "prefill_round_phase_seconds"  # by label "phase"
REQUEST_PHASES_HISTOGRAM = "prefill_request_phase_seconds"  # by label "phase"
STEP_HISTOGRAM = "step_seconds"
# what -> (counter sample, label filter)
_COUNTERS = {"prefill_tokens": ("step_tokens_total", {"mode": "prefill"}),
             "prefill_rows": ("step_requests_total", {"mode": "prefill"}),
             "decode_rows": ("step_requests_total", {"mode": "decode"})}


def metrics_urls(log_dir: Path) -> dict[str, str]:
    """Worker name (its log's stem, e.g. prefill-0) -> its metrics URL (the latest start's)."""
    urls = {}
    for log in sorted(log_dir.glob("*.log")):
        if not _WORKER_LOG.fullmatch(log.stem):  # up.log and router.log may repeat workers' lines
            continue
        found = _URL.findall(log.read_text(errors="replace"))
        if found:
            urls[log.stem] = found[-1]
    return urls


def _matches(labels: dict, wanted: dict) -> bool:
    return all(labels.get(key) == value for key, value in wanted.items())


def parse(text: str) -> dict[str, float]:
    """The totals this module reads: `<what>_sum`/`<what>_count` of the histograms and the counters."""
    totals: dict[str, float] = {}
    for family in text_string_to_metric_families(text):
        for sample in family.samples:
            for what, (name, wanted) in _SAMPLES.items():
                for suffix in ("_sum", "_count"):
                    if sample.name == PREFIX + name + suffix and _matches(sample.labels, wanted):
                        totals[what + suffix] = totals.get(what + suffix, 0.0) + sample.value
            for what, (name, wanted) in _COUNTERS.items():
                if sample.name == PREFIX + name and _matches(sample.labels, wanted):
                    totals[what] = totals.get(what, 0.0) + sample.value
            if sample.name == PREFIX + PHASES_HISTOGRAM + "_sum":
                key = f"phase:{sample.labels['phase']}"
                totals[key] = totals.get(key, 0.0) + sample.value
            for suffix in ("_sum", "_count"):
                if sample.name == PREFIX + REQUEST_PHASES_HISTOGRAM + suffix:
                    key = f"request:{sample.labels['phase']}{suffix}"
                    totals[key] = totals.get(key, 0.0) + sample.value
            if sample.name == PREFIX + STEP_HISTOGRAM + "_bucket" and sample.labels.get("mode") == "prefill":
                key = f"prefill_step_le:{sample.labels['le']}"
                totals[key] = totals.get(key, 0.0) + sample.value
    return totals


def bucket_quantile(q: float, cumulative: dict[float, float]) -> float | None:
    """The `q` quantile of a histogram given as {upper bound: cumulative count} (with +Inf), linear
    within the bucket it falls in (Prometheus' `histogram_quantile`); None when it is empty. A
    quantile in the +Inf bucket is reported as the last finite bound."""
    bounds = sorted(cumulative)
    total = cumulative[bounds[-1]] if bounds else 0.0
    if total <= 0:
        return None
    rank, below, lower = q * total, 0.0, 0.0
    for bound in bounds:
        count = cumulative[bound]
        if count >= rank and count > below:
            if bound == float("inf"):
                return lower
            return lower + (bound - lower) * (rank - below) / (count - below)
        below, lower = count, bound
    return lower


def scrape(urls: dict[str, str], timeout_s: float = 5.0) -> dict[str, dict[str, float]]:
    """Each worker's totals now; a worker that does not answer is left out."""
    out = {}
    for name, url in urls.items():
        try:
            with urllib.request.urlopen(url, timeout=timeout_s) as response:
                out[name] = parse(response.read().decode())
        except OSError:
            continue
    return out


def breakdown(before: dict[str, dict[str, float]], after: dict[str, dict[str, float]]) -> dict[str, dict]:
    """Per worker, the means over what happened between the two scrapes (ms, requests, tokens)."""
    result = {}
    for name, now in after.items():
        then = before.get(name, {})

        def delta(key: str) -> float:
            return now.get(key, 0.0) - then.get(key, 0.0)

        row: dict[str, float] = {}
        for what in _SAMPLES:
            count = delta(what + "_count")
            if count > 0:
                row[f"{what}_ms"] = delta(what + "_sum") / count * 1e3
                row[f"{what}_count"] = count
        if delta("gc_count") > 0:
            row["gc_total_ms"] = delta("gc_sum") * 1e3
        for mode in ("prefill", "decode"):
            steps = delta(f"{mode}_step_count")
            if steps > 0:
                row[f"{mode}_rows_per_step"] = delta(f"{mode}_rows") / steps
        rounds = delta("prefill_step_count")
        if rounds > 0:
            row["prefill_tokens_per_step"] = delta("prefill_tokens") / rounds
            buckets = {float(key.split(":", 1)[1]): delta(key) for key in now if key.startswith("prefill_step_le:")}
            p50 = bucket_quantile(0.5, buckets)
            if p50 is not None:
                row["prefill_step_p50_ms"] = p50 * 1e3
            phases = {key.split(":", 1)[1]: delta(key) / rounds * 1e3 for key in now if key.startswith("phase:")}
            if any(phases.values()):
                row["prefill_phases_ms"] = {phase: ms for phase, ms in phases.items() if ms > 0}
                row["prefill_unattributed_ms"] = row["prefill_step_ms"] - sum(phases.values())
        requests = {key.split(":", 1)[1][:-len("_sum")]: key for key in now
                    if key.startswith("request:") and key.endswith("_sum")}
        request_ms = {phase: delta(key) / delta(key[:-len("_sum")] + "_count") * 1e3
                      for phase, key in requests.items() if delta(key[:-len("_sum")] + "_count") > 0}
        if request_ms:
            row["prefill_request_phases_ms"] = request_ms
        result[name] = row
    return result


def describe(rows: dict[str, dict]) -> str:
    """One line per worker, as in the module doc."""
    lines = []
    for name, row in sorted(rows.items()):
        parts = []
        if "ttft_ms" in row:
            parts.append(f"ttft {row['ttft_ms']:.1f} ms")
        for mode in ("prefill", "decode"):
            if f"{mode}_step_ms" in row:
                extra = (f" ({row['prefill_tokens_per_step']:.0f} tokens)" if mode == "prefill" else "")
                parts.append(f"{mode} step {row[f'{mode}_step_ms']:.1f} ms x "
                             f"{row.get(f'{mode}_rows_per_step', 0):.1f} requests{extra}")
        if "kv_ms" in row:
            parts.append(f"KV {'send' if name.startswith('prefill') else 'receive'} {row['kv_ms']:.1f} ms")
        if "gc_count" in row:
            full = f" ({row['gc2_count']:.0f} full, mean {row['gc2_ms']:.1f} ms)" if "gc2_count" in row else ""
            parts.append(f"GC {row['gc_count']:.0f} pauses, {row['gc_total_ms']:.1f} ms in all{full}")
        lines.append(f"{name}: {', '.join(parts) or 'nothing'}")
        if "prefill_step_p50_ms" in row:
            lines.append(f"  prefill step p50 ~{row['prefill_step_p50_ms']:.1f} ms (its histogram's buckets; "
                         f"the mean above counts every slow one)")
        if "prefill_phases_ms" in row:
            phases = ", ".join(f"{phase} {ms:.1f}" for phase, ms in _in_order(row["prefill_phases_ms"]))
            lines.append(f"  prefill round (means): {phases} ms; unattributed {row['prefill_unattributed_ms']:.1f} ms")
        if "prefill_request_phases_ms" in row:
            lines.append("  prefill request (means): " + ", ".join(
                f"{phase} {ms:.1f}" for phase, ms in row["prefill_request_phases_ms"].items()) + " ms")
    return "\n".join(lines)


def _in_order(phases: dict[str, float]) -> list[tuple[str, float]]:
    return sorted(phases.items(), key=lambda item: PHASES.index(item[0]) if item[0] in PHASES else len(PHASES))

"""`WorkerMetrics`: the Prometheus metrics of one worker process, fed by its servicer and engine.

The module knows no role. What feeds it, and how often (never per token):

    servicer (any role)  observe_request(...) once per finished request, count_failed_request(code)
                         once per failed one: request counts by finish reason, token totals, TTFT,
                         TPOT and end-to-end latency histograms
    engine, per step     observe_step(mode, seconds, num_reqs, num_tokens): one call per extend or
                         decode step for the whole batch (step time, tokens forwarded);
                         observe_round_phases(phases): where a prefill worker's round went
                         (workers/engine/round_clock.py, one series per phase);
                         observe_request_phases(phases): where a prefill request's time went
                         (REQUEST_PHASES, once per request that got its first token);
                         observe_inter_token_latency(gaps): one call per collected decode step
                         with each streamed token's gap since its request's previous token
    engine, per request  observe_prefix_cache(queried, hit), observe_kv_transfer(...),
                         count_kv_transfer_failure(...)
    prefill bootstrap    count_handshake_failure(reason): a refused or failed decode handshake
    garbage collector    observe_gc_pause(generation, seconds) per collection (gc_pauses.py; lock-free,
                         folded into the histogram at scrape time), the frozen startup heap's size
    at scrape time       watch_loads(fn) -> running/queued requests and KV pool pages (the same
                         `Loads` GetLoads reports); watch_paths(kind, fn) -> the runner's decode
                         steps / extend forwards by CUDA-graph replay vs eager; watch_expert_load(fn) -> the expert-load
                         dump served as JSON at /expert_load (not a Prometheus series)

Names follow SGLang's (`sglang:num_running_reqs`, `sglang:time_to_first_token_seconds`, ...) with
our own prefix, so an SGLang dashboard works after replacing `sglang:` with `deepseek_pd:`. Every
series carries the constant labels `role`, `model_name` and `rank` (the DP rank inside a
multi-rank group; "0" for a single process). docs/operations.md lists every metric.

Each instance has its own `CollectorRegistry`, so two engines in one test process never share
series; `serve` exports it with `MetricsServer` (metrics_server.py).
"""
from __future__ import annotations

import bisect
import collections
import gc
import threading
from dataclasses import dataclass
from typing import Callable, Iterable, Mapping

from prometheus_client import CollectorRegistry, Counter, Histogram
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily, HistogramMetricFamily

from deepseek_pd.workers.engine.interface import Loads
from deepseek_pd.workers.engine.round_clock import PHASES
from deepseek_pd.workers.metrics.bulk_histogram import BulkHistogram, cumulative_buckets

PREFIX = "deepseek_pd:"
CONSTANT_LABELS = ("role", "model_name", "rank")
STEP_MODES = ("prefill", "decode")  # an extend step (prefill or colocated prompt) or a decode step

# Seconds. Request latencies span interactive to long generations; steps and TPOT are milliseconds.
TTFT_BUCKETS = (0.01, 0.025, 0.05, 0.1, 0.2, 0.4, 0.6, 0.8, 1, 2, 4, 8, 16, 32, 64, 128)
TPOT_BUCKETS = (0.001, 0.002, 0.005, 0.01, 0.02, 0.03, 0.05, 0.075, 0.1, 0.15, 0.2, 0.3, 0.5, 1, 2)
E2E_BUCKETS = (0.05, 0.1, 0.25, 0.5, 1, 2, 4, 8, 16, 32, 64, 128, 256, 512, 1024)
STEP_BUCKETS = (0.0005, 0.001, 0.002, 0.004, 0.006, 0.008, 0.01, 0.015, 0.02, 0.03, 0.05, 0.075,
                0.1, 0.2, 0.5, 1, 2, 5)
# A round's phases span a few microseconds (a hop) to the whole step.
# A prefill request's time on its worker, from Generate to TransferDone answered:
#   handshake  until decode's handshake has arrived and the KV channel is open
#   prefill    until its first token is sampled (waiting for pages and for rounds, and its rounds)
#   finish     until the KV that was left to send and TransferDone are through
REQUEST_PHASES = ("handshake", "prefill", "finish")
PHASE_BUCKETS = (0.00005, 0.0001, 0.00025, 0.0005, 0.001, 0.002, 0.004, 0.008, 0.015, 0.03, 0.05, 0.1, 0.2,
                 0.5, 1, 2, 5)
# SGLang's default `bucket_inter_token_latency` (sglang:inter_token_latency_seconds).
ITL_BUCKETS = (0.002, 0.004, 0.006, 0.008, 0.01, 0.015, 0.02, 0.025, 0.03, 0.035, 0.04, 0.06, 0.08, 0.1,
               0.2, 0.4, 0.6, 0.8, 1, 2, 4, 6, 8)
TRANSFER_BUCKETS = (0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1, 2.5, 5, 10, 30, 60)
# Tokens one request gets from one speculative verify forward: 1 (every draft rejected) .. steps + 1.
ACCEPT_LENGTH_BUCKETS = (1, 2, 3, 4, 5, 6, 7, 8, 9)
GC_PAUSE_BUCKETS = (0.0001, 0.0005, 0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1)
GC_GENERATIONS = (0, 1, 2)

# Why the prefill bootstrap refused or failed a decode handshake (a bounded set: never a room id).
#   unauthenticated  no, bad, stale, replayed or misaddressed token (Transfer, KVStream, Abort, Route)
#   wrong_dp_rank    the room belongs to another DP rank of this group, or decode's route table is stale
#   protocol         another bootstrap protocol version, a first message that is not a Handshake /
#                    KVStreamOpen, a KV stream index the room does not have
#   unknown_room     a KV stream for a room with no handshake
#   duplicate        a second handshake for a room that already has one
#   timeout          no first message within handshake_timeout_s, or the prefill request never
#                    claimed the room within claim_timeout_s
HANDSHAKE_FAILURE_REASONS = ("unauthenticated", "wrong_dp_rank", "protocol", "unknown_room", "duplicate", "timeout")


@dataclass(frozen=True)
class MetricLabels:
    """The constant labels of every series of one worker process."""

    role: str = ""
    model_name: str = ""
    rank: int = 0

    def values(self) -> dict[str, str]:
        return {"role": self.role, "model_name": self.model_name, "rank": str(self.rank)}


LoadsSource = Callable[[], Loads]
# {"cuda_graph": n, "eager": m}: a runner's forwards so far by the path they ran (ModelRunner.decode_paths,
# ModelRunner.extend_paths).
PathsSource = Callable[[], Mapping[str, int]]
FORWARD_PATHS = ("cuda_graph", "eager")
# Per kind of forward: the counter its runner's paths are exported as, and what the counter says.
PATH_COUNTERS = {
    "decode": ("decode_steps", "Decode steps by how they ran: CUDA-graph replay or eager (no graph, or "
               "batch/context past the captured ones)"),
    "extend": ("extend_forwards", "Extend forwards by how they ran while piecewise extend graphs are on: "
               "CUDA-graph replay or eager (more tokens than the largest captured bucket); none counted "
               "without extend graphs"),
}


class WorkerMetrics:
    """Counters and histograms of one worker; see the module docstring for who calls what."""

    def __init__(self, labels: MetricLabels = MetricLabels()) -> None:
        self.labels = labels
        self.registry = CollectorRegistry(auto_describe=True)
        self._const = labels.values()
        const = list(CONSTANT_LABELS)

        def counter(name: str, doc: str, extra: tuple[str, ...] = ()) -> Counter:
            return Counter(PREFIX + name, doc, const + list(extra), registry=self.registry)

        def histogram(name: str, doc: str, buckets, extra: tuple[str, ...] = ()) -> Histogram:
            return Histogram(PREFIX + name, doc, const + list(extra), buckets=buckets, registry=self.registry)

        self._requests = counter("num_requests", "Requests finished, by finish reason (stop, length, abort)",
                                 ("finish_reason",))
        self._failed = counter("num_failed_requests", "Requests that ended with an error status, by code",
                               ("code",))
        self._prompt_tokens = counter("prompt_tokens", "Prompt tokens of finished requests").labels(**self._const)
        self._generation_tokens = counter(
            "generation_tokens", "Tokens generated for finished requests (prefill workers: the first token)"
        ).labels(**self._const)
        self._cached_tokens = counter("cached_tokens", "Prompt tokens of finished requests served from the "
                                      "prefix cache").labels(**self._const)
        self._ttft = histogram("time_to_first_token_seconds", "From the worker receiving Generate to its first "
                               "token", TTFT_BUCKETS).labels(**self._const)
        self._tpot = histogram("time_per_output_token_seconds", "(e2e - TTFT) / (output tokens - 1), per request "
                               "with at least 2 output tokens", TPOT_BUCKETS).labels(**self._const)
        self._e2e = histogram("e2e_request_latency_seconds", "From the worker receiving Generate to its final "
                              "response", E2E_BUCKETS).labels(**self._const)
        step_seconds = histogram("step_seconds", "One scheduler step's model call (the whole batch): extend "
                                 "(prefill) or decode", STEP_BUCKETS, ("mode",))
        step_tokens = counter("step_tokens", "Tokens forwarded by steps, by mode", ("mode",))
        step_reqs = counter("step_requests", "Requests (batch rows) forwarded by steps, by mode", ("mode",))
        self._step = {mode: tuple(metric.labels(**self._const, mode=mode) for metric in (step_seconds, step_tokens,
                                                                                        step_reqs))
                      for mode in STEP_MODES}
        phases = histogram("prefill_round_phase_seconds", "Where a prefill round's step went, by phase "
                           "(workers/engine/round_clock.py): the phases of one round add up to its step",
                           PHASE_BUCKETS, ("phase",))
        self._phases = {phase: phases.labels(**self._const, phase=phase) for phase in PHASES}
        request_phases = histogram("prefill_request_phase_seconds", "Where a prefill request's time went on "
                                   "the prefill worker, by phase: handshake, prefill, finish", TTFT_BUCKETS,
                                   ("phase",))
        self._request_phases = {phase: request_phases.labels(**self._const, phase=phase) for phase in REQUEST_PHASES}
        self._prefix_queries = counter("prefix_cache_queries", "Prompt tokens looked up in the prefix cache"
                                       ).labels(**self._const)
        self._prefix_hits = counter("prefix_cache_hits", "Prompt tokens found in the prefix cache"
                                    ).labels(**self._const)
        self._kv_bytes = counter("kv_transfer_bytes", "Bytes of latent KV moved between prefill and decode "
                                 "(prefill: sent, decode: received)", ("transport",))
        self._kv_seconds = histogram("kv_transfer_seconds", "Per request: decode, from the handshake to "
                                     "TransferDone; prefill, time spent sending", TRANSFER_BUCKETS, ("transport",))
        self._kv_failures = counter("kv_transfer_failures", "KV transfers that failed, counted by the decode "
                                    "side (the one that pulls), by transport and code", ("transport", "code"))
        self._handshake_failures = counter(
            "bootstrap_handshake_failures", "Decode handshakes (and KV streams, aborts, route requests) the "
            "prefill bootstrap refused or failed, by reason", ("reason",))
        for reason in HANDSHAKE_FAILURE_REASONS:  # zero before the first one, so rate() has a baseline
            self._handshake_failures.labels(*self._const.values(), reason)
        self._spec_drafted = counter("spec_draft_tokens", "Speculative decoding: tokens the MTP layer drafted"
                                     ).labels(**self._const)
        self._spec_accepted = counter("spec_accepted_tokens", "Speculative decoding: drafted tokens the target "
                                      "confirmed").labels(**self._const)
        self._spec_accept_length = histogram(
            "spec_accept_length", "Speculative decoding: tokens one request got from one verify forward (the "
            "accepted drafts + the target's own)", ACCEPT_LENGTH_BUCKETS).labels(**self._const)
        self._itl = BulkHistogram(PREFIX + "inter_token_latency_seconds", "Time between consecutive tokens of "
                                  "one request as the engine streams them (the first decode token's gap starts "
                                  "at the first token)", ITL_BUCKETS, self._const)
        self.registry.register(self._itl)
        self._gc = _GcPauseSeries(self._const)
        self.registry.register(self._gc)
        self._children: dict[tuple, object] = {}  # labelled children by (metric, values): no labels() per call
        self._sources = _ScrapeSources(self._const)
        self.registry.register(self._sources)
        self.expert_load: Callable[[], dict] | None = None  # watch_expert_load

    # ---- scrape-time sources -----------------------------------------------------------------
    def watch_loads(self, loads: LoadsSource) -> None:
        """Gauges of running/queued requests and KV pool pages, read from `loads()` at scrape time
        (the engine's own `loads`; called on the thread that serves /metrics)."""
        self._sources.loads = loads

    def watch_paths(self, kind: str, paths: PathsSource) -> None:
        """The runner's `kind` forwards ("decode" | "extend", PATH_COUNTERS) by path, read from
        `paths()` at scrape time (`ModelRunner.decode_paths` / `.extend_paths`)."""
        if kind not in PATH_COUNTERS:
            raise ValueError(f"unknown forward kind {kind!r} (one of {', '.join(PATH_COUNTERS)})")
        self._sources.paths[kind] = paths

    def watch_expert_load(self, dump: Callable[[], dict]) -> None:
        """This rank's expert-load dump as JSON (model/eplb/load_dump.py), read per GET /expert_load."""
        self.expert_load = dump

    # ---- garbage collector -------------------------------------------------------------------
    def observe_gc_pause(self, generation: int, seconds: float) -> None:
        """One collection of `generation` (gc_pauses.GcPauses). Called inside the collector, by any
        thread: it never waits for a lock (that thread might hold it already); see _GcPauseSeries."""
        self._gc.observe(generation, seconds)

    # ---- servicer ----------------------------------------------------------------------------
    def observe_request(self, finish_reason: str, prompt_tokens: int, completion_tokens: int, cached_tokens: int,
                        ttft_s: float | None, e2e_s: float) -> None:
        """One finished request (`Finished`); `ttft_s` is None if it produced no token."""
        self._child(self._requests, finish_reason).inc()
        self._prompt_tokens.inc(prompt_tokens)
        self._generation_tokens.inc(completion_tokens)
        self._cached_tokens.inc(cached_tokens)
        self._e2e.observe(e2e_s)
        if ttft_s is not None:
            self._ttft.observe(ttft_s)
            if completion_tokens > 1:
                self._tpot.observe((e2e_s - ttft_s) / (completion_tokens - 1))

    def count_failed_request(self, code: str) -> None:
        self._child(self._failed, code).inc()

    # ---- engines -----------------------------------------------------------------------------
    def observe_step(self, mode: str, seconds: float, num_reqs: int, num_tokens: int) -> None:
        """One step of `mode` ("prefill" | "decode") for a batch of `num_reqs` rows."""
        hist, tokens, reqs = self._step[mode]
        hist.observe(seconds)
        tokens.inc(num_tokens)
        reqs.inc(num_reqs)

    def observe_round_phases(self, phases: Mapping[str, float]) -> None:
        """One prefill round's phases (seconds by name of round_clock.PHASES; a phase the round did not
        pass is left out of its series, so each series' mean is over the rounds that had it)."""
        for phase, seconds in phases.items():
            self._phases[phase].observe(seconds)

    def observe_request_phases(self, phases: Mapping[str, float]) -> None:
        """One prefill request's phases (seconds by name of REQUEST_PHASES)."""
        for phase, seconds in phases.items():
            self._request_phases[phase].observe(seconds)

    def observe_inter_token_latency(self, gaps: Iterable[float]) -> None:
        """One collected decode step: each token it streamed, its seconds since the previous token of
        the same request (a request's first token has no gap). Once per step, not per token."""
        self._itl.observe_many(gaps)

    def observe_speculative(self, drafted: int, accepted: int, accept_lengths: Iterable[int]) -> None:
        """One speculative step: tokens drafted and accepted over the batch, and each row's accept length."""
        self._spec_drafted.inc(drafted)
        self._spec_accepted.inc(accepted)
        for length in accept_lengths:
            self._spec_accept_length.observe(length)

    def observe_prefix_cache(self, queried_tokens: int, hit_tokens: int) -> None:
        self._prefix_queries.inc(queried_tokens)
        self._prefix_hits.inc(hit_tokens)

    def observe_kv_transfer(self, transport: str, nbytes: int, seconds: float) -> None:
        self._child(self._kv_bytes, transport).inc(nbytes)
        self._child(self._kv_seconds, transport).observe(seconds)

    def count_kv_transfer_failure(self, transport: str, code: str) -> None:
        self._child(self._kv_failures, transport, code).inc()

    def count_handshake_failure(self, reason: str) -> None:
        """A handshake the prefill bootstrap refused or failed; `reason` is one of HANDSHAKE_FAILURE_REASONS."""
        if reason not in HANDSHAKE_FAILURE_REASONS:
            raise ValueError(f"unknown handshake failure reason {reason!r}")
        self._child(self._handshake_failures, reason).inc()

    def _child(self, metric, *values: str):
        key = (id(metric), values)
        child = self._children.get(key)
        if child is None:
            child = self._children[key] = metric.labels(*self._const.values(), *values)
        return child


class _ScrapeSources:
    """A custom collector: gauges and counters computed from the engine when /metrics is read,
    so the engine pays nothing for them between scrapes."""

    def __init__(self, const: dict[str, str]) -> None:
        self._names = list(const)
        self._values = list(const.values())
        self.loads: LoadsSource | None = None
        self.paths: dict[str, PathsSource] = {}  # by kind of forward (PATH_COUNTERS)

    def _gauge(self, name: str, doc: str, value: float | None) -> GaugeMetricFamily:
        family = GaugeMetricFamily(PREFIX + name, doc, labels=self._names)
        if value is not None:
            family.add_metric(self._values, value)
        return family

    def describe(self) -> Iterable:
        return list(self._families(None, None))

    def collect(self) -> Iterable:
        return list(self._families(self.loads() if self.loads else None,
                                   {kind: dict(source()) for kind, source in self.paths.items()}))

    def _families(self, loads: Loads | None, paths: dict[str, dict[str, int]] | None):
        get = (lambda attr: getattr(loads, attr)) if loads is not None else (lambda attr: None)
        yield self._gauge("num_running_reqs", "Requests in the running batch (decode) or being prefilled",
                          get("num_running"))
        yield self._gauge("num_queue_reqs", "Requests waiting: for KV pages, a handshake or the batch",
                          get("num_waiting"))
        yield self._gauge("kv_pool_used_pages", "KV pool pages held by requests (prefix-cache pages excluded)",
                          get("kv_used_pages"))
        yield self._gauge("kv_pool_total_pages", "KV pool pages in total", get("kv_total_pages"))
        usage = None if loads is None else (loads.kv_used_pages / loads.kv_total_pages if loads.kv_total_pages else 0.0)
        yield self._gauge("token_usage", "kv_pool_used_pages / kv_pool_total_pages", usage)
        cached = None if loads is None else loads.cached_pages
        yield self._gauge("kv_pool_cached_pages", "KV pool pages held by the prefix cache (evictable)", cached)
        for kind, (name, doc) in PATH_COUNTERS.items():
            family = CounterMetricFamily(PREFIX + name, doc, labels=self._names + ["path"])
            counts = (paths or {}).get(kind)
            for path in FORWARD_PATHS:
                if counts is not None:
                    family.add_metric(self._values + [path], counts.get(path, 0))
            yield family


class _GcPauseSeries:
    """`gc_pause_seconds` by generation and `gc_frozen_objects`, rendered at scrape time.

    Pauses arrive on a deque (an append takes no Python lock, so a collection that a scrape
    triggers while holding `_lock` cannot deadlock on it) and are folded into plain counts by the
    scrape, or by `observe` once FOLD_AT are pending and the lock is free at that instant (a worker
    nobody scrapes must not grow the deque forever)."""

    FOLD_AT = 1024

    def __init__(self, const: dict[str, str]) -> None:
        self._names, self._values = list(const), list(const.values())
        self.pending: collections.deque[tuple[int, float]] = collections.deque()
        self._counts = {g: [0] * (len(GC_PAUSE_BUCKETS) + 1) for g in GC_GENERATIONS}
        self._sums = dict.fromkeys(GC_GENERATIONS, 0.0)
        self._lock = threading.Lock()  # scrapes from several threads

    def describe(self) -> Iterable:
        return [HistogramMetricFamily(PREFIX + "gc_pause_seconds", _GC_PAUSE_DOC, labels=self._names + ["generation"]),
                GaugeMetricFamily(PREFIX + "gc_frozen_objects", _GC_FROZEN_DOC, labels=self._names)]

    def observe(self, generation: int, seconds: float) -> None:
        self.pending.append((generation, seconds))
        if len(self.pending) >= self.FOLD_AT and self._lock.acquire(blocking=False):
            try:
                self._fold()
            finally:
                self._lock.release()

    def _fold(self) -> None:
        """Moves the pending pauses into the counts; the caller holds `_lock`."""
        while self.pending:
            generation, seconds = self.pending.popleft()
            self._counts[generation][bisect.bisect_left(GC_PAUSE_BUCKETS, seconds)] += 1
            self._sums[generation] += seconds

    def collect(self) -> Iterable:
        with self._lock:
            self._fold()
            snapshot = {g: (list(counts), self._sums[g]) for g, counts in self._counts.items()}
        pauses = HistogramMetricFamily(PREFIX + "gc_pause_seconds", _GC_PAUSE_DOC, labels=self._names + ["generation"])
        for generation, (counts, total) in snapshot.items():
            pauses.add_metric(self._values + [str(generation)], cumulative_buckets(GC_PAUSE_BUCKETS, counts), total)
        frozen = GaugeMetricFamily(PREFIX + "gc_frozen_objects", _GC_FROZEN_DOC, labels=self._names)
        frozen.add_metric(self._values, gc.get_freeze_count())
        return [pauses, frozen]


_GC_PAUSE_DOC = ("Garbage-collection pauses of this worker process by generation (every thread stops "
                 "while one runs)")
_GC_FROZEN_DOC = "Objects of the startup heap frozen out of garbage collection (gc.freeze at start)"

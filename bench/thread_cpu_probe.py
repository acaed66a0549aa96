"""Which threads of a worker process run while its model thread runs a prefill forward (issue 25).

Loaded into a real `serve prefill` process by the engine-factory test hook, so the process is the
one `up` runs (its gRPC server and the router's calls, the bootstrap service, the KV sender to a
decode process), only observed:

    deepseek-pd up ... --worker-arg=--engine-factory=bench/thread_cpu_probe.py:build
    # with THREAD_PROBE_OUT=FILE in the environment: one JSON line per prefill forward

`build` builds the role's own engine (workers/serve/builders.py) and, for the prefill role, wraps
its `PrefillRounds.forward` (the model thread's part of a round). Around each forward it reads every
thread's kernel accounting (`/proc/self/task/<tid>/schedstat`: nanoseconds on a CPU and waiting
for one; `status`: voluntary and involuntary context switches), so each line says, per thread,
what it did during that forward:

    {"wall_s": 0.093, "tokens": 128, "prompts": 1, "model_tid": 15828,
     "threads": {"15828": {"name": "prefill-model_0", "role": "model", "cpu_s": 0.082, "wait_s": 0.008,
                           "voluntary": 0, "involuntary": 15}, "15528": {"name": "MainThread", ...}}}

Reading it: the model thread's `cpu_s` against `wall_s` says whether it ran or waited; with no
device sync in the launch phase (CPU, or a host-bound GPU forward) its `voluntary` switches are
its waits for the GIL (or a lock); `wait_s` is time runnable but without a CPU (other processes).
Another thread's `cpu_s` during the forward is Python the model thread may have waited for (a
thread in C without the GIL costs it nothing on a machine with cores to spare).

`THREAD_PROBE_STACKS=1` also samples, every 2 ms during a forward, the Python stack of each other
thread that ran since the last sample (its innermost frames), into "stacks": {role: {frame: n}}.
The sampler is a Python thread itself and slows the forward: for attribution, not for timing.
"""
from __future__ import annotations

import json
import os
import sys
import threading
import time
from collections import Counter
from pathlib import Path

from deepseek_pd.workers.serve.builders import BUILDERS

TASKS = Path("/proc/self/task")
SAMPLE_S = 0.002
STACK_DEPTH = 4
MIN_RAN_S = 50e-6  # CPU since the last sample below which a thread counts as idle (a wake-up, not work)
# Thread names (Python's, else the kernel's `comm`) by role, first match wins: how the report groups them.
ROLES = (("MainThread", "event loop"), ("kv-", "kv transport"), ("_poll_wrapper", "grpc poller"),
         ("os:event_engine", "grpc core"), ("os:grpc", "grpc core"), ("os:lifeguard", "grpc core"),
         ("direct-pools", "kv transport"), ("thread-probe", "probe"), ("os:", "native (not Python)"))


def thread_counters() -> dict[int, tuple[int, int, int, int]]:
    """{tid: (ns on a CPU, ns runnable without one, voluntary switches, involuntary switches)}."""
    out = {}
    for task in TASKS.iterdir():
        try:
            run_ns, wait_ns, _ = (task / "schedstat").read_text().split()
            switches = [int(line.split()[1]) for line in (task / "status").read_text().splitlines()
                        if line.startswith(("voluntary_ctxt", "nonvoluntary_ctxt"))]
        except (OSError, ValueError):
            continue  # the thread ended meanwhile
        out[int(task.name)] = (int(run_ns), int(wait_ns), *switches)
    return out


def thread_names() -> dict[int, str]:
    """{tid: name}: Python's thread name, else "os:" + the kernel's name (threads Python did not start)."""
    names = {thread.native_id: thread.name for thread in threading.enumerate()}
    for task in TASKS.iterdir():
        if int(task.name) not in names:
            try:
                names[int(task.name)] = "os:" + (task / "comm").read_text().strip()
            except OSError:
                pass
    return names


def role_of(name: str, is_model: bool) -> str:
    if is_model:
        return "model"
    return next((role for prefix, role in ROLES if name.startswith(prefix) or prefix in name), "other Python")


def forward_record(before: dict, after: dict, names: dict[int, str], model_tid: int) -> dict:
    """What each thread did between the two `thread_counters`, threads that did nothing left out."""
    threads = {}
    for tid, now in after.items():
        then = before.get(tid, (0, 0, 0, 0))
        delta = [a - b for a, b in zip(now, then)]
        if any(delta) or tid == model_tid:
            name = names.get(tid, str(tid))
            threads[str(tid)] = {"name": name, "role": role_of(name, tid == model_tid),
                                 "cpu_s": delta[0] / 1e9, "wait_s": delta[1] / 1e9,
                                 "voluntary": delta[2], "involuntary": delta[3]}
    return threads


class StackSampler:
    """Samples other threads' innermost Python frames while `active` (THREAD_PROBE_STACKS)."""

    def __init__(self) -> None:
        self.active = threading.Event()
        self.model_ident: int | None = None
        self.counts: dict[str, Counter] = {}
        self._names: dict[int, str] = {}
        self._cpu: dict[int, float] = {}
        threading.Thread(target=self._run, name="thread-probe", daemon=True).start()

    def _run(self) -> None:
        own = threading.get_ident()
        while True:
            self.active.wait()
            time.sleep(SAMPLE_S)
            if not self.active.is_set():
                continue
            threads = {t.ident: t for t in threading.enumerate()}
            for ident, frame in sys._current_frames().items():
                if ident in (own, self.model_ident) or ident not in threads:
                    continue
                try:
                    cpu = time.clock_gettime(time.pthread_getcpuclockid(ident))
                except OSError:
                    continue
                ran = cpu - self._cpu.get(ident, cpu) > MIN_RAN_S
                self._cpu[ident] = cpu
                if not ran:
                    continue
                where = []
                while frame is not None and len(where) < STACK_DEPTH:
                    where.append(f"{Path(frame.f_code.co_filename).name}:{frame.f_code.co_name}")
                    frame = frame.f_back
                name = threads[ident].name
                self.counts.setdefault(role_of(name, False), Counter())[" < ".join(where)] += 1

    def take(self) -> dict[str, dict[str, int]]:
        counts, self.counts = self.counts, {}
        return {role: dict(c.most_common(8)) for role, c in counts.items()}


def probe(rounds, out: Path, stacks: StackSampler | None) -> None:
    """Wraps `rounds.forward` (runs in the model thread) with the accounting; a line per forward to `out`."""
    forward = rounds.forward
    lock = threading.Lock()

    def observed(plan, *args, **kwargs):
        model_tid = threading.get_native_id()
        if stacks is not None:
            stacks.model_ident = threading.get_ident()
            stacks.active.set()
        before, began = thread_counters(), time.perf_counter()
        try:
            return forward(plan, *args, **kwargs)
        finally:
            wall = time.perf_counter() - began
            after = thread_counters()
            if stacks is not None:
                stacks.active.clear()
            record = {"wall_s": wall, "tokens": sum(len(seq.token_ids) for seq in plan.seqs),
                      "prompts": len(plan.items), "model_tid": model_tid,
                      "threads": forward_record(before, after, thread_names(), model_tid)}
            if stacks is not None:
                record["stacks"] = stacks.take()
            with lock, out.open("a") as sink:
                sink.write(json.dumps(record) + "\n")

    rounds.forward = observed


def build(config, metrics):
    """The engine-factory hook (module docstring): the role's own engine, the prefill one observed."""
    engine = BUILDERS[config.role](config, metrics)
    out = os.environ.get("THREAD_PROBE_OUT")
    if config.role == "prefill" and out:
        stacks = StackSampler() if os.environ.get("THREAD_PROBE_STACKS") == "1" else None
        probe(engine.rounds, Path(out), stacks)
    return engine

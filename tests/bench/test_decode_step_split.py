"""bench/decode_step_split.py's timeline figures (busy union, idle fraction, top kernels) against a
brute-force count over unit cells, on random integer kernel intervals from the run's seed. The
GPU measures themselves (host time, replay events, the profile) run in bench/decode_bs1_session.sh."""
from __future__ import annotations

import random
from collections import Counter

from pdtest.bench_scripts import bench_module


def test_timeline_stats_match_a_cell_count():
    split = bench_module("decode_step_split")
    rng = random.Random()
    for _ in range(20):
        replays = rng.randint(1, 3)
        spans = []
        for _ in range(rng.randint(1, 30)):
            start = rng.randint(0, 200)
            spans.append(split.KernelSpan(rng.choice("abcd"), float(start), float(start + rng.randint(1, 15))))
        rng.shuffle(spans)
        cells = {t for s in spans for t in range(int(s.start_us), int(s.end_us))}
        window = max(s.end_us for s in spans) - min(s.start_us for s in spans)
        per_name = Counter()
        for s in spans:
            per_name[s.name] += s.end_us - s.start_us
        stats = split.timeline_stats(spans, replays, top=2)
        assert stats["busy_us"] * replays == len(cells)
        assert stats["window_us"] * replays == window
        assert abs(stats["idle_fraction"] - (1 - len(cells) / window)) < 1e-12
        assert abs(stats["kernel_us"] * replays - sum(per_name.values())) < 1e-9
        assert stats["kernels"] * replays == len(spans)
        want_top = sorted(per_name.values(), reverse=True)[:2]
        assert [row["us"] * replays for row in stats["top"]] == want_top
    assert split.timeline_stats([], 1)["kernels"] == 0

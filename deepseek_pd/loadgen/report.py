"""The benchmark's outputs: a JSON document (config + summary + per-request rows) and a PNG."""
from __future__ import annotations

import json
from dataclasses import asdict
from pathlib import Path

from deepseek_pd.loadgen.metrics import RequestRecord


def write_json(path: Path, config: dict, summary: dict, records: list[RequestRecord]) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    rows = [{**asdict(r), "tpot": r.tpot} for r in records]
    path.write_text(json.dumps({"config": config, "summary": summary, "requests": rows}, indent=2))


def write_png(path: Path, summary: dict, records: list[RequestRecord], title: str) -> None:
    import matplotlib

    matplotlib.use("Agg")  # no display on servers and in CI
    import matplotlib.pyplot as plt

    done = [r for r in records if r.success]
    fig, axes = plt.subplots(2, 2, figsize=(11, 8))
    ax = axes[0][0]
    ax.hist([r.ttft * 1e3 for r in done if r.ttft is not None], bins=30, color="tab:blue")
    ax.set(title="TTFT", xlabel="ms", ylabel="requests")
    ax = axes[0][1]
    ax.hist([g * 1e3 for r in done for g in r.itls], bins=30, color="tab:orange")
    ax.set(title="inter-token latency", xlabel="ms", ylabel="gaps")
    ax = axes[1][0]
    ax.scatter([r.start_offset for r in done], [r.latency for r in done], s=8, label="ok")
    failed = [r for r in records if not r.success]
    if failed:
        ax.scatter([r.start_offset for r in failed], [0] * len(failed), s=12, c="red", marker="x",
                   label="failed")
    ax.set(title="end-to-end latency over the run", xlabel="send time (s)", ylabel="latency (s)")
    ax.legend()
    ax = axes[1][1]
    ax.axis("off")
    lines = [f"completed {summary['completed']}/{summary['num_requests']}",
             f"request throughput {summary['request_throughput']:.2f} req/s",
             f"output throughput {summary['output_throughput']:.1f} tok/s",
             f"goodput {summary['goodput']:.2f} req/s"]
    for name in ("ttft_ms", "tpot_ms", "itl_ms"):
        stats = summary[name]
        if stats["p50"] is not None:
            lines.append(f"{name[:-3].upper()} p50/p90/p99 {stats['p50']:.1f}/{stats['p90']:.1f}/"
                         f"{stats['p99']:.1f} ms")
    ax.text(0.0, 1.0, "\n".join(lines), va="top", family="monospace", fontsize=10)
    fig.suptitle(title)
    fig.tight_layout()
    path.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path, dpi=100)
    plt.close(fig)

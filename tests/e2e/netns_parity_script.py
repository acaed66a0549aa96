"""Run inside a private network namespace by test_router_e2e.py (Mooncake binds 0.0.0.0).

Starts a 1P1D cluster with the given KV transport behind the real router, sends greedy prompts
(chunked, and sharing a prefix) through /generate, compares with the offline Engine, and writes
{"mismatches": [...], "checked": N, "used_pages": {...}} to the path in argv[2].
"""
from __future__ import annotations

import asyncio
import json
import random
import sys
from pathlib import Path

from deepseek_pd.client.router_http import RouterClient
from deepseek_pd.launcher.cluster import LocalCluster
from deepseek_pd.workers.engine.offline import Engine
from deepseek_pd.model.sampling.params import SamplingParams
from pdtest.e2e_cluster import CHUNKED_PREFILL_SIZE, PAGE_SIZE, cluster_spec, wait_for_pages


def main(transport: str, out_path: str) -> None:
    rng = random.Random()
    engine = Engine(model="tiny", chunked_prefill_size=CHUNKED_PREFILL_SIZE, page_size=PAGE_SIZE)
    vocab = engine.vocab_size
    prefix = [rng.randrange(3, vocab) for _ in range(CHUNKED_PREFILL_SIZE + 5)]
    prompts = [[rng.randrange(3, vocab) for _ in range(n)] for n in (5, 2 * CHUNKED_PREFILL_SIZE + 3)]
    prompts += [prefix + [rng.randrange(3, vocab) for _ in range(7)], prefix]
    expected = [list(engine.generate(p, SamplingParams(max_new_tokens=8, temperature=0.0)).output_ids)
                for p in prompts]
    report = {"mismatches": [], "checked": 0, "used_pages": {}}
    with LocalCluster(cluster_spec(Path(out_path).parent, kv_transport=transport)) as cluster:
        async def run():
            async with RouterClient(cluster.router_url, cluster.served_model_name) as client:
                for stream in (False, True):
                    for prompt, want in zip(prompts, expected):
                        got = await client.generate(input_ids=prompt, stream=stream,
                                                    max_new_tokens=8, temperature=0.0)
                        report["checked"] += 1
                        if got.output_ids != want:
                            report["mismatches"].append(
                                {"len": len(prompt), "stream": stream, "got": got.output_ids, "want": want})
            for worker in cluster.workers:
                address = worker.address(cluster.spec.host)
                report["used_pages"][worker.process.name] = await wait_for_pages(address, 0, 20)
        asyncio.run(run())
        # The engines log the transport they built; prove the run did not fall back to another.
        report["transport_logged"] = all(f"KV transport {transport}" in w.process.log_path.read_text()
                                         for w in cluster.workers)
    Path(out_path).write_text(json.dumps(report))


if __name__ == "__main__":
    main(sys.argv[1], sys.argv[2])

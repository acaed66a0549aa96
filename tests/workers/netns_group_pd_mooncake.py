"""PD between two multi-rank groups over Mooncake (TCP), run by test_group_pd_mooncake.py in a netns.

A prefill group (dp 2, ep 2) and a decode group (dp 2, ep 2), each `serve` spawning one process
per rank, every rank with its own Mooncake TransferEngine. One small batch of PD requests whose
rooms land on both DP ranks (room % 2). Checked, each against its own oracle:
- greedy tokens equal the single-process offline engine;
- every room was written by the engine of prefill DP rank room % 2 into the engine of decode DP
  rank room % 2 (the prefill ranks' debug log of each write against the sessions the decode ranks
  logged at start): rank to rank, both ranks' endpoints carrying transfers;
- each rank's kv_transfer_bytes{transport="mooncake"} (prefill: sent, decode: received) equals
  the bytes of the prompt pages of its rooms;
- every rank's KV pool is back to zero used pages.
Prints "group mooncake ok" at the end; an assertion fails the script (non-zero exit).
"""
from __future__ import annotations

import asyncio
import random
import re
import sys
import time
from pathlib import Path

from deepseek_pd.ports import pick_free_port_blocks
from pdtest.group_harness import PAGE_SIZE, GroupWorker, offline_greedy
from pdtest.rank_metrics import scrape, value

VOCAB = 256
DP = 2
GROUP = ["--dp", str(DP), "--ep", str(DP), "--kv-transport", "mooncake"]
ENV = {"DEEPSEEK_PD_LOG_LEVEL": "DEBUG"}  # the per-room write log (kv_transfer/mooncake.py)


def page_bytes_all_layers() -> int:
    import torch

    from deepseek_pd.model.config import ModelConfig
    from deepseek_pd.model.kv.pool import bytes_per_pool_page
    from deepseek_pd.model.checkpoint.model_dir import resolve_model_dir

    config = ModelConfig.from_hf(resolve_model_dir("tiny"))
    return bytes_per_pool_page(config.num_hidden_layers, PAGE_SIZE, config.kv_cache_dim, torch.float32)


def sessions_by_rank(log: str, role: str) -> dict[int, str]:
    """{rank: its TransferEngine's session id}, from the line each engine logs at start."""
    found = {int(rank): session for rank, session in
             re.findall(rf"{role}\[rank (\d+)\] INFO \S+: mooncake TransferEngine (\S+) over tcp", log)}
    assert sorted(found) == list(range(DP)) and len(set(found.values())) == DP, (role, found)
    return found


def writes(log: str) -> dict[int, tuple[int, str, str, int]]:
    """{room: (prefill rank, its engine's session, the destination session, the decode DP rank the
    handshake names)}."""
    lines = re.findall(r"prefill\[rank (\d+)\] DEBUG \S+: room (\d+): mooncake (\S+) "
                       r"(?:writes \d+ pages into|serves \d+ pages to) (\S+) \(decode DP rank (\d+)\)", log)
    return {int(room): (int(rank), src, dst, int(stated)) for rank, room, src, dst, stated in lines}


def tails(*workers: GroupWorker) -> str:
    """The workers' last lines (the ranks log at DEBUG here; `log_tail` drops gRPC's chatter)."""
    return "\n".join(worker.log_tail(400) for worker in workers)[-6000:]


async def wait_pools_empty(ports: list[int], timeout_s: float = 20.0) -> list[float]:
    deadline = time.monotonic() + timeout_s
    while True:
        used = [value(scrape(port)[1], "kv_pool_used_pages") for port in ports]
        if not any(used) or time.monotonic() > deadline:
            return used
        await asyncio.sleep(0.2)


def main(seed: int, tmp: Path) -> None:
    from deepseek_pd.client.pd_dispatch import PDClient
    from deepseek_pd.client.scheduler_grpc import sampling_proto

    rng = random.Random(seed)
    count = rng.randint(4, 6)
    prompts = [[rng.randrange(3, VOCAB) for _ in range(rng.randint(2, 40))] for _ in range(count)]
    max_new = [rng.randint(1, 6) for _ in range(count)]
    rooms = [rng.randrange(2**31 - 1) // DP * DP + i % DP for i in range(count)]  # both ranks, drawn rooms
    want = offline_greedy(prompts, max_new)
    p_metrics, d_metrics = pick_free_port_blocks([DP, DP])  # distinct runs, held together while picked
    with GroupWorker("prefill", GROUP + ["--metrics-port", str(p_metrics)], tmp / "prefill.log", env=ENV) as prefill, \
            GroupWorker("decode", GROUP + ["--metrics-port", str(d_metrics)], tmp / "decode.log", env=ENV) as decode:
        async def run() -> tuple[list, list[float]]:
            await asyncio.gather(prefill.wait_healthy(), decode.wait_healthy())
            async with PDClient(prefill.address, "127.0.0.1", prefill.bootstrap_port, decode.address) as client:
                results = await asyncio.gather(*(client.generate(
                    prompts[i], sampling_proto(max_new_tokens=max_new[i], temperature=0.0), stream=bool(i % 2),
                    room=rooms[i]) for i in range(count)))
            ports = [p_metrics + r for r in range(DP)] + [d_metrics + r for r in range(DP)]
            return results, await wait_pools_empty(ports)
        results, used = asyncio.run(run())
        assert all(r.ok for r in results), ([(r.prefill_error, r.decode_error) for r in results],
                                            tails(prefill, decode))
        assert [r.output_ids for r in results] == want, tails(prefill, decode)
        assert used == [0] * (2 * DP), used
        print(f"parity ok: {count} requests, rooms % {DP} = {[room % DP for room in rooms]}")
        sent = [value(scrape(p_metrics + r)[1], "kv_transfer_bytes_total", transport="mooncake") for r in range(DP)]
        received = [value(scrape(d_metrics + r)[1], "kv_transfer_bytes_total", transport="mooncake")
                    for r in range(DP)]
        prefill_log, decode_log = prefill.log_path.read_text(), decode.log_path.read_text()
    page_bytes = page_bytes_all_layers()
    expected = [sum(-(-len(p) // PAGE_SIZE) * page_bytes for p, room in zip(prompts, rooms) if room % DP == r)
                for r in range(DP)]
    assert sent == expected and received == expected, (sent, received, expected)
    print(f"bytes per rank ok: {expected}")
    prefill_sessions, decode_sessions = sessions_by_rank(prefill_log, "prefill"), sessions_by_rank(decode_log, "decode")
    decode_rank_of = {session: rank for rank, session in decode_sessions.items()}
    done = writes(prefill_log)
    assert sorted(done) == sorted(rooms), (sorted(done), sorted(rooms))
    for room, (rank, src, dst, stated) in done.items():
        owner = room % DP
        assert rank == owner and src == prefill_sessions[owner] and decode_rank_of.get(dst) == owner == stated, \
            (room, rank, src, dst, stated, prefill_sessions, decode_sessions)
    print(f"rank to rank ok: prefill {prefill_sessions} -> decode {decode_sessions}")
    print("group mooncake ok")


if __name__ == "__main__":
    main(int(sys.argv[1]), Path(sys.argv[2]))

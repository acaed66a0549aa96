"""Multi-rank workers as `serve` runs them: real processes, gloo on loopback, the tiny model.

`GroupWorker` starts `deepseek-pd serve ROLE ... --dp N --ep N` (the supervisor spawns one process
per rank) in its own session, waits for rank 0's HealthCheck, and stops the whole tree after.
`offline_greedy` is the oracle: the single-process offline engine on the same prompts.
"""
from __future__ import annotations

import asyncio
import os
import signal
import subprocess
import sys
import time
from pathlib import Path
from typing import Sequence

from deepseek_pd.client.scheduler_grpc import SchedulerClient, collect, sampling_proto
from deepseek_pd.ports import pick_free_ports
from smg_grpc_proto import sglang_scheduler_pb2 as pb

PAGE_SIZE = 4
CHUNKED_PREFILL_SIZE = 16
COMMON_ARGS = ("--model", "tiny", "--device", "cpu", f"--page-size={PAGE_SIZE}", "--num-pages=512",
               f"--chunked-prefill-size={CHUNKED_PREFILL_SIZE}", "--drain-timeout=1",
               "--engine-opt=handshake_timeout_s=10", "--engine-opt=transfer_timeout_s=30")


class GroupWorker:
    def __init__(self, role: str, args: Sequence[str], log_path: Path, port: int | None = None,
                 bootstrap_port: int | None = None, env: dict | None = None) -> None:
        self.role = role
        self.port, self.bootstrap_port = (port, bootstrap_port) if port else pick_free_ports(2)
        self.argv = [sys.executable, "-m", "deepseek_pd.cli", "serve", role, *COMMON_ARGS, "--port", str(self.port),
                     "--bootstrap-port", str(self.bootstrap_port), *args]
        self.log_path = log_path
        self.env = {**os.environ, "OMP_NUM_THREADS": "1", **(env or {})}
        self.proc: subprocess.Popen | None = None

    @property
    def address(self) -> str:
        return f"127.0.0.1:{self.port}"

    def start(self) -> "GroupWorker":
        with open(self.log_path, "ab") as log:
            self.proc = subprocess.Popen(self.argv, stdout=log, stderr=subprocess.STDOUT, env=self.env,
                                         start_new_session=True)
        return self

    def log_tail(self, lines: int = 40) -> str:
        """The log's last lines without gRPC's own debug chatter (some tests log at DEBUG, where
        one rank's gRPC lines pushed another rank's start-up error out of the tail)."""
        kept = [line for line in self.log_path.read_text(errors="replace").splitlines() if " grpc." not in line]
        return "\n".join(kept[-lines:])

    async def wait_healthy(self, timeout_s: float = 150.0) -> None:
        deadline = time.monotonic() + timeout_s
        while time.monotonic() < deadline:
            if self.proc.poll() is not None:
                raise AssertionError(f"{self.role} group exited with {self.proc.returncode}:\n{self.log_tail()}")
            # A fresh channel per probe: one kept open while nothing listens backs its reconnects
            # off (1 s, x1.6 per attempt), so it saw a group ready ~10 s late after a 25 s start.
            try:
                async with SchedulerClient(self.address) as client:
                    if (await client.health(timeout_s=1.0)).healthy:
                        return
            except Exception:  # not listening yet
                pass
            await asyncio.sleep(0.2)
        raise AssertionError(f"{self.role} group not healthy within {timeout_s}s:\n{self.log_tail()}")

    def stop(self) -> None:
        if self.proc is None:
            return
        try:
            os.killpg(self.proc.pid, signal.SIGTERM)
            self.proc.wait(20)
        except subprocess.TimeoutExpired:
            pass
        except ProcessLookupError:
            return
        try:
            os.killpg(self.proc.pid, signal.SIGKILL)  # anything the supervisor left behind
        except ProcessLookupError:
            pass
        self.proc.wait(10)

    def __enter__(self) -> "GroupWorker":
        return self.start()

    def __exit__(self, *exc) -> None:
        self.stop()


def greedy_request(rid: str, input_ids: list[int], max_new_tokens: int, stream: bool = True,
                   ignore_eos: bool = False) -> pb.GenerateRequest:
    params = sampling_proto(max_new_tokens=max_new_tokens, temperature=0.0)
    params.ignore_eos = ignore_eos
    return pb.GenerateRequest(request_id=rid, tokenized=pb.TokenizedInput(input_ids=input_ids),
                              sampling_params=params, stream=stream)


async def generate_all(address: str, prompts: Sequence[list[int]], max_new: Sequence[int],
                       ignore_eos: bool = False) -> list[list[int]]:
    """Every prompt at once (concurrent Generate calls), greedy; output ids in prompt order."""
    async with SchedulerClient(address) as client:
        async def one(i: int) -> list[int]:
            ids, _ = await collect(client.generate(greedy_request(f"g{i}-{os.getpid()}", prompts[i], max_new[i],
                                                                  stream=bool(i % 2), ignore_eos=ignore_eos)))
            return ids
        return list(await asyncio.gather(*(one(i) for i in range(len(prompts)))))


def offline_greedy(prompts: Sequence[list[int]], max_new: Sequence[int]) -> list[list[int]]:
    from deepseek_pd.workers.engine.offline import Engine
    from deepseek_pd.model.sampling.params import SamplingParams

    engine = Engine(model="tiny", chunked_prefill_size=CHUNKED_PREFILL_SIZE, page_size=PAGE_SIZE)
    results = engine.generate_batch(prompts, [SamplingParams(max_new_tokens=n, temperature=0.0) for n in max_new])
    return [list(r.output_ids) for r in results]

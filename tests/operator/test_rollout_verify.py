"""Verified rollouts' check (operator/rollout_verify.py) against real decode workers: two
`deepseek-pd serve decode` processes answer the fixed greedy prompts at the same time; the same
checkpoint passes, a different one (another seed: what a broken engine option or image looks
like from outside) is caught, naming the prompt and the first differing token. Prefill the same way,
as PD requests: prefill workers on checkpoints A and B, each paired with the decode worker on A."""
from __future__ import annotations

import asyncio
import pathlib
import random
import subprocess
import sys
import time

import pytest

from deepseek_pd.launcher.health import worker_is_healthy
from deepseek_pd.ports import pick_free_ports
from deepseek_pd.operator.rollout_verify import (
    MAX_NEW_TOKENS, PROMPTS, Mismatch, PrefillGroup, first_mismatch, verify, verify_prefill,
)

pytestmark = [pytest.mark.timeout(300)]


def test_first_mismatch_names_the_prompt_and_position(rng=random.Random()):
    old = [[rng.randrange(1000) for _ in range(MAX_NEW_TOKENS)] for _ in PROMPTS]
    assert first_mismatch(old, [list(o) for o in old]) is None
    new = [list(o) for o in old]
    i, j = rng.randrange(len(PROMPTS)), rng.randrange(MAX_NEW_TOKENS)
    new[i][j] += 1
    assert first_mismatch(old, new) == Mismatch(i, j, old[i][j], old[i][j] + 1)
    assert first_mismatch(old, [*new[:i], old[i][:j], *new[i + 1:]]) == Mismatch(i, j, old[i][j], None)
    assert f"prompt {i} {list(PROMPTS[i])}: output token {j}" in str(Mismatch(i, j, 5, 6))


@pytest.fixture(scope="module")
def workers(tmp_path_factory):
    """Decode workers: two on checkpoint A, one on checkpoint B (another seed)."""
    from deepseek_pd.cli import main

    root = tmp_path_factory.mktemp("verify")
    cli = [sys.executable, "-m", "deepseek_pd.cli"]
    for name, seed in (("a", 1), ("b", 2)):  # in this process: a child's start-up (torch) costs seconds
        assert main(["make-tiny-model", str(root / name), "--seed", str(seed)]) == 0
    procs, addresses = [], {}
    try:
        # Decode "old", "same" (A) and "other" (B); prefill "prefill-a" and "prefill-b".
        for label, role, model in (("old", "decode", "a"), ("same", "decode", "a"), ("other", "decode", "b"),
                                   ("prefill-a", "prefill", "a"), ("prefill-b", "prefill", "b")):
            port, bootstrap = pick_free_ports(2)
            log = open(root / f"{label}.log", "w")
            procs.append(subprocess.Popen([*cli, "serve", role, "--model", str(root / model), "--port",
                                           str(port), "--bootstrap-port", str(bootstrap), "--host", "127.0.0.1"],
                                          stdout=log, stderr=subprocess.STDOUT))
            addresses[label] = f"127.0.0.1:{port}"
            addresses[f"{label}-bootstrap"] = str(bootstrap)
        deadline = time.monotonic() + 240
        for (label, address), proc in zip([(k, v) for k, v in addresses.items() if ":" in v], procs):
            while not worker_is_healthy(address):
                assert proc.poll() is None and time.monotonic() < deadline, (root / f"{label}.log").read_text()
                time.sleep(0.5)
        yield addresses
    finally:
        for proc in procs:
            proc.terminate()
        for proc in procs:
            proc.wait(30)


def test_the_same_checkpoint_passes_and_another_is_caught_with_its_first_token(workers):
    assert asyncio.run(verify(workers["same"], workers["old"])) is None
    mismatch = asyncio.run(verify(workers["other"], workers["old"]))
    assert mismatch is not None and mismatch.new != mismatch.old, mismatch
    assert f"prompt {mismatch.prompt} {list(PROMPTS[mismatch.prompt])}" in str(mismatch)


def test_a_prefill_group_is_checked_through_a_decode_group(workers):
    def group(label: str) -> PrefillGroup:
        return PrefillGroup(workers[label], "127.0.0.1", int(workers[f"{label}-bootstrap"]))
    assert asyncio.run(verify_prefill(group("prefill-a"), group("prefill-a"), workers["old"])) is None
    mismatch = asyncio.run(verify_prefill(group("prefill-b"), group("prefill-a"), workers["old"]))
    # B's prefill picks the first token and writes the KV the decode group continues from.
    assert mismatch is not None and mismatch.new != mismatch.old, mismatch
    assert f"prompt {mismatch.prompt} {list(PROMPTS[mismatch.prompt])}" in str(mismatch)

"""`deepseek-pd generate --deterministic`: the offline engine with the flag, through the CLI.

Oracle: `Engine(deterministic=True)` on the same prompt; a flag that cannot run deterministic is a
one-line CLI error (exit 2)."""
from __future__ import annotations

import json
import random

from deepseek_pd.cli import main
from deepseek_pd.workers.engine.offline import Engine
from deepseek_pd.model.sampling.params import SamplingParams


def test_generate_deterministic_equals_the_engine_with_the_flag(capsys):
    rng = random.Random()
    prompt = [rng.randrange(2, 400) for _ in range(rng.randint(5, 40))]
    chunk = rng.randint(4, 16)
    capsys.readouterr()
    assert main(["generate", "--model", "tiny", "--input-ids", ",".join(map(str, prompt)), "--max-new-tokens", "5",
                 "--ignore-eos", "--chunked-prefill-size", str(chunk), "--page-size", "4", "--deterministic",
                 "--json"]) == 0
    got = json.loads(capsys.readouterr().out)["output_ids"]
    engine = Engine("tiny", page_size=4, chunked_prefill_size=chunk, deterministic=True)
    assert got == engine.generate(prompt, SamplingParams(temperature=0.0, max_new_tokens=5, ignore_eos=True)).output_ids


def test_generate_deterministic_refuses_speculation(capsys):
    assert main(["generate", "--model", "tiny", "--input-ids", "3,4,5", "--deterministic",
                 "--speculative-num-steps", "2"]) == 2
    assert "--deterministic" in capsys.readouterr().err

"""max_tokens at the context's edge with speculative decoding: a request whose prompt leaves only a
few positions of the model's context gets as many tokens as without speculation (the output budget
is capped by the context, and drafts never reach past it: `rules.draft_len`), the same tokens, the
same finish reason, and the pool ends empty. The checkpoint's context is shrunk so prompts reach it.
"""
from __future__ import annotations

import json
import random

import pytest

from deepseek_pd.model.checkpoint.tiny import make_tiny_model
from deepseek_pd.model.sampling.params import SamplingParams
from deepseek_pd.workers.engine.offline import Engine

pytestmark = pytest.mark.timeout(240)
CONTEXT = 40


@pytest.mark.parametrize("steps", [1, 3])
def test_outputs_at_the_context_edge_equal_plain_decoding(tmp_path, steps) -> None:
    rng = random.Random()
    path = make_tiny_model(tmp_path / "v3", seed=rng.randrange(1000), mtp_layers=1)
    config = json.loads((path / "config.json").read_text())
    config["max_position_embeddings"] = CONTEXT
    (path / "config.json").write_text(json.dumps(config))
    base = Engine(str(path), page_size=4, chunked_prefill_size=16)
    spec = Engine(str(path), page_size=4, chunked_prefill_size=16, speculative_num_steps=steps)
    assert spec.max_context == CONTEXT
    gaps = list(range(1, steps + 4))  # fewer positions left than a step's drafts, as many, and more
    prompts = [[rng.randrange(3, 256) for _ in range(CONTEXT - gap)] for gap in gaps]
    params = [SamplingParams(temperature=0.0, max_new_tokens=rng.choice([gap, gap + 1, 100]), ignore_eos=True)
              for gap in gaps]
    for gap, p, a, b in zip(gaps, params, spec.generate_batch(prompts, params), base.generate_batch(prompts, params)):
        assert len(a.output_ids) == min(gap, p.max_new_tokens)
        assert (a.output_ids, a.finish_reason) == (b.output_ids, b.finish_reason)
    assert spec.runner.kv_pool.num_used_pages == 0

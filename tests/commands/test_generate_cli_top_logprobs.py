"""`deepseek-pd generate --json --top-logprobs K`: each output token's K most likely tokens, equal
to full forwards of the offline engine's runner; K over the cap is one line on stderr, exit 2."""
from __future__ import annotations

import json
import random

import pytest

from deepseek_pd.cli import main
from deepseek_pd.model.sampling.sampled_host import TopLogprobs
from deepseek_pd.model.sampling.params import MAX_TOP_LOGPROBS
from pdtest.gateway_oracle import offline_engine
from pdtest.top_logprobs_check import assert_top_matches

pytestmark = pytest.mark.timeout(300)


def test_generate_json_reports_top_logprobs(capsys) -> None:
    rng = random.Random()
    engine = offline_engine()
    prompt = [rng.randrange(2, engine.vocab_size) for _ in range(rng.randint(3, 30))]
    k, new = rng.randint(1, MAX_TOP_LOGPROBS), rng.randint(2, 5)
    assert main(["generate", "--model", "tiny", "--input-ids", ",".join(map(str, prompt)), "--max-new-tokens",
                 str(new), "--temperature", "0", "--ignore-eos", "--json", "--top-logprobs", str(k)]) == 0
    answer = json.loads(capsys.readouterr().out)
    tops = [TopLogprobs(tuple(t for t, _ in entry), tuple(v for _, v in entry)) for entry in answer["output_top_logprobs"]]
    assert_top_matches(engine, tops, answer["output_ids"], prompt, k)
    assert [top.logprobs[0] for top in tops] == pytest.approx(answer["output_logprobs"], abs=1e-6)  # greedy


def test_top_logprobs_over_the_cap_is_a_one_line_error(capsys) -> None:
    code = main(["generate", "--model", "tiny", "--input-ids", "5,6", "--json", "--top-logprobs",
                 str(MAX_TOP_LOGPROBS + random.randint(1, 9))])
    err = capsys.readouterr().err.strip()
    assert code == 2 and "top_logprobs_num" in err and len(err.splitlines()) == 1, err

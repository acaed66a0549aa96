"""SGLang's TBO split rules (model/distributed/tbo_rules.py) against the rule written out by brute force, the
docstring's examples, and the engine-option checks."""
from __future__ import annotations

import random

import pytest

from deepseek_pd.errors import UserError
from deepseek_pd.model.forward_batch import ForwardMode
from deepseek_pd.model.runner_config import RunnerConfig
from deepseek_pd.model.distributed.tbo_rules import TboRules, balanced_cut


def _oracle(lens: list[int], share: float) -> int:
    """Every cut between sequences scored; the best (ties: the later); one sequence cut at T // 2
    when even the best leaves a side below `share` of the tokens."""
    total = sum(lens)
    boundaries = [(abs(2 * sum(lens[:c]) - total), -c) for c in range(1, len(lens))]
    left = sum(lens[:-min(boundaries)[1]]) if boundaries else 0
    return total // 2 if not total * share <= left <= total * (1 - share) else left


def test_extend_split_matches_the_rule_on_random_batches():
    rng = random.Random()
    for _ in range(500):
        share = rng.choice([0.0, 0.25, 0.48, 0.5, rng.uniform(0, 0.5)])
        lens = [rng.choice([1, 2, rng.randint(1, 50), rng.randint(100, 4000)]) for _ in range(rng.randint(1, 8))]
        cut = TboRules(token_distribution_threshold=share).split_token(ForwardMode.EXTEND, lens)
        assert cut == _oracle(lens, share), (lens, share)
        assert 0 <= cut < sum(lens)


def test_docstring_examples_and_decode():
    rules = TboRules()
    assert rules.split_token(ForwardMode.EXTEND, [3, 4, 2, 5]) == 7
    assert rules.split_token(ForwardMode.EXTEND, [3, 4, 5]) == 6
    assert rules.split_token(ForwardMode.EXTEND, [2, 30]) == 16
    assert rules.split_token(ForwardMode.EXTEND, [100]) == 50
    assert TboRules(token_distribution_threshold=0).split_token(ForwardMode.EXTEND, [2, 30]) == 2
    assert TboRules(token_distribution_threshold=0).split_token(ForwardMode.EXTEND, [100]) == 0  # A empty
    assert balanced_cut([1, 2, 1]) == 2  # a tie goes to the later cut, as SGLang's
    n = random.randint(1, 300)
    assert rules.split_token(ForwardMode.DECODE, [1] * n) == n // 2
    assert not rules.pays(ForwardMode.DECODE, 1) and rules.pays(ForwardMode.DECODE, 2)
    high = TboRules(min_decode_tokens=64, min_extend_tokens=512)
    assert not high.pays(ForwardMode.DECODE, 63) and high.pays(ForwardMode.DECODE, 64)
    assert not high.pays(ForwardMode.EXTEND, 511) and high.pays(ForwardMode.EXTEND, 512)


def test_bad_thresholds_are_user_errors():
    with pytest.raises(UserError, match="tbo_token_distribution_threshold must be in"):
        RunnerConfig(tbo_token_distribution_threshold=0.6)
    with pytest.raises(UserError, match="tbo_min_decode_tokens must be >= 2"):
        RunnerConfig(tbo_min_decode_tokens=1)
    with pytest.raises(UserError, match="tbo_min_extend_tokens must be >= 2"):
        RunnerConfig(tbo_min_extend_tokens=0)
    config = RunnerConfig(enable_tbo=True, tbo_min_decode_tokens=64, tbo_token_distribution_threshold=0.3)
    assert config.build_options(_model_config()).tbo_rules == TboRules(0.3, 64, 2)


def _model_config():
    from deepseek_pd.model.config import ModelConfig
    from pdtest.hf_oracle import TinyShape
    return ModelConfig.from_hf(TinyShape(arch="v3", num_layers=2).hf_config().to_dict())

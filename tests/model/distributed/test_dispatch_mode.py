"""`DispatchMode` resolves like SGLang's `DeepEPMode` (forced modes apply to every step, auto by the
step's group mode), bad values are UserErrors, and CUDA-graph safety follows the decode layout."""
from __future__ import annotations

import pytest

from deepseek_pd.errors import UserError
from deepseek_pd.model.distributed.dispatch_mode import DispatchConfig, DispatchMode, decode_capturable
from deepseek_pd.model.forward_batch import ForwardMode
from deepseek_pd.model.moe.dispatcher import DISPATCHERS
from deepseek_pd.model.runner_config import RunnerConfig

N, LL = DispatchMode.NORMAL, DispatchMode.LOW_LATENCY


def test_resolve_per_step_mode():
    table = {mode: (mode.resolve(ForwardMode.EXTEND), mode.resolve(ForwardMode.DECODE)) for mode in DispatchMode}
    assert table == {N: (N, N), LL: (LL, LL), DispatchMode.AUTO: (N, LL)}
    assert DispatchMode.AUTO.low_latency_steps() == (ForwardMode.DECODE,)
    assert LL.low_latency_steps() == (ForwardMode.EXTEND, ForwardMode.DECODE) and N.low_latency_steps() == ()


def test_bad_values_are_user_errors():
    with pytest.raises(UserError, match="dispatch_mode 'fast' is not one of normal, low_latency, auto"):
        RunnerConfig(dispatch_mode="fast")
    with pytest.raises(UserError, match="low_latency_max_tokens must be >= 1"):
        RunnerConfig(low_latency_max_tokens=0)
    with pytest.raises(UserError, match="5 tokens on this rank exceeds the low-latency EP dispatch capacity of 4"):
        DispatchConfig(LL, 4).check_capacity(5)
    DispatchConfig(LL, 4).check_capacity(4)


@pytest.mark.parametrize("mode, want", [(N, False), (LL, True), (DispatchMode.AUTO, True)])
def test_graph_safety_follows_the_decode_layout(mode, want):
    config = DispatchConfig(mode)
    assert decode_capturable(DISPATCHERS.get("all_to_all"), config) is want
    assert decode_capturable(DISPATCHERS.get("local"), config)  # nothing moves in any mode

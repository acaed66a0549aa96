"""The `deepep` dispatcher on the CPU: against an in-process fake `deep_ep` (fake_deep_ep.py, DeepEP
V1's calls at world size 1), a model whose MoE layers dispatch through it gives the `local`
model's logits in every `--deepep-mode`; `auto` switches layouts per step and cleans the
low-latency buffer after normal steps (before a graph replay too); a step above the low-latency
capacity is refused before any DeepEP call."""
from __future__ import annotations

import random

import pytest
import torch

from pdtest import fake_deep_ep
from deepseek_pd.errors import UserError
from deepseek_pd.model.build_options import BuildOptions
from deepseek_pd.model.distributed.dispatch_mode import DispatchConfig, DispatchMode
from deepseek_pd.model.forward_batch import ForwardMode
from deepseek_pd.model.moe import deepep_dispatcher
from deepseek_pd.model.moe.dispatcher import DISPATCHERS
from deepseek_pd.model.runner import DecodeSeq, ExtendSeq, ModelRunner
from deepseek_pd.model.runner_config import RunnerConfig
from pdtest.hf_oracle import TinyShape, build_hf_model, our_model

pytestmark = pytest.mark.timeout(120)
REL_TOL = 1e-5
CAPACITY = 24


@pytest.fixture
def fake_deepep(monkeypatch):
    monkeypatch.setattr(deepep_dispatcher, "deep_ep", fake_deep_ep)
    monkeypatch.setitem(DISPATCHERS._factories, "deepep", deepep_dispatcher.DeepEPDispatcher)
    monkeypatch.setattr(fake_deep_ep.Buffer, "created", [])
    return fake_deep_ep


@pytest.fixture(scope="module")
def hf_model():
    torch.set_num_threads(1)
    return build_hf_model(TinyShape(arch="v3", num_layers=3, first_k_dense_replace=1), seed=random.randrange(1 << 30))


def _scenario(runner: ModelRunner, rng: random.Random) -> dict[str, torch.Tensor]:
    """extend, extend again, two decode steps, then extend and decode again (normal after
    low-latency after normal, for `auto`)."""
    vocab, pool = runner.model_config.vocab_size, runner.kv_pool
    prompts = [[rng.randrange(vocab) for _ in range(rng.randint(1, 7))] for _ in range(rng.randint(2, 3))]
    pages = [pool.alloc(pool.pages_for_tokens(len(p) + 8)) for p in prompts]
    out = {"extend": runner.extend([ExtendSeq(p, 0, pg) for p, pg in zip(prompts, pages)])}
    lengths = [len(p) for p in prompts]
    ids = out["extend"].argmax(-1).tolist()
    for step in range(2):
        out[f"decode{step}"] = runner.decode([DecodeSeq(t, n + step, pg) for t, n, pg in zip(ids, lengths, pages)])
        ids = out[f"decode{step}"].argmax(-1).tolist()
    lengths = [n + 2 for n in lengths]
    out["extend_again"] = runner.extend([ExtendSeq([t], n, pg) for t, n, pg in zip(ids, lengths, pages)])
    ids = out["extend_again"].argmax(-1).tolist()
    out["decode_again"] = runner.decode([DecodeSeq(t, n + 1, pg) for t, n, pg in zip(ids, lengths, pages)])
    return out


@pytest.mark.parametrize("mode", list(DispatchMode))
def test_deepep_dispatcher_equals_local_in_every_mode(fake_deepep, hf_model, mode):
    seed = random.randrange(1 << 20)
    config = RunnerConfig(model="<in-memory>", page_size=4, num_pages=64)
    reference = ModelRunner.from_model(our_model(hf_model), config)
    deepep = ModelRunner.from_model(our_model(hf_model, BuildOptions(
        dispatcher="deepep", dispatch=DispatchConfig(mode, CAPACITY))), config)
    want, got = _scenario(reference, random.Random(seed)), _scenario(deepep, random.Random(seed))
    for case in want:
        err = ((got[case] - want[case]).abs().max() / want[case].abs().max()).item()
        assert err <= REL_TOL, f"seed {seed} {mode.value} {case}: rel err {err:.2e}"
    (buffer,) = fake_deepep.Buffer.created  # one buffer for all layers and both layouts
    assert buffer.low_latency_mode == mode.uses_low_latency
    kernels = set(buffer.calls)
    assert ("dispatch" in kernels) == (mode is not DispatchMode.LOW_LATENCY)
    assert ("low_latency_dispatch" in kernels) == (mode is not DispatchMode.NORMAL)
    hidden = hf_model.config.hidden_size
    num_experts = hf_model.config.n_routed_experts
    # auto: normal extend → low-latency decode twice in the scenario, each switch cleaned once.
    want_cleans = 2 if mode is DispatchMode.AUTO else 0
    assert buffer.cleans == [(CAPACITY, hidden, num_experts)] * want_cleans


def test_auto_cleans_before_a_graph_replay_after_normal_steps(fake_deepep, hf_model):
    """A replayed decode runs no Python in the dispatcher: `prepare_step` must clean for it."""
    model = our_model(hf_model, BuildOptions(dispatcher="deepep", dispatch=DispatchConfig(DispatchMode.AUTO, CAPACITY)))
    runner = ModelRunner.from_model(model, RunnerConfig(model="<in-memory>", page_size=4, num_pages=16))
    runner.extend([ExtendSeq([1, 2, 3], 0, runner.kv_pool.alloc(2))])
    (buffer,) = fake_deepep.Buffer.created
    assert buffer.dirty and not buffer.cleans
    model.dispatcher.prepare_step(ForwardMode.DECODE)  # what DecodeGraphRunner does before replay()
    assert not buffer.dirty and len(buffer.cleans) == 1
    model.dispatcher.prepare_step(ForwardMode.DECODE)  # already low-latency: no second clean
    assert len(buffer.cleans) == 1


def test_a_step_above_the_capacity_is_refused_before_deepep_runs(fake_deepep):
    from deepseek_pd.model.distributed.parallel import ExpertPlacement, ParallelInfo

    placement = ExpertPlacement(num_routed=4, num_fused_shared=0, parallel=ParallelInfo())
    dispatcher = deepep_dispatcher.DeepEPDispatcher(placement, DispatchConfig(DispatchMode.LOW_LATENCY, 3))
    with pytest.raises(UserError, match="4 tokens on this rank exceeds the low-latency EP dispatch capacity of 3"):
        dispatcher.dispatch_a(torch.randn(4, 8), torch.zeros(4, 2, dtype=torch.long), torch.ones(4, 2),
                              ForwardMode.DECODE)
    assert not fake_deepep.Buffer.created  # refused before the buffer or any kernel

"""The per-layer KV hook: told once per layer, in order, after that layer's KV (of the whole batch,
both TBO micro-batches) is in the pool and before the next layer's is; changes no result."""
from __future__ import annotations

import random

import pytest
import torch

from deepseek_pd.model.build_options import BuildOptions
from deepseek_pd.model.layer_ops import DENSE_LAYER_OPS, MOE_LAYER_OPS
from deepseek_pd.model.kv.layer_progress import KV_WRITE_OP, LayerEvents
from deepseek_pd.model.runner import ExtendSeq, ModelRunner
from deepseek_pd.model.runner_config import RunnerConfig
from pdtest.hf_oracle import TinyShape, build_hf_model, our_model

pytestmark = pytest.mark.timeout(90)


@pytest.fixture(scope="module")
def models():
    torch.set_num_threads(1)
    hf = build_hf_model(TinyShape(arch="v3", num_layers=4, first_k_dense_replace=1), seed=random.randrange(1 << 30))
    return {"plain": our_model(hf), "tbo": our_model(hf, BuildOptions(enable_tbo=True, prefix_chunk_size=4))}


class Snapshots:
    """At each call: which layer, and copies of every layer's pages of the batch."""

    def __init__(self, runner: ModelRunner, pages: list[int]) -> None:
        self.runner = runner
        self.index = torch.tensor(pages)
        self.calls: list[tuple[int, list[torch.Tensor]]] = []

    def kv_written(self, layer_id: int) -> None:
        self.calls.append((layer_id, [b.index_select(0, self.index).clone() for b in self.runner.kv_pool.buffers]))


def test_every_layer_list_writes_kv_in_the_hooked_op():
    assert KV_WRITE_OP in MOE_LAYER_OPS and KV_WRITE_OP in DENSE_LAYER_OPS


@pytest.mark.parametrize("kind", ["plain", "tbo"])
def test_hook_fires_between_each_layers_kv_write_and_the_next_and_changes_nothing(models, kind):
    model = models[kind]
    rng = random.Random()
    vocab, num_layers = model.config.vocab_size, model.config.num_hidden_layers
    config = RunnerConfig(model="<in-memory>", page_size=4, num_pages=64, mha_chunked_kv_threshold=1)
    runners = [ModelRunner.from_model(model, config) for _ in range(2)]  # with and without the hook
    prompts = [[rng.randrange(vocab) for _ in range(rng.randint(2, 12))] for _ in range(rng.randint(2, 4))]
    more = [[rng.randrange(vocab) for _ in range(rng.randint(1, 9))] for _ in prompts]
    pages = [runners[0].kv_pool.alloc(runners[0].kv_pool.pages_for_tokens(len(p) + len(m))) for p, m in zip(prompts, more)]
    assert [runners[1].kv_pool.alloc(len(pg)) for pg in pages] == pages
    for a, b in zip(runners[0].kv_pool.buffers, runners[1].kv_pool.buffers):
        b.copy_(a.normal_())  # stale data: a layer not yet written differs from its final contents
    flat_pages = [p for pg in pages for p in pg]
    for step, (tokens, prefix) in enumerate([(prompts, [0] * len(prompts)), (more, [len(p) for p in prompts])]):
        seqs = [ExtendSeq(t, n, pg) for t, n, pg in zip(tokens, prefix, pages)]
        before = [b.index_select(0, torch.tensor(flat_pages)).clone() for b in runners[0].kv_pool.buffers]
        hook = Snapshots(runners[0], flat_pages)
        with_hook = runners[0].extend(seqs, progress=hook)
        without = runners[1].extend(seqs)
        assert torch.equal(with_hook, without), f"step {step}: the hook changed the logits"
        after = [b.index_select(0, torch.tensor(flat_pages)) for b in runners[0].kv_pool.buffers]
        assert [layer for layer, _ in hook.calls] == list(range(num_layers))
        for layer, seen in hook.calls:
            assert torch.equal(seen[layer], after[layer]), f"layer {layer} was not complete when reported"
            # TBO: one micro-batch may run ahead into the next layer before the other wrote this one.
            for later in range(layer + 1, num_layers) if kind == "plain" else ():
                assert torch.equal(seen[later], before[later]), f"layer {later} written before {layer} was reported"
        for a, b in zip(runners[0].kv_pool.buffers, runners[1].kv_pool.buffers):
            assert torch.equal(a, b)


def test_layer_events_on_the_cpu_give_no_event_in_layer_order(models):
    model = models["plain"]
    runner = ModelRunner.from_model(model, RunnerConfig(model="<in-memory>", page_size=4, num_pages=16))
    seen = []
    pages = runner.kv_pool.alloc(2)
    runner.extend([ExtendSeq([1, 2, 3, 4, 5], 0, pages)], progress=LayerEvents("cpu", lambda *a: seen.append(a)))
    assert seen == [(layer, None) for layer in range(model.config.num_hidden_layers)]


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
def test_layer_events_on_cuda_record_an_event_per_layer():
    seen = []
    events = LayerEvents("cuda", lambda layer, event: seen.append((layer, event)))
    events.kv_written(0)
    assert seen[0][0] == 0 and isinstance(seen[0][1], torch.cuda.Event)
    seen[0][1].synchronize()

"""Piecewise extend graphs (model/extend_graph.py, extend_graph_pieces.py, extend_graph_inputs.py).

CPU (CI), fp32 on the tiny V2 and V3 models, the oracle being the plain extend (`runner.extend`
without graphs): the forward cut at its attention cores, and the same pieces run as plain calls
over the padded static rows of a bucket (what a capture records), equal it to fp32 rounding (`_same`
says why not bit for bit) with the same greedy tokens, while padding rows write only the scratch page; the runner's extend takes
that path up to the largest bucket and falls back past it; the layer-wise progress hears of each
layer after its KV is in the pool; each eager core writes its attn_output straight into the static
rows the next piece reads (no copy, counted under a TorchDispatchMode); and the rule refuses what
cannot be captured, in words.
GPU (`gpu` marker): captured replays against eager extend in bf16 (greedy tokens equal) and the
host launches a replayed extend issues against eager.
"""
from __future__ import annotations

import dataclasses
import random
from collections import Counter

import pytest
import torch
from torch.utils._python_dispatch import TorchDispatchMode

from deepseek_pd.errors import UserError
from deepseek_pd.model.checkpoint.tiny import make_tiny_model
from deepseek_pd.model.extend_graph import ExtendGraphRunner
from deepseek_pd.model.extend_graph_inputs import EXTEND_GRAPH_MIN_TOKENS, extend_graph_buckets
from deepseek_pd.model.extend_graph_pieces import ExtendPieces
from deepseek_pd.model.forward_batch import ForwardBatch, ForwardMode
from deepseek_pd.model.runner import DecodeSeq, ExtendSeq, ModelRunner
from deepseek_pd.model.runner_config import RunnerConfig
from deepseek_pd.model.runner_rules import extend_graph_settings_blocker

pytestmark = [pytest.mark.timeout(240), pytest.mark.usefixtures("one_torch_thread")]
needs_cuda = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
PAGE = 4


@pytest.fixture(scope="module", params=["v2", "v3"])
def tiny_path(request, tmp_path_factory, module_seed):
    return str(make_tiny_model(tmp_path_factory.mktemp(f"tiny-{request.param}"), arch=request.param,
                               seed=module_seed % 10_000))


@pytest.fixture(scope="module")
def runner(tiny_path) -> ModelRunner:
    # A low chunked-KV threshold and chunk: small prefixes already take MHA_CHUNKED_KV over several chunks.
    return ModelRunner(RunnerConfig(model=tiny_path, device="cpu", dtype="float32", page_size=PAGE,
                                    num_pages=600, mha_chunked_kv_threshold=24, prefix_chunk_size=16))


def _batch_seqs(runner: ModelRunner, rng: random.Random, lengths: list[int], prefixes: list[int]) -> list[ExtendSeq]:
    """Sequences with random prompts whose prefixes are already prefilled (eagerly) into fresh pages."""
    vocab, pool = runner.model_config.vocab_size, runner.kv_pool
    seqs = []
    for length, prefix in zip(lengths, prefixes):
        pages = pool.alloc(pool.pages_for_tokens(prefix + length))
        if prefix:
            runner.extend([ExtendSeq([rng.randrange(vocab) for _ in range(prefix)], 0, pages)])
        seqs.append(ExtendSeq([rng.randrange(vocab) for _ in range(length)], prefix, pages))
    return seqs


def _build(runner: ModelRunner, seqs: list[ExtendSeq]) -> ForwardBatch:
    batch = ForwardBatch.build(ForwardMode.EXTEND, [s.token_ids for s in seqs], [s.prefix_len for s in seqs],
                               [s.pages for s in seqs], runner.kv_pool, runner.model_config.vocab_size, "cpu")
    batch.attention_method = runner.policy.choose(ForwardMode.EXTEND, batch.prefix_lens)
    return batch


def _free(runner: ModelRunner, seqs: list[ExtendSeq]) -> None:
    for seq in seqs:
        runner.kv_pool.free(seq.pages)


def _split(total: int, parts: int, rng: random.Random) -> list[int]:
    """`parts` positive lengths summing to `total`."""
    cuts = sorted(rng.sample(range(1, total), parts - 1))
    return [b - a for a, b in zip([0, *cuts], [*cuts, total])]


# Prefix shapes: none (MHA), short (MLA, below the threshold 24), long (MHA_CHUNKED_KV), and mixed.
_PREFIXES = {"none": lambda rng: 0, "short": lambda rng: rng.randrange(1, 20),
             "long": lambda rng: rng.randrange(24, 70), "mixed": lambda rng: rng.choice([0, 5, 40])}


def test_buckets_double_from_64_up_to_the_maximum():
    for top in [64, 65, 100, 2048, random.randrange(64, 5000)]:
        buckets = extend_graph_buckets(top)
        assert buckets[0] == min(EXTEND_GRAPH_MIN_TOKENS, top) and buckets[-1] == top
        assert list(buckets) == sorted(set(buckets))
        assert buckets[:-1] == tuple(EXTEND_GRAPH_MIN_TOKENS << i for i in range(len(buckets) - 1))
    assert extend_graph_buckets(2048) == (64, 128, 256, 512, 1024, 2048)
    for bad in (0, 63):
        with pytest.raises(UserError, match="extend_graph_max_tokens must be >= 64"):
            extend_graph_buckets(bad)
        with pytest.raises(UserError, match="extend_graph_max_tokens"):
            RunnerConfig(extend_graph_max_tokens=bad)


@pytest.mark.parametrize("prefix_shape", list(_PREFIXES))
def test_pieces_and_cores_in_order_equal_the_plain_extend(runner, prefix_shape):
    rng = random.Random(random.randrange(1 << 30))
    count = rng.randrange(1, 5)
    seqs = _batch_seqs(runner, rng, [rng.randrange(1, 30) for _ in range(count)],
                       [_PREFIXES[prefix_shape](rng) for _ in range(count)])
    pool = runner.kv_pool
    before = [b.clone() for b in pool.buffers]
    plain = runner.extend(seqs)
    plain_pool = [b.clone() for b in pool.buffers]
    for buf, saved in zip(pool.buffers, before):
        buf.copy_(saved)
    batch = _build(runner, seqs)
    heard: list[int] = []
    state = ExtendPieces(runner.model).run_all(batch, _Progress(heard.append))
    segmented = runner.model.compute_logits(runner.model.final_hidden(state, batch.last_token_index))
    _same(segmented, plain)
    for layer, plain_layer in zip(pool.buffers, plain_pool):
        _same(layer, plain_layer)
    assert heard == [layer.layer_id for layer in runner.model.layers]
    _free(runner, seqs)


def _same(actual: torch.Tensor, expected: torch.Tensor) -> None:
    """Equal to fp32 rounding. Not bit for bit: the CPU's GEMMs round by the operands' alignment and
    row count (the same attention core on equal inputs allocated 128 bytes apart differs by 2e-7),
    so even the plain extend is not bitwise stable against a change in what else was allocated.
    Every real error in these paths (a row mixed in, a stale or padded value read) is far larger."""
    torch.testing.assert_close(actual, expected, rtol=1e-5, atol=1e-5)


class _Progress:
    def __init__(self, listener) -> None:
        self.kv_written = listener


@pytest.mark.parametrize("prefix_shape", ["none", "mixed"])  # mixed: MHA, MLA and chunked-KV rows together
@pytest.mark.parametrize("fill", ["whole bucket", "padded"])
def test_padded_pieces_equal_the_plain_extend_and_padding_writes_only_the_scratch_page(runner, prefix_shape, fill):
    """The runner's extend through the pieces as plain calls over a bucket's static rows (what a
    capture records) against the same runner's plain extend from the same pool bytes."""
    rng = random.Random(random.randrange(1 << 30))
    pool = runner.kv_pool
    scratch = pool.alloc(1)[0]
    graphs = ExtendGraphRunner(runner.model, pool, 128, scratch, capture=False)
    total = rng.choice([64, 128]) if fill == "whole bucket" else rng.choice([rng.randrange(2, 64),
                                                                              rng.randrange(65, 128)])
    count = min(rng.randrange(2, 6), total)
    seqs = _batch_seqs(runner, rng, _split(total, count, rng), [_PREFIXES[prefix_shape](rng) for _ in range(count)])
    for buf in pool.buffers:  # every byte random: any stray write shows
        buf.copy_(torch.randn_like(buf))
    before = [b.clone() for b in pool.buffers]
    plain = runner.extend(seqs)
    plain_pool = [b.clone() for b in pool.buffers]
    for buf, saved in zip(pool.buffers, before):
        buf.copy_(saved)
    runner.extend_graphs = graphs
    try:
        padded = runner.extend(seqs)
        assert runner.extend_paths["cuda_graph"] >= 1
    finally:
        runner.extend_graphs = None
    written = torch.zeros(pool.num_pages, PAGE, dtype=torch.bool)
    for seq in seqs:
        for position in range(seq.prefix_len, seq.prefix_len + len(seq.token_ids)):
            written[seq.pages[position // PAGE], position % PAGE] = True
    untouched = ~written
    untouched[scratch] = False
    for layer in range(pool.num_layers):
        assert torch.equal(pool.buffers[layer][untouched], before[layer][untouched])  # no other page changed
        _same(pool.buffers[layer][written], plain_pool[layer][written])
        # padding rows wrote into the scratch page, and only padding rows do
        assert torch.equal(pool.buffers[layer][scratch], before[layer][scratch]) == (fill == "whole bucket")
    _same(padded, plain)
    assert torch.equal(padded.argmax(-1), plain.argmax(-1))
    _free(runner, seqs)
    pool.free([scratch])


class _Writes(TorchDispatchMode):
    """Counts, per op, the calls that write into `target`'s memory (an out= or in-place op whose
    destination shares its storage)."""

    def __init__(self, target: torch.Tensor) -> None:
        super().__init__()
        self.storage = target.untyped_storage().data_ptr()
        self.ops: Counter = Counter()

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        written = kwargs.get("out") if func._schema.is_mutable and "out" in kwargs else (
            args[0] if func._schema.is_mutable and args else None)
        if isinstance(written, torch.Tensor) and written.untyped_storage().data_ptr() == self.storage:
            self.ops[str(func.overloadpacket)] += 1
        return func(*args, **kwargs)


def test_the_cores_write_attn_output_into_the_static_buffer_without_a_copy(runner):
    """Each eager core multiplies its o_proj straight into the static attn_output rows the next
    piece reads: one write per layer (mm's out=) and no copy into them; the logits stay the plain
    extend's (an equality the padded-pieces test above checks at every prefix shape). Failed before:
    one `copy_` per layer."""
    rng = random.Random(random.randrange(1 << 30))
    pool = runner.kv_pool
    scratch = pool.alloc(1)[0]
    graphs = ExtendGraphRunner(runner.model, pool, 64, scratch, capture=False)
    count = rng.randrange(1, 4)
    seqs = _batch_seqs(runner, rng, _split(rng.randrange(count + 1, 64), count, rng),
                       [_PREFIXES["mixed"](rng) for _ in range(count)])
    batch = _build(runner, seqs)
    with _Writes(graphs.inputs.attn_output) as writes:
        logits = graphs.extend(batch)
    assert writes.ops == {"aten.mm": runner.model.config.num_hidden_layers, "aten.zero_": 1}  # zero_: the padding rows
    assert torch.equal(logits.argmax(-1), runner.extend(seqs).argmax(-1))
    _free(runner, seqs)
    pool.free([scratch])


def test_runner_extend_takes_the_pieces_up_to_the_largest_bucket_and_eager_past_it(runner):
    rng = random.Random(random.randrange(1 << 30))
    pool = runner.kv_pool
    scratch = pool.alloc(1)[0]
    runner.extend_graphs = ExtendGraphRunner(runner.model, pool, 64, scratch, capture=False)
    runner.extend_paths.update(cuda_graph=0, eager=0)
    try:
        with pytest.raises(UserError, match="extend_cuda_graph=false"):  # its replays would not count
            runner.record_expert_load()
        small = _batch_seqs(runner, rng, [rng.randrange(1, 65)], [0])
        big = _batch_seqs(runner, rng, [rng.randrange(65, 100)], [0])
        runner.extend(small)
        assert runner.extend_paths == {"cuda_graph": 1, "eager": 0}
        through_graphs = runner.extend(big)
    finally:
        runner.extend_graphs = None
    assert runner.extend_paths == {"cuda_graph": 1, "eager": 1}
    _same(through_graphs, runner.extend(big))  # past the largest bucket: the plain extend itself
    _free(runner, small + big)
    pool.free([scratch])


def test_progress_hears_each_layer_once_its_kv_is_in_the_pool(runner):
    """The layer-wise KV send reads a layer's pages when told: by then the piece that writes them
    has run (the values are already the forward's final ones), and layers come in order."""
    rng = random.Random(random.randrange(1 << 30))
    pool = runner.kv_pool
    seqs = _batch_seqs(runner, rng, [rng.randrange(1, 40) for _ in range(3)], [0, rng.randrange(1, 30), 0])
    slots = torch.tensor([seq.pages[p // PAGE] * PAGE + p % PAGE for seq in seqs
                          for p in range(seq.prefix_len, seq.prefix_len + len(seq.token_ids))])
    seen: dict[int, torch.Tensor] = {}
    graphs = ExtendGraphRunner(runner.model, pool, 128, pool.alloc(1)[0], capture=False)
    graphs.extend(_build(runner, seqs), _Progress(lambda layer: seen.setdefault(layer, pool.flat(layer)[slots].clone())))
    assert list(seen) == [layer.layer_id for layer in runner.model.layers]
    for layer, at_notice in seen.items():
        assert torch.equal(at_notice, pool.flat(layer)[slots])
    _free(runner, seqs)
    pool.free([graphs.inputs.scratch_page])


# ---- what cannot be captured --------------------------------------------------------------------

def test_the_rule_refuses_what_cannot_be_captured_in_words(tiny_path, monkeypatch):
    from deepseek_pd.workers.serve.flag_rules import check_flags
    from deepseek_pd.workers.serve.flags import ServeFlags

    base = dict(record_expert_load=False, enable_tbo=False, tp_size=1, ep_size=1, deterministic=False,
                speculative_num_steps=0)
    assert extend_graph_settings_blocker(**base) is None
    for change, words in [({"record_expert_load": True}, "expert-load recording"),
                          ({"enable_tbo": True}, "two-batch overlap"), ({"tp_size": 2}, "attention TP"),
                          ({"ep_size": 2}, "expert parallelism"), ({"deterministic": True}, "deterministic"),
                          ({"speculative_num_steps": 2}, "extend_hidden")]:
        assert words in extend_graph_settings_blocker(**{**base, **change})
        config = RunnerConfig(device="cuda", **{k: v for k, v in change.items() if k != "tp_size"},
                              **({"tp_size": 2} if "tp_size" in change else {}))
        assert words in config.extend_graph_blocker()
    assert "CUDA device" in RunnerConfig(device="cpu").extend_graph_blocker()
    for backend, words in [({"moe_backend": "torch"}, "MoE backend 'torch'"),
                           ({"attention_backend": "torch"}, "attention backend 'torch'")]:
        assert words in RunnerConfig(device="cuda", **backend).extend_graph_blocker()
    assert "local MoE dispatcher" in RunnerConfig(device="cuda", dispatcher="all_to_all").extend_graph_blocker()
    with pytest.raises(UserError, match="extend_cuda_graph=true: extend CUDA graphs need a CUDA device"):
        ModelRunner(RunnerConfig(model=tiny_path, device="cpu", extend_cuda_graph=True))
    from deepseek_pd.model.config import ModelConfig
    from deepseek_pd.model.checkpoint.model_dir import resolve_model_dir
    with pytest.raises(UserError, match="extend_cuda_graph=true: extend CUDA graphs need a CUDA device"):
        RunnerConfig.resolve(ModelConfig.from_hf(resolve_model_dir(tiny_path)), graphs_by_default=False,
                             device="cpu", extend_cuda_graph=True)
    with pytest.raises(UserError, match="extend_cuda_graph=true: .*two-batch overlap"):
        check_flags(ServeFlags.from_argv(["prefill", "--model", tiny_path, "--enable-tbo",
                                          "--engine-opt", "extend_cuda_graph=true"]))
    with pytest.raises(UserError, match="extend_cuda_graph=true: .*extend_hidden"):
        check_flags(ServeFlags.from_argv(["decode", "--model", tiny_path, "--speculative-num-steps", "2",
                                          "--engine-opt", "extend_cuda_graph=true"]))
    check_flags(ServeFlags.from_argv(["prefill", "--model", tiny_path, "--engine-opt", "extend_cuda_graph=true"]))


def test_the_built_model_check_names_what_rules_it_out(tiny_path):
    from deepseek_pd.model.extend_graph import check_extend_capturable

    model = ModelRunner(RunnerConfig(model=tiny_path, device="cpu")).model
    with pytest.raises(UserError, match="CUDA device"):
        check_extend_capturable(model)
    model.options = dataclasses.replace(model.options, device="cuda")  # reach the backend checks
    with pytest.raises(UserError, match="attention backend 'torch'"):
        check_extend_capturable(model)


# ---- GPU: captured replays ------------------------------------------------------------------------

def _gpu_runner(path: str, graphs: bool) -> ModelRunner:
    """With `graphs`, decode graphs too: the extend graphs share their pool and scratch page."""
    return ModelRunner(RunnerConfig(
        model=path, dtype="bfloat16", device="cuda", attention_backend="triton", moe_backend="triton",
        page_size=16, num_pages=512, mha_chunked_kv_threshold=24, extend_cuda_graph=graphs,
        extend_graph_max_tokens=256, cuda_graph=graphs, cuda_graph_max_batch=8, cuda_graph_max_context=512))


@pytest.mark.gpu
@needs_cuda
def test_graph_extend_equals_eager(tiny_path):
    rng = random.Random(random.randrange(1 << 30))
    eager, graphed = _gpu_runner(tiny_path, False), _gpu_runner(tiny_path, True)
    for _ in range(12):
        count = rng.randrange(1, 5)
        lengths = [rng.randrange(1, 250 // count) for _ in range(count)]
        prefixes = [rng.choice([0, 0, rng.randrange(1, 20), rng.randrange(24, 90)]) for _ in range(count)]
        vocab = eager.model_config.vocab_size
        prompts = [[rng.randrange(vocab) for _ in range(p + n)] for p, n in zip(prefixes, lengths)]
        logits, decoded = [], []
        for runner in (eager, graphed):
            pages = [runner.kv_pool.alloc(runner.kv_pool.pages_for_tokens(len(p) + 1)) for p in prompts]
            for prompt, prefix, seq_pages in zip(prompts, prefixes, pages):
                if prefix:
                    runner.extend([ExtendSeq(prompt[:prefix], 0, seq_pages)])
            logits.append(runner.extend([ExtendSeq(p[f:], f, sp) for p, f, sp in zip(prompts, prefixes, pages)]))
            # a decode step after it (a graph replay in the shared pool) reads the KV the extend wrote
            first = logits[0].argmax(-1).tolist()
            decoded.append(runner.decode([DecodeSeq(t, len(p), sp) for t, p, sp in zip(first, prompts, pages)]))
            for seq_pages in pages:
                runner.kv_pool.free(seq_pages)
        for pair in (logits, decoded):
            rel = float((pair[1] - pair[0]).norm() / pair[0].norm())
            assert rel < 2e-2, rel
            assert torch.equal(pair[1].argmax(-1), pair[0].argmax(-1))
    assert graphed.extend_paths["cuda_graph"] >= 12 and graphed.decode_paths["cuda_graph"] >= 12


@pytest.mark.gpu
@needs_cuda
def test_graph_extend_issues_far_fewer_host_launches(tiny_path):
    from torch.profiler import ProfilerActivity, profile

    rng = random.Random(random.randrange(1 << 30))
    counts = {}
    for graphs in (False, True):
        runner = _gpu_runner(tiny_path, graphs)
        prompt = [rng.randrange(runner.model_config.vocab_size) for _ in range(200)]
        pages = runner.kv_pool.alloc(runner.kv_pool.pages_for_tokens(len(prompt)))
        runner.extend([ExtendSeq(prompt, 0, pages)])  # compile, plan
        torch.cuda.synchronize()
        # CUDA activity too: the host-side runtime/driver calls (launches, copies) are recorded with it.
        with profile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA]) as prof:
            runner.extend([ExtendSeq(prompt, 0, pages)])
            torch.cuda.synchronize()
        counts[graphs] = sum(e.count for e in prof.key_averages() if e.key in _HOST_LAUNCHES)
        if graphs:
            assert runner.extend_paths["cuda_graph"] == 2
    assert counts[False] > 0, "the profiler recorded no launches: its event names changed?"
    assert counts[True] < 0.5 * counts[False], counts


# The host's calls that put work on the GPU, as the profiler names them (runtime and driver API).
_HOST_LAUNCHES = ("cudaLaunchKernel", "cudaLaunchKernelExC", "cuLaunchKernel", "cuLaunchKernelEx", "cudaGraphLaunch",
                  "cudaMemcpyAsync", "cudaMemsetAsync")

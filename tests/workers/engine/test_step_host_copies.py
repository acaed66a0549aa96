"""The model thread's per-step path copies host data to the device only through
`model/host_copy.upload` (pinned and asynchronous on CUDA).

Why: on an H100 a prefill worker's per-chunk KV send (another thread) blocked in the driver until
the model thread's next forward ended (tests/workers/prefill/test_chunk_send_order_cuda.py). A copy
from pageable memory goes through the driver's shared staging buffers, held until it runs on the
GPU, behind the forward queued before it; other threads' copies wait behind it.

On the CPU, `pdtest.host_uploads.DirectUploads` follows where data comes from and records every
copy that would take another way on CUDA (it is checked first on copies it must catch). Run under it:
a prefill round without and with a cached prefix (MLA over the cache, and MHA over prefix chunks),
its MTP pass, decode steps fed by the previous step's samples, and overlapped speculative steps,
with greedy, seeded, penalised and top-logprob requests. The backends only CUDA runs (Triton,
FlashInfer) and the groups' collectives are checked on their source: no `torch.tensor(.., device=)`
and no `.to(device)` of a freshly made host tensor in the per-step modules.

Failed before: forward_batch.py (7 copies per batch), mla.py's prefix chunks, decode_step.py's
input ids, decoder.py's MTP rows; on the source also triton_backend.py, flashinfer_mla.py,
sampler.py, parallel.py's per-forward all-reduce and tp_replay.py's page indices.
"""
from __future__ import annotations

import ast
import random
from pathlib import Path

import pytest
import torch

from deepseek_pd.model.checkpoint.tiny import make_tiny_model
from deepseek_pd.model import host_copy
from deepseek_pd.model.runner import ExtendSeq, ModelRunner
from deepseek_pd.model.runner_config import RunnerConfig
from deepseek_pd.model.sampling.params import SamplingParams
from deepseek_pd.model.sampling.sampler import Sampler, SamplingState
from deepseek_pd.workers.decode.decode_step import DecodeRow, DecodeStepper
from deepseek_pd.workers.decode.speculative_step import SpecRow, SpeculativeStepper
from deepseek_pd.workers.engine import extend_step
from pdtest.host_uploads import DirectUploads

pytestmark = pytest.mark.usefixtures("one_torch_thread")
REPO = Path(__file__).resolve().parents[3]
PAGE = 4
# What the model thread runs every step: the whole model package (batch building, attention
# metadata, kernels' wrappers, sampling tables, speculative inputs, the groups' per-forward
# collectives) and the workers' step modules; less what never runs in a step.
STEP_MODULES = ("model", "workers/engine/extend_step.py", "workers/decode/decode_step.py",
                "workers/decode/speculative_step.py")
NOT_IN_A_STEP = {"model/eplb/replica_dispatch.py": "its tables are built once per expert placement",
                 "model/kv/pool.py": "`slots` is the tests' helper (pages given as a host list or a device tensor)"}


def test_the_detector_catches_each_way_around_upload() -> None:
    dev = torch.zeros(4)
    with DirectUploads() as mode:
        host = torch.tensor([1, 2])
        host_copy.upload(host, "cpu")[0:1]
        dev[host_copy.upload(host, "cpu")]
        assert mode.records == [] and mode.uploads == 2
        host.to("cpu")
        torch.tensor([1], device="cpu")
        dev[[1, 2]]
        dev[host]
        dev.clone().copy_(torch.arange(4.0))
    assert [what for what, _ in mode.records] == ["Tensor.to(device)", "torch.tensor(device=)",
                                                  "Tensor.__getitem__(list)", "__getitem__(host and device tensors)",
                                                  "device.copy_(host)"]
    assert all(where.startswith("tests/workers/engine/test_step_host_copies.py:") for _, where in mode.records)


def test_upload_parts_is_one_upload_of_aligned_views() -> None:
    rng = random.Random()
    dtypes = [torch.int64, torch.int32, torch.float32, torch.bool, torch.uint8, torch.float16]
    with DirectUploads() as mode:
        parts = []
        for _ in range(rng.randint(1, 6)):
            shape = tuple(rng.randint(0, 5) for _ in range(rng.randint(0, 2)))
            parts.append((torch.randint(0, 100, shape) % 2 if rng.random() < 0.5 else torch.randint(0, 100, shape))
                         .to(rng.choice(dtypes)))
        views = host_copy.upload_parts("cpu", *parts)
    assert mode.uploads == 1 and mode.records == []
    base = views[0].untyped_storage().data_ptr()
    for part, view in zip(parts, views):
        assert view.dtype == part.dtype and view.shape == part.shape and torch.equal(view, part)
        assert view.untyped_storage().data_ptr() == base and (view.data_ptr() - base) % 16 == 0
    assert host_copy.upload_parts("cpu") == []


def _params(rng: random.Random) -> list[SamplingParams]:
    return [SamplingParams(temperature=0.0, max_new_tokens=8, ignore_eos=True, top_logprobs_num=2),
            SamplingParams(temperature=0.8, top_p=0.9, top_k=5, seed=rng.randrange(1 << 20), max_new_tokens=8,
                           ignore_eos=True, repetition_penalty=1.2, frequency_penalty=0.1),
            SamplingParams(temperature=0.7, seed=rng.randrange(1 << 20), max_new_tokens=8, ignore_eos=True,
                           presence_penalty=0.3, min_p=0.05)]


@pytest.mark.parametrize("threshold", [1, 1 << 20], ids=["mha_chunked_kv", "mla"])
def test_prefill_and_decode_steps_upload_only_through_upload(threshold: int) -> None:
    rng = random.Random()
    model = ModelRunner(RunnerConfig(model="tiny", page_size=PAGE, num_pages=128, mha_chunked_kv_threshold=threshold))
    vocab = model.model_config.vocab_size
    prompts = [[rng.randrange(2, vocab) for _ in range(rng.randint(6, 20))] for _ in range(3)]
    cut = [rng.randint(1, len(p) - 1) for p in prompts]
    pages = [model.kv_pool.alloc(model.kv_pool.pages_for_tokens(len(p) + 4)) for p in prompts]
    states = [SamplingState.create(q, p, vocab) for q, p in zip(_params(rng), prompts)]
    with DirectUploads() as mode:
        extend_step.run_extend(model, Sampler(), [ExtendSeq(p[:c], 0, pg) for p, c, pg in zip(prompts, cut, pages)],
                               [], [])
        first = extend_step.run_extend(model, Sampler(), [ExtendSeq(p[c:], c, pg)
                                                          for p, c, pg in zip(prompts, cut, pages)], [0, 1, 2], states)
        stepper = DecodeStepper(model)
        rows = [DecodeRow(t, -1, len(p), pg, s) for t, p, pg, s in zip(first.token_ids, prompts, pages, states)]
        step = stepper.launch([0, 1, 2], rows, None)
        for n in (1, 2):
            rows = [DecodeRow(0, i, len(p) + n, pg, s) for i, (p, pg, s) in enumerate(zip(prompts, pages, states))]
            step = stepper.launch([0, 1, 2], rows, step)
        step.collect()
    assert mode.records == []
    assert mode.uploads >= 6  # 2 extends + 3 decodes' batches, the sampled rows, the sampling tables


def test_speculative_steps_upload_only_through_upload(tmp_path) -> None:
    rng = random.Random()
    path = make_tiny_model(tmp_path / "v3", seed=rng.randrange(1000), mtp_layers=1)
    model = ModelRunner(RunnerConfig(model=str(path), page_size=PAGE, num_pages=128, speculative_num_steps=2))
    vocab = model.model_config.vocab_size
    prompts = [[rng.randrange(2, vocab) for _ in range(rng.randint(6, 20))] for _ in range(3)]
    pages = [model.kv_pool.alloc(model.kv_pool.pages_for_tokens(len(p) + 16)) for p in prompts]
    states = [SamplingState.create(q, p, vocab) for q, p in zip(_params(rng), prompts)]
    with DirectUploads() as mode:
        first, drafts = extend_step.run_extend_with_mtp(
            model, Sampler(), [ExtendSeq(p, 0, pg) for p, pg in zip(prompts, pages)], [0, 1, 2], states, prompts)
        stepper = SpeculativeStepper(model, 2, Sampler())
        rows = [SpecRow(p, pg, 8, s) for p, pg, s in zip(prompts, pages, states)]
        for i, (row, token, (draft, hidden)) in enumerate(zip(rows, first.token_ids, drafts)):
            row.output_ids.append(token)
            if i == 0:
                stepper.seed(row, draft, hidden)  # colocated
            else:
                row.wire_draft = (draft, hidden.tolist())  # from a prefill worker
        pending = None
        for _ in range(3):  # overlapped: launched ahead from the device's counts
            _, pending = stepper.collect_and_launch(pending, rows)
        stepper.collect(pending)
    assert mode.records == []
    assert mode.uploads > 0


def _direct_copies(tree: ast.AST) -> list[int]:
    """Lines of `torch.tensor/as_tensor(..., device=...)` and of `.to(...)`/`.cuda()` applied to a
    tensor made on the host in the same expression (`torch.tensor(..)`, `torch.cat(..)`, ...)."""
    made = {"tensor", "as_tensor", "cat", "stack", "from_numpy", "frombuffer"}

    def host_made(node: ast.AST) -> bool:
        return isinstance(node, ast.Call) and isinstance(node.func, ast.Attribute) \
            and isinstance(node.func.value, ast.Name) and node.func.value.id == "torch" and node.func.attr in made

    lines = []
    for node in ast.walk(tree):
        if not isinstance(node, ast.Call) or not isinstance(node.func, ast.Attribute):
            continue
        if host_made(node) and node.func.attr in ("tensor", "as_tensor") \
                and any(k.arg == "device" for k in node.keywords):
            lines.append(node.lineno)
        elif node.func.attr in ("to", "cuda") and host_made(node.func.value) \
                and (node.func.attr == "cuda" or node.args and not _is_dtype(node.args[0])
                     or any(k.arg == "device" for k in node.keywords)):
            lines.append(node.lineno)
    return lines


def _is_dtype(node: ast.AST) -> bool:
    """`torch.<dtype>` or `<tensor>.dtype`: a cast, not a move."""
    return isinstance(node, ast.Attribute) and (node.attr == "dtype" or isinstance(node.value, ast.Name)
                                                and node.value.id == "torch")


def test_the_step_modules_copy_no_fresh_host_tensor_directly() -> None:
    files = sorted(f for m in STEP_MODULES for f in ([REPO / m] if m.endswith(".py") else (REPO / m).rglob("*.py"))
                   if str(f.relative_to(REPO)) not in NOT_IN_A_STEP)
    assert len(files) > 50 and all((REPO / path).is_file() for path in NOT_IN_A_STEP)
    hits = [f"{f.relative_to(REPO)}:{line}" for f in files for line in _direct_copies(ast.parse(f.read_text()))]
    assert hits == []

"""Trains a model's MTP layer to predict its own model's next-next token, on any device and dtype.

The MTP layer at position p sees (token at p + 1, the target's normed hidden state at p) and drafts
the token at p + 2 (model/speculative/decoder.py), so those are the training pairs. The label is
either the sequence's own token at p + 2 (`labels="tokens"`: right for greedy sequences of the
target) or the target's greedy choice after p + 1 (`labels="greedy"`: what a greedy verify will
accept, also on sequences sampled at temperature > 0, which loop less than greedy ones on a
random model). Only the MTP layer's parameters move; embedding and lm_head are shared and frozen.

Backends without a backward (the Triton kernels) cannot train: the layer is then trained as a copy
built with the torch reference backends (`trainable_mtp`) and copied back in place, so CUDA graphs
captured over the model's own parameters stay valid. Weights below fp32 train through fp32 master
copies (Adam's state in fp32 too). A few seconds on the tiny model on CPU memorise its training
sequences; `save_mtp_layer` writes the trained layer back into a checkpoint for other processes.

    accuracy, steps = train_mtp(runner, sequences, seconds=30.0, labels="greedy")
"""
from __future__ import annotations

import dataclasses
import time
from pathlib import Path
from typing import Literal

import torch
import torch.nn.functional as F

from deepseek_pd.model.forward_batch import ForwardBatch, ForwardMode
from deepseek_pd.model.host_copy import upload
from deepseek_pd.model.runner import ExtendSeq, ModelRunner
from deepseek_pd.model.speculative.mtp import MtpLayer

TORCH_BACKENDS = dict(attention_backend="torch", moe_backend="torch", norm_rope_backend="torch")

Labels = Literal["tokens", "greedy"]


@torch.no_grad()
def target_hidden(runner: ModelRunner, seqs: list[list[int]]) -> list[torch.Tensor]:
    """The target's normed hidden state of every token of each sequence."""
    pool = runner.kv_pool
    pages = [pool.alloc(pool.pages_for_tokens(len(s))) for s in seqs]
    try:
        hidden = runner.extend_hidden([ExtendSeq(s, 0, p) for s, p in zip(seqs, pages)])
    finally:
        for p in pages:
            pool.free(p)
    return list(hidden.split([len(s) for s in seqs]))


@torch.no_grad()
def greedy_next(runner: ModelRunner, hidden: torch.Tensor, chunk: int = 4096) -> torch.Tensor:
    """`[T]` long: the target's argmax token after each of `hidden`'s rows (chunked: logits are T x vocab)."""
    return torch.cat([runner.logits(part).argmax(dim=-1) for part in hidden.split(chunk)])


def trainable_mtp(runner: ModelRunner) -> MtpLayer:
    """The runner's MTP layer where its backends have a backward (all torch), else a copy of it
    built with the torch backends (same dtype and device), to train and copy back."""
    model = runner.model
    options = model.options
    if all(getattr(options, name) == value for name, value in TORCH_BACKENDS.items()):
        return model.mtp
    copy = MtpLayer(model.config, model.rotary, dataclasses.replace(options, **TORCH_BACKENDS), model.dispatcher)
    copy.load_state_dict(model.mtp.state_dict())
    return copy


def _training_pairs(runner: ModelRunner, seqs: list[list[int]], labels: Labels
                    ) -> tuple[list[list[int]], torch.Tensor, torch.Tensor]:
    """(input tokens per sequence: each's tokens from p + 1, previous hidden states `[T, H]`,
    labels `[T]` with -100 where there is none)."""
    if labels not in ("tokens", "greedy"):
        raise ValueError(f"labels must be 'tokens' or 'greedy', got {labels!r}")
    if any(len(s) < 2 for s in seqs):
        raise ValueError("every training sequence needs at least 2 tokens")
    hidden = target_hidden(runner, seqs)
    tokens = [s[1:] for s in seqs]
    prev = torch.cat([h[:-1] for h in hidden])
    if labels == "tokens":
        target = upload(torch.tensor([t for s in seqs for t in s[2:] + [-100]], dtype=torch.long), prev.device)
    else:  # the target's choice after p + 1: hidden row p + 1, which the last row has none of
        nexts = [greedy_next(runner, h[1:]) for h in hidden]
        target = torch.cat([torch.cat([n[:-1], n.new_full((1,), -100)]) for n in nexts])
    return tokens, prev, target


def train_mtp(runner: ModelRunner, seqs: list[list[int]], seconds: float, lr: float = 1e-2,
              target_accuracy: float = 1.0, labels: Labels = "tokens", depth: int = 1) -> tuple[float, int]:
    """Adam on the MTP layer over all of `seqs` at once until `seconds` pass or the training
    accuracy reaches `target_accuracy`; returns (the last step's accuracy, the lowest over
    the depths; steps). The KV pool's MTP layer is left as it was (its training writes go to a scratch copy).

    `depth` d > 1 also trains the draft chain's later steps (decoder.py): chain step j feeds the
    MTP layer its own output at the position before, not the target's hidden state, so depth d at
    position p takes (token p + 1, depth d - 1's output at p - 1; a sequence's first position keeps
    the target's) with the same label. Depth 1 alone teaches only the first draft: a layer that
    memorised its sequences at depth 1 drafts the second and third ones from inputs it never saw
    (the tiny model, fp32, in-sample: accept length 1.96 at k = 1 but 2.2 at k = 2, 2.3 at k = 3)."""
    if depth < 1:
        raise ValueError(f"depth must be >= 1, got {depth}")
    model, pool = runner.model, runner.kv_pool
    tokens, prev, target = _training_pairs(runner, seqs, labels)
    mtp = trainable_mtp(runner)
    params = list(mtp.parameters())
    masters = params if params[0].dtype == torch.float32 else [p.detach().float() for p in params]
    frozen = [p for p in model.parameters() if p.requires_grad]
    for p in frozen:
        p.requires_grad_(False)
    for p in params:
        p.requires_grad_(True)
    opt = torch.optim.Adam(masters, lr=lr)
    layer = mtp.layer_id
    kept = pool.buffers[layer]  # graphs captured over it keep their address
    pages = [pool.alloc(pool.pages_for_tokens(len(t))) for t in tokens]
    # Row r's row one position back in its sequence (`back`), and whether r is a sequence's first.
    firsts = [sum(map(len, tokens[:i])) for i in range(len(tokens))]
    back = upload(torch.tensor([max(r - 1, 0) for r in range(prev.shape[0])], dtype=torch.long), prev.device)
    first = torch.zeros(prev.shape[0], 1, dtype=torch.bool)
    first[firsts] = True
    first = first.to(prev.device)
    accuracy, steps, start = 0.0, 0, time.monotonic()
    try:
        while time.monotonic() - start < seconds and accuracy < target_accuracy:
            batch = ForwardBatch.build(ForwardMode.EXTEND, tokens, [0] * len(tokens), pages, pool,
                                       model.config.vocab_size, model.options.device)
            batch.attention_method = runner.policy.choose(ForwardMode.EXTEND, batch.prefix_lens)
            known = target >= 0
            accuracies, loss, hidden = [], 0.0, prev
            with torch.enable_grad():
                embedded = model.embed_tokens(batch.input_ids)
                for d in range(depth):
                    pool.buffers[layer] = torch.zeros_like(kept)  # no autograd history across passes
                    out = mtp(batch, embedded, hidden)
                    logits = model.lm_head(out).float()
                    loss = loss + F.cross_entropy(logits, target, ignore_index=-100)
                    accuracies.append((logits.detach().argmax(-1)[known] == target[known]).float().mean().item())
                    if d + 1 < depth:  # the next depth's input: this output one position back
                        hidden = torch.where(first, prev, out.detach().index_select(0, back))
                accuracy = min(accuracies)
                steps += 1
                if accuracy >= target_accuracy:  # keep the weights this accuracy was measured on
                    break
                opt.zero_grad()
                loss.backward()
            _step(opt, params, masters)
    finally:
        for p in pages:
            pool.free(p)
        pool.buffers[layer] = kept
        for p in params:
            p.requires_grad_(False)
            p.grad = None
        for p in frozen:
            p.requires_grad_(True)
    if mtp is not model.mtp:
        model.mtp.load_state_dict(mtp.state_dict())  # in place: the model's own tensors
    return accuracy, steps


@torch.no_grad()
def mtp_accuracy(runner: ModelRunner, seqs: list[list[int]], labels: Labels = "tokens") -> float:
    """The share of `seqs`' training pairs whose label the runner's own MTP layer (its kernels, its
    dtype: what drafts at inference) ranks first, over the target's extend-path hidden states.
    Below `train_mtp`'s accuracy: the trained copy's backends and rounding disagree with the
    layer's, near-ties of a memorised layer flipping."""
    tokens, prev, target = _training_pairs(runner, seqs, labels)
    pool = runner.kv_pool
    pages = [pool.alloc(pool.pages_for_tokens(len(t))) for t in tokens]
    try:
        out = runner.draft([ExtendSeq(t, 0, p) for t, p in zip(tokens, pages)], prev)
    finally:
        for p in pages:
            pool.free(p)
    known = target >= 0
    return (greedy_next(runner, out)[known] == target[known]).float().mean().item()


def _step(opt: torch.optim.Optimizer, params: list[torch.Tensor], masters: list[torch.Tensor]) -> None:
    """One optimizer step; below fp32 through the fp32 `masters`, then copied into `params`."""
    if all(p.grad is None for p in params):
        raise RuntimeError("no MTP parameter got a gradient: a backend without a backward ran")
    if masters is params:
        opt.step()
        return
    for master, p in zip(masters, params):  # a parameter used only in routing choices has none
        master.grad = None if p.grad is None else p.grad.float()
        p.grad = None
    opt.step()
    with torch.no_grad():
        for master, p in zip(masters, params):
            p.copy_(master)
            master.grad = None


def save_mtp_layer(runner: ModelRunner, checkpoint: Path) -> None:
    """Writes the runner's (trained) MTP layer back into `checkpoint`'s model.safetensors under the
    HF names, so workers that load the checkpoint draft with it (the tiny V3 shape: q_lora, separate
    shared experts, no FP8)."""
    from safetensors.torch import load_file, save_file

    from deepseek_pd.model.speculative.mtp_names import mtp_hf_prefix

    config, mtp = runner.model.config, runner.model.mtp
    p = {name: t.detach().cpu().float() for name, t in mtp.named_parameters()}
    hf = mtp_hf_prefix(config)
    q_lora, inter = config.q_lora_rank, config.moe_intermediate_size
    out = {f"{hf}enorm.weight": p["enorm.weight"], f"{hf}hnorm.weight": p["hnorm.weight"],
           f"{hf}eh_proj.weight": p["eh_proj.weight"], f"{hf}shared_head.norm.weight": p["shared_head_norm.weight"]}
    layer, a = "layer.", "layer.self_attn."
    for norm in ("input_layernorm", "post_attention_layernorm"):
        out[f"{hf}{norm}.weight"] = p[f"{layer}{norm}.weight"]
    fused = p[a + "fused_qkv_a_proj.weight"]
    out[f"{hf}self_attn.q_a_proj.weight"] = fused[:q_lora]
    out[f"{hf}self_attn.kv_a_proj_with_mqa.weight"] = fused[q_lora:]
    for name in ("q_a_layernorm", "q_b_proj", "kv_a_layernorm", "o_proj"):
        out[f"{hf}self_attn.{name}.weight"] = p[f"{a}{name}.weight"]
    w_kc, w_vc = p[a + "w_kc"], p[a + "w_vc"]
    out[f"{hf}self_attn.kv_b_proj.weight"] = torch.cat([w_kc, w_vc], dim=1).reshape(-1, w_kc.shape[-1])
    m = "layer.mlp."
    out[f"{hf}mlp.gate.weight"] = p[m + "gate_weight"]
    out[f"{hf}mlp.gate.e_score_correction_bias"] = p[m + "e_score_correction_bias"]
    for j in range(config.n_routed_experts):
        out[f"{hf}mlp.experts.{j}.gate_proj.weight"] = p[m + "experts.w13"][j, :inter]
        out[f"{hf}mlp.experts.{j}.up_proj.weight"] = p[m + "experts.w13"][j, inter:]
        out[f"{hf}mlp.experts.{j}.down_proj.weight"] = p[m + "experts.w2"][j]
    shared = p[m + "shared_experts.gate_up_proj.weight"]
    half = shared.shape[0] // 2
    out[f"{hf}mlp.shared_experts.gate_proj.weight"] = shared[:half]
    out[f"{hf}mlp.shared_experts.up_proj.weight"] = shared[half:]
    out[f"{hf}mlp.shared_experts.down_proj.weight"] = p[m + "shared_experts.down_proj.weight"]
    tensors = load_file(str(checkpoint / "model.safetensors"))
    missing = sorted(set(out) - set(tensors))
    if missing:
        raise KeyError(f"not in the checkpoint: {missing}")
    tensors.update({name: t.contiguous() for name, t in out.items()})
    save_file(tensors, str(checkpoint / "model.safetensors"), metadata={"format": "pt"})

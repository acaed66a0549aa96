"""Trains the tiny model's MTP layer, on CPU, to predict its own model's next-next token.

The data are the target's own greedy sequences; the MTP layer sees (token at p + 1, the target's
normed hidden state at p) and learns the token at p + 2, exactly the pairs it drafts from
(model/speculative/decoder.py). Only the MTP layer's parameters move; embedding and lm_head are shared and
frozen. A few seconds on the tiny model memorise the training sequences. `save_mtp_layer` writes
the trained layer back into the checkpoint, for workers in other processes.
"""
from __future__ import annotations

import time
from pathlib import Path

import torch
import torch.nn.functional as F

from deepseek_pd.model.forward_batch import ForwardBatch, ForwardMode
from deepseek_pd.model.runner import ExtendSeq, ModelRunner


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


def train_mtp(runner: ModelRunner, seqs: list[list[int]], seconds: float, lr: float = 1e-2,
              target_accuracy: float = 1.0) -> tuple[float, int]:
    """Adam on the MTP layer until `seconds` pass or the training accuracy reaches `target_accuracy`;
    returns (the last accuracy, steps). The MTP layer's KV pool layer is left zeroed."""
    model, pool = runner.model, runner.kv_pool
    hidden = target_hidden(runner, seqs)
    tokens = [s[1:] for s in seqs]
    prev = torch.cat([h[:-1] for h in hidden])
    labels = torch.cat([torch.tensor(s[2:] + [-100]) for s in seqs]).to(prev.device)
    mtp_params = list(model.mtp.parameters())
    frozen = [p for p in model.parameters() if p.requires_grad]
    for p in frozen:
        p.requires_grad_(False)
    for p in mtp_params:
        p.requires_grad_(True)
    opt = torch.optim.Adam(mtp_params, lr=lr)
    layer = model.mtp.layer_id
    pages = [pool.alloc(pool.pages_for_tokens(len(t))) for t in tokens]
    accuracy, steps, start = 0.0, 0, time.monotonic()
    try:
        while time.monotonic() - start < seconds and accuracy < target_accuracy:
            pool.buffers[layer] = torch.zeros_like(pool.buffers[layer])  # no autograd history across steps
            batch = ForwardBatch.build(ForwardMode.EXTEND, tokens, [0] * len(tokens), pages, pool,
                                       model.config.vocab_size, model.options.device)
            batch.attention_method = runner.policy.choose(ForwardMode.EXTEND, batch.prefix_lens)
            with torch.enable_grad():
                logits = model.lm_head(model.mtp(batch, model.embed_tokens(batch.input_ids), prev)).float()
                loss = F.cross_entropy(logits, labels, ignore_index=-100)
                opt.zero_grad()
                loss.backward()
                opt.step()
            known = labels >= 0
            accuracy = (logits.argmax(-1)[known] == labels[known]).float().mean().item()
            steps += 1
    finally:
        for p in pages:
            pool.free(p)
        pool.buffers[layer] = torch.zeros_like(pool.buffers[layer])
        for p in mtp_params:
            p.requires_grad_(False)
        for p in frozen:
            p.requires_grad_(True)
    return accuracy, steps


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

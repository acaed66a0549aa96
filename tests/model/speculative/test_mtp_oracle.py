"""The MTP layer against HF transformers (which has no MTP module, but has its decoder layer).

Oracle: the checkpoint's MTP decoder layer saved as the only layer of an HF DeepSeek-V3 (layer 0,
MoE), its `shared_head.norm` as the final norm; HF runs it on `inputs_embeds` =
`eh_proj([enorm(emb(x)) ; hnorm(h)])` computed here in plain torch. Ours runs the same tokens and
hidden states through `ModelRunner.draft` in one extend, in two extend rounds, and one decode step
at a time over the paged MTP cache; all must equal HF. The target's hidden states (`extend_hidden`) are checked
against HF's last hidden state of the main model."""
from __future__ import annotations

import json
import random

import pytest
import torch
from safetensors.torch import load_file, save_file

from deepseek_pd.model.runner import ExtendSeq, ModelRunner
from deepseek_pd.model.runner_config import RunnerConfig
from deepseek_pd.model.checkpoint.tiny import make_tiny_model

pytestmark = pytest.mark.timeout(300)
transformers = pytest.importorskip("transformers")


def _rms(x: torch.Tensor, w: torch.Tensor, eps: float) -> torch.Tensor:
    return w * (x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + eps))


def _mtp_as_hf_model(src, dst):
    """The MTP layer of `src` as a one-layer HF checkpoint at `dst` (embedding and head shared)."""
    config = json.loads((src / "config.json").read_text())
    layer = config["num_hidden_layers"]
    tensors = load_file(str(src / "model.safetensors"))
    prefix = f"model.layers.{layer}."
    out = {"model.embed_tokens.weight": tensors["model.embed_tokens.weight"],
           "lm_head.weight": tensors["lm_head.weight"],
           "model.norm.weight": tensors[prefix + "shared_head.norm.weight"]}
    skip = ("enorm.", "hnorm.", "eh_proj.", "shared_head.", "embed_tokens.")
    for name, t in tensors.items():
        if name.startswith(prefix) and not name[len(prefix):].startswith(skip):
            out["model.layers.0." + name[len(prefix):]] = t
    dst.mkdir()
    (dst / "config.json").write_text(json.dumps({**config, "num_hidden_layers": 1, "first_k_dense_replace": 0,
                                                 "num_nextn_predict_layers": 0}))
    save_file(out, str(dst / "model.safetensors"), metadata={"format": "pt"})
    return tensors, prefix, config


def test_mtp_layer_matches_hf_decoder_layer(tmp_path):
    seed = random.randrange(10_000)
    print(f"seed={seed}")
    torch.manual_seed(seed)
    src = make_tiny_model(tmp_path / "tiny", seed=seed, mtp_layers=1)
    tensors, prefix, config = _mtp_as_hf_model(src, tmp_path / "mtp-as-hf")
    hf_mtp = transformers.AutoModelForCausalLM.from_pretrained(tmp_path / "mtp-as-hf", dtype=torch.float32).eval()
    hf_main = transformers.AutoModelForCausalLM.from_pretrained(src, dtype=torch.float32).eval()
    runner = ModelRunner(RunnerConfig(model=str(src), dtype="float32", page_size=4, num_pages=64,
                                      speculative_num_steps=2))
    length = random.randint(3, 17)
    tokens = [random.randrange(2, config["vocab_size"]) for _ in range(length)]
    prev_hidden = torch.randn(length, config["hidden_size"])
    eps = config["rms_norm_eps"]
    with torch.no_grad():
        emb = tensors["model.embed_tokens.weight"][torch.tensor(tokens)]
        fused = torch.cat([_rms(emb, tensors[prefix + "enorm.weight"], eps),
                           _rms(prev_hidden, tensors[prefix + "hnorm.weight"], eps)], dim=-1)
        fused = fused @ tensors[prefix + "eh_proj.weight"].T
        want = hf_mtp.model(inputs_embeds=fused[None]).last_hidden_state[0]
        target_want = hf_main.model(input_ids=torch.tensor([tokens])).last_hidden_state[0]

    pages = runner.kv_pool.alloc(runner.kv_pool.pages_for_tokens(length))
    whole = runner.draft([ExtendSeq(tokens, 0, pages)], prev_hidden)
    torch.testing.assert_close(whole, want, atol=2e-4, rtol=2e-4)
    stepwise = torch.cat([runner.draft([ExtendSeq([t], p, pages)], prev_hidden[p:p + 1])
                          for p, t in enumerate(tokens)])
    torch.testing.assert_close(stepwise, want, atol=2e-4, rtol=2e-4)
    cut = random.randint(1, length - 1)  # in two extend rounds, as chunked prefill runs it
    chunked = torch.cat([runner.draft([ExtendSeq(tokens[:cut], 0, pages)], prev_hidden[:cut]),
                         runner.draft([ExtendSeq(tokens[cut:], cut, pages)], prev_hidden[cut:])])
    torch.testing.assert_close(chunked, want, atol=2e-4, rtol=2e-4)
    torch.testing.assert_close(runner.extend_hidden([ExtendSeq(tokens, 0, pages)]), target_want, atol=2e-4, rtol=2e-4)
    # verify's forced absorbed MLA over a cached prefix gives the same hidden states as the policy's method
    split = length // 2
    torch.testing.assert_close(runner.extend_hidden([ExtendSeq(tokens[split:], split, pages)], force_mla=True),
                               target_want[split:], atol=2e-4, rtol=2e-4)
    runner.kv_pool.free(pages)
    # swapping the two halves of eh_proj's input (the V3 report's order) is not what the module computes
    wrong = torch.cat([_rms(prev_hidden, tensors[prefix + "hnorm.weight"], eps),
                       _rms(emb, tensors[prefix + "enorm.weight"], eps)], dim=-1) @ tensors[prefix + "eh_proj.weight"].T
    with torch.no_grad():
        assert not torch.allclose(hf_mtp.model(inputs_embeds=wrong[None]).last_hidden_state[0], whole, atol=1e-2)

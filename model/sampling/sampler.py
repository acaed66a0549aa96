"""Batched token sampling with per-request parameters and counter-based seeds, all on the device.

Order of operations per row (SGLang's, so a request samples the same way here and there):
1. penalties on the raw logits:
   - repetition (HF/CTRL rule: positive logits divided, negative multiplied) over tokens of the
     prompt AND the output so far, as vLLM and HF do;
   - frequency (`-= f * count`) and presence (`-= p * [count > 0]`) over the OUTPUT tokens only,
     as OpenAI, vLLM and SGLang define them;
2. greedy rows (temperature below 1e-6, as SGLang, or top_k 1) take the argmax of the penalised logits;
3. the rest: `softmax(logits / temperature)`, then in descending-probability order keep a token if
   - its rank < top_k (top_k -1/0 disables),
   - the mass strictly before it is <= top_p (so the most likely token always survives),
   - its probability >= min_p * the largest probability;
   all three measured on the same (untruncated) distribution, then renormalise and draw.
The logprob returned is the chosen token's under the penalised, temperature-scaled, untruncated
distribution (temperature 1 for greedy rows), as SGLang reports it by default; a row with
`top_logprobs_num` k > 0 also gets the k largest logprobs of that same distribution, from one
`topk` over the batch at its widest k (`sampling_ops.top_logprobs`; host layout in `sampled_host`).
`logits / temperature` is clamped to finite fp32, so
extreme but valid values (a repetition penalty near 0) never give NaN.

The draw is Gumbel-max over the kept tokens. A request with a seed takes its noise from a pure
function of (seed, step, token id) (`sampling_noise`), so its tokens depend only on its own seed
and step: never on the batch, its order, or the worker that samples the step (the prefill worker
draws step 0, the decode worker continues at step 1; no generator state travels). Requests without
a seed share the batch's fallback `torch.Generator`.

Pieces: `SamplingState` (per request, `sampling_state`), `SamplingBatch` (a decode batch's device
tables, `sampling_batch`), the tensor steps (`sampling_ops`). `Sampler.sample` is the one-off form.
"""
from __future__ import annotations

from dataclasses import dataclass, field
from typing import Sequence

import torch

from deepseek_pd.model.host_copy import upload
from deepseek_pd.model.sampling.batch import SampleOutput, SamplingBatch  # noqa: F401
from deepseek_pd.model.sampling.ops import penalise, truncation_mask  # noqa: F401
from deepseek_pd.model.sampling.params import SamplingParams  # noqa: F401
from deepseek_pd.model.sampling.state import SamplingState
# Stop conditions live in their own module; re-exported because callers think of them as sampling.
from deepseek_pd.model.sampling.stop_checker import Finish, IncrementalDetokenizer, StopChecker  # noqa: F401


def apply_penalties(logits: torch.Tensor, states: Sequence[SamplingState]) -> torch.Tensor:
    """Penalised logits of a one-off batch (a copy when any row is penalised, else `logits` itself)."""
    if not any(s.penalised for s in states):
        return logits
    vocab, device = logits.shape[1], logits.device
    zeros = torch.zeros(vocab, dtype=torch.float32, device=device)
    counts = torch.stack([s.output_counts if s.penalised else zeros for s in states])
    masks = [s.prompt_mask for s in states]
    prompt = None
    if any(m is not None for m in masks):
        no_prompt = torch.zeros(vocab, dtype=torch.bool, device=device)
        prompt = torch.stack([m if m is not None else no_prompt for m in masks])

    def column(name: str) -> torch.Tensor:
        return upload(torch.tensor([getattr(s.params, name) for s in states], dtype=torch.float32), device).unsqueeze(1)

    return penalise(logits, counts, prompt, column("repetition_penalty"), column("frequency_penalty"),
                    column("presence_penalty"))


@dataclass
class Sampler:
    """One-off batches: `sample(logits, states)` samples one token per state and advances them.

    For a batch that persists across steps use `SamplingBatch`, which keeps its tables on the
    device; this builds a temporary one per call.
    """

    fallback_generator: torch.Generator | None = field(default=None)

    def sample(self, logits: torch.Tensor, states: Sequence[SamplingState]) -> SampleOutput:
        if logits.dim() != 2 or logits.shape[0] != len(states):
            raise ValueError(f"logits {tuple(logits.shape)} do not match {len(states)} requests")
        batch = SamplingBatch(logits.shape[1], logits.device, self.fallback_generator)
        added: list[SamplingState] = []
        try:
            for state in states:
                batch.add(state)
                added.append(state)
            return batch.sample(logits)
        finally:
            batch.remove(added)  # writes each state's new step and counts back

"""`ExpertLoadRecorder`: how many tokens this rank's router sent to each routed expert, per MoE layer.

The statistics an expert-placement rebalancer (EPLB) plans from: with expert parallelism each rank
counts the top-k choices of its own tokens, in global expert ids, so the group's load of expert e
in MoE layer l is the sum of every rank's `counts[l, e]`, and the tokens a rank's experts compute
are the sum over its block of experts (model/distributed/parallel.py, ExpertPlacement).

Recording is one `index_add_` per MoE layer on the device (no host sync, so it does not stall the
forward); fused shared experts are not counted (every token uses them). Attach it before any CUDA
graph is captured (`ModelRunner.record_expert_load` refuses otherwise: replays would not record).

    recorder = runner.record_expert_load()
    ... forwards ...
    counts = recorder.snapshot()   # int64 [num_moe_layers, n_routed_experts] on the CPU
    recorder.dump().write("load.json")   # what `deepseek-pd eplb plan --dump` reads (model/eplb/)
    recorder.reset()

Ids are logical (the router's), counted once per token choice: with redundant experts the
recorder sees the ids before they are mapped to physical slots (model/moe/layer.py).
"""
from __future__ import annotations

import torch

from deepseek_pd.model.eplb.load_dump import ExpertLoadDump
from deepseek_pd.model.distributed.parallel import ParallelInfo


class ExpertLoadRecorder:
    def __init__(self, moe_layer_ids: tuple[int, ...], num_experts: int, device: torch.device | str) -> None:
        self.moe_layer_ids = moe_layer_ids  # row i counts the layer with id moe_layer_ids[i]
        self.num_experts = num_experts
        self.counts = torch.zeros(len(moe_layer_ids), num_experts, dtype=torch.int64, device=device)
        self._ones: torch.Tensor | None = None

    def record(self, row: int, topk_ids: torch.Tensor, counted: torch.Tensor | None = None) -> None:
        """Counts one MoE layer's top-k choices `[T, k]` (global routed-expert ids); `counted` `[T]`
        long, when given: 1 for a token that counts, 0 for one that does not (`ForwardBatch.counted_tokens`)."""
        flat = topk_ids.reshape(-1)
        if counted is not None:
            if counted.shape != topk_ids.shape[:1]:
                raise ValueError(f"counted_tokens {tuple(counted.shape)} for {topk_ids.shape[0]} tokens' choices")
            self.counts[row].index_add_(0, flat, counted.unsqueeze(1).expand_as(topk_ids).reshape(-1))
            return
        if self._ones is None or self._ones.numel() < flat.numel():
            self._ones = torch.ones(max(flat.numel(), 1024), dtype=torch.int64, device=self.counts.device)
        self.counts[row].index_add_(0, flat, self._ones[:flat.numel()])

    def snapshot(self) -> torch.Tensor:
        return self.counts.cpu()

    def reset(self) -> None:
        self.counts.zero_()

    def dump(self, group: ParallelInfo | None = None) -> ExpertLoadDump:
        """This rank's counts as a dump; with `group` (ep_size > 1) the sum over its ranks, which
        every rank of the group must then call together (one all-reduce)."""
        counts = self.counts.clone()
        if group is not None and group.ep_size > 1:
            import torch.distributed as dist
            dist.all_reduce(counts, op=dist.ReduceOp.SUM, group=group.group)
        rows = tuple(tuple(int(c) for c in row) for row in counts.cpu().tolist())
        return ExpertLoadDump(self.moe_layer_ids, rows)

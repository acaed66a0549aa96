"""`DeepseekMoE`: router gate, top-k selection, routed experts and shared experts of one layer.

The layer's ops (`gate`, `select_experts`, `experts`, `shared_experts`, ...) call these pieces;
dispatch/combine between them belong to the dispatcher, so EP slots in without touching this file.
The gate weight and `e_score_correction_bias` stay fp32 whatever the model dtype (as in HF).
With an expert location (redundant experts, a static placement) the router's logical ids become
physical slot ids at the end of `select_experts` (model/eplb/replica_dispatch.py); the load
recorder counts the logical ids before that, once per token choice whatever the replicas.
"""
from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from deepseek_pd.errors import UserError
from deepseek_pd.model import batch_invariant
from deepseek_pd.model.build_options import BuildOptions
from deepseek_pd.model.config import ModelConfig
from deepseek_pd.model.eplb.replica_dispatch import ReplicaDispatch
from deepseek_pd.model.quant.fp8_linear import fp8_spec
from deepseek_pd.model.moe.experts import FusedExperts
from deepseek_pd.model.moe.quant_method import moe_quant_method
from deepseek_pd.model.moe.mlp import GatedMLP
from deepseek_pd.model.moe.topk import SCORING, TOPK_METHODS, TopKSpec, finish_weights
from deepseek_pd.model.distributed.parallel import ExpertPlacement


class DeepseekMoE(nn.Module):
    def __init__(self, config: ModelConfig, options: BuildOptions, layer_id: int | None = None) -> None:
        super().__init__()
        fused = options.num_fused_shared_experts
        if fused not in (0, config.n_shared_experts):
            raise UserError(f"num_fused_shared_experts must be 0 or n_shared_experts={config.n_shared_experts}, "
                            f"got {fused}")
        self.num_routed = config.n_routed_experts
        self.num_fused_shared = fused
        # With EP this rank stacks only its block of routed expert slots (plus the replicated fused
        # shared ones); top-k still picks among all experts, in global ids.
        location = options.expert_location
        self.placement = ExpertPlacement(config.n_routed_experts, fused, options.parallel, location)
        if location is not None and layer_id is None:
            raise UserError("a MoE layer with an expert location needs its layer_id")
        self.to_physical = (None if location is None or location.is_identity else
                            ReplicaDispatch.for_layer(location, layer_id, options.parallel.ep_rank, options.device))
        self.gate_weight = nn.Parameter(torch.empty(config.n_routed_experts, config.hidden_size,
                                                    dtype=torch.float32, device=options.device))
        self.e_score_correction_bias = (
            nn.Parameter(torch.zeros(config.n_routed_experts, dtype=torch.float32, device=options.device))
            if config.topk_method == "noaux_tc" else None)
        self.score = SCORING[config.scoring_func]
        self.scoring_name = config.scoring_func
        self.choose = TOPK_METHODS[config.topk_method]
        self.topk_method = config.topk_method
        self.spec = TopKSpec(config.num_experts_per_tok, config.n_group, config.topk_group,
                             config.norm_topk_prob, config.routed_scaling_factor)
        fp8 = fp8_spec(config, options.fp8_backend)
        # FP8 experts are multiplied by the FP8 backend's kernel of the same name ("torch", "triton").
        self.experts = FusedExperts(self.placement.num_local_experts, config.hidden_size,
                                    config.moe_intermediate_size, options.moe_backend if fp8 is None else fp8.backend,
                                    moe_quant_method(fp8, config.moe_intermediate_size, options.dtype, options.device),
                                    options.small_batch_fusions)
        self.shared_experts = (
            GatedMLP(config.hidden_size, config.moe_intermediate_size * config.n_shared_experts,
                     options.dtype, options.device, fp8)
            if config.n_shared_experts and not fused else None)
        self._router_linear = batch_invariant.linear if options.deterministic else F.linear
        # Scoring + top-k + finish + fused shared ids in one launch (kernels/router_select.py); not
        # with an expert location (its replica map runs between top-k and the shared ids).
        self._fused_select = None
        if options.small_batch_fusions and self.to_physical is None:
            from deepseek_pd.model.kernels.checks import require_triton

            require_triton("small_batch_fusions")
            from deepseek_pd.model.kernels.router_select import router_select

            self._fused_select = router_select
        self.load_recorder = None  # (ExpertLoadRecorder, row) once recording is on (moe/expert_load.py)

    def router_logits(self, hidden: torch.Tensor) -> torch.Tensor:
        return self._router_linear(hidden.float(), self.gate_weight)

    def select_experts(self, router_logits: torch.Tensor,
                       counted: torch.Tensor | None = None) -> tuple[torch.Tensor, torch.Tensor]:
        """→ (weights fp32 `[T, k + fused]`, ids long `[T, k + fused]`: routed slot ids, then the
        fused shared experts'). `counted`: which tokens count in the expert load
        (`ForwardBatch.counted_tokens`)."""
        if self._fused_select is not None and self.load_recorder is None:
            spec = self.spec
            return self._fused_select(router_logits, self.e_score_correction_bias, self.topk_method,
                                      self.scoring_name, spec.top_k, spec.n_group, spec.topk_group,
                                      spec.norm_topk_prob, spec.routed_scaling_factor, self.num_fused_shared,
                                      self.placement.num_slots)
        weights, ids = self.choose(self.score(router_logits), self.e_score_correction_bias, self.spec)
        if self.load_recorder is not None:
            recorder, row = self.load_recorder
            recorder.record(row, ids, counted)
        weights = finish_weights(weights, self.spec)
        if self.to_physical is not None:
            ids = self.to_physical(ids)
        if self.num_fused_shared:
            n, device = router_logits.shape[0], router_logits.device
            first = self.placement.num_slots  # fused shared experts come after the routed slots
            shared_ids = torch.arange(first, first + self.num_fused_shared, device=device)
            ids = torch.cat([ids, shared_ids.expand(n, -1)], dim=1)
            weights = torch.cat([weights, weights.new_ones(n, self.num_fused_shared)], dim=1)
        return weights, ids

    def shared(self, hidden: torch.Tensor) -> torch.Tensor | None:
        return None if self.shared_experts is None else self.shared_experts(hidden)

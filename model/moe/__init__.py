"""DeepSeek MoE: top-k selection (`topk`), stacked experts + kernel registry (`experts`),
EP dispatcher registry (`dispatcher`) and the EP dispatchers that register into it (`ep_dispatcher`,
`deepep_dispatcher`), dense/shared MLP (`mlp`), the per-layer module (`layer`)."""
from deepseek_pd.model.moe.dispatcher import DISPATCHERS, CombineInput, DispatchOutput, LocalDispatcher
from deepseek_pd.model.moe import deepep_dispatcher, ep_dispatcher  # noqa: F401,E402  (register "deepep", "all_to_all")
from deepseek_pd.model.moe.experts import MOE_BACKENDS, FusedExperts, TorchMoEKernel
from deepseek_pd.model.moe import grouped_experts, triton_experts  # noqa: F401,E402  (register "grouped", "triton")
from deepseek_pd.model.moe import invariant_experts  # noqa: F401,E402  (registers "*_invariant")
from deepseek_pd.model.moe import deep_gemm_experts  # noqa: F401,E402  (registers "deep_gemm" where installed)
from deepseek_pd.model.moe.layer import DeepseekMoE
from deepseek_pd.model.moe.mlp import GatedMLP
from deepseek_pd.model.moe.topk import SCORING, TOPK_METHODS, TopKSpec, finish_weights

__all__ = ["DISPATCHERS", "MOE_BACKENDS", "SCORING", "TOPK_METHODS", "CombineInput", "DeepseekMoE",
           "DispatchOutput", "FusedExperts", "GatedMLP", "LocalDispatcher", "TopKSpec", "TorchMoEKernel",
           "finish_weights"]

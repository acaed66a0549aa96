"""GPU kernels (Triton), each in its own module beside a thin wrapper that checks its inputs.

    moe_align        pure torch, device-side: (token, expert) pairs sorted by expert and padded to
                     the GEMM's row block, with no host synchronisation.
    moe_align_small  the same sort in one Triton launch for decode-sized batches (<= 256 pairs).
    moe_align_large  the same sort in three Triton launches for any size (count, offsets, scatter).
    fused_moe        Triton grouped GEMMs over those blocks: gate+up with SiLU-and-mul, then down
                     with the routing weight; the k results of a token are summed in fp32.
                     Experts in the model dtype or block-scaled FP8 (the quantisation method).
    mla_decode       absorbed-MLA decode over the paged latent cache: one launch for the whole
                     batch, split-K over the sequence, then a log-sum-exp combine.
    flash_prefill    ragged flash attention (causal or over a prefix chunk) returning the lse.
    merge_states     the log-sum-exp merge of two partial attentions (chunked-prefix MHA).
    fp8_quant        per-token-group FP8 quantisation of activations (1 x 128, e4m3).
    fp8_gemm         block-scaled FP8 GEMM (W8A8, DeepSeek-V3's 128 x 128 weight blocks).
    checks           shared input checks (rank, dtype, device, unit last stride) and availability.

Integer arguments that change with the batch are `do_not_specialize` in their kernel's decorator
(token, pair and sequence counts, capacities, block and split counts, a page table's width, strides
that follow them). Why: Triton compiles a kernel once per class of each plain int argument (== 1,
divisible by 16, other), so a batch whose count falls in a class not seen yet compiles and loads
a new variant while serving: hundreds of ms, and the module load waits for the whole device, other
threads' copies included (tests/workers/prefill/test_chunk_send_order_cuda.py). Model-shape ints
and strides whose class never changes keep their specialisation (alignment helps vectorise);
tests/model/kernels/test_kernel_specialisation.py checks the rule by launching every step kernel's
wrapper at many batch sizes, and its GPU test that a warmed engine compiles nothing new.
Constexprs that follow the batch (MoE tiles and the sort's BLOCK_P, the decode combine's BLOCK_S)
are a few classes each: the warm-up (workers/engine/model_warm_up.py) runs them.

The oracles are the torch backends (`model/attention/torch_backend.py`, `model/moe/experts.py`,
`model/quant/moe_scales.py`) and `model/quant/fp8_ops.py`;
measured figures are in docs/performance.md. Importing this package does not import Triton; the
kernel modules do (the backends import them when built).
"""

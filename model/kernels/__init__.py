"""GPU kernels (Triton), each in its own module beside a thin wrapper that checks its inputs.

    moe_align        pure torch, device-side: (token, expert) pairs sorted by expert and padded to
                     the GEMM's row block, with no host synchronisation.
    moe_align_small  the same sort in one Triton launch for decode-sized batches (<= 256 pairs).
    fused_moe        Triton grouped GEMMs over those blocks: gate+up with SiLU-and-mul, then down
                     with the routing weight; the k results of a token are summed in fp32.
    mla_decode       absorbed-MLA decode over the paged latent cache: one launch for the whole
                     batch, split-K over the sequence, then a log-sum-exp combine.
    flash_prefill    ragged flash attention (causal or over a prefix chunk) returning the lse.
    checks           shared input checks (rank, dtype, device, unit last stride) and availability.

The oracles are the torch backends (`model/attention/torch_backend.py`, `model/moe/experts.py`);
measured figures are in docs/performance.md. Importing this package does not import Triton; the
kernel modules do (the backends import them when built).
"""

"""GPU kernels (Triton), each in its own module beside a thin wrapper that checks its inputs.

    moe_align     pure torch, device-side: (token, expert) pairs sorted by expert and padded to
                  the GEMM's row block, with no host synchronisation.
    fused_moe     Triton grouped GEMMs over those blocks: gate+up with SiLU-and-mul, then down
                  with the routing weight; the k results of a token are summed in fp32.
    mla_decode    Triton absorbed-MLA decode over the paged latent cache: one launch for the whole
                  batch, split-K over the sequence, then a log-sum-exp combine.

The oracles are the torch backends (`model/attention/torch_backend.py`, `model/moe/experts.py`).
Importing this package does not import Triton; the kernel modules do.
"""

"""The low-latency `all_to_all` layout on CUDA: captured by a CUDA graph over NCCL (world size 1, the
one GPU of the test machine) with host syncs made errors, its replays on fresh tokens equal eager
dispatch/combine. This is what `low_latency_cuda_graph_safe = True` claims."""
from __future__ import annotations

import datetime

import pytest
import torch

from deepseek_pd.ports import pick_free_ports
from deepseek_pd.model.distributed.dispatch_mode import DispatchConfig, DispatchMode
from deepseek_pd.model.forward_batch import ForwardMode
from deepseek_pd.model.moe.dispatcher import DISPATCHERS, CombineInput
from deepseek_pd.model.distributed.parallel import ExpertPlacement, ParallelInfo

pytestmark = [pytest.mark.gpu, pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device"),
              pytest.mark.timeout(180)]


def _moe_round(dispatcher, hidden, ids, weights, scale):
    """dispatch → "experts" (each row times its local expert's scale; masked rows 0) → combine."""
    received = dispatcher.dispatch_b(dispatcher.dispatch_a(hidden, ids, weights, ForwardMode.DECODE))
    local = received.topk_ids.clamp(min=0)  # [N, 1]
    out = received.hidden * scale[local] * (received.topk_ids >= 0) * received.topk_weights
    return dispatcher.combine_b(dispatcher.combine_a(CombineInput(out, received.handle)))


def test_low_latency_layout_is_captured_and_replays_like_eager():
    import torch.distributed as dist
    dist.init_process_group("nccl", init_method=f"tcp://127.0.0.1:{pick_free_ports(1)[0]}", rank=0, world_size=1,
                            timeout=datetime.timedelta(seconds=60), device_id=torch.device("cuda", 0))
    try:
        capacity, num_tokens, top_k, width = 16, 11, 3, 256
        placement = ExpertPlacement(num_routed=8, num_fused_shared=1, parallel=ParallelInfo.from_group())
        dispatcher = DISPATCHERS.build("all_to_all", placement, DispatchConfig(DispatchMode.LOW_LATENCY, capacity))
        scale = torch.rand(placement.num_local_experts, device="cuda") + 0.5  # world 1: local id = global id
        hidden = torch.randn(num_tokens, width, device="cuda")
        ids = torch.empty(num_tokens, top_k, dtype=torch.long, device="cuda")
        weights = torch.empty(num_tokens, top_k, device="cuda")

        def fresh():
            routed = torch.stack([torch.randperm(8, device="cuda")[:top_k - 1] for _ in range(num_tokens)])
            ids.copy_(torch.cat([routed, torch.full((num_tokens, 1), 8, device="cuda")], dim=1))  # + fused shared
            weights.copy_(torch.rand(num_tokens, top_k, device="cuda"))
            hidden.copy_(torch.randn(num_tokens, width, device="cuda"))

        fresh()
        side = torch.cuda.Stream()
        side.wait_stream(torch.cuda.current_stream())
        with torch.cuda.stream(side):
            _moe_round(dispatcher, hidden, ids, weights, scale)  # warm-up (NCCL communicator, allocator)
        torch.cuda.current_stream().wait_stream(side)
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph):  # a host sync inside a capture fails it; the debug mode names it
            torch.cuda.set_sync_debug_mode("error")
            try:
                captured_out = _moe_round(dispatcher, hidden, ids, weights, scale)
            finally:
                torch.cuda.set_sync_debug_mode("default")
        for _ in range(3):
            fresh()
            want = (hidden.unsqueeze(1) * (scale[ids] * weights).unsqueeze(-1)).sum(dim=1)  # [T, H]
            graph.replay()
            eager = _moe_round(dispatcher, hidden, ids, weights, scale)
            torch.testing.assert_close(captured_out, eager, rtol=1e-5, atol=1e-5)
            torch.testing.assert_close(captured_out, want, rtol=1e-4, atol=1e-4)
    finally:
        dist.destroy_process_group()

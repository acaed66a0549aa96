"""Expert parallelism over gloo on CPU: EP (normal and low-latency layouts), TBO and EP+TBO (dispatch
mode auto) equal the single-process model, and EP+TBO takes the path SGLang's rules give each step
(idle and one-sequence ranks included).

One `torch.multiprocessing.spawn` per world size (2 and 4) runs every case inside
(`ep_worker.run_rank`); each rank runs its own tokens and compares against the single-process
reference of the same tokens; the dispatchers' edge cases, the masked layout against an oracle and
the refusal of an over-capacity step run there too. Plus the in-process checks: bad EP sizes, the
dispatcher choice.
"""
from __future__ import annotations

import random

import pytest
import torch

from deepseek_pd.errors import UserError
from deepseek_pd.ports import pick_free_ports
from deepseek_pd.model.build_options import BuildOptions
from deepseek_pd.model.config import ModelConfig
from deepseek_pd.model.deepseek import DeepseekForCausalLM
from deepseek_pd.model.moe.dispatcher import DISPATCHERS
from deepseek_pd.model.distributed.parallel import ExpertPlacement, ParallelInfo
from deepseek_pd.model.runner_config import RunnerConfig
from pdtest.ep_worker import VARIANTS, expected_tbo_paths, run_rank
from pdtest.hf_oracle import TinyShape, build_hf_model

REL_TOL = 1e-5


def _rel_err(got: torch.Tensor, want: torch.Tensor) -> float:
    return ((got - want).abs().max() / want.abs().max()).item()


@pytest.mark.slow
@pytest.mark.timeout(170)
@pytest.mark.parametrize("world, fused, shape", [
    (2, 0, TinyShape(arch="v2", q_lora_rank=None, topk_method="group_limited_greedy", num_layers=3)),  # V2-Lite-like
    (4, 1, TinyShape(arch="v3", num_layers=3)),
], ids=["ep2-v2", "ep4-v3-fused-shared"])
def test_ep_and_tbo_equal_single_process(tmp_path, world, fused, shape):
    seed = random.randrange(1 << 20)
    hf = build_hf_model(shape, seed=seed)
    torch.save({"config": hf.config.to_dict(), "state": dict(hf.state_dict())}, tmp_path / "model.pt")
    hf.save_pretrained(tmp_path / "checkpoint")
    torch.multiprocessing.spawn(run_rank, args=(world, pick_free_ports(1)[0], str(tmp_path), seed, fused), nprocs=world,
                                join=True)
    for rank in range(world):
        results = torch.load(tmp_path / f"rank{rank}.pt")
        assert results.pop("tbo_micro_batches") == [0, 1], f"rank {rank}: TBO did not split under EP"
        # Idle and one-sequence ranks take part (no veto); one long prompt splits; one token does not.
        assert results.pop("tbo_paths") == expected_tbo_paths(rank, world), f"rank {rank}"
        assert results.pop("dispatcher_edges") <= REL_TOL, f"rank {rank}: empty/one-sided dispatch wrong"
        assert results.pop("dispatcher_edges_after_refusal") <= REL_TOL, f"rank {rank}: group out of step"
        assert results.pop("masked_layout"), f"seed {seed} rank {rank}: low-latency masked layout wrong"
        assert results.pop("over_capacity_refused"), f"rank {rank}: an over-capacity step was not refused"
        shards = results.pop("shards")
        assert shards and all(shards.values()), f"rank {rank}: expert shards wrong: {shards}"
        reference = results.pop("reference")
        for variant in VARIANTS:
            for case, want in reference.items():
                got = results[variant][case]
                assert got.shape == want.shape, (rank, variant, case)
                if not want.numel():
                    continue  # this rank was idle in this step
                err = _rel_err(got, want)
                assert err <= REL_TOL, f"seed {seed} rank {rank} {variant} {case}: rel err {err:.2e}"


def _tiny_config(n_routed: int = 8) -> ModelConfig:
    return ModelConfig.from_hf(TinyShape(arch="v3", num_layers=2, extra={"n_routed_experts": n_routed})
                               .hf_config().to_dict())


@pytest.mark.timeout(60)
@pytest.mark.parametrize("ep_size", [3, 5, 16])
def test_ep_size_not_dividing_the_experts_is_a_user_error(ep_size):
    options = BuildOptions(parallel=ParallelInfo(ep_size=ep_size, ep_rank=0), dispatcher="all_to_all")
    with pytest.raises(UserError, match=f"ep_size {ep_size} does not divide n_routed_experts 8"):
        DeepseekForCausalLM(_tiny_config(), options)


@pytest.mark.timeout(60)
def test_bad_parallel_settings_are_user_errors():
    with pytest.raises(UserError, match="ep_rank"):
        ParallelInfo(ep_size=2, ep_rank=2)
    with pytest.raises(UserError, match="ep_size"):
        ParallelInfo(ep_size=0)
    with pytest.raises(UserError, match="local dispatcher cannot serve ep_size 2"):
        DeepseekForCausalLM(_tiny_config(), BuildOptions(parallel=ParallelInfo(2, 1), dispatcher="local"))
    with pytest.raises(UserError, match="init_process_group"):  # no process group in this process
        DeepseekForCausalLM(_tiny_config(), BuildOptions(parallel=ParallelInfo(2, 1), dispatcher="all_to_all"))
    with pytest.raises(UserError, match="ep_size=2 but the process group passed in has 1"):
        RunnerConfig(ep_size=2).parallel_info(None)


def test_dispatcher_auto_and_registry():
    assert RunnerConfig().resolve_dispatcher() == "local"
    assert RunnerConfig(ep_size=4).resolve_dispatcher() == "all_to_all"  # CPU: never deepep
    assert {"local", "all_to_all"} <= set(DISPATCHERS.names())
    try:
        import deep_ep  # noqa: F401
    except ImportError:
        assert "deepep" not in DISPATCHERS.names()  # only offered where it can run


def test_expert_placement_maps_ids_like_the_docstring():
    placement = ExpertPlacement(num_routed=8, num_fused_shared=1, parallel=ParallelInfo(4, 2))
    ids = torch.tensor([[4, 5, 7, 8], [0, 3, 8, 6]])
    owner = placement.owner_rank(ids, source_rank=2)
    assert owner.tolist() == [[2, 2, 3, 2], [0, 1, 2, 3]]
    assert placement.to_local(ids, 2, owner).tolist() == [[0, 1, -1, 2], [-1, -1, 2, -1]]
    assert placement.to_local(ids, 3, owner).tolist() == [[-1, -1, 1, -1], [-1, -1, -1, 0]]

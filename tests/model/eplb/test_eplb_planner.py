"""The EPLB planner and its inputs: plans are valid placements (every expert placed, replicas on
distinct ranks, the right slot count), never less balanced than the trivial placement and clearly
more balanced on skewed loads, also when real tokens are routed through `ReplicaDispatch`; the
recorder's dump round-trips and sums over ranks; `deepseek-pd eplb plan` writes a file `serve`
accepts, and says what is wrong with bad input."""
from __future__ import annotations

import json
import random

import pytest
import torch

from deepseek_pd.cli import main
from deepseek_pd.errors import UserError
from deepseek_pd.model.config import ModelConfig
from deepseek_pd.model.eplb.expert_location import ExpertLocation, resolve_expert_location
from deepseek_pd.model.eplb.load_dump import ExpertLoadDump
from deepseek_pd.model.eplb.planner import imbalance, plan_layer, plan_location
from deepseek_pd.model.eplb.replica_dispatch import ReplicaDispatch
from deepseek_pd.model.checkpoint.model_dir import resolve_model_dir
from deepseek_pd.model.moe.expert_load import ExpertLoadRecorder

pytestmark = pytest.mark.timeout(60)


def _skewed_loads(rng: random.Random, n: int) -> list[int]:
    """Zipf-like loads in a random expert order: a few hot experts, a long cold tail."""
    loads = [int(1000 / (i + 1) ** 1.2) + rng.randrange(5) for i in range(n)]
    rng.shuffle(loads)
    return loads


def _trivial(n: int, redundant: int) -> list[int]:
    return [p % n for p in range(n + redundant)]


@pytest.mark.parametrize("trial", range(6))
def test_plans_are_valid_and_never_worse_than_trivial(trial):
    rng = random.Random()
    ep_size = rng.choice([1, 2, 4, 8])
    n = ep_size * rng.randint(1, 4)
    redundant = ep_size * rng.randint(0, 2)
    loads = [rng.randrange(0, 1000) if rng.random() < 0.8 else 0 for _ in range(n)]
    row = plan_layer(loads, ep_size, redundant)
    location = ExpertLocation(n, ep_size, (0,), (tuple(row),))  # validates: length, ids, every expert placed
    assert location.num_physical == n + redundant
    if redundant <= n * (ep_size - 1):
        for slots in location.replicas(0):  # replicas sit on distinct ranks
            assert len({location.rank_of_slot(s) for s in slots}) == len(slots)
    assert imbalance(row, loads, ep_size) <= imbalance(_trivial(n, redundant), loads, ep_size) + 1e-12


@pytest.mark.parametrize("ep_size, redundant", [(2, 0), (4, 4), (8, 8)])
def test_skewed_loads_get_clearly_more_balanced(ep_size, redundant):
    rng = random.Random()
    n = 32
    loads = _skewed_loads(rng, n)
    if rng.random() < 0.5:
        loads.sort(reverse=True)  # the hottest experts side by side: all in rank 0's block
    row = plan_layer(loads, ep_size, redundant)
    before, after = imbalance(_trivial(n, redundant), loads, ep_size), imbalance(row, loads, ep_size)
    assert after <= before
    if before > 1.05:  # a shuffled order can leave the trivial placement nearly balanced already
        assert after < 1 + 0.5 * (before - 1), (before, after)


def test_routed_tokens_are_more_balanced_across_ranks():
    """The planner's model (a replica carries load / replicas) against real routing: tokens drawn
    from skewed expert popularity, mapped to slots by ReplicaDispatch, counted per rank."""
    rng = random.Random()
    n, ep_size, redundant, top_k, tokens = 16, 4, 4, 2, 3000
    popularity = torch.tensor(_skewed_loads(rng, n), dtype=torch.float) + 1
    gen = torch.Generator().manual_seed(rng.randrange(1 << 30))
    ids = torch.multinomial(popularity.expand(tokens, -1), top_k, generator=gen)  # k distinct experts per token
    counts = torch.bincount(ids.reshape(-1), minlength=n).tolist()
    planned = plan_location([counts], (0,), ep_size, redundant)
    trivial = ExpertLocation(n, ep_size, (0,), (tuple(_trivial(n, redundant)),))

    def rank_imbalance(location: ExpertLocation) -> float:
        per_rank = torch.zeros(ep_size)
        for rank in range(ep_size):  # each rank routes its own quarter of the tokens
            mine = ids[rank::ep_size]
            slots = ReplicaDispatch.for_layer(location, 0, rank, "cpu")(mine).reshape(-1)
            per_rank += torch.bincount(slots // location.num_local_physical, minlength=ep_size).float()
        return (per_rank.max() / per_rank.mean()).item()

    before, after = rank_imbalance(trivial), rank_imbalance(planned)
    assert after < before and after < 1.15, (before, after)


def test_planner_refuses_impossible_requests():
    with pytest.raises(UserError, match="not divisible by ep_size 4"):
        plan_layer([1] * 8, 4, 2)
    with pytest.raises(UserError, match=">= 0"):
        plan_layer([1, -1], 1, 0)
    with pytest.raises(UserError, match="2 rows of expert loads for 3 MoE layers"):
        plan_location([[1, 2], [3, 4]], (1, 2, 3), 2, 0)


def test_recorder_dump_round_trips_and_sums(tmp_path):
    rng = random.Random()
    dumps = []
    for rank in range(3):
        recorder = ExpertLoadRecorder((1, 3), 8, "cpu")
        for row in (0, 1):
            recorder.record(row, torch.randint(0, 8, (rng.randint(0, 20), 2)))
        path = recorder.dump().write(tmp_path / f"rank{rank}.json")
        loaded = ExpertLoadDump.load(path)
        assert torch.equal(torch.tensor(loaded.logical_counts), recorder.snapshot())
        dumps.append(loaded)
    total = ExpertLoadDump.total(dumps)
    assert torch.equal(torch.tensor(total.logical_counts), sum(torch.tensor(d.logical_counts) for d in dumps))
    with pytest.raises(UserError, match="disagree"):
        ExpertLoadDump.total([dumps[0], ExpertLoadDump((1,), ((1,) * 8,))])


def test_cli_plans_a_file_serve_accepts(tmp_path, capsys):
    rng = random.Random()
    tiny = ModelConfig.from_hf(resolve_model_dir("tiny"))  # 8 experts, MoE layers 1, 2, 3
    layers = (1, 2, 3)
    paths = []
    for rank in range(2):
        dump = ExpertLoadDump(layers, tuple(tuple(_skewed_loads(rng, 8)) for _ in layers))
        paths += ["--dump", str(dump.write(tmp_path / f"rank{rank}.json"))]
    out = tmp_path / "placement.json"
    assert main(["eplb", "plan", *paths, "--ep-size", "2", "--redundant", "2", "-o", str(out)]) == 0
    printed = capsys.readouterr().out
    assert printed.count("max/mean rank load") == 3
    location = resolve_expert_location(tiny, 2, 2, str(out))
    assert location.moe_layer_ids == layers and location.num_physical == 10
    assert json.loads(out.read_text())["ep_size"] == 2


@pytest.mark.parametrize("content, message", [
    ("{oops", "not valid JSON"),
    ('{"moe_layer_ids": [1], "logical_counts": [[1, -2]]}', "non-negative integers"),
    ('{"counts": []}', "expected an expert-load dump"),
])
def test_cli_names_what_is_wrong(tmp_path, capsys, content, message):
    (tmp_path / "d.json").write_text(content)
    code = main(["eplb", "plan", "--dump", str(tmp_path / "d.json"), "--ep-size", "2", "-o", str(tmp_path / "p.json")])
    assert code == 2
    assert message in capsys.readouterr().err

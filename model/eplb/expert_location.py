"""`ExpertLocation`: which logical (router) expert each physical expert slot of each MoE layer holds.

With `ep_num_redundant_experts = R` the EP group holds `n_routed_experts + R` physical slots per MoE
layer, `(n_routed + R) / ep_size` per rank in contiguous blocks (rank r holds slots r*S..r*S+S-1,
model/distributed/parallel.py). `physical_to_logical[l][p]` names the logical expert slot p computes in MoE
layer l; a logical expert held by several slots is replicated (its weights copied into each), and
the router's logical top-k ids are mapped to one of its slots per token (replica_dispatch.py).

Example: 4 logical experts, R = 2, ep_size 2 (3 slots per rank), one MoE layer:
    physical_to_logical = [[2, 0, 1, 3, 2, 1]]
    rank 0 holds slots 0-2 = experts 2, 0, 1; rank 1 slots 3-5 = experts 3, 2, 1;
    experts 1 and 2 have two replicas each (on different ranks), 0 and 3 one.

The placement file (`--init-expert-location FILE`, written by `deepseek-pd eplb plan`) is JSON:
    {"physical_to_logical_map": [[...one row per MoE layer...]],
     "moe_layer_ids": [...], "num_logical_experts": N, "ep_size": W}     (the last three optional)
A file with one row per decoder layer (SGLang's layout: dense layers included) is accepted too;
the dense layers' rows are checked and ignored. Every way a file can be wrong is a UserError that
names the file, the layer and the slot.

Speculative decoding adds the MTP layer (model/speculative/mtp.py, layer id num_hidden_layers), a MoE
layer of its own over the same EP group, so the same slot count: it gets a row like any MoE layer
(last in `moe_layer_ids`), its loads are recorded and planned as its own row, and a file planned
without it (no MTP row) gives it the trivial row. A worker without the MTP layer ignores that row,
so one plan serves workers with and without speculation.

The identity (no file, R = 0) is `None` wherever an `ExpertLocation` is optional: the hot path
then maps nothing. Without a file but with R > 0, slot p holds expert p % n_routed (SGLang's
"trivial" placement).
"""
from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any, Sequence

from deepseek_pd.errors import UserError
from deepseek_pd.model.eplb.json_file import read_json
from deepseek_pd.model.speculative.mtp_names import mtp_layer_id

if TYPE_CHECKING:
    from deepseek_pd.model.config import ModelConfig

FORMAT = "deepseek-pd/expert-location/v1"


@dataclass(frozen=True)
class _Layers:
    num_hidden_layers: int


@dataclass(frozen=True)
class ExpertLocation:
    num_logical: int  # the router's experts (n_routed_experts)
    ep_size: int
    moe_layer_ids: tuple[int, ...]  # row i describes decoder layer moe_layer_ids[i]
    physical_to_logical: tuple[tuple[int, ...], ...]  # [MoE layer][physical slot] -> logical expert
    source: str = "<in-memory>"  # named in errors

    def __post_init__(self) -> None:
        where = self.source
        if self.num_logical < 1 or self.ep_size < 1:
            raise UserError(f"{where}: num_logical ({self.num_logical}) and ep_size ({self.ep_size}) must be >= 1")
        if len(self.physical_to_logical) != len(self.moe_layer_ids):
            raise UserError(f"{where}: {len(self.physical_to_logical)} rows for {len(self.moe_layer_ids)} MoE layers")
        if not self.physical_to_logical:
            return
        width = len(self.physical_to_logical[0])
        if width < self.num_logical:
            raise UserError(f"{where}: {width} physical slots per layer, fewer than the {self.num_logical} "
                            f"logical experts (n_routed_experts)")
        if width % self.ep_size:
            raise UserError(f"{where}: {width} physical expert slots per layer are not divisible by ep_size "
                            f"{self.ep_size}: every EP rank must hold the same number of slots")
        for layer_id, row in zip(self.moe_layer_ids, self.physical_to_logical):
            _check_row(row, width, self.num_logical, f"{where}: MoE layer {layer_id}")

    # ---- shape ---------------------------------------------------------------------------------
    @property
    def num_physical(self) -> int:
        return len(self.physical_to_logical[0]) if self.physical_to_logical else self.num_logical

    @property
    def num_redundant(self) -> int:
        return self.num_physical - self.num_logical

    @property
    def num_local_physical(self) -> int:
        return self.num_physical // self.ep_size

    @property
    def is_identity(self) -> bool:
        identity = tuple(range(self.num_logical))
        return all(row == identity for row in self.physical_to_logical)

    def row(self, layer_id: int) -> tuple[int, ...]:
        """physical slot -> logical expert of decoder layer `layer_id` (a MoE layer)."""
        try:
            return self.physical_to_logical[self.moe_layer_ids.index(layer_id)]
        except ValueError:
            raise KeyError(f"layer {layer_id} is not a MoE layer of this expert location") from None

    def replicas(self, layer_id: int) -> list[list[int]]:
        """logical expert -> its physical slots, ascending (every list non-empty)."""
        out: list[list[int]] = [[] for _ in range(self.num_logical)]
        for slot, logical in enumerate(self.row(layer_id)):
            out[logical].append(slot)
        return out

    def rank_of_slot(self, slot: int) -> int:
        return slot // self.num_local_physical

    # ---- construction --------------------------------------------------------------------------
    @classmethod
    def trivial(cls, num_logical: int, num_redundant: int, ep_size: int,
                moe_layer_ids: Sequence[int]) -> "ExpertLocation":
        """Slot p holds expert p % num_logical: experts 0..R-1 get a second replica."""
        if num_redundant < 0:
            raise UserError(f"ep_num_redundant_experts must be >= 0, got {num_redundant}")
        row = tuple(p % num_logical for p in range(num_logical + num_redundant))
        return cls(num_logical, ep_size, tuple(moe_layer_ids), tuple(row for _ in moe_layer_ids),
                   source=f"n_routed_experts {num_logical} + ep_num_redundant_experts {num_redundant}")

    @classmethod
    def from_json(cls, data: Any, *, num_logical: int, num_redundant: int, ep_size: int,
                  moe_layer_ids: Sequence[int], num_hidden_layers: int, source: str,
                  mtp_layer_id: int | None = None) -> "ExpertLocation":
        """A placement file's content, checked against the model and the worker's EP settings.

        `moe_layer_ids` are the decoder layers' MoE layers; `mtp_layer_id` the MTP layer's id when
        the worker builds it and it is a MoE layer (speculative decoding). Its row is the file's
        when the file has one (a plan from dumps recorded with speculation), else the trivial row;
        a file's MTP row is ignored by a worker without the MTP layer."""
        if not isinstance(data, dict) or "physical_to_logical_map" not in data:
            raise UserError(f"{source}: expected a JSON object with a 'physical_to_logical_map' list")
        rows = data["physical_to_logical_map"]
        if not isinstance(rows, list) or not all(isinstance(r, list) for r in rows):
            raise UserError(f"{source}: 'physical_to_logical_map' must be a list of lists (one per MoE layer)")
        main = tuple(moe_layer_ids)
        for key, want in (("num_logical_experts", num_logical), ("ep_size", ep_size)):
            if key in data and data[key] != want:
                raise UserError(f"{source}: planned for {key} {data[key]}, but this worker has {want}")
        by_layer = dict(zip(_file_layer_ids(data, rows, main, num_hidden_layers, num_logical, source), rows))
        want_width = num_logical + num_redundant
        if mtp_layer_id is not None and mtp_layer_id not in by_layer:  # planned without speculation
            by_layer[mtp_layer_id] = [p % num_logical for p in range(want_width)]
        layers = main + (() if mtp_layer_id is None else (mtp_layer_id,))
        for layer_id in layers:
            if len(by_layer[layer_id]) != want_width:
                raise UserError(f"{source}: MoE layer {layer_id} has {len(by_layer[layer_id])} physical slots; "
                                f"expected n_routed_experts {num_logical} + ep_num_redundant_experts "
                                f"{num_redundant} = {want_width}")
        return cls(num_logical, ep_size, layers, tuple(tuple(by_layer[i]) for i in layers), source=source)

    @classmethod
    def load(cls, path: str | Path, **model: Any) -> "ExpertLocation":
        """Reads and checks a placement file (`from_json`'s keyword arguments describe the model)."""
        return cls.from_json(read_json(path, "--init-expert-location"), source=str(path), **model)

    def to_json(self) -> dict[str, Any]:
        return {"format": FORMAT, "num_logical_experts": self.num_logical, "ep_size": self.ep_size,
                "moe_layer_ids": list(self.moe_layer_ids),
                "physical_to_logical_map": [list(row) for row in self.physical_to_logical]}


def _check_row(row: Any, width: int, num_logical: int, where: str) -> None:
    if not isinstance(row, (list, tuple)):
        raise UserError(f"{where}: expected a list of expert ids, got {type(row).__name__}")
    if len(row) != width:
        raise UserError(f"{where}: {len(row)} physical slots, other layers have {width}")
    for slot, logical in enumerate(row):
        if isinstance(logical, bool) or not isinstance(logical, int) or not 0 <= logical < num_logical:
            raise UserError(f"{where}, slot {slot}: {logical!r} is not a logical expert id in "
                            f"[0, {num_logical})")
    missing = sorted(set(range(num_logical)) - set(row))
    if missing:
        raise UserError(f"{where}: logical expert(s) {missing} have no physical slot (no replica)")


def _file_layer_ids(data: dict, rows: list, main: tuple[int, ...], num_hidden_layers: int,
                    num_logical: int, source: str) -> list[int | None]:
    """The MoE layer each row of a placement file describes (None: a dense layer's row, checked and
    ignored). The file's `moe_layer_ids` say it (our planner writes them: the decoder layers' MoE
    layers, then the MTP layer's when the dumps were recorded with speculation); without them the
    row count does: one per MoE layer, or SGLang's one per decoder layer (dense ones included),
    either with one more row for the MTP layer."""
    mtp = mtp_layer_id(_Layers(num_hidden_layers))
    if "moe_layer_ids" in data:
        ids = data["moe_layer_ids"]
        if ids not in (list(main), [*main, mtp]):
            raise UserError(f"{source}: planned for moe_layer_ids {ids}, but this worker has {list(main)} "
                            f"(and MTP layer {mtp} with speculative decoding)")
        if len(rows) != len(ids):
            raise UserError(f"{source}: {len(rows)} rows in physical_to_logical_map for moe_layer_ids {ids}")
        return list(ids)
    # SGLang's layout (a row per decoder layer) wins where the counts coincide (ours has no ids).
    if num_hidden_layers != len(main) and len(rows) in (num_hidden_layers, num_hidden_layers + 1):
        for layer_id, row in enumerate(rows):
            _check_row(row, len(rows[0]), num_logical, f"{source}: layer {layer_id}")
        return [i if i in main or i == mtp else None for i in range(len(rows))]
    if len(rows) in (len(main), len(main) + 1):
        return [*main, mtp][:len(rows)]
    raise UserError(f"{source}: {len(rows)} rows in physical_to_logical_map; the model has "
                    f"{len(main)} MoE layers ({num_hidden_layers} decoder layers), and one MTP layer "
                    "with speculative decoding")


def moe_layer_ids(config: "ModelConfig") -> tuple[int, ...]:
    """The decoder layers' MoE layers (the MTP layer's is `mtp_moe_layer_id`)."""
    return tuple(i for i in range(config.num_hidden_layers) if config.is_moe_layer(i))


def mtp_moe_layer_id(config: "ModelConfig", mtp: bool) -> int | None:
    """The MTP layer's id when the worker builds it (speculative decoding) and it is a MoE layer: it
    then has its own row in the placement, and its own in the expert-load dumps."""
    layer_id = mtp_layer_id(config)
    return layer_id if mtp and config.is_moe_layer(layer_id) else None


def resolve_expert_location(config: "ModelConfig", ep_size: int, num_redundant: int,
                            path: str | None, mtp: bool = False) -> ExpertLocation | None:
    """The location a worker runs with: the file's, else the trivial one for R > 0, else None.
    `mtp`: the worker builds the MTP layer (speculative decoding), whose MoE gets a row too."""
    if num_redundant < 0:
        raise UserError(f"ep_num_redundant_experts must be >= 0, got {num_redundant}")
    if path is None and num_redundant == 0:
        return None
    if config.n_routed_experts == 0:
        raise UserError("redundant experts / --init-expert-location need a MoE model (n_routed_experts is 0)")
    layers, mtp_layer = moe_layer_ids(config), mtp_moe_layer_id(config, mtp)
    if path is None:
        return ExpertLocation.trivial(config.n_routed_experts, num_redundant, ep_size,
                                      layers + (() if mtp_layer is None else (mtp_layer,)))
    return ExpertLocation.load(path, num_logical=config.n_routed_experts, num_redundant=num_redundant,
                               ep_size=ep_size, moe_layer_ids=layers, num_hidden_layers=config.num_hidden_layers,
                               mtp_layer_id=mtp_layer)

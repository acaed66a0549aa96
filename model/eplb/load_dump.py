"""`ExpertLoadDump`: the expert-load statistics a planner reads, as a JSON file.

What `ExpertLoadRecorder.dump()` (model/moe/expert_load.py) writes for one rank: per MoE layer,
how many of this rank's token choices went to each logical expert. With expert parallelism
every rank dumps its own tokens; the group's load is their sum (`ExpertLoadDump.total`), which is
what `deepseek-pd eplb plan --dump A --dump B ...` computes before it plans.

    {"format": "deepseek-pd/expert-load/v1", "moe_layer_ids": [1, 2],
     "logical_counts": [[12, 0, 7, 3], [4, 4, 9, 5]]}
"""
from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Sequence

from deepseek_pd.errors import UserError
from deepseek_pd.model.eplb.json_file import read_json

FORMAT = "deepseek-pd/expert-load/v1"


@dataclass(frozen=True)
class ExpertLoadDump:
    moe_layer_ids: tuple[int, ...]
    logical_counts: tuple[tuple[int, ...], ...]  # [MoE layer][logical expert] token choices

    def __post_init__(self) -> None:
        if len(self.moe_layer_ids) != len(self.logical_counts):
            raise UserError(f"expert-load dump: {len(self.logical_counts)} rows for "
                            f"{len(self.moe_layer_ids)} MoE layers")
        widths = {len(row) for row in self.logical_counts}
        if len(widths) > 1:
            raise UserError(f"expert-load dump: rows of different lengths {sorted(widths)}")
        for row in self.logical_counts:
            if any(isinstance(c, bool) or not isinstance(c, int) or c < 0 for c in row):
                raise UserError("expert-load dump: counts must be non-negative integers")

    @property
    def num_logical(self) -> int:
        return len(self.logical_counts[0]) if self.logical_counts else 0

    @classmethod
    def total(cls, dumps: Sequence["ExpertLoadDump"]) -> "ExpertLoadDump":
        """The sum of several ranks' dumps (same layers and experts)."""
        if not dumps:
            raise UserError("no expert-load dumps to add up")
        first = dumps[0]
        for other in dumps[1:]:
            if other.moe_layer_ids != first.moe_layer_ids or other.num_logical != first.num_logical:
                raise UserError(f"expert-load dumps disagree: layers {list(other.moe_layer_ids)} x "
                                f"{other.num_logical} experts vs {list(first.moe_layer_ids)} x {first.num_logical}")
        rows = tuple(tuple(sum(values) for values in zip(*(d.logical_counts[i] for d in dumps)))
                     for i in range(len(first.moe_layer_ids)))
        return cls(first.moe_layer_ids, rows)

    def to_json(self) -> dict[str, Any]:
        return {"format": FORMAT, "moe_layer_ids": list(self.moe_layer_ids),
                "logical_counts": [list(row) for row in self.logical_counts]}

    def write(self, path: str | Path) -> Path:
        file = Path(path)
        file.write_text(json.dumps(self.to_json()) + "\n")
        return file

    @classmethod
    def load(cls, path: str | Path) -> "ExpertLoadDump":
        file = Path(path)
        data = read_json(file, "expert-load dump")
        if not isinstance(data, dict) or not isinstance(data.get("logical_counts"), list) \
                or not isinstance(data.get("moe_layer_ids"), list):
            raise UserError(f"{file}: expected an expert-load dump (an object with moe_layer_ids and "
                            f"logical_counts lists)")
        try:
            return cls(tuple(data["moe_layer_ids"]), tuple(tuple(row) for row in data["logical_counts"]))
        except UserError as exc:
            raise UserError(f"{file}: {exc}") from None
        except TypeError:
            raise UserError(f"{file}: logical_counts must be a list of lists of integers") from None

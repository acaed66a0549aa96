"""`deepseek-pd eplb plan`: expert-load dumps → a balanced placement file for `serve --init-expert-location`.

    deepseek-pd eplb plan --dump rank0.json --dump rank1.json --ep-size 2 --redundant 2 -o placement.json

The dumps (model/eplb/load_dump.py, one per rank or already summed) are added up; the placement
(model/eplb/planner.py) is written as JSON, and one line per MoE layer shows the busiest rank's
expected load over the mean before (trivial placement) and after.
"""
from __future__ import annotations

import argparse


def register(subparsers: argparse._SubParsersAction) -> None:
    parser = subparsers.add_parser("eplb", help="expert-parallel load balancing: plan an expert placement",
                                   description=__doc__.splitlines()[0])
    actions = parser.add_subparsers(dest="eplb_action", required=True, metavar="ACTION")
    plan = actions.add_parser("plan", help="plan a placement from expert-load dumps",
                              description="Add up expert-load dumps and write a placement whose EP ranks "
                                          "carry balanced loads, replicating the hottest experts.")
    plan.add_argument("--dump", action="append", required=True, metavar="FILE",
                      help="an expert-load dump (repeatable: the dumps of every rank are added up)")
    plan.add_argument("--ep-size", type=int, required=True, help="EP ranks the placement is for")
    plan.add_argument("--redundant", type=int, default=0,
                      help="redundant expert slots (serve --ep-num-redundant-experts; default 0)")
    plan.add_argument("-o", "--output", required=True, help="placement JSON to write")
    plan.set_defaults(func=run_plan)


def run_plan(args: argparse.Namespace) -> int:
    import json
    from pathlib import Path

    from deepseek_pd.model.eplb.load_dump import ExpertLoadDump
    from deepseek_pd.model.eplb.planner import imbalance, plan_location

    load = ExpertLoadDump.total([ExpertLoadDump.load(path) for path in args.dump])
    location = plan_location(load.logical_counts, load.moe_layer_ids, args.ep_size, args.redundant)
    Path(args.output).write_text(json.dumps(location.to_json()) + "\n")
    trivial = [p % load.num_logical for p in range(location.num_physical)]
    for layer_id, loads in zip(load.moe_layer_ids, load.logical_counts):
        before, after = imbalance(trivial, loads, args.ep_size), imbalance(location.row(layer_id), loads, args.ep_size)
        print(f"layer {layer_id}: max/mean rank load {before:.3f} -> {after:.3f}")
    print(args.output)
    return 0

"""Expert-parallel load balancing (EPLB): where each logical expert's replicas live
(`expert_location`), how a token's logical top-k ids become physical slots (`replica_dispatch`),
the expert-load dump format (`load_dump`) and the planner that turns loads into a placement
(`planner`). Nothing here imports the model or the MoE package (model/distributed/parallel.py imports it)."""

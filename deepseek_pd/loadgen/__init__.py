"""`deepseek-pd bench serving`: workload generation, an open/closed-loop load runner, metrics and
the JSON/PNG report. Each module holds one of those; the command wires them together."""

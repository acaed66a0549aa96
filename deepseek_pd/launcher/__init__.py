"""Local process supervision for `deepseek-pd up`: free ports, worker and router processes, health.

`LocalCluster` (cluster.py) is the one entry point; `ManagedProcess` (process.py) owns one child
in its own process group so that stopping it stops everything it spawned.
"""

"""Where the installed Mooncake's TransferEngine really listens, against what the project assumes;
run by test_kv_transfer_mooncake.py inside a private network namespace (only loopback).

- ports: for each MC_MIN_RPC_PORT/MC_MAX_RPC_PORT setting drawn here (a valid two-port range, one
  Mooncake refuses), every port a real engine opens lies in `env.mooncake_rpc_ports()` read
  under the same setting. That range is what local port picks avoid (deepseek_pd/ports.py) and
  what the operator's CRD rule and NetworkPolicy treat as Mooncake's (operator/port_rules.py,
  build_network_policy.py). A two-port range forces the engine onto its max: Mooncake draws
  `min + rand % (max - min + 1)`, both ends included.
- addresses: the engine listens on the wildcard, whatever address it is given, and its handshake
  port answers a local address it was not given (127.0.0.2) with no credential: a Metadata
  request gets every registered buffer's address and length and the TCP data port. This is the
  documented exposure (docs/operations.md §8, `up`'s warning): if it fails, Mooncake learnt to
  bind the given address or to authenticate; bind engines to the address they advertise (or use
  the access control), and drop the warning.

Each engine runs in a child process: Mooncake reads its port range once, when it is imported.
Prints one line per check; exits non-zero on a failed one.
"""
from __future__ import annotations

import json
import os
import random
import subprocess
import sys

from deepseek_pd import env
from pdtest.mooncake_wire import ask_metadata

ADVERTISED = "127.0.0.1"
OTHER_LOCAL = "127.0.0.2"  # on lo too (127/8), but not the address the engine was given

CHILD = f"""
import ctypes, json
from mooncake.engine import TransferEngine

def listening():
    found = set()
    for table in ("/proc/net/tcp", "/proc/net/tcp6"):
        for line in open(table).read().splitlines()[1:]:
            fields = line.split()
            if fields[3] == "0A":  # LISTEN
                address, port = fields[1].rsplit(":", 1)
                found.add((address, int(port, 16)))
    return found

before = listening()
engine = TransferEngine()
status = engine.initialize({ADVERTISED!r}, "P2PHANDSHAKE", "tcp", "")
staging = ctypes.create_string_buffer(4096)  # stands for a registered staging
registered = status == 0 and engine.register_memory(ctypes.addressof(staging), 4096) == 0
print(json.dumps({{"status": status, "rpc_port": engine.get_rpc_port() if status == 0 else None,
                  "listening": sorted(listening() - before),
                  "registered": ctypes.addressof(staging) if registered else None}}), flush=True)
input()  # keeps the engine up until the parent has probed it
"""

WILDCARDS = {"00000000", "00000000000000000000000000000000"}  # 0.0.0.0 and :: as /proc/net/tcp* print them


def start_engine(setting: dict[str, str]) -> tuple[subprocess.Popen, dict]:
    """A child engine under `setting` (MC_* variables; an absent one unset), and what it reported."""
    child_env = {k: v for k, v in os.environ.items() if k not in ("MC_MIN_RPC_PORT", "MC_MAX_RPC_PORT")}
    child_env.update(setting)
    child = subprocess.Popen([sys.executable, "-c", CHILD], env=child_env, stdin=subprocess.PIPE,
                             stdout=subprocess.PIPE, stderr=subprocess.DEVNULL, text=True)
    line = child.stdout.readline()
    assert line, f"the engine child under {setting} died (rc {child.wait()})"
    return child, json.loads(line)


def project_range(setting: dict[str, str]) -> range:
    """`env.mooncake_rpc_ports()` read under `setting`."""
    saved = {name: os.environ.pop(name, None) for name in ("MC_MIN_RPC_PORT", "MC_MAX_RPC_PORT")}
    os.environ.update(setting)
    try:
        return env.mooncake_rpc_ports()
    finally:
        for name, value in saved.items():
            os.environ.pop(name, None)
            if value is not None:
                os.environ[name] = value


def settings(rng: random.Random) -> list[tuple[str, dict[str, str]]]:
    low = rng.randrange(20000, 30000)
    ephemeral, low_port = rng.randrange(33000, 60000), rng.randrange(100, 1023)
    refused = rng.choice([
        (ephemeral, ephemeral + 1),  # inside the ephemeral range Mooncake keeps out of
        (low_port, low_port + 1),  # below 1024
        (low + 1, low),  # inverted
        ("not-a-port", low + 1),  # atoi gives 0
    ])
    refused_setting = {"MC_MIN_RPC_PORT": str(refused[0]), "MC_MAX_RPC_PORT": str(refused[1])}
    return [("two ports", {"MC_MIN_RPC_PORT": str(low), "MC_MAX_RPC_PORT": str(low + 1)}),
            ("refused by Mooncake", refused_setting)]  # unset: netns_mooncake_transfer.py


def check(name: str, setting: dict[str, str]) -> None:
    child, report = start_engine(setting)
    try:
        assert report["status"] == 0, f"{name} {setting}: the engine did not start: {report}"
        ports = {port for _, port in report["listening"]}
        expected = project_range(setting)
        assert len(ports) >= 2 and ports <= set(expected), (
            f"{name} {setting}: the engine listens on {sorted(ports)}, outside the range the project "
            f"keeps for it, {expected.start}-{expected[-1]}")
        print(f"ports ok ({name}): {sorted(ports)} in {expected.start}-{expected[-1]}")
        addresses = {address for address, _ in report["listening"]}
        assert addresses <= WILDCARDS, f"{name}: listeners on {report['listening']}"
        segment = ask_metadata(OTHER_LOCAL, report["rpc_port"])
        assert report["registered"] and [b["addr"] for b in segment["buffers"]] == [report["registered"]], segment
        print(f"wildcard as documented ({name}): handshake port {report['rpc_port']} answers on {OTHER_LOCAL}, "
              f"handing a stranger the registered buffer and the data port {segment['tcp_data_port']}")
    finally:
        child.stdin.close()
        child.wait(timeout=30)


if __name__ == "__main__":
    rng = random.Random(int(sys.argv[1]))
    for name, setting in settings(rng):
        check(name, setting)
    print("engine ports ok")

"""Which protocol and RDMA devices Mooncake starts with: the one rule, decided once at start.

A pod asks for `--kv-protocol rdma` (the CR's `kvTransfer.protocol`), optionally naming HCAs
(`--kv-devices mlx5_0,mlx5_1`) and allowing a TCP fallback (`--kv-tcp-fallback`). What the pod
can actually use is what the kernel lists under /sys/class/infiniband *and* whose verbs device
node (/dev/infiniband/uverbsN) is present in the container: a pod without the RDMA device plugin
still sees sysfs, but not the device nodes.

    requested  named devices  usable here      result
    tcp        (none)         -                tcp
    tcp        mlx5_0         -                UserError (devices only apply to rdma)
    rdma       (none)         mlx5_0, mlx5_1   rdma on "" (Mooncake picks among all)
    rdma       mlx5_1         mlx5_0, mlx5_1   rdma on "mlx5_1"
    rdma       mlx5_7         mlx5_0           UserError (a named device is missing: a config error)
    rdma       any            none             tcp with a warning if fallback, else UserError

A fallback is per worker, so the two ends of a transfer may disagree; the decode side's
handshake names its protocol and the prefill side refuses a mismatch with a clear message
(kv_transfer/mooncake.py) rather than letting every write fail.

Each rank of a group runs its own TransferEngine. The named devices are split over a node's
local ranks (local rank i drives GPU i), in list order, so list them in GPU order
(`nvidia-smi topo -m`: the HCA nearest GPU i at position i). `devices_per_local_rank`: with n
devices and L local ranks, local rank i gets the devices at positions [i*n/L, (i+1)*n/L), at
least the one at floor(i*n/L):

    devices            local ranks  local rank 0      1            ...  7
    mlx5_0..mlx5_7     8            mlx5_0            mlx5_1            mlx5_7
    mlx5_0..mlx5_3     8            mlx5_0            mlx5_0            mlx5_3   (GPUs 2i, 2i+1 share HCA i)
    mlx5_0..mlx5_15    8            mlx5_0,mlx5_1     mlx5_2,mlx5_3     mlx5_14,mlx5_15
    (none)             any          ""                ""                ""       (Mooncake picks among all)

SGLang passes a plain `--disaggregation-ib-device` list whole to every rank and needs a JSON
{gpu: devices} map to pin them; here the list is the map, so eight ranks do not each open every
HCA of the node. tcp takes no devices: every rank gets "".
"""
from __future__ import annotations

import logging
from dataclasses import dataclass
from pathlib import Path

from deepseek_pd.errors import UserError

log = logging.getLogger(__name__)

SYSFS_ROOT = Path("/sys/class/infiniband")
DEV_ROOT = Path("/dev/infiniband")
PROTOCOLS = ("tcp", "rdma")


@dataclass(frozen=True)
class KVProtocolChoice:
    """What Mooncake's `TransferEngine.initialize` gets: protocol and device list ("" = all)."""

    protocol: str
    devices: str
    fell_back: bool = False


def usable_rdma_devices(sysfs_root: Path = SYSFS_ROOT, dev_root: Path = DEV_ROOT) -> tuple[str, ...]:
    """HCA names whose verbs device node is present in this container, sorted."""
    if not sysfs_root.is_dir():
        return ()
    usable = []
    for device in sorted(sysfs_root.iterdir()):
        verbs = device / "device" / "infiniband_verbs"
        nodes = [v.name for v in verbs.iterdir()] if verbs.is_dir() else []
        if any((dev_root / node).exists() for node in nodes):
            usable.append(device.name)
    return tuple(usable)


def parse_devices(text: str) -> tuple[str, ...]:
    """"mlx5_0, mlx5_1" -> ("mlx5_0", "mlx5_1"); empty items are refused."""
    if not text.strip():
        return ()
    names = tuple(item.strip() for item in text.split(","))
    if any(not name for name in names):
        raise UserError(f"--kv-devices {text!r}: an empty device name (use mlx5_0,mlx5_1)")
    return names


def choose_kv_protocol(requested: str, devices: tuple[str, ...], tcp_fallback: bool,
                       usable: tuple[str, ...]) -> KVProtocolChoice:
    """The table in the module docstring. `usable`: `usable_rdma_devices()` (a parameter so the
    rule is testable without hardware)."""
    if requested not in PROTOCOLS:
        raise UserError(f"--kv-protocol {requested!r}: choose tcp or rdma")
    if requested == "tcp":
        if devices:
            raise UserError(f"--kv-devices {','.join(devices)}: RDMA devices only apply to "
                            "--kv-protocol rdma")
        return KVProtocolChoice("tcp", "")
    if not usable:
        where = f"no RDMA device is usable here (none under {SYSFS_ROOT} with its verbs node in {DEV_ROOT})"
        if tcp_fallback:
            log.warning("KV transfer: rdma requested but %s; falling back to tcp (--kv-tcp-fallback). "
                        "Transfers will be much slower; check the pod's RDMA resource "
                        "(rdma.resourceName) and /dev/infiniband", where)
            return KVProtocolChoice("tcp", "", fell_back=True)
        raise UserError(f"--kv-protocol rdma: {where}. Give the pod the RDMA device plugin's resource "
                        "(rdma.resourceName) or host networking, use --kv-protocol tcp, or allow "
                        "--kv-tcp-fallback (kvTransfer.tcpFallback: true)")
    missing = [d for d in devices if d not in usable]
    if missing:
        raise UserError(f"--kv-devices: {', '.join(missing)} not usable here; usable RDMA devices: "
                        f"{', '.join(usable)}")
    log.info("KV transfer: mooncake over rdma on %s", ", ".join(devices) if devices else
             f"any of {', '.join(usable)}")
    return KVProtocolChoice("rdma", ",".join(devices))


def devices_per_local_rank(devices: str, local_ranks: int) -> tuple[str, ...]:
    """The device list (comma-separated, "" = all) each local rank's TransferEngine gets: the table
    in the module docstring."""
    if local_ranks < 1:
        raise ValueError(f"local_ranks must be >= 1, got {local_ranks}")
    names = parse_devices(devices)
    if not names:
        return ("",) * local_ranks
    n = len(names)
    shares = []
    for i in range(local_ranks):
        begin = i * n // local_ranks
        shares.append(",".join(names[begin:max((i + 1) * n // local_ranks, begin + 1)]))
    return tuple(shares)

"""kvTransfer (protocol, devices, TCP fallback) from the CR to Mooncake's TransportConfig.

Two halves of one path: the operator renders `serve` flags into the pod (checked on the built
StatefulSet), and `serve` resolves them against the RDMA devices the container can use (checked
with fake sysfs/dev trees, and on this machine, which has none).
"""
from __future__ import annotations

import logging
import random
from pathlib import Path

import pytest
import yaml

from deepseek_pd.cli import build_parser
from deepseek_pd.commands.serve import flags_from_args
from deepseek_pd.errors import UserError
from deepseek_pd.operator.build_workers import build_group_statefulset
from deepseek_pd.operator.spec import DeploymentSpec
from deepseek_pd.workers.transport.rdma_devices import (
    choose_kv_protocol, usable_rdma_devices)
from deepseek_pd.workers.serve.resolution import resolve_serve_config

EXAMPLES = Path(__file__).resolve().parents[3] / "examples"


def _fake_hcas(root: Path, present: dict[str, bool]) -> tuple[Path, Path]:
    """sysfs entries for each HCA; its /dev/infiniband node only where present[name]."""
    sysfs, dev = root / "sys", root / "dev"
    dev.mkdir(parents=True)
    for number, (name, has_node) in enumerate(present.items()):
        (sysfs / name / "device" / "infiniband_verbs" / f"uverbs{number}").mkdir(parents=True)
        if has_node:
            (dev / f"uverbs{number}").touch()
    return sysfs, dev


def test_usable_devices_are_those_with_a_verbs_node(tmp_path):
    present = {f"mlx5_{i}": random.random() < 0.5 for i in range(6)}
    sysfs, dev = _fake_hcas(tmp_path, present)
    assert usable_rdma_devices(sysfs, dev) == tuple(sorted(n for n, ok in present.items() if ok))
    assert usable_rdma_devices(tmp_path / "missing", dev) == ()


def test_the_protocol_rule():
    usable = ("mlx5_0", "mlx5_1")
    assert choose_kv_protocol("rdma", (), False, usable).protocol == "rdma"
    assert choose_kv_protocol("rdma", ("mlx5_1",), False, usable).devices == "mlx5_1"
    with pytest.raises(UserError, match="mlx5_7 not usable here; usable RDMA devices: mlx5_0, mlx5_1"):
        choose_kv_protocol("rdma", ("mlx5_7",), True, usable)  # a named device missing is a config error
    with pytest.raises(UserError, match="only apply to --kv-protocol rdma"):
        choose_kv_protocol("tcp", ("mlx5_0",), False, usable)
    with pytest.raises(UserError, match="no RDMA device is usable here.*--kv-tcp-fallback"):
        choose_kv_protocol("rdma", (), False, ())
    fallback = choose_kv_protocol("rdma", ("mlx5_0",), True, ())
    assert (fallback.protocol, fallback.devices, fallback.fell_back) == ("tcp", "", True)


def _serve(*argv: str):
    return resolve_serve_config(flags_from_args(build_parser().parse_args(
        ["serve", "decode", "--model", "tiny", "--device", "cpu", *argv])))


def test_serve_on_a_machine_without_rdma_refuses_or_falls_back_with_a_warning(caplog):
    if usable_rdma_devices():
        pytest.skip("this machine has RDMA devices")
    with pytest.raises(UserError, match="--kv-protocol rdma: no RDMA device is usable here"):
        _serve("--kv-transport", "mooncake", "--kv-protocol", "rdma")
    with caplog.at_level(logging.WARNING):
        config = _serve("--kv-transport", "mooncake", "--kv-protocol", "rdma", "--kv-devices", "mlx5_0",
                        "--kv-tcp-fallback")
    assert (config.worker.transport.mooncake_protocol, config.worker.transport.mooncake_device) == ("tcp", "")
    assert "falling back to tcp" in caplog.text
    with pytest.raises(UserError, match="configure Mooncake"):
        _serve("--kv-transport", "grpc", "--kv-protocol", "rdma")
    with pytest.raises(UserError, match="unknown --engine-opt .mooncake_protocol."):  # the flag owns it
        _serve("--kv-transport", "mooncake", "--engine-opt", "mooncake_protocol=rdma")


def _pod(kv: dict) -> dict:
    raw = yaml.safe_load((EXAMPLES / "deepseek-v3-h200.yaml").read_text())["spec"]
    raw["kvTransfer"] = kv
    spec = DeploymentSpec.parse("v3", "llm", raw)
    return build_group_statefulset(spec, random.choice(["prefill", "decode"]), 0)["spec"]["template"]["spec"]


@pytest.mark.parametrize("fallback", [False, True])
def test_the_rendered_pod_carries_the_cr_kv_transfer(fallback):
    devices = random.sample([f"mlx5_{i}" for i in range(8)], random.randint(1, 4))
    pod = _pod({"backend": "mooncake", "protocol": "rdma", "devices": devices, "tcpFallback": fallback})
    container = pod["containers"][0]
    args = container["args"]
    assert args[args.index("--kv-protocol") + 1] == "rdma"
    assert args[args.index("--kv-devices") + 1] == ",".join(devices)
    assert ("--kv-tcp-fallback" in args) is fallback
    env = {e["name"]: e.get("value") for e in container["env"]}
    assert env["MC_FORCE_TCP"] == "false"
    # The rendered argv is what `serve` accepts, and resolves to the same protocol and devices.
    parsed = flags_from_args(build_parser().parse_args(
        [a.replace("$(LWS_WORKER_INDEX)", "0").replace("$(LWS_LEADER_ADDRESS)", "x") for a in args]))
    assert (parsed.kv_protocol, parsed.kv_devices, parsed.kv_tcp_fallback) == ("rdma", ",".join(devices), fallback)
    chosen = choose_kv_protocol(parsed.kv_protocol, tuple(parsed.kv_devices.split(",")), parsed.kv_tcp_fallback,
                                tuple(f"mlx5_{i}" for i in range(8)))
    assert (chosen.protocol, chosen.devices) == ("rdma", ",".join(devices))


def test_tcp_and_grpc_render_no_rdma_flags():
    args = _pod({"backend": "mooncake", "protocol": "tcp"})["containers"][0]["args"]
    assert args[args.index("--kv-protocol") + 1] == "tcp" and "--kv-devices" not in args
    grpc = _pod({"backend": "grpc"})["containers"][0]
    assert "--kv-protocol" not in grpc["args"]
    assert "MC_FORCE_TCP" not in {e["name"] for e in grpc["env"]}


def _destination(protocol: str, page_bytes: int, layers: int, pool_pages: int):
    from deepseek_pd.proto import bootstrap_pb2 as pb
    return pb.MooncakeDestination(session_id="127.0.0.1:1", layer_base_addrs=[4096 * (i + 1) for i in range(layers)],
                                  page_bytes=page_bytes, pool_pages=pool_pages, protocol=protocol)


@pytest.mark.parametrize("decode_protocol", ["tcp", "rdma", ""])
def test_prefill_refuses_a_decode_engine_of_the_other_protocol(decode_protocol):
    """One side fell back to TCP and the other did not: the room fails with INVALID_ARGUMENT naming
    both protocols, before any write; an older peer (no protocol) is not checked."""
    from deepseek_pd.workers.engine.interface import FailureCode
    from deepseek_pd.workers.engine.request_failure import TransferError
    from deepseek_pd.workers.transport.mooncake_channel import check_destination
    rng = random.Random()
    page_bytes, layers, pool = rng.choice([576, 1152]), rng.randint(1, 4), rng.randint(8, 64)
    pages = rng.sample(range(pool), rng.randint(1, 8))
    for prefill_protocol in ("tcp", "rdma"):
        destination = _destination(decode_protocol, page_bytes, layers, pool)
        if decode_protocol in ("", prefill_protocol):
            check_destination(destination, pages, page_bytes, layers, prefill_protocol)
            continue
        with pytest.raises(TransferError) as raised:
            check_destination(destination, pages, page_bytes, layers, prefill_protocol)
        assert raised.value.code == FailureCode.INVALID_ARGUMENT
        assert decode_protocol in raised.value.message and prefill_protocol in raised.value.message


def test_prefill_refuses_pages_outside_the_decode_pool():
    from deepseek_pd.workers.engine.interface import FailureCode
    from deepseek_pd.workers.engine.request_failure import TransferError
    from deepseek_pd.workers.transport.mooncake_channel import check_destination
    pool = random.randint(8, 64)
    for pages in ([pool], [0, pool + random.randint(0, 9)], [1, 1]):
        with pytest.raises(TransferError) as raised:
            check_destination(_destination("tcp", 576, 2, pool), pages, 576, 2, "tcp")
        assert raised.value.code == FailureCode.INVALID_ARGUMENT


def test_a_windowed_destination_must_repeat_one_windows_slots_inside_the_staging():
    """A staging window of W slots: page i's slot is page_ids[i % W], all inside the staging, no slot
    twice within the window; anything else (a decode that would have two pages in flight in one
    slot) is refused before any write."""
    from deepseek_pd.workers.engine.interface import FailureCode
    from deepseek_pd.workers.engine.request_failure import TransferError
    from deepseek_pd.workers.transport.mooncake_channel import check_destination
    rng = random.Random()
    pool = rng.randint(8, 64)
    window = rng.randint(1, pool // 2)
    slots = rng.sample(range(pool), window)
    pages = [slots[i % window] for i in range(rng.randint(window + 1, 4 * window + 2))]
    destination = _destination("tcp", 576, 2, pool)
    destination.window_pages = window
    check_destination(destination, pages, 576, 2, "tcp")
    broken = list(pages)
    broken[rng.randrange(window, len(pages))] = rng.choice([s for s in range(pool) if s not in slots])
    for bad_window, bad_pages in ((window, broken), (len(pages), pages), (window, [pool] * len(pages))):
        destination.window_pages = bad_window
        with pytest.raises(TransferError) as raised:
            check_destination(destination, bad_pages, 576, 2, "tcp")
        assert raised.value.code == FailureCode.INVALID_ARGUMENT


@pytest.mark.parametrize("trial", range(20))
def test_devices_are_split_over_local_ranks_in_list_order(trial):
    """Local rank i gets the devices at [i*n/L, (i+1)*n/L), at least one: checked as properties
    (every device used, shares in list order, as even as they can be) on random n and L."""
    from deepseek_pd.workers.transport.rdma_devices import devices_per_local_rank
    rng = random.Random()
    n, ranks = rng.randint(1, 17), rng.choice([1, 2, 4, 8, rng.randint(1, 16)])
    names = [f"{rng.choice(['mlx5', 'ib', 'bnxt_re'])}_{i}" for i in rng.sample(range(64), n)]
    shares = [share.split(",") for share in devices_per_local_rank(",".join(names), ranks)]
    assert len(shares) == ranks and all(shares)
    if n >= ranks:  # a partition of the list, in order, shares of floor(n/L) or ceil(n/L)
        assert sum(shares, []) == names
        assert {len(s) for s in shares} <= {n // ranks, -(-n // ranks)}
    else:  # one each, consecutive ranks share a device, every device used by floor/ceil(L/n) ranks
        assert all(len(s) == 1 for s in shares)
        flat = [s[0] for s in shares]
        assert sorted(set(flat), key=names.index) == names and flat == sorted(flat, key=names.index)
        assert {flat.count(d) for d in names} <= {ranks // n, -(-ranks // n)}
    if n == ranks:
        assert [s[0] for s in shares] == names
    assert devices_per_local_rank("", ranks) == ("",) * ranks


def test_a_group_on_tcp_gives_every_rank_no_devices():
    from deepseek_pd.workers.serve.group_main import rank_config
    config = _serve("--kv-transport", "mooncake", "--kv-protocol", "tcp", "--dp", "2", "--ep", "2")
    assert [rank_config(config, r).worker.transport.mooncake_device for r in range(2)] == ["", ""]

"""Ports picked for local clusters lie below the kernel's ephemeral range, where no outgoing
connection can take them between the pick and the child's bind (a starting group opens many)."""
from __future__ import annotations

import random

from deepseek_pd import env
from deepseek_pd.ports import EPHEMERAL_RANGE, candidate_range, is_port_free, pick_free_port_blocks


def test_blocks_are_free_distinct_and_below_the_ephemeral_range() -> None:
    rng = random.Random()
    sizes = [rng.randint(1, 4) for _ in range(rng.randint(2, 8))]
    firsts = pick_free_port_blocks(sizes)
    ports = [first + offset for first, size in zip(firsts, sizes) for offset in range(size)]
    assert len(set(ports)) == len(ports)
    assert all(is_port_free(port) for port in ports)
    ephemeral_low, ephemeral_high = map(int, EPHEMERAL_RANGE.read_text().split()[:2])
    if candidate_range() is not None:  # this machine leaves room below its ephemeral range
        assert all(port < ephemeral_low for port in ports), (ports, ephemeral_low)
    else:
        assert all(ephemeral_low <= port <= ephemeral_high for port in ports)


def test_without_room_below_the_range_the_kernel_picks(monkeypatch, tmp_path) -> None:
    import deepseek_pd.ports as ports

    fake = tmp_path / "ip_local_port_range"
    fake.write_text(f"{ports.LOWEST_PORT + random.randrange(ports.MIN_ROOM)}\t60999\n")
    monkeypatch.setattr(ports, "EPHEMERAL_RANGE", fake)
    assert candidate_range() is None
    [first] = pick_free_port_blocks([2])
    assert is_port_free(first) and is_port_free(first + 1)


def test_blocks_never_touch_the_ports_mooncake_draws_from(monkeypatch) -> None:
    """Mooncake engines bind random ports in MC_MIN_RPC_PORT..MC_MAX_RPC_PORT: a picked port
    there can be taken before the child binds it. Half the candidates are put in that range here,
    so a picker that ignored it would land there in about half its draws."""
    candidates = candidate_range()
    if candidates is None:
        return  # the kernel picks, above the ephemeral start; Mooncake's default range is below it
    rng = random.Random()
    middle = (candidates.start + candidates.stop) // 2 + rng.randrange(-500, 500)
    low, high = middle - len(candidates) // 4, middle + len(candidates) // 4
    monkeypatch.setenv("MC_MIN_RPC_PORT", str(low))
    monkeypatch.setenv("MC_MAX_RPC_PORT", str(high))
    assert env.mooncake_rpc_ports() == range(low, high + 1)  # Mooncake draws its max too
    for _ in range(10):
        sizes = [rng.randint(1, 4) for _ in range(rng.randint(4, 10))]
        firsts = pick_free_port_blocks(sizes)
        assert all(first + size <= low or first > high for first, size in zip(firsts, sizes)), (firsts, low, high)


def test_mooncake_defaults_apply_without_its_variables(monkeypatch) -> None:
    monkeypatch.delenv("MC_MIN_RPC_PORT", raising=False)
    monkeypatch.setenv("MC_MAX_RPC_PORT", "not a port")
    assert env.mooncake_rpc_ports() == env.MOONCAKE_RPC_PORTS


def test_later_picks_never_repeat_a_port_handed_out_before(monkeypatch, tmp_path) -> None:
    """A picked port is released at once and bound by its child later, so the next pick of the
    same process must not hand it out again. 2,000 candidates and 400 one-port picks: without the
    memory of picks a repeat is all but certain (birthday bound, p > 0.99)."""
    import deepseek_pd.ports as ports

    fake = tmp_path / "ip_local_port_range"
    fake.write_text(f"{ports.LOWEST_PORT + ports.MIN_ROOM}\t60999\n")
    monkeypatch.setattr(ports, "EPHEMERAL_RANGE", fake)
    monkeypatch.setattr(ports, "_recent", {})
    picked = [port for _ in range(200) for port in pick_free_port_blocks([1, 1])]
    assert len(set(picked)) == len(picked), sorted(p for p in picked if picked.count(p) > 1)
    monkeypatch.setattr(ports, "RECENT_S", 0.0)  # the memory lapses: ports come back into the draw
    again = {port for _ in range(400) for port in pick_free_port_blocks([1])}
    assert again & set(picked)

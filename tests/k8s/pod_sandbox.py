"""A pod's sandbox for the process kubelet: its own network, mount and UTS namespaces, no image.

What a container runtime gives a pod, minus the image, made with util-linux and iproute2:

    PodNetwork     one Linux bridge on the host (10.<a>.<b>.1/24); the host reaches every pod
                   through it, and pods reach each other over it.
    Sandbox        a "pause" process (`unshare --net --mount --uts`, then `sleep`) that holds the
                   namespaces: a veth pair puts the pod on the bridge with its own IP, so every
                   pod may bind 0.0.0.0:30000 as it would on a cluster. Its root is an overlay of
                   the host's / (writes land in the pod's private tmpfs) with /proc, /sys, /dev,
                   /tmp, /work and /root shared with the host, and each volume bind-mounted at its
                   mountPath; /etc/hosts is a file the kubelet rewrites as pods and Services come
                   and go (cluster_hosts.py); /etc/resolv.conf names the node's DNS
                   server (cluster_dns.py).
    exec_argv()    the argv that runs a command inside the sandbox (`nsenter` into the pause
                   process's namespaces and root): containers, exec probes.

Needs root (CAP_SYS_ADMIN, CAP_NET_ADMIN); `sandbox_support()` says why not where it cannot run.
Every namespace dies with the pause process: killing it removes the veth and the mounts.
"""
from __future__ import annotations

import contextlib
import ipaddress
import os
import pathlib
import random
import shlex
import shutil
import subprocess
import sys
import time
from dataclasses import dataclass, field

# Host paths the pods see as on the host (writes go through): the tests' temp dirs, the checkout
# and its venv, the caches under $HOME (the tiny model). Everything else is copy-on-write.
SHARED_PATHS = ("/proc", "/sys", "/dev", "/tmp", "/work", "/root")
# The "image": the checkout and its venv, bound again after the pod's volumes, so that a volume
# over /tmp (the operator's writable /tmp for a read-only root) cannot hide a checkout under /tmp.
IMAGE_PATHS = tuple(dict.fromkeys((str(pathlib.Path(__file__).resolve().parents[2]),
                                   os.path.realpath(sys.prefix))))


def _run(*argv: str, check: bool = True) -> subprocess.CompletedProcess:
    out = subprocess.run(list(argv), capture_output=True, text=True, timeout=30)
    if check and out.returncode != 0:
        raise RuntimeError(f"{shlex.join(argv)} exited {out.returncode}: {out.stderr.strip()}")
    return out


def sandbox_support() -> str | None:
    """None when pods can be sandboxed here, else the reason (for a pytest skip)."""
    for tool in ("unshare", "nsenter", "ip", "mount"):
        if shutil.which(tool) is None:
            return f"{tool} is missing (util-linux, iproute2: scripts/system-deps.sh)"
    if os.geteuid() != 0:
        return "the process kubelet needs root (network and mount namespaces, a bridge)"
    probe = subprocess.run(["unshare", "--net", "--mount", "--uts", "true"], capture_output=True, timeout=30)
    if probe.returncode != 0:
        return f"unshare is not permitted here: {probe.stderr.decode().strip()}"
    return None


@dataclass
class PodNetwork:
    """The node's pod network: a bridge named `bridge` holding the gateway address .1/24."""

    bridge: str = ""
    subnet: ipaddress.IPv4Network | None = None
    _next: int = 2
    _free: list[str] = field(default_factory=list)

    @property
    def gateway(self) -> str:
        assert self.subnet is not None
        return str(self.subnet.network_address + 1)

    def create(self) -> "PodNetwork":
        used = _run("ip", "-4", "route", "show").stdout
        for _ in range(50):
            subnet = ipaddress.ip_network(f"10.{random.randrange(100, 250)}.{random.randrange(256)}.0/24")
            if str(subnet.network_address).rsplit(".", 1)[0] + "." not in used:
                break
        self.subnet = subnet
        self.bridge = f"pdkb{random.randrange(16**6):06x}"
        _run("ip", "link", "add", self.bridge, "type", "bridge")
        _run("ip", "addr", "add", f"{self.gateway}/24", "dev", self.bridge)
        _run("ip", "link", "set", self.bridge, "up")
        return self

    def allocate(self) -> str:
        """A pod address: a never-used one while the /24 has any, then the one released longest
        ago. As host-local IPAM does: a replaced pod that got its predecessor's address at once
        was unreachable from pods that had talked to the predecessor (their neighbour cache
        still held the dead veth's MAC) until that entry expired; the operator's token check of
        a replaced decode group timed out so (DEADLINE_EXCEEDED, ~20 s lost per replacement)."""
        assert self.subnet is not None
        if self._next <= 254:
            address = str(self.subnet.network_address + self._next)
            self._next += 1
            return address
        if self._free:
            return self._free.pop(0)
        raise RuntimeError(f"pod network {self.subnet} is full")

    def release(self, address: str) -> None:
        self._free.append(address)

    def delete(self) -> None:
        if self.bridge:
            _run("ip", "link", "del", self.bridge, check=False)
            self.bridge = ""


@dataclass(frozen=True)
class Mount:
    """`source` (a host path) appears at `target` inside the pod; `tmpfs` mounts a fresh one."""

    target: str
    source: str = ""
    read_only: bool = False
    tmpfs_size: str = ""  # non-empty: a tmpfs of this size instead of a bind mount


class Sandbox:
    """Started by `start()`, torn down by `stop()`; `ip` is the pod's address on the bridge."""

    def __init__(self, workdir: pathlib.Path, network: PodNetwork, hostname: str) -> None:
        self.workdir = workdir
        self.network = network
        self.hostname = hostname[:63]
        self.hosts_file = workdir / "hosts"
        self.resolv_file = workdir / "resolv.conf"
        self.ip = ""
        self.pause: subprocess.Popen | None = None

    def start(self, mounts: list[Mount], hosts: str, resolv: str) -> str:
        """Namespaces, root and mounts, then the network; returns the pod's IP."""
        self.workdir.mkdir(parents=True, exist_ok=True)
        self.hosts_file.write_text(hosts)
        self.resolv_file.write_text(resolv)
        root = self.workdir / "root"
        root.mkdir(exist_ok=True)
        script = self.workdir / "sandbox.sh"
        script.write_text(self._setup_script(root, mounts))
        ready = self.workdir / "ready"
        ready.unlink(missing_ok=True)
        self.pause = subprocess.Popen(
            ["unshare", "--net", "--mount", "--uts", "--propagation", "private", "sh", str(script)],
            stdin=subprocess.DEVNULL, stdout=open(self.workdir / "sandbox.log", "wb"),
            stderr=subprocess.STDOUT, start_new_session=True)
        deadline = time.monotonic() + 30
        while not ready.exists():
            if self.pause.poll() is not None:
                raise RuntimeError(f"pod sandbox setup failed:\n{(self.workdir / 'sandbox.log').read_text()[-2000:]}")
            if time.monotonic() > deadline:
                raise RuntimeError("pod sandbox setup took over 30 s")
            time.sleep(0.02)
        self._plug_network()
        return self.ip

    def _setup_script(self, root: pathlib.Path, mounts: list[Mount]) -> str:
        q = shlex.quote
        lines = ["set -e", f"hostname {q(self.hostname)}",
                 f"mount -t tmpfs -o size=2g pod {q(str(root))}",
                 f"mkdir -p {q(str(root))}/upper {q(str(root))}/work {q(str(root))}/merged"]
        merged = f"{root}/merged"
        lines.append(f"mount -t overlay pod -o lowerdir=/,upperdir={q(str(root))}/upper,"
                     f"workdir={q(str(root))}/work {q(merged)}")
        for path in SHARED_PATHS:
            if os.path.isdir(path):
                lines.append(f"mount --rbind {q(path)} {q(merged + path)}")
        for source, name in ((self.hosts_file, "/etc/hosts"), (self.resolv_file, "/etc/resolv.conf")):
            target = q(merged + os.path.realpath(name))
            lines.append(f"touch {target} && mount --bind {q(str(source))} {target}")
        for mount in mounts:
            # The root mirrors the host's, so its symlinks resolve as the host's do: /var/run/x
            # must become <root>/run/x, never the host's /run/x through an absolute link.
            target = q(merged + os.path.realpath(mount.target))
            if mount.tmpfs_size:
                lines += [f"mkdir -p {target}", f"mount -t tmpfs -o size={q(mount.tmpfs_size)} pod {target}"]
                continue
            if os.path.isdir(mount.source):
                lines.append(f"mkdir -p {target}")
            else:  # a file (subPath): bind it onto an empty file
                lines.append(f"mkdir -p \"$(dirname {target})\" && touch {target}")
            lines.append(f"mount --bind {q(mount.source)} {target}")
            if mount.read_only:
                lines.append(f"mount -o remount,bind,ro {target}")
        for path in IMAGE_PATHS:
            lines.append(f"mkdir -p {q(merged + path)} && mount --rbind {q(path)} {q(merged + path)}")
        lines.append(f"touch {q(str(self.workdir / 'ready'))}")
        lines.append(f"exec chroot {q(merged)} sleep infinity")
        return "\n".join(lines) + "\n"

    def _plug_network(self) -> None:
        assert self.pause is not None
        pid = str(self.pause.pid)
        self.ip = self.network.allocate()
        host_end = f"pdkv{random.randrange(16**8):08x}"[:15]
        _run("ip", "link", "add", host_end, "type", "veth", "peer", "name", "eth0", "netns", pid)
        _run("ip", "link", "set", host_end, "master", self.network.bridge, "up")
        inside = ["nsenter", "--target", pid, "--net", "ip"]
        _run(*inside, "link", "set", "lo", "up")
        _run(*inside, "addr", "add", f"{self.ip}/24", "dev", "eth0")
        _run(*inside, "link", "set", "eth0", "up")
        _run(*inside, "route", "add", "default", "via", self.network.gateway)

    def exec_argv(self, argv: list[str], working_dir: str = "/") -> list[str]:
        """`argv` run inside the pod: its namespaces, its root, `working_dir` there."""
        assert self.pause is not None
        return ["nsenter", "--target", str(self.pause.pid), "--net", "--mount", "--uts",
                "--root", f"--wdns={working_dir or '/'}", "--", *argv]

    def write_hosts(self, hosts: str) -> None:
        """Rewrites /etc/hosts in place: the bind mount follows the inode, not the name."""
        with open(self.hosts_file, "r+") as handle:
            if handle.read() == hosts:
                return
            handle.seek(0)
            handle.write(hosts)
            handle.truncate()

    def stop(self) -> None:
        if self.pause is not None:
            if self.pause.poll() is None:
                with contextlib.suppress(ProcessLookupError):
                    os.killpg(self.pause.pid, 9)
                self.pause.wait(timeout=10)
            self.pause = None
        if self.ip:
            self.network.release(self.ip)
            self.ip = ""

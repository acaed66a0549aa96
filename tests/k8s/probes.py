"""Container probes as a kubelet runs them: exec (inside the pod), httpGet, tcpSocket and grpc
(grpc.health.v1, to the pod IP from the node), with periodSeconds, timeoutSeconds,
initialDelaySeconds, successThreshold and failureThreshold.

`ProbeState.due()` says when the next attempt is due; the pod worker calls `run()` then and reads
`ok` (True after successThreshold successes in a row, False after failureThreshold failures, None
before either). Periods are capped by the kubelet's `period_cap_s`: a test
cannot wait 10 s per probe, and capping keeps each threshold's count of attempts intact.
"""
from __future__ import annotations

import http.client
import socket
import ssl
import subprocess
import time
from dataclasses import dataclass, field
from typing import Any, Callable

Obj = dict[str, Any]
GRPC_SERVING = 1


def resolve_port(port: int | str, container: Obj) -> int:
    """A probe's port: a number, or the name of one of the container's ports."""
    if isinstance(port, int) or str(port).isdigit():
        return int(port)
    for entry in container.get("ports") or []:
        if entry.get("name") == port:
            return int(entry["containerPort"])
    raise ValueError(f"probe port {port!r} names no port of container {container.get('name')!r}")


def _grpc_check(address: str, service: str, timeout: float) -> bool:
    import grpc

    def encode(text: str) -> bytes:  # HealthCheckRequest{service = 1}
        data = text.encode()
        return b"\x0a" + bytes([len(data)]) + data if data else b""

    with grpc.insecure_channel(address) as channel:
        check = channel.unary_unary("/grpc.health.v1.Health/Check",
                                    request_serializer=encode, response_deserializer=lambda raw: raw)
        raw = check(service, timeout=timeout)
    # HealthCheckResponse{status = 1 (enum)}: field 1 varint.
    return len(raw) >= 2 and raw[0] == 0x08 and raw[1] == GRPC_SERVING


def attempt(probe: Obj, container: Obj, pod_ip: str, exec_argv: Callable[[list[str]], list[str]],
            env: dict[str, str]) -> bool:
    """One probe attempt; any error counts as a failure, as a kubelet counts it."""
    timeout = float(probe.get("timeoutSeconds", 1))
    try:
        if "exec" in probe:
            done = subprocess.run(exec_argv(probe["exec"]["command"]), env=env, timeout=timeout,
                                  stdin=subprocess.DEVNULL, capture_output=True)
            return done.returncode == 0
        if "httpGet" in probe:
            get = probe["httpGet"]
            host, port = get.get("host") or pod_ip, resolve_port(get["port"], container)
            if get.get("scheme", "HTTP") == "HTTPS":
                conn = http.client.HTTPSConnection(host, port, timeout=timeout,
                                                   context=ssl._create_unverified_context())
            else:
                conn = http.client.HTTPConnection(host, port, timeout=timeout)
            headers = {h["name"]: h["value"] for h in get.get("httpHeaders") or []}
            try:
                conn.request("GET", get.get("path", "/"), headers=headers)
                return 200 <= conn.getresponse().status < 400
            finally:
                conn.close()
        if "tcpSocket" in probe:
            tcp = probe["tcpSocket"]
            port = resolve_port(tcp["port"], container)
            socket.create_connection((tcp.get("host") or pod_ip, port), timeout=timeout).close()
            return True
        if "grpc" in probe:
            rpc = probe["grpc"]
            return _grpc_check(f"{pod_ip}:{int(rpc['port'])}", rpc.get("service", ""), timeout)
    except Exception:  # noqa: BLE001 (a refused connection, a timeout, a bad answer: all failures)
        return False
    raise ValueError(f"probe has no handler: {sorted(probe)}")


@dataclass
class ProbeState:
    probe: Obj
    period_cap_s: float
    started_at: float = field(default_factory=time.monotonic)
    last_run: float = 0.0
    successes: int = 0
    failures: int = 0
    ok: bool | None = None

    def _capped(self, key: str, default: float) -> float:
        return min(float(self.probe.get(key, default)), self.period_cap_s)

    def due(self, now: float) -> bool:
        # The initial delay is kept: it covers a slow start the probe's thresholds do not.
        if now < self.started_at + float(self.probe.get("initialDelaySeconds", 0)):
            return False
        return now >= self.last_run + self._capped("periodSeconds", 10)

    def run(self, passed: bool, now: float) -> None:
        self.last_run = now
        if passed:
            self.successes, self.failures = self.successes + 1, 0
            if self.successes >= int(self.probe.get("successThreshold", 1)):
                self.ok = True
        else:
            self.successes, self.failures = 0, self.failures + 1
            if self.failures >= int(self.probe.get("failureThreshold", 3)):
                self.ok = False

"""The `kubernetes` Service for pods of the process kubelet: a TCP forwarder, what kube-proxy does
for the apiserver's ClusterIP.

The apiserver listens on 127.0.0.1 of the host, which a pod's network namespace cannot reach. The
kubelet listens on the node's bridge address, port 443, and copies bytes both ways to the
apiserver; pods get KUBERNETES_SERVICE_HOST=kubernetes.default.svc (in the serving certificate,
pki.py) mapped to that address in their /etc/hosts, so in-cluster clients (kopf's
login_with_service_account) verify TLS against the mounted ca.crt as on a cluster.
"""
from __future__ import annotations

import contextlib
import socket
import threading


class TcpForwarder:
    def __init__(self, listen: tuple[str, int], target: tuple[str, int]) -> None:
        self.listen = listen
        self.target = target
        self._server: socket.socket | None = None

    def start(self) -> "TcpForwarder":
        server = socket.socket()
        server.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        server.bind(self.listen)
        server.listen(64)
        self._server = server
        threading.Thread(target=self._accept, name="kubernetes-service", daemon=True).start()
        return self

    def _accept(self) -> None:
        assert self._server is not None
        while True:
            try:
                client, _ = self._server.accept()
            except OSError:
                return  # closed by stop()
            try:
                upstream = socket.create_connection(self.target, timeout=5)
            except OSError:
                client.close()
                continue
            upstream.settimeout(None)
            for source, sink in ((client, upstream), (upstream, client)):
                threading.Thread(target=self._pump, args=(source, sink), daemon=True).start()

    @staticmethod
    def _pump(source: socket.socket, sink: socket.socket) -> None:
        try:
            while data := source.recv(65536):
                sink.sendall(data)
        except OSError:
            pass
        finally:
            for sock in (source, sink):
                with contextlib.suppress(OSError):
                    sock.shutdown(socket.SHUT_RDWR)
                sock.close()

    def stop(self) -> None:
        if self._server is not None:
            self._server.close()
            self._server = None

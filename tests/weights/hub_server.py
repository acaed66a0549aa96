"""A local stand-in for the Hugging Face Hub, serving one directory as a model repository.

It answers what huggingface_hub asks when HF_ENDPOINT (or `endpoint=`) points here:
    GET  /api/models/{repo}/revision/{rev}        {"id", "sha", "siblings"}
    GET  /api/models/{repo}/tree/{rev}?recursive  [{"type": "file", "path", "size", "oid", "lfs"?}]
    GET|HEAD /{repo}/resolve/{rev}/{file}         the bytes; ETag, X-Repo-Commit, Content-Length,
                                                  Accept-Ranges; `Range: bytes=N-` answers 206
Weight files (*.safetensors) are listed as LFS (sha256 in `lfs.oid`), the rest as plain git blobs
(`oid` = git blob sha1), as the Hub does. Faults for tests:
- `token`: requests must carry `Authorization: Bearer <token>`; others get `refuse_status`
  (401 "Invalid credentials in Authorization header", or 403) as the Hub answers them;
- `cut[file] = n`: the next GET of `file` sends its headers and `n` bytes, then drops the connection;
- `outage_after_cut`: after a cut, every request for that file answers 503 until `heal()`.
Every request is recorded in `requests` as (method, path, Range header or None).
"""
from __future__ import annotations

import hashlib
import json
import threading
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path
from urllib.parse import unquote, urlsplit

COMMIT = "0123456789abcdef0123456789abcdef01234567"


def git_blob_sha1(data: bytes) -> str:
    return hashlib.sha1(b"blob %d\0" % len(data) + data).hexdigest()


class FakeHub:
    def __init__(self, repo: str, directory: Path, token: str | None = None, refuse_status: int = 401) -> None:
        self.repo = repo
        self.files = {p.relative_to(directory).as_posix(): p.read_bytes()
                      for p in sorted(directory.rglob("*")) if p.is_file()}
        self.token = token
        self.refuse_status = refuse_status
        self.cut: dict[str, int] = {}
        self.outage_after_cut = False
        self._outage: set[str] = set()
        self.requests: list[tuple[str, str, str | None]] = []
        self.lock = threading.Lock()
        self.server = ThreadingHTTPServer(("127.0.0.1", 0), _handler(self))
        self.server.daemon_threads = True
        self.thread = threading.Thread(target=self.server.serve_forever, daemon=True)

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.server.server_address[1]}"

    def __enter__(self) -> "FakeHub":
        self.thread.start()
        return self

    def __exit__(self, *exc) -> None:
        self.server.shutdown()
        self.server.server_close()

    def heal(self) -> None:
        with self.lock:
            self._outage.clear()

    def tree(self) -> list[dict]:
        out = []
        for path, data in self.files.items():
            entry = {"type": "file", "path": path, "size": len(data), "oid": git_blob_sha1(data)}
            if path.endswith(".safetensors"):
                entry["lfs"] = {"oid": hashlib.sha256(data).hexdigest(), "size": len(data), "pointerSize": 134}
            out.append(entry)
        return out

    def ranges(self, file: str) -> list[str | None]:
        """Range headers of the GETs of `file`, in order."""
        suffix = f"/resolve/{COMMIT}/{file}"
        return [r for m, p, r in self.requests if m == "GET" and p.endswith(suffix)]


def _handler(hub: FakeHub) -> type[BaseHTTPRequestHandler]:
    class Handler(BaseHTTPRequestHandler):
        protocol_version = "HTTP/1.1"

        def log_message(self, *args) -> None:  # quiet test output
            pass

        def do_HEAD(self) -> None:
            self._serve(head=True)

        def do_GET(self) -> None:
            self._serve(head=False)

        def _json(self, status: int, body, headers: dict | None = None) -> None:
            data = json.dumps(body).encode()
            self.send_response(status)
            self.send_header("Content-Type", "application/json")
            self.send_header("Content-Length", str(len(data)))
            for key, value in (headers or {}).items():
                self.send_header(key, value)
            self.end_headers()
            self.wfile.write(data)

        def _serve(self, head: bool) -> None:
            path = unquote(urlsplit(self.path).path)
            with hub.lock:
                hub.requests.append((self.command, path, self.headers.get("Range")))
            if hub.token is not None and self.headers.get("Authorization") != f"Bearer {hub.token}":
                message = ("Invalid credentials in Authorization header" if hub.refuse_status == 401
                           else "Access to model is restricted")
                return self._json(hub.refuse_status, {"error": message})
            api = f"/api/models/{hub.repo}/"
            if path.startswith(api + "revision/"):
                return self._json(200, {"id": hub.repo, "sha": COMMIT,
                                        "siblings": [{"rfilename": f} for f in hub.files]})
            if path.startswith(api + "tree/"):
                return self._json(200, hub.tree())
            prefix = f"/{hub.repo}/resolve/"
            if not path.startswith(prefix):
                return self._json(404, {"error": "Repository not found"}, {"X-Error-Code": "RepoNotFound"})
            revision, _, file = path[len(prefix):].partition("/")
            if revision not in (COMMIT, "main") or file not in hub.files:
                return self._json(404, {"error": "Entry not found"}, {"X-Error-Code": "EntryNotFound"})
            with hub.lock:
                if file in hub._outage:
                    return self._json(503, {"error": "Service Unavailable"})
                cut = None if head else hub.cut.pop(file, None)
                if cut is not None and hub.outage_after_cut:
                    hub._outage.add(file)
            self._send_file(hub.files[file], head, cut)

        def _send_file(self, data: bytes, head: bool, cut: int | None) -> None:
            start = 0
            header = self.headers.get("Range")
            if header and header.startswith("bytes="):
                start = int(header[len("bytes="):].split("-")[0])
            body = data[start:]
            self.send_response(206 if start else 200)
            self.send_header("Content-Length", str(len(body)))
            self.send_header("Accept-Ranges", "bytes")
            self.send_header("ETag", f'"{hashlib.sha256(data).hexdigest()}"')
            self.send_header("X-Repo-Commit", COMMIT)
            if start:
                self.send_header("Content-Range", f"bytes {start}-{len(data) - 1}/{len(data)}")
            self.end_headers()
            if head:
                return
            if cut is None:
                self.wfile.write(body)
                return
            self.wfile.write(body[:cut])
            self.wfile.flush()
            self.close_connection = True
            self.connection.shutdown(2)  # the connection dies mid-body

    return Handler

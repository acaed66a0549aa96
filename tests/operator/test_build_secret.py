"""The deployment secret's Secret: random per deployment, and readable by `serve` once mounted."""
from __future__ import annotations

import base64
import os

from deepseek_pd.operator.build_secret import build_internal_secret, internal_secret_mount
from deepseek_pd.workers.transport.internal_auth import InternalAuth, SECRET_FILE_ENV


def test_secret_is_random_and_mounts_where_serve_reads_it(tmp_path):
    first, second = build_internal_secret("v3", "llm"), build_internal_secret("v3", "llm")
    raw = base64.b64decode(first["data"]["internal.secret"])
    assert len(raw) == 64 and raw != base64.b64decode(second["data"]["internal.secret"])
    volume, mount, env = internal_secret_mount("v3")
    assert volume["secret"]["secretName"] == first["metadata"]["name"]
    assert mount["readOnly"] and volume["secret"]["defaultMode"] == 0o400
    assert env["name"] == SECRET_FILE_ENV and env["value"].startswith(mount["mountPath"] + "/")
    # What the kubelet would write: the key as a file of the mounted volume, mode 0400.
    path = tmp_path / os.path.basename(env["value"])
    path.write_bytes(raw)
    path.chmod(0o400)
    assert InternalAuth.from_file(path).secret == raw

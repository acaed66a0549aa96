"""The deployment secret's Secret and how worker pods mount it (workers/transport/internal_auth.py).

The operator creates the Secret once per DeepSeekDeployment (random bytes, never overwritten by a
reconcile: a new value is a rotation, docs/operations.md) and mounts it read-only into every
worker pod; `DEEPSEEK_PD_INTERNAL_SECRET_FILE` tells `deepseek-pd serve` where it is.
"""
from __future__ import annotations

import base64
import secrets
from typing import Any

from deepseek_pd import env
from deepseek_pd.operator import names

SECRET_KEY = "internal.secret"
# Not under /etc/deepseek-pd: that is the read-only ConfigMap mount, and the runtime cannot create
# a mount point inside it.
MOUNT_DIR = "/var/run/secrets/deepseek-pd"
SECRET_FILE_ENV = env.INTERNAL_SECRET_FILE  # what `serve` reads when it has no --internal-secret-file


def internal_secret_name(deployment: str) -> str:
    return f"{deployment}-internal"


def build_internal_secret(deployment: str, namespace: str, value: bytes | None = None) -> dict[str, Any]:
    """The Secret holding 32 random bytes (hex), created once; `value` for tests."""
    value = value if value is not None else secrets.token_hex(32).encode()
    return {
        "apiVersion": "v1",
        "kind": "Secret",
        "type": "Opaque",
        "metadata": {"name": internal_secret_name(deployment), "namespace": namespace,
                     "labels": names.base_labels(deployment, "internal")},
        "data": {SECRET_KEY: base64.b64encode(value).decode()},
    }


def internal_secret_mount(deployment: str) -> tuple[dict[str, Any], dict[str, Any], dict[str, Any]]:
    """(volume, volumeMount, env var) that give a worker container the secret, read-only, mode 0400."""
    volume = {"name": "internal-secret",
              "secret": {"secretName": internal_secret_name(deployment), "defaultMode": 0o400}}
    mount = {"name": "internal-secret", "mountPath": MOUNT_DIR, "readOnly": True}
    env = {"name": SECRET_FILE_ENV, "value": f"{MOUNT_DIR}/{SECRET_KEY}"}
    return volume, mount, env

"""DeepSeekDeployment specs with a huggingFace model source, drawn at random, for the operator,
Kubernetes and weights tests (examples/cpu-minimal.yaml with its model source replaced)."""
from __future__ import annotations

import pathlib
import random
from typing import Any

import yaml

EXAMPLES = pathlib.Path(__file__).resolve().parents[3] / "examples"
CACHE_KINDS = ("emptyDir", "claimName", "size", "hostPath")


def _word(rng: random.Random, n: int = 6) -> str:
    return "".join(rng.choice("abcdefghijklmnopqrstuvwxyz0123456789") for _ in range(n))


def hub_spec(rng: random.Random, cache_kind: str, *, endpoint: str | None = None,
             token: bool = True, example: str = "cpu-minimal.yaml") -> dict[str, Any]:
    """A raw spec: a random repo, revision and token Secret, the cache of `cache_kind`."""
    raw = yaml.safe_load((EXAMPLES / example).read_text())["spec"]
    hf: dict[str, Any] = {"id": f"org-{_word(rng)}/Model.{_word(rng, 4)}_v{rng.randrange(9)}",
                          "revision": rng.choice(["main", f"v{rng.randrange(9)}.{rng.randrange(9)}",
                                                  "refs/pr/" + str(rng.randrange(1, 99)),
                                                  "%040x" % rng.getrandbits(160)])}
    if token:
        hf["tokenSecret"] = f"hf-{_word(rng)}"
        if rng.random() < 0.5:
            hf["tokenSecretKey"] = f"key_{_word(rng, 3)}"
    if endpoint:
        hf["endpoint"] = endpoint
    cache: dict[str, Any] = {}
    if cache_kind == "claimName":
        cache["claimName"] = f"weights-{_word(rng)}"
    elif cache_kind == "size":
        cache["size"] = f"{rng.randrange(1, 900)}Gi"
        if rng.random() < 0.5:
            cache["storageClassName"] = f"fast-{_word(rng, 3)}"
        cache["accessMode"] = rng.choice(["ReadWriteMany", "ReadWriteOnce"])
    elif cache_kind == "hostPath":
        cache["hostPath"] = f"/var/cache/{_word(rng)}"
    elif rng.random() < 0.5:
        cache["sizeLimit"] = f"{rng.randrange(1, 900)}Gi"
    raw["model"] = {"source": {"huggingFace": hf}, "servedName": raw["model"]["servedName"]}
    if cache:
        raw["model"]["cache"] = cache
    return raw

"""The schemas of third-party CRDs (ServiceMonitor), checked in-process as the API server
checks a custom resource: the fast path for unit tests that cannot hold a real kube-apiserver.

    schemas = third_party_schemas()        the CRDs scripts/fetch-third-party-crds.sh pins
    schemas.knows(obj)                     its apiVersion/kind comes from one of those CRDs
    schemas.validate(obj)                  raises CrdViolation naming every bad field

The CRD files are the very ones tests/k8s installs into the real kube-apiserver, and
tests/k8s/test_third_party_crds.py holds this check to the server's own verdict on the same
objects. What it mirrors of a structural schema: strict unknown fields (every object with
`properties` and no `x-kubernetes-preserve-unknown-fields` closes), `null` dropped unless
`nullable` (the server prunes it), int-or-string, int32/int64 ranges, list types `set` and `map` (unique items and
keys), and the server's own ObjectMeta rules (known fields, name, namespace, labels, annotations). The CRDs carry no CEL rules
(x-kubernetes-validations): one that does fails here loudly rather than passing unchecked.
"""
from __future__ import annotations

import functools
import pathlib
import re
import subprocess
from typing import Any

import jsonschema
import yaml

ROOT = pathlib.Path(__file__).resolve().parents[3]
FETCH_SCRIPT = ROOT / "scripts" / "fetch-third-party-crds.sh"
Obj = dict[str, Any]
_DNS_SUBDOMAIN = re.compile(r"^[a-z0-9]([-a-z0-9]*[a-z0-9])?(\.[a-z0-9]([-a-z0-9]*[a-z0-9])?)*$")
_LABEL_VALUE = re.compile(r"^(([A-Za-z0-9][-A-Za-z0-9_.]*)?[A-Za-z0-9])?$")
_DNS_LABEL = re.compile(r"^[a-z0-9]([-a-z0-9]*[a-z0-9])?$")
_OBJECT_META = frozenset({"name", "generateName", "namespace", "labels", "annotations", "ownerReferences",
                          "finalizers", "uid", "resourceVersion", "generation", "creationTimestamp",
                          "deletionTimestamp", "deletionGracePeriodSeconds", "managedFields", "selfLink"})
_INT_BITS = {"int32": 31, "int64": 63}
_LABEL_NAME = re.compile(r"^([A-Za-z0-9][-A-Za-z0-9_.]*)?[A-Za-z0-9]$")


class CrdViolation(ValueError):
    """An object its CRD refuses; `message` lists every violation, each with its field path."""

    def __init__(self, message: str) -> None:
        super().__init__(message)
        self.message = message


def third_party_crd_files(timeout_s: float = 600) -> list[pathlib.Path]:
    """The pinned CRD files, fetched first if needed. No Go or no proxy is an error, never a skip:
    an object whose schema is missing must not pass unchecked."""
    out = subprocess.run(["bash", str(FETCH_SCRIPT)], capture_output=True, text=True, timeout=timeout_s)
    if out.returncode != 0:
        raise RuntimeError(f"{FETCH_SCRIPT.relative_to(ROOT)} exited {out.returncode}:\n{out.stderr[-3000:]}")
    files = [f for d in out.stdout.split() for f in sorted(pathlib.Path(d).glob("*.yaml"))]
    if not files:
        raise RuntimeError(f"{FETCH_SCRIPT.relative_to(ROOT)} gave no CRD files:\n{out.stdout}")
    return files


def _closed(schema: Obj) -> Obj:
    """The CRD's openAPIV3Schema as JSON Schema with the server's structural rules made explicit."""
    if "x-kubernetes-validations" in schema:
        raise NotImplementedError("a CRD with CEL rules: check it on the real kube-apiserver (tests/k8s)")
    out = {k: v for k, v in schema.items() if k not in ("properties", "items", "additionalProperties")}
    if "properties" in schema:
        out["properties"] = {k: _closed(v) for k, v in schema["properties"].items()}
    if isinstance(schema.get("additionalProperties"), dict):
        out["additionalProperties"] = _closed(schema["additionalProperties"])
    elif schema.get("type") == "object" and not schema.get("x-kubernetes-preserve-unknown-fields"):
        out["additionalProperties"] = False  # fieldValidation=Strict: an unknown field is refused
    if "items" in schema:
        out["items"] = _closed(schema["items"])
    if schema.get("x-kubernetes-int-or-string") and "anyOf" not in schema:
        out["anyOf"] = [{"type": "integer"}, {"type": "string"}]
    bits = _INT_BITS.get(schema.get("format", "")) if schema.get("type") == "integer" else None
    if bits:  # the server checks an integer's format
        out["minimum"] = max(schema.get("minimum", -2**bits), -2**bits)
        out["maximum"] = min(schema.get("maximum", 2**bits - 1), 2**bits - 1)
    if schema.get("x-kubernetes-list-type") == "set":
        out["uniqueItems"] = True
    if schema.get("nullable") and "type" in schema:
        out["type"] = [schema["type"], "null"]
    return out


def _without_pruned_nulls(value: Any, schema: Obj) -> Any:
    """`value` less the nulls the server prunes (every known field whose schema is not nullable)."""
    if isinstance(value, dict):
        props = schema.get("properties", {})
        extra = schema.get("additionalProperties")
        out = {}
        for key, item in value.items():
            known = key in props or isinstance(extra, dict)
            sub = props.get(key, extra if isinstance(extra, dict) else {})
            if item is None and known and not sub.get("nullable"):  # an unknown one stays refused
                continue
            out[key] = _without_pruned_nulls(item, sub)
        return out
    if isinstance(value, list):
        return [_without_pruned_nulls(item, schema.get("items", {})) for item in value]
    return value


def _list_map_keys(validator: Any, keys: list[str], instance: Any, schema: Obj):
    """x-kubernetes-list-type: map: no two items share their key fields."""
    if not validator.is_type(instance, "array"):
        return
    seen = set()
    for item in instance:
        key = tuple(repr(item.get(k)) for k in keys) if isinstance(item, dict) else (repr(item),)
        if key in seen:
            yield jsonschema.ValidationError(f"Duplicate value: {dict(zip(keys, key))}")
        seen.add(key)


_Validator = jsonschema.validators.extend(jsonschema.Draft7Validator,
                                          {"x-kubernetes-list-map-keys": _list_map_keys})


def _metadata_errors(meta: Any) -> list[str]:
    """ObjectMeta as the server checks it for any custom resource: a DNS-1123 subdomain name and
    well-formed labels."""
    if not isinstance(meta, dict):
        return [f"metadata: {meta!r} is not an object"]
    errors = [f"metadata.{key}: unknown field" for key in meta if key not in _OBJECT_META]
    namespace = meta.get("namespace")
    if namespace is not None and not (isinstance(namespace, str) and len(namespace) <= 63
                                      and _DNS_LABEL.match(namespace)):
        errors.append(f"metadata.namespace: {namespace!r} is not a DNS-1123 label")
    # JSON null decodes as an empty map or string (Go's unmarshalling), any other wrong type is an error.
    for field in ("labels", "annotations"):
        if meta.get(field) is not None and not isinstance(meta[field], dict):
            errors.append(f"metadata.{field}: {meta[field]!r} is not an object")
        meta = {**meta, field: {k: "" if v is None else v for k, v in (meta.get(field) or {}).items()}
                if isinstance(meta.get(field), dict) else {}}
    errors += [f"metadata.annotations.{k}: {v!r} is not a string"
               for k, v in meta["annotations"].items() if not isinstance(v, str)]
    name = meta.get("name")
    if not (isinstance(name, str) and 0 < len(name) <= 253 and _DNS_SUBDOMAIN.match(name)):
        errors.append(f"metadata.name: {name!r} is not a DNS-1123 subdomain")
    for key, value in (meta.get("labels") or {}).items():
        prefix, _, label = key.rpartition("/")
        if not (0 < len(label) <= 63 and _LABEL_NAME.match(label)) or (
                prefix and not (len(prefix) <= 253 and _DNS_SUBDOMAIN.match(prefix))):
            errors.append(f"metadata.labels: {key!r} is not a label key")
        if not (isinstance(value, str) and len(value) <= 63 and _LABEL_VALUE.match(value)):
            errors.append(f"metadata.labels.{key}: {value!r} is not a label value")
    return errors


class CrdSchemas:
    """The served versions of some CRDs, by (apiVersion, kind)."""

    def __init__(self, crds: list[Obj]) -> None:
        self.raw: dict[tuple[str, str], Obj] = {}
        self.crds = crds
        for crd in crds:
            group, kind = crd["spec"]["group"], crd["spec"]["names"]["kind"]
            for version in crd["spec"]["versions"]:
                if version.get("served"):
                    self.raw[(f"{group}/{version['name']}", kind)] = version["schema"]["openAPIV3Schema"]

    @classmethod
    def from_files(cls, files: list[pathlib.Path]) -> CrdSchemas:
        return cls([doc for f in files for doc in yaml.safe_load_all(f.read_text())
                    if doc and doc.get("kind") == "CustomResourceDefinition"])

    def knows(self, obj: Obj) -> bool:
        return (obj.get("apiVersion"), obj.get("kind")) in self.raw

    @functools.cache
    def _validator(self, api_version: str, kind: str) -> Any:
        schema = _closed(self.raw[(api_version, kind)])
        # apiVersion, kind and metadata are the server's, checked by _metadata_errors.
        schema["properties"] = {**schema["properties"], "metadata": {"type": "object"}}
        return _Validator(schema)

    def validate(self, obj: Obj) -> None:
        key = (obj.get("apiVersion"), obj.get("kind"))
        if key not in self.raw:
            raise KeyError(f"no third-party CRD defines {key[0]} {key[1]} (scripts/third-party-crds.txt)")
        errors = _metadata_errors(obj.get("metadata"))
        body = _without_pruned_nulls(obj, self.raw[key])
        for error in self._validator(*key).iter_errors(body):
            path = ".".join(str(p) for p in error.absolute_path) or "<root>"
            errors.append(f"{path}: {error.message}")
        if errors:
            meta = obj.get("metadata")
            name = meta.get("name") if isinstance(meta, dict) else None
            raise CrdViolation(f"{key[1]} {name!r}: " + "; ".join(sorted(errors)))


@functools.cache
def third_party_schemas() -> CrdSchemas:
    """The CRDs of scripts/third-party-crds.txt, loaded once per process."""
    return CrdSchemas.from_files(third_party_crd_files())

"""What `bench serving` must know about the model behind a router URL, learned from the router.

The workload's token ids must lie inside the served vocabulary and its lengths inside the served
context, and the report's KV bytes per token must be the served model's; none of that may come
from a local default. So:

1. `GET /v1/models` gives the model name (the first entry, unless `--model-name`).
2. `GET /workers` gives, per worker, what it answered to GetModelInfo, as the router recorded it
   (sglang-router 0.3.2 under `metadata`, smg 1.13 under `labels`, all values strings):
   `vocab_size`, `max_context_length`, `model_path`, `architectures`, and its `grpc://` URL.
3. KV bytes per token, `num_hidden_layers x (kv_lora_rank + qk_rope_head_dim) x dtype bytes`
   (ARCHITECTURE §3): as a worker reports it in GetServerInfo (`kv_bytes_per_token` in
   `scheduler_info` or `server_args`) when it does, which covers a `--dtype` that differs from the
   checkpoint's; else from the config.json at the `model_path` the workers report (readable when
   the benchmark runs where the checkpoint is); else unknown (None, with the reason).

`--model DIR` overrides 2 and 3 with that checkpoint. A gateway whose `/workers` is closed (no
`--admin-key-file`: someone else's) or absent is loaded through its client API alone
(client_api_model.py: its tokenizer, or `--tokenizer`), and the figures only the workers know
are left out, saying so (`TargetModel.left_out`).

Example, against `deepseek-pd up --model /models/v2lite` (V2-Lite's shape, bf16):
`TargetModel(name="v2lite", vocab_size=446, max_context_length=163840, kv_bytes_per_token=31104,
kv_bytes_source="config.json at /models/v2lite (27 layers x 576 x 2 bytes, bfloat16)", ...)`.
"""
from __future__ import annotations

import asyncio
import json
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from deepseek_pd.client.router_http import RouterClient, RouterError
from deepseek_pd.errors import UserError
from deepseek_pd.model.config import DTYPE_BYTES, ModelConfig

KV_BYTES_KEY = "kv_bytes_per_token"  # what a worker's GetServerInfo may carry


@dataclass(frozen=True)
class TargetModel:
    name: str  # the "model" field requests carry
    vocab_size: int | None  # None: not known from the client API; prompts draw from `token_ids`
    max_context_length: int | None  # None: not known from the client API (lengths go unchecked)
    model_path: str | None  # the checkpoint directory the workers serve (on their machine)
    architectures: tuple[str, ...]
    kv_bytes_per_token: int | None
    kv_bytes_source: str  # where that figure came from, or why it is unknown
    source: str  # where vocabulary and context came from
    token_ids: tuple[int, ...] = ()  # the gateway tokenizer's ids of random text (vocab_size None)
    left_out: str | None = None  # the workers' figures not reported, and why
    # Per worker serving it (from /workers and its GetLoads): {"url", "kind", "kv_capacity_tokens"}.
    workers: tuple[dict, ...] = ()

    @property
    def vocabulary(self) -> "int | tuple[int, ...]":
        """What the workload draws prompt ids from (`WorkloadSpec.token_pool`)."""
        return self.vocab_size if self.vocab_size is not None else self.token_ids

    def report_fields(self) -> dict[str, Any]:
        """The fields a report records (the token ids as their count)."""
        fields = {name: getattr(self, name) for name in self.__dataclass_fields__ if name != "token_ids"}
        return {**fields, "token_pool_size": len(self.token_ids) or None}


def kv_bytes_per_token_from_config(config: dict) -> tuple[int | None, str]:
    """(latent KV bytes of one token over all layers, how it was computed); None if the config is
    not one the workers could serve. The rule is the pool's own (model/config.latent_kv_bytes)."""
    try:
        model = ModelConfig.from_hf(config)
    except UserError as exc:
        return None, f"not a servable DeepSeek config ({exc})"
    return (model.kv_bytes_per_token(),
            f"{model.num_hidden_layers} layers x {model.kv_cache_dim} x {DTYPE_BYTES[model.torch_dtype]} bytes, "
            f"{model.torch_dtype}")


def _read_config(model_dir: Path) -> dict | None:
    try:
        return json.loads((model_dir / "config.json").read_text())
    except (OSError, ValueError):
        return None


def target_from_model_dir(name: str, model_dir: str | Path, source: str) -> TargetModel:
    """Everything from a local checkpoint (`--model DIR`)."""
    from deepseek_pd.workers.api.served_model import ServedModelInfo

    info = ServedModelInfo.from_model_dir(model_dir)
    kv, how = kv_bytes_per_token_from_config(_read_config(Path(info.model_path)) or {})
    return TargetModel(name, info.vocab_size, info.max_context_length, info.model_path, info.architectures,
                       kv, f"config.json at {info.model_path} ({how})", source)


@dataclass(frozen=True)
class _WorkerRecord:
    url: str
    model_id: str
    meta: dict[str, Any]
    kind: str = ""  # the router's worker_type: prefill, decode, regular


def _worker_records(payload: Any) -> list[_WorkerRecord]:
    workers = payload.get("workers") if isinstance(payload, dict) else payload
    if not isinstance(workers, list):
        return []
    records = []
    for worker in workers:
        if not isinstance(worker, dict):
            continue
        meta = {**(worker.get("metadata") or {}), **(worker.get("labels") or {})}
        model_id = worker.get("model_id") or meta.get("served_model_name") or ""
        records.append(_WorkerRecord(str(worker.get("url", "")), str(model_id), meta,
                                     str(worker.get("worker_type", ""))))
    return records


def _int_field(records: list[_WorkerRecord], *keys: str) -> list[int]:
    values = []
    for record in records:
        for key in keys:
            try:
                values.append(int(record.meta[key]))
                break
            except (KeyError, TypeError, ValueError):
                continue
    return values


def _architectures(record: _WorkerRecord) -> tuple[str, ...]:
    value = record.meta.get("architectures")
    if isinstance(value, str):
        try:
            value = json.loads(value)
        except ValueError:
            value = [value]
    return tuple(str(v) for v in value or ())


async def _worker_reported_kv_bytes(records: list[_WorkerRecord], timeout_s: float) -> tuple[int, str] | None:
    """A worker's own figure, from GetServerInfo over gRPC (its runtime dtype, not the config's)."""
    from google.protobuf.json_format import MessageToDict

    from deepseek_pd.client.scheduler_grpc import SchedulerClient

    for record in records:
        if not record.url.startswith("grpc://"):
            continue
        address = record.url[len("grpc://"):]
        try:
            async with SchedulerClient(address) as client:
                reply = await client.server_info(timeout_s=timeout_s)
        except Exception:  # unreachable from here, or an older worker: fall back to the config
            continue
        for part in (reply.scheduler_info, reply.server_args):
            value = MessageToDict(part).get(KV_BYTES_KEY)
            if isinstance(value, (int, float)) and value > 0:
                return int(value), f"GetServerInfo of {record.url}"
    return None


async def _worker_capacities(records: list[_WorkerRecord], timeout_s: float) -> tuple[dict, ...]:
    """Each gRPC worker's KV capacity in tokens, from its GetLoads (None where it does not answer here)."""
    from deepseek_pd.client.scheduler_grpc import SchedulerClient

    out = []
    for record in records:
        if not record.url.startswith("grpc://"):
            continue
        try:
            async with SchedulerClient(record.url[len("grpc://"):]) as client:
                capacity = int((await client.loads(timeout_s=timeout_s)).max_total_num_tokens)
        except Exception:  # unreachable from here, or an older worker
            capacity = None
        out.append({"url": record.url, "kind": record.kind, "kv_capacity_tokens": capacity})
    return tuple(out)


async def _model_names(client: RouterClient) -> list[str]:
    try:
        payload = await client.get_json("/v1/models")
    except RouterError as exc:
        raise UserError(f"{client.base_url}/v1/models answered {exc.status}: {exc.message[:200]}") from None
    data = payload.get("data") if isinstance(payload, dict) else None
    names = [str(m["id"]) for m in data or () if isinstance(m, dict) and m.get("id")]
    if not names:
        raise UserError(f"{client.base_url}/v1/models lists no model (got {json.dumps(payload)[:200]})")
    return names


async def _client_api_target(client: RouterClient, name: str, closed: str, tokenizer: str | None,
                             seed: int) -> TargetModel:
    """The model as the client API alone tells it (client_api_model.py); `closed`: why /workers was not read."""
    from deepseek_pd.loadgen.client_api_model import gateway_token_ids, local_tokenizer_size

    left_out = (f"KV bytes per token and the workers' checkpoint, count and KV capacity (only the workers know them): "
                f"{closed}; the context is unknown, so prompt lengths are not checked against it")
    if tokenizer is not None:
        vocab, token_ids, source = local_tokenizer_size(tokenizer), (), f"--tokenizer {tokenizer}"
    else:
        vocab, token_ids = None, await gateway_token_ids(client, name, seed)
        source = f"{client.base_url}/v1/tokenize ({len(token_ids)} distinct ids of random text)"
    return TargetModel(name, vocab, None, None, (), None, "left out (the workers' figure)", source, token_ids,
                       left_out)


async def discover_target_model(url: str, model_name: str | None = None, model_override: str | None = None,
                                timeout_s: float = 10.0, grpc_timeout_s: float = 3.0,
                                api_key: str | None = None, admin_key: str | None = None,
                                tokenizer: str | None = None, seed: int = 0) -> TargetModel:
    """The served model's name, vocabulary, context and KV bytes per token (see the module doc).

    `admin_key` unlocks `/workers` on a gateway whose control plane has keys (as `up` sets);
    without it (or where there is no /workers) the client API's tokenizer, or `tokenizer`
    (`--tokenizer`), gives the vocabulary, `seed` the random text it tokenises."""
    import aiohttp

    try:
        async with RouterClient(url, timeout_s=timeout_s, api_key=api_key, admin_key=admin_key) as client:
            name = model_name or (await _model_names(client))[0]
            if model_override is not None:
                return target_from_model_dir(name, model_override, f"--model {model_override}")
            try:
                records = _worker_records(await client.get_json("/workers", admin=True))
            except RouterError as exc:
                hint = (" (its control plane needs a key: --admin-key-file, e.g. the control-plane-key "
                        "`deepseek-pd up` writes in its log directory)" if exc.status in (401, 403) else "")
                return await _client_api_target(client, name, f"{url}/workers answered {exc.status}{hint}",
                                                tokenizer, seed)
    except (aiohttp.ClientError, asyncio.TimeoutError) as exc:
        raise UserError(f"cannot reach the router at {url}: {exc or type(exc).__name__}") from None
    mine = [r for r in records if r.model_id == name]
    if not mine:
        listed = sorted({r.model_id for r in records})
        raise UserError(f"{url}/workers lists no worker serving {name!r} (it lists {listed}); "
                        f"pass --model-name, or --model DIR")
    paths = sorted({str(r.meta["model_path"]) for r in mine if r.meta.get("model_path")})
    model_path = paths[0] if paths else None
    vocabs = set(_int_field(mine, "vocab_size"))
    contexts = _int_field(mine, "max_context_length", "context_length")
    if len(vocabs) > 1:
        raise UserError(f"the workers serving {name!r} disagree on the vocabulary: {sorted(vocabs)}")
    if not vocabs or not contexts:
        if model_path is not None and _read_config(Path(model_path)) is not None:
            return target_from_model_dir(name, model_path, f"config.json at {model_path}")
        raise UserError(f"{url}/workers does not report {name!r}'s vocabulary and context; "
                        f"pass --model DIR (the checkpoint it serves)")
    reported = await _worker_reported_kv_bytes(mine, grpc_timeout_s)
    if reported is not None:
        kv, kv_source = reported
    elif model_path is not None and (config := _read_config(Path(model_path))) is not None:
        kv, how = kv_bytes_per_token_from_config(config)
        kv_source = f"config.json at {model_path} ({how})"
    else:
        kv, kv_source = None, (f"unknown: the workers do not report it and {model_path}/config.json "
                               f"is not readable here (pass --model DIR)")
    return TargetModel(name, vocabs.pop(), min(contexts), model_path, _architectures(mine[0]), kv, kv_source,
                       f"{url}/workers ({len(mine)} workers)", workers=await _worker_capacities(mine, grpc_timeout_s))

"""The KV transports come from registries (kv_transfer/__init__.py), not from class names looked up
by importlib: every name builds its own side's class, the worker's --kv-transport choices are the
registry's names, and an unknown name is a UserError that lists them."""
from __future__ import annotations

import random

import pytest
import torch

from deepseek_pd.errors import UserError
from deepseek_pd.model.kv.pool import KVPool
from deepseek_pd.workers.transport import (
    KV_RECEIVERS, KV_SENDERS, TRANSPORT_NAMES, KVReceiver, KVSender, TransportConfig, build_receiver, build_sender)
from deepseek_pd.workers.serve.flags import ServeFlags


def test_each_name_registers_both_sides() -> None:
    assert KV_SENDERS.names() == KV_RECEIVERS.names() == sorted(TRANSPORT_NAMES)
    for name in TRANSPORT_NAMES:
        assert issubclass(KV_SENDERS.get(name), KVSender) and issubclass(KV_RECEIVERS.get(name), KVReceiver)
    # `serve --kv-transport` offers the real transports: every one of them is registered.
    serve_choices = next(f.metadata["flag"].choices for f in __import__("dataclasses").fields(ServeFlags)
                         if f.name == "kv_transport")
    assert set(serve_choices) <= set(TRANSPORT_NAMES)


def test_the_fake_transport_builds_and_unknown_names_are_refused() -> None:
    pool = KVPool(random.randint(1, 4), 4, 2, 8, dtype=torch.float32, device="cpu")
    sender, receiver = build_sender("fake", pool, TransportConfig()), build_receiver("fake", pool, TransportConfig())
    assert (type(sender), type(receiver)) == (KV_SENDERS.get("fake"), KV_RECEIVERS.get("fake"))
    for build in (build_sender, build_receiver):
        with pytest.raises(UserError, match="unknown KV transport 'rdma'.*fake, grpc, mooncake"):
            build("rdma", pool, TransportConfig())

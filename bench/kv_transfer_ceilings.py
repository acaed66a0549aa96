"""Ceilings for bench/kv_transfer.py, measured in the same run on the same loopback: bare gRPC
streams of the same message sizes (over 1 or N connections), and one raw Mooncake batch write of
the same pages between the same two engines."""
from __future__ import annotations

import asyncio
import os
import time


async def raw_grpc(total_bytes: int, message_bytes: int, repeats: int, streams: int = 1) -> list[float]:
    """Seconds to stream `total_bytes` as bare `bytes` messages over `streams` loopback gRPC streams,
    each on its own connection (what parallel KV streams could reach)."""
    import grpc

    payload = os.urandom(message_bytes)
    count = -(-total_bytes // message_bytes // streams)

    async def stream(request_iterator, context):
        await request_iterator.__anext__()
        for _ in range(count):
            yield payload

    handler = grpc.method_handlers_generic_handler("bench.Raw", {"S": grpc.stream_stream_rpc_method_handler(stream)})
    limit = [("grpc.max_send_message_length", -1), ("grpc.max_receive_message_length", -1)]
    server = grpc.aio.server(options=limit)
    server.add_generic_rpc_handlers((handler,))
    port = server.add_insecure_port("127.0.0.1:0")
    await server.start()
    channels = [grpc.aio.insecure_channel(f"127.0.0.1:{port}", options=limit + [("grpc.use_local_subchannel_pool", 1)])
                for _ in range(streams)]

    async def one(channel) -> None:
        call = channel.stream_stream("/bench.Raw/S")()
        await call.write(b"go")
        while await call.read() is not grpc.aio.EOF:
            pass

    seconds: list[float] = []
    try:
        for _ in range(repeats + 1):
            began = time.perf_counter()
            await asyncio.gather(*(one(channel) for channel in channels))
            seconds.append(time.perf_counter() - began)
    finally:
        for channel in channels:
            await channel.close()
        await server.stop(0)
    return seconds[1:]  # the first one connects


def raw_mooncake(setup, sender, receiver) -> float:
    """Seconds of one raw `batch_transfer_sync_write` of the same batch between the same two engines."""
    from deepseek_pd.workers.transport.mooncake_channel import build_write_batch

    # Decode's pool is never registered: writers reach only its staging (workers/transport/staging.py),
    # so the raw write goes to the staging's first pages, registered around it (outside its timing)
    # as a transfer's slots are over TCP. No transfer runs meanwhile (the ceiling is taken between repeats).
    staging, engine = receiver.staging, receiver.engine
    slots = list(range(len(setup.dst_pages)))
    if len(slots) > staging.num_pages:
        raise SystemExit(f"the raw mooncake write needs {len(slots)} staging pages, the staging holds "
                         f"{staging.num_pages}: raise --engine-opt mooncake_staging_tokens")
    # Over TCP the source needs no registration (a write reads local memory): the prefill pool's pages.
    # Over RDMA the NIC reads only registered memory: the sender's send staging (as a transfer does).
    if sender.engine.protocol == "tcp":
        batch = build_write_batch([buffer.data_ptr() for buffer in setup.src.buffers], staging.base_addrs,
                                  setup.src.bytes_per_page, setup.src_pages, slots)
    else:
        batch = build_write_batch(sender.staging.base_addrs, staging.base_addrs, setup.src.bytes_per_page,
                                  slots, slots)
    length = len(slots) * staging.page_bytes
    registered = [base for base in staging.base_addrs
                  if engine.protocol == "tcp" and engine.engine.register_memory(base, length) == 0]
    try:
        began = time.perf_counter()
        status = sender.engine.engine.batch_transfer_sync_write(engine.session_id, *batch)
        elapsed = time.perf_counter() - began
    finally:
        for base in registered:
            engine.engine.unregister_memory(base)
    if status != 0:
        raise SystemExit(f"raw mooncake write failed with status {status}")
    return elapsed




def raw_mooncake_read(setup, sender, receiver) -> float:
    """Seconds of one raw `batch_transfer_sync_read` of the same pages, the other way round: the
    decode side's engine reads the prefill pool's pages straight into its staging's first slots, as a
    pulled transfer reads (without its send staging, cipher or MAC). A read is served only from
    registered memory, so the prefill pool's layer buffers are registered with the prefill engine
    around it, outside its timing (a bench ceiling: the workers never register a pool)."""
    from deepseek_pd.workers.transport.mooncake_channel import build_write_batch

    staging, engine = receiver.staging, receiver.engine
    slots = list(range(len(setup.src_pages)))
    if len(slots) > staging.num_pages:
        raise SystemExit(f"the raw mooncake read needs {len(slots)} staging pages, the staging holds "
                         f"{staging.num_pages}")
    layer_bytes = setup.src.buffers[0].numel() * setup.src.buffers[0].element_size()
    registered = []
    try:
        for buffer in setup.src.buffers:
            if sender.engine.engine.register_memory(buffer.data_ptr(), layer_bytes) != 0:
                raise SystemExit("raw mooncake read: the prefill engine refused to register its pool")
            registered.append(buffer.data_ptr())
        batch = build_write_batch(staging.base_addrs, registered, setup.src.bytes_per_page, slots, setup.src_pages)
        began = time.perf_counter()
        status = engine.engine.batch_transfer_sync_read(sender.engine.session_id, *batch)
        elapsed = time.perf_counter() - began
    finally:
        for addr in registered:
            sender.engine.engine.unregister_memory(addr)
    if status != 0:
        raise SystemExit(f"raw mooncake read failed with status {status}")
    staging.scrub(slots)  # (what it read is the prefill pool's plaintext: nothing of it stays behind)
    return elapsed

from google.protobuf.internal import containers as _containers
from google.protobuf.internal import enum_type_wrapper as _enum_type_wrapper
from google.protobuf import descriptor as _descriptor
from google.protobuf import message as _message
from collections.abc import Iterable as _Iterable, Mapping as _Mapping
from typing import ClassVar as _ClassVar, Optional as _Optional, Union as _Union

DESCRIPTOR: _descriptor.FileDescriptor

class FailureCode(int, metaclass=_enum_type_wrapper.EnumTypeWrapper):
    __slots__ = ()
    FAILURE_CODE_UNSPECIFIED: _ClassVar[FailureCode]
    FAILURE_CODE_INVALID_ARGUMENT: _ClassVar[FailureCode]
    FAILURE_CODE_RESOURCE_EXHAUSTED: _ClassVar[FailureCode]
    FAILURE_CODE_DEADLINE_EXCEEDED: _ClassVar[FailureCode]
    FAILURE_CODE_UNAVAILABLE: _ClassVar[FailureCode]
    FAILURE_CODE_ABORTED: _ClassVar[FailureCode]
    FAILURE_CODE_INTERNAL: _ClassVar[FailureCode]
FAILURE_CODE_UNSPECIFIED: FailureCode
FAILURE_CODE_INVALID_ARGUMENT: FailureCode
FAILURE_CODE_RESOURCE_EXHAUSTED: FailureCode
FAILURE_CODE_DEADLINE_EXCEEDED: FailureCode
FAILURE_CODE_UNAVAILABLE: FailureCode
FAILURE_CODE_ABORTED: FailureCode
FAILURE_CODE_INTERNAL: FailureCode

class KVLayout(_message.Message):
    __slots__ = ("num_layers", "page_size", "kv_dim", "dtype")
    NUM_LAYERS_FIELD_NUMBER: _ClassVar[int]
    PAGE_SIZE_FIELD_NUMBER: _ClassVar[int]
    KV_DIM_FIELD_NUMBER: _ClassVar[int]
    DTYPE_FIELD_NUMBER: _ClassVar[int]
    num_layers: int
    page_size: int
    kv_dim: int
    dtype: str
    def __init__(self, num_layers: _Optional[int] = ..., page_size: _Optional[int] = ..., kv_dim: _Optional[int] = ..., dtype: _Optional[str] = ...) -> None: ...

class DecodeMessage(_message.Message):
    __slots__ = ("handshake", "credit")
    HANDSHAKE_FIELD_NUMBER: _ClassVar[int]
    CREDIT_FIELD_NUMBER: _ClassVar[int]
    handshake: Handshake
    credit: Credit
    def __init__(self, handshake: _Optional[_Union[Handshake, _Mapping]] = ..., credit: _Optional[_Union[Credit, _Mapping]] = ...) -> None: ...

class Credit(_message.Message):
    __slots__ = ("received_seq", "landed_pages")
    RECEIVED_SEQ_FIELD_NUMBER: _ClassVar[int]
    LANDED_PAGES_FIELD_NUMBER: _ClassVar[int]
    received_seq: int
    landed_pages: int
    def __init__(self, received_seq: _Optional[int] = ..., landed_pages: _Optional[int] = ...) -> None: ...

class Handshake(_message.Message):
    __slots__ = ("protocol_version", "room", "decode_rid", "num_tokens", "page_ids", "layout", "prefill_dp_rank", "prefill_dp_size", "decode_dp_rank", "grpc", "mooncake", "fake", "auth")
    PROTOCOL_VERSION_FIELD_NUMBER: _ClassVar[int]
    ROOM_FIELD_NUMBER: _ClassVar[int]
    DECODE_RID_FIELD_NUMBER: _ClassVar[int]
    NUM_TOKENS_FIELD_NUMBER: _ClassVar[int]
    PAGE_IDS_FIELD_NUMBER: _ClassVar[int]
    LAYOUT_FIELD_NUMBER: _ClassVar[int]
    PREFILL_DP_RANK_FIELD_NUMBER: _ClassVar[int]
    PREFILL_DP_SIZE_FIELD_NUMBER: _ClassVar[int]
    DECODE_DP_RANK_FIELD_NUMBER: _ClassVar[int]
    GRPC_FIELD_NUMBER: _ClassVar[int]
    MOONCAKE_FIELD_NUMBER: _ClassVar[int]
    FAKE_FIELD_NUMBER: _ClassVar[int]
    AUTH_FIELD_NUMBER: _ClassVar[int]
    protocol_version: int
    room: int
    decode_rid: str
    num_tokens: int
    page_ids: _containers.RepeatedScalarFieldContainer[int]
    layout: KVLayout
    prefill_dp_rank: int
    prefill_dp_size: int
    decode_dp_rank: int
    grpc: GrpcDestination
    mooncake: MooncakeDestination
    fake: FakeDestination
    auth: AuthToken
    def __init__(self, protocol_version: _Optional[int] = ..., room: _Optional[int] = ..., decode_rid: _Optional[str] = ..., num_tokens: _Optional[int] = ..., page_ids: _Optional[_Iterable[int]] = ..., layout: _Optional[_Union[KVLayout, _Mapping]] = ..., prefill_dp_rank: _Optional[int] = ..., prefill_dp_size: _Optional[int] = ..., decode_dp_rank: _Optional[int] = ..., grpc: _Optional[_Union[GrpcDestination, _Mapping]] = ..., mooncake: _Optional[_Union[MooncakeDestination, _Mapping]] = ..., fake: _Optional[_Union[FakeDestination, _Mapping]] = ..., auth: _Optional[_Union[AuthToken, _Mapping]] = ...) -> None: ...

class AuthToken(_message.Message):
    __slots__ = ("timestamp_ms", "nonce", "sender", "receiver", "challenge", "mac")
    TIMESTAMP_MS_FIELD_NUMBER: _ClassVar[int]
    NONCE_FIELD_NUMBER: _ClassVar[int]
    SENDER_FIELD_NUMBER: _ClassVar[int]
    RECEIVER_FIELD_NUMBER: _ClassVar[int]
    CHALLENGE_FIELD_NUMBER: _ClassVar[int]
    MAC_FIELD_NUMBER: _ClassVar[int]
    timestamp_ms: int
    nonce: bytes
    sender: str
    receiver: str
    challenge: bytes
    mac: bytes
    def __init__(self, timestamp_ms: _Optional[int] = ..., nonce: _Optional[bytes] = ..., sender: _Optional[str] = ..., receiver: _Optional[str] = ..., challenge: _Optional[bytes] = ..., mac: _Optional[bytes] = ...) -> None: ...

class GrpcDestination(_message.Message):
    __slots__ = ("max_chunk_bytes", "streams", "direct")
    MAX_CHUNK_BYTES_FIELD_NUMBER: _ClassVar[int]
    STREAMS_FIELD_NUMBER: _ClassVar[int]
    DIRECT_FIELD_NUMBER: _ClassVar[int]
    max_chunk_bytes: int
    streams: int
    direct: DirectPool
    def __init__(self, max_chunk_bytes: _Optional[int] = ..., streams: _Optional[int] = ..., direct: _Optional[_Union[DirectPool, _Mapping]] = ...) -> None: ...

class DirectPool(_message.Message):
    __slots__ = ("host", "pid", "pool_id", "device_uuid", "pool_pages", "page_bytes", "layers")
    HOST_FIELD_NUMBER: _ClassVar[int]
    PID_FIELD_NUMBER: _ClassVar[int]
    POOL_ID_FIELD_NUMBER: _ClassVar[int]
    DEVICE_UUID_FIELD_NUMBER: _ClassVar[int]
    POOL_PAGES_FIELD_NUMBER: _ClassVar[int]
    PAGE_BYTES_FIELD_NUMBER: _ClassVar[int]
    LAYERS_FIELD_NUMBER: _ClassVar[int]
    host: str
    pid: int
    pool_id: str
    device_uuid: str
    pool_pages: int
    page_bytes: int
    layers: _containers.RepeatedCompositeFieldContainer[CudaIpcBuffer]
    def __init__(self, host: _Optional[str] = ..., pid: _Optional[int] = ..., pool_id: _Optional[str] = ..., device_uuid: _Optional[str] = ..., pool_pages: _Optional[int] = ..., page_bytes: _Optional[int] = ..., layers: _Optional[_Iterable[_Union[CudaIpcBuffer, _Mapping]]] = ...) -> None: ...

class CudaIpcBuffer(_message.Message):
    __slots__ = ("handle", "size_bytes", "offset_bytes", "ref_counter_handle", "ref_counter_offset", "event_handle", "event_sync_required")
    HANDLE_FIELD_NUMBER: _ClassVar[int]
    SIZE_BYTES_FIELD_NUMBER: _ClassVar[int]
    OFFSET_BYTES_FIELD_NUMBER: _ClassVar[int]
    REF_COUNTER_HANDLE_FIELD_NUMBER: _ClassVar[int]
    REF_COUNTER_OFFSET_FIELD_NUMBER: _ClassVar[int]
    EVENT_HANDLE_FIELD_NUMBER: _ClassVar[int]
    EVENT_SYNC_REQUIRED_FIELD_NUMBER: _ClassVar[int]
    handle: bytes
    size_bytes: int
    offset_bytes: int
    ref_counter_handle: bytes
    ref_counter_offset: int
    event_handle: bytes
    event_sync_required: bool
    def __init__(self, handle: _Optional[bytes] = ..., size_bytes: _Optional[int] = ..., offset_bytes: _Optional[int] = ..., ref_counter_handle: _Optional[bytes] = ..., ref_counter_offset: _Optional[int] = ..., event_handle: _Optional[bytes] = ..., event_sync_required: _Optional[bool] = ...) -> None: ...

class KVStreamMessage(_message.Message):
    __slots__ = ("open", "credit")
    OPEN_FIELD_NUMBER: _ClassVar[int]
    CREDIT_FIELD_NUMBER: _ClassVar[int]
    open: KVStreamOpen
    credit: Credit
    def __init__(self, open: _Optional[_Union[KVStreamOpen, _Mapping]] = ..., credit: _Optional[_Union[Credit, _Mapping]] = ...) -> None: ...

class KVStreamOpen(_message.Message):
    __slots__ = ("room", "index", "auth")
    ROOM_FIELD_NUMBER: _ClassVar[int]
    INDEX_FIELD_NUMBER: _ClassVar[int]
    AUTH_FIELD_NUMBER: _ClassVar[int]
    room: int
    index: int
    auth: AuthToken
    def __init__(self, room: _Optional[int] = ..., index: _Optional[int] = ..., auth: _Optional[_Union[AuthToken, _Mapping]] = ...) -> None: ...

class MooncakeDestination(_message.Message):
    __slots__ = ("session_id", "layer_base_addrs", "page_bytes", "pool_pages", "protocol", "kv_mac_algorithms", "window_pages", "report_sends", "kv_cipher_algorithms", "pull")
    SESSION_ID_FIELD_NUMBER: _ClassVar[int]
    LAYER_BASE_ADDRS_FIELD_NUMBER: _ClassVar[int]
    PAGE_BYTES_FIELD_NUMBER: _ClassVar[int]
    POOL_PAGES_FIELD_NUMBER: _ClassVar[int]
    PROTOCOL_FIELD_NUMBER: _ClassVar[int]
    KV_MAC_ALGORITHMS_FIELD_NUMBER: _ClassVar[int]
    WINDOW_PAGES_FIELD_NUMBER: _ClassVar[int]
    REPORT_SENDS_FIELD_NUMBER: _ClassVar[int]
    KV_CIPHER_ALGORITHMS_FIELD_NUMBER: _ClassVar[int]
    PULL_FIELD_NUMBER: _ClassVar[int]
    session_id: str
    layer_base_addrs: _containers.RepeatedScalarFieldContainer[int]
    page_bytes: int
    pool_pages: int
    protocol: str
    kv_mac_algorithms: _containers.RepeatedScalarFieldContainer[str]
    window_pages: int
    report_sends: bool
    kv_cipher_algorithms: _containers.RepeatedScalarFieldContainer[str]
    pull: bool
    def __init__(self, session_id: _Optional[str] = ..., layer_base_addrs: _Optional[_Iterable[int]] = ..., page_bytes: _Optional[int] = ..., pool_pages: _Optional[int] = ..., protocol: _Optional[str] = ..., kv_mac_algorithms: _Optional[_Iterable[str]] = ..., window_pages: _Optional[int] = ..., report_sends: _Optional[bool] = ..., kv_cipher_algorithms: _Optional[_Iterable[str]] = ..., pull: _Optional[bool] = ...) -> None: ...

class MooncakeSource(_message.Message):
    __slots__ = ("session_id", "layer_base_addrs", "page_bytes", "pool_pages")
    SESSION_ID_FIELD_NUMBER: _ClassVar[int]
    LAYER_BASE_ADDRS_FIELD_NUMBER: _ClassVar[int]
    PAGE_BYTES_FIELD_NUMBER: _ClassVar[int]
    POOL_PAGES_FIELD_NUMBER: _ClassVar[int]
    session_id: str
    layer_base_addrs: _containers.RepeatedScalarFieldContainer[int]
    page_bytes: int
    pool_pages: int
    def __init__(self, session_id: _Optional[str] = ..., layer_base_addrs: _Optional[_Iterable[int]] = ..., page_bytes: _Optional[int] = ..., pool_pages: _Optional[int] = ...) -> None: ...

class FakeDestination(_message.Message):
    __slots__ = ("pool_key",)
    POOL_KEY_FIELD_NUMBER: _ClassVar[int]
    pool_key: str
    def __init__(self, pool_key: _Optional[str] = ...) -> None: ...

class TransferEvent(_message.Message):
    __slots__ = ("seq", "accepted", "chunk", "done", "failed")
    SEQ_FIELD_NUMBER: _ClassVar[int]
    ACCEPTED_FIELD_NUMBER: _ClassVar[int]
    CHUNK_FIELD_NUMBER: _ClassVar[int]
    DONE_FIELD_NUMBER: _ClassVar[int]
    FAILED_FIELD_NUMBER: _ClassVar[int]
    seq: int
    accepted: HandshakeAck
    chunk: KVChunk
    done: TransferDone
    failed: TransferFailed
    def __init__(self, seq: _Optional[int] = ..., accepted: _Optional[_Union[HandshakeAck, _Mapping]] = ..., chunk: _Optional[_Union[KVChunk, _Mapping]] = ..., done: _Optional[_Union[TransferDone, _Mapping]] = ..., failed: _Optional[_Union[TransferFailed, _Mapping]] = ...) -> None: ...

class HandshakeAck(_message.Message):
    __slots__ = ("protocol_version", "prefill_rid", "credit_window", "kv_streams", "kv_cipher", "mooncake_source", "kv_mac", "auth")
    PROTOCOL_VERSION_FIELD_NUMBER: _ClassVar[int]
    PREFILL_RID_FIELD_NUMBER: _ClassVar[int]
    CREDIT_WINDOW_FIELD_NUMBER: _ClassVar[int]
    KV_STREAMS_FIELD_NUMBER: _ClassVar[int]
    KV_CIPHER_FIELD_NUMBER: _ClassVar[int]
    MOONCAKE_SOURCE_FIELD_NUMBER: _ClassVar[int]
    KV_MAC_FIELD_NUMBER: _ClassVar[int]
    AUTH_FIELD_NUMBER: _ClassVar[int]
    protocol_version: int
    prefill_rid: str
    credit_window: int
    kv_streams: int
    kv_cipher: str
    mooncake_source: MooncakeSource
    kv_mac: str
    auth: AuthToken
    def __init__(self, protocol_version: _Optional[int] = ..., prefill_rid: _Optional[str] = ..., credit_window: _Optional[int] = ..., kv_streams: _Optional[int] = ..., kv_cipher: _Optional[str] = ..., mooncake_source: _Optional[_Union[MooncakeSource, _Mapping]] = ..., kv_mac: _Optional[str] = ..., auth: _Optional[_Union[AuthToken, _Mapping]] = ...) -> None: ...

class KVChunk(_message.Message):
    __slots__ = ("layer_begin", "layer_end", "page_begin", "page_end", "data", "crc32", "written_directly", "source_slots")
    LAYER_BEGIN_FIELD_NUMBER: _ClassVar[int]
    LAYER_END_FIELD_NUMBER: _ClassVar[int]
    PAGE_BEGIN_FIELD_NUMBER: _ClassVar[int]
    PAGE_END_FIELD_NUMBER: _ClassVar[int]
    DATA_FIELD_NUMBER: _ClassVar[int]
    CRC32_FIELD_NUMBER: _ClassVar[int]
    WRITTEN_DIRECTLY_FIELD_NUMBER: _ClassVar[int]
    SOURCE_SLOTS_FIELD_NUMBER: _ClassVar[int]
    layer_begin: int
    layer_end: int
    page_begin: int
    page_end: int
    data: bytes
    crc32: int
    written_directly: bool
    source_slots: _containers.RepeatedScalarFieldContainer[int]
    def __init__(self, layer_begin: _Optional[int] = ..., layer_end: _Optional[int] = ..., page_begin: _Optional[int] = ..., page_end: _Optional[int] = ..., data: _Optional[bytes] = ..., crc32: _Optional[int] = ..., written_directly: _Optional[bool] = ..., source_slots: _Optional[_Iterable[int]] = ...) -> None: ...

class TransferDone(_message.Message):
    __slots__ = ("first_token_id", "first_token_logprob", "num_pages", "cached_tokens", "bytes_sent", "generator_state", "stream_chunks", "first_top_token_ids", "first_top_logprobs", "mtp_draft_token_id", "mtp_hidden", "kv_mac", "kv_mac_algorithm", "auth")
    FIRST_TOKEN_ID_FIELD_NUMBER: _ClassVar[int]
    FIRST_TOKEN_LOGPROB_FIELD_NUMBER: _ClassVar[int]
    NUM_PAGES_FIELD_NUMBER: _ClassVar[int]
    CACHED_TOKENS_FIELD_NUMBER: _ClassVar[int]
    BYTES_SENT_FIELD_NUMBER: _ClassVar[int]
    GENERATOR_STATE_FIELD_NUMBER: _ClassVar[int]
    STREAM_CHUNKS_FIELD_NUMBER: _ClassVar[int]
    FIRST_TOP_TOKEN_IDS_FIELD_NUMBER: _ClassVar[int]
    FIRST_TOP_LOGPROBS_FIELD_NUMBER: _ClassVar[int]
    MTP_DRAFT_TOKEN_ID_FIELD_NUMBER: _ClassVar[int]
    MTP_HIDDEN_FIELD_NUMBER: _ClassVar[int]
    KV_MAC_FIELD_NUMBER: _ClassVar[int]
    KV_MAC_ALGORITHM_FIELD_NUMBER: _ClassVar[int]
    AUTH_FIELD_NUMBER: _ClassVar[int]
    first_token_id: int
    first_token_logprob: float
    num_pages: int
    cached_tokens: int
    bytes_sent: int
    generator_state: bytes
    stream_chunks: _containers.RepeatedScalarFieldContainer[int]
    first_top_token_ids: _containers.RepeatedScalarFieldContainer[int]
    first_top_logprobs: _containers.RepeatedScalarFieldContainer[float]
    mtp_draft_token_id: int
    mtp_hidden: _containers.RepeatedScalarFieldContainer[float]
    kv_mac: bytes
    kv_mac_algorithm: str
    auth: AuthToken
    def __init__(self, first_token_id: _Optional[int] = ..., first_token_logprob: _Optional[float] = ..., num_pages: _Optional[int] = ..., cached_tokens: _Optional[int] = ..., bytes_sent: _Optional[int] = ..., generator_state: _Optional[bytes] = ..., stream_chunks: _Optional[_Iterable[int]] = ..., first_top_token_ids: _Optional[_Iterable[int]] = ..., first_top_logprobs: _Optional[_Iterable[float]] = ..., mtp_draft_token_id: _Optional[int] = ..., mtp_hidden: _Optional[_Iterable[float]] = ..., kv_mac: _Optional[bytes] = ..., kv_mac_algorithm: _Optional[str] = ..., auth: _Optional[_Union[AuthToken, _Mapping]] = ...) -> None: ...

class TransferFailed(_message.Message):
    __slots__ = ("code", "reason")
    CODE_FIELD_NUMBER: _ClassVar[int]
    REASON_FIELD_NUMBER: _ClassVar[int]
    code: FailureCode
    reason: str
    def __init__(self, code: _Optional[_Union[FailureCode, str]] = ..., reason: _Optional[str] = ...) -> None: ...

class AbortRoom(_message.Message):
    __slots__ = ("room", "reason", "auth")
    ROOM_FIELD_NUMBER: _ClassVar[int]
    REASON_FIELD_NUMBER: _ClassVar[int]
    AUTH_FIELD_NUMBER: _ClassVar[int]
    room: int
    reason: str
    auth: AuthToken
    def __init__(self, room: _Optional[int] = ..., reason: _Optional[str] = ..., auth: _Optional[_Union[AuthToken, _Mapping]] = ...) -> None: ...

class AbortAck(_message.Message):
    __slots__ = ("found",)
    FOUND_FIELD_NUMBER: _ClassVar[int]
    found: bool
    def __init__(self, found: _Optional[bool] = ...) -> None: ...

class RouteRequest(_message.Message):
    __slots__ = ("auth",)
    AUTH_FIELD_NUMBER: _ClassVar[int]
    auth: AuthToken
    def __init__(self, auth: _Optional[_Union[AuthToken, _Mapping]] = ...) -> None: ...

class RankEndpoint(_message.Message):
    __slots__ = ("host", "port")
    HOST_FIELD_NUMBER: _ClassVar[int]
    PORT_FIELD_NUMBER: _ClassVar[int]
    host: str
    port: int
    def __init__(self, host: _Optional[str] = ..., port: _Optional[int] = ...) -> None: ...

class RouteReply(_message.Message):
    __slots__ = ("dp_size", "ranks", "auth")
    DP_SIZE_FIELD_NUMBER: _ClassVar[int]
    RANKS_FIELD_NUMBER: _ClassVar[int]
    AUTH_FIELD_NUMBER: _ClassVar[int]
    dp_size: int
    ranks: _containers.RepeatedCompositeFieldContainer[RankEndpoint]
    auth: AuthToken
    def __init__(self, dp_size: _Optional[int] = ..., ranks: _Optional[_Iterable[_Union[RankEndpoint, _Mapping]]] = ..., auth: _Optional[_Union[AuthToken, _Mapping]] = ...) -> None: ...

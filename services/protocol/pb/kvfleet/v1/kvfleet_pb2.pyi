from google.protobuf.internal import containers as _containers
from google.protobuf.internal import enum_type_wrapper as _enum_type_wrapper
from google.protobuf import descriptor as _descriptor
from google.protobuf import message as _message
from collections.abc import Iterable as _Iterable, Mapping as _Mapping
from typing import ClassVar as _ClassVar, Optional as _Optional, Union as _Union

DESCRIPTOR: _descriptor.FileDescriptor

class Reason(int, metaclass=_enum_type_wrapper.EnumTypeWrapper):
    __slots__ = ()
    REASON_UNSPECIFIED: _ClassVar[Reason]
    INVALID_REQUEST: _ClassVar[Reason]
    OVERLOADED: _ClassVar[Reason]
    UNAVAILABLE: _ClassVar[Reason]
    ENGINE_FAILED: _ClassVar[Reason]
    KV_TRANSFER_FAILED: _ClassVar[Reason]
    NO_RESERVATION: _ClassVar[Reason]
    WRONG_ROLE: _ClassVar[Reason]
    SHUTTING_DOWN: _ClassVar[Reason]
    UNAUTHENTICATED: _ClassVar[Reason]

class OverloadStage(int, metaclass=_enum_type_wrapper.EnumTypeWrapper):
    __slots__ = ()
    S0_NORMAL: _ClassVar[OverloadStage]
    S1_NO_BATCH: _ClassVar[OverloadStage]
    S2_CAP_OUTPUT: _ClassVar[OverloadStage]
    S3_FALLBACK: _ClassVar[OverloadStage]
    S4_REJECT: _ClassVar[OverloadStage]

class KVFailure(int, metaclass=_enum_type_wrapper.EnumTypeWrapper):
    __slots__ = ()
    KV_FAILURE_UNSPECIFIED: _ClassVar[KVFailure]
    KV_CHECKSUM_MISMATCH: _ClassVar[KVFailure]
    KV_LAYOUT_MISMATCH: _ClassVar[KVFailure]
    KV_CLOSED: _ClassVar[KVFailure]
    KV_TIMEOUT: _ClassVar[KVFailure]
    KV_DEADLINE: _ClassVar[KVFailure]
    KV_PEER_GONE: _ClassVar[KVFailure]
    KV_REFUSED: _ClassVar[KVFailure]
    KV_OTHER: _ClassVar[KVFailure]
REASON_UNSPECIFIED: Reason
INVALID_REQUEST: Reason
OVERLOADED: Reason
UNAVAILABLE: Reason
ENGINE_FAILED: Reason
KV_TRANSFER_FAILED: Reason
NO_RESERVATION: Reason
WRONG_ROLE: Reason
SHUTTING_DOWN: Reason
UNAUTHENTICATED: Reason
S0_NORMAL: OverloadStage
S1_NO_BATCH: OverloadStage
S2_CAP_OUTPUT: OverloadStage
S3_FALLBACK: OverloadStage
S4_REJECT: OverloadStage
KV_FAILURE_UNSPECIFIED: KVFailure
KV_CHECKSUM_MISMATCH: KVFailure
KV_LAYOUT_MISMATCH: KVFailure
KV_CLOSED: KVFailure
KV_TIMEOUT: KVFailure
KV_DEADLINE: KVFailure
KV_PEER_GONE: KVFailure
KV_REFUSED: KVFailure
KV_OTHER: KVFailure

class SamplingParams(_message.Message):
    __slots__ = ("max_tokens", "temperature", "top_k", "top_p", "seed", "stop", "stop_token_ids", "ignore_eos", "logprobs", "prompt_logprobs", "repetition_penalty", "presence_penalty", "frequency_penalty", "min_p", "min_tokens", "logit_bias", "include_stop_str_in_output", "skip_special_tokens", "spaces_between_special_tokens", "n", "priority")
    class LogitBiasEntry(_message.Message):
        __slots__ = ("key", "value")
        KEY_FIELD_NUMBER: _ClassVar[int]
        VALUE_FIELD_NUMBER: _ClassVar[int]
        key: int
        value: float
        def __init__(self, key: _Optional[int] = ..., value: _Optional[float] = ...) -> None: ...
    MAX_TOKENS_FIELD_NUMBER: _ClassVar[int]
    TEMPERATURE_FIELD_NUMBER: _ClassVar[int]
    TOP_K_FIELD_NUMBER: _ClassVar[int]
    TOP_P_FIELD_NUMBER: _ClassVar[int]
    SEED_FIELD_NUMBER: _ClassVar[int]
    STOP_FIELD_NUMBER: _ClassVar[int]
    STOP_TOKEN_IDS_FIELD_NUMBER: _ClassVar[int]
    IGNORE_EOS_FIELD_NUMBER: _ClassVar[int]
    LOGPROBS_FIELD_NUMBER: _ClassVar[int]
    PROMPT_LOGPROBS_FIELD_NUMBER: _ClassVar[int]
    REPETITION_PENALTY_FIELD_NUMBER: _ClassVar[int]
    PRESENCE_PENALTY_FIELD_NUMBER: _ClassVar[int]
    FREQUENCY_PENALTY_FIELD_NUMBER: _ClassVar[int]
    MIN_P_FIELD_NUMBER: _ClassVar[int]
    MIN_TOKENS_FIELD_NUMBER: _ClassVar[int]
    LOGIT_BIAS_FIELD_NUMBER: _ClassVar[int]
    INCLUDE_STOP_STR_IN_OUTPUT_FIELD_NUMBER: _ClassVar[int]
    SKIP_SPECIAL_TOKENS_FIELD_NUMBER: _ClassVar[int]
    SPACES_BETWEEN_SPECIAL_TOKENS_FIELD_NUMBER: _ClassVar[int]
    N_FIELD_NUMBER: _ClassVar[int]
    PRIORITY_FIELD_NUMBER: _ClassVar[int]
    max_tokens: int
    temperature: float
    top_k: int
    top_p: float
    seed: int
    stop: _containers.RepeatedScalarFieldContainer[str]
    stop_token_ids: _containers.RepeatedScalarFieldContainer[int]
    ignore_eos: bool
    logprobs: int
    prompt_logprobs: int
    repetition_penalty: float
    presence_penalty: float
    frequency_penalty: float
    min_p: float
    min_tokens: int
    logit_bias: _containers.ScalarMap[int, float]
    include_stop_str_in_output: bool
    skip_special_tokens: bool
    spaces_between_special_tokens: bool
    n: int
    priority: int
    def __init__(self, max_tokens: _Optional[int] = ..., temperature: _Optional[float] = ..., top_k: _Optional[int] = ..., top_p: _Optional[float] = ..., seed: _Optional[int] = ..., stop: _Optional[_Iterable[str]] = ..., stop_token_ids: _Optional[_Iterable[int]] = ..., ignore_eos: _Optional[bool] = ..., logprobs: _Optional[int] = ..., prompt_logprobs: _Optional[int] = ..., repetition_penalty: _Optional[float] = ..., presence_penalty: _Optional[float] = ..., frequency_penalty: _Optional[float] = ..., min_p: _Optional[float] = ..., min_tokens: _Optional[int] = ..., logit_bias: _Optional[_Mapping[int, float]] = ..., include_stop_str_in_output: _Optional[bool] = ..., skip_special_tokens: _Optional[bool] = ..., spaces_between_special_tokens: _Optional[bool] = ..., n: _Optional[int] = ..., priority: _Optional[int] = ...) -> None: ...

class TopLogprob(_message.Message):
    __slots__ = ("token_id", "logprob")
    TOKEN_ID_FIELD_NUMBER: _ClassVar[int]
    LOGPROB_FIELD_NUMBER: _ClassVar[int]
    token_id: int
    logprob: float
    def __init__(self, token_id: _Optional[int] = ..., logprob: _Optional[float] = ...) -> None: ...

class TokenLogprob(_message.Message):
    __slots__ = ("token_id", "logprob", "top")
    TOKEN_ID_FIELD_NUMBER: _ClassVar[int]
    LOGPROB_FIELD_NUMBER: _ClassVar[int]
    TOP_FIELD_NUMBER: _ClassVar[int]
    token_id: int
    logprob: float
    top: _containers.RepeatedCompositeFieldContainer[TopLogprob]
    def __init__(self, token_id: _Optional[int] = ..., logprob: _Optional[float] = ..., top: _Optional[_Iterable[_Union[TopLogprob, _Mapping]]] = ...) -> None: ...

class TokenChunk(_message.Message):
    __slots__ = ("request_id", "token_ids", "text", "logprobs", "finished", "finish_reason", "stop_reason", "error", "prompt_logprobs", "num_prompt_tokens", "num_output_tokens", "served_by", "timing", "index", "num_cached_tokens")
    REQUEST_ID_FIELD_NUMBER: _ClassVar[int]
    TOKEN_IDS_FIELD_NUMBER: _ClassVar[int]
    TEXT_FIELD_NUMBER: _ClassVar[int]
    LOGPROBS_FIELD_NUMBER: _ClassVar[int]
    FINISHED_FIELD_NUMBER: _ClassVar[int]
    FINISH_REASON_FIELD_NUMBER: _ClassVar[int]
    STOP_REASON_FIELD_NUMBER: _ClassVar[int]
    ERROR_FIELD_NUMBER: _ClassVar[int]
    PROMPT_LOGPROBS_FIELD_NUMBER: _ClassVar[int]
    NUM_PROMPT_TOKENS_FIELD_NUMBER: _ClassVar[int]
    NUM_OUTPUT_TOKENS_FIELD_NUMBER: _ClassVar[int]
    SERVED_BY_FIELD_NUMBER: _ClassVar[int]
    TIMING_FIELD_NUMBER: _ClassVar[int]
    INDEX_FIELD_NUMBER: _ClassVar[int]
    NUM_CACHED_TOKENS_FIELD_NUMBER: _ClassVar[int]
    request_id: str
    token_ids: _containers.RepeatedScalarFieldContainer[int]
    text: str
    logprobs: _containers.RepeatedCompositeFieldContainer[TokenLogprob]
    finished: bool
    finish_reason: str
    stop_reason: str
    error: str
    prompt_logprobs: _containers.RepeatedCompositeFieldContainer[TokenLogprob]
    num_prompt_tokens: int
    num_output_tokens: int
    served_by: str
    timing: RequestTiming
    index: int
    num_cached_tokens: int
    def __init__(self, request_id: _Optional[str] = ..., token_ids: _Optional[_Iterable[int]] = ..., text: _Optional[str] = ..., logprobs: _Optional[_Iterable[_Union[TokenLogprob, _Mapping]]] = ..., finished: _Optional[bool] = ..., finish_reason: _Optional[str] = ..., stop_reason: _Optional[str] = ..., error: _Optional[str] = ..., prompt_logprobs: _Optional[_Iterable[_Union[TokenLogprob, _Mapping]]] = ..., num_prompt_tokens: _Optional[int] = ..., num_output_tokens: _Optional[int] = ..., served_by: _Optional[str] = ..., timing: _Optional[_Union[RequestTiming, _Mapping]] = ..., index: _Optional[int] = ..., num_cached_tokens: _Optional[int] = ...) -> None: ...

class RequestTiming(_message.Message):
    __slots__ = ("queue_s", "prefill_s", "transfer_s", "decode_s", "pool")
    QUEUE_S_FIELD_NUMBER: _ClassVar[int]
    PREFILL_S_FIELD_NUMBER: _ClassVar[int]
    TRANSFER_S_FIELD_NUMBER: _ClassVar[int]
    DECODE_S_FIELD_NUMBER: _ClassVar[int]
    POOL_FIELD_NUMBER: _ClassVar[int]
    queue_s: float
    prefill_s: float
    transfer_s: float
    decode_s: float
    pool: str
    def __init__(self, queue_s: _Optional[float] = ..., prefill_s: _Optional[float] = ..., transfer_s: _Optional[float] = ..., decode_s: _Optional[float] = ..., pool: _Optional[str] = ...) -> None: ...

class CallStatus(_message.Message):
    __slots__ = ("reason", "code", "param", "message", "retry_after_s", "stage")
    REASON_FIELD_NUMBER: _ClassVar[int]
    CODE_FIELD_NUMBER: _ClassVar[int]
    PARAM_FIELD_NUMBER: _ClassVar[int]
    MESSAGE_FIELD_NUMBER: _ClassVar[int]
    RETRY_AFTER_S_FIELD_NUMBER: _ClassVar[int]
    STAGE_FIELD_NUMBER: _ClassVar[int]
    reason: Reason
    code: str
    param: str
    message: str
    retry_after_s: float
    stage: OverloadStage
    def __init__(self, reason: _Optional[_Union[Reason, str]] = ..., code: _Optional[str] = ..., param: _Optional[str] = ..., message: _Optional[str] = ..., retry_after_s: _Optional[float] = ..., stage: _Optional[_Union[OverloadStage, str]] = ...) -> None: ...

class CancelRequest(_message.Message):
    __slots__ = ("request_id", "sample_index", "reservation_deadline_unix_s")
    REQUEST_ID_FIELD_NUMBER: _ClassVar[int]
    SAMPLE_INDEX_FIELD_NUMBER: _ClassVar[int]
    RESERVATION_DEADLINE_UNIX_S_FIELD_NUMBER: _ClassVar[int]
    request_id: str
    sample_index: int
    reservation_deadline_unix_s: float
    def __init__(self, request_id: _Optional[str] = ..., sample_index: _Optional[int] = ..., reservation_deadline_unix_s: _Optional[float] = ...) -> None: ...

class CancelResponse(_message.Message):
    __slots__ = ("cancelled",)
    CANCELLED_FIELD_NUMBER: _ClassVar[int]
    cancelled: bool
    def __init__(self, cancelled: _Optional[bool] = ...) -> None: ...

class HealthRequest(_message.Message):
    __slots__ = ()
    def __init__(self) -> None: ...

class HealthResponse(_message.Message):
    __slots__ = ("status", "detail")
    class Status(int, metaclass=_enum_type_wrapper.EnumTypeWrapper):
        __slots__ = ()
        UNKNOWN: _ClassVar[HealthResponse.Status]
        SERVING: _ClassVar[HealthResponse.Status]
        NOT_SERVING: _ClassVar[HealthResponse.Status]
    UNKNOWN: HealthResponse.Status
    SERVING: HealthResponse.Status
    NOT_SERVING: HealthResponse.Status
    STATUS_FIELD_NUMBER: _ClassVar[int]
    DETAIL_FIELD_NUMBER: _ClassVar[int]
    status: HealthResponse.Status
    detail: str
    def __init__(self, status: _Optional[_Union[HealthResponse.Status, str]] = ..., detail: _Optional[str] = ...) -> None: ...

class TokenIds(_message.Message):
    __slots__ = ("ids",)
    IDS_FIELD_NUMBER: _ClassVar[int]
    ids: _containers.RepeatedScalarFieldContainer[int]
    def __init__(self, ids: _Optional[_Iterable[int]] = ...) -> None: ...

class GenerateRequest(_message.Message):
    __slots__ = ("model", "text", "token_ids", "params", "request_id", "traffic_class", "user")
    MODEL_FIELD_NUMBER: _ClassVar[int]
    TEXT_FIELD_NUMBER: _ClassVar[int]
    TOKEN_IDS_FIELD_NUMBER: _ClassVar[int]
    PARAMS_FIELD_NUMBER: _ClassVar[int]
    REQUEST_ID_FIELD_NUMBER: _ClassVar[int]
    TRAFFIC_CLASS_FIELD_NUMBER: _ClassVar[int]
    USER_FIELD_NUMBER: _ClassVar[int]
    model: str
    text: str
    token_ids: TokenIds
    params: SamplingParams
    request_id: str
    traffic_class: str
    user: str
    def __init__(self, model: _Optional[str] = ..., text: _Optional[str] = ..., token_ids: _Optional[_Union[TokenIds, _Mapping]] = ..., params: _Optional[_Union[SamplingParams, _Mapping]] = ..., request_id: _Optional[str] = ..., traffic_class: _Optional[str] = ..., user: _Optional[str] = ...) -> None: ...

class ModelCard(_message.Message):
    __slots__ = ("id", "max_model_len", "quality_version")
    ID_FIELD_NUMBER: _ClassVar[int]
    MAX_MODEL_LEN_FIELD_NUMBER: _ClassVar[int]
    QUALITY_VERSION_FIELD_NUMBER: _ClassVar[int]
    id: str
    max_model_len: int
    quality_version: str
    def __init__(self, id: _Optional[str] = ..., max_model_len: _Optional[int] = ..., quality_version: _Optional[str] = ...) -> None: ...

class ListModelsRequest(_message.Message):
    __slots__ = ()
    def __init__(self) -> None: ...

class ListModelsResponse(_message.Message):
    __slots__ = ("models",)
    MODELS_FIELD_NUMBER: _ClassVar[int]
    models: _containers.RepeatedCompositeFieldContainer[ModelCard]
    def __init__(self, models: _Optional[_Iterable[_Union[ModelCard, _Mapping]]] = ...) -> None: ...

class WorkRequest(_message.Message):
    __slots__ = ("request_id", "tenant", "traffic_class", "prompt_token_ids", "params", "degradable")
    REQUEST_ID_FIELD_NUMBER: _ClassVar[int]
    TENANT_FIELD_NUMBER: _ClassVar[int]
    TRAFFIC_CLASS_FIELD_NUMBER: _ClassVar[int]
    PROMPT_TOKEN_IDS_FIELD_NUMBER: _ClassVar[int]
    PARAMS_FIELD_NUMBER: _ClassVar[int]
    DEGRADABLE_FIELD_NUMBER: _ClassVar[int]
    request_id: str
    tenant: str
    traffic_class: str
    prompt_token_ids: _containers.RepeatedScalarFieldContainer[int]
    params: SamplingParams
    degradable: bool
    def __init__(self, request_id: _Optional[str] = ..., tenant: _Optional[str] = ..., traffic_class: _Optional[str] = ..., prompt_token_ids: _Optional[_Iterable[int]] = ..., params: _Optional[_Union[SamplingParams, _Mapping]] = ..., degradable: _Optional[bool] = ...) -> None: ...

class WorkerRef(_message.Message):
    __slots__ = ("worker_id", "address")
    WORKER_ID_FIELD_NUMBER: _ClassVar[int]
    ADDRESS_FIELD_NUMBER: _ClassVar[int]
    worker_id: str
    address: str
    def __init__(self, worker_id: _Optional[str] = ..., address: _Optional[str] = ...) -> None: ...

class Plan(_message.Message):
    __slots__ = ("request_id", "mode", "prefill", "decode", "target", "deadline_unix_s", "router_id", "predicted_ttft_s", "stage", "predicted_wait_s", "predicted_prefill_s", "predicted_transfer_s", "predicted_decode_wait_s", "pool", "model", "quality_version", "output_cap", "queue_wait_s")
    class Mode(int, metaclass=_enum_type_wrapper.EnumTypeWrapper):
        __slots__ = ()
        MODE_UNSPECIFIED: _ClassVar[Plan.Mode]
        COLOCATED: _ClassVar[Plan.Mode]
        DISAGGREGATED: _ClassVar[Plan.Mode]
    MODE_UNSPECIFIED: Plan.Mode
    COLOCATED: Plan.Mode
    DISAGGREGATED: Plan.Mode
    REQUEST_ID_FIELD_NUMBER: _ClassVar[int]
    MODE_FIELD_NUMBER: _ClassVar[int]
    PREFILL_FIELD_NUMBER: _ClassVar[int]
    DECODE_FIELD_NUMBER: _ClassVar[int]
    TARGET_FIELD_NUMBER: _ClassVar[int]
    DEADLINE_UNIX_S_FIELD_NUMBER: _ClassVar[int]
    ROUTER_ID_FIELD_NUMBER: _ClassVar[int]
    PREDICTED_TTFT_S_FIELD_NUMBER: _ClassVar[int]
    STAGE_FIELD_NUMBER: _ClassVar[int]
    PREDICTED_WAIT_S_FIELD_NUMBER: _ClassVar[int]
    PREDICTED_PREFILL_S_FIELD_NUMBER: _ClassVar[int]
    PREDICTED_TRANSFER_S_FIELD_NUMBER: _ClassVar[int]
    PREDICTED_DECODE_WAIT_S_FIELD_NUMBER: _ClassVar[int]
    POOL_FIELD_NUMBER: _ClassVar[int]
    MODEL_FIELD_NUMBER: _ClassVar[int]
    QUALITY_VERSION_FIELD_NUMBER: _ClassVar[int]
    OUTPUT_CAP_FIELD_NUMBER: _ClassVar[int]
    QUEUE_WAIT_S_FIELD_NUMBER: _ClassVar[int]
    request_id: str
    mode: Plan.Mode
    prefill: _containers.RepeatedCompositeFieldContainer[WorkerRef]
    decode: WorkerRef
    target: KVDescriptor
    deadline_unix_s: float
    router_id: str
    predicted_ttft_s: float
    stage: OverloadStage
    predicted_wait_s: float
    predicted_prefill_s: float
    predicted_transfer_s: float
    predicted_decode_wait_s: float
    pool: str
    model: str
    quality_version: str
    output_cap: int
    queue_wait_s: float
    def __init__(self, request_id: _Optional[str] = ..., mode: _Optional[_Union[Plan.Mode, str]] = ..., prefill: _Optional[_Iterable[_Union[WorkerRef, _Mapping]]] = ..., decode: _Optional[_Union[WorkerRef, _Mapping]] = ..., target: _Optional[_Union[KVDescriptor, _Mapping]] = ..., deadline_unix_s: _Optional[float] = ..., router_id: _Optional[str] = ..., predicted_ttft_s: _Optional[float] = ..., stage: _Optional[_Union[OverloadStage, str]] = ..., predicted_wait_s: _Optional[float] = ..., predicted_prefill_s: _Optional[float] = ..., predicted_transfer_s: _Optional[float] = ..., predicted_decode_wait_s: _Optional[float] = ..., pool: _Optional[str] = ..., model: _Optional[str] = ..., quality_version: _Optional[str] = ..., output_cap: _Optional[int] = ..., queue_wait_s: _Optional[float] = ...) -> None: ...

class CallTerms(_message.Message):
    __slots__ = ("timeout_s", "trace")
    class TraceEntry(_message.Message):
        __slots__ = ("key", "value")
        KEY_FIELD_NUMBER: _ClassVar[int]
        VALUE_FIELD_NUMBER: _ClassVar[int]
        key: str
        value: str
        def __init__(self, key: _Optional[str] = ..., value: _Optional[str] = ...) -> None: ...
    TIMEOUT_S_FIELD_NUMBER: _ClassVar[int]
    TRACE_FIELD_NUMBER: _ClassVar[int]
    timeout_s: float
    trace: _containers.ScalarMap[str, str]
    def __init__(self, timeout_s: _Optional[float] = ..., trace: _Optional[_Mapping[str, str]] = ...) -> None: ...

class AdmitAsk(_message.Message):
    __slots__ = ("request", "terms", "cancel")
    REQUEST_FIELD_NUMBER: _ClassVar[int]
    TERMS_FIELD_NUMBER: _ClassVar[int]
    CANCEL_FIELD_NUMBER: _ClassVar[int]
    request: WorkRequest
    terms: CallTerms
    cancel: bool
    def __init__(self, request: _Optional[_Union[WorkRequest, _Mapping]] = ..., terms: _Optional[_Union[CallTerms, _Mapping]] = ..., cancel: _Optional[bool] = ...) -> None: ...

class AdmitAnswer(_message.Message):
    __slots__ = ("request_id", "plan", "failure")
    REQUEST_ID_FIELD_NUMBER: _ClassVar[int]
    PLAN_FIELD_NUMBER: _ClassVar[int]
    FAILURE_FIELD_NUMBER: _ClassVar[int]
    request_id: str
    plan: Plan
    failure: CallStatus
    def __init__(self, request_id: _Optional[str] = ..., plan: _Optional[_Union[Plan, _Mapping]] = ..., failure: _Optional[_Union[CallStatus, _Mapping]] = ...) -> None: ...

class KVLayout(_message.Message):
    __slots__ = ("num_layers", "block_size", "kv_heads", "head_dim", "dtype", "tensor_parallel_size", "k_scale", "v_scale")
    NUM_LAYERS_FIELD_NUMBER: _ClassVar[int]
    BLOCK_SIZE_FIELD_NUMBER: _ClassVar[int]
    KV_HEADS_FIELD_NUMBER: _ClassVar[int]
    HEAD_DIM_FIELD_NUMBER: _ClassVar[int]
    DTYPE_FIELD_NUMBER: _ClassVar[int]
    TENSOR_PARALLEL_SIZE_FIELD_NUMBER: _ClassVar[int]
    K_SCALE_FIELD_NUMBER: _ClassVar[int]
    V_SCALE_FIELD_NUMBER: _ClassVar[int]
    num_layers: int
    block_size: int
    kv_heads: int
    head_dim: int
    dtype: str
    tensor_parallel_size: int
    k_scale: float
    v_scale: float
    def __init__(self, num_layers: _Optional[int] = ..., block_size: _Optional[int] = ..., kv_heads: _Optional[int] = ..., head_dim: _Optional[int] = ..., dtype: _Optional[str] = ..., tensor_parallel_size: _Optional[int] = ..., k_scale: _Optional[float] = ..., v_scale: _Optional[float] = ...) -> None: ...

class NixlTarget(_message.Message):
    __slots__ = ("agent", "base", "num_blocks", "mem", "device")
    AGENT_FIELD_NUMBER: _ClassVar[int]
    BASE_FIELD_NUMBER: _ClassVar[int]
    NUM_BLOCKS_FIELD_NUMBER: _ClassVar[int]
    MEM_FIELD_NUMBER: _ClassVar[int]
    DEVICE_FIELD_NUMBER: _ClassVar[int]
    agent: str
    base: int
    num_blocks: int
    mem: str
    device: int
    def __init__(self, agent: _Optional[str] = ..., base: _Optional[int] = ..., num_blocks: _Optional[int] = ..., mem: _Optional[str] = ..., device: _Optional[int] = ...) -> None: ...

class KVDescriptor(_message.Message):
    __slots__ = ("worker_id", "backend", "agent_metadata", "address", "block_ids", "bytes_per_block", "layout", "nixl")
    WORKER_ID_FIELD_NUMBER: _ClassVar[int]
    BACKEND_FIELD_NUMBER: _ClassVar[int]
    AGENT_METADATA_FIELD_NUMBER: _ClassVar[int]
    ADDRESS_FIELD_NUMBER: _ClassVar[int]
    BLOCK_IDS_FIELD_NUMBER: _ClassVar[int]
    BYTES_PER_BLOCK_FIELD_NUMBER: _ClassVar[int]
    LAYOUT_FIELD_NUMBER: _ClassVar[int]
    NIXL_FIELD_NUMBER: _ClassVar[int]
    worker_id: str
    backend: str
    agent_metadata: bytes
    address: str
    block_ids: _containers.RepeatedScalarFieldContainer[int]
    bytes_per_block: int
    layout: KVLayout
    nixl: NixlTarget
    def __init__(self, worker_id: _Optional[str] = ..., backend: _Optional[str] = ..., agent_metadata: _Optional[bytes] = ..., address: _Optional[str] = ..., block_ids: _Optional[_Iterable[int]] = ..., bytes_per_block: _Optional[int] = ..., layout: _Optional[_Union[KVLayout, _Mapping]] = ..., nixl: _Optional[_Union[NixlTarget, _Mapping]] = ...) -> None: ...

class HandOff(_message.Message):
    __slots__ = ("request_id", "first_token", "first_logprob", "num_prompt_tokens", "sent_at_unix_s", "more_first_tokens")
    REQUEST_ID_FIELD_NUMBER: _ClassVar[int]
    FIRST_TOKEN_FIELD_NUMBER: _ClassVar[int]
    FIRST_LOGPROB_FIELD_NUMBER: _ClassVar[int]
    NUM_PROMPT_TOKENS_FIELD_NUMBER: _ClassVar[int]
    SENT_AT_UNIX_S_FIELD_NUMBER: _ClassVar[int]
    MORE_FIRST_TOKENS_FIELD_NUMBER: _ClassVar[int]
    request_id: str
    first_token: int
    first_logprob: TokenLogprob
    num_prompt_tokens: int
    sent_at_unix_s: float
    more_first_tokens: _containers.RepeatedScalarFieldContainer[int]
    def __init__(self, request_id: _Optional[str] = ..., first_token: _Optional[int] = ..., first_logprob: _Optional[_Union[TokenLogprob, _Mapping]] = ..., num_prompt_tokens: _Optional[int] = ..., sent_at_unix_s: _Optional[float] = ..., more_first_tokens: _Optional[_Iterable[int]] = ...) -> None: ...

class KVNotice(_message.Message):
    __slots__ = ("transfer_id", "crc32", "hand_off")
    TRANSFER_ID_FIELD_NUMBER: _ClassVar[int]
    CRC32_FIELD_NUMBER: _ClassVar[int]
    HAND_OFF_FIELD_NUMBER: _ClassVar[int]
    transfer_id: str
    crc32: int
    hand_off: HandOff
    def __init__(self, transfer_id: _Optional[str] = ..., crc32: _Optional[int] = ..., hand_off: _Optional[_Union[HandOff, _Mapping]] = ...) -> None: ...

class KVTransferHeader(_message.Message):
    __slots__ = ("token", "transfer_id", "layout", "block_ids", "nbytes", "crc32", "timeout_s", "hand_off")
    TOKEN_FIELD_NUMBER: _ClassVar[int]
    TRANSFER_ID_FIELD_NUMBER: _ClassVar[int]
    LAYOUT_FIELD_NUMBER: _ClassVar[int]
    BLOCK_IDS_FIELD_NUMBER: _ClassVar[int]
    NBYTES_FIELD_NUMBER: _ClassVar[int]
    CRC32_FIELD_NUMBER: _ClassVar[int]
    TIMEOUT_S_FIELD_NUMBER: _ClassVar[int]
    HAND_OFF_FIELD_NUMBER: _ClassVar[int]
    token: str
    transfer_id: str
    layout: KVLayout
    block_ids: _containers.RepeatedScalarFieldContainer[int]
    nbytes: int
    crc32: int
    timeout_s: float
    hand_off: HandOff
    def __init__(self, token: _Optional[str] = ..., transfer_id: _Optional[str] = ..., layout: _Optional[_Union[KVLayout, _Mapping]] = ..., block_ids: _Optional[_Iterable[int]] = ..., nbytes: _Optional[int] = ..., crc32: _Optional[int] = ..., timeout_s: _Optional[float] = ..., hand_off: _Optional[_Union[HandOff, _Mapping]] = ...) -> None: ...

class KVTransferReply(_message.Message):
    __slots__ = ("error", "failure")
    ERROR_FIELD_NUMBER: _ClassVar[int]
    FAILURE_FIELD_NUMBER: _ClassVar[int]
    error: str
    failure: KVFailure
    def __init__(self, error: _Optional[str] = ..., failure: _Optional[_Union[KVFailure, str]] = ...) -> None: ...

class ReserveRequest(_message.Message):
    __slots__ = ("request_id", "tenant", "traffic_class", "prompt_token_ids", "params")
    REQUEST_ID_FIELD_NUMBER: _ClassVar[int]
    TENANT_FIELD_NUMBER: _ClassVar[int]
    TRAFFIC_CLASS_FIELD_NUMBER: _ClassVar[int]
    PROMPT_TOKEN_IDS_FIELD_NUMBER: _ClassVar[int]
    PARAMS_FIELD_NUMBER: _ClassVar[int]
    request_id: str
    tenant: str
    traffic_class: str
    prompt_token_ids: _containers.RepeatedScalarFieldContainer[int]
    params: SamplingParams
    def __init__(self, request_id: _Optional[str] = ..., tenant: _Optional[str] = ..., traffic_class: _Optional[str] = ..., prompt_token_ids: _Optional[_Iterable[int]] = ..., params: _Optional[_Union[SamplingParams, _Mapping]] = ...) -> None: ...

class ReserveResponse(_message.Message):
    __slots__ = ("accepted", "reason", "target", "expires_at_unix_s", "request_id")
    ACCEPTED_FIELD_NUMBER: _ClassVar[int]
    REASON_FIELD_NUMBER: _ClassVar[int]
    TARGET_FIELD_NUMBER: _ClassVar[int]
    EXPIRES_AT_UNIX_S_FIELD_NUMBER: _ClassVar[int]
    REQUEST_ID_FIELD_NUMBER: _ClassVar[int]
    accepted: bool
    reason: str
    target: KVDescriptor
    expires_at_unix_s: float
    request_id: str
    def __init__(self, accepted: _Optional[bool] = ..., reason: _Optional[str] = ..., target: _Optional[_Union[KVDescriptor, _Mapping]] = ..., expires_at_unix_s: _Optional[float] = ..., request_id: _Optional[str] = ...) -> None: ...

class ReserveAsk(_message.Message):
    __slots__ = ("request", "terms", "cancel")
    REQUEST_FIELD_NUMBER: _ClassVar[int]
    TERMS_FIELD_NUMBER: _ClassVar[int]
    CANCEL_FIELD_NUMBER: _ClassVar[int]
    request: ReserveRequest
    terms: CallTerms
    cancel: bool
    def __init__(self, request: _Optional[_Union[ReserveRequest, _Mapping]] = ..., terms: _Optional[_Union[CallTerms, _Mapping]] = ..., cancel: _Optional[bool] = ...) -> None: ...

class ReserveAnswer(_message.Message):
    __slots__ = ("request_id", "response", "failure")
    REQUEST_ID_FIELD_NUMBER: _ClassVar[int]
    RESPONSE_FIELD_NUMBER: _ClassVar[int]
    FAILURE_FIELD_NUMBER: _ClassVar[int]
    request_id: str
    response: ReserveResponse
    failure: CallStatus
    def __init__(self, request_id: _Optional[str] = ..., response: _Optional[_Union[ReserveResponse, _Mapping]] = ..., failure: _Optional[_Union[CallStatus, _Mapping]] = ...) -> None: ...

class PrefillRequest(_message.Message):
    __slots__ = ("request_id", "tenant", "traffic_class", "prompt_token_ids", "params", "target", "kv_deadline_unix_s")
    REQUEST_ID_FIELD_NUMBER: _ClassVar[int]
    TENANT_FIELD_NUMBER: _ClassVar[int]
    TRAFFIC_CLASS_FIELD_NUMBER: _ClassVar[int]
    PROMPT_TOKEN_IDS_FIELD_NUMBER: _ClassVar[int]
    PARAMS_FIELD_NUMBER: _ClassVar[int]
    TARGET_FIELD_NUMBER: _ClassVar[int]
    KV_DEADLINE_UNIX_S_FIELD_NUMBER: _ClassVar[int]
    request_id: str
    tenant: str
    traffic_class: str
    prompt_token_ids: _containers.RepeatedScalarFieldContainer[int]
    params: SamplingParams
    target: KVDescriptor
    kv_deadline_unix_s: float
    def __init__(self, request_id: _Optional[str] = ..., tenant: _Optional[str] = ..., traffic_class: _Optional[str] = ..., prompt_token_ids: _Optional[_Iterable[int]] = ..., params: _Optional[_Union[SamplingParams, _Mapping]] = ..., target: _Optional[_Union[KVDescriptor, _Mapping]] = ..., kv_deadline_unix_s: _Optional[float] = ...) -> None: ...

class KVShipped(_message.Message):
    __slots__ = ("request_id", "blocks", "seconds")
    REQUEST_ID_FIELD_NUMBER: _ClassVar[int]
    BLOCKS_FIELD_NUMBER: _ClassVar[int]
    SECONDS_FIELD_NUMBER: _ClassVar[int]
    request_id: str
    blocks: int
    seconds: float
    def __init__(self, request_id: _Optional[str] = ..., blocks: _Optional[int] = ..., seconds: _Optional[float] = ...) -> None: ...

class PrefillReply(_message.Message):
    __slots__ = ("chunk", "shipped")
    CHUNK_FIELD_NUMBER: _ClassVar[int]
    SHIPPED_FIELD_NUMBER: _ClassVar[int]
    chunk: TokenChunk
    shipped: KVShipped
    def __init__(self, chunk: _Optional[_Union[TokenChunk, _Mapping]] = ..., shipped: _Optional[_Union[KVShipped, _Mapping]] = ...) -> None: ...

class PrefillAsk(_message.Message):
    __slots__ = ("request", "terms", "cancel")
    REQUEST_FIELD_NUMBER: _ClassVar[int]
    TERMS_FIELD_NUMBER: _ClassVar[int]
    CANCEL_FIELD_NUMBER: _ClassVar[int]
    request: PrefillRequest
    terms: CallTerms
    cancel: bool
    def __init__(self, request: _Optional[_Union[PrefillRequest, _Mapping]] = ..., terms: _Optional[_Union[CallTerms, _Mapping]] = ..., cancel: _Optional[bool] = ...) -> None: ...

class PrefillNote(_message.Message):
    __slots__ = ("request_id", "accepted", "reply", "end", "failure")
    REQUEST_ID_FIELD_NUMBER: _ClassVar[int]
    ACCEPTED_FIELD_NUMBER: _ClassVar[int]
    REPLY_FIELD_NUMBER: _ClassVar[int]
    END_FIELD_NUMBER: _ClassVar[int]
    FAILURE_FIELD_NUMBER: _ClassVar[int]
    request_id: str
    accepted: bool
    reply: PrefillReply
    end: bool
    failure: CallStatus
    def __init__(self, request_id: _Optional[str] = ..., accepted: _Optional[bool] = ..., reply: _Optional[_Union[PrefillReply, _Mapping]] = ..., end: _Optional[bool] = ..., failure: _Optional[_Union[CallStatus, _Mapping]] = ...) -> None: ...

class DecodeSubscribe(_message.Message):
    __slots__ = ("request_id", "cancel", "generate", "terms")
    REQUEST_ID_FIELD_NUMBER: _ClassVar[int]
    CANCEL_FIELD_NUMBER: _ClassVar[int]
    GENERATE_FIELD_NUMBER: _ClassVar[int]
    TERMS_FIELD_NUMBER: _ClassVar[int]
    request_id: str
    cancel: bool
    generate: WorkRequest
    terms: CallTerms
    def __init__(self, request_id: _Optional[str] = ..., cancel: _Optional[bool] = ..., generate: _Optional[_Union[WorkRequest, _Mapping]] = ..., terms: _Optional[_Union[CallTerms, _Mapping]] = ...) -> None: ...

class DecodeEnd(_message.Message):
    __slots__ = ("request_id", "failure")
    REQUEST_ID_FIELD_NUMBER: _ClassVar[int]
    FAILURE_FIELD_NUMBER: _ClassVar[int]
    request_id: str
    failure: CallStatus
    def __init__(self, request_id: _Optional[str] = ..., failure: _Optional[_Union[CallStatus, _Mapping]] = ...) -> None: ...

class DecodeBatch(_message.Message):
    __slots__ = ("chunks", "ends")
    CHUNKS_FIELD_NUMBER: _ClassVar[int]
    ENDS_FIELD_NUMBER: _ClassVar[int]
    chunks: _containers.RepeatedCompositeFieldContainer[TokenChunk]
    ends: _containers.RepeatedCompositeFieldContainer[DecodeEnd]
    def __init__(self, chunks: _Optional[_Iterable[_Union[TokenChunk, _Mapping]]] = ..., ends: _Optional[_Iterable[_Union[DecodeEnd, _Mapping]]] = ...) -> None: ...

class StatsRequest(_message.Message):
    __slots__ = ()
    def __init__(self) -> None: ...

class WorkerStats(_message.Message):
    __slots__ = ("worker_id", "role", "kv_blocks_total", "kv_blocks_free", "kv_blocks_used", "kv_blocks_reserved", "kv_blocks_cached", "num_running", "num_queued", "queued_prefill_tokens", "prefill_tokens_per_s", "decode_tokens_per_s", "block_size", "kv_writes_in_flight", "grpc_address", "kv_backend", "model", "max_model_len", "updated_at_unix_s", "metrics_url", "tenants", "kv_blocks_held", "prefill_step_s", "prefill_s_per_token", "prefill_s_per_pair", "prefill_fit_steps", "prefill_fit_ratio", "prior_step_s", "prior_s_per_token", "prior_s_per_pair", "prior_source", "prefill_drain_tokens_per_s", "token_budget", "chunk_size", "prefill_recent_step_s", "kv_bytes_per_token", "kv_transfer_bytes_per_s", "kv_blocks_freed_per_s", "sequences_finished_per_s", "queued_prefill_tokens_ahead", "pool", "quality_version", "prefill_queues", "num_decoding", "decode_context_tokens", "max_running", "max_prefill_attention", "prefill_step_tokens_ahead", "step_started_unix_s", "step_predicted_s", "prefill_tokens_per_wall_s", "prefill_tokens_per_wall_s_by_class", "prefill_prompts_per_wall_s_by_class")
    class QueuedPrefillTokensAheadEntry(_message.Message):
        __slots__ = ("key", "value")
        KEY_FIELD_NUMBER: _ClassVar[int]
        VALUE_FIELD_NUMBER: _ClassVar[int]
        key: str
        value: int
        def __init__(self, key: _Optional[str] = ..., value: _Optional[int] = ...) -> None: ...
    class PrefillStepTokensAheadEntry(_message.Message):
        __slots__ = ("key", "value")
        KEY_FIELD_NUMBER: _ClassVar[int]
        VALUE_FIELD_NUMBER: _ClassVar[int]
        key: str
        value: int
        def __init__(self, key: _Optional[str] = ..., value: _Optional[int] = ...) -> None: ...
    class PrefillTokensPerWallSByClassEntry(_message.Message):
        __slots__ = ("key", "value")
        KEY_FIELD_NUMBER: _ClassVar[int]
        VALUE_FIELD_NUMBER: _ClassVar[int]
        key: str
        value: float
        def __init__(self, key: _Optional[str] = ..., value: _Optional[float] = ...) -> None: ...
    class PrefillPromptsPerWallSByClassEntry(_message.Message):
        __slots__ = ("key", "value")
        KEY_FIELD_NUMBER: _ClassVar[int]
        VALUE_FIELD_NUMBER: _ClassVar[int]
        key: str
        value: float
        def __init__(self, key: _Optional[str] = ..., value: _Optional[float] = ...) -> None: ...
    WORKER_ID_FIELD_NUMBER: _ClassVar[int]
    ROLE_FIELD_NUMBER: _ClassVar[int]
    KV_BLOCKS_TOTAL_FIELD_NUMBER: _ClassVar[int]
    KV_BLOCKS_FREE_FIELD_NUMBER: _ClassVar[int]
    KV_BLOCKS_USED_FIELD_NUMBER: _ClassVar[int]
    KV_BLOCKS_RESERVED_FIELD_NUMBER: _ClassVar[int]
    KV_BLOCKS_CACHED_FIELD_NUMBER: _ClassVar[int]
    NUM_RUNNING_FIELD_NUMBER: _ClassVar[int]
    NUM_QUEUED_FIELD_NUMBER: _ClassVar[int]
    QUEUED_PREFILL_TOKENS_FIELD_NUMBER: _ClassVar[int]
    PREFILL_TOKENS_PER_S_FIELD_NUMBER: _ClassVar[int]
    DECODE_TOKENS_PER_S_FIELD_NUMBER: _ClassVar[int]
    BLOCK_SIZE_FIELD_NUMBER: _ClassVar[int]
    KV_WRITES_IN_FLIGHT_FIELD_NUMBER: _ClassVar[int]
    GRPC_ADDRESS_FIELD_NUMBER: _ClassVar[int]
    KV_BACKEND_FIELD_NUMBER: _ClassVar[int]
    MODEL_FIELD_NUMBER: _ClassVar[int]
    MAX_MODEL_LEN_FIELD_NUMBER: _ClassVar[int]
    UPDATED_AT_UNIX_S_FIELD_NUMBER: _ClassVar[int]
    METRICS_URL_FIELD_NUMBER: _ClassVar[int]
    TENANTS_FIELD_NUMBER: _ClassVar[int]
    KV_BLOCKS_HELD_FIELD_NUMBER: _ClassVar[int]
    PREFILL_STEP_S_FIELD_NUMBER: _ClassVar[int]
    PREFILL_S_PER_TOKEN_FIELD_NUMBER: _ClassVar[int]
    PREFILL_S_PER_PAIR_FIELD_NUMBER: _ClassVar[int]
    PREFILL_FIT_STEPS_FIELD_NUMBER: _ClassVar[int]
    PREFILL_FIT_RATIO_FIELD_NUMBER: _ClassVar[int]
    PRIOR_STEP_S_FIELD_NUMBER: _ClassVar[int]
    PRIOR_S_PER_TOKEN_FIELD_NUMBER: _ClassVar[int]
    PRIOR_S_PER_PAIR_FIELD_NUMBER: _ClassVar[int]
    PRIOR_SOURCE_FIELD_NUMBER: _ClassVar[int]
    PREFILL_DRAIN_TOKENS_PER_S_FIELD_NUMBER: _ClassVar[int]
    TOKEN_BUDGET_FIELD_NUMBER: _ClassVar[int]
    CHUNK_SIZE_FIELD_NUMBER: _ClassVar[int]
    PREFILL_RECENT_STEP_S_FIELD_NUMBER: _ClassVar[int]
    KV_BYTES_PER_TOKEN_FIELD_NUMBER: _ClassVar[int]
    KV_TRANSFER_BYTES_PER_S_FIELD_NUMBER: _ClassVar[int]
    KV_BLOCKS_FREED_PER_S_FIELD_NUMBER: _ClassVar[int]
    SEQUENCES_FINISHED_PER_S_FIELD_NUMBER: _ClassVar[int]
    QUEUED_PREFILL_TOKENS_AHEAD_FIELD_NUMBER: _ClassVar[int]
    POOL_FIELD_NUMBER: _ClassVar[int]
    QUALITY_VERSION_FIELD_NUMBER: _ClassVar[int]
    PREFILL_QUEUES_FIELD_NUMBER: _ClassVar[int]
    NUM_DECODING_FIELD_NUMBER: _ClassVar[int]
    DECODE_CONTEXT_TOKENS_FIELD_NUMBER: _ClassVar[int]
    MAX_RUNNING_FIELD_NUMBER: _ClassVar[int]
    MAX_PREFILL_ATTENTION_FIELD_NUMBER: _ClassVar[int]
    PREFILL_STEP_TOKENS_AHEAD_FIELD_NUMBER: _ClassVar[int]
    STEP_STARTED_UNIX_S_FIELD_NUMBER: _ClassVar[int]
    STEP_PREDICTED_S_FIELD_NUMBER: _ClassVar[int]
    PREFILL_TOKENS_PER_WALL_S_FIELD_NUMBER: _ClassVar[int]
    PREFILL_TOKENS_PER_WALL_S_BY_CLASS_FIELD_NUMBER: _ClassVar[int]
    PREFILL_PROMPTS_PER_WALL_S_BY_CLASS_FIELD_NUMBER: _ClassVar[int]
    worker_id: str
    role: str
    kv_blocks_total: int
    kv_blocks_free: int
    kv_blocks_used: int
    kv_blocks_reserved: int
    kv_blocks_cached: int
    num_running: int
    num_queued: int
    queued_prefill_tokens: int
    prefill_tokens_per_s: float
    decode_tokens_per_s: float
    block_size: int
    kv_writes_in_flight: int
    grpc_address: str
    kv_backend: str
    model: str
    max_model_len: int
    updated_at_unix_s: float
    metrics_url: str
    tenants: _containers.RepeatedCompositeFieldContainer[TenantShare]
    kv_blocks_held: int
    prefill_step_s: float
    prefill_s_per_token: float
    prefill_s_per_pair: float
    prefill_fit_steps: int
    prefill_fit_ratio: float
    prior_step_s: float
    prior_s_per_token: float
    prior_s_per_pair: float
    prior_source: str
    prefill_drain_tokens_per_s: float
    token_budget: int
    chunk_size: int
    prefill_recent_step_s: float
    kv_bytes_per_token: int
    kv_transfer_bytes_per_s: float
    kv_blocks_freed_per_s: float
    sequences_finished_per_s: float
    queued_prefill_tokens_ahead: _containers.ScalarMap[str, int]
    pool: str
    quality_version: str
    prefill_queues: _containers.RepeatedCompositeFieldContainer[TenantQueue]
    num_decoding: int
    decode_context_tokens: int
    max_running: int
    max_prefill_attention: int
    prefill_step_tokens_ahead: _containers.ScalarMap[str, int]
    step_started_unix_s: float
    step_predicted_s: float
    prefill_tokens_per_wall_s: float
    prefill_tokens_per_wall_s_by_class: _containers.ScalarMap[str, float]
    prefill_prompts_per_wall_s_by_class: _containers.ScalarMap[str, float]
    def __init__(self, worker_id: _Optional[str] = ..., role: _Optional[str] = ..., kv_blocks_total: _Optional[int] = ..., kv_blocks_free: _Optional[int] = ..., kv_blocks_used: _Optional[int] = ..., kv_blocks_reserved: _Optional[int] = ..., kv_blocks_cached: _Optional[int] = ..., num_running: _Optional[int] = ..., num_queued: _Optional[int] = ..., queued_prefill_tokens: _Optional[int] = ..., prefill_tokens_per_s: _Optional[float] = ..., decode_tokens_per_s: _Optional[float] = ..., block_size: _Optional[int] = ..., kv_writes_in_flight: _Optional[int] = ..., grpc_address: _Optional[str] = ..., kv_backend: _Optional[str] = ..., model: _Optional[str] = ..., max_model_len: _Optional[int] = ..., updated_at_unix_s: _Optional[float] = ..., metrics_url: _Optional[str] = ..., tenants: _Optional[_Iterable[_Union[TenantShare, _Mapping]]] = ..., kv_blocks_held: _Optional[int] = ..., prefill_step_s: _Optional[float] = ..., prefill_s_per_token: _Optional[float] = ..., prefill_s_per_pair: _Optional[float] = ..., prefill_fit_steps: _Optional[int] = ..., prefill_fit_ratio: _Optional[float] = ..., prior_step_s: _Optional[float] = ..., prior_s_per_token: _Optional[float] = ..., prior_s_per_pair: _Optional[float] = ..., prior_source: _Optional[str] = ..., prefill_drain_tokens_per_s: _Optional[float] = ..., token_budget: _Optional[int] = ..., chunk_size: _Optional[int] = ..., prefill_recent_step_s: _Optional[float] = ..., kv_bytes_per_token: _Optional[int] = ..., kv_transfer_bytes_per_s: _Optional[float] = ..., kv_blocks_freed_per_s: _Optional[float] = ..., sequences_finished_per_s: _Optional[float] = ..., queued_prefill_tokens_ahead: _Optional[_Mapping[str, int]] = ..., pool: _Optional[str] = ..., quality_version: _Optional[str] = ..., prefill_queues: _Optional[_Iterable[_Union[TenantQueue, _Mapping]]] = ..., num_decoding: _Optional[int] = ..., decode_context_tokens: _Optional[int] = ..., max_running: _Optional[int] = ..., max_prefill_attention: _Optional[int] = ..., prefill_step_tokens_ahead: _Optional[_Mapping[str, int]] = ..., step_started_unix_s: _Optional[float] = ..., step_predicted_s: _Optional[float] = ..., prefill_tokens_per_wall_s: _Optional[float] = ..., prefill_tokens_per_wall_s_by_class: _Optional[_Mapping[str, float]] = ..., prefill_prompts_per_wall_s_by_class: _Optional[_Mapping[str, float]] = ...) -> None: ...

class TenantShare(_message.Message):
    __slots__ = ("tenant", "sequences", "kv_blocks")
    TENANT_FIELD_NUMBER: _ClassVar[int]
    SEQUENCES_FIELD_NUMBER: _ClassVar[int]
    KV_BLOCKS_FIELD_NUMBER: _ClassVar[int]
    tenant: str
    sequences: int
    kv_blocks: int
    def __init__(self, tenant: _Optional[str] = ..., sequences: _Optional[int] = ..., kv_blocks: _Optional[int] = ...) -> None: ...

class TenantQueue(_message.Message):
    __slots__ = ("traffic_class", "tenant", "tokens", "prompts", "computed")
    TRAFFIC_CLASS_FIELD_NUMBER: _ClassVar[int]
    TENANT_FIELD_NUMBER: _ClassVar[int]
    TOKENS_FIELD_NUMBER: _ClassVar[int]
    PROMPTS_FIELD_NUMBER: _ClassVar[int]
    COMPUTED_FIELD_NUMBER: _ClassVar[int]
    traffic_class: str
    tenant: str
    tokens: int
    prompts: _containers.RepeatedScalarFieldContainer[int]
    computed: _containers.RepeatedScalarFieldContainer[int]
    def __init__(self, traffic_class: _Optional[str] = ..., tenant: _Optional[str] = ..., tokens: _Optional[int] = ..., prompts: _Optional[_Iterable[int]] = ..., computed: _Optional[_Iterable[int]] = ...) -> None: ...

class ServiceRecord(_message.Message):
    __slots__ = ("service_id", "role", "address", "metrics_url", "updated_at_unix_s", "pid")
    SERVICE_ID_FIELD_NUMBER: _ClassVar[int]
    ROLE_FIELD_NUMBER: _ClassVar[int]
    ADDRESS_FIELD_NUMBER: _ClassVar[int]
    METRICS_URL_FIELD_NUMBER: _ClassVar[int]
    UPDATED_AT_UNIX_S_FIELD_NUMBER: _ClassVar[int]
    PID_FIELD_NUMBER: _ClassVar[int]
    service_id: str
    role: str
    address: str
    metrics_url: str
    updated_at_unix_s: float
    pid: int
    def __init__(self, service_id: _Optional[str] = ..., role: _Optional[str] = ..., address: _Optional[str] = ..., metrics_url: _Optional[str] = ..., updated_at_unix_s: _Optional[float] = ..., pid: _Optional[int] = ...) -> None: ...

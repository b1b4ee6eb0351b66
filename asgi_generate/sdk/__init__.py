"""The codec and engine SDK: everything a codec or engine distribution
imports, and nothing else.

A codec (a wire format served by the shared /generate handler) is a sans-IO
:class:`Codec` with an :class:`Exchange` per request, registered through the
``asgi_generate.codecs`` entry point group (:data:`GROUP`). An engine is a
:class:`WorkerProtocol` description registered through the
``asgi_generate.engines`` group (:data:`ENGINES_GROUP`). Import from this
package only (:data:`__all__`): its underscored submodules are its
implementation; :mod:`.answer`, the readers of a worker's answer, is its one
public submodule.
"""

from ._codec import (
    LEG_DONE,
    MAX_REQUEST_ITEMS,
    NO_KV_TRANSFER,
    Attempt,
    BatchItem,
    Codec,
    EngineError,
    Event,
    Exchange,
    GenerateRequest,
    Pair,
    RequestError,
    Route,
    Usage,
    WorkerAnswerError,
    WorkerRequest,
    dump_body,
    engine_error_page,
)
from . import answer
from ._compact import dumps_compact
from ._ids import mint
from ._lax import LaxError, lax_scalar
from ..exceptions import CodecLoadError
from ..protocols import GROUP as ENGINES_GROUP, PublicAbort, WorkerProtocol, dial, positive_int, read_model_card
from ._registry import GROUP, LoadedCodec, load_codecs
from ._text import PromptTokenizer, StopWatch
from ._token_ids import PackedIds, as_u32, pack_token_ids
from ._versions import VLLM_DEFAULT_VERSION, VLLM_VERSIONS, VLLMBehaviour, parse_version, vllm_behaviour

__all__ = [
    "ENGINES_GROUP", "PublicAbort", "WorkerProtocol", "dial", "positive_int", "read_model_card",
    "GROUP", "LEG_DONE", "MAX_REQUEST_ITEMS", "NO_KV_TRANSFER", "VLLM_DEFAULT_VERSION", "VLLM_VERSIONS",
    "Attempt", "BatchItem", "Codec", "CodecLoadError", "EngineError", "Event", "Exchange", "GenerateRequest",
    "LaxError", "LoadedCodec", "PackedIds", "Pair", "PromptTokenizer", "RequestError", "Route", "StopWatch",
    "Usage", "VLLMBehaviour", "WorkerAnswerError", "WorkerRequest",
    "answer", "as_u32", "dump_body", "dumps_compact", "engine_error_page", "lax_scalar", "load_codecs", "mint",
    "pack_token_ids", "parse_version", "vllm_behaviour",
]

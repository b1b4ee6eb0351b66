"""What differs between engine versions on the routes the frontend uses.

A worker reports its engine version at registration (SGLang
``/get_server_info`` ``version``; vLLM ``GET /version`` ``{"version": ...}``,
``vllm/entrypoints/openai/api_server.py`` ``show_version``), and the router
keeps it in ``Worker.info["version"]``. Codecs and the simulator read the
behaviours of that version from here, never from a guess: an unknown or
unreadable version gives ``None`` and the codec then relies on nothing that
differs between versions.

vLLM ``POST /inference/v1/generate`` (tokens in, tokens out), read from the
released wheels' source (``vllm/entrypoints/serve/disagg/`` up to 0.24,
``vllm/entrypoints/scale_out/token_in_token_out/`` from 0.25; ``protocol.py``
and ``serving.py``):

- served from 0.11.2 (``vllm/entrypoints/openai/serving_tokens.py``, unary
  only); streams from 0.20; server-side ``max_tokens`` defaulting and the
  ``n <= max_num_seqs`` check from 0.22; ``usage``, ``model`` and ``created``
  in unary answers, and the engine id (``generate-tokens-<id>``) as their
  ``request_id``, from 0.25 (before, a fresh random uuid);
- every version takes ``sampling_params.n > 1`` and answers ``n`` choices;
  ``sampling_params`` is a required field in every release;
- ``usage`` is ``UsageInfo`` (``entrypoints/openai/engine/protocol.py``,
  from 0.29 ``entrypoints/serve/engine/protocol.py``): unary answers keep its
  null fields (``JSONResponse(content=...model_dump())``), a stream's closing
  usage chunk drops them (``model_dump_json(exclude_none=True)``); with
  ``--enable-prompt-tokens-details`` its ``prompt_tokens_details``
  (``PromptTokenUsageInfo``) is set whenever the engine reports
  ``num_cached_tokens`` (V1 always does, 0 included), else null;
- 0.26: ``PromptTokenUsageInfo`` gains ``created_cache_tokens`` (before,
  ``cached_tokens`` and ``multimodal_tokens`` only);
- 0.28: ``UsageInfo`` gains ``completion_tokens_details`` (null on this
  route);
- 0.30: validation errors show a cleaned dotted ``loc`` and a bounded
  ``input`` (before, pydantic's own: a ``loc`` tuple and the whole input);
- 0.31: a ``--tokens-only`` server refuses stop strings (before, it accepted
  and never applied them);
- 0.32: ``GenerateLogProbs`` entries (integer ``token_id``, ``logprob``,
  ``rank``; ``top_logprobs`` not cut to k) replace ``"token_id:N"`` labels
  with ``bytes``; each choice carries ``stop_reason``; answers carry
  ``output_mode`` and a new field layout; a finishing chunk without tokens (an
  abort) is sent instead of dropped;
- 0.31: a P/D producer's ``kv_transfer_params`` carry
  ``remote_prefill_cached_tokens`` (its own prefix-cache hit,
  ``Scheduler.update_from_output`` in ``v1/core/sched/scheduler.py``) and a
  consumer given them reports that count as its ``cached_tokens``
  (``RequestState.from_new_request`` in ``v1/engine/output_processor.py``);
  before, a consumer counts the prompt it loaded as cached; and a consumer
  asked for ``prompt_logprobs`` loads no remote KV and prefills the prompt
  itself (``Scheduler.schedule``: ``skip_reading_prefix_cache`` zeroes the
  connector's hit; both absent from 0.30.0, in 0.31.0);
- 0.33: routed-expert rows are kept per KV block by the auxiliary-output
  connector (``vllm/distributed/aux_output_connector/connector.py``): a
  consumer with ``--enable-return-routed-experts`` takes no remote KV whose
  rows it lacks (``AuxOutputSchedulerConnector.cap_external_hit``), so it
  prefills the prompt itself and answers every row; before (0.27:
  ``RoutedExpertsManager.get`` in
  ``model_executor/layers/fused_moe/routed_experts_capturer.py``, read at a
  request's first output), rows are read from the slots of the request's own
  KV blocks, so a consumer's prompt rows are slots the transfer filled and
  no forward pass wrote;
- after 0.33 (vLLM main, ``test_generate_max_tokens_boundary``): ``max_tokens``
  above ``max_model_len - prompt_len`` is refused with 400; 0.33 and earlier
  cap generation at the context end (and a value whose sum with the prompt
  overflows int32 kills the engine).
"""

from __future__ import annotations

import re
from dataclasses import dataclass

#: vLLM versions the simulator plays (``sim --engine-version``), oldest
#: first: one per behaviour set below. 0.34.0 stands for vLLM main after the
#: 0.33.0 release.
VLLM_VERSIONS = ("0.27.0", "0.33.0", "0.34.0")
#: The simulator's default: the newest release.
VLLM_DEFAULT_VERSION = "0.33.0"
#: The oldest version the simulator can play (the answer layout it knows).
VLLM_OLDEST_PLAYED = (0, 25, 0)

_LEADING = re.compile(r"v?(\d+(?:\.\d+)*)")


def parse_version(text: object) -> tuple[int, ...] | None:
    """The leading release numbers of a version string (``"0.33.0rc1+g12"``
    gives ``(0, 33, 0)``); ``None`` for anything else."""
    if not isinstance(text, str):
        return None
    match = _LEADING.match(text.strip())
    return tuple(int(p) for p in match.group(1).split(".")) if match else None


@dataclass(frozen=True, slots=True)
class VLLMBehaviour:
    """How one vLLM version answers ``/inference/v1/generate``.

    Attributes:
        version: the version string the worker reported.
        unary_engine_id: a unary answer's ``request_id`` is the engine id
            (else a fresh random uuid).
        clean_validation_errors: validation errors show a cleaned dotted
            ``loc`` and a bounded ``input``.
        refuses_stop_strings: a ``--tokens-only`` server answers 400 to stop
            strings (else it accepts them and never applies them).
        generate_schema: the 0.32 layout: ``GenerateLogProbs`` entries
            (``{"token_id", "logprob", "rank", "top_logprobs"}``, else
            ``{"token": "token_id:N", "logprob", "bytes", "top_logprobs"}``),
            ``stop_reason`` per choice, ``output_mode``, and finishing chunks
            without tokens sent.
        bounds_max_tokens: ``max_tokens`` beyond the context is refused
            (else generation stops at the context end).
        relays_prefill_cache: a P/D consumer reports its producer's
            prefix-cache hit (``remote_prefill_cached_tokens``), else the
            prompt it loaded, as ``cached_tokens``.
        prompt_logprobs_prefill_locally: a P/D consumer asked for
            ``prompt_logprobs`` prefills the prompt itself.
        expert_rows_by_block: a P/D consumer returning routed experts
            prefills the prompt itself (else it loads the KV and answers
            prompt rows no forward pass wrote).
        created_cache_tokens: ``prompt_tokens_details`` has a
            ``created_cache_tokens`` field.
        completion_tokens_details: ``usage`` has a
            ``completion_tokens_details`` field.
    """

    version: str
    unary_engine_id: bool
    clean_validation_errors: bool
    refuses_stop_strings: bool
    generate_schema: bool
    bounds_max_tokens: bool
    relays_prefill_cache: bool
    prompt_logprobs_prefill_locally: bool
    expert_rows_by_block: bool
    created_cache_tokens: bool
    completion_tokens_details: bool

    @property
    def stop_reason(self) -> bool:
        """Each choice carries ``stop_reason``."""
        return self.generate_schema


def vllm_behaviour(version: object) -> VLLMBehaviour | None:
    """The behaviours of vLLM ``version``; ``None`` when it is not a
    readable version string."""
    v = parse_version(version)
    if v is None:
        return None
    return VLLMBehaviour(str(version), v >= (0, 25), v >= (0, 30), v >= (0, 31), v >= (0, 32), v >= (0, 34),
                         v >= (0, 31), v >= (0, 31), v >= (0, 33), v >= (0, 26), v >= (0, 28))

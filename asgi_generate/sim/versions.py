"""What the simulator plays differently per vLLM version: its own record.

Each :class:`Change` is one behaviour of ``POST /inference/v1/generate`` (or
a route beside it) and the first release that has it, read from the released
wheels (``pip download --no-deps vllm==X``, 0.24.0 to 0.33.0), with the file
and function that show it there. The frontend's codec keeps a table of its
own (``asgi_generate.sdk._versions``); tests/sim/test_sim_versions.py checks
that the two agree on every fact both record, so the oracle and what it
judges cannot drift apart unseen.

The simulator plays any version from :data:`VLLM_OLDEST_PLAYED` (the
``token_in_token_out`` route's first release); ``0.34.0`` stands for vLLM
main after the 0.33.0 release.
"""

from __future__ import annotations

import re
from dataclasses import dataclass

#: One version per set of behaviours below, oldest first (``sim
#: --engine-version``).
VLLM_VERSIONS = ("0.27.0", "0.33.0", "0.34.0")
#: The version played when none is given: the newest release.
VLLM_DEFAULT_VERSION = "0.33.0"
#: The oldest version the simulator plays: the first with
#: ``vllm/entrypoints/scale_out/token_in_token_out/`` (0.24 served the route
#: from ``vllm/entrypoints/serve/disagg/`` with another answer layout).
VLLM_OLDEST_PLAYED = (0, 25, 0)

_RELEASE = re.compile(r"v?(\d+(?:\.\d+)*)")


def parse_version(text: object) -> tuple[int, ...] | None:
    """The release numbers a version string starts with (``"0.33.0rc1+g12"``:
    ``(0, 33, 0)``; a leading ``v`` allowed, as ``git describe`` writes
    them); ``None`` for anything else."""
    if not isinstance(text, str):
        return None
    match = _RELEASE.match(text.strip())
    return tuple(int(p) for p in match.group(1).split(".")) if match else None


@dataclass(frozen=True, slots=True)
class Change:
    """One behaviour vLLM gained in release ``since``.

    Attributes:
        name: the behaviour's name (:class:`VLLMPlayed`'s attribute).
        since: the first release that has it.
        source: where that release shows it (file under ``vllm/`` and
            function or class).
    """

    name: str
    since: tuple[int, ...]
    source: str


#: Every behaviour that differs between the versions played, oldest first.
VLLM_CHANGES = (
    Change("unary_engine_id", (0, 25, 0),
           "entrypoints/scale_out/token_in_token_out/serving.py ServingTokens.serve_tokens_full_generator: "
           "GenerateResponse(request_id=request_id), the engine id (0.24's serve/disagg/serving.py: a fresh uuid)"),
    Change("created_cache_tokens", (0, 26, 0),
           "entrypoints/openai/engine/protocol.py PromptTokenUsageInfo.created_cache_tokens"),
    Change("completion_tokens_details", (0, 28, 0),
           "entrypoints/openai/engine/protocol.py UsageInfo.completion_tokens_details"),
    Change("clean_validation_errors", (0, 30, 0),
           "entrypoints/serve/exception_handling/handlers/validation.py _summarize_error_input, "
           "_MAX_REPORTED_ERRORS (a cleaned dotted loc, an input cut at 200 characters, ten errors at most)"),
    Change("refuses_stop_strings", (0, 31, 0),
           "entrypoints/scale_out/token_in_token_out/serving.py ServingTokens.serve_tokens: "
           "force_no_detokenize and sampling_params.stop is a 400"),
    Change("relays_prefill_cache", (0, 31, 0),
           "v1/core/sched/scheduler.py Scheduler.update_from_output sets kv_transfer_params"
           "['remote_prefill_cached_tokens']; v1/engine/output_processor.py RequestState.from_new_request reports it"),
    Change("prompt_logprobs_prefill_locally", (0, 31, 0),
           "v1/core/sched/scheduler.py Scheduler.schedule: request.skip_reading_prefix_cache (sampling_params.py: "
           "prompt_logprobs set) zeroes the connector's get_num_new_matched_tokens"),
    Change("kv_event_sources", (0, 31, 0),
           "entrypoints/serve/instrumentator/basic.py kv_event_sources (GET /kv_event_sources)"),
    Change("generate_schema", (0, 32, 0),
           "entrypoints/scale_out/token_in_token_out/protocol.py GenerateLogProbs, GenerateChoiceBase.stop_reason, "
           "GenerateRequest.output_mode; serving.py sends a finishing output without tokens"),
    Change("weight_version_spans", (0, 33, 0),
           "outputs.py WeightVersionSpan; v1/engine/output_processor.py RequestState._weight_version_spans: a "
           "finished choice's weight_versions, the versions v1/engine/core.py _attach_weight_version stamped on "
           "each step's tokens"),
    Change("expert_rows_by_block", (0, 33, 0),
           "distributed/aux_output_connector/connector.py AuxOutputSchedulerConnector.cap_external_hit"),
    Change("bounds_max_tokens", (0, 34, 0),
           "vLLM main after 0.33.0 (tests: test_generate_max_tokens_boundary): max_tokens past "
           "max_model_len - prompt is a 400; 0.33 stops at the context end"),
)


@dataclass(frozen=True, slots=True)
class VLLMPlayed:
    """The behaviours of one vLLM version, as the simulator plays them (one
    attribute per :data:`VLLM_CHANGES` entry, true from its release on).

    Attributes:
        version: the version string played (``GET /version``).
        unary_engine_id: a unary answer's ``request_id`` is the engine id.
        created_cache_tokens: ``prompt_tokens_details`` has
            ``created_cache_tokens``.
        completion_tokens_details: ``usage`` has ``completion_tokens_details``.
        clean_validation_errors: validation errors show a cleaned dotted
            ``loc`` and a bounded ``input`` (else pydantic's own).
        refuses_stop_strings: a tokens-only server refuses stop strings
            (else it accepts them and never applies them).
        relays_prefill_cache: a P/D consumer reports its producer's
            prefix-cache hit as ``cached_tokens`` (else the prompt it loaded).
        prompt_logprobs_prefill_locally: a P/D consumer asked for
            ``prompt_logprobs`` prefills the prompt itself.
        kv_event_sources: ``GET /kv_event_sources`` is served.
        generate_schema: the 0.32 answer layout (``GenerateLogProbs``
            entries, ``stop_reason``, ``output_mode``; finishing chunks
            without tokens sent).
        weight_version_spans: a finished choice carries ``weight_versions``:
            ``[{"version", "start", "end"}]`` over its output tokens.
        expert_rows_by_block: a P/D consumer returning routed experts
            prefills the prompt itself.
        bounds_max_tokens: ``max_tokens`` past the context is refused.
    """

    version: str
    unary_engine_id: bool
    created_cache_tokens: bool
    completion_tokens_details: bool
    clean_validation_errors: bool
    refuses_stop_strings: bool
    relays_prefill_cache: bool
    prompt_logprobs_prefill_locally: bool
    kv_event_sources: bool
    generate_schema: bool
    weight_version_spans: bool
    expert_rows_by_block: bool
    bounds_max_tokens: bool


def vllm_played(version: str) -> VLLMPlayed:
    """The behaviours the simulator plays for vLLM ``version``.

    Raises:
        ValueError: not a version string, or older than
            :data:`VLLM_OLDEST_PLAYED`.
    """
    v = parse_version(version)
    if v is None:
        raise ValueError(f"not a vLLM version: {version!r}")
    if v < VLLM_OLDEST_PLAYED:
        raise ValueError(f"the simulator plays vLLM {'.'.join(map(str, VLLM_OLDEST_PLAYED))} and later, not {version}")
    return VLLMPlayed(version, **{c.name: v >= c.since for c in VLLM_CHANGES})

"""The request-end record's JSON Schema, version 1.

This module is the schema's source; ``trace/request_trace.v1.schema.json`` in
the repository is its published copy, regenerated with
``asgi-generate-trace schema > trace/request_trace.v1.schema.json``
(a test checks the two agree). A change that would reject a record an older
writer produced needs a new version (``...request_trace.v2``), never an edit.

Field meanings are in each property's ``description``; the layout follows
NVIDIA Dynamo's ``dynamo.request.trace.v1`` ``request_end`` record
(ai-dynamo/dynamo ``lib/llm/src/request_trace/types.rs`` and ``record.rs``),
flattened: scalars at top level,
objects only for attempts, error, finish, session and replay.
"""

from __future__ import annotations

from typing import Any

import orjson

SCHEMA_ID = "asgi_generate.request_trace.v1"
EVENT_TYPE = "request_end"
STATUSES = (
    "ok", "client_disconnect", "rejected", "engine_error", "unavailable", "timeout", "shutdown", "slow_client",
    "engine_abort", "shed", "deadline",
)
ATTEMPT_OUTCOMES = ("finished", "aborted", "error", "connect_failed", "worker_lost", "timeout")
ROLES = ("aggregated", "prefill", "decode", "resumed", "replayed")

_COUNT = {"type": "integer", "minimum": 0}
_MS = {"type": "number", "minimum": 0}
_ID = {"type": "string", "maxLength": 256, "description": "Client-chosen; cut to 256 characters."}
_U64 = {"type": "integer", "minimum": 0, "maximum": 2**64 - 1}


def _d(schema: dict, description: str) -> dict:
    return {**schema, "description": description}


SCHEMA: dict[str, Any] = {
    "$schema": "https://json-schema.org/draft/2020-12/schema",
    "title": SCHEMA_ID,
    "description": "One request-end record per request that reached a registered /generate route, "
    "whatever its outcome. Absent optional fields mean 'not known' or 'not applicable', never empty.",
    "type": "object",
    "additionalProperties": False,
    "required": [
        "schema", "event_type", "event_time_unix_ms", "request_id", "format", "route", "method",
        "status", "output_tokens", "received_unix_ms", "total_ms", "attempts", "replay",
    ],
    "properties": {
        "schema": {"const": SCHEMA_ID},
        "event_type": {"const": EVENT_TYPE},
        "event_time_unix_ms": _d(_COUNT, "When the request ended: received_unix_ms + round(total_ms)."),
        "request_id": _d(
            {"type": "string", "pattern": "^[0-9a-f]{32}$"},
            "The frontend's internal id, unique per request across processes.",
        ),
        "public_id": _d(_ID, "The client's own id (SGLang rid, vLLM request_id)."),
        "batch_id": _d(
            {"type": "string", "pattern": "^[0-9a-f]{32}$"},
            "For one item of a request that carried several (an SGLang batch entry or parallel sample, a vLLM "
            "choice): the request's frontend id, shared by the records of all its items.",
        ),
        "batch_index": _d(_COUNT, "With batch_id: the item's index in the request's answer."),
        "batch_size": _d({"type": "integer", "minimum": 1}, "With batch_id: how many items the request carried."),
        "item_count": _d(
            {"type": "integer", "minimum": 1},
            "For a request that carried several items and was refused as a whole before any of them ran (a "
            "check after decoding, no worker to take it, its engine's error answer): how many items it "
            "carried. Its one record stands for all of them; it has no batch_id.",
        ),
        "x_request_id": _d(_ID, "The client's X-Request-Id header."),
        "format": _d({"type": "string", "minLength": 1}, "The codec's name: sglang, vllm, ..."),
        "route": _d({"type": "string"}, "The request path."),
        "method": _d({"type": "string"}, "The HTTP method."),
        "model": _d({"type": "string"}, "The model the request named."),
        "stream": _d({"type": "boolean"}, "SSE was asked for; absent when the body was never parsed."),
        "status": _d(
            {"enum": list(STATUSES)},
            "How the request ended. engine_abort: the answer ended with the engine's own abort (finish_reason "
            "abort: a pause without hold, abort_all), its output truncated; added to v1. shed: admission refused it "
            "(429 or 503, see shed_reason); deadline: it was still running at its x-deadline-ms and ended with "
            "the engine's abort finish carrying the tokens so far; both added to v1.",
        ),
        "http_status": _d(
            {"type": "integer", "minimum": 100, "maximum": 599},
            "The HTTP status sent; absent when the client left before any was sent.",
        ),
        "error": {
            "description": "Why the request failed, for statuses other than ok and client_disconnect.",
            "type": "object",
            "additionalProperties": False,
            "required": ["type", "message"],
            "properties": {
                "type": _d({"type": "string"}, "A short machine name: invalid_json, too_large, engine, ..."),
                "message": _d({"type": "string", "maxLength": 1024}, "For a human; cut to 1024 characters."),
            },
        },
        "input_tokens": _d(
            _COUNT, "Prompt tokens: the request's input_ids, else the engine's prompt_tokens."
        ),
        "output_tokens": _d(
            _COUNT, "Output tokens the client was sent, counted by the frontend across every attempt."
        ),
        "engine_completion_tokens": _d(
            _COUNT, "The engine's completion_tokens; present only when it differs from output_tokens."
        ),
        "cached_tokens": _d(
            _COUNT, "Prompt tokens served from a prefix cache, as the aggregated engine would report them: the "
            "engine's report, from the leg that computed the prompt in P/D (each leg's own report is its "
            "attempt's usage).",
        ),
        "reasoning_tokens": _d(
            _COUNT,
            "Leading output tokens the reasoning parser counted as reasoning, markers included; "
            "present when one is configured.",
        ),
        "received_unix_ms": _d(_COUNT, "When the request arrived (Unix time, ms)."),
        "dispatch_wait_ms": _d(_MS, "From arrival to the first engine dispatch (body read, checks, routing)."),
        "ttft_ms": _d(
            _MS, "From arrival to the first output token from the engine; absent when none came, or "
            "when the engine answered in one piece (no token timing).",
        ),
        "total_ms": _d(_MS, "From arrival to the end of the handler (abort acknowledged, if any)."),
        "mean_itl_ms": _d(
            _MS, "Mean inter-token latency: (last token - first token) / (output_tokens - 1); "
            "absent without token timing.",
        ),
        "migrations": _d(
            _COUNT, "Times the request continued on another worker mid-answer (resumed attempts); "
            "absent when none.",
        ),
        "queue_ms": _d(_MS, "Admission: time the request waited in the admission queue; absent when it "
                            "never queued (admission off, or refused at arrival)."),
        "priority_class": _d({"type": "string"}, "Admission: the request's priority class."),
        "tenant": _d({"type": "string", "maxLength": 64}, "Admission: the request's tenant (x-tenant, or a "
                                                          "hash of its bearer token)."),
        "group_id": _d({"type": "string", "maxLength": 64}, "Admission: the x-group-id it was admitted with."),
        "shed_reason": _d({"type": "string"}, "Admission: why it was shed (queue_depth, queue_bytes, wait, "
                                              "deadline, group_incomplete, never) or cut (deadline)."),
        "preemptions": _d(_COUNT, "Admission: times the stream was preempted for a higher class (aborted on "
                                  "its engine, parked) and resumed exactly as a migrated leg; each counts in "
                                  "migrations too."),
        "pause_resumes": _d(
            _COUNT, "Times the stream was held across a fleet pause (the engine's abort) and resumed after "
            "it (--resume-after-pause); absent when none.",
        ),
        "segments": _d(
            {
                "type": "array",
                "items": {
                    "type": "object",
                    "additionalProperties": False,
                    "required": ["weight_version", "tokens"],
                    "properties": {
                        "weight_version": {"type": ["string", "null"]},
                        "tokens": _COUNT,
                    },
                },
            },
            "With pause_resumes, or when the tokens sent came from more than one weight version: which "
            "weights produced them, in order: each run of tokens at one weight version and how many were sent. "
            "The version is the one the engine reported for those tokens (SGLang meta_info.weight_version per "
            "chunk, vLLM weight_versions on the finished choice), else the leg's worker's version when the leg "
            "was sent (null when unknown); the tokens sum to output_tokens.",
        ),
        "replays": _d(
            _COUNT, "Times a unary request ran again from scratch on another worker after its worker died "
            "mid-answer (replayed attempts); absent when none.",
        ),
        "not_migrated": _d(
            {"type": "string"}, "Why a stream cut by a dead worker could not continue on another one "
            "(e.g. a text prompt without --tokenizer); absent otherwise.",
        ),
        "attempts": {
            "description": "Every engine leg, in order: aggregated, or prefill and decode, plus retries "
            "and migrations (a resumed leg carries the prompt plus the output sent before it).",
            "type": "array",
            "items": {
                "type": "object",
                "additionalProperties": False,
                "required": ["engine_id", "worker_id", "role"],
                "properties": {
                    "engine_id": _d({"type": "string"}, "The id the engine saw (minted per attempt)."),
                    "worker_id": _d({"type": "string"}, "The worker's id in the router (w0, w1, ...)."),
                    "role": {"enum": list(ROLES)},
                    "outcome": _d(
                        {"enum": list(ATTEMPT_OUTCOMES)},
                        "How the leg ended (timeout: silent past the inter-token timeout, then resumed "
                        "elsewhere).",
                    ),
                    "tokens": _d(
                        _COUNT, "Output tokens this leg contributed to the client's answer; absent when none."
                    ),
                    "abort_acked": _d(
                        {"type": "boolean"}, "An abort was sent for this leg; whether the engine acknowledged it."
                    ),
                    "local_prefill": _d(
                        {"const": True}, "A vLLM decode leg that prefilled the prompt itself: its prefill leg "
                        "answered no kv_transfer_params and --pd-fallback allowed it; absent otherwise.",
                    ),
                    "backoff_ms": _d(
                        _COUNT, "Milliseconds the request waited before this leg (migration backoff); "
                        "absent when none.",
                    ),
                    "weight_version": _d(
                        {"type": "string"}, "The weight version the engine reported for the leg's first output "
                        "token sent (SGLang meta_info.weight_version, vLLM weight_versions); else the one the leg's "
                        "worker served when the leg was sent (SGLang /get_model_info, vLLM /weight_info, or the "
                        "weight update the frontend made); absent when unknown.",
                    ),
                    "usage": {
                        "description": "The token counts this leg's engine reported for it, as reported (a "
                        "P/D decode that received the prompt's KV may count the whole prompt as cached, a "
                        "resumed leg counts the output it was re-fed as prompt); each field only when "
                        "reported, absent when none was.",
                        "type": "object",
                        "additionalProperties": False,
                        "minProperties": 1,
                        "properties": {
                            "prompt_tokens": _COUNT,
                            "completion_tokens": _COUNT,
                            "cached_tokens": _COUNT,
                        },
                    },
                },
            },
        },
        "finish": {
            "description": "Present when the engine sent a finish reason.",
            "type": "object",
            "additionalProperties": False,
            "required": ["finish_reason", "backend_finish_reason"],
            "properties": {
                "finish_reason": _d(
                    {"type": "string"},
                    "After parsing: tool_calls when backend_finish_reason is stop and the output parsed "
                    "into tool calls; otherwise backend_finish_reason.",
                ),
                "backend_finish_reason": _d({"type": "string"}, "The engine's raw reason: stop, length, abort, ..."),
                "matched": _d(
                    {"type": ["integer", "string"], "maxLength": 256},
                    "With stop: the stop token id or stop string that matched, when the engine said "
                    "(SGLang matched, vLLM stop_reason); a string is cut to 256 characters.",
                ),
                "tool_calls": {
                    "description": "The tool calls the tool-call parser found (names only, never ids or "
                    "arguments); present when one is configured.",
                    "type": "array",
                    "items": {
                        "type": "object",
                        "additionalProperties": False,
                        "required": ["index", "name"],
                        "properties": {"index": _COUNT, "name": {"type": "string"}},
                    },
                },
            },
        },
        "session": {
            "description": "Agent session context from the x-session-id, x-parent-session-id and "
            "x-session-final headers; each field only when its header was sent.",
            "type": "object",
            "additionalProperties": False,
            "minProperties": 1,
            "properties": {
                "session_id": _ID,
                "parent_session_id": _ID,
                "session_final": _d({"type": "boolean"}, "Header value 1, true or yes (any case)."),
            },
        },
        "replay": {
            "description": "Replay context: chained XXH3-64 block hashes of the input token ids "
            "(Dynamo's KV-router scheme, partial last block included), or why there are none.",
            "oneOf": [
                {
                    "type": "object",
                    "additionalProperties": False,
                    "required": ["block_size", "input_length", "block_hashes"],
                    "properties": {
                        "block_size": {"type": "integer", "minimum": 1},
                        "input_length": _COUNT,
                        "block_hashes": {"type": "array", "items": _U64},
                    },
                },
                {
                    "type": "object",
                    "additionalProperties": False,
                    "required": ["excluded"],
                    "properties": {
                        "excluded": _d(
                            {"type": "string", "minLength": 1},
                            "text, multimodal or embeddings (the input was not token ids; codecs may "
                            "name others), not_decoded (the body was never parsed: rejected or "
                            "abandoned), rejected (refused after decoding, before any engine saw "
                            "it, e.g. longer than the model's context) or token_id_out_of_range "
                            "(an input id is not a u32).",
                        )
                    },
                },
            ],
        },
    },
}


def schema_json() -> bytes:
    """The published form of :data:`SCHEMA`: orjson, two-space indent, one
    trailing newline."""
    return orjson.dumps(SCHEMA, option=orjson.OPT_INDENT_2) + b"\n"

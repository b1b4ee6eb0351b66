"""What differs between engine versions on the routes the frontend uses.

A worker reports its engine version at registration (SGLang
``/get_server_info`` ``version``; vLLM ``GET /version`` ``{"version": ...}``,
``vllm/entrypoints/openai/api_server.py`` ``show_version``), and the
router keeps it in ``Worker.info["version"]``. Codecs and the simulator read
the behaviours of that version from here, never from a guess: an unknown or
unreadable version gives ``None`` and the codec then relies on nothing that
differs between versions.

vLLM ``POST /inference/v1/generate`` (tokens in, tokens out), by release, from
vLLM's own source:

- v0.11.2: ``vllm/entrypoints/openai/serving_tokens.py``
  ``OpenAIServingTokens`` (PR #24261, merged 2025-11-14); unary only.
- v0.18.2: ``vllm/entrypoints/serve/disagg/serving.py`` ``ServingTokens``,
  streams too; later ``vllm/entrypoints/scale_out/token_in_token_out/``.
- Every version accepts ``sampling_params.n > 1`` and answers ``n`` choices
  (vLLM's test ``test_generate_returns_all_choices_when_n_greater_than_one``);
  newer builds cap it at the server's ``max_num_seqs`` in
  ``ServingTokens.serve_tokens``. Only the Rust frontend
  (``VLLM_USE_RUST_FRONTEND``) refuses ``n > 1``, so no version is refused
  here.
- Output logprob entries: ``ChatCompletionLogProbsContent`` with a
  ``"token_id:N"`` label and ``bytes`` (``_create_tokens_logprobs``) until
  ``GenerateLogProbs`` (``token_in_token_out/protocol.py``
  ``GenerateLogProb``: integer ``token_id``, ``logprob``, ``rank``; PR
  #58181); each choice carries ``stop_reason`` (the matched stop token id or
  string, null for EOS; PR #47313) and a ``--tokens-only`` server refuses stop
  strings outright instead of ignoring them. vLLM's tags were not readable
  here, so :data:`VLLM_NEWER_SCHEMA_SINCE` is the first release taken to
  carry both (the newest release at the time of writing); move it if a
  release proves otherwise.
"""

from __future__ import annotations

import re
from dataclasses import dataclass

#: The first vLLM release taken to answer with the newer generate schema.
VLLM_NEWER_SCHEMA_SINCE = (0, 33, 0)
#: vLLM versions the simulator plays (``sim --engine-version``), oldest first;
#: the last is the default.
VLLM_VERSIONS = ("0.18.2", "0.33.0")

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
        token_id_logprobs: logprob entries are ``{"token_id", "logprob",
            "rank", "top_logprobs"}`` (else ``{"token": "token_id:N",
            "logprob", "bytes", "top_logprobs"}``).
        stop_reason: each choice carries ``stop_reason``.
        refuses_stop_strings: a ``--tokens-only`` server answers 400 to stop
            strings (else it accepts them and never applies them).
    """

    version: str
    token_id_logprobs: bool
    stop_reason: bool
    refuses_stop_strings: bool


def vllm_behaviour(version: object) -> VLLMBehaviour | None:
    """The behaviours of vLLM ``version``; ``None`` when it is not a
    readable version string."""
    parsed = parse_version(version)
    if parsed is None:
        return None
    newer = parsed >= VLLM_NEWER_SCHEMA_SINCE
    return VLLMBehaviour(str(version), newer, newer, newer)

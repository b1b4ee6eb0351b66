"""Reasoning parsers for ``<think>...</think>`` models, in token space.

Both markers are single added tokens in these models' tokenizers, so the
split is a scan for one token id; nothing is decoded. The reasoning span runs
from the start of the output through ``</think>`` (markers count as
reasoning, so reasoning + answer = output). The two parsers differ only when
the output has no ``</think>``, following vLLM's ``Qwen3ReasoningParser`` and
``DeepSeekR1ReasoningParser`` and SGLang's ``reasoning_parser.py``:

- ``qwen3``: reasoning only if the output opened ``<think>`` (thinking cut
  short, e.g. by ``length``); otherwise all answer (thinking disabled).
- ``deepseek_r1``: all reasoning, since R1's chat template opens ``<think>``
  in the prompt and the model may never close it.
"""

from __future__ import annotations

from typing import Sequence

from tokenizers import Tokenizer

from .parser_api import ReasoningParser, marker_id


class Qwen3ReasoningParser(ReasoningParser):
    """Qwen3 (and QwQ) ``<think>`` reasoning; see the module docstring.

    Raises:
        ParserError: the tokenizer has no ``<think>``/``</think>`` token.
    """

    def __init__(self, tokenizer: Tokenizer) -> None:
        super().__init__(tokenizer)
        self.start_id = marker_id(tokenizer, "<think>", "qwen3")
        self.end_id = marker_id(tokenizer, "</think>", "qwen3")

    def reasoning_length(self, output_ids: Sequence[int]) -> int:
        """Tokens through ``</think>``; all if ``<think>`` opened and never
        closed; else 0."""
        if self.end_id in output_ids:  # a scan in C is cheaper than index()'s ValueError
            return output_ids.index(self.end_id) + 1
        return len(output_ids) if self.start_id in output_ids else 0


class DeepSeekR1ReasoningParser(ReasoningParser):
    """DeepSeek-R1 ``<think>`` reasoning; see the module docstring.

    Raises:
        ParserError: the tokenizer has no ``</think>`` token.
    """

    def __init__(self, tokenizer: Tokenizer) -> None:
        super().__init__(tokenizer)
        self.end_id = marker_id(tokenizer, "</think>", "deepseek_r1")

    def reasoning_length(self, output_ids: Sequence[int]) -> int:
        """Tokens through ``</think>``; all of them if it never came."""
        if self.end_id in output_ids:
            return output_ids.index(self.end_id) + 1
        return len(output_ids)

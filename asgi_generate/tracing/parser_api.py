"""The output parsers' plugin API: the classes a parser subclasses and what
they raise.

Two kinds, both built from the Hugging Face tokenizer given by
``--tokenizer``: a :class:`ReasoningParser` finds how many leading output
tokens are the model's reasoning, a :class:`ToolCallParser` finds the tool
calls in the decoded text that follows it. :mod:`.parsers` finds them by
name (built in, or installed through the ``asgi_generate.parsers`` entry
point group).
"""

from __future__ import annotations

from typing import Sequence

from tokenizers import Tokenizer

from ..exceptions import ParserError


class ReasoningParser:
    """Splits an output into reasoning and answer, in token space.

    Args:
        tokenizer: the model's tokenizer, to look up marker token ids.

    Raises:
        ParserError: the tokenizer lacks a marker the parser needs.
    """

    kind = "reasoning"

    def __init__(self, tokenizer: Tokenizer) -> None:
        self.tokenizer = tokenizer

    def reasoning_length(self, output_ids: Sequence[int]) -> int:
        """How many leading ids of ``output_ids`` are reasoning, markers
        included (``0 <= n <= len(output_ids)``); the rest is the answer."""
        raise NotImplementedError


class ToolCallParser:
    """Finds tool calls in decoded answer text.

    Args:
        tokenizer: the model's tokenizer.

    Raises:
        ParserError: the tokenizer does not suit the parser.
    """

    kind = "tool_call"
    #: Text that every tool call of the format contains (Hermes:
    #: ``<tool_call>``), or ``None``. A parser that sets it promises that
    #: :meth:`tool_call_names` finds no call in text without it, so the
    #: analyzer need not decode an answer whose tokens cannot start it.
    marker: str | None = None

    def __init__(self, tokenizer: Tokenizer) -> None:
        self.tokenizer = tokenizer

    def tool_call_names(self, text: str) -> list[str]:
        """The names of the tool calls in ``text``, in order; ``[]`` when the
        text holds no well-formed tool call."""
        raise NotImplementedError


def marker_id(tokenizer: Tokenizer, marker: str, parser: str) -> int:
    """The single token id of ``marker``.

    Raises:
        ParserError: ``marker`` is not one token of ``tokenizer``.
    """
    token_id = tokenizer.token_to_id(marker)
    if token_id is None:
        raise ParserError(f"parser {parser!r} needs the token {marker!r}, which the tokenizer lacks")
    return token_id

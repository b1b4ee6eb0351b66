"""Output analysis for the trace record: reasoning tokens, tool-call names and
the finish reason after parsing.

Runs in the trace writer, never on the response path. The delivered output
ids are decoded at most once: only the answer part after the reasoning, and
only when a tool-call parser needs text: not when none of the answer's
tokens can start the parser's marker (decoding is most of what the parsers
cost).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Sequence

from tokenizers import Tokenizer, decoders

from ..exceptions import ParserError
from .parser_api import ReasoningParser, ToolCallParser
from .parsers import load_parser


@dataclass(frozen=True, slots=True)
class Analysis:
    """What the parsers found in one output.

    Attributes:
        reasoning_tokens: leading reasoning tokens; ``None`` without a
            reasoning parser.
        tool_calls: tool-call names in order; ``None`` without a tool-call
            parser or when it did not run (see :meth:`OutputAnalyzer.analyze`).
    """

    reasoning_tokens: int | None
    tool_calls: list[str] | None


def final_finish_reason(backend: str | None, tool_calls: list[str] | None) -> str | None:
    """The finish reason a client-facing layer would report: ``tool_calls``
    when the engine stopped naturally (``stop``) and the output parsed into
    tool calls; otherwise the engine's raw reason (``length``, ``abort``, ...
    are never rewritten)."""
    if backend == "stop" and tool_calls:
        return "tool_calls"
    return backend


def ids_starting(tokenizer: Tokenizer, marker: str) -> frozenset[int] | None:
    """The token ids whose decoded text can hold the start of ``marker``
    (a ``marker[0]`` that the rest of the token does not contradict), when
    the tokenizer says exactly which: a byte-level one (GPT-2's
    ``ByteLevel`` decoder: Qwen, Llama 3, DeepSeek) and a printable ASCII
    ``marker``. Its vocabulary spells each byte as one character, ASCII as
    itself, and the decoded text holds ``marker`` exactly where the bytes do
    (UTF-8 never hides an ASCII byte in another character, not even a
    replaced one); added tokens count by their text. ``None`` otherwise:
    then any id can.

    Cost: one pass over the vocabulary (~0.1 s for 150K tokens), once.
    """
    if type(tokenizer.decoder) is not decoders.ByteLevel or not (marker and all("!" <= c <= "~" for c in marker)):
        return None
    return frozenset(i for token, i in tokenizer.get_vocab(with_added_tokens=True).items()
                     if any(marker.startswith(token[p:p + len(marker)])
                            for p in range(len(token)) if token[p] == marker[0]))


class OutputAnalyzer:
    """A tokenizer plus the configured parsers.

    Args:
        tokenizer_path: a Hugging Face ``tokenizer.json``.
        reasoning: a reasoning parser name, or ``None``.
        tool_call: a tool-call parser name, or ``None``.

    Raises:
        ParserError: the tokenizer does not load, or a parser is unknown or
            rejects it.
    """

    def __init__(self, tokenizer_path: str, reasoning: str | None, tool_call: str | None) -> None:
        try:
            self.tokenizer = Tokenizer.from_file(tokenizer_path)
        except Exception as exc:  # tokenizers raises a bare Exception
            raise ParserError(f"cannot load tokenizer {tokenizer_path!r}: {exc}") from None
        self.reasoning: ReasoningParser | None = (
            load_parser("reasoning", reasoning, self.tokenizer) if reasoning else None
        )
        self.tool_call: ToolCallParser | None = (
            load_parser("tool_call", tool_call, self.tokenizer) if tool_call else None
        )
        marker = self.tool_call.marker if self.tool_call is not None else None
        #: The ids that can start the tool-call parser's marker; ``None``: any.
        self.marker_ids = ids_starting(self.tokenizer, marker) if marker else None

    def analyze(self, output_ids: Sequence[int], finished: bool) -> Analysis:
        """Parse the output the client was sent.

        Args:
            output_ids: the delivered output token ids.
            finished: the engine ended the output (a finish reason came);
                tool calls are only looked for then, as a cut-off output's
                last call is incomplete.
        """
        n = self.reasoning.reasoning_length(output_ids) if self.reasoning is not None else 0
        names = None
        if self.tool_call is not None and finished:
            answer = output_ids[n:]
            if self.marker_ids is not None and self.marker_ids.isdisjoint(answer):
                names = []  # no marker in its text: no call (the parser's promise)
            else:
                text = self.tokenizer.decode(answer, skip_special_tokens=False) if answer else ""
                names = self.tool_call.tool_call_names(text)
        return Analysis(n if self.reasoning is not None else None, names)

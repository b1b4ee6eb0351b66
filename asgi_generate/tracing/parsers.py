"""Output parsers the trace writer runs: the plugin API and its registry.

Two kinds, both built from the Hugging Face tokenizer given by
``--tokenizer``:

- a :class:`ReasoningParser` finds how many leading output tokens are the
  model's reasoning (``--reasoning-parser``; built in: ``qwen3``,
  ``deepseek_r1``);
- a :class:`ToolCallParser` finds the tool calls in the decoded text that
  follows the reasoning (``--tool-call-parser``; built in: ``hermes``).

More parsers install through the entry point group ``asgi_generate.parsers``:
the entry point's name is the parser's name, its object a subclass of either
class (or a factory with the same signature and a ``kind`` attribute).
"""

from __future__ import annotations

from importlib.metadata import entry_points
from typing import Sequence

from tokenizers import Tokenizer

GROUP = "asgi_generate.parsers"


class ParserError(ValueError):
    """A parser is unknown, or cannot work with the given tokenizer."""


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


def _builtin() -> dict[str, type]:
    from .reasoning import DeepSeekR1ReasoningParser, Qwen3ReasoningParser
    from .tool_calls import HermesToolCallParser

    return {
        "qwen3": Qwen3ReasoningParser,
        "deepseek_r1": DeepSeekR1ReasoningParser,
        "hermes": HermesToolCallParser,
    }


def available(kind: str) -> list[str]:
    """Names of the parsers of ``kind`` (``reasoning`` or ``tool_call``),
    built in and installed."""
    names = {n for n, cls in _builtin().items() if cls.kind == kind}
    for ep in entry_points(group=GROUP):
        try:
            if getattr(ep.load(), "kind", None) == kind:
                names.add(ep.name)
        except Exception:  # a broken plugin is reported when it is asked for
            continue
    return sorted(names)


def load_parser(kind: str, name: str, tokenizer: Tokenizer):
    """Build the parser ``name`` of ``kind`` for ``tokenizer``; an installed
    entry point of the same name overrides a built-in one.

    Raises:
        ParserError: no such parser, it is of another kind, it fails to
            load, or it rejects the tokenizer.
    """
    found = [ep for ep in entry_points(group=GROUP) if ep.name == name]
    try:
        factory = found[0].load() if found else _builtin().get(name)
    except Exception as exc:
        raise ParserError(f"parser {name!r} ({found[0].value}) failed to load: {exc!r}") from exc
    if factory is None or getattr(factory, "kind", None) != kind:
        raise ParserError(f"unknown {kind} parser {name!r} (known: {', '.join(available(kind))})")
    return factory(tokenizer)

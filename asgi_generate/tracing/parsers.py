"""Output parsers the trace writer runs: the registry of the plugin API's
(:mod:`.parser_api`) parsers, by name.

Two kinds, both built from the Hugging Face tokenizer given by
``--tokenizer``:

- a :class:`~.parser_api.ReasoningParser` finds how many leading output
  tokens are the model's reasoning (``--reasoning-parser``; built in:
  ``qwen3``, ``deepseek_r1``);
- a :class:`~.parser_api.ToolCallParser` finds the tool calls in the decoded
  text that follows the reasoning (``--tool-call-parser``; built in: ``hermes``).

More parsers install through the entry point group ``asgi_generate.parsers``:
the entry point's name is the parser's name, its object a subclass of either
class (or a factory with the same signature and a ``kind`` attribute).
"""

from __future__ import annotations

from importlib.metadata import entry_points

from tokenizers import Tokenizer

from ..exceptions import ParserError
from .reasoning import DeepSeekR1ReasoningParser, Qwen3ReasoningParser
from .tool_calls import HermesToolCallParser

GROUP = "asgi_generate.parsers"
_BUILTIN: dict[str, type] = {
    "qwen3": Qwen3ReasoningParser,
    "deepseek_r1": DeepSeekR1ReasoningParser,
    "hermes": HermesToolCallParser,
}


def available(kind: str) -> list[str]:
    """Names of the parsers of ``kind`` (``reasoning`` or ``tool_call``),
    built in and installed."""
    names = {n for n, cls in _BUILTIN.items() if cls.kind == kind}
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
        factory = found[0].load() if found else _BUILTIN.get(name)
    except Exception as exc:
        raise ParserError(f"parser {name!r} ({found[0].value}) failed to load: {exc!r}") from exc
    if factory is None or getattr(factory, "kind", None) != kind:
        raise ParserError(f"unknown {kind} parser {name!r} (known: {', '.join(available(kind))})")
    return factory(tokenizer)

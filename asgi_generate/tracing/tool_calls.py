"""The Hermes tool-call parser (Hermes 2 Pro, Qwen2.5/Qwen3 and their kin).

Format (NousResearch Hermes function calling; vLLM ``hermes_tool_parser.py``)::

    <tool_call>
    {"name": "get_weather", "arguments": {"city": "Paris"}}
    </tool_call>

repeated once per call, possibly after some answer text. Like vLLM, a last
``<tool_call>`` left open is read to the end of the text, and a call that is
not a JSON object with a string ``name`` makes the whole output count as
having no tool calls (vLLM then returns it as plain content).
"""

from __future__ import annotations

import re

import orjson
from tokenizers import Tokenizer

from .parser_api import ToolCallParser, marker_id

_CALL = re.compile(r"<tool_call>(.*?)</tool_call>|<tool_call>(.*)", re.DOTALL)


class HermesToolCallParser(ToolCallParser):
    """``<tool_call>{json}</tool_call>`` blocks; see the module docstring.

    Raises:
        ParserError: the tokenizer has no ``<tool_call>``/``</tool_call>``
            token (a model without them cannot emit this format).
    """

    marker = "<tool_call>"

    def __init__(self, tokenizer: Tokenizer) -> None:
        super().__init__(tokenizer)
        marker_id(tokenizer, "<tool_call>", "hermes")
        marker_id(tokenizer, "</tool_call>", "hermes")

    def tool_call_names(self, text: str) -> list[str]:
        """The ``name`` of each call, in order; ``[]`` if any call is malformed."""
        if "<tool_call>" not in text:
            return []
        names = []
        for closed, open_ in _CALL.findall(text):
            try:
                call = orjson.loads((closed or open_).strip())
            except orjson.JSONDecodeError:
                return []
            if type(call) is not dict or type(call.get("name")) is not str:
                return []
            names.append(call["name"])
        return names

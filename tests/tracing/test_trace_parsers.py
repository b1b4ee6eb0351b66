"""Reasoning and tool-call parsers on real-looking model output, the
finish-reason rewrite rules, and parser loading (built in and plugins)."""

from __future__ import annotations

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st
from tokenizers import Tokenizer, decoders, models

from asgi_generate.assets import TOKENIZER_PATH
from asgi_generate.tracing import parsers
from asgi_generate.tracing.analysis import Analysis, OutputAnalyzer, final_finish_reason, ids_starting
from asgi_generate.exceptions import ParserError
from asgi_generate.tracing.parser_api import ReasoningParser
from asgi_generate.tracing.parsers import load_parser
from asgi_generate.tracing.reasoning import DeepSeekR1ReasoningParser, Qwen3ReasoningParser
from asgi_generate.tracing.tool_calls import HermesToolCallParser

TOK = Tokenizer.from_file(str(TOKENIZER_PATH))


def enc(text: str) -> list[int]:
    return TOK.encode(text, add_special_tokens=False).ids


# Qwen3 with thinking on: the model opens and closes <think> itself.
QWEN3_THINKING = enc(
    "<think>\nThe user asks for 17 * 23. 17 * 20 = 340 and 17 * 3 = 51, so 391.\n</think>"
    "\n\n17 * 23 = 391.<|im_end|>"
)
# DeepSeek-R1 / Qwen3-2507 thinking: the template put <think> in the prompt.
R1_TOOL = enc(
    "Okay, the user wants the weather in Paris. I should call the tool.\n</think>"
    '\n\n<tool_call>\n{"name": "get_weather", "arguments": {"city": "Paris"}}\n</tool_call><|im_end|>'
)
HERMES_TWO = (
    "I'll look both up.\n"
    '<tool_call>\n{"name": "get_weather", "arguments": {"city": "Paris"}}\n</tool_call>\n'
    '<tool_call>\n{"name": "get_time", "arguments": {"timezone": "Europe/Paris"}}\n</tool_call>'
)


def test_qwen3_counts_through_the_closing_marker():
    p = Qwen3ReasoningParser(TOK)
    assert (p.start_id, p.end_id) == (3, 4)
    assert len(QWEN3_THINKING) == 49
    assert p.reasoning_length(QWEN3_THINKING) == 37
    assert QWEN3_THINKING[36] == 4


def test_qwen3_open_think_cut_short_is_all_reasoning_and_no_think_is_none():
    p = Qwen3ReasoningParser(TOK)
    cut = QWEN3_THINKING[:20]
    assert p.reasoning_length(cut) == 20
    assert p.reasoning_length(enc("Paris is the capital of France.<|im_end|>")) == 0
    assert p.reasoning_length([]) == 0


def test_qwen3_closing_marker_without_opening_one():
    assert Qwen3ReasoningParser(TOK).reasoning_length(R1_TOOL) == 25


def test_deepseek_r1_reasoning():
    p = DeepSeekR1ReasoningParser(TOK)
    assert p.reasoning_length(R1_TOOL) == 25
    assert p.reasoning_length(QWEN3_THINKING) == 37
    # Never closed: R1 is still thinking, so all of it is reasoning.
    unclosed = enc("Okay, let me think about this carefully")
    assert p.reasoning_length(unclosed) == len(unclosed) == 15
    assert p.reasoning_length([]) == 0


def test_hermes_names_in_order():
    p = HermesToolCallParser(TOK)
    assert p.tool_call_names(HERMES_TWO) == ["get_weather", "get_time"]
    assert p.tool_call_names(TOK.decode(R1_TOOL[25:], skip_special_tokens=False)) == ["get_weather"]


def test_hermes_no_calls_and_malformed_calls():
    p = HermesToolCallParser(TOK)
    assert p.tool_call_names("The weather in Paris is sunny.") == []
    assert p.tool_call_names("") == []
    # One bad call spoils all of them, as in vLLM.
    bad_json = HERMES_TWO.replace('"get_time", "arguments"', '"get_time" "arguments"')
    assert p.tool_call_names(bad_json) == []
    assert p.tool_call_names('<tool_call>\n{"name": 7}\n</tool_call>') == []
    assert p.tool_call_names("<tool_call>\n[1, 2]\n</tool_call>") == []


def test_hermes_reads_an_unclosed_last_call():
    p = HermesToolCallParser(TOK)
    text = '<tool_call>\n{"name": "search", "arguments": {"q": "asgi"}}\n'
    assert p.tool_call_names(text) == ["search"]
    assert p.tool_call_names('<tool_call>\n{"name": "search", "argu') == []


def test_finish_reason_rewrite_rules():
    assert final_finish_reason("stop", ["get_weather"]) == "tool_calls"
    assert final_finish_reason("stop", []) == "stop"
    assert final_finish_reason("stop", None) == "stop"
    assert final_finish_reason("length", ["get_weather"]) == "length"
    assert final_finish_reason("abort", ["get_weather"]) == "abort"
    assert final_finish_reason(None, ["get_weather"]) is None


class CountingTokenizer:
    """Wraps a tokenizer and counts decode calls."""

    def __init__(self, tok: Tokenizer) -> None:
        self.tok = tok
        self.decodes = 0

    def decode(self, ids, skip_special_tokens=True):
        self.decodes += 1
        return self.tok.decode(ids, skip_special_tokens=skip_special_tokens)


def test_analyzer_decodes_only_the_answer_once():
    a = OutputAnalyzer(str(TOKENIZER_PATH), "deepseek_r1", "hermes")
    counting = CountingTokenizer(a.tokenizer)
    a.tokenizer = counting
    assert a.analyze(R1_TOOL, finished=True) == Analysis(25, ["get_weather"])
    assert counting.decodes == 1
    # Cut off (no finish reason): tool calls are not looked for, nothing decoded.
    assert a.analyze(R1_TOOL, finished=False) == Analysis(25, None)
    assert counting.decodes == 1
    # All reasoning: no answer to decode.
    assert a.analyze(R1_TOOL[:10], finished=True) == Analysis(10, [])
    assert counting.decodes == 1


def test_the_ids_that_can_start_a_marker():
    ids = ids_starting(TOK, "<tool_call>")
    assert TOK.token_to_id("<tool_call>") in ids
    # Tokens whose '<' goes on otherwise cannot start it.
    assert not {TOK.token_to_id(t) for t in ("<think>", "</tool_call>", "<|im_end|>")} & ids
    one = {i for i in range(TOK.get_vocab_size()) if "<" in TOK.decode([i], skip_special_tokens=False)}
    assert ids < one
    # Not a byte-level decoder, or not printable ASCII: any id can.
    wordpiece = Tokenizer(models.WordLevel({"a": 0, "<": 1, "[UNK]": 2}, unk_token="[UNK]"))
    wordpiece.decoder = decoders.WordPiece()
    assert ids_starting(wordpiece, "<tool_call>") is None
    assert ids_starting(TOK, "<é>") is None and ids_starting(TOK, "< x") is None and ids_starting(TOK, "") is None


MARKER_PIECES = [TOK.token_to_id(t) for t in ("<tool_call>", "<|im_end|>", "<think>")] + enc("<tool_call>")


# 200 decodes take about 25 s at a load of 10: a longer hang bound.
@pytest.mark.timeout(120)
@settings(max_examples=200, deadline=None)
@given(st.lists(st.one_of(st.integers(0, TOK.get_vocab_size() - 1), st.sampled_from(MARKER_PIECES)), max_size=40))
def test_an_answer_without_those_ids_decodes_without_the_marker(ids):
    # Byte-level pieces that are halves of characters included.
    if ids_starting(TOK, "<tool_call>").isdisjoint(ids):
        assert "<tool_call>" not in TOK.decode(ids, skip_special_tokens=False)


def test_analyzer_decodes_no_answer_that_cannot_hold_the_marker():
    a = OutputAnalyzer(str(TOKENIZER_PATH), "qwen3", "hermes")
    counting = CountingTokenizer(a.tokenizer)
    a.tokenizer = counting
    plain = enc("Paris is the capital of France.</b> 17 * 23 <= 391<|im_end|>")
    assert a.analyze(QWEN3_THINKING, finished=True) == Analysis(37, [])
    assert a.analyze(plain, finished=True) == Analysis(0, [])
    assert counting.decodes == 0
    # The marker spelled by ordinary tokens is decoded and parsed as the marker.
    spelled = enc("<") + enc("tool_call>") + enc('\n{"name": "f"}\n</tool_call>')
    assert TOK.token_to_id("<tool_call>") not in spelled
    assert a.analyze(spelled, finished=True) == Analysis(0, ["f"])
    assert counting.decodes == 1


def test_analyzer_with_one_parser_each():
    assert OutputAnalyzer(str(TOKENIZER_PATH), "qwen3", None).analyze(QWEN3_THINKING, True) == Analysis(37, None)
    assert OutputAnalyzer(str(TOKENIZER_PATH), None, "hermes").analyze(enc(HERMES_TWO), True) == Analysis(
        None, ["get_weather", "get_time"]
    )


def test_load_parser_errors():
    with pytest.raises(ParserError, match=r"unknown reasoning parser 'qwen9' \(known: deepseek_r1, qwen3\)"):
        load_parser("reasoning", "qwen9", TOK)
    with pytest.raises(ParserError, match=r"unknown tool_call parser 'qwen3' \(known: hermes\)"):
        load_parser("tool_call", "qwen3", TOK)
    bare = Tokenizer(models.WordLevel({"a": 0, "[UNK]": 1}, unk_token="[UNK]"))
    with pytest.raises(ParserError, match="parser 'qwen3' needs the token '<think>'"):
        load_parser("reasoning", "qwen3", bare)
    with pytest.raises(ParserError, match="parser 'hermes' needs the token '<tool_call>'"):
        load_parser("tool_call", "hermes", bare)
    with pytest.raises(ParserError, match="cannot load tokenizer '/nonexistent/tokenizer.json'"):
        OutputAnalyzer("/nonexistent/tokenizer.json", "qwen3", None)


class FirstTokenReasoning(ReasoningParser):
    """A plugin parser: the first token is the reasoning."""

    def reasoning_length(self, output_ids):
        return min(1, len(output_ids))


class FakeEntryPoint:
    def __init__(self, name, obj):
        self.name = name
        self.value = f"plugin:{name}"
        self._obj = obj

    def load(self):
        if isinstance(self._obj, Exception):
            raise self._obj
        return self._obj


def test_entry_point_parsers(monkeypatch):
    eps = [FakeEntryPoint("first", FirstTokenReasoning), FakeEntryPoint("broken", ImportError("no module x"))]
    monkeypatch.setattr(parsers, "entry_points", lambda group: eps if group == parsers.GROUP else [])
    parser = load_parser("reasoning", "first", TOK)
    assert isinstance(parser, FirstTokenReasoning)
    assert parser.reasoning_length([9, 9, 9]) == 1
    assert parsers.available("reasoning") == ["deepseek_r1", "first", "qwen3"]
    with pytest.raises(ParserError, match=r"parser 'broken' \(plugin:broken\) failed to load: ImportError"):
        load_parser("reasoning", "broken", TOK)

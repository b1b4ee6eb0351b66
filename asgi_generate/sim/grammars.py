"""Constrained-decoding requests (grammars), refused as the engines refuse them.

SGLang (0.5.23, default ``--grammar-backend xgrammar``): ``sampling_params``
``json_schema``, ``regex``, ``ebnf`` or ``structural_tag`` is compiled by the
scheduler (``srt/constrained/grammar_manager.py``
``GrammarManager.process_req_with_grammar``, the first of them that is set,
in that order); one that does not compile aborts the request with status
400 and ``Failed to compile {json|regex|ebnf|structural_tag} grammar:
{reason}`` (``Req.set_finish_with_abort``; the HTTP answer is then a 400
``{"error": {"message"}}``, or the abort finish as a stream's last chunk).
The reasons the simulator gives exactly are the backend's own checks
(``base_grammar_backend.py`` ``_init_value_dispatch``: a NUL byte;
``xgrammar_backend.py``: a JSON decode error of the schema or the structural
tag, as Python's ``json`` words it; ``json_schema_validation.py``
``validate_xgrammar_json_schema``: keywords and string formats XGrammar
would ignore); where XGrammar's compiler itself refuses (a regex that does
not parse, a schema that is not JSON Schema, an EBNF without a ``root``
rule, a structural tag of neither layout) the reason is the simulator's own
wording. A grammar that compiles is not applied: the answer is the model's
unconstrained continuation.

vLLM: a ``--tokens-only`` server runs without a tokenizer
(``EngineArgs.create_engine_config`` sets ``skip_tokenizer_init``), so
``SamplingParams._validate_structured_outputs`` refuses every
``structured_outputs`` request, valid or not, with
:data:`VLLM_REFUSAL` (400 ``BadRequestError``), in every version the
simulator plays.
"""

from __future__ import annotations

import json
import re
from typing import Any

#: SGLang's grammar fields, in the order its scheduler reads them, with the
#: key type its messages name.
SGLANG_GRAMMARS = (("json_schema", "json"), ("regex", "regex"), ("ebnf", "ebnf"), ("structural_tag", "structural_tag"))
#: vLLM's refusal of structured outputs without a tokenizer.
VLLM_REFUSAL = "Structured outputs requires a tokenizer so it can't be used with 'skip_tokenizer_init'"

# validate_xgrammar_json_schema's keyword sets (json_schema_validation.py).
_XGRAMMAR_UNSUPPORTED = frozenset({
    "contains", "dependentRequired", "dependentSchemas", "else", "if", "maxContains", "minContains",
    "multipleOf", "not", "then", "uniqueItems",
})
_XGRAMMAR_FORMATS = frozenset({
    "date", "date-time", "duration", "email", "hostname", "ipv4", "ipv6", "json-pointer",
    "relative-json-pointer", "time", "uri", "uri-reference", "uri-template", "uuid",
})
_ONE_SUBSCHEMA = ("additionalItems", "additionalProperties", "contains", "contentSchema", "else", "if", "items",
                  "not", "propertyNames", "then", "unevaluatedItems", "unevaluatedProperties")
_SUBSCHEMA_LISTS = ("allOf", "anyOf", "oneOf", "prefixItems")
_SUBSCHEMA_MAPS = ("$defs", "definitions", "dependentSchemas", "patternProperties", "properties")
_EBNF_ROOT = re.compile(r"^\s*root\s*::=", re.MULTILINE)


class GrammarError(ValueError):
    """A grammar that does not compile: ``str()`` is the reason."""


def sglang_grammar_refusal(sp: dict) -> str | None:
    """SGLang's abort message for the grammar in ``sp`` (a request's
    ``sampling_params``), ``None`` when it has none or it compiles.

    Empty strings count as unset (``SamplingParams.__post_init__``).
    """
    for field, kind in SGLANG_GRAMMARS:
        value = sp.get(field)
        if not value:
            continue
        try:
            _compile(kind, value)
        except GrammarError as exc:
            return f"Failed to compile {kind} grammar: {exc}"
        return None
    return None


def _compile(kind: str, text: Any) -> None:
    """Check ``text`` as SGLang's XGrammar backend compiles a ``kind`` grammar.

    Raises:
        GrammarError: the reason it does not compile.
    """
    if not isinstance(text, str):
        raise GrammarError(f"expected a string, got {type(text).__name__}")
    if "\x00" in text:
        raise GrammarError(f"Invalid {kind}: NUL bytes (\\u0000) are not allowed")
    if kind == "regex":
        try:
            re.compile(text)
        except re.error as exc:
            raise GrammarError(f"regex does not parse: {exc}") from None
    elif kind == "ebnf":
        if not _EBNF_ROOT.search(text):
            raise GrammarError('the grammar has no rule named "root"')
    elif kind == "json":
        if text != "$$ANY$$":  # XGrammar's built-in grammar of any JSON value
            schema = _json(text)
            _xgrammar_supports(schema)
            import jsonschema  # here: its import is a sixth of the simulator's start, for a rare request

            try:
                jsonschema.Draft202012Validator.check_schema(schema)
            except jsonschema.SchemaError as exc:
                raise GrammarError(f"not a JSON Schema: {exc.message}") from None
    else:
        tag = _json(text)
        if not isinstance(tag, dict) or not (
            isinstance(tag.get("format"), dict) or ("structures" in tag and "triggers" in tag)
        ):
            raise GrammarError('a structural tag is {"format": {...}} or {"structures": [...], "triggers": [...]}')


def _json(text: str) -> Any:
    try:
        return json.loads(text)
    except json.JSONDecodeError as exc:
        raise GrammarError(str(exc)) from None


def _subschemas(schema: Any, pointer: str = "#"):
    """``(subschema, JSON pointer)`` of every schema-bearing keyword, the
    walk of ``json_schema_validation._iter_subschemas`` (in a fixed order)."""
    if not isinstance(schema, dict):
        return
    yield schema, pointer
    for key in _ONE_SUBSCHEMA:
        child = schema.get(key)
        if isinstance(child, (bool, dict)):
            yield from _subschemas(child, f"{pointer}/{key}")
        elif key == "items" and isinstance(child, list):
            for i, item in enumerate(child):
                yield from _subschemas(item, f"{pointer}/{key}/{i}")
    for key in _SUBSCHEMA_LISTS:
        children = schema.get(key)
        if isinstance(children, list):
            for i, child in enumerate(children):
                yield from _subschemas(child, f"{pointer}/{key}/{i}")
    for key in (*_SUBSCHEMA_MAPS, "dependencies"):
        children = schema.get(key)
        if isinstance(children, dict):
            for name, child in children.items():
                if key != "dependencies" or isinstance(child, (bool, dict)):
                    escaped = name.replace("~", "~0").replace("/", "~1")
                    yield from _subschemas(child, f"{pointer}/{key}/{escaped}")


def _xgrammar_supports(schema: Any) -> None:
    """``validate_xgrammar_json_schema``: constraints XGrammar would ignore.

    Raises:
        GrammarError: SGLang's ``UnsupportedJSONSchemaFeature`` message.
    """
    for sub, pointer in _subschemas(schema):
        def refuse(reason: str) -> None:
            raise GrammarError(f"JSON Schema at {pointer} is not supported by xgrammar: {reason}")

        unsupported = sorted(_XGRAMMAR_UNSUPPORTED.intersection(sub))
        if unsupported:
            refuse(f"keyword(s) {', '.join(unsupported)} would be ignored")
        kind = sub.get("type")
        if not (kind is None or kind == "string" or (isinstance(kind, list) and "string" in kind)):
            continue
        if "format" in sub and (not isinstance(sub["format"], str) or sub["format"] not in _XGRAMMAR_FORMATS):
            refuse(f"string format {sub['format']!r} is not implemented")
        groups = [name for name, keys in (("format", ("format",)), ("pattern", ("pattern",)),
                                          ("minLength/maxLength", ("minLength", "maxLength")))
                  if any(k in sub for k in keys)]
        if len(groups) > 1:
            refuse(f"constraints {', '.join(groups)} cannot be enforced together")

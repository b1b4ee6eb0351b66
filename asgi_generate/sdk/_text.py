"""The model's tokenizer on the frontend (``--tokenizer``), used only when a
stream migrates: a text prompt's token ids for the resumed leg, the stop
strings a migration seam would hide from the engine, and the answer's text
across the seam.

Both run off the happy path: nothing here is touched until a worker dies
mid-answer.
"""

from __future__ import annotations

from tokenizers import Tokenizer
from tokenizers.decoders import DecodeStream


class PromptTokenizer:
    """A Hugging Face ``tokenizer.json``, loaded once.

    Args:
        path: the file (``--tokenizer``).

    Raises:
        ValueError: the file does not load as a tokenizer.
    """

    def __init__(self, path: str) -> None:
        try:
            self._tok = Tokenizer.from_file(path)
        except Exception as exc:  # tokenizers raises a bare Exception
            first = str(exc).splitlines()[0] if str(exc) else type(exc).__name__
            raise ValueError(f"cannot load tokenizer {path!r}: {first}") from None

    def encode(self, text: str) -> list[int]:
        """``text``'s token ids as SGLang tokenizes a ``text`` prompt:
        ``TokenizerManager._tokenize_texts`` calls the Hugging Face tokenizer
        with its defaults, so special tokens are added as the tokenizer's
        post-processor says (``add_special_tokens=True``), and special-token
        text in the prompt is parsed as those tokens."""
        return self._tok.encode(text, add_special_tokens=True).ids

    def stop_watch(self, stops: tuple[str, ...], before: list[int], skip_special: bool, trim: bool) -> "StopWatch":
        """A :class:`StopWatch` over output that began with ``before``."""
        return StopWatch(self._tok, stops, before, skip_special, trim)


class StopWatch:
    """Decodes a whole output across a migration seam and checks SGLang stop
    strings over it, token by token, as an uninterrupted engine would (the
    simulator's and SGLang's rule: after each token, look for a stop string
    in the decoded output from where the last piece could have completed
    one), for the tokens after a seam.

    Args:
        tok: the tokenizer.
        stops: the request's stop strings.
        before: the output ids sent before the seam (already checked).
        skip_special: SGLang ``skip_special_tokens``.
        trim: the answer's text ends where the stop string begins (SGLang's
            default; ``no_stop_trim`` keeps it).
    """

    __slots__ = ("_tok", "_stream", "stops", "longest", "text", "trim", "ids", "skip_special")

    def __init__(
        self, tok: Tokenizer, stops: tuple[str, ...], before: list[int], skip_special: bool, trim: bool
    ) -> None:
        self._tok = tok
        self.trim = trim
        self.skip_special = skip_special
        self._stream = DecodeStream(skip_special_tokens=skip_special)
        self.stops = stops
        self.longest = max((len(s) for s in stops), default=0)
        #: The whole output so far, and its text piece by piece (what SGLang
        #: checks and streams): one decoder across the seam, so a character
        #: whose bytes straddle it comes out whole.
        self.ids: list[int] = []
        self.text = ""
        for t in before:
            self.ids.append(t)
            self.text += self._stream.step(tok, t) or ""

    def decoded(self, drop_last: bool) -> str:
        """The whole output decoded at once (SGLang's final ``text``),
        without its last token when ``drop_last`` (a trimmed stop token)."""
        return self._tok.decode(self.ids[:-1] if drop_last else self.ids, skip_special_tokens=self.skip_special)

    def step(self, token_id: int) -> tuple[str, int] | None:
        """Add one output token; ``(stop string, its offset in the text)``
        when the output now holds a stop string, else ``None``."""
        piece = self._stream.step(self._tok, token_id) or ""
        self.ids.append(token_id)
        self.text += piece
        tail = max(0, len(self.text) - len(piece) - self.longest)
        for s in self.stops:
            at = self.text.find(s, tail)
            if at >= 0:
                return s, at
        return None

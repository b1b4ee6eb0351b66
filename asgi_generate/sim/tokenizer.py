"""The simulator's view of a Hugging Face ``tokenizer.json``."""

from __future__ import annotations

import pathlib
from typing import Callable

from tokenizers import Tokenizer
from tokenizers.decoders import DecodeStream

from ..assets import TOKENIZER_PATH
from .model import Model

EOS_TOKEN = "<|im_end|>"


class SimTokenizer:
    """Encode prompts and decode output with a ``tokenizers`` tokenizer.

    Args:
        path: a ``tokenizer.json``; the bundled one by default. It must define
            ``<|im_end|>``, which the simulator uses as EOS.

    Raises:
        ValueError: the tokenizer has no ``<|im_end|>`` token.
    """

    def __init__(self, path: str | pathlib.Path = TOKENIZER_PATH) -> None:
        self.path = pathlib.Path(path)
        self._tok = Tokenizer.from_file(str(self.path))
        self.vocab_size = self._tok.get_vocab_size()
        eos = self._tok.token_to_id(EOS_TOKEN)
        if eos is None:
            raise ValueError(f"{self.path} has no {EOS_TOKEN} token")
        self.eos_id = eos
        specials = [
            i for i, t in self._tok.get_added_tokens_decoder().items() if t.special
        ]
        # The model never samples specials except EOS; they sit at the start.
        self.num_special = max(specials) + 1 if specials else 0
        self._pieces = [self._tok.decode([i], skip_special_tokens=False) for i in range(self.vocab_size)]
        #: Each vocabulary size's computed steps, shared by the models of
        #: this tokenizer (:meth:`model`).
        self._steps: dict[int | None, dict] = {}

    def partial_ids(self) -> frozenset[int]:
        """Ordinary ids whose text alone is not whole characters (a byte-level
        BPE's lone bytes 0x80-0xFF: U+FFFD when decoded by themselves)."""
        return frozenset(i for i in range(self.num_special, self.vocab_size) if "\ufffd" in self._pieces[i])

    def model(self, vocab_size: int | None = None) -> Model:
        """The simulator's model over this tokenizer's ids: EOS
        ``<|im_end|>``, never a special token or a partial byte
        (:meth:`partial_ids`); its vocabulary ``vocab_size`` ids (default
        the tokenizer's; more pads it, as real checkpoints are padded).
        The models of one tokenizer and vocabulary share their computed
        steps (a step is a pure function of its prefix state, which holds
        the weight version: :class:`~asgi_generate.sim.model.Model`), so
        the workers of ``sim --workers N`` hold one bounded step cache
        between them, not one each.

        Raises:
            ValueError: ``vocab_size`` is below the tokenizer's.
        """
        return Model(vocab_size or self.vocab_size, self.eos_id, self.num_special, unsampled=self.partial_ids(),
                     drawn=self.vocab_size, steps=self._steps.setdefault(vocab_size or self.vocab_size, {}))

    def encode(self, text: str) -> list[int]:
        """Token ids of ``text`` (no special tokens added)."""
        return self._tok.encode(text, add_special_tokens=False).ids

    def decode(self, ids: list[int], skip_special: bool = True) -> str:
        """The text of ``ids``."""
        return self._tok.decode(ids, skip_special_tokens=skip_special)

    def piece(self, token_id: int) -> str:
        """The text of one token, special tokens included (logprob labels);
        ``""`` for a padding id past the tokenizer's."""
        return self._pieces[token_id] if token_id < self.vocab_size else ""

    def stream_decoder(self, skip_special: bool = True) -> Callable[[int], str]:
        """Incremental decoding, linear in the output length: returns a
        function that takes the next token id and returns the text it
        completes (``""`` while a character is still incomplete)."""
        ds = DecodeStream(skip_special_tokens=skip_special)
        tok = self._tok
        return lambda token_id: ds.step(tok, token_id) or ""

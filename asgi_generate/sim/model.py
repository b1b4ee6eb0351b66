"""The simulator's deterministic language model.

Every output of the model is a pure function of the token prefix before it:
the next token, its logprob, the top-k alternatives and the routed-expert rows.
A request resumed with ``prompt + generated`` therefore continues exactly where
an uninterrupted run would, which is what makes migration and P/D testable
value for value.

The prefix state is a 64-bit fold over the tokens (a SplitMix64-style mixer),
computed incrementally, so a resumed prefix reaches the same state as the
original run token by token.

The weights are a version: ``"default"`` (what an engine starts with) is
the empty prefix's state above; any other weight version mixes a seed
derived from its name into that state (:func:`version_origin`), so every
answer, logprob and expert row changes with the version, deterministically
across processes, and a test can tell which version produced each token.

Parallel samples (SGLang and vLLM ``n`` > 1) stand for independent random
draws: sample ``i`` ranks its next token at the prefix state mixed with
``i`` (:meth:`Model.sampled`), so its output is a pure function of the
prefix and ``i``; sample 0 is the prefix's own state, the output every
``n`` = 1 request gets.
"""

from __future__ import annotations

import array
import base64
import hashlib
import struct
import sys
from dataclasses import dataclass

_MASK = (1 << 64) - 1
_GOLDEN = 0x9E3779B97F4A7C15

#: Candidates the model ranks at each step (the largest top-k it can return).
NUM_CANDIDATES = 20
#: Steps :meth:`Model.step` keeps (a hot prefix repeats; every other state
#: is drawn once). A step holds its 20 candidates, about 3 KB: 4,096 of them
#: are about 12 MB, where the former 200,000 held about 600 MB.
MAX_CACHED_STEPS = 4096
#: Mixed with a sample index > 0 into the state its next token is drawn at.
_SAMPLE_SALT = 0x5A3D1E0000
#: The empty prefix's state under the default weights.
_ORIGIN = 0x243F6A8885A308D3
#: The weight version an engine starts with (SGLang's and vLLM's default).
DEFAULT_VERSION = "default"


def version_origin(version: str) -> int:
    """The empty prefix's state under weight version ``version``: the
    default's, mixed with the first 8 bytes of the version's BLAKE2b digest
    for any other (the same in every process)."""
    if version == DEFAULT_VERSION:
        return _ORIGIN
    return _mix(_ORIGIN, int.from_bytes(hashlib.blake2b(version.encode(), digest_size=8).digest(), "little"))


def _mix(h: int, x: int) -> int:
    """Mix the 64-bit state ``h`` with the integer ``x`` (SplitMix64 finaliser)."""
    z = (h ^ (x * _GOLDEN)) & _MASK
    z = ((z ^ (z >> 30)) * 0xBF58476D1CE4E5B9) & _MASK
    z = ((z ^ (z >> 27)) * 0x94D049BB133111EB) & _MASK
    return z ^ (z >> 31)


@dataclass(frozen=True, slots=True)
class Step:
    """The model's distribution at one prefix.

    ``candidates`` are ``(token_id, logprob)`` pairs, best first; the greedy
    next token is ``candidates[0][0]``.
    """

    state: int
    candidates: tuple[tuple[int, float], ...]

    @property
    def token(self) -> int:
        """The greedy next token id."""
        return self.candidates[0][0]


class Model:
    """A deterministic next-token model over a vocabulary.

    Args:
        vocab_size: number of token ids (the bound of every id a request
            names, and of a full top-k).
        eos_id: the end-of-sequence token the model emits now and then.
        num_special: ids below this are special tokens, never sampled except
            ``eos_id``.
        eos_period: on average one step in this many picks ``eos_id``.
        num_layers, num_experts, experts_topk: the shape of routed-expert rows.
        unsampled: ordinary ids the model never picks, nor ranks among its
            candidates: the tokenizer's partial UTF-8 byte tokens, whose text
            alone is U+FFFD (:meth:`SimTokenizer.partial_ids`), so every
            answer's text is whole characters.
        drawn: the ids below this are the ones the model picks from, ids
            ``>= num_special`` ordinary (default ``vocab_size``): the
            tokenizer's, when the vocabulary is padded past it as real
            checkpoints' are (the padding ids are never picked).
        weight_version: the weights it starts with (see
            :meth:`load_version`).
        steps: the cache of computed steps to use, shared with other
            models of the same vocabulary, EOS, specials and ``unsampled``
            (a step depends on nothing else: the weight version is in its
            state); ``None``: its own.

    Raises:
        ValueError: ``drawn`` is above ``vocab_size``.
    """

    def __init__(
        self,
        vocab_size: int,
        eos_id: int,
        num_special: int,
        *,
        eos_period: int = 50,
        num_layers: int = 4,
        num_experts: int = 16,
        experts_topk: int = 2,
        unsampled: frozenset[int] = frozenset(),
        drawn: int | None = None,
        weight_version: str = DEFAULT_VERSION,
        steps: dict[int, Step] | None = None,
    ) -> None:
        if drawn is not None and drawn > vocab_size:
            raise ValueError(f"a vocabulary of {vocab_size} ids cannot hold the tokenizer's {drawn}")
        self.vocab_size = vocab_size
        self.drawn = vocab_size if drawn is None else drawn
        self.eos_id = eos_id
        self.num_special = num_special
        self.eos_period = eos_period
        self.num_layers = num_layers
        self.num_experts = num_experts
        self.experts_topk = experts_topk
        self.unsampled = unsampled
        self._cache: dict[int, Step] = {} if steps is None else steps
        self.load_version(weight_version)

    def load_version(self, version: str) -> None:
        """Answer with weight version ``version`` from now on (the empty
        prefix's state is its :func:`version_origin`)."""
        self.weight_version = version
        self.origin = version_origin(version)

    def initial_state(self) -> int:
        """The state of the empty prefix under the current weights."""
        return self.origin

    @staticmethod
    def advance(state: int, token_id: int) -> int:
        """The state after appending ``token_id`` to the prefix of ``state``."""
        return _mix(state, token_id + 1)

    @staticmethod
    def sampled(state: int, sample: int) -> int:
        """The state parallel sample ``sample`` draws its next token at, for
        the prefix of ``state`` (sample 0: ``state`` itself)."""
        return state if sample == 0 else _mix(state, _SAMPLE_SALT + sample)

    def fold(self, token_ids: list[int], state: int | None = None) -> int:
        """The state after the whole of ``token_ids`` (from ``state`` or empty)."""
        h = self.initial_state() if state is None else state
        for t in token_ids:
            h = _mix(h, t + 1)
        return h

    def step(self, state: int) -> Step:
        """The ranked candidates at ``state`` (cached: hot prefixes repeat)."""
        cached = self._cache.get(state)
        if cached is not None:
            return cached
        ordinary = self.drawn - self.num_special
        seen: set[int] = set()
        cands: list[tuple[int, float]] = []
        # The leading logprob lies in (-1, 0]; each next candidate is lower.
        lp = -((state >> 11) & 0xFFFF) / 65536.0
        i = 0
        if state % self.eos_period == 0:
            cands.append((self.eos_id, lp))
            seen.add(self.eos_id)
        while len(cands) < NUM_CANDIDATES:
            i += 1
            r = _mix(state, i)
            tok = self.num_special + r % ordinary
            if tok in seen or tok in self.unsampled:  # drawn again: the same draws, minus those
                continue
            seen.add(tok)
            if cands:
                lp -= 0.25 + ((r >> 17) & 0xFFFF) / 65536.0
            cands.append((tok, lp))
        step = Step(state, tuple(cands))
        if len(self._cache) >= MAX_CACHED_STEPS:
            self._cache.clear()
        self._cache[state] = step
        return step

    def biased(self, step: Step, bias: dict[int, float]) -> Step:
        """``step`` with ``bias`` added to the logits of its token ids (SGLang
        ``logit_bias``, vLLM ``logit_bias``): the candidates and the biased
        ids re-ranked by ``logprob + bias``, shifted so the best keeps the
        unbiased best's logprob (the model's distribution is made up; the
        ranking and the gaps are what a test can check)."""
        scores = {tok: lp + bias.get(tok, 0.0) for tok, lp in step.candidates}
        for tok, b in bias.items():
            if tok not in scores:
                scores[tok] = self.logprob(step.state, tok) + b
        ranked = sorted(scores.items(), key=lambda kv: (-kv[1], kv[0]))[:NUM_CANDIDATES]
        shift = step.candidates[0][1] - ranked[0][1]
        return Step(step.state, tuple((tok, score + shift) for tok, score in ranked))

    def forced(self, step: Step, token_id: int) -> Step:
        """``step`` with ``token_id`` made the pick (scripted output): first,
        with the best logprob; the other candidates follow in their order,
        one nat lower, so the list stays sorted best first."""
        if step.candidates[0][0] == token_id:
            return step
        top = step.candidates[0][1]
        rest = [(t, lp - 1.0) for t, lp in step.candidates if t != token_id]
        return Step(step.state, ((token_id, top), *rest[: NUM_CANDIDATES - 1]))

    def top(self, step: Step, k: int) -> list[tuple[int, float]]:
        """The best ``k`` ``(token_id, logprob)`` pairs of ``step``, best
        first: its candidates, then (past :data:`NUM_CANDIDATES`, vLLM's
        ``logprobs=-1`` with ``--max-logprobs -1``) every other id by
        :meth:`logprob`, O(vocabulary) per position."""
        if k <= len(step.candidates):
            return list(step.candidates[:k])
        ranked = {tok for tok, _ in step.candidates}
        rest = sorted(((t, self.logprob(step.state, t)) for t in range(self.vocab_size) if t not in ranked),
                      key=lambda c: (-c[1], c[0]))
        return [*step.candidates, *rest][:k]

    def logprob(self, state: int, token_id: int) -> float:
        """The logprob of ``token_id`` following the prefix of ``state``."""
        step = self.step(state)
        for tok, lp in step.candidates:
            if tok == token_id:
                return lp
        r = _mix(state, 0x5EED0000 + token_id)
        return step.candidates[-1][1] - 1.0 - ((r >> 13) & 0xFFFF) / 8192.0

    def rank(self, state: int, token_id: int) -> int:
        """1-based rank of ``token_id`` at ``state`` (vLLM's ``rank``)."""
        for i, (tok, _) in enumerate(self.step(state).candidates):
            if tok == token_id:
                return i + 1
        r = _mix(state, 0x7A4C0000 + token_id)
        return NUM_CANDIDATES + 1 + r % (self.vocab_size - NUM_CANDIDATES)

    def expert_rows(self, seq: list[int], start: int, received: int = 0) -> list[list[int]]:
        """Routed experts of the positions ``start`` up to the last but one
        of ``seq`` (prompt then output: an engine forwards every token but
        the one it sampled last), one :meth:`expert_row` each.

        Positions below ``received`` were never forwarded on this engine (a
        P/D decode that received their KV from the prefill engine): their
        rows are zeros, what its never-written capture slots hold."""
        state = self.initial_state()
        blank = [0] * (self.num_layers * self.experts_topk)
        rows = []
        for p in range(len(seq) - 1):
            state = self.advance(state, seq[p])
            if p >= start:
                rows.append(blank if p < received else self.expert_row(state))
        return rows

    def expert_row(self, state: int) -> list[int]:
        """Routed experts for the token whose prefix (inclusive) is ``state``.

        Returns ``num_layers * experts_topk`` expert ids, layer-major, each
        layer's ``experts_topk`` ids distinct.
        """
        row: list[int] = []
        for layer in range(self.num_layers):
            picked: list[int] = []
            j = 0
            while len(picked) < self.experts_topk:
                j += 1
                e = _mix(state, 0xE0000 + layer * 64 + j) % self.num_experts
                if e not in picked:
                    picked.append(e)
            row.extend(picked)
        return row


def experts_base64(rows: list[list[int]]) -> str:
    """Encode routed-expert rows as SGLang does: base64 of little-endian int32.

    ``rows`` has shape ``[positions][num_layers * topk]``; the flat layout is
    ``[positions, num_layers, topk]`` (SGLang
    ``srt/state_capturer/routed_experts.py``, decoded by
    ``extract_routed_experts_from_meta_info``).
    """
    flat = array.array("i", (e for row in rows for e in row))
    if sys.byteorder == "big":
        flat.byteswap()
    return base64.b64encode(flat.tobytes()).decode("ascii")


def experts_npy_base64(rows: list[list[int]], num_layers: int, topk: int, num_experts: int) -> str:
    """Encode routed-expert rows as vLLM does: base64 of ``numpy.save``
    bytes of a ``[positions, num_layers, topk]`` array of the smallest
    unsigned dtype holding ``num_experts`` ids (vLLM ``serving.py``,
    ``GenerateChoiceBase.routed_experts``).

    The ``.npy`` header is numpy's (``numpy/lib/format.py``: sorted dict
    keys, room for 21 digits of the first axis, padded with spaces to a
    multiple of 64 bytes with the magic, format 1.0).
    """
    code, descr = ("B", "|u1") if num_experts <= 256 else ("H", "<u2") if num_experts <= 65536 else ("I", "<u4")
    flat = array.array(code, (e for row in rows for e in row))
    if sys.byteorder == "big":
        flat.byteswap()
    shape = (len(rows), num_layers, topk)
    text = "{'descr': %r, 'fortran_order': False, 'shape': %r, }" % (descr, shape)
    text = text.ljust(len(text) + 21 - len(str(len(rows))))
    hlen = len(text) + 1  # with the closing newline
    size = hlen + 64 - (10 + hlen) % 64  # the magic, version and length take 10 bytes
    head = b"\x93NUMPY\x01\x00" + struct.pack("<H", size) + text.ljust(size - 1).encode("latin-1") + b"\n"
    return base64.b64encode(head + flat.tobytes()).decode("ascii")

"""The simulator's model: deterministic greedy decoding a resume continues,
ranked distinct candidates, routed experts' base64 encoding."""

from __future__ import annotations

from hypothesis import given, settings
from hypothesis import strategies as st

from asgi_generate.sim.model import Model, experts_base64


def _model() -> Model:
    return Model(vocab_size=4096, eos_id=2, num_special=7)


@settings(max_examples=60, deadline=None)
@given(st.lists(st.integers(min_value=7, max_value=4095), min_size=1, max_size=30),
       st.integers(min_value=1, max_value=20))
def test_model_resume_continues_where_the_run_left_off(prompt, k):
    """Greedy decoding from prompt+generated[:k] yields generated[k:]."""
    m = _model()
    state, gen = m.fold(prompt), []
    for _ in range(25):
        tok = m.step(state).token
        gen.append(tok)
        state = m.advance(state, tok)
    resumed = m.fold(prompt + gen[:k])
    rest = []
    for _ in range(25 - k):
        tok = m.step(resumed).token
        rest.append(tok)
        resumed = m.advance(resumed, tok)
    assert rest == gen[k:]


def test_model_candidates_are_ranked_and_distinct():
    m = _model()
    step = m.step(m.fold([100, 200]))
    toks = [t for t, _ in step.candidates]
    lps = [lp for _, lp in step.candidates]
    assert len(set(toks)) == len(toks) == 20
    assert lps == sorted(lps, reverse=True) and -1.0 < lps[0] <= 0.0
    assert m.logprob(step.state, toks[3]) == lps[3]
    assert m.rank(step.state, toks[3]) == 4
    assert m.logprob(step.state, 5) < lps[-1]


def test_experts_base64_is_little_endian_int32():
    assert experts_base64([[1, 2], [3, 258]]) == "AQAAAAIAAAADAAAAAgEAAA=="

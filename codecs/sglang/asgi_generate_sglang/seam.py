"""Text and stop strings across a migration seam, for a resumed SGLang
stream (with the frontend's tokenizer).

The resumed leg's engine decodes only its own output, so a character whose
bytes straddle the seam would come out broken in both legs' text; with one
decoder over the whole output the client's ``text`` is the uninterrupted
engine's (pieces while streaming, the whole output decoded once at the
end).

SGLang looks for stop strings in the output of its own request only
(``managers/schedule_batch.py``, ``Req.check_finished``, over the decoded
tail of ``output_ids``), so a resumed leg never sees a stop string that
began before the seam. The frontend, which has the whole output, checks each
token after the seam as the uninterrupted engine would
(:class:`asgi_generate.sdk.StopWatch`) and, on a hit the engine did not
report, ends the answer there: the chunk is cut after the token that
completed the string and made the engine's final chunk (``finish_reason``
``{"type": "stop", "matched": s}``, ``text`` cut where the string begins
unless ``no_stop_trim``, ``completion_tokens`` and the output logprob lists
up to that token; no ``e2e_latency``, which only the engine can time).
"""

from __future__ import annotations

from asgi_generate.sdk import StopWatch

OUTPUT_LOGPROBS = ("output_token_logprobs", "output_top_logprobs", "output_token_ids_logprobs")


def across_seam(
    watch: StopWatch, chunk: dict, meta: dict, new: list[int], seen: int, incremental: bool
) -> int | None:
    """Continue the answer's text over the chunk's ``new`` output ids
    (``seen`` were sent before it) with the one decoder across the seam,
    and check them for a stop string the engine missed; on one, rewrite
    ``chunk`` (in the client's view: cumulative, or a delta when
    ``incremental``) as the final chunk and return how many of ``new`` it
    keeps, else ``None``."""
    before = len(watch.text)
    finish = meta.get("finish_reason")
    hit = None
    for j, token_id in enumerate(new):
        hit = watch.step(token_id)
        if hit is None:
            continue
        if j == len(new) - 1 and finish is not None:
            break  # the engine finished at this token: its reason wins, as uninterrupted
        matched, at = hit
        keep = j + 1
        upto = keep if incremental else seen + keep
        chunk["output_ids"] = chunk["output_ids"][:upto]
        _text(chunk, watch.text[:at] if watch.trim else watch.text, before, incremental)
        for key in OUTPUT_LOGPROBS:
            if type(meta.get(key)) is list:
                meta[key] = meta[key][:upto]
        meta["finish_reason"] = {"type": "stop", "matched": matched}
        meta["completion_tokens"] = seen + keep
        meta.pop("e2e_latency", None)
        return keep
    # SGLang's text as the uninterrupted engine makes it: the pieces so far,
    # cut at a stop string, or the whole output decoded once at the end.
    if type(finish) is not dict:
        text = watch.text
    elif finish.get("type") == "stop" and type(finish.get("matched")) is str and hit is not None:
        text = watch.text[:hit[1]] if watch.trim else watch.text
    else:
        text = watch.decoded(finish.get("type") == "stop" and watch.trim)
    _text(chunk, text, before, incremental)
    return None


def _text(chunk: dict, text: str, before: int, incremental: bool) -> None:
    if type(chunk.get("text")) is str:
        chunk["text"] = text[before:] if incremental else text

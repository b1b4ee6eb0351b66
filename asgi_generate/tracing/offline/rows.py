"""Records turned into what the offline tools export and print: the
Mooncake replay trace's rows (FAST'25 Mooncake traces, as Dynamo's and
AIPerf's replay read them) and nearest-rank percentiles.
"""

from __future__ import annotations

import math
from typing import Iterable, Sequence


def percentile(values: Sequence[float], p: float) -> float:
    """The nearest-rank ``p``-th percentile (0 < p <= 100) of non-empty
    ``values``."""
    ordered = sorted(values)
    return ordered[max(0, math.ceil(p / 100.0 * len(ordered)) - 1)]


def exportable(records: Iterable[dict]) -> tuple[list[dict], int]:
    """The records with block hashes that reached an engine, in arrival
    order, and the number of the others.

    Raises:
        ValueError: those records use more than one block size.
    """
    usable, skipped = [], 0
    for rec in records:
        replay = rec.get("replay", {})
        if "block_hashes" in replay and rec.get("attempts"):
            usable.append(rec)
        else:
            skipped += 1
    sizes = {r["replay"]["block_size"] for r in usable}
    if len(sizes) > 1:
        raise ValueError(f"records use several block sizes {sorted(sizes)}; export them separately")
    usable.sort(key=lambda r: (r["received_unix_ms"], r["request_id"]))
    return usable, skipped


def mooncake_rows(records: Iterable[dict]) -> tuple[list[dict], int, int | None]:
    """Mooncake rows from ``records``: one ``{"timestamp", "input_length",
    "output_length", "hash_ids", "block_size"}`` per record with block hashes
    that reached an engine (:func:`exportable`), in arrival order.
    ``timestamp`` is ms since the first row's request; ``hash_ids`` renumber
    the block hashes from 0 in order of first appearance, so equal ids mean
    an equal prefix; ``block_size`` is the tokens per hash id (the records'
    ``replay.block_size``), carried by every row so that a replay of the
    file draws blocks of the recorded size (the FAST'25 traces leave it out:
    512, by their paper; readers of the four fields ignore it).

    Returns:
        The rows, the number of records skipped, and the block size.

    Raises:
        ValueError: the exportable records use more than one block size.
    """
    usable, skipped = exportable(records)
    ids: dict[int, int] = {}
    rows = []
    start = usable[0]["received_unix_ms"] if usable else 0
    for rec in usable:
        rows.append({
            "timestamp": rec["received_unix_ms"] - start,
            "input_length": rec["replay"]["input_length"],
            "output_length": rec["output_tokens"],
            "hash_ids": [ids.setdefault(h, len(ids)) for h in rec["replay"]["block_hashes"]],
            "block_size": rec["replay"]["block_size"],
        })
    return rows, skipped, usable[0]["replay"]["block_size"] if usable else None

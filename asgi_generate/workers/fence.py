"""The weight version fence: which workers a request may go to, by the
weights they serve.

Each worker's weight version is read with its server info (SGLang
``/get_model_info``, vLLM ``/weight_info``;
:func:`~asgi_generate.workers.probes.read_info`) and set by the weight
routes that change it (:meth:`Fence.weights_loaded`). Once a weight version
is set on a protocol's fleet, a request goes only to workers at that
version; a worker that failed its update is fenced (out of the rotation,
logged, counted, its reason shown) until it reaches the fleet's version or
an operator clears the fence. A request may ask for a minimum version
(:data:`MIN_VERSION_HEADER`); versions compare part by part, digits as
numbers (``v9`` < ``v10``), and an engine's initial version
(:data:`INITIAL_VERSION`) below every other.
"""

from __future__ import annotations

import logging
import re
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from .worker import Worker

# The router's logger: these lines are the router's decisions.
# The router's logger, as before the split: operators match its lines by that name.
log = logging.getLogger("asgi_generate.router")
#: The request header asking for workers at this weight version or later.
MIN_VERSION_HEADER = b"asgi-generate-min-weight-version"
#: The weight version SGLang and vLLM engines report before any update
#: (SGLang's ``--weight-version`` default; vLLM's ``/weight_info``).
INITIAL_VERSION = "default"


def version_order(version: str) -> tuple:
    """A sort key for weight versions: :data:`INITIAL_VERSION` below every
    other version; the others part by part, digit runs as numbers, the rest
    as text (a digit run below a text part at the same place)."""
    # Ranked by its spelling, "default" would be above every numeric version:
    # a fresh or restarted engine would meet a trainer's "8".
    if version == INITIAL_VERSION:
        return (0,)
    return (1, *((0, int(p), "") if p.isdigit() else (1, 0, p) for p in re.split(r"(\d+)", version) if p))


@dataclass(frozen=True, slots=True)
class RouteKey:
    """A routing key with a minimum weight version: the policy's key and
    the version a request asked for at least."""

    policy_key: Any
    min_version: str


class Fence:
    """The fleets' weight versions and the workers fenced from them.

    Attributes:
        versions: the weight version set on each protocol's fleet, by
            protocol name.
    """

    def __init__(self) -> None:
        self.versions: dict[str, str] = {}

    def admits(self, worker: "Worker", min_version: str | None = None) -> bool:
        """Whether ``worker`` may get a new request: up, not fenced, at its
        fleet's weight version once one is set, and at ``min_version`` or
        later (:func:`version_order`) when given: a worker whose version is
        unknown meets no minimum, one at :data:`INITIAL_VERSION` only that
        version itself."""
        if not worker.healthy or worker.fence is not None:
            return False
        have = worker.weight_version
        target = self.versions.get(worker.protocol.name)
        if target is not None and have != target:
            return False
        return min_version is None or (have is not None and version_order(have) >= version_order(min_version))

    def unavailable(self, protocol: str, workers: "list[Worker]", key: Any = None) -> str:
        """Why none of ``workers`` (the healthy ones of ``protocol`` in the
        rotation) can take a request with ``key``: the 503's message."""
        target = self.versions.get(protocol)
        fenced = any(w.fence is not None for w in workers)
        if not workers or (target is None and not fenced and not isinstance(key, RouteKey)):
            return f"no healthy worker for protocol {protocol!r}"
        wanted = ["unfenced"] if fenced else []
        if target is not None:
            wanted.append(f"at the fleet's weight version {target!r}")
        if isinstance(key, RouteKey):
            wanted.append(f"at weight version {key.min_version!r} or later")
        seen = ", ".join(f"{w.id}: {w.weight_version}" + (f" (fenced: {w.fence})" if w.fence else "")
                         for w in workers)
        return f"no healthy worker for protocol {protocol!r} {' and '.join(wanted)} ({seen})"

    def weights_loaded(self, protocol: str, loaded: "list[Worker]", failed: "dict[Worker, str]",
                       version: str | None, fleet: bool, with_weights: bool) -> None:
        """A weight route answered: ``loaded`` workers now serve ``version``
        (``None``: the label is kept), each of ``failed`` (with why) is
        fenced and counted. With ``fleet`` (the call went to every worker,
        not a named one) ``version`` becomes the fleet's. A fenced worker
        that reaches the fleet's version (any, while no fleet call set one)
        is let back when the call loaded weights with it (``with_weights``)
        or named that worker; a fleet call that only relabels keeps it
        fenced (it missed the weights)."""
        if fleet and version is not None:
            self.versions[protocol] = version
        target = self.versions.get(protocol)
        for w in loaded:
            if version is not None:
                w.info = {**w.info, "weight_version": version}
            back = with_weights or not fleet
            if w.fence is not None and back and (target is None or w.weight_version == target):
                log.warning("worker %s (%s) reached weight version %r: back in the rotation", w.id, w.url,
                            w.weight_version)
                w.fence = None
        for w, why in failed.items():
            w.failed_updates += 1
            w.fence = why
            log.warning("worker %s (%s) fenced out of the rotation: %s", w.id, w.url, why)

    @staticmethod
    def clear(worker: "Worker", version: str | None) -> None:
        """An operator let ``worker`` back, its engine now at ``version``."""
        log.warning("worker %s (%s) fence cleared by an operator (was: %s); weight version %r", worker.id,
                    worker.url, worker.fence, version)
        worker.fence = None
        worker.info = {**worker.info, "weight_version": version}

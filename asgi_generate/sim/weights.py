"""The simulator's weight routes: the update flows RL trainers drive.

The simulator moves no tensors. It checks each request's shape as the
engine's route does, records what a real engine would set up, and changes
its weight version (:meth:`~asgi_generate.sim.model.Model.load_version`),
which changes its answers deterministically.

SGLang (``srt/entrypoints/http_server.py``, request shapes in
``srt/managers/io_struct.py``). Each answers ``{"success", "message"}``,
200 on success and 400 on failure; a body whose required field is missing
or of the wrong type is refused as SGLang's ``RequestValidationError``
handler does (:func:`sglang_invalid`: 400, not FastAPI's 422):

- ``POST /init_weights_update_group`` (``InitWeightsUpdateGroupReqInput``:
  ``master_address``, ``master_port``, ``rank_offset``, ``world_size``,
  ``group_name`` = ``weight_update_group``, ``backend`` = ``nccl``). The
  engine's ranks are ``rank_offset + tp_rank`` (SGLang
  ``weight_updater.py`` ``init_weights_update_group``), ``tp_size`` of
  them; refused when they leave ``[0, world_size)``, when the group is
  already set up here, or when the :class:`GroupRegistry` holds another
  engine of the same group (same master address, port and name) whose
  ranks overlap these or whose ``world_size`` differs.
- ``POST /destroy_weights_update_group`` (``group_name``): refused for a
  group not set up.
- ``POST /update_weights_from_distributed`` (``names``, ``dtypes``,
  ``shapes`` of one length, ``group_name``, ``flush_cache`` = true,
  ``abort_all_requests`` = false, ``weight_version``): refused without the
  group; ``/update_weights_from_tensor`` (``serialized_named_tensors``, a
  list), ``/update_weights_from_ipc`` (``zmq_handles``, an object) and
  ``/update_weights_from_disk`` (``model_path``; its answer adds
  ``num_paused_requests``) likewise, without a group.
- ``POST /begin_weight_update``, ``/end_weight_update`` (refused outside a
  session).
- ``POST /update_weight_version`` (``new_version``, ``abort_all_requests`` =
  true): ``{"success", "message", "new_version"}``.
- ``GET``/``POST /get_weights_by_name`` (``name``, ``truncate_size`` = 100):
  a list of floats, a function of the name and the weight version.
- ``GET``/``POST /weights_checker`` (``action`` = ``checksum``):
  ``{"success", "message", "per_engine_checksum"}``.

vLLM (``vllm/entrypoints/rl/online/api_router.py``; bodies are FastAPI's
``Body(embed=True)`` fields, so a field missing or of the wrong type is
refused by vLLM's ``validation_exception_handler``, 400 as for
``/generate``: :meth:`SimWeights._vllm_invalid`). A refused call is an
exception in the engine: 500 ``Internal Server Error``:

- ``POST /init_weight_transfer_engine`` ``{"init_info": {...}}``: with
  ``rank_offset`` and ``world_size`` (the NCCL backends'
  ``NCCLWeightTransferInitInfo``) checked as SGLang's group above
  (``tp_size`` ranks; ``group_name`` absent); ``{"message"}``.
- ``POST /shutdown_weight_transfer_engine``, ``/start_weight_update``,
  ``/update_weights`` ``{"update_info": {...}}``, ``/finish_weight_update``
  ``{"weight_version"?}``: ``{"message"}``.
- ``POST /update_weight_version`` ``{"new_version"}``: ``{"success",
  "new_version"}``; ``GET /weight_info``: ``{"weight_version"}``.
- ``POST /weight_checker`` ``{"action": "checksum"|"reset"|"compare",
  "baseline"?}``; ``GET /get_world_size``: ``{"world_size": tp_size}``.

Failure hook: ``POST /sim/faults`` ``{"weight_updates": N}`` makes this
engine's next ``N`` weight loads (an ``update_weights_from_*`` call, vLLM
``/update_weights``) fail with the engine's failure answer.

Load time: ``sim --weight-load-s S`` makes each weight load take ``S``
seconds before it answers (default 0: at once), the engine busy meanwhile
(:attr:`SimWeights.loading`): SGLang's health routes stall then
(:mod:`asgi_generate.sim.app`), as a scheduler busy loading serves no
health generation.
"""

from __future__ import annotations

import fcntl
import hashlib
import os
from typing import Any, Callable

import anyio
import orjson

from .engine import SimEngine
from .lax import LaxError, lax_scalar
from .vllm_checks import render_invalid

SGLANG_WEIGHT_ROUTES = {
    "/init_weights_update_group": ("POST",),
    "/destroy_weights_update_group": ("POST",),
    "/update_weights_from_distributed": ("POST",),
    "/update_weights_from_tensor": ("POST",),
    "/update_weights_from_ipc": ("POST",),
    "/update_weights_from_disk": ("POST",),
    "/begin_weight_update": ("POST",),
    "/end_weight_update": ("POST",),
    "/update_weight_version": ("POST",),
    "/get_weights_by_name": ("GET", "POST"),
    "/weights_checker": ("GET", "POST"),
}
VLLM_WEIGHT_ROUTES = {
    "/init_weight_transfer_engine": ("POST",),
    "/shutdown_weight_transfer_engine": ("POST",),
    "/start_weight_update": ("POST",),
    "/update_weights": ("POST",),
    "/finish_weight_update": ("POST",),
    "/update_weight_version": ("POST",),
    "/weight_info": ("GET",),
    "/weight_checker": ("POST",),
    "/get_world_size": ("GET",),
}
#: The routes that load weights (:attr:`SimWeights.load_s` each).
LOADS = frozenset({"/update_weights_from_distributed", "/update_weights_from_tensor", "/update_weights_from_ipc",
                   "/update_weights_from_disk", "/update_weights"})
#: SGLang's default group name (``InitWeightsUpdateGroupReqInput``).
DEFAULT_GROUP = "weight_update_group"
Answer = tuple[int, Any]


class GroupRegistry:
    """The rank ranges every simulator of a fleet took in its weight-update
    groups, in one JSON file shared by the simulators (``sim
    --weights-group-registry PATH``) and read by tests.

    The file is an object: group key (``address:port/name``) to a list of
    ``{"engine", "rank_offset", "ranks", "world_size"}``; every change is
    made under an exclusive ``flock`` of the file.
    """

    def __init__(self, path: str) -> None:
        self.path = path

    def _update(self, change: Callable[[dict], str | None]) -> str | None:
        with open(self.path, "a+b") as f:
            fcntl.flock(f, fcntl.LOCK_EX)
            f.seek(0)
            data = f.read()
            groups = orjson.loads(data) if data.strip() else {}
            refusal = change(groups)
            if refusal is None:
                f.seek(0)
                f.truncate()
                f.write(orjson.dumps(groups))
            return refusal

    def join(self, key: str, entry: dict) -> str | None:
        """Add ``entry`` to group ``key``; the refusal, or ``None``, when
        its ranks overlap a member's or its ``world_size`` differs."""

        def change(groups: dict) -> str | None:
            members = groups.setdefault(key, [])
            lo, hi = entry["rank_offset"], entry["rank_offset"] + entry["ranks"]
            for m in members:
                if m["world_size"] != entry["world_size"]:
                    return f"world_size {entry['world_size']} differs from {m['world_size']} of another engine"
                if lo < m["rank_offset"] + m["ranks"] and m["rank_offset"] < hi:
                    end = m["rank_offset"] + m["ranks"] - 1
                    return f"ranks {lo}..{hi - 1} overlap ranks {m['rank_offset']}..{end} of another engine"
            members.append(entry)
            return None

        return self._update(change)

    def leave(self, key: str, engine: str) -> None:
        """Remove ``engine``'s entry from group ``key``."""

        def change(groups: dict) -> None:
            groups[key] = [m for m in groups.get(key, []) if m["engine"] != engine]
            if not groups[key]:
                del groups[key]

        self._update(change)


#: The required fields of SGLang's weight-route bodies (``io_struct.py``;
#: every other field has a default) and their types: pydantic's lax
#: ``str``/``int`` (:mod:`asgi_generate.sim.lax`), or a list or dict
#: checked at its top level only.
SGLANG_REQUIRED = {
    "InitWeightsUpdateGroupReqInput": {"master_address": "str", "master_port": "int", "rank_offset": "int",
                                       "world_size": "int"},
    "UpdateWeightsFromDistributedReqInput": {"names": "list", "dtypes": "list", "shapes": "list"},
    "UpdateWeightsFromTensorReqInput": {"serialized_named_tensors": "list"},
    "UpdateWeightsFromIPCReqInput": {"zmq_handles": "dict"},
    "UpdateWeightFromDiskReqInput": {"model_path": "str"},
    "UpdateWeightVersionReqInput": {"new_version": "str"},
    "GetWeightsByNameReqInput": {"name": "str"},
}
_CONTAINERS = {"list": (list, "list_type", "Input should be a valid list"),
               "dict": (dict, "dict_type", "Input should be a valid dictionary")}


def sglang_invalid(cls: str, obj: dict) -> tuple[Answer | None, dict]:
    """SGLang's validation of a weight route's body ``obj`` as its
    ``io_struct.py`` class ``cls`` (a ``msgspec.Struct`` whose pydantic
    schema is ``msgspec_struct_pydantic_core_schema``,
    ``srt/utils/msgspec_utils.py``: a left-to-right union of an instance
    check and the typed dict of its fields, validated by FastAPI as
    Python). Returns ``(None, obj)`` with lax-read values when it passes;
    else the answer of SGLang's ``RequestValidationError`` handler
    (``http_server.py`` ``validation_exception_handler``): 400
    ``ErrorResponse`` (``object``, ``message``, ``type`` ``"Bad Request"``,
    ``param``, ``code``) whose message is ``str(exc)`` then
    ``str(exc.errors())``: the instance branch's error, then each field's
    (loc under ``body``). ``str(exc)`` is FastAPI's ``N validation
    errors:`` list; the endpoint's file and line that recent FastAPI
    releases append to it are left out."""
    errors: list[dict] = []
    branch = f"function-after[build_struct(), {cls}]"
    out = dict(obj)
    for name, kind in SGLANG_REQUIRED[cls].items():
        loc = ("body", branch, name)
        if name not in obj:
            errors.append({"type": "missing", "loc": loc, "msg": "Field required", "input": obj})
        elif kind in _CONTAINERS:
            want, err_type, msg = _CONTAINERS[kind]
            if type(obj[name]) is not want:
                errors.append({"type": err_type, "loc": loc, "msg": msg, "input": obj[name]})
        else:
            try:
                out[name] = lax_scalar(kind, obj[name])
            except LaxError as exc:
                errors.append({"type": exc.kind, "loc": loc, "msg": exc.msg, "input": obj[name]})
    if not errors:
        return None, out
    errors.insert(0, {"type": "is_instance_of", "loc": ("body", f"is-instance[{cls}]"),
                      "msg": f"Input should be an instance of {cls}", "input": obj, "ctx": {"class": cls}})
    label = "error" if len(errors) == 1 else "errors"
    text = f"{len(errors)} validation {label}:\n" + "".join(f"  {e}\n" for e in errors)
    message = f"{text.rstrip()} {errors}"
    return (400, {"object": "error", "message": message, "type": "Bad Request", "param": None, "code": 400}), obj


def _payload_errors(value: Any, loc: tuple) -> list[dict]:
    """pydantic's errors for ``value`` as vLLM's
    ``WeightTransferUpdatePayload`` (``dict[str, Any] | list[dict[str,
    Any]]``, ``vllm/distributed/weight_transfer/base.py``): none, or one
    per branch of the union."""
    if type(value) is dict:
        return []
    as_dict = {"type": "dict_type", "loc": (*loc, "dict[str,any]"), "msg": "Input should be a valid dictionary",
               "input": value}
    branch = (*loc, "list[dict[str,any]]")
    if type(value) is not list:
        return [as_dict, {"type": "list_type", "loc": branch, "msg": "Input should be a valid list", "input": value}]
    items = [{"type": "dict_type", "loc": (*branch, i), "msg": "Input should be a valid dictionary", "input": v}
             for i, v in enumerate(value) if type(v) is not dict]
    return [as_dict, *items] if items else []


class SimWeights:
    """Weight state of one simulator: version, groups, session, faults.

    Args:
        engine: the engine whose model's weight version changes.
        protocol: ``sglang`` or ``vllm``: which routes it serves.
        tp_size: the engine's tensor-parallel size: the ranks it takes in a
            weight-update group.
        registry: the fleet's shared :class:`GroupRegistry`, or ``None``
            (ranks then checked against ``world_size`` only).
        load_s: seconds each weight load takes before it answers.

    Raises:
        ValueError: ``load_s`` below 0.
    """

    def __init__(self, engine: SimEngine, protocol: str, tp_size: int = 1,
                 registry: GroupRegistry | None = None, load_s: float = 0.0,
                 clean_validation_errors: bool = True) -> None:
        if not load_s >= 0:
            raise ValueError(f"--weight-load-s must be 0 or more, got {load_s}")
        self.engine = engine
        #: vLLM renders validation errors cleaned (0.30 on) or as pydantic's.
        self.clean_validation_errors = clean_validation_errors
        self.vllm = protocol == "vllm"
        self.routes = VLLM_WEIGHT_ROUTES if self.vllm else SGLANG_WEIGHT_ROUTES
        self.tp_size = tp_size
        self.registry = registry
        self.name = f"{os.getpid()}-{id(self):x}"
        #: Group name to the ``init`` arguments it was set up with.
        self.groups: dict[str, dict] = {}
        self.in_update = False
        #: Weight loads still to fail (``POST /sim/faults`` ``weight_updates``).
        self.failures = 0
        self.failed = 0
        self.load_s = load_s
        #: Weight loads under way now (each takes :attr:`load_s` seconds).
        self.loading = 0

    @property
    def version(self) -> str:
        """The weight version the engine answers with."""
        return self.engine.model.weight_version

    def serves(self, method: str, path: str) -> bool:
        """Whether ``(method, path)`` is one of its weight routes."""
        return method in self.routes.get(path, ())

    async def answer(self, path: str, args: dict[str, str], obj: dict) -> Answer:
        """``(status, JSON-able body)`` for one call of a route it
        :meth:`serves`, a weight load after :attr:`load_s` seconds; a body
        of bytes is sent as text."""
        if self.load_s > 0 and path in LOADS:
            self.loading += 1
            try:
                await anyio.sleep(self.load_s)
            finally:
                self.loading -= 1
        handler = getattr(self, ("_v_" if self.vllm else "_s_") + path.strip("/"))
        return handler(args, obj)

    # -- shared ---------------------------------------------------------------

    def _load(self, version: Any, abort_all: bool = False, flush: bool = False) -> str | None:
        """One weight load: the refusal when a failure is armed, else load
        ``version`` (a string; anything else keeps the version)."""
        if self.failures:
            self.failures -= 1
            self.failed += 1
            return "simulated weight update failure (POST /sim/faults weight_updates)"
        if abort_all:
            self.engine.abort_all()
        if flush:
            self.engine.flush_cache()
        if isinstance(version, str):
            self.engine.model.load_version(version)
        return None

    def _join(self, key: str, offset: Any, world: Any) -> str | None:
        if type(offset) is not int or type(world) is not int:
            return "rank_offset and world_size must be integers"
        if offset < 0 or offset + self.tp_size > world:
            return (f"ranks {offset}..{offset + self.tp_size - 1} (tp_size {self.tp_size}) "
                    f"are not within world_size {world}")
        if self.registry is not None:
            entry = {"engine": self.name, "rank_offset": offset, "ranks": self.tp_size, "world_size": world}
            return self.registry.join(key, entry)
        return None

    def _leave(self, key: str) -> None:
        if self.registry is not None:
            self.registry.leave(key, self.name)

    def checksum(self) -> str:
        """A hex digest of the loaded weights (their version)."""
        return hashlib.blake2b(self.version.encode(), digest_size=8).hexdigest()

    def stats(self) -> dict:
        """The ``/sim/stats`` ``weights`` entry."""
        return {"weight_version": self.version, "tp_size": self.tp_size, "groups": dict(self.groups),
                "failures_armed": self.failures, "failed_updates": self.failed, "loading": self.loading}

    # -- SGLang ---------------------------------------------------------------

    @staticmethod
    def _result(refusal: str | None, message: str) -> Answer:
        if refusal is not None:
            return 400, {"success": False, "message": refusal}
        return 200, {"success": True, "message": message}

    def _s_init_weights_update_group(self, args: dict, obj: dict) -> Answer:
        refused, obj = sglang_invalid("InitWeightsUpdateGroupReqInput", obj)
        if refused is not None:
            return refused
        name = obj.get("group_name", DEFAULT_GROUP)
        if name in self.groups:
            return self._result(f"group {name!r} is already initialized", "")
        key = f"{obj['master_address']}:{obj['master_port']}/{name}"
        refusal = self._join(key, obj["rank_offset"], obj["world_size"])
        if refusal is None:
            self.groups[name] = {**{f: obj[f] for f in ("master_address", "master_port", "rank_offset",
                                                      "world_size")},
                                 "group_name": name, "backend": obj.get("backend", "nccl"), "key": key}
        return self._result(refusal, "Succeeded to initialize custom process group.")

    def _s_destroy_weights_update_group(self, args: dict, obj: dict) -> Answer:
        name = obj.get("group_name", DEFAULT_GROUP)
        group = self.groups.pop(name, None)
        if group is None:
            return self._result(f"group {name!r} is not initialized", "")
        self._leave(group["key"])
        return self._result(None, "Succeeded to destroy custom process group.")

    def _s_update_weights_from_distributed(self, args: dict, obj: dict) -> Answer:
        refused, obj = sglang_invalid("UpdateWeightsFromDistributedReqInput", obj)
        if refused is not None:
            return refused
        name = obj.get("group_name", DEFAULT_GROUP)
        if name not in self.groups:
            return self._result(f"group {name!r} is not initialized", "")
        if not (isinstance(obj["names"], list) and len(obj["names"]) == len(obj["dtypes"]) == len(obj["shapes"])):
            return self._result("names, dtypes and shapes must be lists of one length", "")
        return self._updated(obj, "Succeeded to update parameter online.")

    def _s_update_weights_from_tensor(self, args: dict, obj: dict) -> Answer:
        refused, obj = sglang_invalid("UpdateWeightsFromTensorReqInput", obj)
        if refused is not None:
            return refused
        return self._updated(obj, "Succeeded to update model weights.")

    def _s_update_weights_from_ipc(self, args: dict, obj: dict) -> Answer:
        refused, obj = sglang_invalid("UpdateWeightsFromIPCReqInput", obj)
        if refused is not None:
            return refused
        return self._updated(obj, "Succeeded to update model weights.")

    def _s_update_weights_from_disk(self, args: dict, obj: dict) -> Answer:
        refused, obj = sglang_invalid("UpdateWeightFromDiskReqInput", obj)
        if refused is not None:
            return refused
        status, body = self._updated(obj, "Succeeded to update model weights.", flush_default=False)
        if status == 200 and isinstance(obj.get("weight_version"), str):
            body["message"] += f" Weight version updated to {obj['weight_version']}."
        return status, {**body, "num_paused_requests": 0}

    def _updated(self, obj: dict, message: str, flush_default: bool = True) -> Answer:
        refusal = self._load(obj.get("weight_version"), obj.get("abort_all_requests") is True,
                             obj.get("flush_cache", flush_default) is True)
        return self._result(refusal, message)

    def _s_begin_weight_update(self, args: dict, obj: dict) -> Answer:
        self.in_update = True
        return self._result(None, "Weight update session opened.")

    def _s_end_weight_update(self, args: dict, obj: dict) -> Answer:
        if not self.in_update:
            return self._result("no weight update session is open", "")
        self.in_update = False
        return self._result(None, "Weight update session closed.")

    def _s_update_weight_version(self, args: dict, obj: dict) -> Answer:
        refused, obj = sglang_invalid("UpdateWeightVersionReqInput", obj)
        if refused is not None:
            return refused
        version = obj["new_version"]
        if obj.get("abort_all_requests", True) is True:
            self.engine.abort_all()
        self.engine.model.load_version(version)
        return 200, {"success": True, "message": f"Weight version updated to {version}", "new_version": version}

    def _s_get_weights_by_name(self, args: dict, obj: dict) -> Answer:
        refused, obj = sglang_invalid("GetWeightsByNameReqInput", obj)
        if refused is not None:
            return refused
        name = obj["name"]
        size = obj.get("truncate_size", 100)
        seed = int.from_bytes(hashlib.blake2b(f"{self.version}/{name}".encode(), digest_size=8).digest(), "little")
        return 200, [round(((seed >> (i % 48)) & 0xFFFF) / 65536.0 - 0.5, 6) for i in range(min(size, 8))]

    def _s_weights_checker(self, args: dict, obj: dict) -> Answer:
        action = obj.get("action", "checksum")
        return 200, {"success": True, "message": f"{action} done", "per_engine_checksum": self.checksum()}

    # -- vLLM -----------------------------------------------------------------

    @staticmethod
    def _failed(refusal: str | None, message: str) -> Answer:
        if refusal is not None:
            return 500, b"Internal Server Error"
        return 200, {"message": message}

    def _vllm_invalid(self, obj: dict, field: str, kind: str, required: bool = True) -> Answer | None:
        """vLLM's answer when the ``Body(embed=True)`` field ``field`` of
        ``obj`` is missing (``required``) or not of ``kind`` (``dict``:
        ``dict[str, Any]``; ``payload``: ``WeightTransferUpdatePayload``,
        a dict or a list of dicts; ``str``; ``action``: the
        ``weight_checker`` literal; an optional one may be null), as
        pydantic words it under FastAPI (a missing field's ``input`` is
        null) and vLLM's ``validation_exception_handler`` renders it
        (:func:`~asgi_generate.sim.vllm_checks.render_invalid`); ``None``
        when it is well formed."""
        loc = ("body", field)
        value = obj.get(field)
        if field not in obj:
            errors = [{"type": "missing", "loc": loc, "msg": "Field required", "input": None}] if required else []
        elif value is None and not required:
            errors = []
        elif kind == "dict":
            errors = [] if type(value) is dict else [
                {"type": "dict_type", "loc": loc, "msg": "Input should be a valid dictionary", "input": value}]
        elif kind == "payload":
            errors = _payload_errors(value, loc)
        elif kind == "action":
            expected = "'checksum', 'reset' or 'compare'"
            errors = [] if value in ("checksum", "reset", "compare") and type(value) is str else [
                {"type": "literal_error", "loc": loc, "msg": f"Input should be {expected}", "input": value,
                 "ctx": {"expected": expected}}]
        else:
            errors = [] if type(value) is str else [
                {"type": "string_type", "loc": loc, "msg": "Input should be a valid string", "input": value}]
        if not errors:
            return None
        refused = render_invalid(errors, self.clean_validation_errors)
        return refused.status, refused.body

    def _v_init_weight_transfer_engine(self, args: dict, obj: dict) -> Answer:
        refused = self._vllm_invalid(obj, "init_info", "dict")
        if refused is not None:
            return refused
        info = obj["init_info"]
        if self.groups:
            return self._failed("the weight transfer engine is already initialized", "")
        key = f"{info.get('master_address')}:{info.get('master_port')}/vllm"
        refusal = self._join(key, info.get("rank_offset"), info.get("world_size"))
        if refusal is None:
            self.groups["vllm"] = {**info, "key": key}
        return self._failed(refusal, "Weight transfer initialized")

    def _v_shutdown_weight_transfer_engine(self, args: dict, obj: dict) -> Answer:
        group = self.groups.pop("vllm", None)
        if group is not None:
            self._leave(group["key"])
        return self._failed(None, "Weight transfer shut down")

    def _v_start_weight_update(self, args: dict, obj: dict) -> Answer:
        self.in_update = True
        return self._failed(None, "Weight update started")

    def _v_update_weights(self, args: dict, obj: dict) -> Answer:
        refused = self._vllm_invalid(obj, "update_info", "payload")
        if refused is not None:
            return refused
        if not self.groups:
            return self._failed("the weight transfer engine is not initialized", "")
        return self._failed(self._load(None), "Weights updated")

    def _v_finish_weight_update(self, args: dict, obj: dict) -> Answer:
        refused = self._vllm_invalid(obj, "weight_version", "str", required=False)
        if refused is not None:
            return refused
        self.in_update = False
        version = obj.get("weight_version")
        if version is not None:
            self.engine.model.load_version(version)
        return self._failed(None, "Weight update finished")

    def _v_update_weight_version(self, args: dict, obj: dict) -> Answer:
        refused = self._vllm_invalid(obj, "new_version", "str")
        if refused is not None:
            return refused
        version = obj["new_version"]
        self.engine.model.load_version(version)
        return 200, {"success": True, "new_version": version}

    def _v_weight_info(self, args: dict, obj: dict) -> Answer:
        return 200, {"weight_version": self.version}

    def _v_weight_checker(self, args: dict, obj: dict) -> Answer:
        refused = self._vllm_invalid(obj, "action", "action")
        if refused is not None:
            return refused
        action = obj["action"]
        if action == "reset":
            return 200, {"status": "reset"}
        checksums = {"model": self.checksum()}
        if action == "checksum":
            return 200, {"checksums": checksums}
        baseline = obj.get("baseline")
        if not isinstance(baseline, dict):
            return 400, {"detail": "action='compare' requires a 'baseline' object"}
        mismatches = sorted(k for k in checksums.keys() | baseline.keys() if checksums.get(k) != baseline.get(k))
        return 200, {"match": not mismatches, "mismatches": mismatches}

    def _v_get_world_size(self, args: dict, obj: dict) -> Answer:
        return 200, {"world_size": self.tp_size}

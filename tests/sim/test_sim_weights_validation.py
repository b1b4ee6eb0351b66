"""The SGLang simulator's weight routes refuse a malformed body as SGLang
0.5.23 does: its ``io_struct.py`` request classes are ``msgspec.Struct``s
that FastAPI validates through ``msgspec_struct_pydantic_core_schema``
(``srt/utils/msgspec_utils.py``), and its ``RequestValidationError``
handler (``srt/entrypoints/http_server.py``) answers 400. The reference
errors come from the installed pydantic running that same schema over
mirrors of the request classes."""

from __future__ import annotations

from typing import Any, Dict, List, Literal, Optional

import anyio
import orjson
import pytest

from asgi_generate.sim.app import SimApp
from support import asgi_request

pydantic = pytest.importorskip("pydantic", reason="pydantic, which SGLang's FastAPI validates bodies with")
msgspec = pytest.importorskip("msgspec", reason="msgspec, SGLang's request structs")
core_schema = pytest.importorskip("pydantic_core").core_schema


def _struct_schema(cls, handler):
    """``msgspec_struct_pydantic_core_schema`` as SGLang 0.5.23 builds it."""
    fields = {}
    for f in msgspec.structs.fields(cls):
        schema = handler.generate_schema(f.type)
        if f.default is not msgspec.NODEFAULT:
            schema = core_schema.with_default_schema(schema, default=f.default)
        fields[f.name] = core_schema.typed_dict_field(schema, required=f.default is msgspec.NODEFAULT)
    typed = core_schema.typed_dict_schema(fields, cls_name=cls.__name__, extra_behavior="ignore", ref=cls.__name__)

    def build_struct(value):
        return value if isinstance(value, cls) else cls(**value)

    built = core_schema.no_info_after_validator_function(build_struct, typed)
    return core_schema.json_or_python_schema(json_schema=built, python_schema=core_schema.union_schema(
        [core_schema.is_instance_schema(cls), built], mode="left_to_right"))


class BaseReq(msgspec.Struct, tag=True, kw_only=True, array_like=True):
    rid: Optional[str] = None
    http_worker_ipc: Optional[str] = None

    @classmethod
    def __get_pydantic_core_schema__(cls, source, handler):
        return _struct_schema(cls, handler)


class UpdateWeightFromDiskReqInput(BaseReq, kw_only=True):
    model_path: str
    load_format: Optional[str] = None
    abort_all_requests: bool = False
    weight_version: Optional[str] = None
    flush_cache: bool = True
    manifest: Optional[Dict[str, Any]] = None


class InitWeightsUpdateGroupReqInput(BaseReq, kw_only=True):
    master_address: str
    master_port: int
    rank_offset: int
    world_size: int
    group_name: str = "weight_update_group"
    backend: str = "nccl"


class UpdateWeightsFromIPCReqInput(BaseReq, kw_only=True):
    zmq_handles: Dict[str, str]
    flush_cache: bool = True


class UpdateWeightsFromDistributedReqInput(BaseReq, kw_only=True):
    names: List[str]
    dtypes: List[str]
    shapes: List[List[int]]


def _sglang_answer(cls, body: dict) -> tuple[int, dict] | None:
    """What SGLang answers when FastAPI's validation of ``body`` fails
    (``None`` when it passes): ``str(exc)`` (FastAPI's ``N validation
    errors:`` list, errors under ``body``) then ``str(exc.errors())``."""
    try:
        pydantic.TypeAdapter(cls).validate_python(body, from_attributes=True)
        return None
    except pydantic.ValidationError as exc:
        errors = [{**e, "loc": ("body", *e["loc"])} for e in exc.errors(include_url=False)]
    label = "error" if len(errors) == 1 else "errors"
    text = f"{len(errors)} validation {label}:\n" + "".join(f"  {e}\n" for e in errors)
    return 400, {"object": "error", "message": f"{text.rstrip()} {errors}", "type": "Bad Request", "param": None,
                 "code": 400}


def _sim(path: str, body: dict) -> tuple[int, dict]:
    app = SimApp("sglang")
    status, _, raw = anyio.run(asgi_request, app, "POST", path, orjson.dumps(body))
    return status, orjson.loads(raw)


@pytest.mark.parametrize("path, cls, body", [
    ("/update_weights_from_disk", UpdateWeightFromDiskReqInput, {"model_path": 5}),
    ("/update_weights_from_disk", UpdateWeightFromDiskReqInput, {"model_path": None}),
    ("/update_weights_from_disk", UpdateWeightFromDiskReqInput, {"model_path": ["/m"]}),
    ("/update_weights_from_disk", UpdateWeightFromDiskReqInput, {}),
    ("/init_weights_update_group", InitWeightsUpdateGroupReqInput, {"master_address": "127.0.0.1", "master_port": 1}),
    ("/init_weights_update_group", InitWeightsUpdateGroupReqInput,
     {"master_address": 1, "master_port": "x", "rank_offset": 1.5, "world_size": True}),
    ("/update_weights_from_ipc", UpdateWeightsFromIPCReqInput, {}),
    ("/update_weights_from_ipc", UpdateWeightsFromIPCReqInput, {"zmq_handles": []}),
    ("/update_weights_from_distributed", UpdateWeightsFromDistributedReqInput, {"names": "w", "dtypes": []}),
])
def test_malformed_weight_bodies_are_refused_as_sglang(path, cls, body):
    want = _sglang_answer(cls, body)
    assert want is not None and _sim(path, body) == want


def test_update_weights_from_disk_with_a_non_string_model_path():
    status, answer = _sim("/update_weights_from_disk", {"model_path": 5})
    assert (status, answer["type"], answer["code"]) == (400, "Bad Request", 400)
    assert answer["message"].startswith(
        "2 validation errors:\n  {'type': 'is_instance_of', 'loc': ('body', 'is-instance[UpdateWeightFromDiskReqInput]'), "
        "'msg': 'Input should be an instance of UpdateWeightFromDiskReqInput', 'input': {'model_path': 5}, "
        "'ctx': {'class': 'UpdateWeightFromDiskReqInput'}}\n  {'type': 'string_type', 'loc': ('body', "
        "'function-after[build_struct(), UpdateWeightFromDiskReqInput]', 'model_path'), "
        "'msg': 'Input should be a valid string', 'input': 5} [")


def test_lax_values_pass_as_sglang_reads_them():
    body = {"master_address": "127.0.0.1", "master_port": "29500", "rank_offset": 1.0, "world_size": "2"}
    assert _sglang_answer(InitWeightsUpdateGroupReqInput, body) is None
    assert _sim("/init_weights_update_group", body) == (200, {
        "success": True, "message": "Succeeded to initialize custom process group."})


# -- vLLM's RL routes: Body(embed=True) fields, rendered by vLLM's validation handler -----------

VLLM_BODIES = {
    "/init_weight_transfer_engine": {"init_info": (Dict[str, Any], ...)},
    "/update_weights": {"update_info": (Dict[str, Any] | List[Dict[str, Any]], ...)},
    "/update_weight_version": {"new_version": (str, ...)},
    "/finish_weight_update": {"weight_version": (Optional[str], None)},
    "/weight_checker": {"action": (Literal["checksum", "reset", "compare"], ...),
                        "baseline": (Optional[Dict[str, str]], None)},
}


def _vllm_errors(path: str, body: dict) -> list[dict]:
    """pydantic's errors for ``body`` as FastAPI's model of the route's
    embedded body fields, under ``body``; FastAPI reports a missing one
    with a null ``input`` (``fastapi._compat.get_missing_field_error``)."""
    model = pydantic.create_model("Body", **VLLM_BODIES[path])
    try:
        model.model_validate(body)
        return []
    except pydantic.ValidationError as exc:
        errors = [{**e, "loc": ("body", *e["loc"])} for e in exc.errors(include_url=False)]
    return [{**e, "input": None} if e["type"] == "missing" else e for e in errors]


@pytest.mark.parametrize("version", ["0.33.0", "0.27.0"])
@pytest.mark.parametrize("path, body", [
    ("/init_weight_transfer_engine", {}),
    ("/init_weight_transfer_engine", {"init_info": 5}),
    ("/update_weights", {}),
    ("/update_weights", {"update_info": "x"}),
    ("/update_weights", {"update_info": [{"a": 1}, 5]}),
    ("/update_weight_version", {}),
    ("/update_weight_version", {"new_version": 7}),
    ("/finish_weight_update", {"weight_version": 3}),
    ("/weight_checker", {}),
    ("/weight_checker", {"action": "nope"}),
])
def test_malformed_vllm_weight_bodies_are_refused_as_vllm(version, path, body):
    from asgi_generate.sim.vllm_checks import render_invalid

    errors = _vllm_errors(path, body)
    want = render_invalid(errors, version == "0.33.0")
    app = SimApp("vllm", engine_version=version)
    status, _, raw = anyio.run(asgi_request, app, "POST", path, orjson.dumps(body))
    assert errors and (status, orjson.loads(raw)) == (want.status, want.body) and status == 400


def test_vllm_update_weights_takes_a_list_payload():
    app = SimApp("vllm")

    async def run() -> list[tuple[int, dict]]:
        out = []
        for path, body in (("/init_weight_transfer_engine", {"init_info": {"rank_offset": 1, "world_size": 2}}),
                           ("/update_weights", {"update_info": [{"names": ["w"]}]})):
            status, _, raw = await asgi_request(app, "POST", path, orjson.dumps(body))
            out.append((status, orjson.loads(raw)))
        return out

    assert anyio.run(run) == [(200, {"message": "Weight transfer initialized"}), (200, {"message": "Weights updated"})]
    assert _vllm_errors("/update_weights", {"update_info": [{"names": ["w"]}]}) == []

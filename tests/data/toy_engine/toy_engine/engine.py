"""The toy engine's description: its routes, and P/D pairs joined
sequentially (the prefill leg answers a handle the decode leg carries)."""

from asgi_generate.sdk import WorkerProtocol


def read_info(obj: dict) -> dict:
    """``GET /info``: ``{"model", "max_model_len"}``."""
    return {"served_model_name": obj.get("model"), "max_model_len": obj.get("max_model_len")}


ENGINE = WorkerProtocol(
    "toy", b"/healthz", b"/info", b"/abort", read_info, "ids", abort_takes_list=True, pd="sequential",
    generate_path="/toy_generate",
)

"""The ``sim`` capacity flags, as each engine's own CLI spells them, read
into a :class:`CapacityConfig` for :mod:`asgi_generate.sim.capacity`
(off unless one is set)."""

from __future__ import annotations

from dataclasses import dataclass

#: SGLang's ``--priority-scheduling-preemption-threshold`` default
#: (``srt/arg_groups/fields/schedule.py``).
PREEMPTION_THRESHOLD = 10


@dataclass(frozen=True, slots=True)
class CapacityConfig:
    """An engine's limits and step costs; ``None`` limits are unbounded.

    ``kv_tokens`` is the pool in tokens (SGLang ``--max-total-tokens``;
    vLLM ``--num-gpu-blocks-override`` times ``block_size``);
    ``max_queued_tokens`` vLLM's ``--max-num-queued-tokens``. Times are in
    seconds.
    """

    engine: str
    max_running: int | None = None
    kv_tokens: int | None = None
    block_size: int = 1
    max_batched_tokens: int | None = None
    max_queued: int | None = None
    priority: bool = False
    low_priority_values_first: bool = False
    abort_on_priority_when_disabled: bool = False
    step_s: float = 0.0
    seq_s: float = 0.0
    prefill_token_s: float = 0.0
    max_queued_tokens: int | None = None
    priority_preemption: bool = True
    preemption_threshold: int = PREEMPTION_THRESHOLD


#: The capacity flags of each engine, as its own CLI spells them, and the
#: engine-neutral step costs (``sim --help``).
SGLANG_FLAGS = ("max_running_requests", "max_total_tokens", "max_queued_requests",
                "enable_priority_scheduling", "schedule_low_priority_values_first",
                "abort_on_priority_when_disabled", "disable_priority_preemption",
                "priority_scheduling_preemption_threshold")
VLLM_FLAGS = ("max_num_seqs", "num_gpu_blocks_override", "max_num_batched_tokens", "max_num_queued_reqs",
              "max_num_queued_tokens", "scheduling_policy")
STEP_FLAGS = ("step_ms", "step_us_per_seq", "step_us_per_prefill_token")


def _flag(name: str) -> str:
    return "--" + name.replace("_", "-")


def _unset(value: object) -> bool:
    """A flag left at its default: 0 is a limit (vLLM's
    ``check_admission`` refuses every request at ``--max-num-queued-reqs 0``)."""
    return value is None or value is False or value == "fcfs"


def capacity_config(protocol: str, block_size: int, **flags) -> CapacityConfig | None:
    """The :class:`CapacityConfig` the ``sim`` flags ask for, or ``None``
    when none is set (the default: unbounded, timed as before).

    ``flags`` are :data:`SGLANG_FLAGS`, :data:`VLLM_FLAGS` and
    :data:`STEP_FLAGS` by name (``None``/``False``/``"fcfs"``: unset).

    Raises:
        ValueError: a limit below 1 (``--max-queued-requests`` and
            ``--max-num-queued-reqs`` and ``--max-num-queued-tokens`` may
            be 0, as the engines allow), a
            negative cost, an unknown scheduling policy, or a flag of the
            other engine's.
    """
    unknown = set(flags) - set(SGLANG_FLAGS) - set(VLLM_FLAGS) - set(STEP_FLAGS)
    if unknown:
        raise ValueError(f"unknown capacity flags {sorted(unknown)}")
    get = flags.get
    own, other = (SGLANG_FLAGS, VLLM_FLAGS) if protocol == "sglang" else (VLLM_FLAGS, SGLANG_FLAGS)
    for name in other:
        if not _unset(get(name)):
            raise ValueError(f"{_flag(name)} is {'vLLM' if protocol == 'sglang' else 'SGLang'}'s; "
                             f"this simulator plays {protocol}")
    policy = get("scheduling_policy") or "fcfs"
    if policy not in ("fcfs", "priority"):
        raise ValueError(f"--scheduling-policy must be fcfs or priority, got {policy!r}")
    for name in ("max_running_requests", "max_total_tokens", "max_num_seqs", "num_gpu_blocks_override",
                 "max_num_batched_tokens"):
        value = get(name)
        if value is not None and (type(value) is not int or value < 1):
            raise ValueError(f"{_flag(name)} must be a positive integer, got {value!r}")
    for name in ("max_queued_requests", "max_num_queued_reqs", "max_num_queued_tokens"):
        value = get(name)
        if value is not None and (type(value) is not int or value < 0):
            raise ValueError(f"{_flag(name)} must be an integer of at least 0, got {value!r}")
    for name in STEP_FLAGS:
        value = get(name)
        if value is not None and value < 0:
            raise ValueError(f"{_flag(name)} must be at least 0, got {value!r}")
    if get("schedule_low_priority_values_first") and not get("enable_priority_scheduling"):
        raise ValueError("--schedule-low-priority-values-first needs --enable-priority-scheduling")
    threshold = get("priority_scheduling_preemption_threshold")
    threshold = PREEMPTION_THRESHOLD if threshold is None else threshold
    if type(threshold) is not int:
        raise ValueError(f"--priority-scheduling-preemption-threshold must be an integer, got {threshold!r}")
    # Preemption's knobs change nothing without priority scheduling, so they turn nothing on.
    knobs = ("disable_priority_preemption", "priority_scheduling_preemption_threshold")
    if all(_unset(get(name)) for name in own + STEP_FLAGS if name not in knobs):
        return None
    ms, us = 1e-3, 1e-6
    costs = dict(step_s=(get("step_ms") or 0) * ms, seq_s=(get("step_us_per_seq") or 0) * us,
                 prefill_token_s=(get("step_us_per_prefill_token") or 0) * us)
    if protocol == "sglang":
        return CapacityConfig("sglang", get("max_running_requests"), get("max_total_tokens"), 1, None,
                              get("max_queued_requests"), bool(get("enable_priority_scheduling")),
                              bool(get("schedule_low_priority_values_first")),
                              bool(get("abort_on_priority_when_disabled")), **costs,
                              priority_preemption=not get("disable_priority_preemption"),
                              preemption_threshold=threshold)
    blocks = get("num_gpu_blocks_override")
    return CapacityConfig("vllm", get("max_num_seqs"), None if blocks is None else blocks * block_size,
                          block_size, get("max_num_batched_tokens"), get("max_num_queued_reqs"),
                          policy == "priority", False, False, **costs,
                          max_queued_tokens=get("max_num_queued_tokens"))

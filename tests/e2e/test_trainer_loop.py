"""The trainer loop (tests/trainer_loop.py) with a few streams, under both
worker classes, through one process, through ``serve --workers 3`` and
through three replicas sharing the simulators (the control calls to one
process or replica); bench/bench_trainer_loop.py runs it with 50."""

from __future__ import annotations

import pytest

import trainer_loop

pytestmark = pytest.mark.e2e


@pytest.mark.parametrize("worker_class", ["trio", "asyncio"])
def test_trainer_loop(tmp_path, worker_class):
    problems, _ = trainer_loop.run(str(tmp_path), worker_class, streams=8)
    assert problems == []


@pytest.mark.parametrize("worker_class", ["trio", "asyncio"])
def test_trainer_loop_through_three_processes(tmp_path, worker_class):
    problems, _ = trainer_loop.run(str(tmp_path), worker_class, streams=8, processes=3)
    assert problems == []


@pytest.mark.parametrize("worker_class", ["trio", "asyncio"])
def test_trainer_loop_through_three_replicas(tmp_path, worker_class):
    problems, _ = trainer_loop.run(str(tmp_path), worker_class, streams=8, replicas=3)
    assert problems == []

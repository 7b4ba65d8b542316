"""The CPU engine core forked from its worker gets the OpenMP threads and cores a spawned
one would read from its environment; other forks of the worker keep the worker's."""

from __future__ import annotations

import multiprocessing
import os
import types

import pytest
import torch

from prism.engine.core_process import forked_core


def _report(pipe) -> None:
    pipe.send((torch.get_num_threads(), sorted(os.sched_getaffinity(0))))


def _fork() -> tuple[int, list[int]]:
    """What a child forked now sees, forked as vLLM forks its engine core."""
    here, there = multiprocessing.Pipe()
    child = multiprocessing.get_context(os.environ["VLLM_WORKER_MULTIPROC_METHOD"]).Process(
        target=_report, args=(there,)
    )
    child.start()
    child.join(30)
    return here.recv()


def _omp(lists: list[list[int]], mode: str = "list") -> types.SimpleNamespace:
    return types.SimpleNamespace(cpu_lists=lists, auto_setup=mode == "auto",
                                 skip_setup=mode == "nobind")  # fmt: skip


@pytest.fixture
def worker(monkeypatch):
    """This process as a worker whose vLLM platform asked for spawned processes."""
    monkeypatch.setenv("VLLM_WORKER_MULTIPROC_METHOD", "spawn")
    own = (torch.get_num_threads(), sorted(os.sched_getaffinity(0)))
    yield own
    assert (torch.get_num_threads(), sorted(os.sched_getaffinity(0))) == own


def test_a_core_given_cores_is_bound_to_them_with_a_thread_each(worker):
    core = worker[1][:1]
    with forked_core(_omp([core])):
        assert _fork() == (1, core)
    assert os.environ["VLLM_WORKER_MULTIPROC_METHOD"] == "spawn"
    # Only the engine core's fork is changed: a later one is the worker's own.
    os.environ["VLLM_WORKER_MULTIPROC_METHOD"] = "fork"
    assert _fork() == worker


def test_vllms_automatic_binding_gives_its_thread_count_unbound(worker):
    with forked_core(_omp([[0, 1, 2]], "auto")):
        assert _fork() == (3, worker[1])


def test_nobind_leaves_the_core_as_the_worker_is(worker):
    with forked_core(_omp([], "nobind")):
        assert _fork() == worker

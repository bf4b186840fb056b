"""A user's runner runs in the driver process: the check's timeout stops it with the line it was stuck at."""

from __future__ import annotations

import functools
import threading
import time

import pytest
import torch
import torch.nn as nn

import pipecheck as pc


class TwoLayers(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.a, self.b = nn.Linear(4, 4), nn.Linear(4, 4)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.b(torch.tanh(self.a(x)))


CHECK = functools.partial(pc.assert_equivalent, TwoLayers, (torch.randn(4, 4),),
                          split_spec={"b": pc.SplitPoint.BEGINNING}, n_microbatches=2, tracer="fx")


def _reference(job: pc.Job) -> pc.StepResult:
    return pc.DetachExecutor(job.split()).step(job.args, job.kwargs, loss_fn=job.loss_fn, target=job.target,
                                               n_microbatches=job.n_microbatches)


def test_a_runner_that_sleeps_forever_in_the_driver_is_stopped_by_the_timeout_with_its_stack() -> None:
    release, resumed = threading.Event(), []

    def waits_for_a_peer(job: pc.Job) -> pc.StepResult:
        release.wait(600)  # blocked in native code: the thread cannot be killed, only left behind
        resumed.append(1)
        return _reference(job)

    started = time.monotonic()
    try:
        with pytest.raises(pc.EngineError) as info:
            CHECK(runner=waits_for_a_peer, timeout=2)
        took = time.monotonic() - started
    finally:
        release.set()
    assert took < 2 + 10, took
    message = str(info.value)
    assert message.startswith("runner 'waits_for_a_peer' did not finish within timeout=2 s")
    assert "in waits_for_a_peer\n" in message and "release.wait(600)" in message  # where it was stuck
    assert "cannot be killed" in message and "daemon thread" in message and "Fix: " in message
    assert info.value.engine == "waits_for_a_peer" and isinstance(info.value.__cause__, TimeoutError)
    stuck = [t for t in threading.enumerate() if t.name == "pipecheck runner 'waits_for_a_peer'"]
    assert all(t.daemon for t in stuck)  # never keeps the process from exiting
    for thread in stuck:
        thread.join(10)
    assert resumed == []  # told to stop: once it ran Python again, it ended there
    assert CHECK(runner=_reference, timeout=2).ok  # a later check is not harmed


def test_a_runner_spinning_in_python_is_ended_at_the_timeout() -> None:
    spins = []

    def spins_forever(job: pc.Job) -> pc.StepResult:
        while True:
            spins.append(1)
            del spins[:]

    with pytest.raises(pc.EngineError, match=r"did not finish within timeout=1 s(.|\n)*in spins_forever"):
        CHECK(runner=spins_forever, timeout=1)
    for thread in threading.enumerate():
        if thread.name == "pipecheck runner 'spins_forever'":
            thread.join(10)
            assert not thread.is_alive()


def test_a_runner_in_time_keeps_its_result_its_errors_and_its_attributes() -> None:
    calls = []

    class Refusing:
        follows_precision = False

        def check_split(self, pipe: pc.Pipe) -> None:
            calls.append("check_split")

        def __call__(self, job: pc.Job) -> pc.StepResult:
            calls.append("call")
            raise ValueError("bad layout")

    with pytest.raises(pc.EngineError, match="runner 'Refusing' failed to run the job: ValueError: bad layout"):
        CHECK(runner=Refusing(), timeout=30)
    assert calls == ["check_split", "call"]
    assert CHECK(runner=_reference, timeout=30).ok

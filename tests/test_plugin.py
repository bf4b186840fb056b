"""pipecheck's pytest plugin, in real pytest sessions (pytester, in a subprocess): the session-long
World fixture, the ``gpu`` marker's clean skip, and the hypothesis profiles."""

from __future__ import annotations

import os
import time

import pytest

pytestmark = pytest.mark.filterwarnings("ignore::pytest.PytestUnraisableExceptionWarning")


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    return True


def test_the_world_fixture_keeps_one_world_per_size_and_stops_it_at_the_end(pytester: pytest.Pytester) -> None:
    pytester.makepyfile(test_engine='''
        import os
        import torch
        import pipecheck as pc

        class Net(torch.nn.Module):
            def __init__(self):
                super().__init__()
                self.a, self.b = torch.nn.Linear(4, 4), torch.nn.Linear(4, 2)

            def forward(self, x):
                x = self.a(x)
                pc.pipe_split()
                return self.b(x)

        def test_a_check_on_the_fixture_world(pipecheck_world):
            world = pipecheck_world(2)
            assert pipecheck_world(2) is world and world.world_size == 2
            report = pc.assert_equivalent(Net, (torch.randn(4, 4),), runner="distributed", world=world,
                                          n_microbatches=2)
            assert report.ok
            print("\\nPIDS", *world.pids)

        def test_the_same_world_serves_the_next_test(pipecheck_world):
            print("\\nPIDS", *pipecheck_world(2).pids)
    ''')
    result = pytester.runpytest_subprocess("-s", "-p", "no:cacheprovider", "-p", "no:xdist")
    result.assert_outcomes(passed=2)
    pid_lines = [line.split()[1:] for line in result.outlines if line.startswith("PIDS")]
    assert len(pid_lines) == 2 and pid_lines[0] == pid_lines[1] and len(pid_lines[0]) == 2
    deadline = time.monotonic() + 5
    while any(_alive(int(pid)) for pid in pid_lines[0]) and time.monotonic() < deadline:
        time.sleep(0.1)
    assert not any(_alive(int(pid)) for pid in pid_lines[0]), "a rank outlived the pytest session"


def test_the_gpu_marker_is_declared_and_skips_cleanly_without_gpus(pytester: pytest.Pytester) -> None:
    pytester.makepyfile(test_gpu='''
        import pytest

        @pytest.mark.gpu(n=999)
        def test_needs_many_gpus():
            raise AssertionError("must not run")

        @pytest.mark.gpu(999)
        def test_needs_many_gpus_positional():
            raise AssertionError("must not run")
    ''')
    result = pytester.runpytest_subprocess("--strict-markers", "-rs", "-p", "no:cacheprovider", "-p", "no:xdist")
    result.assert_outcomes(skipped=2)
    result.stdout.fnmatch_lines(["*needs 999 CUDA GPU(s), found *"])


@pytest.mark.parametrize("profile,max_examples,derandomize", [("ci", 25, True), ("nightly", 500, False)])
def test_hypothesis_profiles_are_chosen_by_the_environment(pytester: pytest.Pytester, monkeypatch: pytest.MonkeyPatch,
                                                           profile: str, max_examples: int, derandomize: bool) -> None:
    monkeypatch.setenv("HYPOTHESIS_PROFILE", profile)
    pytester.makepyfile(test_profile=f'''
        from hypothesis import settings

        def test_profile():
            assert settings().max_examples == {max_examples}
            assert settings().derandomize is {derandomize}
            assert settings().deadline is None
    ''')
    result = pytester.runpytest_subprocess("-p", "no:cacheprovider", "-p", "no:xdist")
    result.assert_outcomes(passed=1)

"""The pytest plugin's thread fixture: tiny-model tests on one torch thread, opt-outs by marker.

Run in a throw-away project (pytester), as a third party's contract tests meet it: the plugin comes from the
`pytest11` entry point, not from this repository's conftest or ini.
"""

from __future__ import annotations

import pytest
import torch

pytest_plugins = ["pytester"]


def test_this_suite_runs_on_one_thread():
    assert torch.get_num_threads() == 1  # pyproject's outrider_torch_threads = "1"


@pytest.mark.torch_threads(2)
def test_a_marked_test_gets_its_threads():
    assert torch.get_num_threads() == 2


def test_in_another_project_only_tests_using_outrider_fixtures_run_on_one_thread(pytester):
    pytester.makepyfile(
        """
        import pytest, torch

        BEFORE = torch.get_num_threads()

        def test_uses_a_tiny_model_fixture(toy_model):
            assert torch.get_num_threads() == 1

        def test_plain():
            assert torch.get_num_threads() == BEFORE

        @pytest.mark.torch_threads(0)
        def test_opted_out(toy_model):
            assert torch.get_num_threads() == BEFORE

        def test_restored_afterwards():
            assert torch.get_num_threads() == BEFORE
        """
    )
    with_threads = 3  # not 1, so "plain" and "one thread" differ
    before = torch.get_num_threads()
    torch.set_num_threads(with_threads)
    try:
        result = pytester.runpytest_inprocess("-p", "no:cacheprovider")
    finally:
        torch.set_num_threads(before)
    result.assert_outcomes(passed=4)

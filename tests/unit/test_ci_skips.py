"""Under CI=true a skipped test fails, unless it carries the gpu marker (tests/conftest.py): a
folder that skips itself (the Slurm tests when not root, SGLang's contract without SGLang) would
otherwise leave `.ci/run` green with nothing of it run."""

from __future__ import annotations

from pathlib import Path

import pytest

pytest_plugins = ["pytester"]
CONFTEST = Path(__file__).resolve().parents[1] / "conftest.py"
TESTS = """
import pytest

def test_skips():
    pytest.skip("the cluster needs root")

@pytest.mark.gpu
def test_needs_a_gpu():
    pytest.skip("needs a CUDA GPU")

def test_runs():
    assert True
"""


def _run(pytester: pytest.Pytester, monkeypatch: pytest.MonkeyPatch, ci: str | None) -> pytest.RunResult:
    pytester.makeconftest(CONFTEST.read_text())
    pytester.makeini("[pytest]\nmarkers =\n    gpu: needs a CUDA GPU")
    pytester.makepyfile(test_some=TESTS)
    monkeypatch.setenv("PYTHONPATH", str(CONFTEST.parents[1]))  # the conftest imports tests.slurm
    if ci is None:
        monkeypatch.delenv("CI", raising=False)
    else:
        monkeypatch.setenv("CI", ci)
    return pytester.runpytest_subprocess("-p", "no:cacheprovider")


def test_a_skip_fails_under_ci_unless_marked_gpu(pytester: pytest.Pytester, monkeypatch: pytest.MonkeyPatch) -> None:
    result = _run(pytester, monkeypatch, "true")
    result.assert_outcomes(passed=1, failed=1, skipped=1)
    result.stdout.fnmatch_lines(["*test_skips - skipped under CI=true*the cluster needs root*"])


def test_a_skip_is_a_skip_outside_ci(pytester: pytest.Pytester, monkeypatch: pytest.MonkeyPatch) -> None:
    _run(pytester, monkeypatch, None).assert_outcomes(passed=1, skipped=2)

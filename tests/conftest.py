"""How the suite is spread over pytest-xdist workers (the README's test command: `-n 2`).

Each test module is one unit of work: a module's fixtures start jobs, engines or a whole learning
suite once (scope "module") and must not run again on a second worker. The Slurm tests are one
unit, because they share one cluster (a session fixture: two workers would start two clusters on
the same ports). They go first, being the longest unit (about 25 minutes of CI's 40), so the other
worker's tests run beside them. The whole suite keeps the 2 cores busy (1.85 of 2 measured), so
a third worker is no faster (BENCHMARKS.md, "CI").

(A scheduler of our own rather than xdist's `--dist loadgroup`: that mode renames the test ids
through an attribute pytest 9 no longer reads, so its groups are silently ignored.)
"""

from __future__ import annotations

import os
import sys
from collections.abc import Iterator
from typing import Any

import pytest

SLURM = "tests/slurm/"


def _unit_of_work(nodeid: str) -> str:
    return "slurm" if nodeid.startswith(SLURM) else nodeid.split("::", 1)[0]


def pytest_xdist_make_scheduler(config: pytest.Config, log: Any) -> Any:
    from xdist.scheduler import LoadScopeScheduling  # type: ignore[import-untyped]  # only under -n

    class ByModule(LoadScopeScheduling):
        def _split_scope(self, nodeid: str) -> str:
            return _unit_of_work(nodeid)

    return ByModule(config, log)


# The longest modules after the Slurm unit, longest first (seconds in a clean-clone CI run,
# BENCHMARKS.md "CI"): a worker then ends on short unit tests instead of one learning run while
# the other waits (the vLLM run came last and alone, about 200 s, at 528935a).
LONGEST = (
    "tests/integration/test_multimodal_system.py",  # 363 s
    "tests/integration/test_algorithms_learn.py",  # 294
    "tests/integration/test_agentic.py",  # 265
    "tests/integration/test_resume.py",  # 222
    "tests/integration/test_vllm_run.py",  # 193
    "tests/integration/test_learning.py",  # 123
    "tests/integration/test_weight_sync.py",  # 119
    "tests/integration/test_vllm_resume.py",  # 56 alone
)


def _order(item: pytest.Item) -> tuple[int, int]:
    if item.nodeid.startswith(SLURM):
        return (0, 0)
    module = item.nodeid.split("::", 1)[0]
    return (1, LONGEST.index(module)) if module in LONGEST else (2, 0)


def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    items.sort(key=_order)  # stable: each module's order stays


def pytest_report_header(config: pytest.Config) -> str:
    from tests.slurm.chaos_cycle import header

    return header()  # the chaos test's draw, printed where every CI log shows it


def _under_ci() -> bool:
    return os.environ.get("CI", "").lower() in ("1", "true", "yes")


def _skip_allowed(item: pytest.Item) -> bool:
    """Under CI only the gpu marker's tests may skip (no GPU there), and on a machine with CUDA the
    CPU forms of GPU tests: any other skip is a test CI believes ran and did not."""
    if item.get_closest_marker("gpu") is not None:
        return True
    torch = sys.modules.get("torch")  # loaded by any module whose skip depends on CUDA
    return torch is not None and torch.cuda.is_available()


@pytest.hookimpl(hookwrapper=True)
def pytest_runtest_makereport(item: pytest.Item, call: pytest.CallInfo[None]) -> Iterator[None]:
    outcome = yield
    report = outcome.get_result()  # type: ignore[attr-defined]
    if report.skipped and _under_ci() and not _skip_allowed(item):
        reason = report.longrepr[2] if isinstance(report.longrepr, tuple) else str(report.longrepr)
        report.outcome = "failed"
        report.longrepr = f"skipped under CI=true, where only `gpu` tests may skip: {reason}"


@pytest.fixture
def one_rank(tmp_path):
    """A process group of this process alone (another test of the worker may have made one and
    left it: megatron's parallel state stays for the process)."""
    import torch.distributed as dist  # here, not at the top: the xdist controller loads this file only to schedule

    if dist.is_initialized():
        assert dist.get_world_size() == 1
        yield
        return
    dist.init_process_group("gloo", init_method=f"file://{tmp_path / 'store'}", rank=0, world_size=1)
    yield
    dist.destroy_process_group()

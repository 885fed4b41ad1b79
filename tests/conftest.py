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


def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    items.sort(key=lambda item: not item.nodeid.startswith(SLURM))  # stable: each module's order stays


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

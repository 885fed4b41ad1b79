"""Fixtures shared by the unit tests."""

from __future__ import annotations

import pytest
import torch.distributed as dist


@pytest.fixture
def one_rank(tmp_path):
    """A process group of this process alone (another test of the session may have made one)."""
    if dist.is_initialized():
        assert dist.get_world_size() == 1
        yield
        return
    dist.init_process_group("gloo", init_method=f"file://{tmp_path / 'store'}", rank=0, world_size=1)
    yield
    dist.destroy_process_group()

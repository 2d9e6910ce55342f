"""Fixtures shared by the unit tests."""

from __future__ import annotations

import pytest
import torch


@pytest.fixture
def one_rank_world():
    """A one-rank gloo world: tensor-parallel mappings ignore their group without one."""
    torch.distributed.init_process_group("gloo", store=torch.distributed.HashStore(), rank=0,
                                         world_size=1)
    yield
    torch.distributed.destroy_process_group()

"""Shared by the test files: the golden blocks (golden/ beside this file) and seeded random inputs."""
import os

import pytest
import torch

GOLDEN = os.path.join(os.path.dirname(os.path.abspath(__file__)), 'golden')


@pytest.fixture(scope='session')
def golden():
    return torch.load(os.path.join(GOLDEN, 'golden_blocks.pt'), weights_only=True)


def qkv(B, H, N, D, dtype=torch.float64, seed=0):
    g = torch.Generator().manual_seed(seed)
    return [torch.randn(B, H, N, D, generator=g, dtype=dtype) for _ in range(3)]

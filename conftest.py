"""Shared by the test files: the golden blocks (golden/ beside this file), seeded random inputs,
and where the fast cores run their compiled graphs."""
import os

import pytest
import torch

import kernels

GOLDEN = os.path.join(os.path.dirname(os.path.abspath(__file__)), 'golden')


@pytest.fixture(scope='session')
def golden():
    return torch.load(os.path.join(GOLDEN, 'golden_blocks.pt'), weights_only=True)


@pytest.fixture(autouse=True)
def closed_forms_eagerly(request):
    """The fast cores run their closed forms eagerly (kernels.eagerly(), as enable_fast's check
    runs them) in every test but those marked `compiled`, which prove the compiled graphs equal the
    reference: a graph compiled for each dtype, head dim and neighbour count the tests met took
    most of the suite's time on a new machine (RESULTS.md, "The test suite"). A model compiled
    whole traces them either way."""
    if request.node.get_closest_marker('compiled'):
        yield
        return
    with kernels.eagerly():
        yield


def qkv(B, H, N, D, dtype=torch.float64, seed=0):
    g = torch.Generator().manual_seed(seed)
    return [torch.randn(B, H, N, D, generator=g, dtype=dtype) for _ in range(3)]

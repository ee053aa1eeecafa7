"""The proof: the reference against explicit formulas, the backbones against the authors' models.

    python -m pytest -q                      # about 5-8 minutes on 2 CPU cores (README, "Quick start")
    INLINE_SLOW=1 python -m pytest -q        # also the MACs of all 15 variants

Golden data: golden/ beside this file (its README says what each file holds and how it was made):
golden_blocks.pt, small blocks of the authors' released models with their weights, float64 inputs and
outputs; keys/<variant>.tsv.gz, every key of each released state dict. Big models are only built on the
meta device, where shapes and FLOP counts cost no memory.
"""
import argparse
import ast
import contextlib
import copy
import functools
import glob
import gzip
import hashlib
import io
import json
import math
import os
import re
import signal
import socket
import subprocess
import statistics
import sys
import tempfile
import threading
import time
import tokenize
import types
import warnings

import numpy as np
import pytest
import torch
import torch.nn as nn
import torch.nn.functional as F
from PIL import Image, ImageEnhance, ImageOps
from torchvision import datasets

import inline
import kernels
import models
import paper
import train

GOLDEN = os.path.join(os.path.dirname(os.path.abspath(__file__)), 'golden')


@pytest.fixture(scope='session')
def golden():
    return torch.load(os.path.join(GOLDEN, 'golden_blocks.pt'), weights_only=True)


def qkv(B, H, N, D, dtype=torch.float64, seed=0):
    g = torch.Generator().manual_seed(seed)
    return [torch.randn(B, H, N, D, generator=g, dtype=dtype) for _ in range(3)]


# ---------------------------------------------------------------------------------------------------
# Eq. 5

@pytest.mark.parametrize('kernel', sorted(inline.KERNELS))
@pytest.mark.parametrize('N', [49, 197])
def test_eq5_explicit_equals_linear_form(kernel, N):
    phi = inline.get_kernel(kernel, head_dim=32)
    if isinstance(phi, torch.nn.Module):  # relu_affine: an affine map away from its identity start
        phi = perturb(phi.double())
    q, k, v = qkv(2, 3, N, 32)
    q, k = phi(q), phi(k)
    w = inline.inline_weights(q, k)
    torch.testing.assert_close(w.sum(-1), torch.ones(2, 3, N, dtype=torch.float64), rtol=0, atol=1e-12)
    torch.testing.assert_close(inline.inline_attention(q, k, v), w @ v, rtol=0, atol=1e-12)


def test_eq5_reference_keeps_its_precision_in_bf16():
    """inline_attention centres k and v before their product, as its docstring promises, so keys whose means are 20
    times their spread cost bf16 nothing: its error against float64 on the same bf16 inputs stays under a fixed
    bound (about 0.002 here; the uncentred k^T (v - v_mean) would be about 0.08)."""
    g = torch.Generator().manual_seed(0)
    q, k, v = (torch.randn(2, 2, 196, 32, generator=g) for _ in range(3))
    q, k, v = q.bfloat16(), (20 + k).bfloat16(), v.bfloat16()
    exact = inline.inline_attention(q.double(), k.double(), v.double())
    error = (inline.inline_attention(q, k, v).double() - exact).abs().max().item()
    print(f"bf16 reference against float64, key means 20x their spread: {error:.4f} (outputs up to "
          f"{exact.abs().max().item():.2f})")
    assert error < 0.01


@pytest.mark.parametrize('scale_by_count', [True, False], ids=['s-over-N', 'printed-s'])
def test_eq5_weights_match_the_formula_element_by_element(scale_by_count):
    """s/N (the released models') or s (the paper's printed Eq. 5) times q_i.(k_j - k_mean), plus 1/N."""
    q, k, _ = qkv(1, 1, 7, 4)
    w = inline.inline_weights(q, k, scale_by_count=scale_by_count)
    s, N = 4 ** -0.5, 7
    g = s / N if scale_by_count else s
    k_mean = k[0, 0].mean(0)
    for i in range(N):
        for j in range(N):
            expected = g * (q[0, 0, i] @ k[0, 0, j] - q[0, 0, i] @ k_mean) + 1 / N
            assert abs(w[0, 0, i, j].item() - expected.item()) < 1e-14


def test_printed_eq5_linear_form_and_core_equal_its_weights():
    """scale_by_count=False on an image: the linear form and the core (Eq. 5 without Eq. 6) give w @ v with the
    printed weights, outputs and gradients, in float64; the module passes the option to its core and its weights."""
    q, k, v, do = qkv(2, 3, 49, 8) + [torch.randn(2, 3, 49, 8, dtype=torch.float64)]
    forms = {'explicit': lambda q, k, v: inline.inline_weights(q, k, scale_by_count=False) @ v,
             'linear': lambda q, k, v: inline.inline_attention(q, k, v, scale_by_count=False),
             'core': lambda q, k, v: inline.inline_core(q, k, v, None, (7, 7), scale_by_count=False)}
    results = {}
    for name, form in forms.items():
        leaves = [t.clone().requires_grad_() for t in (q, k, v)]
        o = form(*leaves)
        results[name] = [o, *torch.autograd.grad(o, leaves, do)]
    for name in ('linear', 'core'):
        for what, a, b in zip(['o', 'dq', 'dk', 'dv'], results[name], results['explicit']):
            torch.testing.assert_close(a, b, rtol=0, atol=1e-11, msg=f"{name}, {what}")
    assert (results['explicit'][0] - inline.inline_weights(q, k) @ v).abs().max() > 1e-2  # the two factors differ
    torch.manual_seed(0)
    attn = inline.InLineAttention(16, 2, scale_by_count=False).double()
    x = torch.randn(2, 49, 16, dtype=torch.float64)
    _, q, k, _ = attn.project(x, (7, 7))
    torch.testing.assert_close(attn.weights(x, (7, 7)), inline.inline_weights(q, k, scale_by_count=False))
    with pytest.raises(ValueError, match="nonneg .* needs scale_by_count=True"):
        inline.InLineAttention(16, 2, nonneg=True, scale_by_count=False)


def test_uncentred_form_of_the_released_models_is_the_same_number():
    q, k, v = qkv(2, 2, 64, 16)
    N, s = 64, 16 ** -0.5
    uncentred = (s / N) * q @ (k.transpose(-2, -1) @ v) \
        - s * (q @ k.mean(2, keepdim=True).transpose(-2, -1)) * v.mean(2, keepdim=True) + v.mean(2, keepdim=True)
    torch.testing.assert_close(inline.inline_attention(q, k, v), uncentred, rtol=0, atol=1e-12)


def test_linear_attention_matches_its_weights():
    q, k, v = (torch.relu(t) for t in qkv(2, 2, 30, 8))
    torch.testing.assert_close(inline.linear_attention(q, k, v, eps=0),
                               inline.linear_attention_weights(q, k, eps=0) @ v)


@pytest.mark.parametrize('alpha', [2.0, 0.5, 10.0])
def test_injectivity(alpha):
    """Vanilla linear attention gives q and alpha*q the same weights; InLine and softmax do not."""
    q, k, _ = qkv(1, 2, 20, 8)
    relu = inline.get_kernel('relu')
    q = relu(q) + 0.1  # positive queries so the linear weights are well defined
    lin = inline.linear_attention_weights(q, relu(k), eps=0)
    torch.testing.assert_close(lin, inline.linear_attention_weights(alpha * q, relu(k), eps=0), rtol=0, atol=1e-14)
    ours = inline.inline_weights(q, k)
    assert (ours - inline.inline_weights(alpha * q, k)).abs().max() > 1e-3
    soft = torch.softmax(q @ k.transpose(-2, -1), -1)
    assert (soft - torch.softmax(alpha * q @ k.transpose(-2, -1), -1)).abs().max() > 1e-3


# ---------------------------------------------------------------------------------------------------
# Eq. 6

def local_residual_slow(v, r, grid, size=3, dilation=1):
    """Eq. 6 by a loop over every token's size x size neighbourhood, neighbour t at (dilation*(t//size - size//2),
    dilation*(t%size - size//2)) (R-dil; README, "The paper's experiments"), zero outside the grid."""
    B, H, N, D = v.shape
    h, w = grid
    T = size * size
    out = torch.zeros_like(v)
    for b in range(B):
        for head in range(H):
            for j in range(D):
                c = head * D + j
                for y in range(h):
                    for x in range(w):
                        total = 0.0
                        for t in range(T):
                            yy, xx = y + dilation * (t // size - size // 2), x + dilation * (t % size - size // 2)
                            if 0 <= yy < h and 0 <= xx < w:
                                total += r[b, T * c + t] * v[b, head, yy * w + xx, j]
                        out[b, head, y * w + x, j] = total
    return out


@pytest.mark.parametrize('size,dilation', [(3, 1), (3, 2), (3, 3), (5, 1), (1, 1)],
                         ids=['3x3', '3x3-dilation2', '3x3-dilation3', '5x5', '1x1'])
def test_eq6_against_explicit_loop_on_a_non_square_grid(size, dilation):
    grid = (5, 7)
    v = qkv(2, 2, 35, 3)[0]
    r = torch.randn(2, size * size * 6, dtype=torch.float64, generator=torch.Generator().manual_seed(1))
    torch.testing.assert_close(inline.local_residual(v, r, grid, size, dilation),
                               local_residual_slow(v, r, grid, size, dilation), rtol=0, atol=1e-12)


def test_plain_residual_is_r_times_v():
    """R-res 'plain': one weight per channel, o_i += r * v_i, through the core's Eq. 6 path."""
    q, k, v = qkv(2, 2, 1 + 12, 4)
    r = torch.randn(2, 8, dtype=torch.float64)  # (B, C)
    out = inline.inline_core(q, k, v, r, (3, 4), size=1)
    plain = inline.inline_attention(q, k, v)
    expected = plain[:, :, 1:] + r.view(2, 2, 1, 4) * v[:, :, 1:]  # channel c = head*D + j
    torch.testing.assert_close(out[:, :, 1:], expected, rtol=0, atol=1e-12)
    torch.testing.assert_close(out[:, :, :1], plain[:, :, :1], rtol=0, atol=0)


def test_core_leaves_leading_tokens_without_local_residual():
    q, k, v = qkv(2, 2, 1 + 12, 8)
    r = torch.randn(2, 9 * 16, dtype=torch.float64)
    out = inline.inline_core(q, k, v, r, (3, 4))
    plain = inline.inline_attention(q, k, v)
    torch.testing.assert_close(out[:, :, :1], plain[:, :, :1], rtol=0, atol=0)
    torch.testing.assert_close(out[:, :, 1:], plain[:, :, 1:] + inline.local_residual(v[:, :, 1:], r, (3, 4)))
    torch.testing.assert_close(out, plain + inline.local_residual(v, r, (3, 4)), rtol=0, atol=0)


def test_residual_mlp_is_block_diagonal_per_head():
    """Channel c's nine weights depend only on the input channels of c's head."""
    torch.manual_seed(0)
    C, H = 8, 2
    mlp = inline.residual_mlp(C, H).double()
    x = torch.randn(1, 5, C, dtype=torch.float64)
    x2 = x.clone()
    x2[..., C // 2:] += 1.0  # change only head 1's channels
    r, r2 = inline.residual_weights(mlp, x), inline.residual_weights(mlp, x2)
    assert r.shape == (1, 9 * C)
    torch.testing.assert_close(r[:, :9 * C // 2], r2[:, :9 * C // 2], rtol=0, atol=0)
    assert (r[:, 9 * C // 2:] - r2[:, 9 * C // 2:]).abs().max() > 1e-6


@pytest.mark.parametrize('causal', [False, True], ids=['per-sample', 'causal'])
def test_residual_weights_are_the_released_grouped_convolutions(causal):
    """residual_weights multiplies the token mean by W1's and W2's per-head blocks: the number the released two 1x1
    grouped convolutions give on the mean as a 1-token sequence (per-sample), or on each prefix mean (causal)."""
    torch.manual_seed(0)
    B, N, C, H = 2, 11, 12, 3
    mlp = inline.residual_mlp(C, H, taps=9).double()
    x = torch.randn(B, N, C, dtype=torch.float64)
    means = x.cumsum(1) / torch.arange(1, N + 1)[:, None] if causal else x.mean(1, keepdim=True)  # (B, N or 1, C)
    expected = mlp(means.transpose(1, 2)).transpose(1, 2)  # (B, N or 1, 9C): the convolutions themselves
    r = inline.residual_weights(mlp, x, causal)
    torch.testing.assert_close(r, expected if causal else expected[:, 0], rtol=0, atol=1e-14)


# ---------------------------------------------------------------------------------------------------
# The module (its golden outputs are checked with the other golden blocks below)

def test_module_with_class_token_and_non_square_grid_backward():
    torch.manual_seed(0)
    attn = inline.InLineAttention(32, 2, leading_tokens=1)
    x = torch.randn(2, 1 + 4 * 6, 32, requires_grad=True)
    out = attn(x, (4, 6))
    out.backward(torch.randn_like(out))
    assert out.shape == x.shape and torch.isfinite(out).all()
    assert all(p.grad is not None and p.grad.abs().sum() > 0 for p in attn.parameters())


def test_linear_baseline_and_no_residual_switches():
    torch.manual_seed(0)
    x = torch.randn(2, 16, 32)
    lin = inline.InLineAttention(32, 2, kernel='relu', attention='linear')
    no_res = inline.InLineAttention(32, 2, residual='none')
    assert lin(x, (4, 4)).shape == x.shape and no_res.residual is None
    assert not any('residual' in name for name, _ in no_res.named_parameters())
    assert no_res(x, (4, 4)).shape == x.shape


# ---------------------------------------------------------------------------------------------------
# Bad input

def test_bad_input_errors():
    with pytest.raises(ValueError, match=r"16 tokens, but this attention declares 0 leading token.*5x5 grid"):
        inline.InLineAttention(32, 2)(torch.randn(1, 16, 32), (5, 5))
    with pytest.raises(ValueError, match=r"16 tokens cannot hold a 5x5 token grid of 25"):
        inline.inline_core(*qkv(1, 2, 16, 16), torch.zeros(1, 9 * 32, dtype=torch.float64), (5, 5))
    with pytest.raises(ValueError, match=r"channels \(30\) must be divisible by heads \(4\)"):
        inline.InLineAttention(30, 4)
    with pytest.raises(ValueError, match=r"unknown kernel function 'gelu'; choose one of \['exp', 'identity'"):
        inline.InLineAttention(32, 2, kernel='gelu')
    with pytest.raises(ValueError, match=r"needs a non-negative kernel"):
        inline.InLineAttention(32, 2, kernel='identity', attention='linear')
    with pytest.raises(ValueError, match=r"cannot hold a 3x3 token grid"):
        q, k, v = qkv(1, 1, 8, 4)
        inline.inline_core(q, k, v, torch.zeros(1, 36, dtype=torch.float64), (3, 3))


# ===================================================================================================
# models.py: the four backbones against the authors' released models

SLOW = pytest.mark.skipif(not os.environ.get('INLINE_SLOW'), reason="set INLINE_SLOW=1 for every variant")
TINY = ['inline_deit_t', 'inline_pvt_t', 'inline_swin_t', 'inline_cswin_t']  # one variant per family

# Small models of each family, for real forward and backward passes on a non-square image. They reach
# every code path: class token, separate q/kv, I, L, S and M letters, padded and shifted Swin windows,
# two-branch CSwin stripes that need padding (stage 3: a 4x6 map in stripes of 3).
SMALL = {
    'inline_deit_t': dict(img_size=(48, 80), embed_dim=32, depth=2, num_heads=2, layout='I'),
    'inline_pvt_t': dict(img_size=(64, 96), embed_dims=(16, 32, 32, 64), depths=(1, 1, 1, 1),
                         num_heads=(1, 2, 2, 2), layout='ILII'),
    'inline_swin_t': dict(img_size=(64, 96), embed_dim=16, depths=(2, 2, 2, 2), num_heads=(1, 2, 2, 4),
                          layout='SIMS1', softmax_window=3),
    'inline_cswin_t': dict(img_size=(64, 96), embed_dim=16, depths=(1, 2, 2, 1), num_heads=(2, 2, 4, 4),
                           layout='ILSS', stripes=(1, 2, 3, 3)),
}


def released_keys(name):
    """[(key, shape, kind)] of the authors' state dict for a variant."""
    with gzip.open(os.path.join(GOLDEN, 'keys', f'{name}.tsv.gz'), 'rt') as f:
        rows = [line.rstrip('\n').split('\t') for line in f][1:]
    return [(key, tuple(int(n) for n in shape.split('x')), kind) for key, shape, kind in rows]


def meta_model(name, **overrides):
    with torch.device('meta'):
        return models.create_model(name, **overrides)


def perturb(module, seed=0):
    g = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for p in module.parameters():
            p.add_(0.1 * torch.randn(p.shape, generator=g, dtype=p.dtype))
    return module


# ---------------------------------------------------------------------------------------------------
# The authors' blocks, reproduced from their weights

DEFAULTS = models.ATTENTION_OPTIONS  # the released models' attention: identity kernel, Eq. 6


def golden_block(name, cfg):
    """Our module for a golden case, built from its config."""
    dim, heads = cfg['dim'], cfg['heads']
    if name.startswith('swin_attention'):
        return inline.InLineAttention(dim, heads, kernel=cfg['kernel'])
    if name.startswith('swin_block'):
        assert cfg['shift'] in (0, cfg['window'] // 2)
        return models.SwinBlock(dim, heads, cfg['attn'], cfg['window'], cfg['shift'] > 0, cfg['mlp_ratio'], 0., DEFAULTS)
    if name in ('deit_block', 'pvt_block'):
        attn = models.make_attention('I', dim, heads, DEFAULTS, separate_q=name == 'pvt_block',
                                     leading_tokens=int(name == 'deit_block'))  # DeiT's class token
        return models.Block(dim, cfg['mlp_ratio'], 0., cfg['norm_eps'], attn)
    if name.startswith('cswin_block'):
        return models.CSwinBlock(dim, heads, cfg['attn'], cfg['split'], cfg['grid'], cfg['mlp_ratio'], 0., DEFAULTS)
    raise KeyError(name)


GOLDEN_CASES = ['swin_block_inline', 'swin_block_softmax_shifted', 'swin_attention_identity', 'swin_attention_relu',
                'swin_attention_leakyrelu', 'swin_attention_exp', 'deit_block', 'pvt_block', 'cswin_block_inline',
                'cswin_block_softmax_stripes']


@pytest.mark.parametrize('name', GOLDEN_CASES)
def test_golden_block(golden, name):
    torch.manual_seed(0)
    case = golden[name]
    block = golden_block(name, case['config']).double().eval()
    state = {k: v for k, v in case['state_dict'].items() if k.rsplit('.', 1)[-1] not in models.REBUILT_BUFFERS}
    block.load_state_dict(state, strict=True)  # the authors' key names, unmapped
    out = block(*case['inputs'], case['config']['grid'])
    error = (out - case['output']).abs().max().item()
    print(f"{name}: max |ours - authors'| = {error:.1e}")
    assert error < 1e-10


def test_rebuilt_buffers_equal_the_released_ones(golden):
    state = golden['swin_block_softmax_shifted']['state_dict']  # window 4, shift 2, 8x8 map
    assert torch.equal(models.window_mask(8, 8, 4, 4, 2, 2, 'cpu'), state['attn_mask'])
    assert torch.equal(models.relative_position_index(4, 4, 4, 'cpu'), state['attn.relative_position_index'])


# ---------------------------------------------------------------------------------------------------
# Windows that do not tile the map: padded and masked, checked against attention written without
# windows at all (global attention, a token pair allowed iff in the same window of the original frame)

def swin_reference(block, x, grid):
    (h, w), window = grid, block.window
    y, xx = (t.flatten() for t in torch.meshgrid(torch.arange(h), torch.arange(w), indexing='ij'))

    def group(c, L):  # which window a coordinate falls in: windows start at -shift, cut at the border
        size = min(window, L)
        shift = window // 2 if block.shift and size < L else 0
        return torch.div(c - shift, size, rounding_mode='floor')

    allowed = (group(y, h)[:, None] == group(y, h)[None]) & (group(xx, w)[:, None] == group(xx, w)[None])
    index = (y[:, None] - y[None] + window - 1) * (2 * window - 1) + (xx[:, None] - xx[None] + window - 1)
    bias = block.attn.relative_position_bias_table[torch.where(allowed, index, 0)].permute(2, 0, 1)
    B, N, C = x.shape
    q, k, v = block.attn.qkv(block.norm1(x)).view(B, N, 3, block.attn.num_heads, -1).permute(2, 0, 3, 1, 4)
    a = (q @ k.transpose(-2, -1)) * q.shape[-1] ** -0.5 + bias
    a = a.masked_fill(~allowed, float('-inf')).softmax(-1)
    x = x + block.attn.proj((a @ v).transpose(1, 2).reshape(B, N, C))
    return x + block.mlp(block.norm2(x))


@pytest.mark.parametrize('grid,window,shift', [((8, 8), 4, True), ((6, 10), 4, True), ((5, 7), 3, False),
                                               ((3, 9), 4, True), ((7, 5), 3, True)],
                         ids=['8x8-w4-shift', '6x10-w4-shift-pad', '5x7-w3-pad', '3x9-w4-one-axis-covered',
                              '7x5-w3-shift-pad'])
def test_swin_windows_against_global_masked_attention(grid, window, shift):
    torch.manual_seed(0)
    block = perturb(models.SwinBlock(16, 2, 'S', window, shift, 2., 0., DEFAULTS).double())
    x = torch.randn(2, grid[0] * grid[1], 16, dtype=torch.float64)
    torch.testing.assert_close(block(x, grid), swin_reference(block, x, grid), rtol=0, atol=1e-12)


def cswin_reference(block, x, grid):
    h, w = grid
    B, N, C = x.shape
    y, xx = (t.flatten() for t in torch.meshgrid(torch.arange(h), torch.arange(w), indexing='ij'))
    q, k, v = block.qkv(block.norm1(x)).chunk(3, dim=-1)
    outs = []
    for attn, q, k, v in zip(block.attns, q.chunk(2, -1), k.chunk(2, -1), v.chunk(2, -1)):
        stripe = torch.div(xx if attn.axis == 0 else y, attn.stripe, rounding_mode='floor')
        heads = [t.view(B, N, attn.num_heads, -1).transpose(1, 2) for t in (q, k, v)]  # (B, H, N, D)
        a = (heads[0] @ heads[1].transpose(-2, -1)) * heads[0].shape[-1] ** -0.5
        o = a.masked_fill(stripe[:, None] != stripe[None], float('-inf')).softmax(-1) @ heads[2]
        dim = 3 if attn.axis == 0 else 2  # LePE: the depthwise conv, one stripe at a time
        v_map = v.transpose(1, 2).reshape(B, -1, h, w)
        lepe = torch.cat([attn.get_v(part) for part in v_map.split(attn.stripe, dim=dim)], dim=dim)
        outs.append(o.transpose(1, 2).reshape(B, N, -1) + lepe.flatten(2).transpose(1, 2))
    x = x + block.proj(torch.cat(outs, dim=-1))
    return x + block.mlp(block.norm2(x))


@pytest.mark.parametrize('grid,stripe', [((8, 8), 2), ((4, 6), 3), ((5, 7), 2)], ids=['8x8-s2', '4x6-s3-pad', '5x7-s2-pad'])
def test_cswin_stripes_against_global_masked_attention(grid, stripe):
    torch.manual_seed(0)
    block = perturb(models.CSwinBlock(16, 2, 'S', stripe, grid, 2., 0., DEFAULTS).double())
    assert len(block.attns) == 2
    x = torch.randn(2, grid[0] * grid[1], 16, dtype=torch.float64)
    torch.testing.assert_close(block(x, grid), cswin_reference(block, x, grid), rtol=0, atol=1e-12)


# ---------------------------------------------------------------------------------------------------
# The released variants: parameters, MACs, checkpoint layout

@pytest.mark.parametrize('name', list(models.RELEASED))
def test_param_count(name):
    model = meta_model(name)
    assert sum(p.numel() for p in model.parameters()) == models.RELEASED[name][0]


@pytest.mark.parametrize('name', [n if n in TINY else pytest.param(n, marks=SLOW) for n in models.RELEASED])
def test_macs(name):
    """FLOPs / 2 from torch.utils.flop_counter within 0.1% of the authors' count (the issue asks 0.5%;
    we are closer, and a missing or extra matmul anywhere would show). Ours is lower only by the released
    code's q.k_mean product (N*D per head), which the centred form of Eq. 5 does not compute."""
    gmacs = models.count_macs(meta_model(name)) / 1e9
    released = models.RELEASED[name][1]
    print(f"{name}: {gmacs:.3f} GMACs, released {released:.3f}")
    assert abs(gmacs / released - 1) < 0.001


@pytest.mark.parametrize('name', list(models.RELEASED))
def test_keys_match_the_released_checkpoint(name):
    """Our state dict is the authors' parameters, key for key and shape for shape, with no mapping."""
    ours = {k: tuple(v.shape) for k, v in meta_model(name).state_dict().items()}
    assert ours == {k: shape for k, shape, kind in released_keys(name) if kind == 'parameter'}


@pytest.mark.parametrize('name', TINY)
def test_released_format_loads_strictly(name, tmp_path):
    torch.manual_seed(0)
    state = {k: torch.randn(shape) if kind == 'parameter' else torch.zeros(shape)  # buffers: rebuilt, ignored
             for k, shape, kind in released_keys(name)}
    path = tmp_path / 'released.pth'
    torch.save({'model': state, 'epoch': 299}, path)
    for source in (path, state):  # a file, or a state dict already in memory
        model = meta_model(name).to_empty(device='cpu')  # skips the random init, which the load overwrites
        models.load_checkpoint(model, source)
        for k, v in model.state_dict().items():
            assert torch.equal(v, state[k]), k


def test_checkpoint_with_wrong_keys_names_them(tmp_path):
    torch.manual_seed(0)
    state = models.create_model('inline_deit_t', **SMALL['inline_deit_t']).state_dict()
    del state['blocks.0.attn.proj.bias']
    state['blocks.9.attn.qkv.weight'] = torch.zeros(1)
    torch.save({'model': state}, tmp_path / 'wrong.pth')
    with pytest.raises(RuntimeError, match=r"missing \['blocks\.0\.attn\.proj\.bias'\], unexpected \['blocks\.9\.attn\.qkv\.weight'\]"):
        models.create_model('inline_deit_t', checkpoint=tmp_path / 'wrong.pth', **SMALL['inline_deit_t'])


@pytest.mark.parametrize('name', ['inline_deit_t', 'inline_pvt_t', 'inline_swin_t'])
def test_checkpoint_with_other_classes_and_size(name, tmp_path):
    """A different num_classes drops the head with a warning; another image size resizes position
    embeddings and relative position tables (bicubic); the rest loads unchanged."""
    torch.manual_seed(0)
    small = dict(SMALL[name], num_classes=5)
    source = models.create_model(name, **small)
    path = tmp_path / 'project.pth'
    torch.save({'model': source.state_dict(), 'args': {'model': name}, 'epoch': 1}, path)  # train.py's format
    H, W = small['img_size']  # twice the size: the same aspect ratio, so the old grid can be told from its length
    bigger = dict(small, img_size=(2 * H, 2 * W), num_classes=7, **({'softmax_window': 4} if name == 'inline_swin_t' else {}))
    with pytest.warns(UserWarning, match='num_classes=7'):
        model = models.create_model(name, checkpoint=path, **bigger)
    resized = 0
    for k, v in model.state_dict().items():
        if not k.startswith('head.') and v.shape == source.state_dict()[k].shape:
            assert torch.equal(v, source.state_dict()[k]), k
        elif not k.startswith('head.'):
            resized += 1
    assert resized > 0 and model(torch.randn(1, 3, 2 * H, 2 * W)).shape == (1, 7)
    if name == 'inline_deit_t':  # the class token's position embedding is kept, not resampled
        assert torch.equal(model.pos_embed[:, 0], source.pos_embed[:, 0])


# ---------------------------------------------------------------------------------------------------
# Every family at a small size: forward, backward, other input sizes, errors

@pytest.mark.parametrize('name', TINY)
def test_forward_backward_non_square(name):
    torch.manual_seed(0)
    # no stochastic depth: at batch 2 it can drop a branch for both samples, zeroing its gradients
    model = models.create_model(name, num_classes=10, drop_path_rate=0., **SMALL[name])
    x = torch.randn(2, 3, *model.img_size)  # non-square
    out = model(x)
    assert out.shape == (2, 10) and torch.isfinite(out).all()
    out.backward(torch.randn_like(out))
    # DeiT's head reads only the class token, and Eq. 6 never touches it, so nothing of the last
    # block's residual MLP reaches the output: its gradient is zero by construction.
    exempt = 'blocks.1.attn.residual.' if name == 'inline_deit_t' else None
    for n, p in model.named_parameters():
        assert p.grad is not None and torch.isfinite(p.grad).all(), n
        assert (exempt and n.startswith(exempt)) or p.grad.abs().sum() > 0, n


@pytest.mark.parametrize('name', TINY[1:])
def test_hierarchical_stage_maps_and_other_input_size(name):
    torch.manual_seed(0)
    model = models.create_model(name, num_classes=3, **SMALL[name]).eval()
    with torch.no_grad():
        stages = model.forward_features(torch.randn(1, 3, 64, 96), return_stages=True)
        config = SMALL[name]
        dims = config.get('embed_dims') or [config['embed_dim'] * 2 ** i for i in range(4)]
        assert [tuple(s.shape[1:]) for s in stages] == [(dims[0], 16, 24), (dims[1], 8, 12), (dims[2], 4, 6), (dims[3], 2, 3)]
        assert model(torch.randn(1, 3, 128, 64)).shape == (1, 3)  # a size the model was not built for


@pytest.mark.parametrize('name', TINY)
def test_bad_input_size_is_a_clear_error(name):
    torch.manual_seed(0)
    model = models.create_model(name, **SMALL[name])
    stride = 16 if name == 'inline_deit_t' else 32
    with pytest.raises(ValueError, match=f"divisible by {stride}"):
        model(torch.randn(1, 3, 70, 100))
    with pytest.raises(ValueError, match=f"divisible by {stride}"):
        models.create_model(name, img_size=200)
    if name == 'inline_deit_t':
        with pytest.raises(ValueError, match=r"built for 48x80 images got 64x64: .* img_size=\(64, 64\)"):
            model(torch.randn(1, 3, 64, 64))


def test_unknown_name_and_bad_overrides():
    with pytest.raises(ValueError, match=r"unknown model 'inline_vit_t'; choose one of inline_deit_t, .*inline_cswin_b_384"):
        models.create_model('inline_vit_t')
    with pytest.raises(ValueError, match=r"layout 'IIX'"):
        meta_model('inline_swin_t', layout='IIX')
    with pytest.raises(ValueError, match=r"layout 'IIMS'"):
        meta_model('inline_swin_t', layout='IIMS')
    with pytest.raises(ValueError, match=r"layout 'IIMS7'"):  # stage 3 of Swin-T has 6 blocks
        meta_model('inline_swin_t', layout='IIMS7')
    with pytest.raises(ValueError, match="needs a non-negative kernel"):
        meta_model('inline_cswin_t', layout='LISS', kernel='identity')


def test_layouts_and_ablation_switches():
    """'IIMS2' puts two InLine blocks before Swin-B's stage-3 softmax blocks; L is the linear baseline
    (relu kernel); residual='none' removes Eq. 6 everywhere (Table 4)."""
    assert models.parse_layout('IIMS2', [2, 2, 5, 2], 'ILSM')[2] == ['I', 'I', 'S', 'S', 'S']
    swin_b = meta_model('inline_swin_b')
    letters = [block.letter for block in swin_b.layers[2].blocks]
    assert letters == ['I', 'I'] + ['S'] * 16
    baseline = meta_model('inline_swin_t', layout='LLLS', residual='none')
    attns = [m for m in baseline.modules() if isinstance(m, inline.InLineAttention)]
    assert len(attns) == 10 and all(a.attention == 'linear' and a.kernel == 'relu' and a.residual is None for a in attns)
    cswin = meta_model('inline_cswin_t', kernel='relu')
    branches = [m for m in cswin.modules() if isinstance(m, models.StripeAttention) and m.letter == 'I']
    assert len(branches) == 6 and all(b.core is inline.inline_core for b in branches)
    assert meta_model('inline_deit_t', layout='L').blocks[0].attn.attention == 'linear'


def test_model_api():
    torch.manual_seed(0)
    for name in TINY:
        model = models.create_model(name, **SMALL[name])
        assert model.family == name.split('_')[1] and model.img_size == SMALL[name]['img_size']
        model.reset_classifier(4)
        assert model.num_classes == 4 and model(torch.randn(1, 3, *model.img_size)).shape == (1, 4)
        assert model.no_weight_decay() <= {n for n, _ in model.named_parameters()}
    assert meta_model('inline_deit_t').no_weight_decay() == {'pos_embed', 'cls_token'}
    assert len(meta_model('inline_swin_t').no_weight_decay()) == 2  # the two S blocks' bias tables
    assert meta_model('inline_pvt_t').no_weight_decay() == set()  # PVT decays its position embeddings, as released


def test_fast_switch_replaces_every_core():
    torch.manual_seed(0)
    model = models.create_model('inline_cswin_t', fast=True, **dict(SMALL['inline_cswin_t'], layout='IISS'))
    cores = [m.core for m in model.modules() if hasattr(m, 'core')]
    assert len(cores) == 1 + 2 and all(core is kernels.inline_core_fast for core in cores)  # the I blocks of stages 1, 2


# ---------------------------------------------------------------------------------------------------
# Dense prediction: timm's features_only backbones, torchvision's detectors, the Semantic FPN head

DENSE_LAYOUTS = [('inline_pvt_t', {}), ('inline_pvt_t', dict(layout='SSSS', num_heads=(1, 2, 5, 8))),
                 ('inline_pvt_t', dict(layout='LLLL')), ('inline_swin_t', {}), ('inline_swin_t', dict(layout='SSSS')),
                 ('inline_swin_t', dict(layout='LLLS')), ('inline_swin_b', {}), ('inline_cswin_t', {}),
                 ('inline_cswin_t', dict(layout='SSSS', depths=(1, 2, 21, 1)))]


@pytest.mark.parametrize('name,overrides', DENSE_LAYOUTS,
                         ids=[f"{n}-{o.get('layout', 'released')}" for n, o in DENSE_LAYOUTS])
def test_features_only_at_coco_size_every_family_and_layout(name, overrides):
    """On the meta device: 800x1333 (padded to 800x1344) gives the four maps at strides 4-32 with the
    channels feature_info states, a LayerNorm on each where the family's own dense backbone has one."""
    with torch.device('meta'):
        model = models.create_model(name, features_only=True, **overrides)
        maps = model(torch.zeros(1, 3, 800, 1333))
        subset = models.create_model(name, features_only=True, out_indices=(1, 2, 3), **overrides)
    channels = model.feature_info.channels()
    assert model.feature_info.reduction() == [4, 8, 16, 32] and subset.feature_info.channels() == channels[1:]
    assert [tuple(m.shape) for m in maps] == [(1, c, 800 // r, 1344 // r) for c, r in zip(channels, (4, 8, 16, 32))]
    norm = nn.Identity if name.startswith('inline_pvt') else nn.LayerNorm
    assert all(type(n) is norm for n in model.norms)
    assert not any(k.startswith('model.head.') or k.startswith('model.norm.') for k in model.state_dict())


def test_features_only_refuses_deit_and_bad_out_indices():
    with pytest.raises(ValueError, match='isotropic .* pvt, swin, cswin'):
        meta_model('inline_deit_t', features_only=True)
    with pytest.raises(ValueError, match='out_indices'):
        meta_model('inline_pvt_t', features_only=True, out_indices=(2, 1))


@pytest.mark.parametrize('name', TINY[1:])
def test_features_only_at_another_size_equals_a_model_built_for_it(name):
    """Built at one size and fed another (96x64), a backbone gives the maps of the same weights built for
    that size: PVT's position embeddings resized bilinearly, as its forward resizes them."""
    torch.manual_seed(0)
    built = models.create_model(name, features_only=True, drop_path_rate=0., **SMALL[name]).eval()
    sized = models.create_model(name, features_only=True, drop_path_rate=0., **{**SMALL[name], 'img_size': (96, 64)})
    state = built.state_dict()
    for i, key in enumerate(k for k in state if re.fullmatch(r'model\.pos_embed\d', k)):
        state[key] = models.resize_grid(state[key], built.model.grids[i], sized.model.grids[i], 'bilinear')
    sized.load_state_dict(state)
    x = torch.randn(2, 3, 96, 64)
    with torch.no_grad():
        for a, b in zip(built(x), sized.eval()(x)):
            torch.testing.assert_close(a, b, rtol=0, atol=0)


def test_features_only_loads_a_checkpoint_and_drops_the_head(tmp_path):
    torch.manual_seed(0)
    full = models.create_model('inline_pvt_t', **SMALL['inline_pvt_t']).eval()
    torch.save({'model': full.state_dict()}, tmp_path / 'pvt.pth')
    backbone = models.create_model('inline_pvt_t', features_only=True, checkpoint=str(tmp_path / 'pvt.pth'),
                                   **SMALL['inline_pvt_t']).eval()
    assert not any('head' in k for k in backbone.state_dict())
    x = torch.randn(1, 3, 64, 96)
    with torch.no_grad():
        for a, b in zip(backbone(x), full.forward_features(x, return_stages=True)):
            torch.testing.assert_close(a, b, rtol=0, atol=0)  # PVT's detection backbone has no output norms


def readme_block(heading):
    """The first ```python block under a README heading."""
    with open(os.path.join(os.path.dirname(os.path.abspath(__file__)), 'README.md')) as f:
        section = f.read().split(f'\n{heading}\n', 1)[1]
    return section.split('```python\n', 1)[1].split('\n```', 1)[0]


def test_readme_detection_example_trains_mask_rcnn_with_inline_swin_t(monkeypatch, capsys):
    """The README's example, run as written: Mask R-CNN with the real InLine-Swin-T takes a training step on
    two images of different sizes (finite losses, gradients in the backbone's attention), predicts on an
    image file, and the Semantic FPN example gives logits at the image's size."""
    torch.manual_seed(0)
    monkeypatch.chdir(os.path.dirname(os.path.abspath(__file__)))
    scope = {}
    exec(readme_block('## Detection and segmentation'), scope)
    losses, model = scope['losses'], scope['model']
    assert set(losses) == {'loss_classifier', 'loss_box_reg', 'loss_mask', 'loss_objectness', 'loss_rpn_box_reg'}
    assert all(torch.isfinite(v) for v in losses.values())
    attention = [p for n, p in model.backbone.named_parameters() if '.attn.' in n]
    assert attention and all(p.grad is not None for p in attention)
    # Every InLine stage's attention learns: its qkv and Eq. 6's residual MLP. (Drop path, on as in training,
    # can skip all of a stage's attention for both images: stage 4's two softmax blocks, with this seed.)
    for stage in scope['backbone'].model.layers[:3]:
        assert sum(b.attn.qkv.weight.grad.abs().sum() for b in stage.blocks) > 0
        assert sum(p.grad.abs().sum() for b in stage.blocks for p in b.attn.residual.parameters()) > 0
    image = scope['image']  # masks come back in the image file's own pixels
    assert scope['prediction']['masks'].shape[1:] == (1, *image.shape[1:]) and 'boxes' in scope['prediction']
    assert scope['logits'].shape == (2, 150, 96, 128) and torch.isfinite(scope['loss'])
    model.roi_heads.score_thresh = 0.0  # untrained scores are near 1/91: keep every box to see boxes and masks
    model.roi_heads.detections_per_img = 5  # of 100: the mask head's cost is per box
    with torch.no_grad():
        out = model(scope['images'])
    for o, image in zip(out, scope['images']):
        assert len(o['boxes']) > 0 and o['masks'].shape == (len(o['boxes']), 1, *image.shape[1:])


def test_semantic_fpn_trains_with_inline_pvt_t():
    """Semantic FPN on the real InLine-PVT-T: a training step (finite loss, gradients in the attention of every
    stage), then eval logits at the input's size for two sizes, one not a multiple of 32."""
    torch.manual_seed(0)
    model = models.SemanticFPN(models.create_model('inline_pvt_t', features_only=True), num_classes=5)
    x, y = torch.rand(2, 3, 64, 96), torch.randint(0, 5, (2, 64, 96))
    loss = F.cross_entropy(model(x), y)
    loss.backward()
    assert torch.isfinite(loss)
    for i in range(1, 5):
        attn = getattr(model.backbone.model, f'block{i}')[0].attn
        assert attn.q.weight.grad.abs().sum() > 0 and attn.kv.weight.grad.abs().sum() > 0
    model.eval()
    with torch.no_grad():
        assert model(torch.rand(1, 3, 70, 100)).shape == (1, 5, 70, 100)
        assert model(torch.rand(2, 3, 32, 64)).shape == (2, 5, 32, 64)


def test_faster_rcnn_and_retinanet_take_the_adapter():
    """FasterRCNN with the default adapter (four levels and 'pool'); RetinaNet as torchvision builds it, stages
    2-4 and P6, P7: five levels for its five anchor sizes. A training step and a prediction each."""
    from torchvision.models.detection import FasterRCNN, RetinaNet
    from torchvision.ops.feature_pyramid_network import LastLevelP6P7
    torch.manual_seed(0)
    small = dict(SMALL['inline_pvt_t'], layout='IIII')
    images = [torch.rand(3, 64, 96), torch.rand(3, 80, 64)]
    targets = [dict(boxes=torch.tensor([[8., 8., 40., 50.]]), labels=torch.tensor([1]))] * 2
    retina_backbone = models.create_model('inline_pvt_t', features_only=True, out_indices=(1, 2, 3), **small)
    size = dict(min_size=64, max_size=96)  # small images and few boxes: seconds on a CPU
    faster = FasterRCNN(models.BackboneWithFPN(models.create_model('inline_pvt_t', features_only=True, **small),
                                               out_channels=32), num_classes=3, rpn_post_nms_top_n_train=50,
                        rpn_post_nms_top_n_test=50, box_batch_size_per_image=32, box_detections_per_img=10, **size)
    retina = RetinaNet(models.BackboneWithFPN(retina_backbone, out_channels=32, extra_blocks=LastLevelP6P7(32, 32)),
                       num_classes=3, topk_candidates=50, detections_per_img=10, **size)
    for model in (faster, retina):
        losses = model(images, targets)
        assert all(torch.isfinite(v) for v in losses.values())
        sum(losses.values()).backward()
        assert model.backbone.body.model.block1[0].attn.q.weight.grad.abs().sum() > 0  # stage 1 feeds stage 2
        with torch.no_grad():
            assert all('boxes' in o for o in model.eval()(images))


# ---------------------------------------------------------------------------------------------------
# The paper's experiments (README, "The paper's experiments"): each switch against an explicit construction

def test_shifted_inline_windows_equal_an_explicit_loop():
    """Table 4's windows, as the authors' code has them: odd blocks roll by window/2 with no mask, so tokens
    wrapped across the border share a window; each window is its own InLine attention with its own means and
    Eq. 6 weights."""
    torch.manual_seed(0)
    B, (h, w), C, window, shift = 2, (8, 8), 16, 4, 2
    block = perturb(models.SwinBlock(C, 2, 'I', window, True, 2., 0., DEFAULTS).double())
    attn = block.attn
    x = torch.randn(B, h * w, C, dtype=torch.float64)
    rolled = torch.roll(block.norm1(x).view(B, h, w, C), (-shift, -shift), dims=(1, 2))
    expected = torch.zeros_like(rolled)
    for i in range(0, h, window):
        for j in range(0, w, window):
            y = rolled[:, i:i + window, j:j + window].reshape(B, window * window, C)  # one window, row-major
            q, k, v = (t.view(B, -1, 2, C // 2).transpose(1, 2) for t in attn.qkv(y).chunk(3, dim=-1))
            r = inline.residual_weights(attn.residual, y)  # this window's own Eq. 6 weights
            o = inline.inline_core(q, k, v, r, (window, window)).transpose(1, 2).reshape(B, -1, C)
            expected[:, i:i + window, j:j + window] = attn.proj(o).view(B, window, window, C)
    expected = x + torch.roll(expected, (shift, shift), dims=(1, 2)).reshape(B, h * w, C)
    expected = expected + block.mlp(block.norm2(expected))
    torch.testing.assert_close(block(x, (h, w)), expected, rtol=0, atol=1e-12)
    # wrapped: token (0, 0) and token (7, 7) share a window in the shifted block, not in the unshifted one
    x2 = x.clone()
    x2[:, 7 * w + 7] += torch.randn(C, dtype=torch.float64)  # not a constant, which the LayerNorm would remove
    assert (block(x2, (h, w)) - block(x, (h, w)))[:, 0].abs().max() > 1e-6
    block.shift = False
    assert (block(x2, (h, w)) - block(x, (h, w)))[:, 0].abs().max() == 0


def test_nonneg_inline_weights_are_non_negative_and_rows_sum_to_one():
    torch.manual_seed(0)
    attn = perturb(inline.InLineAttention(32, 2, nonneg=True, leading_tokens=1).double())
    x = 5 * torch.randn(3, 1 + 36, 32, dtype=torch.float64)  # large inputs: plain InLine goes negative here
    w = attn.weights(x, (6, 6))
    assert w.shape == (3, 2, 37, 37) and w.min() >= 0
    torch.testing.assert_close(w.sum(-1), torch.ones(3, 2, 37, dtype=torch.float64), rtol=0, atol=1e-12)
    plain = perturb(inline.InLineAttention(32, 2, leading_tokens=1).double())
    assert plain.weights(x, (6, 6)).min() < 0  # without the switch the same inputs give negative weights


def test_normalised_q_in_swin_gives_q_and_2q_the_same_weights():
    """T1 in Swin: with normalise_q='S' (windowed softmax) or 'I' (InLine), doubling q in those blocks leaves the
    logits as they were; without it they change. The fast core follows InLine's option (enable_fast checks it)."""
    torch.manual_seed(0)
    x = torch.randn(2, 3, 64, 64)
    for letters, layout, kind in (('S', 'SSSS', models.WindowAttention), ('I', 'IIIS', inline.InLineBase),
                                  ('', 'IIIS', inline.InLineBase)):
        model = models.create_model('inline_swin_t', img_size=64, embed_dim=16, depths=(1, 1, 1, 1),
                                    num_heads=(2, 2, 2, 2), softmax_window=4, layout=layout, num_classes=3,
                                    normalise_q=letters).eval()
        if kind is inline.InLineBase:
            assert kernels.enable_fast(model, log=None) == 3
        attns = [m for m in model.modules() if isinstance(m, kind)]
        assert len(attns) == len(layout.replace('S' if kind is inline.InLineBase else 'I', ''))
        assert all((m.normalise_q is not None) == bool(letters) for m in attns)
        with torch.no_grad():
            before = model(x)
            for m in attns:  # q is the first third of qkv's outputs
                m.qkv.weight[:m.qkv.out_features // 3] *= 2
                m.qkv.bias[:m.qkv.out_features // 3] *= 2
            after = model(x)
        assert torch.allclose(before, after, rtol=0, atol=1e-5) == bool(letters), letters


def test_normalised_q_softmax_is_not_injective():
    """T1: softmax over L2-normalised queries gives q and 2q identical weights; plain softmax does not."""
    torch.manual_seed(0)
    x = torch.randn(2, 10, 24, dtype=torch.float64)
    for normalise_q, same in ((True, True), (False, False)):
        attn = models.SoftmaxAttention(24, 3, normalise_q=normalise_q, leading_tokens=1).double()
        nn.init.zeros_(attn.qkv.bias)
        w, w2 = attn.weights(x, (3, 3)), None
        with torch.no_grad():
            attn.qkv.weight[:24] *= 2  # q -> 2q, k and v unchanged
        w2 = attn.weights(x, (3, 3))
        assert torch.allclose(w, w2, rtol=0, atol=1e-12) == same
        # the forward applies the same weights
        q, k, v = attn.project(x, (3, 3))
        o = (w2 @ v).transpose(1, 2).reshape(2, 10, 24)
        torch.testing.assert_close(attn(x, (3, 3)), attn.proj(o), rtol=0, atol=1e-12)


def test_relu_affine_starts_as_relu_and_trains():
    torch.manual_seed(0)
    attn = inline.InLineAttention(16, 2, kernel='relu_affine')
    x = torch.randn(2, 9, 16)
    q = torch.randn(2, 2, 9, 8)
    torch.testing.assert_close(attn.phi(q), torch.relu(q), rtol=0, atol=0)
    optimizer = torch.optim.SGD(attn.parameters(), lr=0.1)
    out = attn(x, (3, 3))
    out.backward(torch.randn_like(out))
    assert attn.phi.weight.grad.abs().sum() > 0 and attn.phi.bias.grad.abs().sum() > 0
    optimizer.step()
    assert not torch.equal(attn.phi.weight, torch.eye(8)) and attn.phi.bias.abs().sum() > 0
    assert models.InLineDeiT(img_size=32, embed_dim=16, depth=1, num_heads=2, kernel='relu_affine').no_weight_decay() \
        == {'pos_embed', 'cls_token', 'blocks.0.attn.phi.weight'}  # A starts at the identity: not decayed to zero


def test_ape_per_stage_and_window_reaches_qkv_not_the_shortcut():
    swin = meta_model('inline_swin_t', window=7, residual='none')
    for i, layer in enumerate(swin.layers):
        for block in layer.blocks:
            if block.letter == 'I':
                assert block.attn.ape.shape == (1, 49, 96 * 2 ** i)  # 7x7 windows in every stage
    assert meta_model('inline_swin_t', residual='none').layers[0].blocks[0].attn.ape.shape == (1, 56 * 56, 96)
    assert meta_model('inline_swin_t').layers[0].blocks[0].attn.ape is None  # the released models: none
    assert meta_model('inline_swin_t', ape=False, residual='none').layers[0].blocks[0].attn.ape is None
    torch.manual_seed(0)
    block = perturb(models.SwinBlock(16, 2, 'I', None, False, 2., 0., dict(DEFAULTS, residual='none'),
                                     ape_tokens=16).double())
    x = torch.randn(2, 16, 16, dtype=torch.float64)
    seen = []
    block.attn.qkv.register_forward_pre_hook(lambda m, args: seen.append(args[0]))
    out = block(x, (4, 4))
    torch.testing.assert_close(seen[0], block.norm1(x) + block.attn.ape)  # the APE reaches q, k and v
    with torch.no_grad():
        block.attn.proj.weight.zero_(), block.attn.proj.bias.zero_()  # the attention branch now adds nothing
        block.attn.ape.add_(1.0)
    without_attention = block(x, (4, 4))
    with torch.no_grad():
        block.attn.ape.zero_()
    torch.testing.assert_close(block(x, (4, 4)), without_attention, rtol=0, atol=0)  # the shortcut never sees it
    assert not torch.allclose(out, without_attention)


def test_softmax_originals_have_the_known_sizes():
    """Layout all-S gives each backbone's softmax original: Swin-T 28,288,354 parameters (timm's); the DeiT
    skeleton with softmax is InLine-DeiT without its residual MLPs; PVT S adds the spatial reductions."""
    count = lambda m: sum(p.numel() for p in m.parameters())  # noqa: E731
    assert count(meta_model('inline_swin_t', layout='SSSS')) == 28_288_354
    deit = meta_model('inline_deit_t')
    residual = sum(p.numel() for n, p in deit.named_parameters() if '.residual.' in n)
    assert count(meta_model('inline_deit_t', layout='S')) == count(deit) - residual
    assert count(meta_model('inline_deit_t', **models.EXPERIMENTS['s_deit_t'].overrides)) == 5_717_416  # DeiT-T's
    pvt = meta_model('inline_pvt_t', layout='SSSS', num_heads=(1, 2, 5, 8))
    sr = [b.attn.sr.kernel_size[0] for i in range(1, 4) for b in getattr(pvt, f'block{i}')]
    assert sr == [8, 8, 4, 4, 2, 2] and not hasattr(pvt.block4[0].attn, 'sr')


def tiny_experiment(name, **extra):
    """An experiment at its real 224 px (so its windows tile as in the paper) but a few channels wide."""
    e = models.EXPERIMENTS[name]
    family = e.model.split('_')[1]
    small = {'deit': dict(embed_dim=24, depth=2), 'pvt': dict(embed_dims=(8, 16, 40, 64), depths=(1, 1, 1, 1)),
             'swin': dict(embed_dim=8, depths=(2, 2, 2, 2), num_heads=(1, 2, 4, 8)),
             'cswin': dict(embed_dim=8, depths=(1, 2, 2, 1))}[family]
    return models.create_experiment(name, num_classes=3, **small, **extra)


@pytest.mark.parametrize('name', list(models.EXPERIMENTS))
def test_every_experiment_builds_and_trains(name):
    torch.manual_seed(0)
    model = tiny_experiment(name)
    x = torch.randn(1, 3, *model.img_size)
    out = model(x)
    assert out.shape == (1, 3) and torch.isfinite(out).all()
    out.backward(torch.randn_like(out))
    assert all(p.grad is not None for p in model.parameters())
    assert models.describe(model).startswith(model.family)


def test_experiment_registry_matches_the_spec():
    e = models.EXPERIMENTS
    assert e['t4_window7_no_residual'].overrides == dict(window=7, residual='none') and e['t4_window7_no_residual'].reported == '80.3'
    assert e['t3_linear_relu_affine'].ours and e['t3_linear_relu_affine'].reported == '70.2'
    assert e['r_dilation3'].reported == '80.8' and e['r_nonneg'].reported == '81.7'
    assert e['t1_softmax_normalised_q'].reported == '70.6 / 69.9' and e['s_swin_t'].reported == '81.3'
    model = meta_model('inline_swin_t', **e['t4_window7_no_residual'].overrides)
    assert model.ape and model.window == 7 and model.layers[0].blocks[1].shift
    assert 'InLine windows 7 (shifted on odd blocks' in models.describe(model)
    assert models.create_model('inline_deit_t', img_size=32, embed_dim=16, depth=1, num_heads=2,
                               layout='S').arch == dict(img_size=32, embed_dim=16, depth=1, num_heads=2, layout='S')


def test_experiment_switches_reject_bad_input():
    with pytest.raises(ValueError, match=r"unknown experiment 't9_nothing'; choose one of t3_linear_relu, "):
        models.create_experiment('t9_nothing')
    with pytest.raises(ValueError, match=r"InLine window 5 does not tile stage 1 \(56x56 tokens at 224x224 px\); "
                                         r"windows that tile it: \[1, 2, 4, 7, 8, 14, 28, 56\]"):
        meta_model('inline_swin_t', window=5)
    with pytest.raises(ValueError, match=r"dilation must be a whole number >= 1"):
        meta_model('inline_swin_t', dilation=0)
    with pytest.raises(ValueError, match=r"dilation must be .* > 1 only where Eq. 6 has neighbours"):
        meta_model('inline_swin_t', dilation=2, residual='plain')
    with pytest.raises(ValueError, match=r"dilation must be .* > 1 only where Eq. 6 has neighbours"):
        meta_model('inline_swin_t', dilation=2, local_size=1)
    for size in (4, 0, -1, 3.0):
        with pytest.raises(ValueError, match=rf"local_size .* must be an odd whole number >= 1.* got {size}"):
            meta_model('inline_swin_t', local_size=size)
    with pytest.raises(ValueError, match=r"layout 'M': need 1 letters from I L S"):
        meta_model('inline_deit_t', layout='M')
    with pytest.raises(ValueError, match=r"layout 'IIMI2': need 4 letters from I L S"):
        meta_model('inline_pvt_t', layout='IIMI2')
    with pytest.raises(ValueError, match=r"needs a non-negative kernel .* got 'leakyrelu'; pass allow_divergent=True"):
        meta_model('inline_swin_t', layout='LLLS', kernel='leakyrelu')
    assert meta_model('inline_swin_t', layout='LLLS', kernel='relu_affine')  # T3's 70.2 row: allowed
    with pytest.raises(ValueError, match=r"unknown residual 'global'; choose one of \['local', 'plain', 'none'\]"):
        meta_model('inline_swin_t', residual='global')
    with pytest.raises(ValueError, match=r"window and ape are InLine-Swin's options"):
        meta_model('inline_deit_t', window=7)
    with pytest.raises(ValueError, match=r"normalise_q takes the letters .* of \['I'\] in this layout .* got 'S'"):
        meta_model('inline_deit_t', normalise_q='S')  # layout I: no softmax block to normalise
    with pytest.raises(ValueError, match=r"of \['I'\] in this layout .*nor CSwin's stripe softmax\), got 'IS'"):
        meta_model('inline_cswin_t', normalise_q='IS')
    with pytest.raises(ValueError, match=r"not 'L': division cancels q's length already\), got 'L'"):
        meta_model('inline_swin_t', layout='LLLS', normalise_q='L')
    with pytest.raises(ValueError, match=r"got True"):
        meta_model('inline_swin_t', normalise_q=True)
    with pytest.raises(ValueError, match=r"unknown argument\(s\) \['depht'\]"):
        meta_model('inline_deit_t', depht=3)


def test_fast_path_refuses_what_it_does_not_cover_when_the_model_is_built():
    """Vanilla linear attention has no fast core: create_model(fast=True) refuses it, naming the option, before
    any forward; every InLine option builds fast."""
    with pytest.raises(ValueError, match=r"the fast InLine core has no attention='linear' \(layout letter L"):
        meta_model('inline_swin_t', layout='LISS', fast=True)
    with pytest.raises(ValueError, match=r"attention='linear'"):
        meta_model('inline_cswin_t', layout='LISS', fast=True)
    with warnings.catch_warnings():
        warnings.simplefilter('error')
        model = meta_model('inline_swin_t', window=7, residual='plain', nonneg=True, kernel='relu_affine', fast=True)
        assert all(m.core is kernels.inline_core_fast for m in model.modules() if hasattr(m, 'core'))
        meta_model('inline_swin_t', local_size=7, dilation=2, fast=True)


# ===================================================================================================
# kernels.py: the fast path against the reference, outputs and every gradient, with a random upstream
# gradient. fp32: fixed tolerances relative to each tensor's scale. bf16: the fast path's error against
# the fp32 reference is at most twice the reference's own bf16 error, plus one bf16 rounding of the
# tensor's scale. B, H and N are symbolic in the compiled graphs, so each dtype and head dim compiles
# once per direction.

CUDA = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")

# (B, H, P, grid, D): P leading tokens off the grid, N = P + h*w. The shapes the backbones produce.
SHAPES = [
    (2, 3, 0, (7, 7), 32),  # a Swin window, N = 49
    (2, 3, 1, (14, 14), 32),  # DeiT at 224 px: a class token and 14 x 14 patches, N = 197
    (2, 3, 0, (56, 56), 32),  # stage 1 of Swin and PVT at 224 px, N = 3136
    (2, 2, 0, (6, 10), 64),  # a non-square grid
    (3, 2, 1, (5, 9), 64),  # odd sizes everywhere: B, h, w, N = 46
]
FP32_TOLERANCE = 2e-5  # of the tensor's largest entry; fp32 reductions over 3136 tokens, in another order
BF16_ROUNDING = 2 ** -8  # half a bf16 ulp at 1, times the tensor's largest entry


def shape_id(B, H, P, grid, D):
    return f"B{B}-H{H}-N{P + grid[0] * grid[1]}-D{D}"


def core_inputs(B, H, P, grid, D, device='cpu', seed=0):
    """q, k, v (B, H, N, D) with non-zero token means (what centring is for), r (B, 9C), upstream do."""
    g = torch.Generator(device).manual_seed(seed)
    N = P + grid[0] * grid[1]
    q, k, v, do = (torch.randn(B, H, N, D, generator=g, device=device, dtype=torch.float64) for _ in range(4))
    k = k + torch.randn(B, H, 1, D, generator=g, device=device, dtype=torch.float64)  # a mean per channel
    v = v + 0.5
    r = 0.3 * torch.randn(B, 9 * H * D, generator=g, device=device, dtype=torch.float64)
    return q, k, v, r, do


def run_core(core, q, k, v, r, do, grid, dtype):
    """[o, dq, dk, dv, dr] of core on the inputs cast to dtype, as float64."""
    leaves = [t.to(dtype).requires_grad_() if t is not None else None for t in (q, k, v, r)]
    o = core(*leaves, grid)
    grads = torch.autograd.grad(o, [t for t in leaves if t is not None], do.to(dtype))
    return [t.double() for t in (o, *grads)]


NAMES = ['o', 'dq', 'dk', 'dv', 'dr']


def assert_fp32_close(fast, reference, tolerance=FP32_TOLERANCE):
    for name, a, b in zip(NAMES, fast, reference):
        error, scale = (a - b).abs().max().item(), b.abs().max().item()
        assert error <= tolerance * scale, f"{name}: max error {error:.2e} > {tolerance} * {scale:.2e}"


@pytest.mark.parametrize('shape', SHAPES, ids=[shape_id(*s) + '-fp32' for s in SHAPES])
def test_fast_core_equals_reference_fp32(shape):
    torch.manual_seed(0)
    B, H, P, grid, D = shape
    q, k, v, r, do = core_inputs(*shape)
    fast = run_core(kernels.inline_core_fast, q, k, v, r, do, grid, torch.float32)
    reference = run_core(inline.inline_core, q, k, v, r, do, grid, torch.float32)
    assert fast[0].shape == (B, H, P + grid[0] * grid[1], D)
    assert_fp32_close(fast, reference)


@pytest.mark.parametrize('shape', SHAPES, ids=[shape_id(*s) + '-bf16' for s in SHAPES])
def test_fast_core_bf16_error_within_twice_the_references(shape):
    torch.manual_seed(0)
    grid = shape[3]
    q, k, v, r, do = core_inputs(*shape)
    assert_bf16_within_twice_the_references(kernels.inline_core_fast, inline.inline_core, q, k, v, r, do, grid)


def assert_bf16_within_twice_the_references(fast_core, reference_core, q, k, v, r, do, grid):
    """The fast core's bf16 error against the fp32 reference is at most twice the reference's own in bf16,
    plus one bf16 rounding of the tensor's scale."""
    truth = run_core(reference_core, q, k, v, r, do, grid, torch.float32)
    fast = run_core(fast_core, q, k, v, r, do, grid, torch.bfloat16)
    reference = run_core(reference_core, q, k, v, r, do, grid, torch.bfloat16)
    for name, f, ref, t in zip(NAMES, fast, reference, truth):
        fast_error, reference_error = (f - t).abs().max().item(), (ref - t).abs().max().item()
        noise = BF16_ROUNDING * t.abs().max().item()
        print(f"{name}: bf16 error, fast {fast_error:.3e}, reference {reference_error:.3e}, noise {noise:.1e}")
        assert fast_error <= 2 * reference_error + noise, name


# Every InLine option the fast core covers: the plain residual (one neighbour, T = 1), a dilated 3x3 and a 5x5
# neighbourhood, and R-nonneg's normalised q, k with s = 1/2 (relu_affine and the APE act before the core)
FAST_OPTIONS = {'plain-residual': dict(size=1), 'dilation3': dict(dilation=3), 'local5': dict(size=5),
                'nonneg': dict(scale=0.5)}


@pytest.mark.parametrize('dtype', ['fp32', 'bf16'])
@pytest.mark.parametrize('option', list(FAST_OPTIONS))
def test_fast_core_covers_every_inline_option(option, dtype):
    torch.manual_seed(0)
    B, H, P, grid, D = 2, 3, 1, (6, 7), 32
    q, k, v, r, do = core_inputs(B, H, P, grid, D)
    size = FAST_OPTIONS[option].get('size', 3)
    r = 0.3 * torch.randn(B, size * size * H * D, generator=torch.Generator().manual_seed(1), dtype=torch.float64)
    if option == 'nonneg':
        q, k = F.normalize(q, dim=-1), F.normalize(k, dim=-1)
    fast, reference = (functools.partial(core, **FAST_OPTIONS[option]) for core in (kernels.inline_core_fast,
                                                                                   inline.inline_core))
    if dtype == 'fp32':
        assert_fp32_close(run_core(fast, q, k, v, r, do, grid, torch.float32),
                          run_core(reference, q, k, v, r, do, grid, torch.float32))
    else:
        assert_bf16_within_twice_the_references(fast, reference, q, k, v, r, do, grid)


def test_fast_core_compiles_once_for_every_batch_head_count_and_grid():
    """B, H and N are symbols in the compiled graphs: after one call, other batch sizes, head counts and
    grids (with a class token, too) run the same two graphs; under this stance a recompile raises."""
    q, k, v, r, do = core_inputs(2, 3, 0, (7, 7), 32)
    run_core(kernels.inline_core_fast, q, k, v, r, do, (7, 7), torch.float32)
    with torch.compiler.set_stance('fail_on_recompile'):
        for B, H, P, grid, D in [(3, 2, 1, (5, 9), 32), (4, 5, 0, (14, 10), 32)]:
            q, k, v, r, do = core_inputs(B, H, P, grid, D)
            fast = run_core(kernels.inline_core_fast, q, k, v, r, do, grid, torch.float32)
            assert_fp32_close(fast, run_core(inline.inline_core, q, k, v, r, do, grid, torch.float32))


def test_fast_core_fp16_sums_over_tokens_stay_in_range():
    """fp16 tops out at 65504. Here N Cov (3136 tokens, Cov ~ 64) and q^T dO pass it although Eq. 5
    only needs their means: the reference's output overflows, the fast path's sums over tokens are
    pre-scaled (kernels.sum_scale) and every result stays within a few fp16 roundings of fp32."""
    torch.manual_seed(0)
    q, k, v, r, do = core_inputs(1, 2, 0, (56, 56), 32)
    k, q = 4 * k, 4 * q
    v, do = 4 * (k - k.mean(2, keepdim=True)) + v, 2 * q + do  # correlated, so the sums grow like N
    truth = run_core(inline.inline_core, q, k, v, r, do, (56, 56), torch.float32)
    assert not run_core(inline.inline_core, q, k, v, r, do, (56, 56), torch.float16)[0].isfinite().all()
    fast = run_core(kernels.inline_core_fast, q, k, v, r, do, (56, 56), torch.float16)
    for name, f, t in zip(NAMES, fast, truth):
        error, scale = (f - t).abs().max().item(), t.abs().max().item()
        assert error <= 8 * 2 ** -11 * scale, f"{name}: fp16 error {error:.2e} of scale {scale:.2e}"


def test_fast_core_without_local_residual():
    torch.manual_seed(0)
    q, k, v, _, do = core_inputs(2, 3, 1, (6, 5), 32)
    fast = run_core(kernels.inline_core_fast, q, k, v, None, do, (6, 5), torch.float32)
    assert_fp32_close(fast, run_core(inline.inline_core, q, k, v, None, do, (6, 5), torch.float32))


def test_fast_core_accepts_the_strided_views_models_pass():
    """A model's q, k, v are views into one qkv projection; its upstream gradient is a transposed view."""
    torch.manual_seed(0)
    B, N, H, D, grid = 2, 49, 3, 32, (7, 7)
    qkv = torch.randn(B, N, 3 * H * D)
    q, k, v = (t.reshape(B, N, H, D).transpose(1, 2) for t in qkv.chunk(3, dim=-1))  # (B, H, N, D)
    r, do = 0.3 * torch.randn(B, 9 * H * D), torch.randn(B, N, H, D).transpose(1, 2)
    assert_fp32_close(run_core(kernels.inline_core_fast, q, k, v, r, do, grid, torch.float32),
                      run_core(inline.inline_core, q, k, v, r, do, grid, torch.float32))


def test_fast_core_trains_after_an_inference_mode_pass():
    """The border masks are cached per shape; one built under inference_mode must still be saveable."""
    torch.manual_seed(0)
    q, k, v, r, do = core_inputs(2, 3, 0, (4, 7), 32)
    with torch.inference_mode():
        kernels.inline_core_fast(q.float(), k.float(), v.float(), r.float(), (4, 7))
    assert_fp32_close(run_core(kernels.inline_core_fast, q, k, v, r, do, (4, 7), torch.float32),
                      run_core(inline.inline_core, q, k, v, r, do, (4, 7), torch.float32))


def test_fast_core_follows_autocast():
    """Under autocast the core computes in the autocast dtype, as the reference's matmuls do. (With
    fp32 inputs the reference's output is fp32, promoted by its fp32 means; in a model q, k, v come out
    of an autocast Linear in bf16, and both return bf16.)"""
    torch.manual_seed(0)
    q, k, v, r, do = core_inputs(2, 3, 0, (7, 7), 32)
    with torch.autocast('cpu', dtype=torch.bfloat16):
        fast, reference = (run_core(core, q, k, v, r, do, (7, 7), torch.float32)
                           for core in (kernels.inline_core_fast, inline.inline_core))
        assert kernels.inline_core_fast(q.float(), k.float(), v.float(), r.float(), (7, 7)).dtype == torch.bfloat16
    truth = run_core(inline.inline_core, q, k, v, r, do, (7, 7), torch.float32)
    for name, f, ref, t in zip(NAMES, fast, reference, truth):
        fast_error, reference_error = (f - t).abs().max().item(), (ref - t).abs().max().item()
        print(f"{name}: autocast error, fast {fast_error:.3e}, reference {reference_error:.3e}")
        assert fast_error <= 2 * reference_error + BF16_ROUNDING * t.abs().max().item(), name


def test_fast_core_rejects_what_the_reference_rejects():
    q = k = v = torch.randn(2, 3, 49, 32)
    with pytest.raises(ValueError, match="token grid"):
        kernels.inline_core_fast(q, k, v, torch.randn(2, 9 * 96), (8, 8))
    for size in (3, 1):
        with pytest.raises(ValueError, match=rf"r must hold {size}x{size} neighbour weights per channel"):
            kernels.inline_core_fast(q, k, v, torch.randn(2, 5 * 96), (7, 7), size=size)
        with pytest.raises(ValueError, match=rf"r must hold {size}x{size} neighbour weights per channel"):
            inline.inline_core(q, k, v, torch.randn(2, 5 * 96), (7, 7), size=size)


def test_no_silent_fallback_when_compilation_fails(monkeypatch):
    """If the compiler cannot run, the closed form runs eagerly after one loud warning, still exact."""
    torch.manual_seed(0)

    class CompilerMissing(torch._dynamo.exc.BackendCompilerFailed):  # what inductor raises without g++
        def __init__(self):
            RuntimeError.__init__(self, "InvalidCxxCompiler: No working C++ compiler found")

    def broken(*args):
        raise CompilerMissing()

    monkeypatch.setattr(kernels, 'COMPILED', {'core_forward': broken, 'core_backward': broken})
    monkeypatch.setattr(kernels, '_compile_error', [])
    q, k, v, r, do = core_inputs(2, 2, 1, (3, 4), 8)
    with pytest.warns(UserWarning, match="torch.compile failed"):
        fast = run_core(kernels.inline_core_fast, q, k, v, r, do, (3, 4), torch.float64)
    torch.testing.assert_close(fast, run_core(inline.inline_core, q, k, v, r, do, (3, 4), torch.float64))
    with warnings.catch_warnings():
        warnings.simplefilter('error')  # warned once, not at every call
        kernels.inline_core_fast(*(t.float() for t in (q, k, v, r)), (3, 4))


def test_fallback_names_the_broken_cache_file(monkeypatch):
    """When the retry in a private folder fails too, the warning names the file the first error named."""
    def broken(*args):
        raise ImportError("/tmp/inductor/wv/cwvyao5g.main.so: file too short")

    monkeypatch.setattr(kernels, 'COMPILED', {'core_forward': broken, 'core_backward': broken})
    monkeypatch.setattr(kernels, '_compile_error', [])
    q, k, v = qkv(1, 1, 4, 8, dtype=torch.float32)
    with pytest.warns(UserWarning, match=r"torch.compile failed .*cwvyao5g.main.so in the inductor cache may be "
                                         r"broken: delete it"):
        o = kernels.inline_core_fast(q, k, v, None, (2, 2))
    torch.testing.assert_close(o, inline.inline_core(q, k, v, None, (2, 2)))


# One process compiling the fast core's forward graph (a tiny shape; the backward's graph goes the same way) in
# the inductor cache folder TORCHINDUCTOR_CACHE_DIR names; it prints whether it fell back, how many graphs it
# compiled, its warnings, its inductor cache hits and its error against the reference
COMPILE_CORE = """
import json, warnings, torch, inline, kernels
from torch._dynamo.utils import counters
torch.manual_seed(0)
q, k, v = (torch.randn(1, 2, 5, 8) for _ in range(3))
r = torch.randn(1, 9 * 16)
with warnings.catch_warnings(record=True) as caught:
    warnings.simplefilter('always')
    o = kernels.inline_core_fast(q, k, v, r, (2, 2))
print(json.dumps(dict(fell_back=bool(kernels._compile_error), graphs=len(kernels._compiled_signatures),
                      warnings=[str(w.message) for w in caught], hits=counters['inductor']['fxgraph_cache_hit'],
                      error=(o - inline.inline_core(q, k, v, r, (2, 2))).abs().max().item())))
"""


def start_compiling(cache):
    env = dict(os.environ, TORCHINDUCTOR_CACHE_DIR=str(cache), TORCHINDUCTOR_COMPILE_THREADS='1', OMP_NUM_THREADS='1')
    return subprocess.Popen([sys.executable, '-c', COMPILE_CORE], stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                            text=True, env=env, cwd=os.path.dirname(os.path.abspath(__file__)))


def compiled(process):
    stdout, stderr = process.communicate(timeout=600)
    assert process.returncode == 0, stderr[-3000:]
    return json.loads(stdout.splitlines()[-1])


@pytest.fixture(scope='module')
def two_compilers(tmp_path_factory):
    """Two processes that start compiling the same core at once, in one fresh inductor cache."""
    cache = tmp_path_factory.mktemp('inductor')
    processes = [start_compiling(cache) for _ in range(2)]
    return cache, [compiled(p) for p in processes]


def test_two_processes_compiling_at_once_both_end_compiled(two_compilers):
    """The first compiles while the other waits (kernels.node_lock), then loads the graph from the cache."""
    _, results = two_compilers
    for result in results:
        assert not result['fell_back'] and result['graphs'] == 1 and not result['warnings'], result
        assert result['error'] < 1e-5
    assert sorted(result['hits'] for result in results) == [0, 1], results


def test_an_empty_so_in_the_cache_still_runs_compiled(two_compilers):
    """A .so left empty by a process that died writing it fails every load of its graph; the core compiles again
    in a private folder and names the file to delete."""
    cache, _ = two_compilers
    compiled_so = [p for p in cache.rglob('*.so') if not os.path.exists(f'{p}.load_ok')]  # not the CPU probes
    assert compiled_so
    for path in compiled_so:
        path.write_bytes(b'')
    result = compiled(start_compiling(cache))
    assert not result['fell_back'] and result['graphs'] == 1 and result['error'] < 1e-5, result
    assert result['warnings'] and all('compiled again in a private folder' in w for w in result['warnings'])
    assert all(any(f'Delete {p}' in w for p in map(str, compiled_so)) for w in result['warnings'])


def test_benchmark_row_has_the_promised_keys():
    """One case of `python kernels.py --bench --json`: every key the README and the JSON lines promise."""
    row = kernels.bench_case('swin_t_stage3', torch.float32, torch.device('cpu'))
    assert {'case', 'tokens', 'dtype', 'reference_fwd_ms', 'reference_fwdbwd_ms', 'fast_fwd_ms', 'fast_fwdbwd_ms',
            'sdpa_fwd_ms', 'sdpa_fwdbwd_ms', 'floor_fwdbwd_ms', 'fast_peak_mb', 'fwd_speedup', 'fwdbwd_speedup',
            'fwdbwd_over_floor'} <= set(row)
    assert row['case'] == 'swin_t_stage3' and row['tokens'] == 196 and row['dtype'] == 'float32'
    assert all(row[key] > 0 for key in row if key.endswith(('_ms', '_mb', 'speedup', 'floor')))
    json.dumps(row)


@CUDA
@pytest.mark.parametrize('dtype', [torch.float32, torch.bfloat16], ids=['fp32', 'bf16'])
def test_fast_core_on_cuda(dtype):
    torch.manual_seed(0)
    shape = (2, 3, 1, (14, 14), 32)
    q, k, v, r, do = core_inputs(*shape, device='cuda')
    truth = run_core(inline.inline_core, q, k, v, r, do, shape[3], torch.float32)
    fast = run_core(kernels.inline_core_fast, q, k, v, r, do, shape[3], dtype)
    if dtype == torch.float32:
        assert_fp32_close(fast, truth, tolerance=1e-4)  # TF32 may be on for the caller's matmuls
    else:
        reference = run_core(inline.inline_core, q, k, v, r, do, shape[3], dtype)
        for name, f, ref, t in zip(NAMES, fast, reference, truth):
            fast_error, reference_error = (f - t).abs().max().item(), (ref - t).abs().max().item()
            print(f"{name}: bf16 error, fast {fast_error:.3e}, reference {reference_error:.3e}")
            assert fast_error <= 2 * reference_error + BF16_ROUNDING * t.abs().max().item(), name


# ---------------------------------------------------------------------------------------------------
# Whole models: fast=True equals fast=False in logits and in the gradient of every parameter

FAST_SMALL = {  # one small variant per family; every InLine attention has at least two heads
    'inline_deit_t': dict(img_size=(48, 80), embed_dim=32, depth=2, num_heads=2),
    'inline_pvt_t': dict(img_size=(64, 96), embed_dims=(16, 32, 32, 64), depths=(1, 1, 1, 1), num_heads=(2, 2, 2, 2)),
    'inline_swin_t': dict(img_size=(64, 96), embed_dim=16, depths=(2, 2, 2, 2), num_heads=(2, 2, 2, 4),
                          layout='IIMS1', softmax_window=3),
    'inline_cswin_t': dict(img_size=(64, 96), embed_dim=16, depths=(1, 2, 2, 1), num_heads=(2, 2, 4, 4),
                           layout='IISS', stripes=(1, 2, 3, 3)),
}


def assert_fast_model_equals_reference(name, compile_fast=False, **switches):
    torch.manual_seed(0)
    config = dict(FAST_SMALL[name], num_classes=5, drop_path_rate=0.0, **switches)
    reference = models.create_model(name, **config)
    fast = models.create_model(name, fast=True, **config)
    fast.load_state_dict(reference.state_dict())
    cores = [m for m in fast.modules() if getattr(m, 'core', None) is kernels.inline_core_fast]
    assert len(cores) >= 2 and all(m.infer is kernels.infer_fast for m in cores)
    x, upstream = torch.randn(2, 3, *config['img_size']), torch.randn(2, 5)
    logits = []
    for model in (reference, torch.compile(fast) if compile_fast else fast):
        logits.append(model(x))
        logits[-1].backward(upstream)
    torch.testing.assert_close(logits[1], logits[0], rtol=1e-5, atol=1e-5)
    with torch.no_grad():  # no gradient: Eq. 6's weights and the core in one graph (kernels.infer_fast)
        torch.testing.assert_close(model(x), logits[0], rtol=1e-5, atol=1e-5)
    for (key, p), q in zip(reference.named_parameters(), fast.parameters()):
        scale = p.grad.abs().max().item()
        assert (q.grad - p.grad).abs().max().item() <= 1e-4 * scale + 1e-7, key
    return model


@pytest.mark.parametrize('name', list(FAST_SMALL))
def test_fast_model_equals_reference_model(name):
    assert_fast_model_equals_reference(name)


def test_fast_model_with_the_ablation_switches():
    """Shifted 2x2 InLine windows, a learnable kernel and a dilated Eq. 6, all in one model."""
    assert_fast_model_equals_reference('inline_swin_t', window=2, kernel='relu_affine', dilation=2)


def test_fast_core_inside_a_compiled_model():
    """train.py --compile, torch.compile(model): the core's closed forms are traced into the model's graph, with no
    break at the attentions, with gradients and without; logits and gradients equal the eager reference
    model's (the causal core: test_fast_causal_core_inside_a_compiled_module)."""
    counters = torch._dynamo.utils.counters
    counters.clear()
    compiled = assert_fast_model_equals_reference('inline_deit_t', compile_fast=True)
    with torch.no_grad():
        compiled(torch.randn(2, 3, *FAST_SMALL['inline_deit_t']['img_size']))  # inference: a graph of its own
    assert not counters['graph_break'], dict(counters['graph_break'])


def test_enable_fast_swaps_exactly_the_reference_cores():
    torch.manual_seed(0)
    model = models.create_model('inline_swin_t', **FAST_SMALL['inline_swin_t'])
    cores = [m for m in model.modules() if getattr(m, 'core', None) is inline.inline_core]
    assert kernels.enable_fast(model) == len(cores) > 0
    assert all(m.core is kernels.inline_core_fast and m.infer is kernels.infer_fast for m in cores)
    assert kernels.enable_fast(model) == 0  # nothing left to swap


def test_enable_fast_refuses_an_inference_graph_that_does_not_follow_a_change():
    """kernels.infer_fast computes Eq. 6's weights itself, with GELU as the released predictor has it. A predictor
    changed in code (SiLU here) is followed by the fast core with a gradient, not by that graph: enable_fast finds the
    output with no gradient differ and refuses the module, naming it."""
    module = inline.InLineAttention(32, 2)
    module.residual[1] = torch.nn.SiLU()
    with pytest.raises(ValueError, match=r'InLineAttention\).*output with no gradient: max \|fast - float64'):
        kernels.enable_fast(module, log=None)
    assert module.core is inline.inline_core and module.infer is None


def test_inference_graph_under_bf16_autocast_within_twice_the_references_error():
    """Under autocast the inference graph casts q, k, v to bf16 and computes Eq. 6's weights in fp32, as the
    reference path does: its error against the float64 module is at most twice the bf16 reference's, plus noise."""
    torch.manual_seed(0)
    reference = inline.InLineAttention(64, 2, leading_tokens=1)
    fast = copy.deepcopy(reference)
    kernels.enable_fast(fast, log=None)
    x = torch.randn(2, 1 + 6 * 7, 64)
    with torch.no_grad():
        exact = copy.deepcopy(reference).double()(x.double(), (6, 7))
        with torch.autocast('cpu', torch.bfloat16):
            ours, theirs = reference(x, (6, 7)), fast(x, (6, 7))
    own, error = (ours.double() - exact).abs().max().item(), (theirs.double() - exact).abs().max().item()
    print(f"bf16 error: reference {own:.2e}, inference graph {error:.2e}")
    assert theirs.dtype == ours.dtype == torch.bfloat16 and error <= 2 * own + 1e-3 * exact.abs().max().item()


# ===================================================================================================
# InLine on sequences (README, "InLine on sequences"): causal Eq. 5's three forms against the explicit causal weights
# in float64, Eq. 6 over the last k tokens against a loop, the whole module's no-look-ahead, and the fast causal core

def sequence_inputs(B, H, N, D, taps=3, dtype=torch.float64, seed=0):
    """q, k, v (B, H, N, D) with non-zero means (what the uncentred prefix sums cost), r (B, N, k*C) per token, do."""
    g = torch.Generator().manual_seed(seed)
    q, k, v, do = (torch.randn(B, H, N, D, generator=g, dtype=dtype) for _ in range(4))
    k = k + torch.randn(B, H, 1, D, generator=g, dtype=dtype)
    v = v + 0.5
    r = 0.3 * torch.randn(B, N, taps * H * D, generator=g, dtype=dtype)
    return q, k, v, r, do


def stepped(q, k, v, state=None, scale_by_count=True):
    """inline_step over every token of q, k, v (B, H, N, D): the outputs (B, H, N, D) and the last state."""
    outs = []
    for t in range(q.shape[2]):
        o_t, state = inline.inline_step(q[:, :, t], k[:, :, t], v[:, :, t], state, scale_by_count=scale_by_count)
        outs.append(o_t)
    return torch.stack(outs, dim=2), state


@pytest.mark.parametrize('scale_by_count', [True, False], ids=['s-over-i', 'printed-s'])
def test_causal_weights_match_the_formula_element_by_element(scale_by_count):
    """Each prefix 1..i written out by hand: w_ij = g_i (q_i.k_j - q_i.k_mean_i) + 1/i, g_i = s/i or s (printed)."""
    q, k, _ = qkv(1, 1, 7, 4)
    w = inline.inline_weights(q, k, causal=True, scale_by_count=scale_by_count)
    s = 4 ** -0.5
    for i in range(7):
        k_mean = k[0, 0, :i + 1].mean(0)
        g = s / (i + 1) if scale_by_count else s
        for j in range(7):
            expected = g * (q[0, 0, i] @ k[0, 0, j] - q[0, 0, i] @ k_mean) + 1 / (i + 1) if j <= i else 0.0
            assert abs(w[0, 0, i, j].item() - float(expected)) < 1e-14
    torch.testing.assert_close(w.sum(-1), torch.ones(1, 1, 7, dtype=torch.float64), rtol=0, atol=1e-14)
    assert (inline.inline_weights(2 * q, k, causal=True, scale_by_count=scale_by_count)
            - w)[0, 0, 1:].abs().amax(-1).min() > 1e-3  # 2q gives other weights in every row with two tokens or more


@pytest.mark.parametrize('scale_by_count', [True, False], ids=['s-over-i', 'printed-s'])
def test_causal_injectivity_needs_d_plus_1_tokens(scale_by_count):
    """Row i is injective in q_i only where the centred keys k_j - k_mean_i (j <= i) span all D dimensions, i >= D + 1:
    a change of q_i orthogonal to all of them (their null space, which exists while i <= D) leaves row i as it was,
    and at i >= D + 1 there is no such change: the same step along the last right-singular vector moves the row."""
    D = 6
    q, k, _ = qkv(1, 1, 12, D)
    for i in range(1, 12):  # row i counts i + 1 tokens
        centred = k[0, 0, :i + 1] - k[0, 0, :i + 1].mean(0)  # (i + 1, D)
        direction = torch.linalg.svd(centred).Vh[-1]  # (D,): in the null space while i + 1 <= D
        moved = q.clone()
        moved[0, 0, i] += 3.0 * direction
        w, w_moved = (inline.inline_weights(t, k, causal=True, scale_by_count=scale_by_count)[0, 0, i]
                      for t in (q, moved))
        change = (w - w_moved).abs().max().item()
        assert change < 1e-14 if i + 1 <= D else change > 1e-4, (i + 1, change)


@pytest.mark.parametrize('scale_by_count', [True, False], ids=['s-over-i', 'printed-s'])
@pytest.mark.parametrize('N', [1, 37, 131], ids=['N1', 'N37', 'N131'])
def test_causal_forms_equal_the_explicit_weights(N, scale_by_count):
    """Prefix sums (inline_attention), chunks of 16 (inline_chunked, a ragged last chunk) and the recurrent step:
    outputs and the gradients of q, k, v against w @ v with the explicit causal weights, in float64, under either
    factor of Eq. 5 (the explicit weights are the hand formula: test_causal_weights_match_the_formula_element_by_element)."""
    q, k, v, _, do = sequence_inputs(2, 3, N, 8)
    c = dict(scale_by_count=scale_by_count)
    forms = {'explicit': lambda q, k, v: inline.inline_weights(q, k, causal=True, **c) @ v,
             'prefix sums': lambda q, k, v: inline.inline_attention(q, k, v, causal=True, **c),
             'chunked': lambda q, k, v: inline.inline_chunked(q, k, v, chunk=16, **c)[0],
             'step': lambda q, k, v: stepped(q, k, v, **c)[0]}
    results = {}
    for name, form in forms.items():
        leaves = [t.clone().requires_grad_() for t in (q, k, v)]
        o = form(*leaves)
        results[name] = [o, *torch.autograd.grad(o, leaves, do)]
    for name in list(forms)[1:]:
        for what, a, b in zip(['o', 'dq', 'dk', 'dv'], results[name], results['explicit']):
            torch.testing.assert_close(a, b, rtol=0, atol=1e-11, msg=f"{name}, {what}")


def test_a_sequence_split_in_two_and_resumed_from_its_state_equals_the_whole():
    """The chunked form's state goes on to a second call, or to recurrent steps (a prompt, then generation):
    the outputs and the final state equal one pass over the whole sequence."""
    q, k, v, _, _ = sequence_inputs(2, 2, 61, 8)
    whole, whole_state = inline.inline_chunked(q, k, v, chunk=8)
    first, state = inline.inline_chunked(q[:, :, :23], k[:, :, :23], v[:, :, :23], chunk=8)
    second, state = inline.inline_chunked(q[:, :, 23:], k[:, :, 23:], v[:, :, 23:], state=state, chunk=16)
    generated, step_state = stepped(q[:, :, 40:], k[:, :, 40:], v[:, :, 40:],
                                    inline.inline_chunked(q[:, :, :40], k[:, :, :40], v[:, :, :40])[1])
    torch.testing.assert_close(torch.cat([first, second], 2), whole, rtol=0, atol=1e-12)
    torch.testing.assert_close(generated, whole[:, :, 40:], rtol=0, atol=1e-12)
    for a, b, c in zip(state, step_state, whole_state):
        torch.testing.assert_close(torch.as_tensor(a), torch.as_tensor(c), rtol=0, atol=1e-11)
        torch.testing.assert_close(torch.as_tensor(b), torch.as_tensor(c), rtol=0, atol=1e-11)
    assert state[3] == 61 and state[0].shape == (2, 2, 8, 8)  # the count, and one D x D sum per head


def state_numel(state):
    """Floats a step's state holds: every tensor in it, however nested."""
    if isinstance(state, (tuple, list)):
        return sum(state_numel(t) for t in state)
    return state.numel() if isinstance(state, torch.Tensor) else 0


@pytest.mark.parametrize('options', [dict(), dict(kernel='one_plus_elu', scale_by_count=False),
                                     dict(local_size=5, dilation=2), dict(residual='none')],
                         ids=['eq6', 'one_plus_elu-printed-s', 'eq6-k5-dilation2', 'no-eq6'])
def test_module_step_with_eq6_equals_the_whole_sequence(options):
    """Generation runs the trained module: InLineAttention(causal=True).step token by token gives forward's output
    on the whole sequence, Eq. 6 included (its weights from the running mean of x, its last dilation*(k-1) values
    kept), in float64; the state's size does not grow with the tokens."""
    torch.manual_seed(0)
    attn = inline.InLineAttention(24, 3, causal=True, **options).double()
    x = torch.randn(2, 23, 24, dtype=torch.float64)
    whole, state, sizes = attn(x), None, []
    steps = []
    for t in range(23):
        y_t, state = attn.step(x[:, t], state)
        steps.append(y_t)
        sizes.append(state_numel(state))
    torch.testing.assert_close(torch.stack(steps, 1), whole, rtol=0, atol=1e-12)
    assert len(set(sizes[1:])) == 1, sizes  # from the second token on, one size
    with pytest.raises(ValueError, match="a step is causal InLine's"):
        inline.InLineAttention(24, 3, sequence=True).double().step(x[:, 0])


def test_causal_linear_attention_matches_its_weights():
    q, k, v = qkv(2, 2, 45, 8)
    q, k = F.relu(q), F.relu(k)
    w = inline.linear_attention_weights(q, k, eps=0, causal=True)
    assert w.triu(1).abs().max() == 0
    torch.testing.assert_close(inline.linear_attention(q, k, v, eps=0, causal=True), w @ v, rtol=0, atol=1e-12)


def sequence_residual_loop(v, r, size, dilation, causal):
    """Eq. 6 on a sequence, one token, channel and tap at a time."""
    B, H, N, D = v.shape
    out = torch.zeros_like(v)
    for b in range(B):
        for i in range(N):
            for t in range(size):
                j = i + dilation * (t - (size - 1 if causal else size // 2))
                if 0 <= j < N:
                    for h in range(H):
                        for d in range(D):
                            c = h * D + d
                            weight = r[b, i, size * c + t] if causal else r[b, size * c + t]
                            out[b, h, i, d] += weight * v[b, h, j, d]
    return out


@pytest.mark.parametrize('size,dilation,causal', [(3, 1, True), (3, 2, True), (1, 1, True), (5, 1, False),
                                                  (3, 2, False)],
                         ids=['k3-causal', 'k3-d2-causal', 'k1-causal', 'k5-centred', 'k3-d2-centred'])
def test_eq6_on_a_sequence_against_an_explicit_loop(size, dilation, causal):
    q, k, v, r, _ = sequence_inputs(2, 2, 11, 3, taps=size)
    r = r if causal else r[:, 0]  # (B, N, kC) per token, or (B, kC) per sample
    expected = sequence_residual_loop(v, r, size, dilation, causal)
    torch.testing.assert_close(inline.local_residual(v, r, None, size, dilation, causal), expected, rtol=0, atol=1e-13)


def test_causal_eq6_weights_come_from_the_prefix_mean():
    torch.manual_seed(0)
    mlp = inline.residual_mlp(8, 2, taps=3).double()
    x = torch.randn(2, 9, 8, dtype=torch.float64)
    r = inline.residual_weights(mlp, x, causal=True)
    assert r.shape == (2, 9, 24)
    for i in range(9):
        torch.testing.assert_close(r[:, i], inline.residual_weights(mlp, x[:, :i + 1]), rtol=0, atol=1e-14)


def no_look_ahead(module, x, j):
    """module(x) and module(x with token j changed): outputs before j must be equal bit for bit."""
    changed = x.clone()
    changed[:, j] += torch.randn(x.shape[0], x.shape[2], generator=torch.Generator().manual_seed(1), dtype=x.dtype)
    y, z = module(x), module(changed)
    assert torch.equal(y[:, :j], z[:, :j]), f"token {j} changed an earlier output by {(y - z)[:, :j].abs().max():.1e}"
    assert (y[:, j] - z[:, j]).abs().max() > 1e-3  # and it does change its own


@pytest.mark.parametrize('attention,kernel', [('inline', 'identity'), ('linear', 'one_plus_elu')],
                         ids=['inline', 'linear-one_plus_elu'])
def test_causal_module_never_looks_ahead(attention, kernel):
    """The whole module with Eq. 6 (prefix-mean weights, the last 3 tokens): change token j, and every output
    before j is unchanged exactly, in float64 and float32."""
    torch.manual_seed(0)
    for dtype in (torch.float64, torch.float32):
        attn = inline.InLineAttention(24, 3, causal=True, attention=attention, kernel=kernel).to(dtype)
        x = torch.randn(2, 45, 24, dtype=dtype)
        for j in (0, 17, 44):
            no_look_ahead(attn, x, j)
    assert attn.residual[2].out_channels == 3 * 24  # k = 3 taps per channel on a sequence, not k^2


def test_readme_decoder_block_never_looks_ahead():
    """The README's decoder block, run as written: (B, N, C) in and out, and no output sees a later token."""
    scope = {}
    exec(readme_block('## InLine on sequences'), scope)
    torch.manual_seed(0)
    block = scope['DecoderBlock'](32, 4).double()
    x = torch.randn(2, 19, 32, dtype=torch.float64)
    assert block(x).shape == x.shape
    for j in (0, 9, 18):
        no_look_ahead(block, x, j)


def test_sequence_modules_and_their_errors():
    """causal=True and sequence=True take (B, N, C) with no grid; the bidirectional one does look both ways; a grid
    module needs its grid; bad combinations are refused, saying what is allowed."""
    torch.manual_seed(0)
    x = torch.randn(2, 13, 16)
    bidirectional = inline.InLineAttention(16, 2, sequence=True)
    y = bidirectional(x)
    changed = x.clone()
    changed[:, -1] += 1
    assert y.shape == (2, 13, 16) and (bidirectional(changed)[:, 0] - y[:, 0]).abs().max() > 0
    assert bidirectional.weights(x).shape == (2, 2, 13, 13)
    assert inline.InLineAttention(16, 2, causal=True).weights(x).triu(1).abs().max() == 0
    with pytest.raises(ValueError, match=r"built for a 1-D sequence \(causal or sequence=True\): call it with no grid"):
        inline.InLineAttention(16, 2, causal=True)(x, (1, 13))
    with pytest.raises(ValueError, match=r"built for a token grid: pass grid=\(h, w\), or build it with sequence=True"):
        inline.InLineAttention(16, 2)(x)
    q, k, v, r, _ = sequence_inputs(2, 2, 13, 8)
    with pytest.raises(ValueError, match=r"causal attention runs over a 1-D sequence: grid must be None"):
        inline.inline_core(q, k, v, r, (1, 13), causal=True)
    with pytest.raises(ValueError, match=r"r must hold 3 neighbour weights per channel and token, \(B, N, kC\)"):
        inline.inline_core(q, k, v, r[:, 0], None, causal=True)
    with pytest.raises(ValueError, match=r"r must hold 3 neighbour weights per channel, \(B, kC\)"):
        inline.inline_core(q, k, v, r, None)


def causal(core, **options):
    return functools.partial(core, causal=True, **options)


# (B, H, N, D): odd lengths, ragged last chunks (the fast core's are 64 tokens); B, H, N are symbols of one graph
CAUSAL_SHAPES = [(2, 3, 131, 32), (3, 2, 200, 32)]
CAUSAL_OPTIONS = {'eq6': dict(size=3), 'eq6-dilation2': dict(size=3, dilation=2), 'no-eq6': None,
                  'eq6-printed-s': dict(size=3, scale_by_count=False)}  # the paper's printed Eq. 5: s, not s/i
ROUNDING = {torch.bfloat16: 2 ** -8, torch.float16: 2 ** -11}  # half an ulp at 1, times the tensor's largest entry


@pytest.mark.parametrize('option', list(CAUSAL_OPTIONS))
@pytest.mark.parametrize('shape', CAUSAL_SHAPES, ids=[f"B{B}-H{H}-N{N}-D{D}-fp32" for B, H, N, D in CAUSAL_SHAPES])
def test_fast_causal_core_equals_reference_fp32(shape, option):
    q, k, v, r, do = sequence_inputs(*shape)
    options = CAUSAL_OPTIONS[option] or {}
    r = r if 'size' in options else None
    fast = run_core(causal(kernels.inline_core_fast, **options), q, k, v, r, do, None, torch.float32)
    reference = run_core(causal(inline.inline_core, **options), q, k, v, r, do, None, torch.float32)
    assert fast[0].shape == shape
    assert_fp32_close(fast, reference)


@pytest.mark.parametrize('scale_by_count', [True, False], ids=['s-over-i', 'printed-s'])
@pytest.mark.parametrize('dtype', [torch.bfloat16, torch.float16], ids=['bf16', 'fp16'])
def test_fast_causal_core_low_precision_within_twice_the_references(dtype, scale_by_count):
    """In bf16 and fp16 the fast causal core's error against the fp32 reference is at most twice the reference's
    own in that dtype, plus one rounding of the tensor's scale. (The reference sums in fp32 whatever the dtype, so
    its own error is little more than its inputs' rounding: the fast core must do as well.) Under either factor of
    Eq. 5: the printed s makes the outputs grow with i, the scans' sums unscaled."""
    q, k, v, r, do = sequence_inputs(2, 3, 131, 32)
    c = dict(scale_by_count=scale_by_count)
    truth = run_core(causal(inline.inline_core, **c), q, k, v, r, do, None, torch.float32)
    fast = run_core(causal(kernels.inline_core_fast, **c), q, k, v, r, do, None, dtype)
    reference = run_core(causal(inline.inline_core, **c), q, k, v, r, do, None, dtype)
    for name, f, ref, t in zip(NAMES, fast, reference, truth):
        fast_error, reference_error = (f - t).abs().max().item(), (ref - t).abs().max().item()
        noise = ROUNDING[dtype] * t.abs().max().item()
        print(f"{name}: {dtype} error, fast {fast_error:.3e}, reference {reference_error:.3e}, noise {noise:.1e}")
        assert fast_error <= 2 * reference_error + noise, name


def test_fast_core_with_the_printed_scale_on_an_image():
    """scale_by_count=False on a 7x7 window (Eq. 5 with s, not s/N): the fast core's output and every gradient equal
    the reference's in fp32, and the module built with it passes enable_fast's check."""
    shape = (2, 3, 0, (7, 7), 32)
    q, k, v, r, do = core_inputs(*shape)
    printed = lambda core: functools.partial(core, scale_by_count=False)  # noqa: E731
    fast = run_core(printed(kernels.inline_core_fast), q, k, v, r, do, (7, 7), torch.float32)
    assert_fp32_close(fast, run_core(printed(inline.inline_core), q, k, v, r, do, (7, 7), torch.float32))
    assert kernels.enable_fast(inline.InLineAttention(32, 2, scale_by_count=False), log=None) == 1


def test_the_scale_option_is_part_of_the_compiled_graphs_key():
    """scale_by_count is a Python bool the graphs specialise on: kernels.signature keys the two apart, so a call under
    one never reuses the switches and marks recorded for the other's graph."""
    q, k, v, _, _ = sequence_inputs(2, 2, 130, 8, dtype=torch.float32)
    for f in (kernels.causal_forward, kernels.core_forward):
        keys = {kernels.signature(f, [q, k, v, None, None, None, 8 ** -0.5, c]) for c in (True, False)}
        assert len(keys) == 2


def test_fast_core_on_a_bidirectional_sequence():
    """grid=None without causal: Eq. 5 over the whole sequence, Eq. 6 over the 3 tokens centred on each."""
    q, k, v, r, do = sequence_inputs(2, 3, 45, 32)
    fast = run_core(kernels.inline_core_fast, q, k, v, r[:, 0], do, None, torch.float32)
    assert_fp32_close(fast, run_core(inline.inline_core, q, k, v, r[:, 0], do, None, torch.float32))


def test_fast_causal_module_never_looks_ahead():
    """The module on the fast path, built by kernels.enable_fast, is the reference module's function and keeps its
    no-look-ahead bit for bit across the fast core's chunks."""
    torch.manual_seed(0)
    reference = inline.InLineAttention(64, 2, causal=True)
    fast = inline.InLineAttention(64, 2, causal=True)
    fast.load_state_dict(reference.state_dict())
    assert kernels.enable_fast(fast) == 1 and fast.core is kernels.inline_core_fast
    x = torch.randn(2, 150, 64)
    torch.testing.assert_close(fast(x), reference(x), rtol=0, atol=2e-5 * reference(x).abs().max().item())
    for j in (30, 70, 149):
        no_look_ahead(fast, x, j)
    with pytest.raises(ValueError, match=r"the fast InLine core has no attention='linear'"):
        kernels.enable_fast(inline.InLineAttention(64, 2, causal=True, attention='linear', kernel='relu'))


def test_a_guard_failing_under_a_known_signature_compiles_with_the_switches(monkeypatch):
    """Dynamo guards a compiled graph on the torch-function modes in force. A call under a new one, with a signature
    kernels.run has a graph for, would recompile without the core's switches and, past dynamo's limit, run eagerly
    and silently; instead run compiles another graph with the switches, and it returns the reference's output."""
    class Mode(torch.overrides.TorchFunctionMode):
        def __torch_function__(self, func, types, args=(), kwargs=None):
            return func(*args, **(kwargs or {}))
    q, k, v, r = (t.float() for t in core_inputs(2, 2, 0, (5, 6), 16)[:4])
    compiled, compile_and_call = [], kernels.compile_and_call
    monkeypatch.setattr(kernels, 'compile_and_call', lambda f, args, key: (compiled.append(key), compile_and_call(
        f, args, key))[1])
    with torch.no_grad():
        kernels.inline_core_fast(q, k, v, r, (5, 6))  # the graph for this signature, if this process has none yet
        compiled.clear()
        with Mode():
            fast = kernels.inline_core_fast(q, k, v, r, (5, 6))
        torch.testing.assert_close(fast, inline.inline_core(q, k, v, r, (5, 6)), rtol=1e-5, atol=1e-5)
    assert len(compiled) == 1  # under the mode: compiled again, with the switches


def test_fast_causal_core_inside_a_compiled_module():
    """torch.compile of a causal module on the fast path: the causal core's closed forms are traced into the module's
    graph, with no break; output and every gradient equal the reference module's."""
    torch.manual_seed(0)
    reference = inline.InLineAttention(16, 2, causal=True)
    fast = inline.InLineAttention(16, 2, causal=True)
    fast.load_state_dict(reference.state_dict())
    kernels.enable_fast(fast, log=None)
    x, do = torch.randn(2, 70, 16), torch.randn(2, 70, 16)  # two chunks of the fast core, the second ragged
    counters = torch._dynamo.utils.counters
    counters.clear()
    outputs = []
    for module in (reference, torch.compile(fast)):
        x_ = x.clone().requires_grad_()
        out = module(x_)
        out.backward(do)
        outputs.append([out, x_.grad] + [p.grad for p in module.parameters()])
    assert not counters['graph_break'], dict(counters['graph_break'])
    for f, r in zip(outputs[1], outputs[0]):
        torch.testing.assert_close(f, r, rtol=1e-4, atol=1e-5 * r.abs().max().item())


@CUDA
@pytest.mark.parametrize('dtype', [torch.float32, torch.bfloat16], ids=['fp32', 'bf16'])
def test_fast_causal_core_on_cuda(dtype):
    q, k, v, r, do = (t.cuda() for t in sequence_inputs(2, 3, 131, 32))
    truth = run_core(causal(inline.inline_core), q, k, v, r, do, None, torch.float32)
    fast = run_core(causal(kernels.inline_core_fast), q, k, v, r, do, None, dtype)
    if dtype == torch.float32:
        assert_fp32_close(fast, truth, tolerance=1e-4)  # TF32 may be on for the caller's matmuls
    else:
        reference = run_core(causal(inline.inline_core), q, k, v, r, do, None, dtype)
        for name, f, ref, t in zip(NAMES, fast, reference, truth):
            fast_error, reference_error = (f - t).abs().max().item(), (ref - t).abs().max().item()
            print(f"{name}: bf16 error, fast {fast_error:.3e}, reference {reference_error:.3e}")
            assert fast_error <= 2 * reference_error + BF16_ROUNDING * t.abs().max().item(), name


def test_fast_causal_core_rejects_what_the_reference_rejects():
    q, k, v, r, _ = sequence_inputs(2, 2, 13, 8)
    with pytest.raises(ValueError, match=r"causal attention runs over a 1-D sequence: grid must be None"):
        kernels.inline_core_fast(q, k, v, r, (1, 13), causal=True)
    with pytest.raises(ValueError, match=r"r must hold 3 neighbour weights per channel and token, \(B, N, kC\)"):
        kernels.inline_core_fast(q, k, v, r[:, 0], None, causal=True)


def test_mqar_batches_ask_for_the_values_of_earlier_keys():
    x, y = paper.mqar_batch(16, 8, 30, torch.Generator().manual_seed(0))
    assert x.shape == y.shape == (16, 30)
    keys, values, filler = x[:, 0:16:2], x[:, 1:16:2], x[:, 16:22]
    assert (keys < paper.RECALL_VOCAB).all() and ((values >= paper.RECALL_VOCAB) & (values < 2 * paper.RECALL_VOCAB)).all()
    assert (filler >= 2 * paper.RECALL_VOCAB).all()
    assert all(len(set(row.tolist())) == 8 for row in keys)  # distinct keys in each sequence
    assert (y[:, :22] == -100).all() and (y[:, 22:] >= paper.RECALL_VOCAB).all()
    for b in range(16):
        answer = dict(zip(keys[b].tolist(), values[b].tolist()))
        assert [answer[k] for k in x[b, 22:].tolist()] == y[b, 22:].tolist()


def test_recall_sizes_put_every_query_where_inline_is_injective():
    """Every query of the default sizes sits at token D + 1 or later (D = C / 2), where the prefix's centred keys can
    span D dimensions (test_causal_injectivity_needs_d_plus_1_tokens)."""
    for width, pairs, tokens in paper.RECALL_SIZES:
        _, y = paper.mqar_batch(2, pairs, tokens, torch.Generator().manual_seed(0))
        first_query = (y[0] != -100).nonzero().min().item() + 1  # counting tokens from 1
        assert first_query >= width // paper.RECALL_HEADS + 1


def test_most_frequent_guess_against_a_hand_count():
    """Values 64, 64, 65, 66 with queries asking for each key once: the guess answers 64, right 2 times in 4."""
    x = torch.tensor([[0, 64, 1, 64, 2, 65, 3, 66, 0, 1, 2, 3]])
    y = torch.full_like(x, -100)
    y[0, 8:] = torch.tensor([64, 64, 65, 66])
    assert paper.most_frequent_guess(x, y, 4) == 50.0


def test_recall_models_run_the_reference_function():
    """RecallLM's explicit-weight core (short_sequence_core) gives the reference core's logits, under either factor
    of Eq. 5; q-norm models give q and 2q the same weights (injectivity in q's length off), the others do not."""
    torch.manual_seed(0)
    x, _ = paper.mqar_batch(3, 4, 12, torch.Generator().manual_seed(0))
    for name in ('InLine s/i', 'InLine 1+elu s', 'InLine s/i q-norm', 'linear 1+elu', 'floor phi=0', 'InLine s + Eq. 6'):
        model = paper.RecallLM(name, 16, 12).double()
        cores = [m for m in model.modules() if hasattr(m, 'core')]
        assert len(cores) == 2 and all(m.causal for m in cores)
        assert all(m.scale_by_count == paper.RECALL_MODELS[name].get('scale_by_count', True) for m in cores)
        logits = model(x)
        torch.testing.assert_close(model(x, 4), logits[:, -4:], rtol=0, atol=1e-12)  # the head at the answers only
        for m in cores:
            m.core = inline.inline_core
        torch.testing.assert_close(logits, model(x), rtol=0, atol=1e-10)
        assert logits.shape == (3, 12, 3 * paper.RECALL_VOCAB)
    q = torch.randn(2, 2, 12, 8, dtype=torch.float64)
    normalise = inline.NormalisedQ(2, 8).double()
    torch.testing.assert_close(normalise(q), normalise(2 * q))
    attn = paper.CausalInLine(16, 2, normalise_q=True, residual='none').double()
    q, k, _ = qkv(2, 2, 12, 8)
    assert (attn.explicit_weights(q, k) - attn.explicit_weights(2 * q, k)).abs().max() < 1e-12
    attn = paper.CausalInLine(16, 2, residual='none').double()
    assert (attn.explicit_weights(q, k) - attn.explicit_weights(2 * q, k)).abs().max() > 1e-3


def test_recall_softmax_adds_causal_eq6_token_by_token():
    """CausalSoftmax with residual='local' adds, at token i, sum over t of r_i[3c + t] * v_{i-2+t} (zero before the
    start) to softmax's output, r from the prefix mean; token i's output does not move when a later token does."""
    torch.manual_seed(0)
    plain, shifted = paper.CausalSoftmax(16, 2).double(), paper.CausalSoftmax(16, 2, residual='local').double()
    shifted.qkv.load_state_dict(plain.qkv.state_dict())
    shifted.proj.load_state_dict(plain.proj.state_dict())
    x = torch.randn(3, 7, 16, dtype=torch.float64)
    v = plain.qkv(x).chunk(3, -1)[2]  # (B, N, C), channel c = head*D + j
    r = inline.residual_weights(shifted.residual, x, causal=True).reshape(3, 7, 16, 3)  # (B, N, C, taps)
    eq6 = torch.stack([sum(r[:, i, :, t] * v[:, i - 2 + t] for t in range(3) if i - 2 + t >= 0) for i in range(7)], 1)
    expected = plain(x) + eq6 @ plain.proj.weight.T  # proj is linear: its bias is in plain(x) already
    torch.testing.assert_close(shifted(x), expected)
    later = x.clone()
    later[:, 4:] += 1.0
    torch.testing.assert_close(shifted(later)[:, :4], shifted(x)[:, :4])


def test_paper_recall_chooses_learning_rates_keeps_finished_runs_and_trains_only_the_rest(tmp_path, monkeypatch,
                                                                                         capsys):
    """Seed 0 at every learning rate, then seed 1 at the one that recalled most on the held-out sequences; a rerun
    trains only what is missing, a run another command has claimed is left to it, and --no-train trains nothing."""
    results, argv = str(tmp_path / 'recall.jsonl'), ['recall', '--steps', '3', '--seeds', '2', '--sizes', '8x2x6',
                                                     '--out', str(tmp_path)]
    threads = torch.get_num_threads()
    runs = paper.main(argv + ['--results', results, '--models', 'softmax', 'InLine s/i'])
    assert torch.get_num_threads() == threads  # --threads 1 held for the training only
    with open(results) as f:
        assert len(f.readlines()) == 2 * (len(paper.RECALL_LRS) + 1)  # 2 models x (3 learning rates + seed 1)
    for r in runs.values():  # the right test answers kept, 1024 sequences x 2 pairs, are the recall
        assert 100 * train.unpack_correct(r['correct'], 1024 * 2).double().mean().item() == pytest.approx(r['recall'],
                                                                                                           abs=0.01)
    for name in ('softmax', 'InLine s/i'):
        best = max((r for r in runs.values() if r['model'] == name and r['seed'] == 0),
                   key=lambda r: (r['valid'], -r['lr']))
        assert [r['lr'] for r in runs.values() if r['model'] == name and r['seed'] == 1] == [best['lr']]
    trained = []
    real = paper.recall_run
    monkeypatch.setattr(paper, 'recall_run', lambda *run: trained.append(run) or real(*run))
    # another command holds the first run and gives it up unfinished after 2 s: it is left, waited for, then trained
    claimed = paper.recall_claim(str(tmp_path), paper.recall_key('linear 1+elu', 8, 2, 6, 0, paper.RECALL_LRS[0], 3))
    threading.Timer(2.0, os.close, (claimed,)).start()
    paper.main(argv + ['--results', results, '--models', 'softmax', 'InLine s/i', 'linear 1+elu'])
    assert {run[0] for run in trained} == {'linear 1+elu'} and [run[4] for run in trained] == [0, 0, 0, 1]
    assert [run[5] for run in trained[:3]] == [*paper.RECALL_LRS[1:], paper.RECALL_LRS[0]]
    paper.main(argv + ['--results', results, '--models', 'softmax', 'InLine s', '--no-train'])
    assert len(trained) == len(paper.RECALL_LRS) + 1
    out = capsys.readouterr().out
    assert '| 8 / 2 / 6 | linear 1+elu |' in out and 'No runs yet: InLine s at 8 / 2 / 6.' in out
    assert_png(str(tmp_path / 'recall.png'))
    for bad, message in ((['--models', 'gpt'], "unknown recall models ['gpt']"),
                         (['--sizes', '8x65x200'], '--sizes takes'), (['--sizes', '7x4x12'], '--sizes takes'),
                         (['--sizes', '16x4x10'], 'every query sits at token D + 1 or later'),
                         (['--seeds', '0'], '--seeds, --steps and --threads must be at least 1')):
        with pytest.raises(SystemExit):
            paper.main(argv + ['--results', results] + bad)
        assert message in capsys.readouterr().err


def test_recall_comparisons_are_untestable_under_the_floor_or_the_guess(tmp_path, capsys):
    """Records made up for one size: a comparison whose two models clear the floor (phi = 0) and the guess by
    RECALL_GATE gets a verdict; one whose model sits at the floor is untestable, and Holm counts only the first. The
    models with Eq. 6 are compared among themselves, gated by the floor with Eq. 6: the same softmax numbers are
    untestable there, where that floor sits at 58%."""
    width, pairs, tokens, steps = 16, 4, 12, 7
    recall = {'softmax': [99.0, 98.5, 99.5], 'softmax q-norm': [60.0, 58.0, 61.0], 'floor phi=0': [27.0, 26.5, 27.5],
              'InLine s/i': [27.2, 26.8, 27.1], 'InLine s/i q-norm': [26.9, 27.3, 27.0],
              'softmax + Eq. 6': [99.0, 98.5, 99.5], 'softmax q-norm + Eq. 6': [60.0, 58.0, 61.0],
              'floor phi=0 + Eq. 6': [58.0, 58.0, 58.0]}
    path = tmp_path / 'recall.jsonl'
    for name, values in recall.items():
        for lr in paper.RECALL_LRS:
            paper.append_record(str(path), dict(model=name, width=width, pairs=pairs, tokens=tokens, seed=0,
                                                steps=steps, batch=paper.RECALL_BATCH, lr=lr, cpu_s=1.0,
                                                valid=values[0] + (lr == paper.RECALL_LRS[1]), recall=values[0]))
        for seed, value in enumerate(values[1:], 1):
            paper.append_record(str(path), dict(model=name, width=width, pairs=pairs, tokens=tokens, seed=seed,
                                                steps=steps, batch=paper.RECALL_BATCH, lr=paper.RECALL_LRS[1],
                                                cpu_s=1.0, valid=0.0, recall=value))
    paper.main(['recall', '--no-train', '--results', str(path), '--steps', str(steps), '--seeds', '3', '--sizes',
                f'{width}x{pairs}x{tokens}', '--models', *recall, '--out', str(tmp_path)])
    out = capsys.readouterr().out
    assert '| injectivity within softmax | 16 / 4 / 12 | 59.7 | 99.0 | +39.3 ± ' in out
    assert '| reproduced | reproduced |' in out
    assert '| injectivity within InLine | 16 / 4 / 12 | 27.1 | 27.0 | ' in out and '| untestable | untestable |' in out
    assert re.search(r'\| injectivity within softmax \+ Eq. 6 \| 16 / 4 / 12 \| 59.7 \| 99.0 \| .* \| untestable \| untestable \|',
                     out)  # 59.7 < 58 + RECALL_GATE


def test_recall_intervals_count_the_test_sequences(tmp_path, capsys):
    """Made-up records with right answers kept: a gets the same answers right in every seed, b those and the same 410
    more (20 points), so the seeds alone give ± 0.0, while the test sequences give the interval of a mean over 1024
    sequences: t(0.975, 1023) sd / sqrt(1024) of the per-sequence differences (the two-way model with no seed or
    residual variance)."""
    width, pairs, tokens, steps = 16, 2, 12, 7
    g = torch.Generator().manual_seed(0)
    a = torch.rand(1024 * pairs, generator=g) < 0.5
    b = a.clone()
    wrong = (~a).nonzero().flatten()
    b[wrong[torch.randperm(len(wrong), generator=g)[:410]]] = True
    path = str(tmp_path / 'recall.jsonl')
    for name, bits in (('InLine s/i q-norm', a), ('InLine s/i', b)):
        for seed in range(3):
            for lr in paper.RECALL_LRS if seed == 0 else paper.RECALL_LRS[:1]:
                paper.append_record(path, dict(model=name, width=width, pairs=pairs, tokens=tokens, seed=seed,
                                               steps=steps, batch=paper.RECALL_BATCH, lr=lr, cpu_s=1.0, valid=50.0,
                                               recall=100 * bits.double().mean().item(),
                                               correct=train.pack_correct(bits)))
    paper.main(['recall', '--no-train', '--results', path, '--steps', str(steps), '--seeds', '3', '--sizes',
                f'{width}x{pairs}x{tokens}', '--models', 'InLine s/i q-norm', 'InLine s/i', '--out', str(tmp_path)])
    row = next(line for line in capsys.readouterr().out.splitlines() if line.startswith('| injectivity within InLine |'))
    d = 100 * (b.view(1024, pairs).double().mean(1) - a.view(1024, pairs).double().mean(1))  # per test sequence
    half = 1.962339 * d.std().item() / 1024 ** 0.5  # t(0.975, 1023)
    assert 1.0 < half < 5.0 and f'| {d.mean().item():+.1f} ± {half:.1f} |' in row


def test_the_committed_records_rebuild_the_results_claim_tables(tmp_path, capsys):
    """RESULTS.md's claim tables are what `paper.py ablations --claims --no-train` prints from results/runs.jsonl,
    line for line: the evidence cannot drift from its records."""
    paper.main(['ablations', '--claims', '--no-train', '--out', str(tmp_path), '--png', str(tmp_path / 'a.png')])
    tables = [line for line in capsys.readouterr().out.splitlines() if line.startswith('|')]
    with open(os.path.join(os.path.dirname(paper.__file__), 'RESULTS.md')) as f:
        results = f.read().splitlines()
    assert len(tables) > 10 and [line for line in tables if line not in results] == []


def test_the_committed_records_rebuild_the_results_mosaic_tables(tmp_path, capsys):
    """RESULTS.md's tables of the test bed where attention must select are what `paper.py ablations --dataset
    fashion_recall --no-train` prints from results/runs.jsonl, line for line."""
    paper.main(['ablations', '--dataset', 'fashion_recall', '--no-train', '--out', str(tmp_path)])
    tables = [line for line in capsys.readouterr().out.splitlines() if line.startswith('|')]
    with open(os.path.join(os.path.dirname(paper.__file__), 'RESULTS.md')) as f:
        results = f.read().splitlines()
    assert len(tables) > 10 and [line for line in tables if line not in results] == []


def test_the_committed_recall_records_rebuild_the_results_recall_tables(tmp_path, capsys):
    """RESULTS.md's recall tables are what `paper.py recall --no-train` prints from results/recall.jsonl, line for
    line."""
    paper.main(['recall', '--no-train', '--out', str(tmp_path)])
    tables = [line for line in capsys.readouterr().out.splitlines() if line.startswith('|')]
    with open(os.path.join(os.path.dirname(paper.__file__), 'RESULTS.md')) as f:
        results = f.read().splitlines()
    assert len(tables) > 10 and [line for line in tables if line not in results] == []


def test_recall_verdict_reads_a_claimed_ordering():
    """b minus a, seed by seed: the ablations' verdict with "b above a" as the claimed side."""
    assert paper.verdict([10.0, 12.0, 11.0], paper.RECALL_CLAIM) == 'reproduced'
    assert paper.verdict([-10.0, -12.0, -11.0], paper.RECALL_CLAIM) == 'contradicted'
    assert paper.verdict([10.0, -12.0, 1.0], paper.RECALL_CLAIM) == 'not resolved'
    assert paper.verdict([0.0, 0.0, 0.0], paper.RECALL_CLAIM) == 'not resolved'  # both at 100 %, say
    mean, half = paper.interval([1.0, 2.0, 3.0])
    assert mean == 2.0 and abs(half - 4.303 * 1.0 / math.sqrt(3)) < 1e-3


# ---------------------------------------------------------------------------------------------------
# The README's "Changing the method": each recipe followed on a throwaway change, so the recipes cannot go stale

def readme_walk():
    """The README's "One block end to end": its two numbered lists of `file.py:function`, reference and fast."""
    with open(os.path.join(os.path.dirname(os.path.abspath(__file__)), 'README.md')) as f:
        section = f.read().split('## One block end to end')[1].split('\n## ')[0]
    lists, previous = [], None
    for line in section.splitlines():
        item = re.match(r'(\d+)\. `(\w+\.py:[\w.]+)`', line)
        if item:
            if item.group(1) == '1':
                lists.append([])
            lists[-1].append(item.group(2))
    return lists


def traced_calls(fn):
    """The functions of inline.py, models.py and kernels.py that fn() calls, as 'file.py:qualname', each once, in
    the order of their first call (generator expressions and lambdas left out)."""
    calls = []

    def record(frame, event, arg):
        name = f"{os.path.basename(frame.f_code.co_filename)}:{frame.f_code.co_qualname}"
        if event == 'call' and name.split(':')[0] in ('inline.py', 'models.py', 'kernels.py') and '<' not in name \
                and name not in calls:
            calls.append(name)
    sys.setprofile(record)
    try:
        fn()
    finally:
        sys.setprofile(None)
    return calls


def test_block_walk_is_the_readme():
    """The README's walk through one InLine-Swin block is what a forward calls: at most 12 functions in 2 files on
    the reference path; on the fast path the same, with the core that kernels.enable_fast put in."""
    reference_walk, fast_walk = readme_walk()
    torch.manual_seed(0)
    block = models.SwinBlock(32, 2, 'I', None, False, 4., 0., DEFAULTS)
    x = torch.randn(2, 64, 32)
    assert traced_calls(lambda: block(x, (8, 8))) == reference_walk
    assert len(reference_walk) <= 12 and {name.split(':')[0] for name in reference_walk} == {'inline.py', 'models.py'}
    kernels.enable_fast(block)
    block(x, (8, 8))  # compiled (or loaded from the cache) on the first call
    assert traced_calls(lambda: block(x, (8, 8))) == reference_walk[:8] + fast_walk + reference_walk[-1:]


def test_recipe_a_new_kernel_function(monkeypatch):
    """A kernel function phi is one entry of inline.KERNELS, and one of NON_NEGATIVE_KERNELS if phi >= 0."""
    monkeypatch.setitem(inline.KERNELS, 'softplus', F.softplus)
    monkeypatch.setattr(inline, 'NON_NEGATIVE_KERNELS', inline.NON_NEGATIVE_KERNELS + ('softplus',))
    phi = inline.get_kernel('softplus')
    q, k, v = qkv(2, 2, 49, 8)
    torch.testing.assert_close(inline.inline_attention(phi(q), phi(k), v),
                               inline.inline_attention_quadratic(phi(q), phi(k), v), rtol=0, atol=1e-12)
    assert_fast_model_equals_reference('inline_swin_t', kernel='softplus')
    assert meta_model('inline_swin_t', layout='LLLS', kernel='softplus')  # >= 0: linear attention takes it
    assert 'kernel softplus' in models.describe(meta_model('inline_swin_t', kernel='softplus'))


def test_recipe_another_neighbourhood_for_eq6():
    """Eq. 6 over 5x5 neighbours is one option, local_size=5: the weight layout, the reference, the fast path and
    the APE rule all take their tap count from it (the explicit loop at 5x5 is test_eq6_against_explicit_loop_on_a_non_square_grid)."""
    model = meta_model('inline_swin_t', local_size=5)
    attns = [m for m in model.modules() if isinstance(m, inline.InLineAttention)]
    assert attns and all(m.residual[2].out_channels == 25 * m.proj.in_features for m in attns)
    assert not model.ape and 'local_size 5' in models.describe(model)
    assert meta_model('inline_swin_t', local_size=1).ape  # a 1x1 neighbourhood is the plain residual: no position
    assert_fast_model_equals_reference('inline_swin_t', local_size=5)
    torch.manual_seed(0)
    one = models.create_model('inline_swin_t', local_size=1, **dict(FAST_SMALL['inline_swin_t'], num_classes=5))
    plain = models.create_model('inline_swin_t', residual='plain', **dict(FAST_SMALL['inline_swin_t'], num_classes=5))
    plain.load_state_dict(one.state_dict())  # the same parameters, the same keys
    x = torch.randn(2, 3, 64, 96)
    torch.testing.assert_close(one.eval()(x), plain.eval()(x), rtol=0, atol=0)


def test_recipe_a_new_experiment_by_name(monkeypatch):
    """An experiment is one models.experiment(...) line: models, train.py --experiment and paper.py find it."""
    monkeypatch.setattr(models, 'EXPERIMENTS', dict(models.EXPERIMENTS))
    models.experiment('r_local5', 'inline_swin_t', dict(local_size=5), 'R-res', None, "Eq. 6 over 5x5 neighbours",
                      ours=True)
    assert models.create_experiment('r_local5', img_size=64).options['local_size'] == 5
    run = resolved(['--experiment', 'r_local5'])
    assert run.args.model == 'inline_swin_t' and run.arch == dict(local_size=5)
    every = paper.experiments()
    assert 'r_local5' in every and paper.config_key(every['r_local5']) != paper.config_key(every['r_residual_local'])


def add_a_learnable_temperature(monkeypatch):
    """The README's recipe, as a reader makes it in inline.py: setup_inline makes Eq. 5's scale a per-head parameter
    (1, H, 1, 1) that starts at D^-1/2; prepare returns it, as it returns every scale."""
    setup = inline.InLineBase.setup_inline

    def setup_with_a_temperature(self, dim, num_heads, **options):
        setup(self, dim, num_heads, **options)
        self.scale = nn.Parameter(torch.full((1, num_heads, 1, 1), inline.attention_scale(dim // num_heads)))
    monkeypatch.setattr(inline.InLineBase, 'setup_inline', setup_with_a_temperature)


def test_recipe_a_learnable_temperature_in_eq5(monkeypatch):
    """A learnable per-head temperature as Eq. 5's scale: the fast core follows it (a tensor scale joins q), so the
    check passes and the whole model's logits and every gradient, the temperature's included, equal the reference's;
    and three optimizer steps move it alike on both paths."""
    add_a_learnable_temperature(monkeypatch)
    assert_fast_model_equals_reference('inline_swin_t')
    torch.manual_seed(0)
    pair = [nn.Module(), nn.Module()]
    pair[0].attn, pair[1].attn = perturb(inline.InLineAttention(32, 2)), inline.InLineAttention(32, 2)
    pair[1].load_state_dict(pair[0].state_dict())
    assert kernels.enable_fast(pair[1]) == 1
    x, target = torch.randn(4, 49, 32), torch.randn(4, 49, 32)
    for block in pair:
        optimizer = torch.optim.SGD(block.parameters(), lr=0.1)  # linear in the gradients, as AdamW's first steps are not
        for _ in range(3):
            optimizer.zero_grad()
            F.mse_loss(block.attn(x, (7, 7)), target).backward()
            optimizer.step()
    taus = [block.attn.scale.flatten() for block in pair]
    print('temperature after 3 steps, reference and fast:', taus[0].tolist(), taus[1].tolist())
    assert (taus[0] - 16 ** -0.5).abs().min() > 1e-3  # it trained from D^-1/2
    torch.testing.assert_close(taus[1], taus[0], rtol=1e-5, atol=1e-6)


def test_fast_path_refuses_a_core_that_drops_a_gradient(monkeypatch):
    """The check at build time: a fast core that ignored the scale's gradient (as one that detached its inputs did)
    is refused before any step, naming the module, the quantity, both values and the way out."""
    add_a_learnable_temperature(monkeypatch)
    block = nn.Module()
    block.attn = inline.InLineAttention(32, 2)

    def detaching_core(q, k, v, r, grid, scale, *args):
        return kernels.inline_core_fast(q, k, v, r, grid, scale.detach(), *args)
    with pytest.raises(ValueError, match=r"does not compute what attn \(InLineAttention\) computes on the reference "
                                         r"path: gradient of attn\.scale: reference \d\.\de[+-]\d\d, fast none\. Build "
                                         r"the model with fast=False \(train\.py: --attention-impl reference\)"):
        kernels.enable_fast(block, core=detaching_core)
    assert block.attn.core is inline.inline_core  # refused: nothing swapped


def eq6_weights_per_token(mlp, x, causal=False):
    """The README's recipe for another Eq. 6 predictor: weights from each token, (B, N, T*C), not from the mean."""
    return mlp(x.transpose(1, 2)).transpose(1, 2)  # (B, C, N) -> (B, T*C, N) -> (B, N, T*C)


def test_recipe_eq6_weights_per_token(monkeypatch):
    """Eq. 6 weights predicted per token: the reference applies them (inline.local_residual takes r per token, and
    equals the per-sample form when every token's weights are the same), and the model trains on it; the fast core
    has one weight set per sample, so create_model(fast=True) refuses it when the model is built, naming the module,
    what failed and the way out."""
    q, k, v = qkv(2, 2, 1 + 12, 4)
    r = torch.randn(2, 9 * 8, dtype=torch.float64)
    torch.testing.assert_close(inline.local_residual(v, r[:, None].expand(2, 13, -1), (3, 4)),
                               inline.local_residual(v, r, (3, 4)), rtol=0, atol=1e-14)
    monkeypatch.setattr(inline, 'residual_weights', eq6_weights_per_token)
    torch.manual_seed(0)
    config = dict(FAST_SMALL['inline_deit_t'], num_classes=5)
    model = models.create_model('inline_deit_t', **config)
    F.cross_entropy(model(torch.randn(2, 3, 48, 80)), torch.tensor([0, 1])).backward()
    assert model.blocks[0].attn.residual[0].weight.grad.abs().max() > 0
    with pytest.raises(ValueError, match=r"blocks\.0\.attn \(InLineAttention\) computes on the reference path: the fast "
                                         r"core raised ValueError: r must hold 3x3 neighbour weights per channel.*"
                                         r"Build the model with fast=False"):
        models.create_model('inline_deit_t', fast=True, **config)


def test_readme_vit_example_runs_on_both_paths():
    """The README's own ViT, run as written: a class token first, then the patch grid; the fast path's logits and
    gradients equal the reference's."""
    scope = {}
    exec(readme_block('### InLine attention in your own ViT'), scope)
    reference, fast = scope['TinyViT'](), scope['TinyViT']()
    fast.load_state_dict(reference.state_dict())
    assert kernels.enable_fast(fast, log=None) == 2
    x, upstream = torch.randn(2, 3, 32, 32), torch.randn(2, 10)
    logits = [model(x) for model in (reference, fast)]
    for model, out in zip((reference, fast), logits):
        out.backward(upstream)
    torch.testing.assert_close(logits[1], logits[0], rtol=1e-5, atol=1e-5)
    for (key, p), q in zip(reference.named_parameters(), fast.parameters()):
        assert (q.grad - p.grad).abs().max().item() <= 1e-4 * p.grad.abs().max().item() + 1e-7, key


HERE = os.path.dirname(os.path.abspath(__file__))
DOCUMENTS = ['README.md', 'RESULTS.md', 'inline.py', 'kernels.py', 'models.py', 'train.py', 'paper.py', 'test_inline.py']


def prose(document):
    """What a document says to its reader: a Markdown file whole; of a Python file, its docstrings and comments."""
    text = open(os.path.join(HERE, document)).read()
    if not document.endswith('.py'):
        return text
    nodes = [n for n in ast.walk(ast.parse(text)) if isinstance(n, (ast.Module, ast.ClassDef, ast.FunctionDef))]
    comments = [tok.string for tok in tokenize.generate_tokens(io.StringIO(text).readline) if tok.type == tokenize.COMMENT]
    return '\n'.join([ast.get_docstring(n) or '' for n in nodes] + comments)


def test_the_documents_name_only_what_exists():
    """Every test the README, RESULTS.md and the files' docstrings and comments name is a test here; every
    `python <file>.py [command]` they give has an entry point (and paper.py the command); every picture and record
    the README and RESULTS.md show is in figures/ or results/; every `inline.X`, `kernels.X`, `models.X`, `train.X`,
    `paper.X` and `<file>.py:Name` the README names is there."""
    tests = set(re.findall(r'^def (test_\w+)', open(os.path.join(HERE, 'test_inline.py')).read(), re.M))
    commands = set(re.findall(r"sub\.add_parser\('(\w+)'", open(os.path.join(HERE, 'paper.py')).read()))
    modules = dict(inline=inline, kernels=kernels, models=models, train=train, paper=paper)
    missing = []
    for document in DOCUMENTS:
        text = prose(document)
        missing += [f"{document}: {name}" for name in re.findall(r'\b(test_\w+)\b(?!\.py)', text) if name not in tests]
        for script, command in re.findall(r'python (?:-m )?(\w+)\.py(?: ([a-z]\w*))?', text):
            path = os.path.join(HERE, f'{script}.py')
            if not os.path.exists(path) or "if __name__ == '__main__':" not in open(path).read():
                missing.append(f"{document}: python {script}.py (no entry point)")
            elif script == 'paper' and command and command not in commands:
                missing.append(f"{document}: python paper.py {command} (no such command)")
    for document in ('README.md', 'RESULTS.md'):  # the pictures and records they show or cite
        for path in re.findall(r'\b((?:figures|results|golden)/[\w./-]*\w)', prose(document)):
            if not os.path.exists(os.path.join(HERE, path)):
                missing.append(f"{document}: {path}")
    readme = open(os.path.join(HERE, 'README.md')).read()
    for module, name in re.findall(r'(?<![\w.])(inline|kernels|models|train|paper)\.([A-Za-z_]\w*)', readme):
        if name != 'py' and not hasattr(modules[module], name):
            missing.append(f"README.md: {module}.{name}")
    for module, path in re.findall(r'\b(inline|kernels|models|train|paper)\.py:([\w.]+)', readme):
        obj = modules[module]
        for part in path.split('.'):
            obj = getattr(obj, part, None)
        if obj is None:
            missing.append(f"README.md: {module}.py:{path}")
    assert not missing, f"named but not there: {sorted(set(missing))}"


def test_a_failure_reads_on_one_screen(tmp_path):
    """A failing assertion in a test that uses the fast path, while torch's trace logger writes debug records (as
    it does while compiling), shows its message within 40 lines of the report and none of those records: pytest.ini
    keeps what torch logs out of failure reports."""
    test = tmp_path / 'test_failing.py'
    test.write_text(f"""import logging, sys
sys.path.insert(0, {HERE!r})
import torch, kernels

def test_fails():
    trace = logging.getLogger('torch.__trace')
    trace.propagate = True
    for i in range(300):
        trace.debug('a torch trace record %d', i)
    q, k, v = (torch.randn(2, 2, 49, 8) for _ in range(3))
    assert kernels.inline_core_fast(q, k, v, None, (7, 7)).sum().item() == 12345.0, 'the deliberate message'
""")
    result = subprocess.run([sys.executable, '-m', 'pytest', '-q', '-p', 'no:cacheprovider', '-c',
                             os.path.join(HERE, 'pytest.ini'), '--rootdir', str(tmp_path), str(test)],
                            capture_output=True, text=True, timeout=300, cwd=tmp_path)
    lines = result.stdout.splitlines()
    assert result.returncode == 1, result.stdout[-2000:]
    first = next(i for i, line in enumerate(lines) if 'AssertionError: the deliberate message' in line)
    print(f"the message on line {first + 1} of {len(lines)}")
    assert first < 40 and not any('a torch trace record 7' in line for line in lines)  # a record, not the source


def test_grid_and_leading_tokens_are_declared():
    """The module says how many tokens precede its grid; any other N is an error naming N, the grid and that count,
    and a grid that is not a pair of positive whole numbers says so. DeiT's attention declares its class token."""
    x = torch.randn(1, 17, 32)
    with pytest.raises(ValueError, match=r"17 tokens, but this attention declares 0 leading token\(s\).* before its "
                                         r"3x5 grid: N must be 0 \+ 15 = 15"):
        inline.InLineAttention(32, 2)(x, (3, 5))
    with pytest.raises(ValueError, match=r"17 tokens, but this attention declares 1 leading token"):
        inline.InLineAttention(32, 2, leading_tokens=1)(x, (3, 5))
    assert inline.InLineAttention(32, 2, leading_tokens=2)(x, (3, 5)).shape == x.shape
    for grid in (4, (4,), (4, 0), (2.0, 8), (True, 8), '44'):
        with pytest.raises(ValueError, match=r"grid must be a pair \(h, w\) of positive whole numbers"):
            inline.InLineAttention(32, 2)(torch.randn(1, 16, 32), grid)
    with pytest.raises(ValueError, match=r"leading_tokens .* must be a whole number >= 0, and 0 on a 1-D sequence"):
        inline.InLineAttention(32, 2, causal=True, leading_tokens=1)
    with pytest.raises(ValueError, match=r"declares 0 leading token"):
        models.SoftmaxAttention(32, 2)(x, (3, 5))
    assert [meta_model('inline_deit_t', layout=c).blocks[0].attn.leading_tokens for c in 'IS'] == [1, 1]
    assert {m.leading_tokens for m in meta_model('inline_swin_t').modules() if hasattr(m, 'core')} == {0}


# ===================================================================================================
# train.py, run as a user runs it: in a subprocess (one process, or two under torchrun with gloo), on
# the smallest variant at the smallest size; checks what it leaves behind and what it prints

TRAIN = os.path.join(os.path.dirname(os.path.abspath(__file__)), 'train.py')
# the smallest variant at the smallest size it takes; the reference attention needs no compilation; one thread
# per process, so that a busy machine slows the tests down rather than stalling them
TINY_ARGS = ['--model', 'inline_deit_t', '--attention-impl', 'reference', '--img-size', '32', '--batch-size', '8',
        '--workers', '0', '--threads', '1']
SYNTHETIC_ARGS = TINY_ARGS + ['--synthetic-train', '48', '--synthetic-val', '21', '--epochs', '2']


def command(args, nproc=1):
    launcher = [sys.executable, '-m', 'torch.distributed.run', '--standalone', f'--nproc_per_node={nproc}']
    return (launcher if nproc > 1 else [sys.executable]) + [TRAIN, *args]


def run_train(args, nproc=1, ok=True, timeout=600, cwd=None):
    result = subprocess.run(command(args, nproc), capture_output=True, text=True, timeout=timeout, cwd=cwd)
    if ok and result.returncode != 0:
        raise AssertionError(f'train.py failed ({result.returncode}):\n{result.stdout[-3000:]}\n'
                             f'{result.stderr[-3000:]}')
    return result


def metrics(output_dir):
    with open(os.path.join(output_dir, 'metrics.jsonl')) as f:
        return [json.loads(line) for line in f]


def printed(stdout, prefix):
    """The JSON object train.py printed after `prefix` (e.g. 'eval model: ')."""
    return json.loads(next(line for line in stdout.splitlines() if line.startswith(prefix))[len(prefix):])


def load_checkpoint_file(path):
    return torch.load(path, map_location='cpu', weights_only=True)


@pytest.fixture(scope='module')
def two_process_run(tmp_path_factory):
    """Two processes under torchrun, two epochs of the synthetic task; shared by the tests below."""
    output_dir = str(tmp_path_factory.mktemp('run'))
    result = run_train(SYNTHETIC_ARGS + ['--output-dir', output_dir], nproc=2)
    return output_dir, result


def test_two_processes_train_and_write_checkpoints(two_process_run):
    output_dir, result = two_process_run
    assert 'schedule: 2 epochs' in result.stdout and 'data: synthetic' in result.stdout
    log = metrics(output_dir)
    assert [e['epoch'] for e in log] == [1, 2]
    assert all(e['val_images'] == 21 for e in log)  # every image once: 11 + 10, no padding
    assert 'val_correct' not in log[0]  # per-image results: the final evaluation's only, each image once
    assert train.unpack_correct(log[-1]['val_correct'], 21).sum().item() == round(log[-1]['val_acc1'] * 21 / 100)
    ckpt = load_checkpoint_file(os.path.join(output_dir, 'checkpoint.pt'))
    assert ckpt['epoch'] == 2 and ckpt['step'] == 0 and len(ckpt['rng']) == 2
    assert ckpt['args']['model'] == 'inline_deit_t' and ckpt['log'] == log
    assert {'model', 'optimizer', 'scheduler', 'scaler', 'model_ema'} <= ckpt.keys()
    best = load_checkpoint_file(os.path.join(output_dir, 'best.pt'))
    assert best['best_acc1'] == max(e['val_acc1'] for e in log)
    assert not [f for f in os.listdir(output_dir) if f.endswith('.tmp')]


def test_eval_reproduces_the_logged_accuracy(two_process_run):
    output_dir, _ = two_process_run
    result = run_train(SYNTHETIC_ARGS + ['--eval', '--checkpoint', os.path.join(output_dir, 'checkpoint.pt')], nproc=2)
    evaluated, logged = printed(result.stdout, 'eval model: '), metrics(output_dir)[-1]
    assert evaluated['images'] == 21
    assert evaluated['acc1'] == logged['val_acc1'] and evaluated['acc5'] == logged['val_acc5']
    assert evaluated['correct_sha256'] == hashlib.sha256(logged['val_correct'].encode()).hexdigest()[:16]
    assert evaluated['loss'] == pytest.approx(logged['val_loss'], rel=1e-6)


def test_evaluate_keeps_each_images_result_at_its_place_in_the_validation_set():
    """train.evaluate's per-image results sit at each image's index in the validation set whatever slice a rank
    holds (here rank 1 of 2: images 1, 3, 5, ...; the other rank's places stay 0 until all_reduce adds them) and
    count the top-1 it reports; unpack_correct reads pack_correct back."""
    torch.manual_seed(0)
    x, y = torch.randn(11, 4), torch.randint(0, 3, (11,))
    model = nn.Linear(4, 3)
    run = types.SimpleNamespace(device=torch.device('cpu'), world=1, autocast=lambda training: contextlib.nullcontext())
    data = torch.utils.data.TensorDataset(x, y)
    result = train.evaluate(run, model, torch.utils.data.DataLoader(torch.utils.data.Subset(data, range(1, 11, 2)),
                                                                    batch_size=2))
    right = model(x).argmax(1) == y
    expected = torch.zeros(11, dtype=torch.bool)
    expected[1::2] = right[1::2]
    assert torch.equal(train.unpack_correct(result['correct'], 11), expected) and result['images'] == 5
    assert result['acc1'] == pytest.approx(100 * right[1::2].double().mean().item())


def test_evaluate_on_a_rank_with_no_images(monkeypatch):
    """Three ranks, two images: rank 2's slice is empty; its evaluate adds zeros, and all_reduce (here rank 0's and
    rank 1's sums, added by a stand-in) gives every image's result."""
    torch.manual_seed(0)
    x, y = torch.randn(2, 4), torch.tensor([0, 1])
    model, data = nn.Linear(4, 3), torch.utils.data.TensorDataset(x, y)
    runs = [types.SimpleNamespace(device=torch.device('cpu'), world=3, rank=r, args=types.SimpleNamespace(
        batch_size=4, workers=0), autocast=lambda training: contextlib.nullcontext()) for r in range(3)]
    monkeypatch.setattr(train.dist, 'all_reduce', lambda t: None)
    parts = [train.evaluate(runs[r], model, train.val_loader(runs[r], data)) for r in (0, 1)]
    others = torch.tensor([float(sum(p['images'] * p['loss'] for p in parts)),
                           float(sum(round(p['acc1'] * p['images'] / 100) for p in parts)), 0.0, 2.0])
    correct = train.unpack_correct(parts[0]['correct'], 2) | train.unpack_correct(parts[1]['correct'], 2)

    def add_others(t):  # what the other two ranks contribute
        t += others.to(t.dtype) if t.dtype == torch.float64 else correct.to(t.dtype)
    monkeypatch.setattr(train.dist, 'all_reduce', add_others)
    result = train.evaluate(runs[2], model, train.val_loader(runs[2], data))
    assert result['images'] == 2
    assert torch.equal(train.unpack_correct(result['correct'], 2), model(x).argmax(1) == y)


def test_non_finite_loss_stops_and_keeps_the_last_checkpoint(two_process_run, tmp_path):
    torch.manual_seed(0)
    ckpt = load_checkpoint_file(os.path.join(two_process_run[0], 'checkpoint.pt'))
    name = next(iter(ckpt['model']))
    ckpt['model'][name] = torch.full_like(ckpt['model'][name], float('nan'))
    path = str(tmp_path / 'checkpoint.pt')
    torch.save(ckpt, path)
    digest = hashlib.sha256(open(path, 'rb').read()).hexdigest()
    result = run_train(TINY_ARGS + ['--synthetic-train', '48', '--synthetic-val', '21', '--epochs', '3',
                           '--output-dir', str(tmp_path)], ok=False)
    assert result.returncode != 0 and 'the loss is not finite' in result.stderr
    assert hashlib.sha256(open(path, 'rb').read()).hexdigest() == digest


@pytest.mark.parametrize('mode', ['--eval', '--resume'])
def test_checkpoint_of_another_model_is_refused(two_process_run, mode, tmp_path):
    """--eval's case runs under torchrun, where the error must print once, not once per process."""
    path = os.path.join(two_process_run[0], 'checkpoint.pt')
    args = SYNTHETIC_ARGS + ['--model', 'inline_pvt_t', '--output-dir', str(tmp_path)]
    result = run_train(args + ([mode, '--checkpoint', path] if mode == '--eval' else [mode, path]), ok=False,
                       nproc=2 if mode == '--eval' else 1)
    message = 'is a checkpoint of inline_deit_t, not of --model inline_pvt_t'
    assert result.returncode != 0 and result.stderr.count(message) == 1, result.stderr[-2000:]


# the README's two-node launch; here both nodes are this machine, one process each
TWO_NODES = 'torchrun --nnodes=2 --nproc_per_node={nproc} --rdzv-id=inline --rdzv-backend=c10d --rdzv-endpoint={host}'


def test_two_nodes_end_with_the_weights_of_one_node_with_two_processes(two_process_run, tmp_path):
    """The README's command for two nodes, on 127.0.0.1: two torchrun launchers of one process each train the
    same weights as the two processes of one node."""
    with open(os.path.join(os.path.dirname(TRAIN), 'README.md')) as f:
        assert TWO_NODES.format(nproc=8, host='HOST:29500') in f.read()
    with socket.socket() as s:  # a free port for the rendezvous
        s.bind(('127.0.0.1', 0))
        port = s.getsockname()[1]
    launcher = TWO_NODES.format(nproc=1, host=f'127.0.0.1:{port}').split()[1:]
    output_dir = str(tmp_path)
    nodes = [subprocess.Popen([sys.executable, '-m', 'torch.distributed.run', *launcher, TRAIN, *SYNTHETIC_ARGS,
                               '--output-dir', output_dir], stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
             for _ in range(2)]
    for node in nodes:
        output, _ = node.communicate(timeout=600)
        assert node.returncode == 0, output[-3000:]
    one_node, two_nodes = (load_checkpoint_file(os.path.join(d, 'checkpoint.pt'))
                           for d in (two_process_run[0], output_dir))
    assert two_nodes['epoch'] == 2 and one_node['model'].keys() == two_nodes['model'].keys()
    assert all(torch.equal(one_node['model'][k], two_nodes['model'][k]) for k in one_node['model'])


@pytest.mark.parametrize('local_rank', [0, 1])
def test_more_processes_than_gpus_on_a_node_is_refused(local_rank, monkeypatch, capsys):
    """Two processes on a node with one GPU (faked): stop before any process touches a device; the node's
    first process names both numbers and the flag."""
    monkeypatch.setattr(torch.cuda, 'is_available', lambda: True)
    monkeypatch.setattr(torch.cuda, 'device_count', lambda: 1)
    for name in ('set_device', 'init', 'current_device'):
        monkeypatch.setattr(torch.cuda, name, lambda *a: pytest.fail('a device was touched'))
    monkeypatch.setattr(train.dist, 'init_process_group', lambda *a, **k: pytest.fail('a process group started'))
    for key, value in dict(RANK=2 + local_rank, WORLD_SIZE=4, LOCAL_RANK=local_rank, LOCAL_WORLD_SIZE=2).items():
        monkeypatch.setenv(key, str(value))
    with pytest.raises(SystemExit):
        train.setup(train.get_args_parser().parse_args(TINY_ARGS))
    error = capsys.readouterr().err
    if local_rank == 0:
        assert 'started 2 processes on this node, which has 1 GPU' in error and '--nproc-per-node=1' in error
    else:
        assert error == ''


# ------------------------------------------------------------------------------------- nothing is lost
# Mixup, CutMix, drop path and EMA are on, so any random stream or state not restored changes the weights;
# gradient accumulation too, so a mid-epoch resume must skip whole accumulation groups.
RESUMABLE = TINY_ARGS + ['--synthetic-train', '160', '--synthetic-val', '16', '--epochs', '3', '--mixup', '0.8',
                    '--cutmix', '1.0', '--drop-path', '0.1', '--ema-decay', '0.9', '--accum-steps', '2']


def final_weights(output_dir):
    ckpt = load_checkpoint_file(os.path.join(output_dir, 'checkpoint.pt'))
    assert ckpt['epoch'] == 3
    return {**ckpt['model'], **{f'ema.{k}': v for k, v in ckpt['model_ema'].items()}}


def interrupt(args, output_dir, sig):
    """Start a two-process run; once epoch 1 is saved, send `sig` to torchrun (SIGTERM: it forwards it to
    the workers) or to torchrun and both workers (SIGKILL: nothing gets to clean up)."""
    process = subprocess.Popen(command(args, nproc=2), stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    deadline = time.time() + 300
    while not os.path.exists(os.path.join(output_dir, 'metrics.jsonl')):
        assert process.poll() is None and time.time() < deadline, 'the run ended before epoch 1 was saved'
        time.sleep(0.05)
    time.sleep(0.3)  # into epoch 2
    assert process.poll() is None, 'the run ended before it could be interrupted'
    with open(f'/proc/{process.pid}/task/{process.pid}/children') as f:
        workers = [int(pid) for pid in f.read().split()]
    for pid in [process.pid] + (workers if sig == signal.SIGKILL else []):
        os.kill(pid, sig)
    output, _ = process.communicate(timeout=120)
    assert len(metrics(output_dir)) < 3, 'the interruption came too late to test anything'
    return output


@pytest.fixture(scope='module')
def uninterrupted(tmp_path_factory):
    output_dir = str(tmp_path_factory.mktemp('uninterrupted'))
    run_train(RESUMABLE + ['--output-dir', output_dir], nproc=2)
    return output_dir


@pytest.mark.parametrize('sig', [signal.SIGKILL, signal.SIGTERM], ids=['kill-9', 'sigterm'])
def test_interrupted_and_resumed_equals_uninterrupted(uninterrupted, sig, tmp_path):
    reference, interrupted = uninterrupted, str(tmp_path / 'interrupted')
    output = interrupt(RESUMABLE + ['--output-dir', interrupted], interrupted, sig)
    if sig == signal.SIGTERM:  # saved where it stopped, mid-epoch
        assert 'SIGTERM: saved' in output and load_checkpoint_file(os.path.join(interrupted, 'checkpoint.pt'))['step'] > 0
    result = run_train(RESUMABLE + ['--output-dir', interrupted], nproc=2)  # the same command, rerun
    assert 'resumed from' in result.stdout
    expected, got = final_weights(reference), final_weights(interrupted)
    assert expected.keys() == got.keys()
    assert all(torch.equal(expected[k], got[k]) for k in expected), 'resumed weights differ'
    val = lambda log: [{k: v for k, v in e.items() if 'val_' in k} for e in log]  # noqa: E731
    assert val(metrics(interrupted)) == val(metrics(reference))
    assert sorted(os.listdir(interrupted)) == ['best.pt', 'checkpoint.pt', 'metrics.jsonl']  # no .tmp left


# ------------------------------------------------------------------------------------------ real images
def write_image_folder(root, counts, seed=0):
    """Two classes of 32 px PNGs told apart by colour: root/<split>/<class>/<i>.png."""
    g = torch.Generator().manual_seed(seed)
    for split, count in counts.items():
        for label, colour in enumerate(('red', 'blue')):
            os.makedirs(os.path.join(root, split, colour), exist_ok=True)
            for i in range(count):
                img = torch.rand(32, 32, 3, generator=g) * 0.3
                img[..., 0 if label == 0 else 2] += 0.7
                Image.fromarray((img * 255).byte().numpy()).save(os.path.join(root, split, colour, f'{i}.png'))


def test_image_folder_trains_and_evaluates(tmp_path):
    torch.manual_seed(0)
    root, output_dir = str(tmp_path / 'data'), str(tmp_path / 'run')
    write_image_folder(root, {'train': 8, 'val': 3})
    # the released recipe (RandAugment, Mixup/CutMix, random erasing, ...) at a tiny scale: 2 steps of 2 x 4 images
    args = TINY_ARGS + ['--data-path', root, '--batch-size', '4', '--accum-steps', '2', '--epochs', '2',
                   '--warmup-epochs', '1', '--workers', '1', '--output-dir', output_dir]
    result = run_train(args)
    assert 'released ImageNet-1K recipe' in result.stdout
    log = metrics(output_dir)
    assert len(log) == 2 and log[-1]['val_images'] == 6
    result = run_train(args + ['--eval', '--checkpoint', os.path.join(output_dir, 'checkpoint.pt')])
    assert printed(result.stdout, 'eval model: ')['acc1'] == log[-1]['val_acc1']


# ------------------------------------------------------------------- small datasets, read from their own files
def write_idx(path, array):
    """An IDX file as MNIST's are distributed: gzipped, 0 0 8 D, D big-endian sizes, uint8 data."""
    a = np.asarray(array, dtype=np.uint8)
    with gzip.open(path, 'wb') as f:
        f.write(bytes([0, 0, 8, a.ndim]) + b''.join(int(n).to_bytes(4, 'big') for n in a.shape) + a.tobytes())


def write_fashion_mnist(root, train=12, test=6, seed=0):
    """The four .gz files of Fashion-MNIST in one plain folder (as Debian's package installs them), tiny."""
    g = np.random.default_rng(seed)
    data = {}
    for prefix, n in (('train', train), ('t10k', test)):
        images, labels = g.integers(0, 256, (n, 28, 28)), np.arange(n) % 10
        write_idx(os.path.join(root, f'{prefix}-images-idx3-ubyte.gz'), images)
        write_idx(os.path.join(root, f'{prefix}-labels-idx1-ubyte.gz'), labels)
        data[prefix] = images, labels
    return data


def write_cifar(root, name, per_batch=4, seed=0):
    """CIFAR-10's or CIFAR-100's python batches, tiny: rows of 3072 bytes, channel-major, as distributed."""
    import pickle
    g = np.random.default_rng(seed)
    ten = name == 'cifar10'
    folder = os.path.join(root, 'cifar-10-batches-py' if ten else 'cifar-100-python')
    os.makedirs(folder)
    key = 'labels' if ten else 'fine_labels'
    files = [f'data_batch_{i}' for i in range(1, 6)] + ['test_batch'] if ten else ['train', 'test']
    written = {}
    for file in files:
        data, labels = g.integers(0, 256, (per_batch, 3072), dtype=np.uint8), list(g.integers(0, 10, per_batch))
        with open(os.path.join(folder, file), 'wb') as f:
            pickle.dump({'data': data, key: labels}, f)
        written[file] = data, labels
    with open(os.path.join(folder, 'batches.meta' if ten else 'meta'), 'wb') as f:
        pickle.dump({'label_names' if ten else 'fine_label_names': [f'c{i}' for i in range(10 if ten else 100)]}, f)
    return written


def test_fashion_mnist_reads_from_a_plain_folder_of_idx_files(tmp_path):
    data = write_fashion_mnist(str(tmp_path))
    images, labels, classes = train.read_small('fashion_mnist', str(tmp_path), train=True)
    assert images.shape == (12, 3, 28, 28) and all(torch.equal(images[:, c], torch.tensor(data['train'][0],
                                                                                        dtype=torch.uint8)) for c in range(3))
    assert labels.tolist() == data['train'][1].tolist() and classes == datasets.FashionMNIST.classes
    # torchvision's layout, ROOT/FashionMNIST/raw, uncompressed, reads the same
    raw = tmp_path / 'tv' / 'FashionMNIST' / 'raw'
    raw.mkdir(parents=True)
    for file in os.listdir(tmp_path):
        if file.endswith('.gz'):
            (raw / file[:-3]).write_bytes(gzip.decompress((tmp_path / file).read_bytes()))
    assert torch.equal(train.read_small('fashion_mnist', str(tmp_path / 'tv'), train=False)[0][:, 0],
                       torch.tensor(data['t10k'][0], dtype=torch.uint8))
    # grayscale read as 3 equal channels, at the asked size; a fixed subset of training images whatever the seed
    args = train.get_args_parser().parse_args(['--dataset', 'fashion_mnist', '--data-path', str(tmp_path),
                                               '--img-size', '32', '--train-subset', '5'])
    args.model = 'inline_deit_t'
    train_set, val_set = train.load_data(args)
    x, y = val_set[1]
    pixels = x * torch.tensor(train.STD)[:, None, None] + torch.tensor(train.MEAN)[:, None, None]
    assert x.shape == (3, 32, 32) and y == 1 and torch.allclose(pixels[0], pixels[1], atol=1e-6)
    assert len(train_set) == 5 and train_set.classes == val_set.classes == datasets.FashionMNIST.classes
    args.seed = 7
    assert train.load_data(args)[0].indices == train_set.indices


@pytest.mark.parametrize('task, pairs, query', [('recall', 2, 'other'), ('recall', 4, 'same'), ('below', None, None)])
def test_fashion_recall_labels_follow_from_each_mosaics_layout(tmp_path, task, pairs, query):
    """Every label of a batch of mosaics, checked against the layout: recall's keys and values distinct in class, each
    key right above its value, the framed query of one key's class (the key's own image with query='same'), the
    label that key's value; below's cells all filled, its framed item in row 1, the label the class right below it
    and distinct from the two cells in the same slot of the other 2x2 blocks (what a network without attention
    cannot tell apart). The pixels are the layout's items (at 14 px, in their cells) with the framed cell's border
    lit; test mosaics hold test images."""
    write_fashion_mnist(str(tmp_path), train=30, test=20)
    recall = ['--recall-pairs', str(pairs), '--recall-query', query] if task == 'recall' else []
    args = train.get_args_parser().parse_args(['--dataset', 'fashion_recall', '--data-path', str(tmp_path),
                                               '--recall-task', task, *recall, '--synthetic-train', '40',
                                               '--synthetic-val', '30'])
    args.seed = 0
    train_set, val_set = train.load_data(args)
    assert (len(train_set), len(val_set)) == (40, 30) and train_set.classes == datasets.FashionMNIST.classes
    test_images, test_labels, _ = train.read_small('fashion_mnist', str(tmp_path), train=False)
    for i in range(30):
        classes, roles, images, label = val_set.layout(i)
        cells = {(r, c): (classes[r][c], roles[r][c], images[r][c]) for r in range(4) for c in range(4)}
        framed = [cell for cell, (_, role, _) in cells.items() if role in ('query', 'framed')]
        assert len(framed) == 1
        (fr, fc), = framed
        if task == 'recall':
            keys = [cell for cell, (_, role, _) in cells.items() if role == 'key']
            assert len(keys) == pairs and all(cells[r + 1, c][1] == 'value' for r, c in keys)
            assert len({cells[k][0] for k in keys}) == pairs == len({cells[r + 1, c][0] for r, c in keys})
            (kr, kc), = [k for k in keys if cells[k][0] == cells[fr, fc][0]]
            assert label == cells[kr + 1, kc][0]
            assert (cells[fr, fc][2] == cells[kr, kc][2]) == (query == 'same') or query == 'other'
        else:
            assert fr == 1 and cells[2, fc][1] == 'below' and label == cells[2, fc][0]
            assert all(source >= 0 for _, _, source in cells.values())
            same_slot = [(r, c) for r in (0, 2) for c in (fc % 2, fc % 2 + 2)]  # row 0 of each block, fc's column
            assert len({cells[cell][0] for cell in same_slot if cell != (0, fc)}) == 3
        assert all(test_labels[source] == c for c, _, source in cells.values() if source >= 0)  # the test split's
        x, y = val_set[i]
        pixels = (x * torch.tensor(train.STD)[:, None, None] + torch.tensor(train.MEAN)[:, None, None])[0] * 255
        assert y == label and x.shape == (3, 64, 64)
        for (r, c), (_, role, source) in cells.items():
            inner = pixels[16 * r + 1:16 * r + 15, 16 * c + 1:16 * c + 15]
            expected = val_set.items[source].float() if source >= 0 else torch.zeros(14, 14)
            torch.testing.assert_close(inner, expected, rtol=0, atol=1e-3)
            border = pixels[16 * r:16 * r + 16, 16 * c:16 * c + 16].clone()
            border[1:-1, 1:-1] = 255 if role in ('query', 'framed') else 0
            assert (border == 255).all() if role in ('query', 'framed') else (border.abs() < 1e-3).all()
    if task == 'below':  # pairs and a query are recall's
        with pytest.raises(SystemExit):
            train.FashionRecall(test_images, test_labels, 1, 0, False, task='below', pairs=3)


@pytest.mark.parametrize('name', ['cifar10', 'cifar100'])
def test_cifar_reads_its_python_batches(tmp_path, name):
    written = write_cifar(str(tmp_path), name)
    images, labels, classes = train.read_small(name, str(tmp_path), train=True)
    files = [f'data_batch_{i}' for i in range(1, 6)] if name == 'cifar10' else ['train']
    expected = np.concatenate([written[f][0] for f in files]).reshape(-1, 3, 32, 32)  # channel-major rows
    assert torch.equal(images, torch.from_numpy(expected)) and images.shape == (4 * len(files), 3, 32, 32)
    assert labels.tolist() == sum((list(written[f][1]) for f in files), [])
    assert len(classes) == (10 if name == 'cifar10' else 100)
    test_images = train.read_small(name, str(tmp_path), train=False)[0]
    assert test_images.shape == (4, 3, 32, 32)


def test_a_missing_small_dataset_says_how_to_get_it(tmp_path, capsys):
    with pytest.raises(SystemExit):
        train.read_small('fashion_mnist', str(tmp_path), train=True)
    err = capsys.readouterr().err
    assert 'apt-get install dataset-fashion-mnist' in err and '--download' in err


def test_fashion_mnist_trains_with_the_small_image_recipe(tmp_path):
    """train.py on the tiny IDX files: its recipe printed, validation every --val-every epochs, the dataset stored in
    the checkpoint's arguments."""
    os.makedirs(tmp_path / 'fm')
    write_fashion_mnist(str(tmp_path / 'fm'), train=16, test=6)
    output_dir = str(tmp_path / 'run')
    result = run_train(TINY_ARGS + ['--dataset', 'fashion_mnist', '--data-path', str(tmp_path / 'fm'), '--epochs', '2',
                                    '--val-every', '2',
                                    '--output-dir', output_dir])
    assert 'small-image recipe for fashion_mnist (random crop padded by 4 px, flip' in result.stdout
    log = metrics(output_dir)  # validated every 2 epochs: not after the first
    assert 'val_acc1' not in log[0] and log[1]['val_images'] == 6
    args = load_checkpoint_file(os.path.join(output_dir, 'checkpoint.pt'))['args']
    assert args['dataset'] == 'fashion_mnist' and args['data_path'] == str(tmp_path / 'fm')


def test_throughput_prints_images_per_second():
    """--throughput takes the default precision from train.default_amp, and the model line says why."""
    result = run_train(TINY_ARGS + ['--throughput', '--batch-size', '2'])
    amp, why = re.search(r'amp (bf16|fp16|fp32) \((.+)\), device', result.stdout).groups()
    mask = lambda reason: re.sub(r'\d+\.\d+x', 'Nx', reason)  # noqa: E731  (a probe's figure varies between runs)
    assert mask(why) == mask(train.default_amp(torch.device('cuda' if torch.cuda.is_available() else 'cpu'))[1])
    assert f'images/s (one process, batch 2, 32 px, {amp})' in result.stdout


# ------------------------------------------------------------------------------------------- bad input
def bad_data(root, case):
    """A data folder with one thing wrong."""
    if case == 'no-train':
        os.makedirs(os.path.join(root, 'val', 'a'))
    elif case == 'no-val':
        os.makedirs(os.path.join(root, 'train', 'a'))
    elif case == 'no-images':
        for split in ('train', 'val'):
            os.makedirs(os.path.join(root, split, 'a'))
    elif case == 'undecodable':
        write_image_folder(root, {'train': 2, 'val': 1})
        with open(os.path.join(root, 'train', 'red', 'broken.png'), 'wb') as f:
            f.write(b'not a png at all')
    return ['--data-path', root, '--accum-steps', '1', '--epochs', '1', '--warmup-epochs', '0', '--batch-size', '5']


BAD = {  # case: (extra arguments or a data-folder case, what the error must say)
    'no-train': ('no-train', 'has no train/ folder'),
    'no-val': ('no-val', 'has no val/ folder'),
    'no-images': ('no-images', 'no images in'),
    'undecodable': ('undecodable', 'cannot decode image'),
    'img-size': (['--img-size', '40'], 'divisible by 16'),
    'batch-size-zero': (['--batch-size', '0'], '--batch-size 0 is out of range'),
    'batch-size-too-big': (['--batch-size', '64'], 'exceeds the 48 training images'),
    'lr-negative': (['--lr=-1e-3'], '--lr -0.001 is out of range'),
    'lr-too-big': (['--lr', '3'], '--lr 3.0 is out of range'),
    'eval-without-checkpoint': (['--eval'], '--eval needs --checkpoint'),
    'missing-checkpoint': (['--eval', '--checkpoint', 'no/such/file.pt'], 'no checkpoint at no/such/file.pt'),
}


@pytest.mark.parametrize('case', BAD)
def test_bad_input_gets_a_clear_error(case, tmp_path):
    torch.manual_seed(0)
    extra, message = BAD[case]
    if isinstance(extra, str):
        extra = bad_data(str(tmp_path / 'data'), extra)
    result = run_train(SYNTHETIC_ARGS + ['--output-dir', str(tmp_path / 'run')] + extra, ok=False)
    assert result.returncode != 0
    assert message in result.stderr, result.stderr[-2000:]
    if case == 'undecodable':
        assert 'broken.png' in result.stderr


# ------------------------------------------------------------------------------ the recipe, in process
# The released recipe (the authors' cfgs/inline_<variant>.yaml), written out here apart from train.py's VARIANTS:
# batch per process, epochs, (warm-up epochs, warm-up lr), min lr, cool-down, weight decay, clip (None: off),
# drop path; and the peak lr per 512 images
RELEASED_RECIPE = {
    'inline_deit_t': (512, 300, (20, 5e-7), 5e-6, 0, 0.05, 5.0, 0.1, 5e-4),
    'inline_deit_s': (128, 300, (20, 5e-7), 5e-6, 0, 0.05, 5.0, 0.1, 5e-4),
    'inline_deit_b': (64, 300, (20, 5e-7), 5e-6, 0, 0.05, 5.0, 0.1, 5e-4),
    'inline_pvt_t': (128, 300, (5, 1e-6), 1e-5, 10, 0.05, None, 0.1, 5e-4),
    'inline_pvt_s': (128, 300, (5, 1e-6), 1e-5, 10, 0.05, None, 0.1, 5e-4),
    'inline_pvt_m': (128, 300, (5, 1e-6), 1e-5, 10, 0.05, 1.0, 0.3, 5e-4),
    'inline_pvt_l': (64, 300, (5, 1e-6), 1e-5, 10, 0.05, 1.0, 0.3, 5e-4),
    'inline_swin_t': (128, 300, (20, 5e-7), 5e-6, 0, 0.05, 5.0, 0.2, 5e-4),
    'inline_swin_s': (128, 300, (20, 5e-7), 5e-6, 0, 0.05, 5.0, 0.3, 5e-4),
    'inline_swin_b': (64, 300, (20, 5e-7), 5e-6, 0, 0.05, 5.0, 0.5, 5e-4),
    'inline_swin_b_384': (32, 30, (5, 2e-8), 2e-7, 0, 1e-8, 5.0, 0.5, 2e-5),
    'inline_cswin_t': (128, 300, (20, 1e-6), 1e-5, 10, 0.05, None, 0.2, 5e-4),
    'inline_cswin_s': (128, 300, (20, 1e-6), 1e-5, 10, 0.05, None, 0.4, 5e-4),
    'inline_cswin_b': (64, 300, (20, 1e-6), 1e-5, 10, 0.1, None, 0.5, 5e-4),
    'inline_cswin_b_384': (32, 20, (0, 5e-6), 5e-7, 10, 1e-8, None, 0.7, 5e-6),
}


def resolved(argv, world=1):
    """train.py's flags as setup() resolves them, in this process, with `world` processes; in an empty folder, so
    that no runs/ folder of an earlier run is resumed."""
    run = train.Run(train.get_args_parser().parse_args(argv), world=world)
    with tempfile.TemporaryDirectory() as empty, contextlib.chdir(empty):
        train.resolve(run)
    return run


def refused(argv, capsys):
    """What train.py says when it refuses argv (in this process)."""
    with pytest.raises(SystemExit):
        resolved(argv)
    return capsys.readouterr().err


def test_the_loop_smooths_labels_and_averages_weights_as_its_flags_say():
    """What fit() trains with, built from --label-smoothing and --ema-decay: the loss of one batch equals
    F.cross_entropy(..., label_smoothing=0.2), and one EMA update is ema = d * ema + (1 - d) * weights, d = 0.9."""
    run = resolved(SYNTHETIC_ARGS + ['--label-smoothing', '0.2', '--ema-decay', '0.9'])
    torch.manual_seed(0)
    raw = models.create_model('inline_deit_t', img_size=32, num_classes=10)
    t, _, _ = train.prepare_training(run, raw, train.SyntheticShapes(48, 32, 0, True))
    logits, y = torch.randn(8, 10), torch.randint(0, 10, (8,))
    torch.testing.assert_close(t.criterion(logits, y), F.cross_entropy(logits, y, label_smoothing=0.2))
    assert not torch.allclose(t.criterion(logits, y), F.cross_entropy(logits, y))
    t.ema.update_parameters(raw)  # the first update copies the weights
    before = [p.detach().clone() for p in t.ema.module.parameters()]
    with torch.no_grad():
        for p in raw.parameters():
            p.add_(1.0)
    t.ema.update_parameters(raw)
    for old, new, p in zip(before, t.ema.module.parameters(), raw.parameters()):
        torch.testing.assert_close(new, 0.9 * old + 0.1 * p, rtol=1e-6, atol=1e-6)


@pytest.mark.parametrize('name', list(RELEASED_RECIPE))
def test_recipe_is_the_released_table(name):
    batch, epochs, (warmup, warmup_lr), min_lr, cooldown, wd, clip, drop_path, lr = RELEASED_RECIPE[name]
    for world, accum in ((8, 1), (2, 4)):  # 8 processes as the authors ran it; 2 accumulate to the same total batch
        run = resolved(['--model', name, '--data-path', 'imagenet'], world)
        a = run.args
        assert (a.batch_size, a.accum_steps, run.total_batch) == (batch, accum, batch * 8)
        assert (a.lr, a.epochs, a.warmup_epochs, a.warmup_lr, a.min_lr, a.cooldown_epochs) == (
            lr, epochs, warmup, warmup_lr, min_lr, cooldown)
        assert (a.weight_decay, a.clip_grad or None, a.drop_path) == (wd, clip, drop_path)
        # shared by every variant; the EMA is CSwin's, 0.9996 per step at a total batch of 4096
        assert (a.label_smoothing, a.mixup, a.cutmix, a.mixup_switch_prob, a.random_erase) == (0.1, 0.8, 1.0, 0.5, 0.25)
        assert (a.randaug_n, a.randaug_m, a.randaug_mstd) == (2, 9, 0.5)
        assert a.ema_decay == (pytest.approx(0.9996 ** (batch * 8 / 4096)) if 'cswin' in name else 0)
        assert a.img_size == (384 if name.endswith('_384') else 288 if name == 'inline_deit_s' else
                              448 if name == 'inline_deit_b' else 224)


@pytest.mark.parametrize('name', TINY)
def test_weight_decay_groups(name):
    """As released: no decay on 1-D parameters, DeiT's position embedding and class token, Swin's relative position bias
    tables; PVT's position embeddings are decayed."""
    model = models.create_model(name, **SMALL[name])
    run = resolved(['--model', name, '--data-path', 'imagenet'])
    optimizer, _ = train.build_optimizer(model, run.args, run.total_batch, steps_per_epoch=1)
    names = {id(p): n for n, p in model.named_parameters()}
    got = {g['weight_decay']: {names[id(p)] for p in g['params']} for g in optimizer.param_groups}
    exempt = {'inline_deit_t': {'pos_embed', 'cls_token'}}.get(name, set())
    expected = {n for n, p in model.named_parameters()
                if p.ndim <= 1 or n in exempt or n.endswith('relative_position_bias_table')}
    assert got[0.0] == expected and got[0.05] == set(names.values()) - expected
    if name == 'inline_pvt_t':
        assert {f'pos_embed{i}' for i in range(1, 5)} <= got[0.05]


# The default precision's rule (train.default_amp) on faked machines: (device, AMX, AVX-512 BF16, the GPU's bf16, what
# the CPU's bf16 probe measures) -> (the precision, words its reason must hold). None: that query is absent (torch.cpu
# lacks the private function), or must not be made (a CPU run asks nothing of a GPU; only AVX-512 BF16 without AMX
# is probed).
AMP_MACHINES = {
    'cpu-amx': ('cpu', True, True, None, None, 'bf16', 'has AMX'),
    'cpu-avx512bf16-no-amx-bf16-faster': ('cpu', False, True, None, 2.9, 'bf16', 'BF16 but no AMX; bf16 ran 2.9x'),
    'cpu-avx512bf16-no-amx-bf16-slower': ('cpu', False, True, None, 0.8, 'fp32', 'BF16 but no AMX; bf16 ran 0.8x'),
    'cpu-avx512bf16-no-amx-within-margin': ('cpu', False, True, None, 1.2, 'fp32', 'bf16 ran 1.2x'),
    'cpu-avx2-only': ('cpu', False, False, None, None, 'fp32', 'no AMX or AVX-512 BF16'),
    'cpu-private-api-absent': ('cpu', None, None, None, None, 'fp32', 'no AMX or AVX-512 BF16'),
    'cuda-bf16': ('cuda', False, True, True, None, 'bf16', 'Fake GPU computes bf16'),
    'cuda-no-bf16-cpu-amx': ('cuda', True, True, False, None, 'fp16', 'Fake GPU has no bf16 (fp16, with the loss'),
}


def fake_machine(monkeypatch, amx, avx512_bf16, gpu_bf16, speedup):
    """torch's capability queries and the bf16 probe answer as the machine would. Counting emulation, as torch does by
    default, every GPU says it has bf16, as a GPU before Ampere really does."""
    for name, value in (('_is_amx_tile_supported', amx), ('_is_avx512_bf16_supported', avx512_bf16)):
        if value is None:
            monkeypatch.delattr(torch.cpu, name, raising=False)
        else:
            monkeypatch.setattr(torch.cpu, name, lambda value=value: value, raising=False)

    def never(*args, **kwargs):
        raise AssertionError('a query this machine must not make')
    monkeypatch.setattr(torch.cuda, 'is_bf16_supported', never if gpu_bf16 is None else
                        lambda including_emulation=True: including_emulation or gpu_bf16)
    monkeypatch.setattr(torch.cuda, 'get_device_name', never if gpu_bf16 is None else lambda device=None: 'Fake GPU')
    monkeypatch.setattr(train, 'bf16_speedup', never if speedup is None else lambda: speedup)


@pytest.mark.parametrize('machine', AMP_MACHINES)
def test_default_precision_is_the_faster_one_on_the_machine(machine, monkeypatch):
    device, *capabilities, amp, reason = AMP_MACHINES[machine]
    fake_machine(monkeypatch, *capabilities)
    got, why = train.default_amp(torch.device(device))
    print(f'{machine}: amp {got} ({why})')
    assert got == amp and reason in why


@pytest.mark.parametrize('machine', ['cpu-amx', 'cpu-avx512bf16-no-amx-bf16-slower'])
def test_resolve_takes_the_default_precision_and_amp_overrides_it(machine, monkeypatch):
    """With no --amp a run takes default_amp's choice and its reason; --amp wins, and the reason says it was given."""
    device, *capabilities, amp, reason = AMP_MACHINES[machine]
    fake_machine(monkeypatch, *capabilities)
    run = resolved([])
    assert (run.args.amp, run.amp_given) == (amp, False) and reason in run.amp_why
    for given in ('bf16', 'fp16', 'fp32'):
        run = resolved(['--amp', given])
        assert (run.args.amp, run.amp_given, run.amp_why) == (given, True, 'given by --amp')


def test_bf16_probe_leaves_the_random_streams_and_the_threads_as_they_were():
    torch.manual_seed(0)
    threads, state = torch.get_num_threads(), torch.get_rng_state()
    speedup = train.bf16_speedup.__wrapped__(rounds=1)  # a fresh measurement, not the process's cached one
    print(f'bf16 probe on this CPU: bf16 {speedup:.2f}x the speed of fp32')
    assert 0 < speedup < math.inf and torch.get_num_threads() == threads and torch.equal(torch.get_rng_state(), state)


def test_validation_runs_in_fp32_unless_amp_is_given():
    run = resolved([])
    run.args.amp = 'bf16'  # as resolved on a machine with AMX or a GPU with bf16
    with run.autocast(training=True):
        assert torch.is_autocast_enabled('cpu') and torch.get_autocast_dtype('cpu') == torch.bfloat16
    with run.autocast(training=False):
        assert not torch.is_autocast_enabled('cpu')
    with resolved(['--amp', 'bf16']).autocast(training=False):
        assert torch.is_autocast_enabled('cpu')


@pytest.mark.parametrize('size,crop,side', [(32, True, 36), (384, True, 438), (384, False, 384)],
                         ids=['32px', 'cswin_b_384', 'swin_b_384'])
def test_eval_transform_is_a_square_resize_then_a_centre_crop(size, crop, side):
    """The released evaluation: a square of int(img * 256/224), the aspect not kept, bicubic, then the centre
    img x img."""
    g = torch.Generator().manual_seed(0)
    img = Image.fromarray(torch.randint(0, 256, (size + 17, size + 40, 3), generator=g, dtype=torch.uint8).numpy())
    square = torch.from_numpy(np.array(img.resize((side, side), Image.BICUBIC))).permute(2, 0, 1) / 255
    top = (side - size) // 2
    expected = (square[:, top:top + size, top:top + size] - torch.tensor(train.MEAN)[:, None, None]) / \
        torch.tensor(train.STD)[:, None, None]
    torch.testing.assert_close(train.eval_transform(size, crop)(img), expected)
    assert train.NO_EVAL_CROP == ('inline_swin_b_384',)  # inline_cswin_b_384 crops


# timm's rand-m9-mstd0.5-inc1 at magnitude m = 9 (f = 0.9) and sign s: PIL's own operations, as timm calls them,
# with timm's magnitude formulas (README, "Training and evaluation"); geometric ops bicubic, filled with the mean
# colour
FILL = (124, 116, 104)
RANDAUG_FORMULAS = {
    'AutoContrast': lambda img, s: ImageOps.autocontrast(img),
    'Equalize': lambda img, s: ImageOps.equalize(img),
    'Invert': lambda img, s: ImageOps.invert(img),
    'Rotate': lambda img, s: img.rotate(s * 27, resample=Image.BICUBIC, fillcolor=FILL),  # 30 f degrees
    'PosterizeIncreasing': lambda img, s: Image.fromarray(np.asarray(img) & 0b10000000),  # 4 - int(4 f) = 1 bit
    'SolarizeIncreasing': lambda img, s: Image.fromarray(np.where(np.asarray(img) >= 26, 255 - np.asarray(img),
                                                                  np.asarray(img)).astype(np.uint8)),  # 256 - int(256 f)
    'SolarizeAdd': lambda img, s: Image.fromarray(np.where(np.asarray(img) < 128, np.minimum(
        np.asarray(img).astype(int) + 99, 255), np.asarray(img)).astype(np.uint8)),  # int(110 f) = 99
    'ColorIncreasing': lambda img, s: ImageEnhance.Color(img).enhance(1 + s * 0.81),  # 1 +- 0.9 f
    'ContrastIncreasing': lambda img, s: ImageEnhance.Contrast(img).enhance(1 + s * 0.81),
    'BrightnessIncreasing': lambda img, s: ImageEnhance.Brightness(img).enhance(1 + s * 0.81),
    'SharpnessIncreasing': lambda img, s: ImageEnhance.Sharpness(img).enhance(1 + s * 0.81),
    # PIL's affine maps each output pixel (x, y) to the input pixel (a x + b y + c, d x + e y + f)
    'ShearX': lambda img, s: img.transform(img.size, Image.AFFINE, (1, s * 0.27, 0, 0, 1, 0), Image.BICUBIC,
                                           fillcolor=FILL),  # 0.3 f
    'ShearY': lambda img, s: img.transform(img.size, Image.AFFINE, (1, 0, 0, s * 0.27, 1, 0), Image.BICUBIC,
                                           fillcolor=FILL),
    'TranslateXRel': lambda img, s: img.transform(img.size, Image.AFFINE, (1, 0, s * 0.405 * img.width, 0, 1, 0),
                                                  Image.BICUBIC, fillcolor=FILL),  # 0.45 f of the side
    'TranslateYRel': lambda img, s: img.transform(img.size, Image.AFFINE, (1, 0, 0, 0, 1, s * 0.405 * img.height),
                                                  Image.BICUBIC, fillcolor=FILL),
}


@pytest.mark.parametrize('sign', [1, -1])
@pytest.mark.parametrize('name', list(RANDAUG_FORMULAS))
def test_randaugment_op_is_its_formula(name, sign):
    g = torch.Generator().manual_seed(0)  # values short of 0 and 255 and enough pixels for Equalize: every op acts
    img = Image.fromarray(torch.randint(30, 220, (40, 50, 3), generator=g, dtype=torch.uint8).numpy())
    got = np.asarray(train.RANDAUG_OPS[name](img, 0.9, sign)).astype(int)
    expected = np.asarray(RANDAUG_FORMULAS[name](img, sign)).astype(int)
    assert got.shape == expected.shape and (got != np.asarray(img)).any()
    assert (got == expected).all(), f'{(got != expected).sum()} of {got.size} values differ'


def test_randaugment_posterize_at_magnitude_10_is_black():
    img = Image.new('RGB', (5, 4), (200, 100, 50))
    assert not np.asarray(train.RANDAUG_OPS['PosterizeIncreasing'](img, 1.0, 1)).any()


def test_randaugment_policy(monkeypatch):
    """Two ops per image, uniformly with replacement from timm's fifteen, each applied with probability 0.5 at
    its own magnitude N(9, 0.5) clipped to [0, 10], in either direction."""
    assert list(train.RANDAUG_OPS) == list(RANDAUG_FORMULAS)
    calls = []
    monkeypatch.setattr(train, 'RANDAUG_OPS', {name: lambda img, f, s, name=name: calls.append((name, f, s)) or img
                                               for name in RANDAUG_FORMULAS})
    torch.manual_seed(0)
    augment, images = train.RandAugment(2, 9, 0.5), 6000
    for _ in range(images):
        augment(None)
    n = len(calls)  # binomial(2 x 6000, 0.5): mean 6000, std 55
    assert abs(n - images) < 5 * 55
    counts = torch.tensor([sum(c[0] == name for c in calls) for name in RANDAUG_FORMULAS], dtype=torch.float64)
    assert (counts - n / 15).abs().max() < 5 * (n / 15) ** 0.5  # uniform over the fifteen
    m = torch.tensor([10 * c[1] for c in calls])
    assert 0 <= m.min() and m.max() == 10  # clipped: about 2% of the draws pass 10
    assert abs(m.mean() - 9) < 0.05 and 0.4 < m.std() < 0.5  # the clip at 10 trims the std of 0.5 a little
    assert abs(sum(c[2] for c in calls)) < 5 * n ** 0.5 and {c[2] for c in calls} == {1, -1}


def test_finetune_starts_from_the_ema_weights(tmp_path):
    """The authors' 384 px CSwin fine-tune starts from the 224 px EMA weights: --finetune takes a file's EMA."""
    source = perturb(models.create_model('inline_deit_t', img_size=32, num_classes=10))
    ema = {k: v + 1 for k, v in source.state_dict().items()}
    path = str(tmp_path / 'authors.pth')
    torch.save({'model': source.state_dict(), 'state_dict_ema': ema}, path)
    run = resolved(['--model', 'inline_deit_t', '--img-size', '32', '--attention-impl', 'reference', '--finetune', path])
    model = train.build_model(run, num_classes=10)
    assert all(torch.equal(v, ema[k]) for k, v in model.state_dict().items())


def test_authors_checkpoint_with_ema_and_a_config_object(tmp_path, capsys):
    """The authors' CSwin file: {'model', 'state_dict_ema'} and their yacs config, which weights_only=True refuses.
    Refused with a line that strips it; stripped, evaluated with its weights and then its EMA weights, each giving
    the loss computed here from the eval transform and the model."""
    torch.manual_seed(0)
    root = str(tmp_path / 'data')
    write_image_folder(root, {'train': 1, 'val': 3})
    small = dict(embed_dim=16, depths=(1, 1, 1, 1), num_heads=(2, 2, 4, 4))
    model = perturb(models.create_model('inline_cswin_t', img_size=32, num_classes=2, **small))
    ema = perturb(models.create_model('inline_cswin_t', img_size=32, num_classes=2, **small), seed=1)
    path = str(tmp_path / 'inline_cswin_t.pth')
    torch.save({'model': model.state_dict(), 'state_dict_ema': ema.state_dict(), 'config': argparse.Namespace()}, path)
    args = ['--model', 'inline_cswin_t', '--model-kwargs', 'embed_dim=16', 'depths=(1,1,1,1)', 'num_heads=(2,2,4,4)',
            '--img-size', '32', '--attention-impl', 'reference', '--threads', '1', '--eval', '--checkpoint', path]
    error = refused(args + ['--data-path', root], capsys)
    assert 'weights_only=True' in error
    with pytest.raises(ValueError, match='weights_only=True'):  # models.load_checkpoint refuses it the same way
        models.load_checkpoint(model, path)
    strip = next(line for line in error.splitlines() if line.startswith('python -c '))
    subprocess.run([sys.executable, '-c', strip[len('python -c '):].strip('"')], check=True)
    args[-1] = str(tmp_path / 'inline_cswin_t.weights.pth')
    error = refused(args, capsys)  # not one of our synthetic runs
    assert '--eval of' in error and 'needs --data-path' in error
    result = run_train(args + ['--data-path', root])
    val = datasets.ImageFolder(os.path.join(root, 'val'), train.eval_transform(32))
    x, y = torch.stack([img for img, _ in val]), torch.tensor([label for _, label in val])
    for prefix, module in (('eval model: ', model), ('eval ema: ', ema)):
        with torch.no_grad():
            expected = torch.nn.functional.cross_entropy(module.eval()(x), y).item()
        assert printed(result.stdout, prefix)['loss'] == pytest.approx(expected, rel=1e-5)


# ------------------------------------------------------------------------------------ the paper's ablations
# t4_window7_no_residual in miniature: windows of 7 tokens tile 224 px stages (56-28-14-7), one block per stage
ABLATION = ['--experiment', 't4_window7_no_residual', '--model-kwargs', 'depths=(1,1,1,1)', 'embed_dim=16',
            'num_heads=(1,1,2,2)', '--attention-impl', 'reference', '--synthetic-train', '16', '--synthetic-val', '8',
            '--threads', '1']


def test_every_starting_checkpoint_goes_through_one_function(tmp_path, capsys):
    """--resume FILE, --eval --checkpoint FILE and a rerun finding OUTPUT_DIR/checkpoint.pt are read alike: the
    saved flags fill those left unset, and an architecture other than the flags given ask for is refused."""
    out = str(tmp_path / 'run')
    saved = resolved(['--experiment', 't4_window7_residual', '--lr', '0.01', '--output-dir', out])
    os.makedirs(out)
    path = os.path.join(out, 'checkpoint.pt')
    torch.save({'args': vars(saved.args), 'arch': dict(saved.arch, img_size=224, num_classes=10)}, path)
    for argv in (['--resume', path], ['--output-dir', out], ['--eval', '--checkpoint', path]):
        run = resolved(argv)
        assert run.saved_path == path and run.arch == saved.arch == dict(window=7)
        assert (run.args.experiment, run.args.lr, run.args.img_size) == ('t4_window7_residual', 0.01, 224)
        assert 'this run asks for window=14. They differ in window' in refused(argv + ['--window', '14'], capsys)
        assert 'is a checkpoint of inline_swin_t, not of --model inline_pvt_t' in refused(
            argv + ['--model', 'inline_pvt_t'], capsys)


def test_architecture_flags_and_experiments_resolve():
    run = resolved(['--experiment', 't4_window7_no_residual', '--window', '14', '--kernel', 'relu', '--no-ape',
                    '--model-kwargs', 'embed_dim=48', 'depths=(1,1,2,1)', 'layout=IIIS'])
    assert run.args.model == 'inline_swin_t'
    assert run.arch == dict(window=14, residual='none', kernel='relu', ape=False, embed_dim=48, depths=(1, 1, 2, 1),
                            layout='IIIS')  # the experiment's residual, the flags' window over its 7
    assert run.args.output_dir == os.path.join(
        'runs', 't4_window7_no_residual-apeFalse-depths1.1.2.1-embed_dim48-kernelrelu-layoutIIIS-window14-synthetic')
    # the synthetic task: Swin's InLine windows smaller than its stages at 224 px, where they tile them
    assert (resolved(['--experiment', 't4_window7_residual']).args.img_size, run.args.batch_size) == (224, 8)
    assert resolved(['--experiment', 't4_window56_residual']).args.img_size == 32
    assert resolved(['--experiment', 's_swin_t', '--data-path', 'imagenet']).args.drop_path == 0.2  # Swin-T's row


@pytest.mark.parametrize('argv,message', [
    (['--experiment', 'nope'], 'unknown experiment nope; choose one of t3_linear_relu'),
    (['--model-kwargs', 'depths'], '--model-kwargs takes KEY=VALUE pairs'),
    (['--model-kwargs', 'img_size=64'], '--model-kwargs img_size: train.py sets it; use --img-size')],
    ids=['unknown-experiment', 'model-kwargs-without-value', 'model-kwargs-img-size'])
def test_bad_architecture_flags_are_refused(argv, message, capsys):
    assert message in refused(argv, capsys)


def test_an_architecture_the_model_refuses_is_a_clear_error(capsys):
    run = resolved(['--model', 'inline_deit_t', '--kernel', 'bogus', '--attention-impl', 'reference'])
    with pytest.raises(SystemExit):
        train.build_model(run, num_classes=10)
    assert "cannot build inline_deit_t with {'kernel': 'bogus'" in capsys.readouterr().err


def test_an_ablation_trains_resumes_and_evaluates_from_its_checkpoint_alone(tmp_path, capsys):
    run_train(ABLATION + ['--epochs', '1'], cwd=tmp_path)
    output_dir = tmp_path / 'runs' / 't4_window7_no_residual-depths1.1.1.1-embed_dim16-num_heads1.1.2.2-synthetic'
    path = str(output_dir / 'checkpoint.pt')
    arch = dict(window=7, residual='none', depths=(1, 1, 1, 1), embed_dim=16, num_heads=(1, 1, 2, 2))
    assert arch.items() <= load_checkpoint_file(path)['arch'].items()
    result = run_train(['--resume', path, '--epochs', '2', '--threads', '1'], cwd=tmp_path)  # no architecture flags
    assert 'resumed from' in result.stdout and 'InLine windows 7' in result.stdout
    log = metrics(str(output_dir))
    assert [e['epoch'] for e in log] == [1, 2] and all(e['arch']['window'] == 7 for e in log)
    result = run_train(['--eval', '--checkpoint', path, '--attention-impl', 'reference', '--threads', '1'])
    assert printed(result.stdout, 'eval model: ')['loss'] == pytest.approx(log[-1]['val_loss'], rel=1e-6)
    assert 'this run asks for window=14. They differ in window' in refused(['--eval', '--checkpoint', path,
                                                                             '--window', '14'], capsys)


def test_grad_checkpointing_keeps_the_gradients():
    torch.manual_seed(0)
    name = 'inline_swin_t'
    model = perturb(models.create_model(name, drop_path_rate=0.1, **SMALL[name]))
    x = torch.randn(2, 3, *SMALL[name]['img_size'])
    upstream = torch.randn(2, model.num_classes)

    def gradients(enable):
        model.set_grad_checkpointing(enable)
        model.zero_grad()
        torch.manual_seed(1)  # the same drop path draws
        model(x).backward(upstream)
        return {n: p.grad.clone() for n, p in model.named_parameters()}
    without, with_ = gradients(False), gradients(True)
    assert all(torch.equal(without[n], with_[n]) for n in without)
    run = resolved(['--model', name, '--img-size', '64', '--attention-impl', 'reference', '--grad-checkpoint'])
    assert train.build_model(run, num_classes=10).grad_checkpointing


# ---------------------------------------------------------------------------------------------------
# paper.py: every subcommand runs, draws a valid PNG, and computes what it claims

def assert_png(path, min_size=(100, 100)):
    """The file decodes as an RGB PNG of at least min_size (width, height)."""
    with Image.open(path) as img:
        img.load()  # decodes every pixel: a truncated file fails here
        assert img.format == 'PNG' and img.mode == 'RGB', (img.format, img.mode)
        assert img.width >= min_size[0] and img.height >= min_size[1], img.size


def test_paper_injectivity_finds_identical_rows_for_linear_only(tmp_path):
    groups = paper.main(['injectivity', '--out', str(tmp_path)])
    # q, 2q, 3q, 4q (rows 0-3) share their weights under division; no other pair of rows does, anywhere
    assert groups == {'softmax': [], 'linear (relu)': [[0, 1, 2, 3]], 'linear (relu_affine)': [[0, 1, 2, 3]],
                      'InLine (identity)': []}
    assert_png(tmp_path / 'injectivity.png', (800, 400))


def tiny_deit_checkpoint(path, layout='I', **overrides):
    """A train.py-format checkpoint of an untrained tiny DeiT: 64 px, 8 px patches, an 8x8 grid, 2 blocks."""
    torch.manual_seed(0)
    model = models.create_model('inline_deit_t', img_size=64, patch_size=8, depth=2, embed_dim=32, num_heads=1,
                                num_classes=10, layout=layout, **overrides)
    torch.save({'model': model.state_dict(), 'arch': model.arch, 'args': {'model': 'inline_deit_t'}}, path)
    return str(path)


def test_paper_locality_of_known_patterns_equals_the_hand_count():
    """Weights replaced by patterns whose shares are known, on a 4x4 grid + class token (N = 17): all on the token
    itself; uniform (class token 1/17; among the 16 grid tokens own 1/16, and on average 6.25 - 1 = 5.25 of the
    others in the 3x3, per axis 2, 3, 3, 2 neighbours); half on the class token and half on the token itself (the
    grid renormalised: own 1); half on itself and half two columns away, outside its 3x3 (own 0.5 or 1)."""
    torch.manual_seed(0)
    model = models.create_model('inline_deit_t', img_size=64, depth=4, embed_dim=32, num_heads=2, num_classes=10)
    N = 17

    def pattern(kind):
        def weights(x, grid):
            w = torch.zeros(x.shape[0], 2, N, N)
            if kind == 'self':
                w[..., range(N), range(N)] = 1
            elif kind == 'uniform':
                w[:] = 1 / N
            elif kind == 'class token':
                w[..., 0] = 0.5
                w[..., range(1, N), range(1, N)] = 0.5
            else:  # grid token i = 1 + 4y + x: half on itself, half on (y, x + 2) if it exists
                for i in range(1, N):
                    w[..., i, i] = 0.5 if (i - 1) % 4 < 2 else 1.0
                    if (i - 1) % 4 < 2:
                        w[..., i, i + 2] = 0.5
            return w
        return weights

    for block, kind in zip(model.blocks, ['self', 'uniform', 'class token', 'half']):
        block.attn.weights = pattern(kind)
    got = [{k: v.tolist() for k, v in paper.weight_shares(w, model.grid).items()}
           for w in paper.attention_weights(model.eval(), torch.randn(2, 3, 64, 64))]
    expected = [dict(own=1.0, near=0.0, **{'class': 0.0}), dict(own=1 / 16, near=5.25 / 16, **{'class': 1 / 17}),
                dict(own=1.0, near=0.0, **{'class': 0.5}), dict(own=0.75, near=0.0, **{'class': 0.0})]
    for layer, want in zip(got, expected):
        for key, value in want.items():
            assert layer[key] == pytest.approx([value] * 2, abs=1e-6), (key, layer)


def test_paper_eq6_share_is_measured_apart_from_the_weights():
    """Eq. 6's share is 0 without it; with it, a fraction in (0, 1); and all of the output where Eq. 5 gives 0:
    with q = k = 0 every InLine weight is 1/N, so Eq. 5 returns the mean of v, which is 0 for tokens centred
    over the sequence and no v bias."""
    torch.manual_seed(0)
    sizes = dict(img_size=32, patch_size=8, depth=1, embed_dim=16, num_heads=2)
    with_eq6, without = (models.create_model('inline_deit_t', residual=r, **sizes) for r in ('local', 'none'))
    x = torch.randn(3, 17, 16)  # (B, 1 + 4*4, C)
    with torch.no_grad():
        assert paper.eq6_share(without.blocks[0].attn, x, (4, 4)).tolist() == [0.0, 0.0]
        share = paper.eq6_share(with_eq6.blocks[0].attn, x, (4, 4))
        assert share.shape == (2,) and ((share > 0) & (share < 1)).all()
        attn = with_eq6.blocks[0].attn
        attn.qkv.weight[:32] = 0  # q = k = 0
        attn.qkv.bias.zero_()
        share = paper.eq6_share(attn, x - x.mean(1, keepdim=True), (4, 4))
        assert share.tolist() == pytest.approx([1.0, 1.0], abs=1e-5)


def test_paper_locality_and_maps_commands(tmp_path):
    """Untrained softmax attention (weights init std .02, so q.k ~ 0) is close to uniform: its shares are near the
    uniform lines the command prints. A name given twice is two seeds. Both commands draw their PNG."""
    softmax = tiny_deit_checkpoint(tmp_path / 'softmax.pt', layout='S')
    ours = tiny_deit_checkpoint(tmp_path / 'inline.pt', layout='I')
    results, uniform = paper.main(['locality', '--checkpoints', f'softmax={softmax}', f'InLine={ours}',
                                   f'InLine={ours}', '--images', '4', '--out', str(tmp_path)])
    assert len(results['softmax']) == 1 and len(results['InLine']) == 2 and len(results['InLine'][0]) == 2
    assert uniform == pytest.approx({'own': 1 / 64, 'near': ((22 / 8) ** 2 - 1) / 64})
    for layer in results['softmax'][0]:
        assert layer['near'].tolist() == pytest.approx([uniform['near']], abs=2e-3)
        assert layer['class'].tolist() == pytest.approx([1 / 65], abs=2e-3) and layer['eq6'].tolist() == [0.0]
    assert all((layer['eq6'] > 0).all() for layer in results['InLine'][0])
    assert_png(tmp_path / 'locality.png', (500, 300))
    rows = paper.main(['maps', '--checkpoints', f'softmax={softmax}', f'InLine={ours}', '--queries', '0,0', '7,7',
                       '--out', str(tmp_path)])
    assert [label for label, _ in rows] == ['softmax, layer 1', 'softmax, layer 2', 'InLine, layer 1', 'InLine, layer 2']
    assert_png(tmp_path / 'maps.png', (400, 500))


def test_paper_locality_keeps_its_measurements_beside_the_records(tmp_path, monkeypatch):
    """F4 of a run's checkpoint is measured once, trained and untrained, and kept in results/locality.jsonl: with
    the checkpoint gone the same table comes back from the file; a checkpoint that is neither here nor measured
    is a clear error."""
    ours = tiny_deit_checkpoint(tmp_path / 'inline.pt', layout='I')
    monkeypatch.setattr(paper, 'checkpoints', lambda args, seeds=1: {'InLine': [('run-0', ours), ('run-1', ours)]})
    argv = ['locality', '--images', '4', '--out', str(tmp_path), '--results', str(tmp_path / 'r' / 'runs.jsonl')]
    first, _ = paper.main(argv)
    assert sorted(first) == ['InLine', 'InLine, untrained'] and len(first['InLine']) == 2
    os.remove(ours)
    again, _ = paper.main(argv)
    assert all(torch.equal(a[k], b[k]) for x, y in zip(first['InLine'], again['InLine']) for a, b in zip(x, y)
               for k in a)
    with pytest.raises(SystemExit):
        paper.main(argv[:2] + ['8'] + argv[3:])  # 8 images: not measured, and the checkpoint is gone


def test_paper_measures_on_the_data_a_checkpoint_was_trained_on(tmp_path):
    """A checkpoint trained on Fashion-MNIST is measured on Fashion-MNIST's test images (its stored arguments),
    not on the synthetic task; --dataset/--data-path choose other images."""
    os.makedirs(tmp_path / 'fm')
    data = write_fashion_mnist(str(tmp_path / 'fm'), test=6)
    path = tiny_deit_checkpoint(tmp_path / 'inline.pt')
    ckpt = torch.load(path, weights_only=True)
    ckpt['args'].update(dataset='fashion_mnist', data_path=str(tmp_path / 'fm'))
    model = paper.load_trained(path)[0]
    args = paper.main.__globals__['argparse'].Namespace(dataset=None, data_path=None, download=False)
    images, labels, classes, what = paper.eval_images(ckpt, model, args, 3)
    assert images.shape == (3, 3, 64, 64) and labels.tolist() == data['t10k'][1][::2].tolist()
    assert classes == datasets.FashionMNIST.classes and 'fashion_mnist' in what
    args.dataset = 'synthetic'
    assert 'synthetic' in paper.eval_images(ckpt, model, args, 3)[3]


def test_paper_bad_input_is_a_clear_error(tmp_path, capsys):
    ours = tiny_deit_checkpoint(tmp_path / 'inline.pt')
    (tmp_path / 'broken.png').write_bytes(b'not an image')
    swin = models.create_model('inline_swin_t', img_size=64, embed_dim=32, depths=(1, 1, 1, 1), num_heads=(1, 1, 1, 1),
                               num_classes=10)
    torch.save({'model': swin.state_dict(), 'arch': swin.arch, 'args': {'model': 'inline_swin_t'}}, tmp_path / 'swin.pt')
    torch.save({'weights': 1}, tmp_path / 'other.pt')
    for argv, message in [
            (['maps', '--checkpoints', ours, '--image', str(tmp_path / 'broken.png')], 'cannot read image .*broken.png'),
            (['locality', '--checkpoints', str(tmp_path / 'swin.pt')], 'needs an isotropic DeiT'),
            (['locality', '--checkpoints', str(tmp_path / 'other.pt')], 'not a checkpoint written by train.py'),
            (['locality', '--checkpoints', str(tmp_path / 'none.pt')], 'no checkpoint at'),
            (['maps', '--checkpoints', ours, '--queries', '8,0'], '--queries must lie on the 8x8 token grid'),
            (['ablations', '--only', 'no_such_experiment', '--dataset', 'synthetic'], 'unknown experiments'),
            (['ablations', '--data-path', str(tmp_path / 'nothing')], 'no fashion_mnist files in .*apt-get install '
                                                                      'dataset-fashion-mnist.*--download')]:
        with pytest.raises(SystemExit):
            paper.main(argv + ['--out', str(tmp_path)])
        assert re.search('error: .*' + message, capsys.readouterr().err), argv


def test_paper_speed_times_softmax_through_sdpa_only(tmp_path, monkeypatch, capsys):
    """The speed command on tiny DeiTs (the real points are minutes each on a CPU): one row per point, dtype and
    device, cached; and a softmax that builds its N x N weights explicitly is refused."""
    tiny = dict(depth=1, embed_dim=32, num_heads=1, num_classes=10)
    monkeypatch.setattr(paper, 'SPEED', {'F5b': ('window', (32,), {}), 'F5c': ('image size', (32, 64), {64: 2.0})})
    monkeypatch.setattr(paper, 'speed_models', lambda figure, point, device: [
        models.create_model('inline_deit_t', img_size=point, layout=c, **tiny).eval() for c in 'SI'])
    monkeypatch.setattr(paper, 'speed_point', lambda *a, real=paper.speed_point, **k: calls.append(a) or real(*a, **k))
    calls = []
    rows = paper.main(['speed', '--batch', '1', '--rounds', '2', '--out', str(tmp_path)])
    assert [(r['figure'], r['point'], r['dtype']) for r in rows] == [
        (f, p, d) for d in ('float32', 'bfloat16') for f, p in (('F5b', 32), ('F5c', 32), ('F5c', 64))]
    assert all(r['softmax_img_s'] > 0 and r['inline_img_s'] > 0 and r['speedup'] > 0 for r in rows)
    assert_png(tmp_path / 'speed.png', (800, 300))
    paper.main(['speed', '--batch', '1', '--rounds', '2', '--out', str(tmp_path)])
    assert len(calls) == 6  # the second run read every point from the cache

    class Explicit(torch.nn.Module):
        def forward(self, x):
            return torch.softmax(x @ x.transpose(-2, -1), dim=-1) @ x
    with pytest.raises(SystemExit):
        paper.check_sdpa(Explicit(), torch.randn(1, 4, 8))
    assert 'only through F.scaled_dot_product_attention' in capsys.readouterr().err


def test_paper_speed_dense_rows_cache_and_picture(tmp_path, monkeypatch):
    """speed --dense on tiny backbones (the real points are minutes each on a CPU): one row per comparison and
    size, with both forward times and peaks, kept and reused by a rerun."""
    tiny = dict(SMALL['inline_pvt_t'], layout='IIII')
    monkeypatch.setattr(paper, 'DENSE', {'PVT': ('soft', 'inl')})
    monkeypatch.setattr(paper, 'DENSE_SIZES', ((64, 64), (64, 96)))
    monkeypatch.setattr(paper, 'dense_forward', lambda name, size, device: models.create_model(
        'inline_pvt_t', features_only=True, **dict(tiny, layout='SSSS' if name == 'soft' else 'IIII')).eval())
    monkeypatch.setattr(paper, 'dense_peak_mb', lambda name, size, device: calls.append(name) or size[1] / 8)
    calls = []
    rows = paper.main(['speed', '--dense', '--rounds', '2', '--out', str(tmp_path)])
    assert [(r['comparison'], r['size']) for r in rows] == [('PVT', [64, 64]), ('PVT', [64, 96])]
    assert all(r['softmax_ms'] > 0 and r['inline_ms'] > 0 and r['speedup'] > 0 for r in rows)
    assert [(r['softmax_mb'], r['inline_mb']) for r in rows] == [(8, 8), (12, 12)]
    assert_png(tmp_path / 'dense.png', (800, 800))
    paper.main(['speed', '--dense', '--rounds', '2', '--out', str(tmp_path)])
    assert len(calls) == 4  # the second run read every point from the cache


def test_paper_dense_peak_rss_sees_what_a_forward_allocates():
    """The CPU peak is the rise of a fresh process's peak RSS over one forward: 64 MiB held during a forward
    shows. (In a process that has run other things, freed pages are reused and the rise can read 0.)"""
    code = ('import torch, paper; paper.dense_forward = lambda name, size, device: lambda x: torch.ones(size[0], 2**20)'
            '.sum(); paper.dense_peak_rss("any", 16, 1)')  # float32: 16 * 4 MiB
    run = subprocess.run([sys.executable, '-c', code], capture_output=True, text=True, timeout=120,
                         cwd=os.path.dirname(os.path.abspath(__file__)))
    assert run.returncode == 0, run.stderr
    assert 56 <= float(run.stdout.split()[-1]) <= 90, run.stdout


def fake_run(path, accs, epochs):
    os.makedirs(path, exist_ok=True)
    with open(os.path.join(path, 'metrics.jsonl'), 'w') as f:
        f.writelines(json.dumps({'epoch': e + 1, 'val_acc1': acc}) + '\n' for e, acc in enumerate(accs[:epochs]))


class FakeTrain:
    """train.py stand-in for subprocess.Popen: records the command line and writes a finished run into its
    folder, top-1 `acc(seed, argv)` at the last epoch."""
    def __init__(self, acc=lambda seed, argv: 60.0 + seed):
        self.launched, self.acc = [], acc

    def __call__(self, argv, **kwargs):
        self.launched.append(argv)
        seed, epochs = int(argv[argv.index('--seed') + 1]), int(argv[argv.index('--epochs') + 1])
        fake_run(argv[argv.index('--output-dir') + 1], [50.0] * (epochs - 1) + [self.acc(seed, argv)], epochs)
        return types.SimpleNamespace(returncode=0, poll=lambda: 0, terminate=lambda: None, wait=lambda: 0)


def fake_record(run, acc):
    """A finished run's record, as train_runs writes it."""
    return dict(run._asdict(), argv=['train.py', *run.argv], state='done', cpu_min=1.0, wall_min=1.0,
                epochs=[{'epoch': run.recipe['epochs'], 'val_acc1': acc}], machine={'cpu': 'test'}, finished='')


def test_paper_ablations_reuse_records_and_train_the_rest(tmp_path, monkeypatch, capsys):
    """Runs with a record are read, not retrained; the others go to train.py with the experiment's miniature, its
    data and its precision on the command line, and append their records; the tables compare seed by seed, with
    the MDE, Holm's verdict and the φ = 0 floor's gate; --no-train rebuilds the same tables from the records
    alone, and the learning curves are drawn."""
    os.makedirs(tmp_path / 'fm')
    write_fashion_mnist(str(tmp_path / 'fm'))
    chosen = {n: models.EXPERIMENTS[n] for n in ('t1_softmax', 't1_softmax_normalised_q')}
    chosen['floor_deit'] = paper.experiments()['floor_deit']  # --only adds the family's floor: the gate
    monkeypatch.setattr(paper, 'experiments', lambda dataset=None: chosen)
    results = str(tmp_path / 'runs.jsonl')
    args = ['ablations', '--only', *list(chosen)[:2], '--seeds', 'T1=3', '--epochs', '2', '--train-images', '64',
            '--jobs', '1',
            '--data-path', str(tmp_path / 'fm'), '--out', str(tmp_path), '--results', results]
    fake = FakeTrain()
    monkeypatch.setattr(paper.subprocess, 'Popen', fake)
    ns = argparse.Namespace(epochs=2, train_images=64, dataset='fashion_mnist', data_path=str(tmp_path / 'fm'),
                            device='cpu')
    for seed, acc in ((0, 70.0), (1, 72.0), (2, 71.0)):  # softmax and the floor: every seed has its record
        paper.append_record(results, fake_record(paper.make_run('t1_softmax', chosen['t1_softmax'], seed, ns), acc))
        paper.append_record(results, fake_record(paper.make_run('floor_deit', chosen['floor_deit'], seed, ns), 50.0))
    configs, rows = paper.main(args)
    assert len(fake.launched) == 3 and all('t1_softmax_normalised_q' in a for a in fake.launched)
    argv0 = paper.make_run('t1_softmax', chosen['t1_softmax'], 0, ns).argv
    assert argv0[:2] == ['--experiment', 't1_softmax'] and 'num_heads=1' in argv0  # 3 heads x 1/3: head dim 64
    assert argv0[argv0.index('--dataset'):argv0.index('--dataset') + 6] == [
        '--dataset', 'fashion_mnist', '--data-path', str(tmp_path / 'fm'), '--train-subset', '64']
    assert argv0[argv0.index('--amp') + 1] == paper.PRECISION['cpu']  # explicit, never train.py's default
    assert configs[0][3] == '71.0 ± 1.0 (3)'
    assert [c[5] for c in configs] == ['+21.0', '+11.0', '+0.0']  # over the floor's 50
    # per-seed differences -10, -11, -9: mean -10, sd 1; half-width 4.303 / sqrt(3) = 2.48; MDE (4.303 + 1.061) /
    # sqrt(3) = 3.10; 10 seeds bring the MDE under 1 point; one comparison, so Holm's p is its own; the fake runs
    # keep no per-image results, so the interval is the seeds' only, and says so
    assert rows == [['T1', 't1_softmax_normalised_q − t1_softmax', '70.6 / 69.9 vs 72.2', '-10.0 [-12.5, -7.5]',
                     'seeds only', '3', '3.1', '10', rows[0][8], 'reproduced', 'reproduced']]
    assert float(rows[0][8]) < 0.01
    records = paper.read_records(results)
    assert len(records) == 9
    assert all(r['cpu_min'] >= 0 and r['machine'] for r in records.values())
    assert 'estimate for the 3 runs without a record' in capsys.readouterr().out
    assert_png(tmp_path / 'ablations.png', (300, 200))
    assert_png(tmp_path / 'curves.png', (300, 200))
    fake.launched.clear()
    assert paper.main(args + ['--no-train']) == (configs, rows)
    assert fake.launched == []


def test_paper_device_cuda_is_refused_without_a_gpu(tmp_path, capsys):
    """--device cuda says plainly that there is no GPU here, before any run; nothing trains."""
    if torch.cuda.is_available():
        pytest.skip('a GPU is here: test_paper_device_cuda_plans_the_converging_scale covers it')
    with pytest.raises(SystemExit):
        paper.main(['ablations', '--quick', '--device', 'cuda', '--dataset', 'synthetic', '--out', str(tmp_path),
                    '--results', str(tmp_path / 'runs.jsonl')])
    assert '--device cuda: torch sees no CUDA device' in capsys.readouterr().err


@pytest.mark.skipif(not torch.cuda.is_available(), reason='needs CUDA')
def test_paper_device_cuda_plans_the_converging_scale():
    """On a GPU the same experiments get BUDGET['cuda']: every training image, epochs until flat, bf16, a
    validation every epoch; a recipe of its own, so its records never mix with the CPU's."""
    ns = argparse.Namespace(epochs=None, train_images=None, device='cuda', dataset='fashion_mnist', data_path='x')
    paper.resolve_budget(ns)
    every = paper.experiments()
    run = paper.make_run('r_residual_local', every['r_residual_local'], 0, ns)
    assert (ns.train_images, ns.epochs) == (60_000, paper.BUDGET['cuda']['epochs'])
    assert run.recipe['device'] == 'cuda' and run.recipe['val_every'] == 1 and '--amp' in run.argv
    cpu = paper.make_run('r_residual_local', every['r_residual_local'], 0, argparse.Namespace(**{**vars(ns), 'device': 'cpu'}))
    assert cpu.key() != run.key()


def test_paper_holm_verdict_is_stricter_than_the_rows_own(tmp_path, monkeypatch):
    """Two comparisons each reproduced on its own (p 0.035 and 0.046, under 5%) are both not resolved under Holm
    (0.035 x 2 = 0.07); a configuration two tables share is one row of the first table; each comparison row
    carries its MDE at 80% power."""
    os.makedirs(tmp_path / 'fm')
    write_fashion_mnist(str(tmp_path / 'fm'))
    chosen = {n: models.EXPERIMENTS[n] for n in ('t1_softmax', 't1_softmax_normalised_q', 's_deit_t')}
    chosen['inline_deit_t'] = paper.experiments()['inline_deit_t']
    chosen['floor_deit'] = paper.experiments()['floor_deit']
    monkeypatch.setattr(paper, 'experiments', lambda dataset=None: chosen)
    offset = {'t1_softmax_normalised_q': (-4.0, -3.0, -2.0), 'inline_deit_t': (4.5, 3.25, 2.0)}

    def acc(seed, argv):  # softmax (t1_softmax = s_deit_t) 70 at every seed; the others offset from it; the floor 60
        name = argv[argv.index('--experiment') + 1] if '--experiment' in argv else argv[argv.index('--model') + 1]
        return 60.0 if "kernel='zero'" in argv else 70.0 + offset.get(name, (0.0, 0.0, 0.0))[seed]
    monkeypatch.setattr(paper.subprocess, 'Popen', FakeTrain(acc))
    configs, rows = paper.main(['ablations', '--only', *chosen, '--seeds', '3', '--epochs', '2', '--train-images', '64',
                                '--jobs', '1', '--data-path', str(tmp_path / 'fm'), '--out', str(tmp_path),
                                '--results', str(tmp_path / 'runs.jsonl')])
    assert [c[0] for c in configs] == ['t1_softmax = s_deit_t', 't1_softmax_normalised_q *', 'inline_deit_t',
                                           'floor_deit *']
    assert [c[1] for c in configs] == ['T1, S', 'T1', 'S', 'floor']
    assert [r[1] for r in rows] == ['t1_softmax_normalised_q − t1_softmax', 's_deit_t − inline_deit_t',
                                    'inline_deit_t − floor_deit']
    assert [float(r[8]) for r in rows[:2]] == pytest.approx([0.0352, 0.0459], abs=5e-4)
    assert [(r[9], r[10]) for r in rows] == [('reproduced', 'not resolved')] * 2 + [('—', '—')]  # the gate: no claim
    # the MDE from the sd pooled over the three comparisons (sds 1, 1.25, 1.25; 2 degrees of freedom each)
    sd = math.sqrt((1 + 1.25 ** 2 + 1.25 ** 2) / 3)
    assert [r[6] for r in rows] == [f'{paper.mde(sd, 3):.1f}'] * 3


def test_paper_sigterm_stops_the_runs_and_keeps_their_cpu_time(tmp_path):
    """paper.py stopped by SIGTERM stops the train.py it runs (here a stand-in that sleeps) and adds their CPU and
    wall time to the run's cpu.json before it exits, so a resumed run's record counts every attempt."""
    out = str(tmp_path)
    code = ('import argparse, subprocess, sys, paper\n'
            'real = subprocess.Popen\n'
            'subprocess.Popen = lambda argv, **kw: real([sys.executable, "-c", "import time\\nwhile True: sum(range(9999))"],'
            ' pass_fds=kw["pass_fds"])\n'
            f'run = paper.Run("x", "config", {{"epochs": 1}}, 0, ["--seed", "0"])\n'
            f'open({out!r} + "/started", "w").close()\n'
            f'paper.train_runs([run], argparse.Namespace(jobs=1, results={out!r} + "/runs.jsonl", no_train=False, '
            f'device="cpu", out={out!r}))\n')
    proc = subprocess.Popen([sys.executable, '-c', code], cwd=os.path.dirname(paper.__file__))
    deadline = time.time() + 60
    while not glob_one(os.path.join(out, 'runs', 'x-seed0-*', 'train.log')) and time.time() < deadline:
        time.sleep(0.1)
    time.sleep(1.0)  # the stand-in spends some CPU
    proc.send_signal(signal.SIGTERM)
    assert proc.wait(timeout=60) == 143
    spent = json.load(open(os.path.join(glob_one(os.path.join(out, 'runs', 'x-seed0-*')), 'cpu.json')))
    assert spent['cpu_s'] > 0.2 and spent['wall_s'] > 0.5
    assert not os.path.exists(os.path.join(out, 'runs.jsonl'))  # not finished: no record


def glob_one(pattern):
    found = glob.glob(pattern)
    return found[0] if found else None


def test_paper_records_keep_the_first_of_a_run_and_refuse_a_bad_line(tmp_path, capsys):
    """The record store: one JSON line per run, appended; the first record of a run counts (a second is ignored);
    a run of another recipe or seed is another record; a line that is not a record stops with its number."""
    path = str(tmp_path / 'r' / 'runs.jsonl')
    assert paper.read_records(path) == {}
    run = paper.Run('x', 'config', {'epochs': 2}, 0, ['--seed', '0'])
    paper.append_record(path, fake_record(run, 50.0))
    paper.append_record(path, fake_record(run, 99.0))
    paper.append_record(path, fake_record(run._replace(recipe={'epochs': 3}), 60.0))
    paper.append_record(path, fake_record(run._replace(seed=1), 70.0))
    found = paper.read_records(path)
    assert len(found) == 3 and found[run.key()]['epochs'][-1]['val_acc1'] == 50.0
    with open(path, 'a') as f:
        f.write('{"not": "a record"}\n')
    with pytest.raises(SystemExit):
        paper.read_records(path)
    assert 'line 5, is not a record' in capsys.readouterr().err


def test_paper_run_lock_keeps_a_second_command_off_a_run(tmp_path, monkeypatch):
    """A run's lock is exclusive, and the train.py process inherits it: it holds after the parent lets go. A
    command that finds a run locked trains the others, waits for it, and takes its record without training it."""
    folder = str(tmp_path / 'run')
    fd = paper.lock_run(folder)
    assert fd is not None and paper.lock_run(folder) is None
    child = subprocess.Popen([sys.executable, '-c', 'import time; time.sleep(1.5)'], pass_fds=(fd,))
    os.close(fd)
    assert paper.lock_run(folder) is None  # the child still holds it
    child.wait()
    again = paper.lock_run(folder)
    assert again is not None
    os.close(again)

    results = str(tmp_path / 'runs.jsonl')
    runs = [paper.Run(f'x{i}', 'config', {'epochs': 1}, i, ['--epochs', '1', '--seed', str(i)]) for i in range(2)]
    other = runs[0].folder(str(tmp_path))  # another command trains run 0: it holds the lock, then records it
    code = (f'import paper, json, time, os; fd = paper.lock_run({other!r}); open({other!r} + "/held", "w").close(); '
            f'time.sleep(2); paper.append_record({results!r}, json.loads({json.dumps(json.dumps(fake_record(runs[0], 42.0)))}))')
    holder = subprocess.Popen([sys.executable, '-c', code], cwd=os.path.dirname(paper.__file__))
    while not os.path.exists(os.path.join(other, 'held')):
        time.sleep(0.05)
    fake = FakeTrain()
    monkeypatch.setattr(paper.subprocess, 'Popen', fake)
    done = paper.train_runs(runs, argparse.Namespace(jobs=1, results=results, no_train=False, device='cpu',
                                                     out=str(tmp_path)))
    holder.wait()
    assert [a[a.index('--seed') + 1] for a in fake.launched] == ['1']  # run 0 was left to its holder
    assert done[runs[0].key()]['epochs'][-1]['val_acc1'] == 42.0 and runs[1].key() in done


def test_paper_runs_on_any_image_folder_with_the_small_recipe(tmp_path):
    """--dataset imagefolder --data-path DIR: the same runs on an ImageFolder, with the small datasets' recipe in
    place of the released ImageNet one (no Mixup, RandAugment, erasing or EMA; one process, no accumulation)."""
    root = str(tmp_path / 'data')
    write_image_folder(root, {'train': 2, 'val': 1})
    ns = argparse.Namespace(out=str(tmp_path), epochs=2, train_images=3, dataset='imagefolder', data_path=root,
                            download=False, device='cpu')
    paper.resolve_data(ns)
    run = resolved(paper.make_run('inline_deit_t', paper.experiments()['inline_deit_t'], 0, ns).argv)
    a = run.args
    assert (a.dataset, a.train_subset, a.epochs, a.accum_steps, a.ema_decay) == ('imagefolder', 3, 2, 1, 0.0)
    assert {k: getattr(a, k) for k in train.SMALL if k not in ('epochs', 'warmup_epochs')} == {
        k: v for k, v in train.SMALL.items() if k not in ('epochs', 'warmup_epochs')}
    assert a.warmup_epochs == round(2 / 12, 3)  # the budget's: 1/12 of the epochs
    assert len(train.load_data(a)[0]) == 3


def test_paper_refuses_a_folder_without_train(tmp_path, capsys):
    """An ImageFolder root without train/ is refused before any run starts, naming the folder."""
    os.makedirs(tmp_path / 'data' / 'val' / 'a')
    ns = argparse.Namespace(dataset='imagefolder', data_path=str(tmp_path / 'data'), download=False)
    with pytest.raises(SystemExit):
        paper.resolve_data(ns)
    assert 'has no train/ folder' in capsys.readouterr().err


def test_paper_distinct_configurations_never_share_a_run():
    """Two different models never get the same train.py command line, so never the same run folder: the
    experiments outside models.EXPERIMENTS (the released InLine variants, F4's DeiTs) carry their overrides."""
    every = {**paper.experiments(), **paper.F4_EXTRA}
    ns = argparse.Namespace(epochs=1, train_images=8, dataset='synthetic', device='cpu')
    owner = {}
    for name, e in every.items():
        argv = json.dumps(paper.make_run(name, e, 0, ns).argv)
        assert owner.setdefault(argv, paper.config_key(e)) == paper.config_key(e), name
    assert "layout='L'" in paper.make_run('deit_linear_relu', every['deit_linear_relu'], 0, ns).argv


def test_paper_ablation_subsets_share_the_runs_of_one_configuration(tmp_path, monkeypatch):
    """r_residual_local and t4_window56_residual build the same model: whichever subset asks for it, the run is
    the one of the registry's first name, so --only (or --quick) and the full run never train it twice."""
    every = {n: models.EXPERIMENTS[n] for n in ('t4_window56_residual', 'r_residual_local')}
    monkeypatch.setattr(paper, 'experiments', lambda dataset=None: every)
    fake = FakeTrain()
    monkeypatch.setattr(paper.subprocess, 'Popen', fake)
    common = ['--seeds', '1', '--epochs', '1', '--train-images', '64', '--jobs', '1', '--dataset', 'synthetic',
              '--out', str(tmp_path), '--results', str(tmp_path / 'runs.jsonl')]
    paper.main(['ablations', '--only', 'r_residual_local', *common])
    assert len(fake.launched) == 1
    assert fake.launched[0][fake.launched[0].index('--experiment') + 1] == 't4_window56_residual'
    paper.main(['ablations', '--only', 't4_window56_residual', *common])
    assert len(fake.launched) == 1  # recorded


def test_paper_every_ablation_miniature_builds_and_runs():
    """Each experiment's miniature (its overrides and the family's sizes) is a valid model on 64 px images, so a
    full ablation run cannot fail hours in; and the experiments that are one model share one configuration."""
    torch.manual_seed(0)
    chosen = paper.experiments()
    for name, e in chosen.items():
        size = paper.MINI[paper.family(e)][0]
        model = models.create_model(e.model, img_size=size, num_classes=10, **{**e.overrides, **paper.mini_kwargs(e)})
        assert model(torch.randn(1, 3, size, size)).shape == (1, 10), name
    keys = {name: paper.config_key(e) for name, e in chosen.items()}
    assert keys['r_residual_local'] == keys['t10_kernel_identity'] == keys['inline_swin_t'] == keys['r_dilation1']
    assert keys['t4_window56_no_residual'] == keys['r_residual_none'] == keys['t3_inline_identity']
    assert keys['t4_window28_residual'] != keys['t4_window56_residual'] != keys['t4_window56_no_residual']
    assert paper.mini_kwargs(chosen['t4_window7_residual'])['window'] == 2  # 7/56 of the 16x16 stage 1
    assert paper.untestable(chosen['t4_window7_residual']) and not paper.untestable(chosen['t4_window14_residual'])
    assert keys['floor_swin'] != keys['r_residual_none_no_ape']  # phi = 0: the same shapes, another model
    assert paper.MINI['deit'][0] // paper.MINI['deit'][2]['patch_size'] == 8  # DeiT's 8x8 grid


def test_paper_matched_row_has_eq6s_parameter_count_and_runs_of_its_own():
    """R-res's matched row is r_residual_none (no Eq. 6, the APE) with every MLP widened until it has
    r_residual_local's parameters, counted here, within 0.1%; it is compared with r_residual_local against the
    paper's -2.2, and a different model from r_residual_none, so it never shares that row's runs."""
    every = paper.experiments()
    matched, local, none = (every[n] for n in ('r_residual_none_matched', 'r_residual_local', 'r_residual_none'))
    counts = {}
    for name, e in (('matched', matched), ('local', local), ('none', none)):
        model = paper.miniature(e)
        counts[name] = sum(p.numel() for p in model.parameters())
        if name == 'matched':
            assert model.options['residual'] == 'none' and matched.overrides['mlp_ratio'] > 4
            assert all(m.fc1.out_features == int(m.fc1.in_features * matched.overrides['mlp_ratio'])
                       for m in model.modules() if isinstance(m, models.Mlp))
    assert counts['local'] - counts['none'] > 100_000  # Eq. 6's MLPs: the gap the widening closes
    assert abs(counts['matched'] - counts['local']) < 1e-3 * counts['local']
    assert paper.config_key(matched) != paper.config_key(none)
    assert (('R-res',), 'r_residual_none_matched', 'r_residual_local') in paper.comparisons(every)
    assert paper.paper_claim('r_residual_none_matched', 'r_residual_local', every)[1] == -2.2


def student_t_cdf_above_0(t, df, steps=20_000):
    """P(0 < T < t) for Student's t with df degrees of freedom, by Simpson's rule on its density (float64)."""
    c = math.exp(math.lgamma((df + 1) / 2) - math.lgamma(df / 2)) / math.sqrt(df * math.pi)
    x = torch.linspace(0, t, steps + 1, dtype=torch.float64)
    f = c * (1 + x ** 2 / df) ** (-(df + 1) / 2)
    return (t / steps / 3 * (f[0] + f[-1] + 4 * f[1:-1:2].sum() + 2 * f[2:-1:2].sum())).item()


@pytest.mark.parametrize('df', [1, 2, 3, 4, 5, 9, 10, 29, 30, 31, 45, 60, 120, 1000])
@pytest.mark.parametrize('p', [0.8, 0.975])
def test_t_quantile_against_the_density_itself(df, p):
    """paper.t_quantile(p, df) leaves 1 - p above it: against Simpson's rule on Student's t density."""
    assert student_t_cdf_above_0(paper.t_quantile(p, df), df) == pytest.approx(p - 0.5, abs=2e-5)


def test_t_distribution_against_published_values():
    """Quantiles from the published t table (3 decimals) and CDF values in closed form: df = 1 is Cauchy's,
    1/2 + atan(t)/pi; df = 2 is 1/2 + t / (2 sqrt(2 + t^2))."""
    for p, df, table in ((0.975, 1, 12.706), (0.975, 2, 4.303), (0.975, 4, 2.776), (0.975, 10, 2.228),
                         (0.975, 30, 2.042), (0.8, 2, 1.061), (0.8, 4, 0.941), (0.8, 9, 0.883), (0.9, 20, 1.325),
                         (0.995, 5, 4.032), (0.95, 5, 2.015)):
        assert round(paper.t_quantile(p, df), 3) == table, (p, df)
        assert paper.t_quantile(1 - p, df) == pytest.approx(-table, abs=1e-3)
    for t in (-3.0, -0.5, 0.0, 1.0, 2.0, 7.5):
        assert paper.t_cdf(t, 1) == pytest.approx(0.5 + math.atan(t) / math.pi, abs=1e-12)
        assert paper.t_cdf(t, 2) == pytest.approx(0.5 + t / (2 * math.sqrt(2 + t * t)), abs=1e-12)
    assert paper.t_cdf(1.959964, 10 ** 6) == pytest.approx(0.975, abs=1e-5)  # the normal's, in the limit


@pytest.mark.parametrize('diffs,paper_diff,expected', [  # per-seed differences (row minus reference), the paper's
    ([-10, -9, -11], -1.6, 'reproduced'),  # lower here and in the paper: the interval excludes 0 on its side
    ([10, 9, 11], -1.6, 'contradicted'),
    ([-1, 1, 0.5], -1.6, 'not resolved'),  # the interval holds 0
    ([1, 1.1, 0.9], 1.0, 'reproduced'),  # mean 1.0, sd 0.1, 3 seeds: +-0.25
    ([0.5, 2.0, 0.1], 1.0, 'not resolved'),  # the same sign on every seed, but +-2.5 at 3 seeds (t = 4.30, not 2)
    ([1, 1, 1], 2.4, 'reproduced'),  # the seeds spread top-1 widely, yet each gains 1: paired
    ([-60, -58, -63], float('-inf'), 'reproduced'),  # 'does not converge' against a number
    ([0.1, -0.1, 0.0, 0.2, -0.2], 0.1, 'reproduced'),  # a paper tie: TOST, the whole interval within +-MARGIN
    ([5, 5.5, 4.5], 0.0, 'contradicted'),  # ... wholly outside it
    ([0.5, 1.5, 1.0], 0.1, 'not resolved'),  # ... neither: [-0.24, 2.24]
    ([-2, 2, 0], 0.2000000000000028, 'not resolved'),  # a tie as printed; no power is not agreement
    ([0.0, 0.0, 0.0], 0.0, 'reproduced'),  # no spread at all: inside the margin for certain
    ([5], -1.6, 'not resolved'),  # one seed: no interval
    ([-10, -9, -11], None, '—')])
def test_paper_verdict_rules(diffs, paper_diff, expected):
    assert paper.verdict(diffs, paper_diff) == expected
    assert expected in paper.WORDS + ('—',)


def test_paper_p_values_agree_with_the_interval():
    """Each verdict's p crosses 0.05 exactly where its interval rule flips: the paired t-test where the 95%
    interval's edge reaches 0; TOST (2.5% a side, doubled) where its edge reaches the margin."""
    for shift in (-0.02, 0.02):
        diffs = [1.0, 2.0, 3.0]
        mean, half = paper.interval(diffs)
        moved = [d - mean + half + shift for d in diffs]  # the interval's lower edge at +shift
        assert (paper.p_values(moved, 1.5)[0] < 0.05) == (shift > 0)
        diffs = [0.1, 0.2, 0.3]  # sd 0.1: an interval narrow enough to fit inside +-MARGIN
        mean, half = paper.interval(diffs)
        tie = [d - mean + paper.MARGIN - half - shift for d in diffs]  # its upper edge at MARGIN - shift
        assert (paper.p_values(tie, 0.0)[0] < 0.05) == (shift > 0)


def test_paper_interval_mde_and_seeds_for_power():
    """The interval against the t table; the MDE at 80% power and the seeds it takes against their explicit formula,
    (t_0.975,n-1 + t_0.8,n-1) sqrt(sd² / n + the test set's term), sd pooled over a table's comparisons with their
    degrees of freedom summed; the MDE against a simulation: a true effect of that size is caught about 80% of the
    time."""
    mean, half = paper.interval([1.0, 2.0, 3.0])  # sd 1, 3 seeds: 4.303 / sqrt(3)
    assert mean == 2.0 and half == pytest.approx(4.303 / math.sqrt(3), abs=1e-3)
    assert paper.interval([1.0])[1] == math.inf and paper.mde(1.0, 1) == math.inf
    # variances 1 (3 seeds, 2 df) and 2 (2 seeds, 1 df); a comparison of one seed adds nothing
    sd, df = paper.pooled_sd([[1.0, 2.0, 3.0], [0.0, 2.0], [5.0]])
    assert df == 3 and sd == pytest.approx(math.sqrt((2 * 1 + 1 * 2) / 3))
    assert paper.pooled_sd([[1.0], []]) == (None, 0)
    assert paper.mde(1.0, 3) == pytest.approx((4.303 + 1.061) / math.sqrt(3), abs=1e-3)
    assert paper.mde(2.0, 5, image_var=0.3) == pytest.approx((2.776 + 0.941) * math.sqrt(4 / 5 + 0.3), abs=1e-3)
    # sd 1: (t_0.975,8 + t_0.8,8) / 3 = (2.306 + 0.889) / 3 = 1.065; (2.262 + 0.883) / sqrt(10) = 0.995
    assert paper.seeds_for(1.0) == 10
    # the test set's term does not shrink with seeds: 0.2 points² alone holds the MDE over (1.96 + 0.84) 0.447 = 1.25
    assert paper.seeds_for(1.0, image_var=0.2) is None and paper.seeds_for(1.0, image_var=0.01) == 11
    g = np.random.default_rng(0)
    n, effect = 5, paper.mde(1.0, 5)
    sims = g.standard_normal((20_000, n)) + effect  # sd 1, true mean = the MDE at sd 1
    t = sims.mean(1) / (sims.std(1, ddof=1) / math.sqrt(n))
    assert abs(t).__gt__(paper.t_quantile(0.975, n - 1)).mean() == pytest.approx(0.8, abs=0.03)


def summary_record(seed, acc, correct=None, state='done'):
    """A run's record as summarise reads it; correct: its per-image results (train.pack_correct), None for a
    record from before train.py kept them."""
    last = {'epoch': 4, 'val_acc1': acc}
    if correct is not None:
        last.update(val_images=len(correct), val_correct=train.pack_correct(torch.tensor(correct)))
    return dict(seed=seed, state=state, recipe={'epochs': 4}, epochs=[{'epoch': 3, 'val_acc1': acc - 1}, last])


def test_paper_pairs_match_by_seed_number_and_leave_diverged_runs_out():
    """A comparison pairs runs by seed number: a seed one side lacks (no record, or diverged) drops that pair and
    leaves the others in place, where pairing by list position would shift every later pair. A diverged run is
    left out of every mean and t-test (never counted as a guess) and named; per-image differences come only when
    every paired run kept them, else the interval is the seeds' only."""
    def right(*wrong):  # 10 test images, all right but these
        return [int(i not in wrong) for i in range(10)]
    a = paper.summarise([summary_record(0, 80.0, right(0, 1)), summary_record(1, 90.0, right(0)),
                         summary_record(2, 70.0, right(0, 1, 2))])
    b = paper.summarise([summary_record(0, 70.0, right(0, 1, 3)), summary_record(1, 0.0, state='diverged'),
                         summary_record(2, 80.0, right(0, 4))])
    assert b.top1 == {0: 70.0, 2: 80.0} and b.diverged == [1] and b.gain == 1.0
    seeds, diffs, images = paper.matched(a, b)
    assert seeds == [0, 2] and diffs == [10.0, -10.0]  # by position: 80 - 70 and 90 - 80
    assert images.tolist() == [[0, 0, 0, 1, 0, 0, 0, 0, 0, 0], [0, -1, -1, 0, 1, 0, 0, 0, 0, 0]]
    old = paper.summarise([summary_record(0, 78.0), summary_record(2, 71.0)])  # records without per-image results
    assert old.correct == {0: None, 2: None} and paper.matched(a, old)[2] is None
    every = paper.experiments()
    chosen = {n: every[n] for n in ('t3_linear_relu', 't3_inline_relu')}
    configs, rows, _, (sd, df, m) = paper.table_rows(chosen, {n: [] for n in chosen}, {
        't3_linear_relu': a, 't3_inline_relu': b}, every)
    assert configs[1][3] == '75.0 ± 7.1 (2), seed 1 diverged'
    mean, half = paper.interval(diffs, images)
    assert rows[0][3:6] == [f'{mean:+.1f} [{mean - half:+.1f}, {mean + half:+.1f}]', 'seeds and test images',
                            '2 (seed 1 unpaired)']
    assert (sd, df, m) == (pytest.approx(math.sqrt(200)), 1, 0)
    assert rows[0][9:] == ['untestable (no floor run)', 'untestable']  # no floor_swin among the results: no gate


def test_paper_record_keeps_the_final_per_image_results(tmp_path):
    """make_record keeps what train.py's final evaluation wrote of each test image (val_images, val_correct) beside
    the per-epoch metrics, and drops what a table never reads (the architecture, the speed)."""
    correct = train.pack_correct(torch.tensor([1, 0, 1]))
    with open(tmp_path / 'metrics.jsonl', 'w') as f:
        f.write(json.dumps({'epoch': 1, 'train_loss': 2.0, 'images_per_s': 9.0, 'arch': {}}) + '\n')
        f.write(json.dumps({'epoch': 2, 'val_acc1': 66.67, 'val_images': 3, 'val_correct': correct, 'arch': {}}) + '\n')
    record = paper.make_record(paper.Run('x', 'config', {'epochs': 2}, 0, []), str(tmp_path), 'done', 1)
    assert record['epochs'] == [{'epoch': 1, 'train_loss': 2.0},
                                {'epoch': 2, 'val_acc1': 66.67, 'val_images': 3, 'val_correct': correct}]
    assert paper.summarise([record]).correct[0].tolist() == [True, False, True]


def test_paper_interval_covers_a_known_difference():
    """1,000 simulated comparisons of two models on 500 test images at 5 seeds, each image right with a known
    probability per model (four kinds of image, so the true difference, 1 point, is known exactly), each seed
    shifting both models and their difference: the 95% interval over seeds and images covers the truth in
    93-97% of them. The seeds-only interval, which holds the test set fixed, covers it far less often."""
    g = torch.Generator().manual_seed(0)
    sims, seeds, images = 1000, 5, 500
    share, pa, pb = torch.tensor([(0.5, .98, .98), (0.2, .9, .6), (0.2, .6, .85), (0.1, .2, .2)],
                                 dtype=torch.float64).T  # (kinds,) each: how common, P(a right), P(b right)
    truth = 100 * (share * (pa - pb)).sum().item()  # 0.2 (0.3) + 0.2 (-0.25) = 0.01
    kind = torch.multinomial(share, sims * images, replacement=True, generator=g).view(sims, 1, images)
    both = 0.01 * torch.randn(sims, seeds, 1, generator=g, dtype=torch.float64)  # a seed's effect on both models
    apart = 0.004 * torch.randn(sims, seeds, 1, generator=g, dtype=torch.float64)  # ... and on their difference
    u = torch.rand(sims, seeds, images, generator=g, dtype=torch.float64)  # one draw for both: easy images agree
    right_a, right_b = u < pa[kind] + both + apart / 2, u < pb[kind] + both - apart / 2
    per_image = right_a.to(torch.int8) - right_b.to(torch.int8)  # (sims, seeds, images)
    diffs = 100 * per_image.double().mean(2)  # (sims, seeds)
    covered = {'images': 0, 'seeds': 0}
    for d, im in zip(diffs.tolist(), per_image):
        for over, given in (('images', im), ('seeds', None)):
            mean, half = paper.interval(d, given)
            covered[over] += abs(mean - truth) <= half
    print(covered)
    assert 930 <= covered['images'] <= 970 and covered['seeds'] < 900


def test_paper_holm_adjusts_against_a_worked_example():
    """Holm: sorted 0.005, 0.01, 0.03, 0.04 times 4, 3, 2, 1 -> 0.02, 0.03, 0.06, 0.04, kept increasing -> 0.06."""
    assert paper.holm([0.01, 0.04, 0.03, 0.005]) == pytest.approx([0.03, 0.06, 0.06, 0.02])
    assert paper.holm([0.5, 0.9]) == [1.0, 1.0] and paper.holm([]) == []


def test_paper_seeds_per_table(capsys):
    default = {'T3': 5, 'T1': 3}
    assert paper.seeds_option(None, default) == default
    assert paper.seeds_option(['T1=8'], default) == {'T3': 5, 'T1': 8}
    assert paper.seeds_option(['2'], default) == {'T3': 2, 'T1': 2}
    assert paper.seeds_option(['2', 'T3=6'], default) == {'T3': 6, 'T1': 2}
    for bad in ('T3=x', 'T9=3', '0'):
        with pytest.raises(SystemExit):
            paper.seeds_option([bad], default)
        assert '--seeds takes N or TABLE=N' in capsys.readouterr().err


def test_paper_mosaic_bed_is_injective_and_runs_its_own_recipe(tmp_path):
    """paper.py ablations --dataset fashion_recall: MOSAIC_ROWS alone, each miniature with head dim 8 in every stage
    and every InLine layer of stages 1-3 at least D + 1 tokens (injective); each run trains on task 'below' at
    MOSAIC_BUDGET, new training mosaics a seed, the same 10,000 test mosaics every seed; 5 seeds of every row;
    its comparisons include T1 within softmax and within InLine."""
    every = paper.experiments('fashion_recall')
    assert set(every) == set(paper.MOSAIC_ROWS) and not set(paper.MOSAIC_ONLY) & set(paper.experiments())
    for name, e in every.items():
        model = paper.miniature(e)
        for stage, grid in zip(model.layers, models.stage_grids(model.img_size)):
            for block in stage.blocks:
                heads = block.attn.num_heads
                assert block.attn.qkv.in_features // heads == 8, name
                if block.letter == 'I' and name != 'floor_swin':  # the floor (phi = 0) selects nothing
                    side = grid[0] if model.window is None else min(model.window, grid[0])
                    assert side * side >= 8 + 1, (name, grid)
    root = str(tmp_path / 'fm')
    os.makedirs(root)
    write_fashion_mnist(root, train=40, test=20)
    ns = argparse.Namespace(out=str(tmp_path), epochs=None, train_images=None, dataset='fashion_recall',
                            data_path=root, download=False, device='cpu', quick=False, claims=False, only=None,
                            seeds=None)
    paper.resolve_budget(ns)
    paper.resolve_data(ns)
    assert (ns.epochs, ns.train_images) == (4, 20_000)
    chosen, seeds = paper.choose(ns, every)
    assert all(seeds(n) == 5 for n in chosen)
    runs = [resolved(paper.make_run('inline_swin_t', every['inline_swin_t'], seed, ns).argv).args for seed in (0, 1)]
    assert [(a.dataset, a.recall_task, a.synthetic_train, a.synthetic_val, a.seed) for a in runs] == [
        ('fashion_recall', 'below', 20_000, 10_000, s) for s in (0, 1)]
    sets = [train.load_data(argparse.Namespace(**{**vars(a), 'synthetic_train': 4, 'synthetic_val': 4})) for a in runs]
    assert torch.equal(sets[0][1][3][0], sets[1][1][3][0])  # the same test mosaic for both seeds
    assert not torch.equal(sets[0][0][3][0], sets[1][0][3][0])  # another training mosaic
    pairs = {(name, ref) for _, name, ref in paper.comparisons(every)}
    assert {('t1_swin_softmax_normalised_q', 's_swin_t'), ('t1_inline_normalised_q', 'inline_swin_t'),
            ('inline_swin_t', 'floor_swin'), ('t3_linear_relu', 't3_inline_relu')} <= pairs


def test_paper_a_comparison_with_one_seed_of_per_image_results_is_not_run_yet():
    """One seed a side, with per-image results: the row says '(1 seed)' and gets no interval (the test set's term
    needs two seeds), rather than dividing by zero; the gate row beside it has its interval from two."""
    every = paper.experiments()
    chosen = {n: every[n] for n in ('s_deit_t', 'inline_deit_t', 'floor_deit')}
    right = lambda p, seed: torch.rand(200, generator=torch.Generator().manual_seed(seed)) < p  # noqa: E731
    result = {'s_deit_t': paper.Summary({0: 80.0}, {0: right(0.8, 0)}, [], None),
              'inline_deit_t': paper.Summary({0: 81.0, 1: 82.0}, {0: right(0.81, 1), 1: right(0.82, 2)}, [], None),
              'floor_deit': paper.Summary({0: 40.0, 1: 41.0}, {0: right(0.4, 3), 1: right(0.41, 4)}, [], None)}
    configs, rows, points, _ = paper.table_rows(chosen, {n: [] for n in chosen}, result, every)
    one = next(r for r in rows if r[1].startswith('s_deit_t'))
    assert one[3] == '-1.0 (1 seed)' and one[6] == '∞' and points[rows.index(one)] is None
    gate = next(r for r in rows if r[1].startswith('inline_deit_t'))
    assert gate[3].startswith('+41.0 [') and gate[4] == 'seeds and test images'

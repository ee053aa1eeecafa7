"""The reference against explicit formulas and the golden blocks, and the fast path (kernels.py) against the
reference; the README's recipes and block walk.
"""
import ast
import copy
import functools
import glob
import importlib
import inspect
import io
import json
import os
import re
import subprocess
import sys
import textwrap
import tokenize
import warnings

import pytest
import torch
import torch.nn as nn
import torch.nn.functional as F

import bench
import inline
import kernels
import sequence
import models
import paper
from test_models import DEFAULTS, meta_model, perturb, readme_block
from conftest import qkv

# ---------------------------------------------------------------------------------------------------
# Eq. 5

@pytest.mark.parametrize('kernel', sorted(inline.PHI))
@pytest.mark.parametrize('N', [49, 197])
def test_eq5_explicit_equals_linear_form(kernel, N):
    phi = inline.get_phi(kernel, head_dim=32)
    if isinstance(phi, torch.nn.Module):  # relu_affine: an affine map away from its identity start
        phi = perturb(phi.double())
    q, k, v = qkv(2, 3, N, 32)
    q, k = phi(q), phi(k)
    w = inline.inline_weights(q, k)
    torch.testing.assert_close(w.sum(-1), torch.ones(2, 3, N, dtype=torch.float64), rtol=0, atol=1e-12)
    torch.testing.assert_close(inline.inline_attention(q, k, v), w @ v, rtol=0, atol=1e-12)


def test_eq5_reference_keeps_its_precision_in_bf16():
    """inline_attention centres k and v before their product, as its docstring promises, so keys whose means
    are 20 times their spread cost bf16 nothing: its error against float64 on the same bf16 inputs stays under
    a fixed bound (about 0.002 here; the uncentred k^T (v - v_mean) would be about 0.08)."""
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
    """scale_by_count=False on an image: the linear form and the core (Eq. 5 without Eq. 6) give w @ v with
    the printed weights, outputs and gradients, in float64; the module passes the option to its core and its
    weights."""
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
    # the two factors differ
    assert (results['explicit'][0] - inline.inline_weights(q, k) @ v).abs().max() > 1e-2
    torch.manual_seed(0)
    attn = inline.InLineAttention(16, 2, scale_by_count=False).double()
    x = torch.randn(2, 49, 16, dtype=torch.float64)
    q, k, _ = attn.project(x)
    torch.testing.assert_close(attn.weights(x, (7, 7)), inline.inline_weights(q, k, scale_by_count=False))
    with pytest.raises(ValueError, match="nonneg .* needs scale_by_count=True"):
        inline.InLineAttention(16, 2, nonneg=True, scale_by_count=False)


def test_uncentred_form_of_the_released_models_is_the_same_number():
    q, k, v = qkv(2, 2, 64, 16)
    N, s = 64, 16 ** -0.5
    uncentred = (s / N) * q @ (k.transpose(-2, -1) @ v) \
        - s * (q @ k.mean(2, keepdim=True).transpose(-2, -1)) * v.mean(2, keepdim=True) \
        + v.mean(2, keepdim=True)
    torch.testing.assert_close(inline.inline_attention(q, k, v), uncentred, rtol=0, atol=1e-12)


def test_linear_attention_matches_its_weights():
    q, k, v = (torch.relu(t) for t in qkv(2, 2, 30, 8))
    torch.testing.assert_close(inline.linear_attention(q, k, v, eps=0),
                               inline.linear_attention_weights(q, k, eps=0) @ v)


@pytest.mark.parametrize('alpha', [2.0, 0.5, 10.0])
def test_injectivity(alpha):
    """Vanilla linear attention gives q and alpha*q the same weights; InLine and softmax do not."""
    q, k, _ = qkv(1, 2, 20, 8)
    relu = inline.get_phi('relu')
    q = relu(q) + 0.1  # positive queries so the linear weights are well defined
    lin = inline.linear_attention_weights(q, relu(k), eps=0)
    torch.testing.assert_close(lin, inline.linear_attention_weights(alpha * q, relu(k), eps=0),
                               rtol=0, atol=1e-14)
    ours = inline.inline_weights(q, k)
    assert (ours - inline.inline_weights(alpha * q, k)).abs().max() > 1e-3
    soft = torch.softmax(q @ k.transpose(-2, -1), -1)
    assert (soft - torch.softmax(alpha * q @ k.transpose(-2, -1), -1)).abs().max() > 1e-3


# ---------------------------------------------------------------------------------------------------
# Eq. 6

def local_residual_slow(v, r, grid, size=3, dilation=1):
    """Eq. 6 by a loop over every token's size x size neighbourhood, neighbour t at
    (dilation*(t//size - size//2), dilation*(t%size - size//2)) (R-dil; paper/experiments.py), zero outside
    the grid."""
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
                            yy, xx = y + dilation * (t // size - size // 2), \
                                x + dilation * (t % size - size // 2)
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
    r, r2 = inline.residual_weights(mlp, x.mean(1)), inline.residual_weights(mlp, x2.mean(1))
    assert r.shape == (1, 9 * C)
    torch.testing.assert_close(r[:, :9 * C // 2], r2[:, :9 * C // 2], rtol=0, atol=0)
    assert (r[:, 9 * C // 2:] - r2[:, 9 * C // 2:]).abs().max() > 1e-6


@pytest.mark.parametrize('causal', [False, True], ids=['per-sample', 'causal'])
def test_residual_weights_are_the_released_grouped_convolutions(causal):
    """residual_weights multiplies the token mean by W1's and W2's per-head blocks: the number the released
    two 1x1 grouped convolutions give on the mean as a 1-token sequence (per-sample), or on each prefix mean
    (causal: inline.residual_weights of every prefix's mean, sequence.prefix_means)."""
    torch.manual_seed(0)
    B, N, C, H = 2, 11, 12, 3
    mlp = inline.residual_mlp(C, H, T=9).double()
    x = torch.randn(B, N, C, dtype=torch.float64)
    means = x.cumsum(1) / torch.arange(1, N + 1)[:, None] if causal \
        else x.mean(1, keepdim=True)  # (B, N or 1, C)
    expected = mlp(means.transpose(1, 2)).transpose(1, 2)  # (B, N or 1, 9C): the convolutions themselves
    r = inline.residual_weights(mlp, sequence.prefix_means(x) if causal else x.mean(1))
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
    lin = inline.make_attention(32, 2, feature_map='relu', attention='linear')
    assert type(lin) is inline.LinearAttention
    no_res = inline.InLineAttention(32, 2, eq6='none')
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
    with pytest.raises(ValueError, match=r"unknown feature map 'gelu' \(phi\); choose one of "
                                         r"\['exp', 'identity'"):
        inline.InLineAttention(32, 2, feature_map='gelu')
    with pytest.raises(ValueError, match=r"needs a non-negative feature map"):
        inline.LinearAttention(32, 2, feature_map='identity')
    with pytest.raises(ValueError, match=r"cannot hold a 3x3 token grid"):
        q, k, v = qkv(1, 1, 8, 4)
        inline.inline_core(q, k, v, torch.zeros(1, 36, dtype=torch.float64), (3, 3))
    attn = inline.InLineAttention(64, 2)
    with pytest.raises(ValueError, match=r"takes tokens \(B, N, C\), C = 64 channels \(its dim\); "
                                         r"got \(2, 64, 4, 4\): an image \(B, C, h, w\) is "
                                         r"x.flatten\(2\).transpose\(1, 2\), grid \(h, w\)"):
        attn(torch.randn(2, 64, 4, 4), (4, 4))
    with pytest.raises(ValueError, match=r"C = 64 channels \(its dim\); got \(2, 16, 48\)$"):
        attn(torch.randn(2, 16, 48), (4, 4))
    with pytest.raises(ValueError, match=r"positive whole numbers"):
        attn(torch.randn(2, 16, 64), (torch.tensor(4.0), torch.tensor(4.0)))
    x = torch.randn(2, 16, 64)  # a traced model brings its grid as 0-d integer tensors of known values
    torch.testing.assert_close(attn(x, (torch.tensor(4), torch.tensor(4))), attn(x, (4, 4)), rtol=0, atol=0)


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


# The core's compiled graphs in fp32 at head dim 32 and in bf16 at 64 (the backbones' two); the other
# cases run the same closed forms eagerly (conftest.py): each dtype and head dim compiles its own graphs,
# ~20 s on 2 cores
@pytest.mark.parametrize('shape', [pytest.param(s, marks=pytest.mark.compiled) if s[4] == 32 else s
                                   for s in SHAPES], ids=[shape_id(*s) + '-fp32' for s in SHAPES])
def test_fast_core_equals_reference_fp32(shape):
    torch.manual_seed(0)
    B, H, P, grid, D = shape
    q, k, v, r, do = core_inputs(*shape)
    fast = run_core(kernels.inline_core_fast, q, k, v, r, do, grid, torch.float32)
    reference = run_core(inline.inline_core, q, k, v, r, do, grid, torch.float32)
    assert fast[0].shape == (B, H, P + grid[0] * grid[1], D)
    assert_fp32_close(fast, reference)


@pytest.mark.parametrize('shape', [pytest.param(s, marks=pytest.mark.compiled) if s[4] == 64 else s
                                   for s in SHAPES], ids=[shape_id(*s) + '-bf16' for s in SHAPES])
def test_fast_core_bf16_error_within_twice_the_references(shape):
    torch.manual_seed(0)
    grid = shape[3]
    q, k, v, r, do = core_inputs(*shape)
    assert_bf16_within_twice_the_references(kernels.inline_core_fast, inline.inline_core,
                                            q, k, v, r, do, grid)


@pytest.mark.parametrize('dtype', [torch.bfloat16, torch.float16], ids=['bf16', 'fp16'])
@pytest.mark.parametrize('native', [True, False], ids=['native', 'widened'])
def test_fast_gemm_is_the_low_precision_gemm_whether_or_not_the_cpu_runs_it_natively(monkeypatch,
                                                                                     dtype, native):
    """kernels.matmul, the fast cores' GEMM: on a CPU with native bf16 / fp16 GEMMs a @ b, on one without
    (AVX2) the operands widened to fp32. Either way: the result in the dtype, the exact product (float64)
    rounded once, within one rounding of the dtype and the fp32 sums' error."""
    monkeypatch.setitem(kernels.NATIVE_CPU_GEMM, dtype, native)
    g = torch.Generator().manual_seed(0)
    a, b = torch.randn(3, 197, 32, generator=g).to(dtype), torch.randn(3, 32, 40, generator=g).to(dtype)
    out = kernels.matmul(a, b)
    assert out.dtype == dtype
    exact = a.double() @ b.double()
    rounding = {torch.bfloat16: 2 ** -8, torch.float16: 2 ** -11}[dtype]  # one ulp, relative
    bound = rounding * exact.abs() + 1e-6 * (a.double().abs() @ b.double().abs())
    assert ((out.double() - exact).abs() <= bound).all()


def assert_bf16_within_twice_the_references(fast_core, reference_core, q, k, v, r, do, grid):
    """The fast core's bf16 error against the fp32 reference is at most twice the reference's own in bf16,
    plus one bf16 rounding of the tensor's scale."""
    truth = run_core(reference_core, q, k, v, r, do, grid, torch.float32)
    fast = run_core(fast_core, q, k, v, r, do, grid, torch.bfloat16)
    reference = run_core(reference_core, q, k, v, r, do, grid, torch.bfloat16)
    for name, f, ref, t in zip(NAMES, fast, reference, truth):
        fast_error, reference_error = (f - t).abs().max().item(), (ref - t).abs().max().item()
        noise = BF16_ROUNDING * t.abs().max().item()
        print(f"{name}: bf16 error, fast {fast_error:.3e}, reference {reference_error:.3e}, "
              f"noise {noise:.1e}")
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
    r = 0.3 * torch.randn(B, size * size * H * D, generator=torch.Generator().manual_seed(1),
                          dtype=torch.float64)
    if option == 'nonneg':
        q, k = F.normalize(q, dim=-1), F.normalize(k, dim=-1)
    fast, reference = (functools.partial(core, **FAST_OPTIONS[option]) for core in (kernels.inline_core_fast,
                                                                                   inline.inline_core))
    if dtype == 'fp32':
        assert_fp32_close(run_core(fast, q, k, v, r, do, grid, torch.float32),
                          run_core(reference, q, k, v, r, do, grid, torch.float32))
    else:
        assert_bf16_within_twice_the_references(fast, reference, q, k, v, r, do, grid)


@pytest.mark.compiled
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
    only needs their means: both cores keep their sums in range (the reference takes the mean Cov and scales
    q before it, the fast path pre-scales its sums, kernels.sum_scale), and every result of the fast path
    stays within a few fp16 roundings of fp32, the reference's output too."""
    torch.manual_seed(0)
    q, k, v, r, do = core_inputs(1, 2, 0, (56, 56), 32)
    k, q = 4 * k, 4 * q
    v, do = 4 * (k - k.mean(2, keepdim=True)) + v, 2 * q + do  # correlated, so the sums grow like N
    truth = run_core(inline.inline_core, q, k, v, r, do, (56, 56), torch.float32)
    reference = run_core(inline.inline_core, q, k, v, r, do, (56, 56), torch.float16)
    error, scale = (reference[0] - truth[0]).abs().max().item(), truth[0].abs().max().item()
    assert error <= 8 * 2 ** -11 * scale, f"reference o: fp16 error {error:.2e} of scale {scale:.2e}"
    fast = run_core(kernels.inline_core_fast, q, k, v, r, do, (56, 56), torch.float16)
    for name, f, t in zip(NAMES, fast, truth):
        error, scale = (f - t).abs().max().item(), t.abs().max().item()
        assert error <= 8 * 2 ** -11 * scale, f"{name}: fp16 error {error:.2e} of scale {scale:.2e}"


def test_reference_under_fp16_autocast_keeps_large_inputs_in_range():
    """Inputs of std 30 under fp16 autocast: (K - k_mean)^T V summed over 3136 tokens passes fp16's 65504, though
    the output (about 3e3 here) fits. The reference takes the mean Cov and scales q before it, so its output is
    finite and within a few fp16 roundings of the float64 truth."""
    g = torch.Generator().manual_seed(0)
    q, k, v = (30 * torch.randn(2, 3, 3136, 32, generator=g) for _ in range(3))
    k = k + 30 * torch.randn(2, 3, 1, 32, generator=g)  # a mean per channel, as projections have
    r = 0.3 * torch.randn(2, 9 * 96, generator=g)
    truth = inline.inline_core(q.double(), k.double(), v.double(), r.double(), (56, 56))
    with torch.autocast('cpu', dtype=torch.float16):
        o = inline.inline_core(q, k, v, r, (56, 56))
    error, scale = (o.double() - truth).abs().max().item(), truth.abs().max().item()
    print(f"fp16 autocast: max error {error:.2e} of {scale:.2e}")
    assert o.isfinite().all() and error <= 8 * 2 ** -11 * scale


def test_fast_core_without_local_residual():
    torch.manual_seed(0)
    q, k, v, _, do = core_inputs(2, 3, 1, (6, 5), 32)
    fast = run_core(kernels.inline_core_fast, q, k, v, None, do, (6, 5), torch.float32)
    assert_fp32_close(fast, run_core(inline.inline_core, q, k, v, None, do, (6, 5), torch.float32))


@pytest.mark.compiled
def test_fast_core_accepts_the_strided_views_models_pass():
    """A model's q, k, v are views into one qkv projection; its upstream gradient is a transposed view."""
    torch.manual_seed(0)
    B, N, H, D, grid = 2, 49, 3, 32, (7, 7)
    qkv = torch.randn(B, N, 3 * H * D)
    q, k, v = (t.reshape(B, N, H, D).transpose(1, 2) for t in qkv.chunk(3, dim=-1))  # (B, H, N, D)
    r, do = 0.3 * torch.randn(B, 9 * H * D), torch.randn(B, N, H, D).transpose(1, 2)
    assert_fp32_close(run_core(kernels.inline_core_fast, q, k, v, r, do, grid, torch.float32),
                      run_core(inline.inline_core, q, k, v, r, do, grid, torch.float32))


@pytest.mark.compiled
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
        assert kernels.inline_core_fast(q.float(), k.float(), v.float(), r.float(), (7, 7)).dtype \
            == torch.bfloat16
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
        with pytest.raises(ValueError, match=rf"r must hold {size * size} neighbour weights per channel"):
            kernels.inline_core_fast(q, k, v, torch.randn(2, 5 * 96), (7, 7), size=size)
        with pytest.raises(ValueError, match=rf"r must hold {size}x{size} neighbour weights per channel"):
            inline.inline_core(q, k, v, torch.randn(2, 5 * 96), (7, 7), size=size)


@pytest.mark.compiled
def test_no_silent_fallback_when_compilation_fails(monkeypatch):
    """If the compiler cannot run, the closed form runs eagerly after one loud warning, still exact."""
    torch.manual_seed(0)

    class CompilerMissing(torch._dynamo.exc.BackendCompilerFailed):  # what inductor raises without g++
        def __init__(self):
            RuntimeError.__init__(self, "InvalidCxxCompiler: No working C++ compiler found")

    def broken(*args):
        raise CompilerMissing()

    monkeypatch.setattr(kernels, 'COMPILED', {name: broken for name in kernels.COMPILED})
    monkeypatch.setattr(kernels, '_compile_error', [])
    q, k, v, r, do = core_inputs(2, 2, 1, (3, 4), 8)
    with pytest.warns(UserWarning, match="torch.compile failed"):
        fast = run_core(kernels.inline_core_fast, q, k, v, r, do, (3, 4), torch.float64)
    torch.testing.assert_close(fast, run_core(inline.inline_core, q, k, v, r, do, (3, 4), torch.float64))
    with warnings.catch_warnings():
        warnings.simplefilter('error')  # warned once, not at every call
        kernels.inline_core_fast(*(t.float() for t in (q, k, v, r)), (3, 4))


@pytest.mark.compiled
def test_fallback_names_the_broken_cache_file(monkeypatch):
    """When a graph cannot load, the warning names the file the error named."""
    def broken(*args):
        raise ImportError("/tmp/inductor/wv/cwvyao5g.main.so: file too short")

    monkeypatch.setattr(kernels, 'COMPILED', {name: broken for name in kernels.COMPILED})
    monkeypatch.setattr(kernels, '_compile_error', [])
    q, k, v = qkv(1, 1, 4, 8, dtype=torch.float32)
    with pytest.warns(UserWarning, match=r"torch.compile failed .*cwvyao5g.main.so in the inductor cache "
                                         r"may be broken: delete it"):
        o = kernels.inline_core_fast(q, k, v, None, (2, 2))
    torch.testing.assert_close(o, inline.inline_core(q, k, v, None, (2, 2)))


# One process compiling the fast core's forward graph (a tiny shape; the backward's graph goes the same way)
# in the inductor cache folder TORCHINDUCTOR_CACHE_DIR names; it prints whether it fell back, how many graphs
# it compiled, its warnings, its inductor cache hits and its error against the reference
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
                      warnings=[str(w.message) for w in caught],
                      hits=counters['inductor']['fxgraph_cache_hit'],
                      error=(o - inline.inline_core(q, k, v, r, (2, 2))).abs().max().item())))
"""


def start_compiling(cache):
    env = dict(os.environ, TORCHINDUCTOR_CACHE_DIR=str(cache), TORCHINDUCTOR_COMPILE_THREADS='1',
               OMP_NUM_THREADS='1')
    return subprocess.Popen([sys.executable, '-c', COMPILE_CORE], stdout=subprocess.PIPE,
                            stderr=subprocess.PIPE, text=True, env=env,
                            cwd=os.path.dirname(os.path.abspath(__file__)))


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
    """The first compiles while the other waits (kernels.compile_lock), then loads the graph from the
    cache."""
    _, results = two_compilers
    for result in results:
        assert not result['fell_back'] and result['graphs'] == 1 and not result['warnings'], result
        assert result['error'] < 1e-5
    assert sorted(result['hits'] for result in results) == [0, 1], results


def test_an_empty_so_in_the_cache_is_named_in_the_fallback_warning(two_compilers):
    """A .so left empty by a process that died writing it fails every load of its graph; the core runs its
    closed form eagerly, correct, after one warning that names the file to delete."""
    cache, _ = two_compilers
    compiled_so = [p for p in cache.rglob('*.so') if not os.path.exists(f'{p}.load_ok')]  # not the CPU probes
    assert compiled_so
    for path in compiled_so:
        path.write_bytes(b'')
    result = compiled(start_compiling(cache))
    assert result['fell_back'] and result['error'] < 1e-5, result
    assert len(result['warnings']) == 1 and 'torch.compile failed' in result['warnings'][0], result
    assert any(f'{p} in the inductor cache may be broken' in result['warnings'][0]
               for p in map(str, compiled_so))


def test_benchmark_row_has_the_promised_keys():
    """One case of `python bench.py --bench --json`: every key the README and the JSON lines promise."""
    row = bench.bench_case('swin_t_stage3', torch.float32, torch.device('cpu'))
    assert {'case', 'tokens', 'dtype', 'reference_fwd_ms', 'reference_fwdbwd_ms', 'fast_fwd_ms',
            'fast_fwdbwd_ms', 'sdpa_fwd_ms', 'sdpa_fwdbwd_ms', 'floor_fwdbwd_ms', 'fast_peak_mb',
            'fwd_speedup', 'fwdbwd_speedup', 'fwdbwd_over_floor'} <= set(row)
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
# Whole models: fast='compile' equals fast=None in logits and in the gradient of every parameter

FAST_SMALL = {  # one small variant per family; every InLine attention has at least two heads
    'inline_deit_t': dict(img_size=(48, 80), embed_dim=32, depth=2, num_heads=2),
    'inline_pvt_t': dict(img_size=(64, 96), embed_dims=(16, 32, 32, 64), depths=(1, 1, 1, 1),
                         num_heads=(2, 2, 2, 2)),
    'inline_swin_t': dict(img_size=(64, 96), embed_dim=16, depths=(2, 2, 2, 2), num_heads=(2, 2, 2, 4),
                          layout='IIMS1', softmax_window=3),
    'inline_cswin_t': dict(img_size=(64, 96), embed_dim=16, depths=(1, 2, 2, 1), num_heads=(2, 2, 4, 4),
                           layout='IISS', stripes=(1, 2, 3, 3)),
}


def assert_fast_model_equals_reference(name, compile_fast=False, switched=2, **switches):
    torch.manual_seed(0)
    config = dict(FAST_SMALL[name], num_classes=5, drop_path_rate=0.0, **switches)
    reference = models.create_model(name, **config)
    fast = models.create_model(name, fast='compile', **config)
    fast.load_state_dict(reference.state_dict())
    assert sum(getattr(m, 'fast', None) == 'compile' for m in fast.modules()) >= switched
    x, upstream = torch.randn(2, 3, *config['img_size']), torch.randn(2, 5)
    logits = []
    for model in (reference, torch.compile(fast) if compile_fast else fast):
        logits.append(model(x))
        logits[-1].backward(upstream)
    torch.testing.assert_close(logits[1], logits[0], rtol=1e-5, atol=1e-5)
    with torch.no_grad():  # no gradient: the same forward, the core's forward graph without autograd
        torch.testing.assert_close(model(x), logits[0], rtol=1e-5, atol=1e-5)
    for (key, p), q in zip(reference.named_parameters(), fast.parameters()):
        scale = p.grad.abs().max().item()
        assert (q.grad - p.grad).abs().max().item() <= 1e-4 * scale + 1e-7, key
    return model


# Swin through the compiled graphs, at head dim 32 in its InLine stages: the graphs the core tests above
# compiled (each dtype and head dim costs a compile of ~20 s on 2 cores); the others run the same closed forms
# (conftest.py)
COMPILED_SWIN = dict(embed_dim=64, num_heads=(2, 4, 8, 16))


@pytest.mark.parametrize('name', [pytest.param(n, marks=pytest.mark.compiled) if n == 'inline_swin_t' else n
                                  for n in FAST_SMALL])
def test_fast_model_equals_reference_model(name):
    assert_fast_model_equals_reference(name, **(COMPILED_SWIN if name == 'inline_swin_t' else {}))


def test_fast_model_with_the_ablation_switches():
    """Shifted 2x2 InLine windows, a learnable kernel and a dilated Eq. 6, all in one model."""
    assert_fast_model_equals_reference('inline_swin_t', window=2, feature_map='relu_affine', dilation=2)


@pytest.mark.compiled
def test_fast_core_inside_a_compiled_model():
    """train.py --compile, torch.compile(model): the core's closed forms are traced into the model's graph,
    with no break at the attentions, with gradients and without; logits and gradients equal the eager
    reference model's (the causal core: test_fast_causal_core_inside_a_compiled_module)."""
    counters = torch._dynamo.utils.counters
    counters.clear()
    # one block: each block is traced into the graph, and compiling two took 25 s more
    compiled = assert_fast_model_equals_reference('inline_deit_t', compile_fast='compile', switched=1,
                                                  depth=1)
    with torch.no_grad():
        compiled(torch.randn(2, 3, *FAST_SMALL['inline_deit_t']['img_size']))  # inference: a graph of its own
    assert not counters['graph_break'], dict(counters['graph_break'])


@pytest.mark.compiled
def test_no_gradient_runs_the_module_whole_as_one_graph():
    """Where no gradient is asked, an InLine module's forward runs its steps, attend and the core's
    closed form included, as one compiled graph (kernels.steps_fast), which reads Eq. 6's neighbour
    table rather than building it: its output is the reference module's; a second module of the same
    configuration, a second call and another batch size reuse the graph; with a gradient the module
    runs as before."""
    torch.manual_seed(0)
    reference = inline.InLineAttention(64, 2, leading_tokens=1)
    perturb(reference)
    fast = [copy.deepcopy(reference) for _ in range(2)]
    for m in fast:
        assert kernels.enable_fast(m, log=None) == 1
    x, grid = torch.randn(2, 1 + 5 * 6, 64), (5, 6)
    counters, before = torch._dynamo.utils.counters, set(kernels._compiled_signatures)
    counters.clear()
    with torch.no_grad():
        expected = reference(x, grid)
        outputs = [m(x, grid) for m in fast] + [fast[0](x, grid)]
    with torch.inference_mode():
        outputs.append(fast[1](x, grid))
    for o in outputs:
        assert_fp32_close([o], [expected])
    with torch.no_grad():  # another batch size: the batch is a symbol in the graph
        x3 = torch.randn(3, *x.shape[1:])
        assert_fp32_close([fast[1](x3, grid)], [reference(x3, grid)])
    module_graphs = [k for k in kernels._compiled_signatures - before if k[0] == 'steps']
    # one graph under no_grad, one under inference_mode (its tensors dispatch otherwise), for both modules
    # and batch sizes (keys: 3)
    assert len(module_graphs) == 3
    assert counters['stats']['unique_graphs'] == 2, dict(counters['stats'])
    key = ('grid_table', 31, (5, 6), x.device, 3, 1)
    assert key in kernels._tables  # built eagerly before the graph, which reads it
    o = fast[0](x, grid)  # a gradient: the core's own graphs, as before
    assert o.requires_grad
    assert_fp32_close([o.detach()], [expected])


def test_enable_fast_switches_exactly_the_inline_modules():
    torch.manual_seed(0)
    model = models.create_model('inline_swin_t', **FAST_SMALL['inline_swin_t'])
    switches = [m for m in model.modules() if isinstance(m, inline.InLineBase)]
    assert not any(m.fast for m in switches)
    assert kernels.enable_fast(model) == len(switches) > 0
    assert all(m.fast == 'compile' for m in switches)
    assert kernels.enable_fast(model) == 0  # nothing left to switch


@pytest.mark.compiled
def test_the_check_at_build_runs_the_closed_forms_eagerly_once_per_configuration(monkeypatch):
    """enable_fast checks one module per configuration, head counts aside (H is symbolic in every graph), on
    the closed forms run eagerly (compiled equal eager is what the fast-core tests above prove), and says so
    in one line; the graphs compile at their first use, not at the build."""
    def not_now(*args):
        raise AssertionError('compiled during the check')
    monkeypatch.setattr(kernels, 'COMPILED', {name: not_now for name in kernels.COMPILED})
    model = nn.Sequential(inline.InLineAttention(32, 1), inline.InLineAttention(64, 2),
                          inline.InLineAttention(128, 4), inline.InLineAttention(64, 2, local_size=5))
    lines = []
    assert kernels.enable_fast(model, log=lines.append) == 4
    assert len(lines) == 1 and '4 module(s), 2 configuration(s), equal the reference' in lines[0], lines
    assert all(m.fast == 'compile' for m in model)


@pytest.mark.compiled
def test_fast_module_without_a_gradient_under_bf16_autocast_within_twice_the_references_error():
    """Under autocast, with no gradient, the fast core casts q, k, v to bf16 and Eq. 6's weights come in the
    autocast dtype, as on the reference path: the fast module's error against the float64 module is at most
    twice the bf16 reference's, plus noise."""
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
    print(f"bf16 error: reference {own:.2e}, fast {error:.2e}")
    assert theirs.dtype == ours.dtype == torch.bfloat16 and error <= 2 * own + 1e-3 * exact.abs().max().item()


# ---------------------------------------------------------------------------------------------------
# The README's "Changing the method": each recipe followed on a throwaway change, so the recipes cannot go
# stale

def readme_walk():
    """The README's "One block end to end": its three numbered lists of `file.py:function`: reference,
    fast, and fast with no gradient."""
    with open(os.path.join(os.path.dirname(os.path.abspath(__file__)), 'README.md')) as f:
        section = f.read().split('## One block end to end')[1].split('\n## ')[0]
    lists = []
    for line in section.splitlines():
        item = re.match(r'(\d+)\. `(\w+\.py:[\w.]+)`', line)
        if item:
            if item.group(1) == '1':
                lists.append([])
            lists[-1].append(item.group(2))
    return lists


# The functions that compute an equation: a walk ends at the first of them it meets
MATH = ('inline.py:residual_weights', 'inline.py:inline_attention', 'inline.py:local_residual',
        'kernels.py:core_forward', 'kernels.py:core_backward',
        'kernels.py:core_inference')  # core_forward with no gradient, inlined into its graph


def traced_walk(fn):
    """(walk, calls) of fn(): calls, every function of inline.py, models.py and kernels.py it calls, as
    'file.py:qualname', once each in the order of first call; walk, those a reader passes on the way to the
    math: the project's functions on the call stack of each call of a MATH function, down to that function
    (what it calls in turn, eq5_gain say, is the math's own). Generator expressions and lambdas left out."""
    calls, walk, stack = [], [], []

    def record(frame, event, arg):
        name = f"{os.path.basename(frame.f_code.co_filename)}:{frame.f_code.co_qualname}"
        ours = name.split(':')[0] in ('inline.py', 'models.py', 'kernels.py') and '<' not in name
        if event == 'call':
            stack.append(name if ours else None)
            if ours and name not in calls:
                calls.append(name)
            if name in MATH and not any(f in MATH for f in stack[:-1]):
                walk.extend(f for f in stack if f is not None and f not in walk)
        elif event == 'return' and stack:
            stack.pop()
    sys.setprofile(record)
    try:
        fn()
    finally:
        sys.setprofile(None)
    return walk, calls


def test_block_walk_is_the_readme():
    """The README's walk through one InLine-Swin block is what a forward passes on the way to the math, with
    and without a gradient: on the reference path at most 8 steps (6 before the method had its one place,
    InLineBase.attend, which every family's attention runs; 7 before forward's steps became a method of their
    own, which no gradient runs as one graph), and on either path at most 6 of the project's functions
    between the block's call and the math. The fast path is the reference's first steps, then the README's
    second list; with no gradient, its first two, then the third."""
    reference_walk, fast_walk, no_grad_walk = readme_walk()
    torch.manual_seed(0)
    block = models.SwinBlock(32, 2, 'I', None, False, 4., 0., DEFAULTS)
    x = torch.randn(2, 64, 32)
    walk, calls = traced_walk(lambda: block(x, (8, 8)))
    assert walk == reference_walk and len(walk) <= 8, (walk, calls)
    with torch.no_grad():  # one path: the same calls when no gradient is asked
        assert traced_walk(lambda: block(x, (8, 8))) == (walk, calls)
    kernels.enable_fast(block, log=None)
    block(x, (8, 8))  # compiled (or loaded from the cache) on the first call
    fast, fast_calls = traced_walk(lambda: block(x, (8, 8)))
    assert fast == reference_walk[:5] + fast_walk, (fast, fast_calls)
    with torch.no_grad():  # the module's steps as one graph (here run eagerly: conftest.py)
        no_grad = traced_walk(lambda: block(x, (8, 8)))[0]
    # steps_fast and compiled_call, then the graph traces steps, attend and residual_weights, then the core
    assert no_grad == reference_walk[:2] + no_grad_walk[:2] + reference_walk[2:5] + no_grad_walk[2:], no_grad
    for path in (walk, fast, no_grad):
        between = [f for f in path[1:] if f not in MATH]
        print(f"{len(between)} functions between the block and the math: {between}")
        assert len(between) <= 6


def test_recipe_a_new_feature_map(monkeypatch):
    """A feature map phi is one entry of inline.PHI, and one of NON_NEGATIVE_PHI if phi >= 0."""
    monkeypatch.setitem(inline.PHI, 'softplus', F.softplus)
    monkeypatch.setattr(inline, 'NON_NEGATIVE_PHI', inline.NON_NEGATIVE_PHI + ('softplus',))
    phi = inline.get_phi('softplus')
    q, k, v = qkv(2, 2, 49, 8)
    torch.testing.assert_close(inline.inline_attention(phi(q), phi(k), v),
                               inline.inline_attention_quadratic(phi(q), phi(k), v), rtol=0, atol=1e-12)
    assert_fast_model_equals_reference('inline_swin_t', feature_map='softplus')
    assert meta_model('inline_swin_t', layout='LLLS', feature_map='softplus')  # >= 0: linear attention takes it
    assert meta_model('inline_swin_t', feature_map='softplus').options['feature_map'] == 'softplus'


def test_recipe_another_statistic_in_place_of_eq5s_mean(monkeypatch):
    """inline_attention's docstring and the README: a median in k_mean's place changes nothing in the centred
    linear form (the centred values sum to zero, so any constant cancels), while the explicit weights change;
    in the uncentred form, g q_i^T sum_j (k_j - c) v_j^T + v_mean, the median gives the explicit weights'
    output with the median: the form a change to Eq. 5's mean belongs in."""
    q, k, v = qkv(2, 2, 13, 4)
    before = inline.inline_attention(q, k, v)
    median = k.median(dim=2, keepdim=True).values  # (B, H, 1, D)
    edit(monkeypatch, inline, 'inline_attention', 'k_mean = k.mean(dim=2, keepdim=True)',
         'k_mean = k.median(dim=2, keepdim=True).values')
    edit(monkeypatch, inline, 'inline_weights', 'k_mean = k.mean(dim=2, keepdim=True)',
         'k_mean = k.median(dim=2, keepdim=True).values')
    centred = inline.inline_attention(q, k, v)
    assert (centred - before).abs().max() < 1e-12  # the silent no-op the docstring warns of
    explicit = inline.inline_attention_quadratic(q, k, v)
    assert (explicit - before).abs().max() > 1e-2
    N, s = q.shape[2], inline.attention_scale(q.shape[-1])
    uncentred = (inline.eq5_gain(s, N) * q) @ ((k - median).transpose(-2, -1) @ v) + v.mean(2, keepdim=True)
    torch.testing.assert_close(uncentred, explicit, rtol=0, atol=1e-12)


def test_renamed_options_are_refused_naming_the_new():
    """kernel is feature_map, residual is eq6, fast=True is fast='compile': refused under the old name, with
    the new one, in the module, create_model and train.py's flags (test_train.py)."""
    with pytest.raises(TypeError, match=r"InLineAttention got unknown option\(s\) kernel \(now feature_map\)"):
        inline.InLineAttention(32, 2, kernel='relu')
    with pytest.raises(ValueError, match=r"unknown argument\(s\) \['residual \(now eq6\)'\]"):
        meta_model('inline_swin_t', residual='none')
    with pytest.raises(ValueError, match=r"fast=True: choose one of \[None, 'compile', 'triton'\] \(fast=True is "
                                         r"now fast='compile'\)"):
        meta_model('inline_swin_t', fast=True)


def test_recipe_another_neighbourhood_for_eq6():
    """Eq. 6 over 5x5 neighbours is one option, local_size=5: the weight layout, the reference, the fast path
    and the APE rule all take their tap count from it (the explicit loop at 5x5 is
    test_eq6_against_explicit_loop_on_a_non_square_grid)."""
    model = meta_model('inline_swin_t', local_size=5)
    attns = [m for m in model.modules() if isinstance(m, inline.InLineAttention)]
    assert attns and all(m.residual[2].out_channels == 25 * m.proj.in_features for m in attns)
    assert not model.ape and model.options['local_size'] == 5
    # a 1x1 neighbourhood is the plain residual: no position
    assert meta_model('inline_swin_t', local_size=1).ape
    assert_fast_model_equals_reference('inline_swin_t', local_size=5)
    torch.manual_seed(0)
    one = models.create_model('inline_swin_t', local_size=1,
                              **dict(FAST_SMALL['inline_swin_t'], num_classes=5))
    plain = models.create_model('inline_swin_t', eq6='plain',
                                **dict(FAST_SMALL['inline_swin_t'], num_classes=5))
    plain.load_state_dict(one.state_dict())  # the same parameters, the same keys
    x = torch.randn(2, 3, 64, 96)
    torch.testing.assert_close(one.eval()(x), plain.eval()(x), rtol=0, atol=0)


def add_a_learnable_temperature(monkeypatch):
    """The README's recipe, as a reader makes it in inline.py: InLineBase.__init__ makes Eq. 5's scale a
    per-head parameter (1, H, 1, 1) that starts at D^-1/2; the forward passes it on, as every scale."""
    init = inline.InLineBase.__init__

    def init_with_a_temperature(self, dim, num_heads, **options):
        init(self, dim, num_heads, **options)
        self.scale = nn.Parameter(torch.full((1, num_heads, 1, 1), inline.attention_scale(dim // num_heads)))
    monkeypatch.setattr(inline.InLineBase, '__init__', init_with_a_temperature)


def edit(monkeypatch, obj, name, old, new):
    """A reader's edit of one line of a function's source (obj.name), made and run as the edited file would
    be: the source with old replaced by new, compiled in the function's own module."""
    function = getattr(obj, name)
    source = textwrap.dedent(inspect.getsource(function))
    assert old in source, f"{old!r} not in {name}"
    scope = {}
    exec(compile(source.replace(old, new), inspect.getsourcefile(function), 'exec'), function.__globals__,
         scope)
    monkeypatch.setattr(obj, name, scope[name])


def test_recipe_a_learnable_temperature_in_eq5(monkeypatch):
    """A learnable per-head temperature as Eq. 5's scale: the fast core follows it (a tensor scale joins q),
    so the check passes and the whole model's logits and every gradient, the temperature's included, equal the
    reference's; and three optimizer steps move it alike on both paths."""
    add_a_learnable_temperature(monkeypatch)
    assert_fast_model_equals_reference('inline_swin_t')
    torch.manual_seed(0)
    pair = [nn.Module(), nn.Module()]
    pair[0].attn, pair[1].attn = perturb(inline.InLineAttention(32, 2)), inline.InLineAttention(32, 2)
    pair[1].load_state_dict(pair[0].state_dict())
    assert kernels.enable_fast(pair[1]) == 1
    x, target = torch.randn(4, 49, 32), torch.randn(4, 49, 32)
    for block in pair:
        # linear in the gradients, as AdamW's first steps are not
        optimizer = torch.optim.SGD(block.parameters(), lr=0.1)
        for _ in range(3):
            optimizer.zero_grad()
            F.mse_loss(block.attn(x, (7, 7)), target).backward()
            optimizer.step()
    taus = [block.attn.scale.flatten() for block in pair]
    print('temperature after 3 steps, reference and fast:', taus[0].tolist(), taus[1].tolist())
    assert (taus[0] - 16 ** -0.5).abs().min() > 1e-3  # it trained from D^-1/2
    torch.testing.assert_close(taus[1], taus[0], rtol=1e-5, atol=1e-6)


def add_a_gain_on_eq6s_weights(monkeypatch):
    """A reader's change in the one place the method lives: a learnable gain, 1 at the start, on Eq. 6's
    weights, as one line of InLineBase.attend (and its parameter in InLineBase.__init__)."""
    init = inline.InLineBase.__init__

    def init_with_gain(self, dim, num_heads, **options):
        init(self, dim, num_heads, **options)
        self.gain = nn.Parameter(torch.ones(()))
    monkeypatch.setattr(inline.InLineBase, '__init__', init_with_gain)
    edit(monkeypatch, inline.InLineBase, 'attend', 'residual_weights(self.residual, self.eq6_mean(x))',
         'self.gain * residual_weights(self.residual, self.eq6_mean(x))')


class OnASequence(nn.Module):
    """A SequenceAttention as a model: tokens (B, N, C) -> (B, N, C)."""

    def __init__(self, causal):
        super().__init__()
        self.attn = sequence.SequenceAttention(16, 2, causal=causal)

    def forward(self, x):
        return self.attn(x)


@pytest.mark.parametrize('name', [*FAST_SMALL, 'causal sequence', 'sequence both ways'])
def test_a_gain_on_eq6s_weights_in_attend_trains_everywhere_on_both_paths(monkeypatch, name):
    """The gain reaches every InLine attention: the four families (CSwin's whole-map branch included) and
    sequences, causal and both ways. Each fast model is accepted by the check; with the gains moved off 1
    alike, it gives the reference's output with a gradient and without one (what validation runs), every
    gain receives the reference's gradient, not zero, and one optimizer step moves the gains alike."""
    add_a_gain_on_eq6s_weights(monkeypatch)
    torch.manual_seed(0)
    if name in FAST_SMALL:
        config = dict(FAST_SMALL[name], num_classes=5, drop_path_rate=0.0)
        reference, fast = (models.create_model(name, fast=fast, **config) for fast in (None, 'compile'))
        x, upstream = torch.randn(2, 3, *config['img_size']), torch.randn(2, 5)
    else:
        reference = OnASequence(causal=name == 'causal sequence')
        fast = copy.deepcopy(reference)
        assert kernels.enable_fast(fast, log=None) == 1
        x, upstream = torch.randn(2, 70, 16), torch.randn(2, 70, 16)  # 70 tokens: two causal chunks
    fast.load_state_dict(reference.state_dict())
    gains = [[p for n, p in m.named_parameters() if n.endswith('gain')] for m in (reference, fast)]
    assert len(gains[0]) == sum(isinstance(m, inline.InLineBase) for m in reference.modules()) >= 1
    assert {m.fast for m in fast.modules() if isinstance(m, inline.InLineBase)} == {'compile'}
    with torch.no_grad():
        for ours in gains:
            for i, g in enumerate(ours):
                g.fill_(0.5 + i / len(ours))
    outputs = [model(x) for model in (reference, fast)]
    torch.testing.assert_close(outputs[1], outputs[0], rtol=1e-5, atol=1e-5)
    with torch.no_grad():
        error = (fast(x) - reference(x)).abs().max().item()
    print(f"{name}, without a gradient: max |fast - reference| {error:.1e}")
    assert error <= 1e-5 * outputs[0].abs().max().item()
    for model, out in zip((reference, fast), outputs):
        out.backward(upstream)
        torch.optim.SGD([p for n, p in model.named_parameters() if n.endswith('gain')], lr=0.1).step()
    for i, (g, h) in enumerate(zip(*gains)):
        # but DeiT's last block: its Eq. 6 acts on the grid tokens, which the head (the class token) never reads
        assert g.grad.abs() > 0 or (name == 'inline_deit_t' and i == len(gains[0]) - 1)
        torch.testing.assert_close(h.grad, g.grad, rtol=1e-4, atol=1e-7)
        torch.testing.assert_close(h.detach(), g.detach(), rtol=1e-5, atol=1e-7)  # moved alike


@pytest.mark.parametrize('name', ['InLineAttention', 'CSwinInLine', 'causal sequence', 'sequence both ways'])
def test_a_parameter_no_forward_uses_is_refused_by_name(monkeypatch, name):
    """A parameter added to every InLine module that no forward uses receives no gradient on either path, so
    no comparison could see it: enable_fast refuses it, naming the module and the parameter, and switches
    nothing."""
    init = inline.InLineBase.__init__

    def init_with_unused(self, dim, num_heads, **options):
        init(self, dim, num_heads, **options)
        self.unused = nn.Parameter(torch.ones(()))
    monkeypatch.setattr(inline.InLineBase, '__init__', init_with_unused)
    block = nn.Module()
    block.attn = {'InLineAttention': lambda: inline.InLineAttention(16, 2),
                  'CSwinInLine': lambda: models.CSwinInLine(16, 2),
                  'causal sequence': lambda: sequence.SequenceAttention(16, 2, causal=True),
                  'sequence both ways': lambda: sequence.SequenceAttention(16, 2, causal=False)}[name]()
    with pytest.raises(ValueError, match=rf"attn \({type(block.attn).__name__}\): parameter\(s\) attn\.unused "
                                         r"receive no gradient in its forward: a change that does not reach"):
        kernels.enable_fast(block, log=None)
    assert block.attn.fast is None


def test_a_change_the_fast_core_does_not_follow_is_refused_by_name(monkeypatch):
    """A change inside the reference core alone that agrees at initialisation: Eq. 5's learnable temperature s
    used as s^2 sqrt(D) in inline_core, equal to s while s = D^-1/2. The check draws every parameter away from
    its initial value first, so it finds the difference and refuses, naming the module and the quantity; the
    fast core is not switched on."""
    add_a_learnable_temperature(monkeypatch)
    edit(monkeypatch, inline, 'inline_core', 'inline_attention(q, k, v, scale, scale_by_count)',
         'inline_attention(q, k, v, scale ** 2 * q.shape[-1] ** 0.5, scale_by_count)')
    block = nn.Module()
    block.attn = inline.InLineAttention(32, 2)
    with pytest.raises(ValueError, match=r"the fast InLine core \('compile'\) and the reference differ in "
                                         r"attn \(InLineAttention\): output: max \|fast - float64 reference\|"
                                         r".*Build the model with fast=None \(train\.py: --fast none\)"):
        kernels.enable_fast(block, log=None)
    assert block.attn.fast is None


def test_fast_path_refuses_a_core_that_drops_a_gradient(monkeypatch):
    """The check at build time: a fast core that ignored the scale's gradient (as one that detached its inputs
    did) is refused before any step, naming the module, the quantity, both values and the way out."""
    add_a_learnable_temperature(monkeypatch)
    block = nn.Module()
    block.attn = inline.InLineAttention(32, 2)

    fast_core = kernels.inline_core_fast

    def detaching_core(q, k, v, r, grid, scale, *args):
        return fast_core(q, k, v, r, grid, scale.detach(), *args)
    monkeypatch.setattr(kernels, 'inline_core_fast', detaching_core)  # the twin inline.fast_twin finds
    with pytest.raises(ValueError, match=r"differ in attn \(InLineAttention\): gradient of attn\.scale: "
                                         r"reference \d\.\de[+-]\d\d, fast none\. Build the model with "
                                         r"fast=None \(train\.py: --fast none\)"):
        kernels.enable_fast(block, 'compile')
    assert block.attn.fast is None  # refused: nothing switched


def test_a_fast_core_that_differs_without_a_gradient_is_refused(monkeypatch):
    """The check compares the output with no gradient too: a twin that agrees while autograd records but not
    without it (as a separate inference graph could) is refused, naming that quantity."""
    def twin(q, k, v, r, grid, *options):
        o = inline.inline_core(q, k, v, r, grid, *options)
        return o if torch.is_grad_enabled() else 1.01 * o
    monkeypatch.setattr(kernels, 'inline_core_fast', twin)  # the twin inline.fast_twin finds
    module = inline.InLineAttention(32, 2)
    with pytest.raises(ValueError, match=r"InLineAttention\): output with no gradient: max \|fast - float64"):
        kernels.enable_fast(module, 'compile', log=None)
    assert module.fast is None


def test_every_form_of_eq5_takes_its_factor_from_eq5_gain(monkeypatch):
    """eq5_gain moved (twice the released factor): the linear form, the core, the explicit weights, the causal
    forms (prefix sums, chunks, one step) and both fast cores follow it, and still agree with each other; the
    outputs change."""
    q, k, v = qkv(2, 2, 13, 4)
    before = inline.inline_attention(q, k, v)
    monkeypatch.setattr(inline, 'eq5_gain', lambda s, n, scale_by_count=True: 2 * (s / n if scale_by_count else s))
    after = inline.inline_attention(q, k, v)
    assert (after - before).abs().max() > 1e-3
    torch.testing.assert_close(after, inline.inline_attention_quadratic(q, k, v), rtol=0, atol=1e-12)
    torch.testing.assert_close(inline.inline_core(q, k, v, None, (3, 4)), after, rtol=0, atol=1e-12)
    causal = sequence.causal_inline_weights(q, k) @ v
    torch.testing.assert_close(sequence.causal_inline_attention(q, k, v), causal, rtol=0, atol=1e-12)
    torch.testing.assert_close(sequence.inline_chunked(q, k, v, chunk=4)[0], causal, rtol=0, atol=1e-12)
    state, steps = None, []
    for t in range(q.shape[2]):
        o_t, state = sequence.inline_step(q[:, :, t], k[:, :, t], v[:, :, t], state)
        steps.append(o_t)
    torch.testing.assert_close(torch.stack(steps, 2), causal, rtol=0, atol=1e-12)
    # the fast cores, through enable_fast's check (their closed forms, run eagerly)
    assert kernels.enable_fast(inline.InLineAttention(32, 2), log=None) == 1
    assert kernels.enable_fast(sequence.SequenceAttention(32, 2, causal=True), log=None) == 1
    with kernels.eagerly():  # as in the check: a cached graph holds the unmoved gain
        torch.testing.assert_close(kernels.inline_core_fast(q, k, v, None, (3, 4)), after, rtol=0, atol=1e-12)


def test_eq6_weights_per_token_the_reference_follows_and_the_fast_core_refuses(monkeypatch):
    """Eq. 6 weights predicted per token, as the README's recipe makes them: the forward gives
    residual_weights the tokens x, not their mean, so r is (B, N, T*C). The reference applies them
    (inline.local_residual takes r per token, and equals the per-sample form when every token's weights are
    the same), and the model trains on it; the fast core has one weight set per sample, so
    create_model(fast='compile') refuses it when the model is built, naming the module, what failed and the way
    out."""
    q, k, v = qkv(2, 2, 1 + 12, 4)
    r = torch.randn(2, 9 * 8, dtype=torch.float64)
    torch.testing.assert_close(inline.local_residual(v, r[:, None].expand(2, 13, -1), (3, 4)),
                               inline.local_residual(v, r, (3, 4)), rtol=0, atol=1e-14)
    edit(monkeypatch, inline.InLineBase, 'eq6_mean', 'x.mean(dim=1)', 'x')
    torch.manual_seed(0)
    config = dict(FAST_SMALL['inline_deit_t'], num_classes=5)
    model = models.create_model('inline_deit_t', **config)
    F.cross_entropy(model(torch.randn(2, 3, 48, 80)), torch.tensor([0, 1])).backward()
    assert model.blocks[0].attn.residual[0].weight.grad.abs().max() > 0
    with pytest.raises(ValueError, match=r"differ in blocks\.0\.attn \(InLineAttention\): the fast core "
                                         r"raised ValueError: r must hold 9 neighbour weights per channel"
                                         r".*Build the model with fast=None"):
        models.create_model('inline_deit_t', fast='compile', **config)


def test_readme_vit_example_runs_on_both_paths():
    """The README's own ViT, run as written: a class token first, then the patch grid; the fast path's logits
    and gradients equal the reference's; torch.export takes it with a dynamic batch (x.shape[0], not len(x),
    which export would fix at the example's 2)."""
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
    batch = torch.export.Dim('batch', min=1, max=64)
    exported = torch.export.export(reference.eval(), (x,), dynamic_shapes=({0: batch},)).module()
    x5 = torch.randn(5, 3, 32, 32)
    torch.testing.assert_close(exported(x5), reference(x5))


HERE = os.path.dirname(os.path.abspath(__file__))
CORE = ['inline', 'kernels', 'sequence', 'models', 'dense', 'data', 'checkpoints', 'train', 'bench', 'peers',
        'predict']
TESTS = sorted(glob.glob(os.path.join(HERE, 'test_*.py'))
               + glob.glob(os.path.join(HERE, 'paper', 'test_*.py')))
LAB = sorted(glob.glob(os.path.join(HERE, 'paper', '*.py')))
DOCUMENTS = ['README.md', 'RESULTS.md'] + [f'{name}.py' for name in CORE] + sorted(
    {os.path.relpath(path, HERE) for path in LAB + TESTS})


def prose(document):
    """What a document says to its reader: a Markdown file whole; of a Python file, its docstrings and
    comments."""
    text = open(os.path.join(HERE, document)).read()
    if not document.endswith('.py'):
        return text
    nodes = [n for n in ast.walk(ast.parse(text))
             if isinstance(n, (ast.Module, ast.ClassDef, ast.FunctionDef))]
    comments = [tok.string for tok in tokenize.generate_tokens(io.StringIO(text).readline)
                if tok.type == tokenize.COMMENT]
    return '\n'.join([ast.get_docstring(n) or '' for n in nodes] + comments)


def test_the_documents_name_only_what_exists():
    """Every test the README, RESULTS.md and the files' docstrings and comments name is a test of this suite;
    every `python <file>.py` they give has an entry point, and every `python -m paper COMMAND` the command;
    every picture and record the README and RESULTS.md show is in figures/ or results/; every `<module>.X` and
    `<file>.py:Name` the README names, for the core's files and the lab, is there."""
    tests = {name for path in TESTS for name in re.findall(r'^def (test_\w+)', open(path).read(), re.M)}
    commands = {name for path in LAB for name in re.findall(r"sub\.add_parser\('(\w+)'", open(path).read())}
    modules = {name: importlib.import_module(name) for name in CORE} | {'paper': paper}
    missing = []
    for document in DOCUMENTS:
        text = prose(document)
        missing += [f"{document}: {name}" for name in re.findall(r'\b(test_\w+)\b(?!\.py)', text)
                    if name not in tests]
        for script in re.findall(r'python (\w+)\.py', text):
            path = os.path.join(HERE, f'{script}.py')
            if not os.path.exists(path) or "if __name__ == '__main__':" not in open(path).read():
                missing.append(f"{document}: python {script}.py (no entry point)")
        missing += [f"{document}: python -m paper {command} (no such command)"
                    for command in re.findall(r'python -m paper ([a-z]\w*)', text) if command not in commands]
    for document in ('README.md', 'RESULTS.md'):  # the pictures and records they show or cite
        for path in re.findall(r'\b((?:figures|results|golden)/[\w./-]*\w)', prose(document)):
            if not os.path.exists(os.path.join(HERE, path)):
                missing.append(f"{document}: {path}")
    readme = open(os.path.join(HERE, 'README.md')).read()
    names = '|'.join(modules)
    for module, name in re.findall(rf'(?<![\w./])({names})\.([A-Za-z_]\w*)', readme):
        if name != 'py' and not hasattr(modules[module], name):
            missing.append(f"README.md: {module}.{name}")
    for module, path in re.findall(rf'\b({names})\.py:([\w.]+)', readme):
        obj = modules[module]
        for part in path.split('.'):
            obj = getattr(obj, part, None)
        if obj is None:
            missing.append(f"README.md: {module}.py:{path}")
    assert not missing, f"named but not there: {sorted(set(missing))}"


def test_a_failure_reads_on_one_screen(tmp_path):
    """A failing assertion in a test that uses the fast path, while torch's trace logger writes debug records
    (as it does while compiling), shows its message within 40 lines of the report and none of those records:
    pytest.ini keeps what torch logs out of failure reports."""
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
    with kernels.eagerly():
        assert kernels.inline_core_fast(q, k, v, None, (7, 7)).sum().item() == 12345.0, 'the deliberate message'
""")
    result = subprocess.run([sys.executable, '-m', 'pytest', '-q', '-p', 'no:cacheprovider', '-c',
                             os.path.join(HERE, 'pytest.ini'), '--rootdir', str(tmp_path), str(test)],
                            capture_output=True, text=True, timeout=300, cwd=tmp_path)
    lines = result.stdout.splitlines()
    assert result.returncode == 1, result.stdout[-2000:]
    first = next(i for i, line in enumerate(lines) if 'AssertionError: the deliberate message' in line)
    print(f"the message on line {first + 1} of {len(lines)}")
    # a record, not the source
    assert first < 40 and not any('a torch trace record 7' in line for line in lines)


def test_grid_and_leading_tokens_are_declared():
    """The module says how many tokens precede its grid; any other N is an error naming N, the grid and that
    count, and a grid that is not a pair of positive whole numbers says so. DeiT's attention declares its
    class token."""
    x = torch.randn(1, 17, 32)
    with pytest.raises(ValueError, match=r"17 tokens, but this attention declares 0 leading token\(s\).* "
                                         r"before its 3x5 grid: N must be 0 \+ 15 = 15"):
        inline.InLineAttention(32, 2)(x, (3, 5))
    with pytest.raises(ValueError, match=r"17 tokens, but this attention declares 1 leading token"):
        inline.InLineAttention(32, 2, leading_tokens=1)(x, (3, 5))
    assert inline.InLineAttention(32, 2, leading_tokens=2)(x, (3, 5)).shape == x.shape
    for grid in (4, (4,), (4, 0), (2.0, 8), (True, 8), '44'):
        with pytest.raises(ValueError, match=r"grid must be a pair \(h, w\) of positive whole numbers"):
            inline.InLineAttention(32, 2)(torch.randn(1, 16, 32), grid)
    with pytest.raises(ValueError, match=r"leading_tokens .* must be a whole number >= 0"):
        inline.InLineAttention(32, 2, leading_tokens=-1)
    with pytest.raises(ValueError, match=r"a 1-D sequence has no leading tokens here .*grid \(1, L\)"):
        sequence.SequenceAttention(32, 2, causal=True, leading_tokens=1)
    with pytest.raises(ValueError, match=r"declares 0 leading token"):
        models.SoftmaxAttention(32, 2)(x, (3, 5))
    assert [meta_model('inline_deit_t', layout=c).blocks[0].attn.leading_tokens for c in 'IS'] == [1, 1]
    assert {m.leading_tokens for m in meta_model('inline_swin_t').modules()
            if isinstance(m, inline.InLineBase)} == {0}

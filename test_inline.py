"""The proof: the reference against explicit formulas and the authors' golden outputs.

    python -m pytest -q test_inline.py

Golden data: ../shared/official/golden_blocks.pt, small blocks of the authors' released models with
their weights, float64 inputs and outputs (SPEC.md §5). Tests that need it skip when it is absent.
"""
import os

import pytest
import torch

import inline

GOLDEN_PATH = os.environ.get(
    'INLINE_GOLDEN', os.path.join(os.path.dirname(os.path.abspath(__file__)), '..', 'shared', 'official', 'golden_blocks.pt'))


@pytest.fixture(scope='session')
def golden():
    if not os.path.exists(GOLDEN_PATH):
        message = f"golden blocks not found at {GOLDEN_PATH} (set INLINE_GOLDEN)"
        pytest.fail(message) if os.environ.get('CI') else pytest.skip(message)
    return torch.load(GOLDEN_PATH, weights_only=True)


def qkv(B, H, N, D, dtype=torch.float64, seed=0):
    g = torch.Generator().manual_seed(seed)
    return [torch.randn(B, H, N, D, generator=g, dtype=dtype) for _ in range(3)]


# ---------------------------------------------------------------------------------------------------
# Eq. 5

@pytest.mark.parametrize('kernel', sorted(inline.KERNELS))
@pytest.mark.parametrize('N', [49, 197])
def test_eq5_explicit_equals_linear_form(kernel, N):
    phi = inline.get_kernel(kernel)
    q, k, v = qkv(2, 3, N, 32)
    q, k = phi(q), phi(k)
    w = inline.inline_weights(q, k)
    torch.testing.assert_close(w.sum(-1), torch.ones(2, 3, N, dtype=torch.float64), rtol=0, atol=1e-12)
    torch.testing.assert_close(inline.inline_attention(q, k, v), w @ v, rtol=0, atol=1e-12)


def test_eq5_weights_match_the_formula_element_by_element():
    q, k, _ = qkv(1, 1, 7, 4)
    w = inline.inline_weights(q, k)
    s, N = 4 ** -0.5, 7
    k_mean = k[0, 0].mean(0)
    for i in range(N):
        for j in range(N):
            expected = s / N * (q[0, 0, i] @ k[0, 0, j] - q[0, 0, i] @ k_mean) + 1 / N
            assert abs(w[0, 0, i, j].item() - expected.item()) < 1e-14


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

def local_residual_slow(v, r, grid):
    """Eq. 6 by a loop over every token's 3x3 neighbourhood, zero outside the grid."""
    B, H, N, D = v.shape
    h, w = grid
    out = torch.zeros_like(v)
    for b in range(B):
        for head in range(H):
            for j in range(D):
                c = head * D + j
                for y in range(h):
                    for x in range(w):
                        total = 0.0
                        for t in range(9):
                            yy, xx = y + t // 3 - 1, x + t % 3 - 1
                            if 0 <= yy < h and 0 <= xx < w:
                                total += r[b, 9 * c + t] * v[b, head, yy * w + xx, j]
                        out[b, head, y * w + x, j] = total
    return out


def test_eq6_against_explicit_loop_on_a_non_square_grid():
    grid = (3, 5)
    v = qkv(2, 2, 15, 3)[0]
    r = torch.randn(2, 9 * 6, dtype=torch.float64, generator=torch.Generator().manual_seed(1))
    torch.testing.assert_close(inline.local_residual(v, r, grid), local_residual_slow(v, r, grid), rtol=0, atol=1e-12)


def test_eq6_is_a_per_sample_depthwise_conv():
    """The released models compute Eq. 6 as one conv2d with B*C groups; the same number."""
    B, H, D, h, w = 2, 2, 4, 6, 5
    v = qkv(B, H, h * w, D)[0]
    r = torch.randn(B, 9 * H * D, dtype=torch.float64)
    grid_v = v.transpose(-2, -1).reshape(1, B * H * D, h, w)
    conv = torch.nn.functional.conv2d(grid_v, r.reshape(B * H * D, 1, 3, 3), padding=1, groups=B * H * D)
    torch.testing.assert_close(inline.local_residual(v, r, (h, w)),
                               conv.reshape(B, H, D, h * w).transpose(-2, -1), rtol=0, atol=1e-12)


def test_core_leaves_leading_tokens_without_local_residual():
    q, k, v = qkv(2, 2, 1 + 12, 8)
    r = torch.randn(2, 9 * 16, dtype=torch.float64)
    out = inline.inline_core(q, k, v, r, (3, 4))
    plain = inline.inline_attention(q, k, v)
    torch.testing.assert_close(out[:, :, :1], plain[:, :, :1], rtol=0, atol=0)
    torch.testing.assert_close(out[:, :, 1:], plain[:, :, 1:] + inline.local_residual(v[:, :, 1:], r, (3, 4)))


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


# ---------------------------------------------------------------------------------------------------
# The module against the authors' golden outputs

@pytest.mark.parametrize('kernel', ['identity', 'relu', 'leakyrelu', 'exp'])
def test_golden_swin_attention(golden, kernel):
    case = golden[f'swin_attention_{kernel}']
    cfg = case['config']
    attn = inline.InLineAttention(cfg['dim'], cfg['heads'], kernel=cfg['kernel']).double()
    attn.load_state_dict(case['state_dict'], strict=True)
    out = attn(case['inputs'][0], cfg['grid'])
    assert (out - case['output']).abs().max().item() < 1e-10


def test_module_with_class_token_and_non_square_grid_backward():
    torch.manual_seed(0)
    attn = inline.InLineAttention(32, 2)
    x = torch.randn(2, 1 + 4 * 6, 32, requires_grad=True)
    out = attn(x, (4, 6))
    out.backward(torch.randn_like(out))
    assert out.shape == x.shape and torch.isfinite(out).all()
    assert all(p.grad is not None and p.grad.abs().sum() > 0 for p in attn.parameters())


def test_linear_baseline_and_no_residual_switches():
    torch.manual_seed(0)
    x = torch.randn(2, 16, 32)
    lin = inline.InLineAttention(32, 2, kernel='relu', attention='linear')
    no_res = inline.InLineAttention(32, 2, local_residual=False)
    assert lin(x, (4, 4)).shape == x.shape and no_res.residual is None
    assert not any('residual' in name for name, _ in no_res.named_parameters())
    assert no_res(x, (4, 4)).shape == x.shape


# ---------------------------------------------------------------------------------------------------
# Bad input

def test_bad_input_errors():
    with pytest.raises(ValueError, match=r"cannot hold a 5x5 token grid"):
        inline.InLineAttention(32, 2)(torch.randn(1, 16, 32), (5, 5))
    with pytest.raises(ValueError, match=r"channels \(30\) must be divisible by heads \(4\)"):
        inline.InLineAttention(30, 4)
    with pytest.raises(ValueError, match=r"unknown kernel function 'gelu'; choose one of \['exp', 'identity'"):
        inline.InLineAttention(32, 2, kernel='gelu')
    with pytest.raises(ValueError, match=r"needs a non-negative kernel"):
        inline.InLineAttention(32, 2, kernel='identity', attention='linear')
    with pytest.raises(ValueError, match=r"cannot hold a 3x3 token grid"):
        q, k, v = qkv(1, 1, 8, 4)
        inline.inline_core(q, k, v, torch.zeros(1, 36, dtype=torch.float64), (3, 3))

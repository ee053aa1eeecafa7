"""InLine attention, the readable reference: one equation of the paper at a time.

Han et al., "Bridging the Divide: Reconsidering Softmax and Linear Attention", NeurIPS 2024,
arXiv 2412.06590. Linear attention normalises by division (w_ij = q_i.k_j / sum_t q_i.k_t), which maps
q and 2q to the same weights: it is not injective. InLine normalises by subtraction instead (Eq. 5),
which is injective and still linear in N, and adds a local attention residual over each token's 3x3
neighbourhood (Eq. 6), because linear attention alone attends too little to nearby tokens.

This file favours clarity over speed; kernels.py holds the fast path and is tested against it.

    python inline.py        # a short demonstration: injectivity, the two forms agree, O(N) vs O(N^2)

Notation, used in every shape comment: B batch, H heads, N tokens, D head dim, C = H*D channels,
(h, w) the token grid, P leading tokens that are not on the grid (DeiT's class token), N = P + h*w.
"""
import math
import time

import torch
import torch.nn as nn
import torch.nn.functional as F

# ---------------------------------------------------------------------------------------------------
# Kernel functions phi, applied to queries and keys (the paper's Table 5 ablates them)

KERNELS = {
    'identity': lambda x: x,
    'relu': F.relu,
    'leakyrelu': F.leaky_relu,  # negative slope 0.01, PyTorch's default
    'exp': lambda x: torch.exp(0.2 * x),  # the 0.2 keeps exp from overflowing on raw projections
}
NON_NEGATIVE_KERNELS = ('relu', 'exp')  # what vanilla linear attention needs: its weights divide by q.k


def get_kernel(name):
    if name not in KERNELS:
        raise ValueError(f"unknown kernel function {name!r}; choose one of {sorted(KERNELS)}")
    return KERNELS[name]


def _scale(q, scale):
    return q.shape[-1] ** -0.5 if scale is None else scale


def check_grid(N, grid):
    """The last h*w of the N tokens lie on the (h, w) grid; the N - h*w before them (P >= 0) do not."""
    h, w = grid
    if h < 1 or w < 1 or N < h * w:
        raise ValueError(f"{N} tokens cannot hold a {h}x{w} token grid: need N = P + h*w with P >= 0 "
                         f"leading tokens (e.g. a class token) and h, w >= 1")
    return N - h * w


# ---------------------------------------------------------------------------------------------------
# The two baselines the paper compares against. All attention functions take q, k, v of shape
# (B, H, N, D), already through phi, and return (B, H, N, D).

def softmax_attention(q, k, v, scale=None):
    """w_ij = exp(s q_i.k_j) / sum_t exp(s q_i.k_t). Injective, O(N^2)."""
    w = torch.softmax(_scale(q, scale) * q @ k.transpose(-2, -1), dim=-1)  # (B, H, N, N)
    return w @ v


def linear_attention(q, k, v, eps=1e-6):
    """Vanilla linear attention: w_ij = q_i.k_j / sum_t q_i.k_t, computed as q (K^T V) / (q . sum_t k_t).

    Needs a non-negative phi. Not injective: q and a*q (a > 0) give the same weights.
    """
    kv = k.transpose(-2, -1) @ v  # (B, H, D, D)
    denominator = q @ k.sum(dim=2, keepdim=True).transpose(-2, -1)  # (B, H, N, 1)
    return (q @ kv) / (denominator + eps)


def linear_attention_weights(q, k, eps=1e-6):
    """The N x N weights of vanilla linear attention, for looking at and for the injectivity test."""
    w = q @ k.transpose(-2, -1)  # (B, H, N, N)
    return w / (w.sum(dim=-1, keepdim=True) + eps)


# ---------------------------------------------------------------------------------------------------
# InLine attention, Eq. 5: w_ij = (s/N) (q_i.k_j - q_i.k_mean) + 1/N

def inline_weights(q, k, scale=None):
    """The explicit N x N weights of Eq. 5. Every row sums to exactly 1; weights may be negative.

    The paper writes Eq. 5 without s/N. Its released models fold s/N into phi(Q); we keep it here, in
    the open, so the weights are the paper's up to that factor and the output equals the released models.
    """
    N = q.shape[2]
    s = _scale(q, scale)
    k_mean = k.mean(dim=2, keepdim=True)  # (B, H, 1, D)
    return (s / N) * (q @ (k - k_mean).transpose(-2, -1)) + 1 / N  # Eq. 5, (B, H, N, N)


def inline_attention_quadratic(q, k, v, scale=None):
    """o_i = sum_j w_ij v_j with the explicit weights: O(N^2 D), for teaching and tests."""
    return inline_weights(q, k, scale) @ v  # (B, H, N, D)


def inline_attention(q, k, v, scale=None):
    """Eq. 5 in linear form, O(N D^2), never building the N x N weights.

    Summing Eq. 5 over j:  o_i = (s/N) q_i^T sum_j (k_j - k_mean) v_j^T + v_mean
                               = s q_i^T Cov + v_mean,   Cov = (1/N) sum_j (k_j - k_mean)(v_j - v_mean)^T
    (subtracting v_mean inside the sum changes nothing, since sum_j (k_j - k_mean) = 0). The released
    models compute the uncentred q^T (K^T V) - N (q.k_mean) v_mean instead: the same number in exact
    arithmetic, but the centred covariance keeps its precision in bf16 when the means are large.
    """
    N = q.shape[2]
    s = _scale(q, scale)
    k_mean = k.mean(dim=2, keepdim=True)  # (B, H, 1, D)
    v_mean = v.mean(dim=2, keepdim=True)  # (B, H, 1, D)
    # (B, H, D, D); equals K^T V / N - k_mean^T v_mean, the released models' uncentred product
    cov = (k - k_mean).transpose(-2, -1) @ (v - v_mean) / N
    return s * (q @ cov) + v_mean  # Eq. 5 summed over j, (B, H, N, D)


# ---------------------------------------------------------------------------------------------------
# The local attention residual, Eq. 6: o_i += sum_{t=1..9} r_t v_{N_t(i)} over the 3x3 neighbourhood

def residual_mlp(dim, num_heads):
    """Predicts the nine neighbour weights of every channel from the token mean of the input.

    Two 1x1 grouped convolutions, one group per head (block-diagonal per head), GELU between:
    C -> C -> 9C. Output channel 9c + t is the weight of neighbour t (row-major over the 3x3 window)
    for channel c = head*D + j. Keys: residual.0.*, residual.2.* as in the released checkpoints.
    """
    return nn.Sequential(
        nn.Conv1d(dim, dim, kernel_size=1, groups=num_heads),
        nn.GELU(),
        nn.Conv1d(dim, dim * 9, kernel_size=1, groups=num_heads),
    )


def residual_weights(mlp, x):
    """r = W2 GELU(W1 mean_tokens(x) + b1) + b2 for x of shape (B, N, C); returns (B, 9C)."""
    return mlp(x.mean(dim=1).unsqueeze(-1)).squeeze(-1)  # (B, C, 1) -> (B, 9C, 1) -> (B, 9C)


def local_residual(v, r, grid):
    """Eq. 6: sum over the nine neighbours t of r[b, 9c + t] * v at the neighbour, zero padding outside.

    v (B, H, h*w, D) on the grid, r (B, 9C) per sample and channel, grid = (h, w). The sum over a 3x3
    neighbourhood with a weight per channel is a depthwise 3x3 convolution; a different kernel for every
    sample makes it one convolution with B*C groups, each (sample, channel) plane its own group. Kernel
    entry t = 3*dy + dx multiplies the neighbour at offset (dy - 1, dx - 1): row-major, as Eq. 6 counts.
    """
    B, H, N, D = v.shape
    h, w = grid
    v = v.transpose(-2, -1).reshape(1, B * H * D, h, w)  # (1, B*C, h, w), plane b*C + head*D + j
    kernels = r.reshape(B * H * D, 1, 3, 3)  # (B*C, 1, 3, 3), one 3x3 kernel per sample and channel
    out = F.conv2d(v, kernels, padding=1, groups=B * H * D)  # Eq. 6, (1, B*C, h, w)
    return out.reshape(B, H, D, N).transpose(-2, -1)  # (B, H, h*w, D)


def add_local_residual(o, v, r, grid):
    """o + Eq. 6 on the last h*w tokens of o and v (B, H, N, D); the P = N - h*w leading ones get none."""
    P = check_grid(o.shape[2], grid)
    o_grid = o[:, :, P:] + local_residual(v[:, :, P:], r, grid)  # Eq. 6, (B, H, h*w, D)
    return torch.cat([o[:, :, :P], o_grid], dim=2)  # (B, H, N, D)


def inline_core(q, k, v, r, grid, scale=None):
    """Eq. 5 over all N tokens, then Eq. 6 on the last h*w tokens: the whole InLine attention core.

    q, k, v (B, H, N, D) with q, k already through phi; r (B, 9C) residual weights, or None for no
    local residual; grid = (h, w) of the last h*w tokens (the N - h*w leading ones get none).
    kernels.inline_core_fast takes the same arguments and returns the same result, faster.
    """
    o = inline_attention(q, k, v, scale)  # Eq. 5, (B, H, N, D)
    return o if r is None else add_local_residual(o, v, r, grid)


# ---------------------------------------------------------------------------------------------------
# The module the four backbones share

class InLineAttention(nn.Module):
    """Projections around the InLine core: x (B, N, C) -> q, k, v -> Eq. 5 + Eq. 6 -> proj -> (B, N, C).

    kernel: phi, one of KERNELS. local_residual: Eq. 6 on or off (the paper's Table 4 ablation).
    separate_q: PVT's parameter layout (`q` C->C and `kv` C->2C) instead of `qkv` C->3C.
    attention: 'inline' (Eq. 5) or 'linear', the vanilla division-normalised baseline (Table 3), which
    needs a non-negative kernel. `core` is the function computing Eq. 5 + Eq. 6; kernels.enable_fast
    replaces it with the fused one.
    """
    core = staticmethod(inline_core)

    def __init__(self, dim, num_heads, *, kernel='identity', local_residual=True, qkv_bias=True,
                 separate_q=False, attention='inline'):
        super().__init__()
        if dim % num_heads != 0:
            raise ValueError(f"channels ({dim}) must be divisible by heads ({num_heads})")
        if attention not in ('inline', 'linear'):
            raise ValueError(f"unknown attention {attention!r}; choose 'inline' or 'linear'")
        if attention == 'linear' and kernel not in NON_NEGATIVE_KERNELS:
            raise ValueError(f"vanilla linear attention divides by q.k, so it needs a non-negative kernel "
                             f"{NON_NEGATIVE_KERNELS}, got {kernel!r}")
        self.num_heads = num_heads
        self.kernel = kernel
        self.kernel_function = get_kernel(kernel)
        self.attention = attention
        if separate_q:
            self.q = nn.Linear(dim, dim, bias=qkv_bias)
            self.kv = nn.Linear(dim, 2 * dim, bias=qkv_bias)
        else:
            self.qkv = nn.Linear(dim, 3 * dim, bias=qkv_bias)
        self.proj = nn.Linear(dim, dim)
        self.residual = residual_mlp(dim, num_heads) if local_residual else None

    def forward(self, x, grid):
        B, N, C = x.shape
        check_grid(N, grid)
        if hasattr(self, 'qkv'):
            q, k, v = self.qkv(x).chunk(3, dim=-1)  # 3 x (B, N, C)
        else:
            q = self.q(x)  # (B, N, C)
            k, v = self.kv(x).chunk(2, dim=-1)  # 2 x (B, N, C)
        q, k = self.kernel_function(q), self.kernel_function(k)
        q, k, v = (t.reshape(B, N, self.num_heads, -1).transpose(1, 2) for t in (q, k, v))  # (B, H, N, D)
        r = residual_weights(self.residual, x) if self.residual is not None else None  # (B, 9C)
        if self.attention == 'linear':
            o = linear_attention(q, k, v)  # (B, H, N, D)
            if r is not None:
                o = add_local_residual(o, v, r, grid)  # Eq. 6
        else:
            o = self.core(q, k, v, r, grid)  # Eq. 5 + Eq. 6, (B, H, N, D)
        return self.proj(o.transpose(1, 2).reshape(B, N, C))  # (B, N, C)


# ---------------------------------------------------------------------------------------------------
# python inline.py: a demonstration a reader can follow

def _demo():
    torch.manual_seed(0)
    B, H, N, D = 1, 1, 16, 8
    k = torch.randn(B, H, N, D, dtype=torch.float64)
    v = torch.randn(B, H, N, D, dtype=torch.float64)
    q = torch.randn(B, H, 1, D, dtype=torch.float64)
    relu = get_kernel('relu')

    print("1. Injectivity: does the query q get different weights from 2q? (16 random keys)")
    pairs = {
        'softmax': lambda q: torch.softmax(q @ k.transpose(-2, -1) * D ** -0.5, dim=-1),
        'linear (relu)': lambda q: linear_attention_weights(relu(q), relu(k), eps=0),
        'InLine': lambda q: inline_weights(q, k),
    }
    for name, weights in pairs.items():
        diff = (weights(q) - weights(2 * q)).abs().max().item()
        print(f"   {name:14s} max |w(q) - w(2q)| = {diff:.3e}   {'distinct' if diff > 1e-9 else 'SAME: not injective'}")

    q = torch.randn(B, H, N, D, dtype=torch.float64)
    w = inline_weights(q, k)
    print("\n2. Eq. 5, explicit N x N weights vs the linear O(N D^2) form (float64)")
    print(f"   rows of w sum to 1: max |sum_j w_ij - 1| = {(w.sum(-1) - 1).abs().max().item():.1e}")
    print(f"   max |w @ v - linear form| = "
          f"{(inline_attention_quadratic(q, k, v) - inline_attention(q, k, v)).abs().max().item():.1e}")
    print(f"   negative weights: {(w < 0).float().mean().item():.0%} of them (intended: no non-negativity constraint)")

    print(f"\n3. Time of one forward, B=1, H=3, D=32, float32, {torch.get_num_threads()} threads on this machine")
    print(f"   {'tokens':>8s} {'softmax ms':>11s} {'InLine ms':>10s} {'ratio':>6s}")
    for side in (14, 28, 56, 80):
        N = side * side
        q, k, v = (torch.randn(1, 3, N, 32) for _ in range(3))
        times = []
        for fn in (softmax_attention, inline_attention):
            fn(q, k, v)
            start = time.perf_counter()
            for _ in range(5):
                fn(q, k, v)
            times.append((time.perf_counter() - start) / 5 * 1e3)
        print(f"   {N:8d} {times[0]:11.2f} {times[1]:10.2f} {times[0] / times[1]:5.1f}x")
    print("   softmax grows as N^2, InLine as N: the ratio grows with the token count.")


if __name__ == '__main__':
    _demo()

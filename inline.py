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
    'relu_affine': None,  # learnable: ReLUAffine below, one per attention layer
    'zero': torch.zeros_like,  # phi = 0: Eq. 5 gives every weight 1/N, attention that cannot select (paper.py's floor)
}
NON_NEGATIVE_KERNELS = ('relu', 'exp', 'relu_affine')  # what vanilla linear attention needs: it divides by q.k


class ReLUAffine(nn.Module):
    """phi(x) = ReLU(A x + b) on each head's D dims, one A (D x D) and b (D) per layer, shared by q and k and
    by the heads (the paper's Table 3 'relu_affine'; no code was released, so this is our construction).
    Starts as plain relu: A = I, b = 0."""

    def __init__(self, head_dim):
        super().__init__()
        self.weight = nn.Parameter(torch.eye(head_dim))
        self.bias = nn.Parameter(torch.zeros(head_dim))

    def forward(self, x):
        return F.relu(F.linear(x, self.weight, self.bias))  # (..., D) -> (..., D)


def get_kernel(name, head_dim=None):
    """The kernel function phi by name; 'relu_affine' is a module with parameters, built for head_dim."""
    if name not in KERNELS:
        raise ValueError(f"unknown kernel function {name!r}; choose one of {sorted(KERNELS)}")
    return ReLUAffine(head_dim) if name == 'relu_affine' else KERNELS[name]


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

RESIDUALS = {'local': 9, 'plain': 1, 'none': 0}  # residual type -> taps T, the neighbours each weight covers


def residual_mlp(dim, num_heads, taps=9):
    """Predicts the T neighbour weights of every channel from the token mean of the input.

    Two 1x1 grouped convolutions, one group per head (block-diagonal per head), GELU between:
    C -> C -> T*C. Output channel T*c + t is the weight of neighbour t (row-major over the 3x3 window
    for T = 9; the token itself for T = 1, the paper's 'plain' residual) for channel c = head*D + j.
    Keys: residual.0.*, residual.2.* as in the released checkpoints.
    """
    return nn.Sequential(
        nn.Conv1d(dim, dim, kernel_size=1, groups=num_heads),
        nn.GELU(),
        nn.Conv1d(dim, dim * taps, kernel_size=1, groups=num_heads),
    )


def residual_weights(mlp, x):
    """r = W2 GELU(W1 mean_tokens(x) + b1) + b2 for x of shape (B, N, C); returns (B, T*C)."""
    return mlp(x.mean(dim=1).unsqueeze(-1)).squeeze(-1)  # (B, C, 1) -> (B, T*C, 1) -> (B, T*C)


def local_residual(v, r, grid, dilation=1):
    """Eq. 6: sum over the neighbours t of r[b, T*c + t] * v at the neighbour, zero padding outside.

    v (B, H, h*w, D) on the grid, r (B, T*C) per sample and channel, grid = (h, w). T = 9: the 3x3
    neighbourhood, neighbour t = 3*dy + dx at offset (dilation*(dy - 1), dilation*(dx - 1)), row-major as
    Eq. 6 counts (dilation > 1 is the paper's R-dil ablation). T = 1: the token itself, o_i += r * v_i.
    The sum over a neighbourhood with a weight per channel is a depthwise convolution; a different kernel
    for every sample makes it one convolution with B*C groups, each (sample, channel) plane its own group.
    """
    B, H, N, D = v.shape
    h, w = grid
    side = 3 if r.shape[1] == 9 * H * D else 1  # T = 9 or 1
    v = v.transpose(-2, -1).reshape(1, B * H * D, h, w)  # (1, B*C, h, w), plane b*C + head*D + j
    kernels = r.reshape(B * H * D, 1, side, side)  # (B*C, 1, 3, 3), one kernel per sample and channel
    out = F.conv2d(v, kernels, padding=dilation * (side // 2), dilation=dilation, groups=B * H * D)  # Eq. 6
    return out.reshape(B, H, D, N).transpose(-2, -1)  # (B, H, h*w, D)


def add_local_residual(o, v, r, grid, dilation=1):
    """o + Eq. 6 on the last h*w tokens of o and v (B, H, N, D); the P = N - h*w leading ones get none."""
    P = check_grid(o.shape[2], grid)
    o_grid = o[:, :, P:] + local_residual(v[:, :, P:], r, grid, dilation)  # Eq. 6, (B, H, h*w, D)
    return torch.cat([o[:, :, :P], o_grid], dim=2)  # (B, H, N, D)


def inline_core(q, k, v, r, grid, scale=None, dilation=1):
    """Eq. 5 over all N tokens, then Eq. 6 on the last h*w tokens: the whole InLine attention core.

    q, k, v (B, H, N, D) with q, k already through phi; r (B, T*C) residual weights (T = 9, or 1 for the
    plain residual), or None for no residual; grid = (h, w) of the last h*w tokens (the N - h*w leading
    ones get none); dilation of Eq. 6's neighbourhood.
    kernels.inline_core_fast takes the same arguments and returns the same result, faster.
    """
    o = inline_attention(q, k, v, scale)  # Eq. 5, (B, H, N, D)
    return o if r is None else add_local_residual(o, v, r, grid, dilation)


# ---------------------------------------------------------------------------------------------------
# The modules the four backbones share

class InLineBase(nn.Module):
    """What every InLine (or vanilla linear) attention does between its projections: phi, Eq. 5 (or the
    division of linear attention), Eq. 6. InLineAttention adds the projections; CSwin's stripe branch
    (models.py) shares one qkv per block and so uses this alone. `core` computes Eq. 5 + Eq. 6;
    kernels.enable_fast replaces it with the fused one.

    kernel: phi, one of KERNELS. residual: 'local' (Eq. 6), 'plain' (o_i += r * v_i) or 'none'.
    dilation: of Eq. 6's 3x3 neighbourhood. attention: 'inline' (Eq. 5) or 'linear', the vanilla
    division-normalised baseline, which needs a non-negative kernel unless allow_divergent (the paper's
    Table 3 reports that it does not converge with identity or leakyrelu). nonneg: the R-nonneg ablation
    (ours): q and k L2-normalised per head and s = 1/2, so s |q.(k_j - k_mean)| <= 1 and every w_ij >= 0.
    """
    core = staticmethod(inline_core)

    def setup_inline(self, dim, num_heads, *, kernel='identity', residual='local', dilation=1, nonneg=False,
                     attention='inline', allow_divergent=False):
        if dim % num_heads != 0:
            raise ValueError(f"channels ({dim}) must be divisible by heads ({num_heads})")
        if attention not in ('inline', 'linear'):
            raise ValueError(f"unknown attention {attention!r}; choose 'inline' or 'linear'")
        if residual not in RESIDUALS:
            raise ValueError(f"unknown residual {residual!r}; choose one of {list(RESIDUALS)}")
        if not (isinstance(dilation, int) and dilation >= 1) or (dilation > 1 and residual != 'local'):
            raise ValueError(f"dilation must be a whole number >= 1, and > 1 only with residual='local' "
                             f"(it spreads Eq. 6's 3x3 neighbourhood), got {dilation!r} with residual={residual!r}")
        if attention == 'linear' and kernel not in NON_NEGATIVE_KERNELS and not allow_divergent:
            raise ValueError(f"vanilla linear attention divides by q.k, so it needs a non-negative kernel "
                             f"{NON_NEGATIVE_KERNELS}, got {kernel!r}; pass allow_divergent=True to run it anyway "
                             f"(the paper's Table 3 reports that it does not converge)")
        if nonneg and attention != 'inline':
            raise ValueError("nonneg (every weight >= 0) is an option of InLine attention, not of linear attention, "
                             "whose weights are already non-negative")
        self.num_heads, self.kernel, self.attention, self.nonneg = num_heads, kernel, attention, nonneg
        self.residual_type, self.dilation = residual, dilation
        self.phi = get_kernel(kernel, dim // num_heads)
        self.residual = residual_mlp(dim, num_heads, RESIDUALS[residual]) if residual != 'none' else None

    def prepare(self, q, k):
        """q, k (B, H, N, D) -> phi(q), phi(k) and the scale s (None: D^-1/2)."""
        q, k = self.phi(q), self.phi(k)
        if self.nonneg:  # R-nonneg: |q| = |k_j| = 1, so |q.(k_j - k_mean)| <= 2 and s = 1/2 keeps w_ij >= 0
            return F.normalize(q, dim=-1), F.normalize(k, dim=-1), 0.5
        return q, k, None

    def attend(self, q, k, v, x, grid):
        """q, k, v (B, H, N, D) before phi; x (B, N', C) the tokens Eq. 6's weights are predicted from.
        Returns o (B, H, N, D)."""
        q, k, scale = self.prepare(q, k)
        r = residual_weights(self.residual, x) if self.residual is not None else None  # (B, T*C)
        if self.attention == 'linear':
            o = linear_attention(q, k, v)  # (B, H, N, D)
            return o if r is None else add_local_residual(o, v, r, grid, self.dilation)  # Eq. 6
        return self.core(q, k, v, r, grid, scale, self.dilation)  # Eq. 5 + Eq. 6, (B, H, N, D)

    def explicit_weights(self, q, k):
        """The N x N weights of Eq. 5 (or of linear attention) for q, k (B, H, N, D) before phi. Eq. 6's
        residual is not among them: its weights are per channel, not per head."""
        q, k, scale = self.prepare(q, k)
        return linear_attention_weights(q, k) if self.attention == 'linear' else inline_weights(q, k, scale)


def add_projections(module, dim, qkv_bias, separate_q):
    """The attention's input and output projections under the released names: `qkv` C->3C, or PVT's `q`
    C->C and `kv` C->2C; `proj` C->C. Shared by InLineAttention and the softmax attention of models.py."""
    if separate_q:
        module.q = nn.Linear(dim, dim, bias=qkv_bias)
        module.kv = nn.Linear(dim, 2 * dim, bias=qkv_bias)
    else:
        module.qkv = nn.Linear(dim, 3 * dim, bias=qkv_bias)
    module.proj = nn.Linear(dim, dim)


class InLineAttention(InLineBase):
    """Projections around the InLine core: x (B, N, C) -> q, k, v -> Eq. 5 + Eq. 6 -> proj -> (B, N, C).

    dim, num_heads: C and H.
    qkv_bias: biases in the input projections (every released model has them).
    separate_q: PVT's parameter layout (`q` C->C and `kv` C->2C) instead of `qkv` C->3C.
    ape_tokens: N of the authors' absolute position embedding, a (1, N, C) parameter added to x before the
        projections, so it reaches q, k and v but not the block's shortcut; None: none. The authors use it
        in their ablations without Eq. 6 (their answer in their repository's issue #6; README, "The paper's
        experiments").
    kernel: phi, one of KERNELS ('identity' for InLine).
    residual: 'local' (Eq. 6), 'plain' (o_i += r * v_i) or 'none'.
    dilation: of Eq. 6's 3x3 neighbourhood.
    nonneg: every weight forced >= 0 (R-nonneg, ours).
    attention: 'inline' (Eq. 5) or 'linear' (vanilla division).
    allow_divergent: let vanilla linear attention run with a signed kernel.
    The last six are InLineBase's; it says more of each.
    """

    def __init__(self, dim, num_heads, *, qkv_bias=True, separate_q=False, ape_tokens=None, **options):
        super().__init__()
        self.setup_inline(dim, num_heads, **options)
        add_projections(self, dim, qkv_bias, separate_q)
        self.ape = None
        if ape_tokens:
            self.ape = nn.Parameter(torch.zeros(1, ape_tokens, dim))
            nn.init.trunc_normal_(self.ape, std=.02)

    def project(self, x, grid):
        """x (B, N, C) -> x with the APE added, and q, k, v (B, H, N, D)."""
        B, N, C = x.shape
        check_grid(N, grid)
        if self.ape is not None:
            if self.ape.shape[1] != N:
                raise ValueError(f"this attention's position embedding (ape) covers {self.ape.shape[1]} tokens, got "
                                 f"{N}: build the model for this input size")
            x = x + self.ape
        if hasattr(self, 'qkv'):
            q, k, v = self.qkv(x).chunk(3, dim=-1)  # 3 x (B, N, C)
        else:
            q = self.q(x)  # (B, N, C)
            k, v = self.kv(x).chunk(2, dim=-1)  # 2 x (B, N, C)
        return x, *(t.reshape(B, N, self.num_heads, -1).transpose(1, 2) for t in (q, k, v))  # (B, H, N, D)

    def forward(self, x, grid):
        B, N, C = x.shape
        x, q, k, v = self.project(x, grid)
        o = self.attend(q, k, v, x, grid)  # Eq. 5 + Eq. 6, (B, H, N, D)
        return self.proj(o.transpose(1, 2).reshape(B, N, C))  # (B, N, C)

    def weights(self, x, grid):
        """The explicit attention weights (B, H, N, N) this module applies to x (B, N, C)."""
        _, q, k, _ = self.project(x, grid)
        return self.explicit_weights(q, k)


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
    print("   softmax as a user runs it (F.scaled_dot_product_attention), against InLine's linear form")
    print(f"   {'tokens':>8s} {'softmax ms':>11s} {'InLine ms':>10s} {'ratio':>6s}")
    for side in (14, 28, 56, 80):
        N = side * side
        q, k, v = (torch.randn(1, 3, N, 32) for _ in range(3))
        times = []
        for fn in (F.scaled_dot_product_attention, inline_attention):
            fn(q, k, v)
            start = time.perf_counter()
            for _ in range(5):
                fn(q, k, v)
            times.append((time.perf_counter() - start) / 5 * 1e3)
        print(f"   {N:8d} {times[0]:11.2f} {times[1]:10.2f} {times[0] / times[1]:5.1f}x")
    print("   softmax grows as N^2, InLine as N: the ratio grows with the token count. Whole models:\n"
          "   python paper.py speed")


if __name__ == '__main__':
    _demo()

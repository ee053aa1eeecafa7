"""InLine attention, the readable reference: one equation of the paper at a time.

Han et al., "Bridging the Divide: Reconsidering Softmax and Linear Attention", NeurIPS 2024,
arXiv 2412.06590. Linear attention normalises by division (w_ij = q_i.k_j / sum_t q_i.k_t), which maps
q and 2q to the same weights: it is not injective. InLine normalises by subtraction instead (Eq. 5),
which is injective (given D + 1 tokens or more: inline_weights) and still linear in N, and adds a local attention
residual over each token's 3x3 neighbourhood (Eq. 6), because linear attention alone attends too little to nearby
tokens.

On sequences (README, "InLine on sequences"): `causal=True` gives Eq. 5 over each prefix 1..i, in three forms
(prefix sums, chunks for training, a recurrent step for generation: InLineAttention.step), and Eq. 6 over the last
k tokens; InLineAttention(dim, num_heads, causal=True) takes (B, N, C) with no grid, as does sequence=True.

This file favours clarity over speed; kernels.py holds the fast path and is tested against it.

    python inline.py        # a short demonstration: injectivity, the two forms agree, O(N) vs O(N^2)

Notation, used in every shape comment: B batch, H heads, N tokens, D head dim, C = H*D channels,
(h, w) the token grid, P leading tokens that are not on the grid (DeiT's class token), N = P + h*w.
"""
import contextlib
import math
import time

import torch
import torch.nn as nn
import torch.nn.functional as F

# ---------------------------------------------------------------------------------------------------
# Kernel functions phi, applied to queries and keys (the paper's Table 5 ablates them)

KERNELS = {  # name -> phi; a new one is one line here (and in NON_NEGATIVE_KERNELS if it is >= 0), tests included
    'identity': nn.Identity(),  # stateless, so one instance serves every layer
    'relu': F.relu,
    'leakyrelu': F.leaky_relu,  # negative slope 0.01, PyTorch's default
    'exp': lambda x: torch.exp(0.2 * x),  # the 0.2 keeps exp from overflowing on raw projections
    'one_plus_elu': lambda x: 1 + F.elu(x),  # > 0: elu + 1, the map of Katharopoulos et al. (2020)'s linear attention
    'relu_affine': None,  # learnable: ReLUAffine below, one per attention layer
    'zero': torch.zeros_like,  # phi = 0: Eq. 5 gives every weight 1/N, attention that cannot select (paper.py's floor)
}
# what vanilla linear attention needs: it divides by q.k
NON_NEGATIVE_KERNELS = ('relu', 'exp', 'one_plus_elu', 'relu_affine')


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


def attention_scale(D):
    """D^-1/2, the default scale s of q.k in Eq. 5 and in softmax, the paper's: the one place it is written. A scale
    given instead may be a number or a tensor that broadcasts against (B, H, N, 1), such as a learnable per-head
    temperature (1, H, 1, 1) (README, "Changing the method")."""
    return D ** -0.5


def get_kernel(name, head_dim=None):
    """The kernel function phi by name; 'relu_affine' is a module with parameters, built for head_dim."""
    if name not in KERNELS:
        raise ValueError(f"unknown kernel function {name!r}; choose one of {sorted(KERNELS)}")
    return ReLUAffine(head_dim) if name == 'relu_affine' else KERNELS[name]


def check_grid(N, grid, leading_tokens=None):
    """P, the leading tokens before the (h, w) grid of N tokens: N = P + h*w. leading_tokens is what the module
    declares (DeiT's class token: 1; Swin's windows, PVT and CSwin: 0), and any other N is an error; None (the
    cores, whose module has checked): any P >= 0. grid must be a pair of positive whole numbers."""
    if not (isinstance(grid, (tuple, list)) and len(grid) == 2
            and all(isinstance(s, int) and not isinstance(s, bool) and s >= 1 for s in grid)):
        raise ValueError(f"grid must be a pair (h, w) of positive whole numbers, the token grid; got {grid!r}")
    h, w = grid
    if leading_tokens is None:
        if N < h * w:
            raise ValueError(f"{N} tokens cannot hold a {h}x{w} token grid of {h * w}")
        return N - h * w
    if N != leading_tokens + h * w:
        raise ValueError(f"{N} tokens, but this attention declares {leading_tokens} leading token(s) (leading_tokens, "
                         f"e.g. DeiT's class token) before its {h}x{w} grid: N must be {leading_tokens} + {h * w} = "
                         f"{leading_tokens + h * w}")
    return leading_tokens


# ---------------------------------------------------------------------------------------------------
# The two baselines the paper compares against. All attention functions take q, k, v of shape
# (B, H, N, D), already through phi, and return (B, H, N, D).

def softmax_attention(q, k, v, scale=None):
    """w_ij = exp(s q_i.k_j) / sum_t exp(s q_i.k_t). Injective, O(N^2)."""
    s = attention_scale(q.shape[-1]) if scale is None else scale
    w = torch.softmax(s * q @ k.transpose(-2, -1), dim=-1)  # (B, H, N, N)
    return w @ v


def linear_attention(q, k, v, eps=1e-6, causal=False):
    """Vanilla linear attention: w_ij = q_i.k_j / sum_t q_i.k_t, computed as q (K^T V) / (q . sum_t k_t);
    causal: the sums over t <= i, as q_i^T sum_{j<=i} k_j v_j^T / (q_i . sum_{j<=i} k_j), in chunks (causal_products).

    Needs a non-negative phi. Not injective: q and a*q (a > 0) give the same weights.
    """
    if causal:
        return causal_products(q, k, v)[0] / ((q * k.cumsum(2)).sum(-1, keepdim=True) + eps)  # (B, H, N, D)
    kv = k.transpose(-2, -1) @ v  # (B, H, D, D)
    denominator = q @ k.sum(dim=2, keepdim=True).transpose(-2, -1)  # (B, H, N, 1)
    return (q @ kv) / (denominator + eps)


def linear_attention_weights(q, k, eps=1e-6, causal=False):
    """The N x N weights of vanilla linear attention, for looking at and for the injectivity test."""
    w = q @ k.transpose(-2, -1)  # (B, H, N, N)
    w = w.tril() if causal else w  # causal: token i sees j <= i only
    return w / (w.sum(dim=-1, keepdim=True) + eps)


# ---------------------------------------------------------------------------------------------------
# InLine attention, Eq. 5: w_ij = s (q_i.k_j - q_i.k_mean) + 1/N, with s/N in place of s in the released models

def eq5_gain(s, n, scale_by_count=True):
    """The factor of q_i.(k_j - k_mean) in Eq. 5 over n tokens, decided here for every form. scale_by_count: s/n, the
    released models' (they fold s/N into phi(Q); on a prefix it becomes s/i), which the authors' logits need; else
    s, the paper's printed Eq. 5. n: the token count, or the counts (N, 1) of a causal form's rows."""
    return s / n if scale_by_count else s


def inline_weights(q, k, scale=None, causal=False, scale_by_count=True):
    """The explicit N x N weights of Eq. 5. Every row sums to exactly 1; weights may be negative.

    scale_by_count (eq5_gain): w_ij = (s/N)(q_i.k_j - q_i.k_mean) + 1/N, the released models' factor, kept here in
    the open so the output equals theirs; False: s (q_i.k_j - q_i.k_mean) + 1/N, Eq. 5 as the paper prints it.
    causal: Eq. 5 over each prefix, w_ij = g_i (q_i.k_j - q_i.k_mean_i) + 1/i for j <= i, 0 for j > i, with k_mean_i
    the mean of k_1..k_i and g_i = s/i or s; rows still sum to 1.
    Injective in q_i where the centred keys k_j - k_mean_i span all D dimensions, so at least D + 1 tokens (N, or i
    on a prefix): then q_i -> row i is an affine map of full rank. With fewer, a change of q_i orthogonal to every
    k_j - k_mean_i leaves row i as it was (README, "InLine on sequences"). The same under either factor.
    """
    N = q.shape[2]
    s = attention_scale(q.shape[-1]) if scale is None else scale
    if causal:
        n = torch.arange(1, N + 1, dtype=q.dtype, device=q.device)[:, None]  # (N, 1): the count i of row i
        k_mean = k.cumsum(2) / n  # (B, H, N, D): k_mean_i
        g = eq5_gain(s, n, scale_by_count)  # s/i or s
        w = g * (q @ k.transpose(-2, -1) - (q * k_mean).sum(-1, keepdim=True)) + 1 / n  # Eq. 5, (B, H, N, N)
        return w.tril()  # 0 for j > i
    k_mean = k.mean(dim=2, keepdim=True)  # (B, H, 1, D)
    return eq5_gain(s, N, scale_by_count) * (q @ (k - k_mean).transpose(-2, -1)) + 1 / N  # Eq. 5, (B, H, N, N)


def inline_attention_quadratic(q, k, v, scale=None, causal=False, scale_by_count=True):
    """o_i = sum_j w_ij v_j with the explicit weights (causal: over each prefix): O(N^2 D), for teaching and tests."""
    return inline_weights(q, k, scale, causal, scale_by_count) @ v  # (B, H, N, D)


def inline_attention(q, k, v, scale=None, causal=False, scale_by_count=True):
    """Eq. 5 in linear form, O(N D^2), never building the N x N weights.

    Summing Eq. 5 over j, with g = s/N (scale_by_count) or s:
        o_i = g q_i^T sum_j (k_j - k_mean) v_j^T + v_mean = g N q_i^T Cov + v_mean,
        Cov = (1/N) sum_j (k_j - k_mean)(v_j - v_mean)^T
    (subtracting v_mean inside the sum changes nothing, since sum_j (k_j - k_mean) = 0). The released
    models compute the uncentred q^T (K^T V) - N (q.k_mean) v_mean instead: the same number in exact
    arithmetic, but the centred covariance keeps its precision in bf16 when the means are large.
    causal: the same over each prefix, o_i = g_i i q_i^T Cov_i + v_mean_i, from prefix sums of k v^T, k and v (below).
    """
    N = q.shape[2]
    s = attention_scale(q.shape[-1]) if scale is None else scale
    if causal:
        # Cov_i = (1/i) sum_{j<=i} k_j v_j^T - k_mean_i v_mean_i^T: the uncentred form, since centring on a mean that
        # moves with i would revisit every earlier token. Its subtraction cancels the leading digits the means
        # share: with means m times the spread, about 2 log2(m) bits are lost, most of bf16's 8 but few of fp32's
        # 24. So the sums accumulate and subtract in fp32 (or wider) and the output is rounded once.
        dtype, acc = q.dtype, torch.promote_types(q.dtype, torch.float32)
        q, k, v = q.to(acc), k.to(acc), v.to(acc)
        n = torch.arange(1, N + 1, dtype=acc, device=q.device)[:, None]  # (N, 1): the count i
        k_mean, v_mean = k.cumsum(2) / n, v.cumsum(2) / n  # (B, H, N, D): the prefix means
        kv = (k.unsqueeze(-1) * v.unsqueeze(-2)).cumsum(2)  # (B, H, N, D, D): sum_{j<=i} k_j v_j^T
        cov = kv / n[..., None] - k_mean.unsqueeze(-1) * v_mean.unsqueeze(-2)  # (B, H, N, D, D): Cov_i
        g = eq5_gain(s, n, scale_by_count) * n  # (N, 1): s, or s i
        return (g * (q.unsqueeze(-2) @ cov).squeeze(-2) + v_mean).to(dtype)  # Eq. 5 over the prefix, (B, H, N, D)
    k_mean = k.mean(dim=2, keepdim=True)  # (B, H, 1, D)
    v_mean = v.mean(dim=2, keepdim=True)  # (B, H, 1, D)
    # (B, H, D, D); equals K^T V / N - k_mean^T v_mean, the released models' uncentred product
    cov = (k - k_mean).transpose(-2, -1) @ (v - v_mean) / N
    g = s if scale_by_count else s * N  # eq5_gain(s, N) * N, written out: s/N or s, times N
    return g * (q @ cov) + v_mean  # Eq. 5 summed over j, (B, H, N, D)


def causal_products(q, k, v, kv=None, chunk=64):
    """sum_{j<=i} (q_i.k_j) v_j for every token i, (B, H, N, D), in chunks of L tokens: the masked L x L products
    within a chunk, a running D x D sum of k v^T across chunks, which starts from kv (B, H, D, D), the sum over the
    tokens before these (None: none). Returns them and the running sum after the last token. O(N L D + N D^2)."""
    B, H, N, D = q.shape
    L = min(chunk, N)
    qc, kc, vc = (F.pad(t, (0, 0, 0, -N % L)).reshape(B, H, -1, L, D) for t in (q, k, v))  # (B, H, N/L, L, D)
    chunk_kv = kc.transpose(-2, -1) @ vc  # (B, H, N/L, D, D): each chunk's sum of k v^T (zero padding adds none)
    before = F.pad(chunk_kv.cumsum(2)[:, :, :-1], (0, 0, 0, 0, 1, 0))  # (B, H, N/L, D, D): the earlier chunks' sums
    before = before if kv is None else before + kv.unsqueeze(2)  # and the tokens' before these
    scores = (qc @ kc.transpose(-2, -1)).tril()  # (B, H, N/L, L, L): q_i.k_j within the chunk, j <= i
    out = (qc @ before + scores @ vc).reshape(B, H, -1, D)[:, :, :N]  # (B, H, N, D)
    return out, before[:, :, -1] + chunk_kv[:, :, -1]


def inline_chunked(q, k, v, scale=None, state=None, chunk=64, scale_by_count=True):
    """Causal Eq. 5 in chunks, for training: inline_attention(causal=True)'s output without its (B, H, N, D, D)
    prefix sums. state: inline_step's, the tokens before these (None: none), so a sequence goes on where a call
    stopped. Returns o (B, H, N, D) and the state after the last token. Sums in fp32, as in inline_attention."""
    B, H, N, D = q.shape
    s = attention_scale(D) if scale is None else scale
    dtype, acc = q.dtype, torch.promote_types(q.dtype, torch.float32)
    zeros = torch.zeros(B, H, D, D, dtype=acc, device=q.device)  # (B, H, D, D)
    kv, k_sum, v_sum, count = state if state is not None else (zeros, zeros[..., 0], zeros[..., 0], 0)
    q, k, v = q.to(acc), k.to(acc), v.to(acc)
    n = count + torch.arange(1, N + 1, dtype=acc, device=q.device)[:, None]  # (N, 1): the count i
    qkv, kv = causal_products(q, k, v, kv, chunk)  # (B, H, N, D): q_i^T sum_{j<=i} k_j v_j^T
    k_sums, v_sums = k_sum.unsqueeze(2) + k.cumsum(2), v_sum.unsqueeze(2) + v.cumsum(2)  # (B, H, N, D): through i
    # g_i i q_i^T Cov_i + v_mean_i, with i Cov_i = sum_{j<=i} k_j v_j^T - i k_mean_i v_mean_i^T
    g = eq5_gain(s, n, scale_by_count)  # (N, 1): s/i or s
    o = g * (qkv - (q * k_sums).sum(-1, keepdim=True) * v_sums / n) + v_sums / n  # Eq. 5 over the prefix
    return o.to(dtype), (kv, k_sums[:, :, -1], v_sums[:, :, -1], count + N)


def inline_step(q_t, k_t, v_t, state=None, scale=None, scale_by_count=True):
    """One token of causal Eq. 5, for generation: q_t, k_t, v_t (B, H, D) -> o_t (B, H, D) and the state after it,
    (sum k v^T (B, H, D, D), sum k (B, H, D), sum v (B, H, D), count): one size however long the sequence, and
    inline_chunked's; None starts a sequence. Sums in fp32, as in inline_attention. Eq. 6 as well: a module's
    step (InLineBase.step) adds sequence_residual_step."""
    s = attention_scale(q_t.shape[-1]) if scale is None else scale
    dtype, acc = q_t.dtype, torch.promote_types(q_t.dtype, torch.float32)
    kv, k_sum, v_sum, count = state if state is not None else (0, 0, 0, 0)
    q_t, k_t, v_t = q_t.to(acc), k_t.to(acc), v_t.to(acc)
    kv = kv + k_t.unsqueeze(-1) * v_t.unsqueeze(-2)  # (B, H, D, D)
    k_sum, v_sum, count = k_sum + k_t, v_sum + v_t, count + 1  # (B, H, D)
    # t Cov over 1..t: sum k v^T - t k_mean v_mean^T, (B, H, D, D)
    cov = kv - (k_sum / count).unsqueeze(-1) * v_sum.unsqueeze(-2)
    g = eq5_gain(s, count, scale_by_count)  # s/t or s
    o_t = g * (q_t.unsqueeze(-2) @ cov).squeeze(-2) + v_sum / count  # Eq. 5 over tokens 1..t, (B, H, D)
    return o_t.to(dtype), (kv, k_sum, v_sum, count)


# ---------------------------------------------------------------------------------------------------
# The local attention residual, Eq. 6: o_i += sum_t r_t v_{N_t(i)} over the k x k neighbourhood of token i

RESIDUALS = ('local', 'plain', 'none')  # Eq. 6; o_i += r * v_i (the R-res ablation); none
LOCAL_SIZE = 3  # the side k of Eq. 6's k x k neighbourhood in the paper: every default of it is this name


def neighbourhood_size(residual, local_size=LOCAL_SIZE):
    """Eq. 6's neighbourhood side k, decided here for every piece that depends on it: the T = k^2 neighbour
    weights per channel (residual_mlp), the reference (local_residual), the fast path's neighbour table and the
    tests. 'local': local_size, odd and >= 1 (3 is the paper's); 'plain': 1, the token itself (o_i += r * v_i);
    'none': None, no Eq. 6."""
    if residual not in RESIDUALS:
        raise ValueError(f"unknown residual {residual!r}; choose one of {list(RESIDUALS)}")
    if not (isinstance(local_size, int) and local_size >= 1 and local_size % 2 == 1):
        raise ValueError(f"local_size (the side of Eq. 6's neighbourhood) must be an odd whole number >= 1, so that "
                         f"the neighbourhood is centred on its token; got {local_size!r}")
    return {'local': local_size, 'plain': 1, 'none': None}[residual]


def residual_mlp(dim, num_heads, taps=9):
    """Holds the parameters that predict the T neighbour weights of every channel from the token mean of the input:
    W1 (C -> C) and W2 (C -> T*C), each block-diagonal with one block per head, GELU between (residual_weights
    computes with them). Kept as the released model's two 1x1 grouped convolutions, one group per head, so the keys
    (residual.0.*, residual.2.*) and shapes ((C, D, 1), (T*C, D, 1)) are the released checkpoints'. Output channel
    T*c + t is the weight of neighbour t (row-major over the k x k neighbourhood, T = k^2) for channel c = head*D + j.
    """
    return nn.Sequential(
        nn.Conv1d(dim, dim, kernel_size=1, groups=num_heads),
        nn.GELU(),
        nn.Conv1d(dim, dim * taps, kernel_size=1, groups=num_heads),
    )


class NormalisedQ(nn.Module):
    """q (B, H, N, D) -> q / |q| times a learned gain per head (init sqrt(D), where |q| is about sqrt(D) for unit
    entries): the T1 ablation (ours). q and a*q (a > 0) then give the same weights, so softmax and InLine lose their
    injectivity in q's length, while the gain still lets each head learn how sharp its weights are."""

    def __init__(self, num_heads, head_dim):
        super().__init__()
        self.gain = nn.Parameter(torch.full((1, num_heads, 1, 1), head_dim ** 0.5))

    def forward(self, q):
        return F.normalize(q, dim=-1) * self.gain  # (B, H, N, D)


def residual_weights(mlp, x, causal=False):
    """Eq. 6's weights r = W2 GELU(W1 m + b1) + b2 from m, the token mean of x (B, N, C); returns (B, T*C).
    causal: at each token i from the mean m_i of x_1..x_i, so that no weight looks ahead; returns (B, N, T*C).

    W1 and W2 are block-diagonal, one D x D (and T*D x D) block per head, so each head's slice of m is multiplied by
    its own block: H small matmuls in one batch, what the released 1x1 grouped convolutions compute on a sequence of
    length 1 (mlp holds their weights; a convolution would treat the (B, C) vector as a 1-token image)."""
    conv1, act, conv2 = mlp
    H, device = conv1.groups, x.device.type
    if causal:
        n = torch.arange(1, x.shape[1] + 1, device=x.device)[:, None]  # (N, 1)
        m = (x.to(torch.promote_types(x.dtype, torch.float32)).cumsum(1) / n).to(x.dtype)  # (B, N, C), fp32 sums
    else:
        m = x.mean(dim=1, keepdim=True)  # (B, 1, C)
    B, M, C = m.shape
    # In the weights' dtype, outside autocast: for B vectors, autocast's casts of W1 and W2 on every call would cost
    # more than the matmuls (and a CPU's bf16 path for small matmuls is slower than its fp32). r comes out in the
    # autocast dtype, as from autocast's matmuls.
    autocast = torch.amp.is_autocast_available(device) and torch.is_autocast_enabled(device)  # not on 'meta'
    with torch.autocast(device, enabled=False) if autocast else contextlib.nullcontext():
        m = m.to(conv1.weight.dtype).reshape(B * M, H, C // H).transpose(0, 1)  # (H, B*M, D): each head's slice
        w1 = conv1.weight.reshape(H, -1, C // H).transpose(1, 2)  # (H, D, D): W1's blocks
        w2 = conv2.weight.reshape(H, -1, C // H).transpose(1, 2)  # (H, D, T*D): W2's blocks
        hidden = act(torch.baddbmm(conv1.bias.reshape(H, 1, -1), m, w1))  # (H, B*M, D)
        r = torch.baddbmm(conv2.bias.reshape(H, 1, -1), hidden, w2)  # (H, B*M, T*D): head g's channels T*c + t
    r = r.transpose(0, 1).reshape(B, M, -1)  # (B, M, T*C)
    if autocast:
        r = r.to(torch.get_autocast_dtype(device))
    return r if causal else r[:, 0]  # (B, N, T*C) or (B, T*C)


def local_residual(v, r, grid, size=LOCAL_SIZE, dilation=1, causal=False):
    """Eq. 6 on the last h*w of the N tokens of v (B, H, N, D): for each, the sum over its k x k neighbours t of
    r[b, T*c + t] * v at the neighbour, zero padding outside the grid; zero for the P = N - h*w leading tokens
    (DeiT's class token), which are not on the grid. grid None: a 1-D sequence (sequence_residual).

    r (B, T*C) per sample and channel, T = size^2, as residual_weights predicts it; or (B, N, T*C), per token too
    (a change of the method: README, "Changing the method"; the leading tokens' rows are not read). Neighbour
    t = size*dy + dx sits at offset (dilation*(dy - size//2), dilation*(dx - size//2)), row-major as Eq. 6 counts
    (dilation > 1 is the paper's R-dil ablation; size 1 is the plain residual o_i += r * v_i). A sum over a
    neighbourhood with one weight per channel is a depthwise convolution; other weights for every sample make it
    one convolution with B*C groups, each (sample, channel) plane its own group.
    """
    if grid is None:
        return sequence_residual(v, r, size, dilation, causal)
    B, H, N, D = v.shape
    P, (h, w) = check_grid(N, grid), grid
    if r.shape not in ((B, size * size * H * D), (B, N, size * size * H * D)):
        raise ValueError(f"r must hold {size}x{size} neighbour weights per channel, (B, {size * size}C) = "
                         f"{(B, size * size * H * D)}, or per token too, (B, N, {size * size}C); got {tuple(r.shape)}")
    if r.dim() == 3:  # per token: each token's k x k neighbours unfolded beside it, channel c's at rows T*c + t
        planes = v[:, :, P:].transpose(-2, -1).reshape(B, H * D, h, w)  # (B, C, h, w)
        cols = F.unfold(planes, size, dilation=dilation, padding=dilation * (size // 2))  # (B, T*C, h*w)
        out = (cols * r[:, P:].transpose(1, 2)).unflatten(1, (H * D, -1)).sum(2)  # Eq. 6, (B, C, h*w)
        return F.pad(out.reshape(B, H, D, h * w).transpose(-2, -1), (0, 0, P, 0))  # (B, H, N, D), zero for the P
    planes = v[:, :, P:].transpose(-2, -1).reshape(1, B * H * D, h, w)  # (1, B*C, h, w), plane b*C + head*D + j
    taps = r.reshape(B * H * D, 1, size, size)  # (B*C, 1, k, k): the neighbour weights of each sample and channel
    out = F.conv2d(planes, taps, padding=dilation * (size // 2), dilation=dilation, groups=B * H * D)  # Eq. 6
    return F.pad(out.reshape(B, H, D, h * w).transpose(-2, -1), (0, 0, P, 0))  # (B, H, N, D), zero for the P


def sequence_residual(v, r, size=LOCAL_SIZE, dilation=1, causal=False):
    """Eq. 6 on a 1-D sequence v (B, H, N, D), T = k = size taps per channel: o_i += sum_t r[.., T*c + t] *
    v_{i + dilation*(t - (k-1))} causal (tokens i, i-1, .., i-k+1; zero before the start), else
    v_{i + dilation*(t - k//2)} (k tokens centred on i; zero outside). r (B, T*C) per sample, or causal
    (B, N, T*C) per token, predicted from the prefix mean (residual_weights). A depthwise 1-D convolution."""
    B, H, N, D = v.shape
    if r.shape != ((B, N, size * H * D) if causal else (B, size * H * D)):
        raise ValueError(f"r must hold {size} neighbour weights per channel{' and token' if causal else ''}, "
                         f"{'(B, N, kC)' if causal else '(B, kC)'}, got {tuple(r.shape)} for v of {tuple(v.shape)}")
    left = dilation * (size - 1 if causal else size // 2)  # how far back the first tap reaches
    planes = F.pad(v.transpose(-2, -1).reshape(B, H * D, N), (left, dilation * (size - 1) - left))  # (B, C, N + pad)
    windows = planes.unfold(-1, dilation * (size - 1) + 1, 1)[..., ::dilation]  # (B, C, N, T): v_{i + d t - left}
    taps = r.reshape(B, -1, H * D, size).transpose(1, 2)  # (B, C, N or 1, T)
    return (windows * taps).sum(-1).reshape(B, H, D, N).transpose(-2, -1)  # Eq. 6, (B, H, N, D)


def sequence_residual_step(v_t, r_t, recent=None, size=LOCAL_SIZE, dilation=1):
    """One token of causal Eq. 6, for generation: v_t (B, H, D) and its weights r_t (B, T*C), T = size, ->
    sum_t r_t[.., T*c + t] v_{i + dilation*(t - (k-1))} (B, H, D), and recent after it: the last dilation*(k-1)
    values (B, H, dilation*(k-1), D), all Eq. 6 reaches back to (None: none yet, zero before the start)."""
    B, H, D = v_t.shape
    reach = dilation * (size - 1)
    recent = v_t.new_zeros(B, H, reach, D) if recent is None else recent  # zero before the start, as sequence_residual
    window = torch.cat([recent, v_t.unsqueeze(2)], 2)[:, :, ::dilation]  # (B, H, T, D): v_{i - d(k-1)} .. v_i
    taps = r_t.reshape(B, H, D, size).permute(0, 1, 3, 2)  # (B, H, T, D): channel c = head*D + j, tap t
    return (window * taps).sum(2), torch.cat([recent, v_t.unsqueeze(2)], 2)[:, :, 1:]  # Eq. 6, (B, H, D)


def inline_core(q, k, v, r, grid, scale=None, size=LOCAL_SIZE, dilation=1, causal=False, scale_by_count=True):
    """Eq. 5 over all N tokens, then Eq. 6 on the last h*w tokens: the whole InLine attention core.

    q, k, v (B, H, N, D) with q, k already through phi; r (B, T*C) the neighbour weights, T = size^2, or None
    for no residual; grid = (h, w) of the last h*w tokens (the P = N - h*w leading ones, DeiT's class token,
    take part in Eq. 5 but get no Eq. 6); size and dilation of Eq. 6's neighbourhood. grid None: a 1-D
    sequence, T = size; causal (grid None): Eq. 5 over each prefix, Eq. 6 over the last k tokens, r (B, N, T*C).
    scale_by_count: Eq. 5's factor s/N (s/i on a prefix), else s (eq5_gain).
    kernels.inline_core_fast takes the same arguments and returns the same result, faster.
    """
    if causal and grid is not None:
        raise ValueError("causal attention runs over a 1-D sequence: grid must be None")
    o = inline_attention(q, k, v, scale, causal, scale_by_count)  # Eq. 5, (B, H, N, D)
    return o if r is None else o + local_residual(v, r, grid, size, dilation, causal)  # Eq. 6


# ---------------------------------------------------------------------------------------------------
# The modules the four backbones share

class InLineBase(nn.Module):
    """What every InLine (or vanilla linear) attention does between its projections: phi, Eq. 5 (or the
    division of linear attention), Eq. 6. InLineAttention adds the projections; CSwin's stripe branch
    (models.py) shares one qkv per block and so uses this alone.

    kernel: the kernel function phi, one of KERNELS.
    residual: 'local' (Eq. 6), 'plain' (o_i += r * v_i) or 'none'; local_size: Eq. 6's neighbourhood side k
        (odd; the paper's 3); dilation: its spread (neighbourhood_size says how the three combine).
    attention: 'inline' (Eq. 5) or 'linear', the vanilla division-normalised baseline, which needs a
        non-negative kernel unless allow_divergent (the paper's Table 3 reports that it does not converge
        with identity or leakyrelu).
    nonneg: the R-nonneg ablation (ours): q and k L2-normalised per head and s = 1/2, so
        s |q.(k_j - k_mean)| <= 1 and every w_ij >= 0.
    normalise_q: the T1 ablation (ours): phi(q) L2-normalised with a learned per-head gain (NormalisedQ), so q
        and a*q give the same weights.
    causal: Eq. 5 (or the division) over each prefix, Eq. 6 over the last k tokens with weights from the prefix
        mean: no output sees a later token. A 1-D sequence, as sequence=True, which alone is the bidirectional
        form: Eq. 6 over the k tokens centred on each (T = k taps per channel, not k^2).
    leading_tokens: P, the tokens before the (h, w) grid, which take part in Eq. 5 but get no Eq. 6 (DeiT's class
        token: 1); every call must bring exactly P + h*w tokens. 0 on a 1-D sequence.
    scale_by_count: Eq. 5's factor s/N, s/i on a prefix (True, the released models'), or s, the paper's printed
        Eq. 5 (eq5_gain).
    """

    def setup_inline(self, dim, num_heads, *, kernel='identity', residual='local', local_size=LOCAL_SIZE, dilation=1,
                     nonneg=False, normalise_q=False, attention='inline', allow_divergent=False, causal=False,
                     sequence=False, leading_tokens=0, scale_by_count=True):
        if dim % num_heads != 0:
            raise ValueError(f"channels ({dim}) must be divisible by heads ({num_heads})")
        if attention not in ('inline', 'linear'):
            raise ValueError(f"unknown attention {attention!r}; choose 'inline' or 'linear'")
        size = neighbourhood_size(residual, local_size)
        if not (isinstance(dilation, int) and dilation >= 1) or (dilation > 1 and (size or 1) == 1):
            raise ValueError(f"dilation must be a whole number >= 1, and > 1 only where Eq. 6 has neighbours "
                             f"(residual='local', local_size > 1), got {dilation!r} with residual={residual!r}")
        if attention == 'linear' and kernel not in NON_NEGATIVE_KERNELS and not allow_divergent:
            raise ValueError(f"vanilla linear attention divides by q.k, so it needs a non-negative kernel "
                             f"{NON_NEGATIVE_KERNELS}, got {kernel!r}; pass allow_divergent=True to run it anyway "
                             f"(the paper's Table 3 reports that it does not converge)")
        if nonneg and attention != 'inline':
            raise ValueError("nonneg (every weight >= 0) is an option of InLine attention, not of linear attention, "
                             "whose weights are already non-negative")
        if normalise_q and (attention != 'inline' or nonneg):
            raise ValueError("normalise_q is an option of InLine attention without nonneg: linear attention divides "
                             "by phi(q).sum(phi(k)), so q's length cancels already, and nonneg normalises q itself")
        if nonneg and not scale_by_count:
            raise ValueError("nonneg keeps every weight >= 0 with s = 1/2 and the factor s/N; scale_by_count=False "
                             "drops the 1/N, so it needs scale_by_count=True")
        if not (isinstance(leading_tokens, int) and leading_tokens >= 0) or (leading_tokens and (causal or sequence)):
            raise ValueError(f"leading_tokens (the tokens before the grid, e.g. a class token) must be a whole number "
                             f">= 0, and 0 on a 1-D sequence; got {leading_tokens!r}")
        self.num_heads, self.head_dim, self.leading_tokens = num_heads, dim // num_heads, leading_tokens
        self.kernel, self.attention, self.nonneg = kernel, attention, nonneg
        self.scale_by_count = bool(scale_by_count)
        self.local_size, self.dilation = size, dilation
        self.causal, self.sequence = bool(causal), bool(sequence or causal)  # a 1-D sequence: called with no grid
        self.phi = get_kernel(kernel, dim // num_heads)
        self.normalise_q = NormalisedQ(num_heads, dim // num_heads) if normalise_q else None
        self.scale = attention_scale(dim // num_heads)  # Eq. 5's s, which prepare returns
        self.residual = residual_mlp(dim, num_heads, size if self.sequence else size * size) if size else None
        # The core, Eq. 5 + Eq. 6: this reference, or its compiled twin kernels.inline_core_fast (same arguments,
        # same result), which kernels.enable_fast(model) puts here once it has run this module both ways and found
        # the same output and gradients
        self.core = inline_core
        # For a call with no gradient, enable_fast may also put here one compiled graph for Eq. 6's weights and the core
        # together (kernels.infer_fast: residual_weights, then the core, in one call), checked the same way
        self.infer = None

    def prepare(self, q, k):
        """q, k (B, H, N, D) -> phi(q), phi(k) and the scale s: self.scale, a number or a tensor that broadcasts
        against (B, H, N, 1), such as a learnable per-head temperature (1, H, 1, 1) (attention_scale)."""
        q, k = self.phi(q), self.phi(k)
        if self.normalise_q is not None:  # T1: q and a*q give the same weights
            q = self.normalise_q(q)
        if self.nonneg:  # R-nonneg: |q| = |k_j| = 1, so |q.(k_j - k_mean)| <= 2 and s = 1/2 keeps w_ij >= 0
            return F.normalize(q, dim=-1), F.normalize(k, dim=-1), 0.5
        return q, k, self.scale

    def attend(self, q, k, v, x, grid):
        """q, k, v (B, H, N, D) before phi; x (B, N', C) the tokens Eq. 6's weights are predicted from.
        Returns o (B, H, N, D)."""
        q, k, scale = self.prepare(q, k)
        if self.infer is not None and not torch.is_grad_enabled():  # the fast path's graph for inference (kernels.py)
            return self.infer(self, q, k, v, x, grid, scale)  # what the two lines below compute
        r = residual_weights(self.residual, x, self.causal) if self.residual is not None else None  # (B, [N,] T*C)
        if self.attention == 'linear':  # the baseline: division instead of Eq. 5, then the same Eq. 6
            o = linear_attention(q, k, v, causal=self.causal)  # (B, H, N, D)
            return o if r is None else o + local_residual(v, r, grid, self.local_size, self.dilation, self.causal)
        return self.core(q, k, v, r, grid, scale, self.local_size, self.dilation, self.causal,
                         self.scale_by_count)  # Eq. 5 + Eq. 6

    def explicit_weights(self, q, k):
        """The N x N weights of Eq. 5 (or of linear attention) for q, k (B, H, N, D) before phi. Eq. 6's
        residual is not among them: its weights are per channel, not per head."""
        q, k, scale = self.prepare(q, k)
        if self.attention == 'linear':
            return linear_attention_weights(q, k, causal=self.causal)
        return inline_weights(q, k, scale, self.causal, self.scale_by_count)

    def step_attend(self, q_t, k_t, v_t, x_t, state=None):
        """One token of attend on a causal module, for generation: q_t, k_t, v_t (B, H, D) before phi, x_t (B, C) the
        token Eq. 6's weights are predicted from. Returns o_t (B, H, D) and the state after it: inline_step's, the
        running sum of x (B, C) for Eq. 6's prefix mean and the last dilation*(k-1) values (sequence_residual_step);
        one size however long the sequence. None starts a sequence."""
        if not self.causal or self.attention != 'inline':
            raise ValueError("a step is causal InLine's: build the module with causal=True and attention='inline'")
        eq5, x_sum, recent = state if state is not None else (None, 0, None)
        q, k, scale = self.prepare(q_t.unsqueeze(2), k_t.unsqueeze(2))  # phi, on (B, H, 1, D)
        o_t, eq5 = inline_step(q[:, :, 0], k[:, :, 0], v_t, eq5, scale, self.scale_by_count)  # Eq. 5, (B, H, D)
        if self.residual is None:
            return o_t, (eq5, x_sum, recent)
        x_sum = x_sum + x_t.to(torch.promote_types(x_t.dtype, torch.float32))  # (B, C), fp32 sums as residual_weights
        r_t = self.residual((x_sum / eq5[3]).to(x_t.dtype).unsqueeze(-1)).squeeze(-1)  # (B, T*C) from the prefix mean
        local, recent = sequence_residual_step(v_t, r_t, recent, self.local_size, self.dilation)  # Eq. 6
        return o_t + local, (eq5, x_sum, recent)


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
    kernel: the kernel function phi, one of KERNELS ('identity' for InLine).
    residual: 'local' (Eq. 6), 'plain' (o_i += r * v_i) or 'none'.
    local_size: the side k of Eq. 6's k x k neighbourhood (odd; the paper's 3).
    dilation: the spread of Eq. 6's neighbourhood (R-dil).
    nonneg: every weight forced >= 0 (R-nonneg, ours).
    normalise_q: q L2-normalised with a learned per-head gain (T1, ours).
    attention: 'inline' (Eq. 5) or 'linear' (vanilla division).
    allow_divergent: let vanilla linear attention run with a signed kernel.
    causal, sequence: a 1-D sequence, called with no grid; causal: no output sees a later token.
    leading_tokens: the tokens before the grid (a class token first: 1), so a call brings leading_tokens + h*w.
    The last eleven are InLineBase's; it says more of each.
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
        if (grid is None) != self.sequence:
            raise ValueError("this attention was built for a 1-D sequence (causal or sequence=True): call it with "
                             "no grid" if self.sequence else "this attention was built for a token grid: pass grid="
                             "(h, w), or build it with sequence=True or causal=True for a 1-D sequence")
        if grid is not None:
            check_grid(N, grid, self.leading_tokens)
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

    def forward(self, x, grid=None):
        B, N, C = x.shape
        x, q, k, v = self.project(x, grid)
        o = self.attend(q, k, v, x, grid)  # Eq. 5 + Eq. 6, (B, H, N, D)
        return self.proj(o.transpose(1, 2).reshape(B, N, C))  # (B, N, C)

    def step(self, x_t, state=None):
        """One token through a causal module, for generation: x_t (B, C) -> (B, C) and the state after it (step_attend),
        equal to forward's output at that token given the same tokens before it."""
        if self.ape is not None:
            raise ValueError("a step has no position embedding (ape): it is made for a fixed number of tokens")
        x, q, k, v = self.project(x_t.unsqueeze(1), None)  # (B, H, 1, D)
        o_t, state = self.step_attend(q[:, :, 0], k[:, :, 0], v[:, :, 0], x[:, 0], state)  # (B, H, D)
        return self.proj(o_t.reshape(x_t.shape)), state  # (B, C)

    def weights(self, x, grid=None):
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
        'softmax': lambda q: torch.softmax(q @ k.transpose(-2, -1) * attention_scale(D), dim=-1),
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

"""InLine attention, the readable reference: one equation of the paper at a time.

Han et al., "Bridging the Divide: Reconsidering Softmax and Linear Attention", NeurIPS 2024, arXiv 2412.06590.
Linear attention normalises by division (w_ij = q_i.k_j / sum_t q_i.k_t), which maps q and 2q to the same
weights: it is not injective. InLine normalises by subtraction instead (Eq. 5), which is injective (given
D + 1 tokens or more: inline_weights) and still linear in N, and adds a local attention residual over each
token's 3x3 neighbourhood (Eq. 6), because linear attention alone attends too little to nearby tokens.

Causal InLine is sequence.py; the fast path, kernels.py, is tested against this clear, slow reference.

    python bench.py --demo  # a short demonstration: injectivity, and the two forms of Eq. 5 agree

Notation, used in every shape comment: B batch, H heads, N tokens, D head dim, C = H*D channels,
(h, w) the token grid, P leading tokens that are not on the grid (DeiT's class token), N = P + h*w.
"""
import contextlib

import torch
import torch.nn as nn
import torch.nn.functional as F

# ---------------------------------------------------------------------------------------------------
# Kernel functions phi, applied to queries and keys (the paper's Table 5 ablates them)

# name -> phi; a new one is one line here (and in NON_NEGATIVE_KERNELS if it is >= 0), tests included
KERNELS = {
    'identity': nn.Identity(),  # stateless, so one instance serves every layer
    'relu': F.relu,
    'leakyrelu': F.leaky_relu,  # negative slope 0.01, PyTorch's default
    'exp': lambda x: torch.exp(0.2 * x),  # the 0.2 keeps exp from overflowing on raw projections
    'one_plus_elu': lambda x: 1 + F.elu(x),  # > 0: elu + 1, Katharopoulos et al. (2020)'s linear attention
}  # and the two ablations' at the end of this file: 'relu_affine' (learnable) and 'zero'
NON_NEGATIVE_KERNELS = ('relu', 'exp', 'one_plus_elu', 'relu_affine')  # linear attention divides by q.k


def attention_scale(D):
    """D^-1/2, the paper's scale s of q.k in Eq. 5 and in softmax, written only here. A scale given instead
    may be a number or a tensor that broadcasts against (B, H, N, 1), a learnable temperature say."""
    return D ** -0.5


def get_kernel(name, head_dim=None):
    """The kernel function phi by name; 'relu_affine' is a module with parameters, built for head_dim."""
    if name not in KERNELS:
        raise ValueError(f"unknown kernel function {name!r}; choose one of {sorted(KERNELS)}")
    return ReLUAffine(head_dim) if name == 'relu_affine' else KERNELS[name]


def check_grid(N, grid, leading_tokens=None):
    """P, the leading tokens before the (h, w) grid of N tokens: N = P + h*w, where P must be the module's
    leading_tokens (DeiT's class token: 1; else 0), or any P >= 0 where None (the cores)."""
    if isinstance(grid, (tuple, list)):  # traced (torch.onnx.export): 0-d integer tensors of known values
        grid = [int(s) if torch.is_tensor(s) and s.dim() == 0 and not s.is_floating_point() else s
                for s in grid]
    if not (isinstance(grid, (tuple, list)) and len(grid) == 2
            and all(isinstance(s, int) and not isinstance(s, bool) and s >= 1 for s in grid)):
        raise ValueError(f"grid must be a pair (h, w) of positive whole numbers (the token grid), got {grid}")
    h, w = grid
    if leading_tokens is None:
        if N < h * w:
            raise ValueError(f"{N} tokens cannot hold a {h}x{w} token grid of {h * w}")
        return N - h * w
    if N != leading_tokens + h * w:
        raise ValueError(f"{N} tokens, but this attention declares {leading_tokens} leading token(s) "
                         f"(leading_tokens, e.g. DeiT's class token) before its {h}x{w} grid: N must be "
                         f"{leading_tokens} + {h * w} = {leading_tokens + h * w}")
    return leading_tokens


# ---------------------------------------------------------------------------------------------------
# The two baselines the paper compares against; every attention function: q, k, v (B, H, N, D) -> (B, H, N, D)

def softmax_attention(q, k, v, scale=None):
    """w_ij = exp(s q_i.k_j) / sum_t exp(s q_i.k_t). Injective, O(N^2)."""
    s = attention_scale(q.shape[-1]) if scale is None else scale
    w = torch.softmax(s * q @ k.transpose(-2, -1), dim=-1)  # (B, H, N, N)
    return w @ v


def linear_attention(q, k, v, eps=1e-6):
    """w_ij = q_i.k_j / sum_t q_i.k_t as q (K^T V) / (q . sum_t k_t). Needs phi >= 0; not injective."""
    kv = k.transpose(-2, -1) @ v  # (B, H, D, D)
    denominator = q @ k.sum(dim=2, keepdim=True).transpose(-2, -1)  # (B, H, N, 1)
    return (q @ kv) / (denominator + eps)


def linear_attention_weights(q, k, eps=1e-6):
    """The N x N weights of vanilla linear attention, for looking at and for the injectivity test."""
    w = q @ k.transpose(-2, -1)  # (B, H, N, N)
    return w / (w.sum(dim=-1, keepdim=True) + eps)


# ---------------------------------------------------------------------------------------------------
# InLine attention, Eq. 5: w_ij = s (q_i.k_j - q_i.k_mean) + 1/N (s/N in the released models: eq5_gain)

def eq5_gain(s, n, scale_by_count=True):
    """The factor of q_i.(k_j - k_mean) in Eq. 5 over n tokens (or a causal form's counts (N, 1)): s/n with
    scale_by_count, the released models' (they fold s/N into phi(Q)); else s, Eq. 5 as the paper prints it."""
    return s / n if scale_by_count else s


def inline_weights(q, k, scale=None, scale_by_count=True):
    """The explicit N x N weights of Eq. 5, factor eq5_gain. Every row sums to 1; weights may be negative.
    Injective in q_i where the centred keys k_j - k_mean span all D dimensions, so at least D + 1 tokens:
    then q_i -> row i is an affine map of full rank. With fewer, a change of q_i orthogonal to every
    k_j - k_mean leaves row i as it was."""
    N = q.shape[2]
    s = attention_scale(q.shape[-1]) if scale is None else scale
    k_mean = k.mean(dim=2, keepdim=True)  # (B, H, 1, D)
    return eq5_gain(s, N, scale_by_count) * (q @ (k - k_mean).transpose(-2, -1)) + 1 / N  # Eq. 5 (B, H, N, N)


def inline_attention_quadratic(q, k, v, scale=None, scale_by_count=True):
    """o_i = sum_j w_ij v_j with the explicit weights: O(N^2 D), for teaching and tests."""
    return inline_weights(q, k, scale, scale_by_count) @ v  # (B, H, N, D)


def inline_attention(q, k, v, scale=None, scale_by_count=True):
    """Eq. 5 in linear form, O(N D^2), never building the N x N weights. Summed over j, g = eq5_gain(s, N):
        o_i = g q_i^T sum_j (k_j - k_mean) v_j^T + v_mean = g N q_i^T Cov + v_mean,
        Cov = (1/N) sum_j (k_j - k_mean)(v_j - v_mean)^T   (sum_j (k_j - k_mean) = 0 lets v_mean in)
    """
    N = q.shape[2]
    s = attention_scale(q.shape[-1]) if scale is None else scale
    k_mean = k.mean(dim=2, keepdim=True)  # (B, H, 1, D)
    v_mean = v.mean(dim=2, keepdim=True)  # (B, H, 1, D)
    # (B, H, D, D); equals K^T V / N - k_mean^T v_mean, so o is the released models' uncentred
    # q^T (K^T V) - N (q.k_mean) v_mean, but centred keeps its precision in bf16 when the means are large
    cov = (k - k_mean).transpose(-2, -1) @ (v - v_mean) / N
    g = s if scale_by_count else s * N  # eq5_gain(s, N) * N, written out: s/N or s, times N
    return g * (q @ cov) + v_mean  # Eq. 5 summed over j, (B, H, N, D)


# ---------------------------------------------------------------------------------------------------
# The local attention residual, Eq. 6: o_i += sum_t r_t v_{N_t(i)} over the k x k neighbourhood of token i

RESIDUALS = ('local', 'plain', 'none')  # Eq. 6; o_i += r * v_i (the R-res ablation); none
LOCAL_SIZE = 3  # the side k of Eq. 6's k x k neighbourhood in the paper: every default of it is this name


def neighbourhood_size(residual, local_size=LOCAL_SIZE):
    """Eq. 6's neighbourhood side k, decided here for every piece that depends on it (T = k^2 weights per
    channel): 'local': local_size, odd (3 is the paper's); 'plain': 1, o_i += r * v_i; 'none': None."""
    if residual not in RESIDUALS:
        raise ValueError(f"unknown residual {residual!r}; choose one of {list(RESIDUALS)}")
    if not (isinstance(local_size, int) and local_size >= 1 and local_size % 2 == 1):
        raise ValueError(f"local_size (the side of Eq. 6's neighbourhood) must be an odd whole number "
                         f">= 1, so that the neighbourhood is centred on its token; got {local_size!r}")
    return {'local': local_size, 'plain': 1, 'none': None}[residual]


def residual_mlp(dim, num_heads, taps=9):
    """W1 (C -> C), GELU, W2 (C -> T*C), each block-diagonal with one block per head, as the released two 1x1
    grouped convolutions, so the keys (residual.0.*, residual.2.*) are the checkpoints'. Output channel
    T*c + t is the weight of neighbour t (row-major over the k x k neighbourhood) for channel c."""
    return nn.Sequential(
        nn.Conv1d(dim, dim, kernel_size=1, groups=num_heads),
        nn.GELU(),
        nn.Conv1d(dim, dim * taps, kernel_size=1, groups=num_heads),
    )


def residual_weights(mlp, x):
    """Eq. 6's weights r = W2 GELU(W1 m + b1) + b2 from m, the token mean of x (B, N, C); returns (B, T*C).
    Each head's slice of m meets its own block: H small matmuls in one batch, what the grouped convolutions
    compute on a sequence of length 1."""
    return mean_residual_weights(mlp, x.mean(dim=1, keepdim=True))[:, 0]  # (B, T*C)


def mean_residual_weights(mlp, m):
    """residual_weights from the means m (B, M, C) it is given: (B, M, T*C), one set of weights per mean."""
    conv1, act, conv2 = mlp
    H, device = conv1.groups, m.device.type
    B, M, C = m.shape
    # In the weights' dtype, outside autocast: for B vectors, autocast's casts of W1 and W2 would cost more
    # than the matmuls. r comes out in the autocast dtype, as from autocast's matmuls.
    autocast = torch.amp.is_autocast_available(device) and torch.is_autocast_enabled(device)  # not on 'meta'
    with torch.autocast(device, enabled=False) if autocast else contextlib.nullcontext():
        m = m.to(conv1.weight.dtype).reshape(B * M, H, C // H).transpose(0, 1)  # (H, B*M, D)
        w1 = conv1.weight.reshape(H, -1, C // H).transpose(1, 2)  # (H, D, D): W1's blocks
        w2 = conv2.weight.reshape(H, -1, C // H).transpose(1, 2)  # (H, D, T*D): W2's blocks
        hidden = act(torch.baddbmm(conv1.bias.reshape(H, 1, -1), m, w1))  # (H, B*M, D)
        r = torch.baddbmm(conv2.bias.reshape(H, 1, -1), hidden, w2)  # (H, B*M, T*D)
    r = r.transpose(0, 1).reshape(B, M, -1)  # (B, M, T*C)
    return r.to(torch.get_autocast_dtype(device)) if autocast else r


def local_residual(v, r, grid, size=LOCAL_SIZE, dilation=1):
    """Eq. 6 on the last h*w tokens of v (B, H, N, D): the sum over the k x k neighbours t of each of
    r[b, T*c + t] * v at the neighbour, zero padding outside the grid; zero for the P leading tokens.
    r (B, T*C), T = size^2, from residual_weights; or (B, N, T*C), per token too (README, "Changing the
    method"). Neighbour t = size*dy + dx sits at dilation*(dy - size//2, dx - size//2) (dilation > 1: the
    R-dil ablation). Weights per sample and channel: one convolution with B*C groups."""
    B, H, N, D = v.shape
    P, (h, w) = check_grid(N, grid), grid
    T = size * size
    if r.shape not in ((B, T * H * D), (B, N, T * H * D)):
        raise ValueError(f"r must hold {size}x{size} neighbour weights per channel, (B, {T}C) = "
                         f"{(B, T * H * D)}, or per token too, (B, N, {T}C); got {tuple(r.shape)}")
    # per token: each token's k x k neighbours unfolded beside it, channel c's at rows T*c + t
    if r.dim() == 3:
        planes = v[:, :, P:].transpose(-2, -1).reshape(B, H * D, h, w)  # (B, C, h, w)
        cols = F.unfold(planes, size, dilation=dilation, padding=dilation * (size // 2))  # (B, T*C, h*w)
        out = (cols * r[:, P:].transpose(1, 2)).unflatten(1, (H * D, -1)).sum(2)  # Eq. 6, (B, C, h*w)
        return F.pad(out.reshape(B, H, D, h * w).transpose(-2, -1), (0, 0, P, 0))  # (B, H, N, D), 0 for the P
    planes = v[:, :, P:].transpose(-2, -1).reshape(1, B * H * D, h, w)  # (1, B*C, h, w)
    taps = r.reshape(B * H * D, 1, size, size)  # (B*C, 1, k, k): each sample's and channel's weights
    out = F.conv2d(planes, taps, padding=dilation * (size // 2), dilation=dilation, groups=B * H * D)  # Eq. 6
    return F.pad(out.reshape(B, H, D, h * w).transpose(-2, -1), (0, 0, P, 0))  # (B, H, N, D), zero for the P


# ---------------------------------------------------------------------------------------------------
# The core, Eq. 5 + Eq. 6, and the one path of a module's attend: Eq. 6's weights, then the core

def inline_core(q, k, v, r, grid, scale=None, size=LOCAL_SIZE, dilation=1, scale_by_count=True):
    """Eq. 5 over all N tokens, then Eq. 6 on the last h*w tokens: the whole InLine attention core.
    q, k, v (B, H, N, D) through phi; r (B, T*C) Eq. 6's weights, T = size^2, or None; grid (h, w); size and
    dilation of Eq. 6's neighbourhood; scale_by_count: eq5_gain. kernels.inline_core_fast: the same, faster.
    """
    o = inline_attention(q, k, v, scale, scale_by_count)  # Eq. 5, (B, H, N, D)
    return o if r is None else o + local_residual(v, r, grid, size, dilation)  # Eq. 6


def reference_path(module, q, k, v, x, grid, scale):
    """What module.attend runs after phi, with or without a gradient: Eq. 6's weights from x (B, N, C), then
    module.core (or linear attention's division, then Eq. 6); o (B, H, N, D). Fast twin: kernels.fast_path."""
    r = residual_weights(module.residual, x) if module.residual is not None else None  # (B, T*C)
    if module.attention == 'linear':  # the baseline: division instead of Eq. 5, then the same Eq. 6
        o = linear_attention(q, k, v)  # (B, H, N, D)
        return o if r is None else o + local_residual(v, r, grid, module.local_size, module.dilation)
    return module.core(q, k, v, r, grid, scale, module.local_size, module.dilation,
                       module.scale_by_count)  # Eq. 5 + Eq. 6


# ---------------------------------------------------------------------------------------------------
# The modules the four backbones share

class InLineBase(nn.Module):
    """phi, Eq. 6's weights, Eq. 5 (or linear attention's division), Eq. 6: what every InLine attention does
    between its projections (InLineAttention adds them; CSwin's stripes in models.py use this alone).
    kernel: phi, one of KERNELS. residual, local_size: neighbourhood_size; dilation: Eq. 6's spread.
    attention: 'inline' (Eq. 5) or 'linear', which needs phi >= 0 unless allow_divergent (Table 3).
    leading_tokens: P, before the (h, w) grid (DeiT's class token: 1), in Eq. 5 but not in Eq. 6.
    scale_by_count: eq5_gain. nonneg, normalise_q: the ablations R-nonneg and T1, at the end of this file.
    """
    token_dims = 2  # Eq. 6's neighbourhood is k x k: T = k^2 weights per channel

    def setup_inline(self, dim, num_heads, *, kernel='identity', residual='local', local_size=LOCAL_SIZE,
                     dilation=1, nonneg=False, normalise_q=False, attention='inline', allow_divergent=False,
                     leading_tokens=0, scale_by_count=True):
        if dim % num_heads != 0:
            raise ValueError(f"channels ({dim}) must be divisible by heads ({num_heads})")
        if attention not in ('inline', 'linear'):
            raise ValueError(f"unknown attention {attention!r}; choose 'inline' or 'linear'")
        size = neighbourhood_size(residual, local_size)
        if not (isinstance(dilation, int) and dilation >= 1) or (dilation > 1 and (size or 1) == 1):
            raise ValueError(f"dilation must be a whole number >= 1, and > 1 only where Eq. 6 has "
                             f"neighbours (residual='local', local_size > 1), got {dilation!r} with "
                             f"residual={residual!r}")
        if attention == 'linear' and kernel not in NON_NEGATIVE_KERNELS and not allow_divergent:
            raise ValueError(f"vanilla linear attention divides by q.k, so it needs a non-negative kernel "
                             f"{NON_NEGATIVE_KERNELS}, got {kernel!r}; pass allow_divergent=True to run it "
                             f"anyway (the paper's Table 3 reports that it does not converge)")
        check_ablations(attention, nonneg, normalise_q, scale_by_count)
        if not (isinstance(leading_tokens, int) and leading_tokens >= 0):
            raise ValueError(f"leading_tokens (the tokens before the grid, e.g. a class token) must be a "
                             f"whole number >= 0; got {leading_tokens!r}")
        self.num_heads, self.head_dim, self.leading_tokens = num_heads, dim // num_heads, leading_tokens
        self.kernel, self.attention, self.nonneg = kernel, attention, nonneg
        self.scale_by_count = bool(scale_by_count)
        self.local_size, self.dilation = size, dilation
        self.phi = get_kernel(kernel, dim // num_heads)
        self.normalise_q = NormalisedQ(num_heads, dim // num_heads) if normalise_q else None
        self.scale = attention_scale(dim // num_heads)  # Eq. 5's s, which prepare returns
        self.residual = residual_mlp(dim, num_heads, size ** self.token_dims) if size else None
        # Eq. 5 + Eq. 6, and attend's one path after phi: kernels.enable_fast may swap in their fast twins
        self.core = inline_core
        self.path = reference_path

    def prepare(self, q, k):
        """q, k (B, H, N, D) -> phi(q), phi(k) and Eq. 5's scale s, self.scale (attention_scale)."""
        q, k = self.phi(q), self.phi(k)
        if self.normalise_q is not None:  # T1: q and a*q give the same weights
            q = self.normalise_q(q)
        if self.nonneg:  # R-nonneg: every weight >= 0
            return nonneg_qk(q, k)
        return q, k, self.scale

    def attend(self, q, k, v, x, grid):
        """q, k, v (B, H, N, D) before phi; x (B, N', C) the tokens Eq. 6's weights are predicted from.
        Returns o (B, H, N, D). One path, with or without a gradient."""
        q, k, scale = self.prepare(q, k)  # phi
        return self.path(self, q, k, v, x, grid, scale)  # Eq. 6's weights, then Eq. 5 + Eq. 6

    def explicit_weights(self, q, k):
        """The N x N weights of Eq. 5 (or of linear attention) for q, k (B, H, N, D) before phi."""
        q, k, scale = self.prepare(q, k)
        if self.attention == 'linear':
            return linear_attention_weights(q, k)
        return inline_weights(q, k, scale, self.scale_by_count)

    def check_shape(self):
        """(N, grid) of the small call kernels.enable_fast checks this module on."""
        return self.leading_tokens + 42, (6, 7)


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
    """x (B, N, C) -> q, k, v -> Eq. 5 + Eq. 6 -> proj -> (B, N, C). dim, num_heads: C and H; qkv_bias,
    separate_q: add_projections. ape_tokens: N of the authors' absolute position embedding (1, N, C), added to
    x before the projections, for their ablations without Eq. 6 (their repository's issue #6); None: none.
    Other options: InLineBase. On a 1-D sequence: sequence.SequenceAttention."""

    def __init__(self, dim, num_heads, *, qkv_bias=True, separate_q=False, ape_tokens=None, **options):
        super().__init__()
        self.setup_inline(dim, num_heads, **options)
        add_projections(self, dim, qkv_bias, separate_q)
        self.ape = None
        if ape_tokens:
            self.ape = nn.Parameter(torch.zeros(1, ape_tokens, dim))
            nn.init.trunc_normal_(self.ape, std=.02)

    def check_tokens(self, N, grid):
        """Refuse a call whose N tokens do not fit the module: leading_tokens + h*w on its grid."""
        if grid is None:
            raise ValueError("this attention was built for a token grid: pass grid=(h, w), or use "
                             "sequence.SequenceAttention for a 1-D sequence")
        check_grid(N, grid, self.leading_tokens)

    def project(self, x, grid):
        """x (B, N, C) -> x with the APE added, and q, k, v (B, H, N, D)."""
        if x.dim() != 3 or x.shape[-1] != self.proj.in_features:
            image = ': an image (B, C, h, w) is x.flatten(2).transpose(1, 2), grid (h, w)' * (x.dim() == 4)
            raise ValueError(f"this attention takes tokens (B, N, C), C = {self.proj.in_features} channels "
                             f"(its dim); got {tuple(x.shape)}{image}")
        B, N, C = x.shape
        self.check_tokens(N, grid)
        if self.ape is not None:
            if self.ape.shape[1] != N:
                raise ValueError(f"this attention's position embedding (ape) covers {self.ape.shape[1]} "
                                 f"tokens, got {N}: build the model for this input size")
            x = x + self.ape
        if hasattr(self, 'qkv'):
            q, k, v = self.qkv(x).chunk(3, dim=-1)  # 3 x (B, N, C)
        else:
            q = self.q(x)  # (B, N, C)
            k, v = self.kv(x).chunk(2, dim=-1)  # 2 x (B, N, C)
        return x, *(t.reshape(B, N, self.num_heads, -1).transpose(1, 2) for t in (q, k, v))  # (B, H, N, D)

    def forward(self, x, grid=None):
        x, q, k, v = self.project(x, grid)
        o = self.attend(q, k, v, x, grid)  # Eq. 5 + Eq. 6, (B, H, N, D)
        return self.proj(o.transpose(1, 2).flatten(2))  # (B, N, C): the heads side by side

    def weights(self, x, grid=None):
        """The explicit attention weights (B, H, N, N) this module applies to x (B, N, C)."""
        _, q, k, _ = self.project(x, grid)
        return self.explicit_weights(q, k)


# ---------------------------------------------------------------------------------------------------
# The paper's ablation switches: a learnable phi (ReLUAffine), phi = 0 (the floor), q normalised (NormalisedQ,
# T1), every weight >= 0 (nonneg, R-nonneg). InLineBase's options kernel, normalise_q and nonneg choose them.

class ReLUAffine(nn.Module):
    """phi(x) = ReLU(A x + b), one A (D x D) and b per layer, shared by q, k and the heads: Table 3's
    'relu_affine', our construction (none was released). Starts as relu: A = I, b = 0."""

    def __init__(self, head_dim):
        super().__init__()
        self.weight = nn.Parameter(torch.eye(head_dim))
        self.bias = nn.Parameter(torch.zeros(head_dim))

    def forward(self, x):
        return F.relu(F.linear(x, self.weight, self.bias))  # (..., D) -> (..., D)


KERNELS['relu_affine'] = None  # learnable: ReLUAffine above, one per attention layer (get_kernel builds it)
KERNELS['zero'] = torch.zeros_like  # phi = 0: Eq. 5 gives every weight 1/N, which cannot select (the floor)


class NormalisedQ(nn.Module):
    """q (B, H, N, D) -> q / |q| times a learned gain per head (init sqrt(D)): the T1 ablation (ours). q and
    a*q then give the same weights, while the gain still lets each head learn how sharp its weights are."""

    def __init__(self, num_heads, head_dim):
        super().__init__()
        self.gain = nn.Parameter(torch.full((1, num_heads, 1, 1), head_dim ** 0.5))

    def forward(self, q):
        return F.normalize(q, dim=-1) * self.gain  # (B, H, N, D)


def nonneg_qk(q, k):
    """The R-nonneg ablation (ours): q and k L2-normalised per head and s = 1/2, so |q.(k_j - k_mean)| <= 2,
    s |q.(k_j - k_mean)| <= 1 and, with the factor s/N, every w_ij >= 0. Returns q, k and the scale."""
    return F.normalize(q, dim=-1), F.normalize(k, dim=-1), 0.5


def check_ablations(attention, nonneg, normalise_q, scale_by_count):
    """Refuse the ablation switches where they mean nothing (InLineBase.setup_inline calls this)."""
    if nonneg and attention != 'inline':
        raise ValueError("nonneg (every weight >= 0) is an option of InLine attention, not of linear "
                         "attention, whose weights are already non-negative")
    if normalise_q and (attention != 'inline' or nonneg):
        raise ValueError("normalise_q is an option of InLine attention without nonneg: linear attention's "
                         "division cancels q's length already, and nonneg normalises q itself")
    if nonneg and not scale_by_count:
        raise ValueError("nonneg keeps every weight >= 0 with s = 1/2 and the factor s/N; "
                         "scale_by_count=False drops the 1/N, so it needs scale_by_count=True")

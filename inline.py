"""InLine attention, the readable reference: one equation of the paper at a time.

Han et al., "Bridging the Divide: Reconsidering Softmax and Linear Attention", NeurIPS 2024, arXiv
2412.06590. Linear attention normalises by division (w_ij = q_i.k_j / sum_t q_i.k_t), which maps q
and 2q to the same weights: it is not injective. InLine normalises by subtraction instead (Eq. 5),
which is injective (given D + 1 tokens or more: inline_weights) and still linear in N, and adds a
local attention residual over each token's 3x3 neighbourhood (Eq. 6), because linear attention alone
attends too little to nearby tokens.

The file reads top to bottom: the feature map phi (the paper's "kernel function"), the two
baselines, Eq. 5, Eq. 6, the core (Eq. 5 then Eq. 6) and where its fast twins live, the module
InLineAttention, and last the paper's baselines and ablations as subclasses. InLineBase.attend is
the method after the projections, in one place: phi, Eq. 6's weights, the core or, where the switch
`fast` is on, its fast twin (kernels.py: torch.compile; triton_core.py: CUDA). Every InLine
attention runs it: InLineAttention, the linear baseline, CSwin's whole-map branch (models.py) and
sequences (sequence.py), so a line added there reaches them all; a variant overrides one step.

    python bench.py --demo  # a short demonstration: injectivity, and the two forms of Eq. 5 agree

Notation, used in every shape comment: B batch, H heads, N tokens, D head dim, C = H*D channels,
(h, w) the token grid, P leading tokens that are not on the grid (DeiT's class token), N = P + h*w,
T = k*k the weights per channel of Eq. 6's k x k neighbourhood.
"""
import contextlib
import importlib
import sys

import torch
import torch.nn as nn
import torch.nn.functional as F

# --------------------------------------------------------------------------------------------------
# The feature map phi, applied to queries and keys (the paper's "kernel function"; Table 5 compares
# them). The option `feature_map` names one.

# name -> phi; a new one is one line here (and in NON_NEGATIVE_PHI if it is >= 0), tests included
PHI = {
    'identity': nn.Identity(),  # stateless, so one instance serves every layer
    'relu': F.relu,
    'leakyrelu': F.leaky_relu,  # negative slope 0.01, PyTorch's default
    'exp': lambda x: torch.exp(0.2 * x),  # the 0.2 keeps exp from overflowing on raw projections
    # > 0: elu + 1, Katharopoulos et al. (2020)'s linear attention
    'one_plus_elu': lambda x: 1 + F.elu(x),
    # phi = 0: every weight of Eq. 5 is 1/N, which cannot select (the floor)
    'zero': torch.zeros_like,
    # learnable, one per layer: ReLUAffine, with the ablations at the end of this file
    'relu_affine': None,
}
NON_NEGATIVE_PHI = ('relu', 'exp', 'one_plus_elu', 'relu_affine')  # linear attention divides by q.k


def get_phi(name, head_dim=None):
    """The feature map phi by name (the option feature_map); 'relu_affine' is a module with
    parameters, built for head_dim."""
    if name not in PHI:
        raise ValueError(f"unknown feature map {name!r} (phi); choose one of {sorted(PHI)}")
    return ReLUAffine(head_dim) if name == 'relu_affine' else PHI[name]


def attention_scale(D):
    """D^-1/2, the paper's scale s of q.k in Eq. 5 and in softmax, written only here. A scale given
    instead may be a number or a tensor that broadcasts against (B, H, N, 1), a learnable
    temperature say."""
    return D ** -0.5


def check_grid(N, grid, leading_tokens=None):
    """P, the leading tokens before the (h, w) grid of N tokens: N = P + h*w, where P must be the
    module's leading_tokens (DeiT's class token: 1; else 0), or any P >= 0 where None
    (the pure functions)."""
    # traced (torch.onnx.export): 0-d integer tensors of known values
    if isinstance(grid, (tuple, list)):
        grid = [int(s) if torch.is_tensor(s) and s.dim() == 0 and not s.is_floating_point() else s
                for s in grid]
    if not (isinstance(grid, (tuple, list)) and len(grid) == 2
            and all(isinstance(s, int) and not isinstance(s, bool) and s >= 1 for s in grid)):
        raise ValueError(f"grid must be a pair (h, w) of positive whole numbers (the token "
                         f"grid), got {grid}")
    h, w = grid
    if leading_tokens is None:
        if N < h * w:
            raise ValueError(f"{N} tokens cannot hold a {h}x{w} token grid of {h * w}")
        return N - h * w
    if N != leading_tokens + h * w:
        raise ValueError(f"{N} tokens, but this attention declares {leading_tokens} leading "
                         f"token(s) (leading_tokens, e.g. DeiT's class token) before its {h}x{w} "
                         f"grid: N must be {leading_tokens} + {h * w} = {leading_tokens + h * w}")
    return leading_tokens


# --------------------------------------------------------------------------------------------------
# The two baselines the paper compares against; every attention function: q, k, v (B, H, N, D) ->
# (B, H, N, D)

def softmax_attention(q, k, v, scale=None):
    """w_ij = exp(s q_i.k_j) / sum_t exp(s q_i.k_t). Injective, O(N^2)."""
    s = attention_scale(q.shape[-1]) if scale is None else scale
    w = torch.softmax(s * q @ k.transpose(-2, -1), dim=-1)  # (B, H, N, N)
    return w @ v


def linear_attention(q, k, v, eps=1e-6):
    """w_ij = q_i.k_j / sum_t q_i.k_t as q (K^T V) / (q . sum_t k_t). Needs phi >= 0; not
    injective."""
    kv = k.transpose(-2, -1) @ v  # (B, H, D, D)
    denominator = q @ k.sum(dim=2, keepdim=True).transpose(-2, -1)  # (B, H, N, 1)
    return (q @ kv) / (denominator + eps)


def linear_attention_weights(q, k, eps=1e-6):
    """The N x N weights of vanilla linear attention, for looking at and for the injectivity
    test."""
    w = q @ k.transpose(-2, -1)  # (B, H, N, N)
    return w / (w.sum(dim=-1, keepdim=True) + eps)


# --------------------------------------------------------------------------------------------------
# InLine attention, Eq. 5: w_ij = s (q_i.k_j - q_i.k_mean) + 1/N (s/N in the released models:
# eq5_gain)

def eq5_gain(s, n, scale_by_count=True):
    """The factor of q_i.(k_j - k_mean) in Eq. 5 over n tokens (or a causal form's counts (N, 1)):
    s/n with scale_by_count, the released models' (they fold s/N into phi(Q)); else s, Eq. 5 as the
    paper prints it. Every form of Eq. 5 in the project, fast or causal, takes its factor from
    here."""
    return s / n if scale_by_count else s


def inline_weights(q, k, scale=None, scale_by_count=True):
    """The explicit N x N weights of Eq. 5. Every row sums to 1; weights may be negative. Injective
    in q_i where the centred keys k_j - k_mean span all D dimensions, so at least D + 1 tokens: then
    q_i -> row i is an affine map of full rank. With fewer, a change of q_i orthogonal to every
    k_j - k_mean leaves row i as it was."""
    N = q.shape[2]
    s = attention_scale(q.shape[-1]) if scale is None else scale
    k_mean = k.mean(dim=2, keepdim=True)  # (B, H, 1, D)
    # Eq. 5 (B, H, N, N)
    return eq5_gain(s, N, scale_by_count) * (q @ (k - k_mean).transpose(-2, -1)) + 1 / N


def inline_attention_quadratic(q, k, v, scale=None, scale_by_count=True):
    """o_i = sum_j w_ij v_j with the explicit weights: O(N^2 D), for teaching and tests."""
    return inline_weights(q, k, scale, scale_by_count) @ v  # (B, H, N, D)


def inline_attention(q, k, v, scale=None, scale_by_count=True):
    """Eq. 5 in linear form, O(N D^2), never building the N x N weights. Summed over j, with g the
    gain:
        o_i = g q_i^T sum_j (k_j - k_mean) v_j^T + v_mean = g N q_i^T Cov + v_mean,
        Cov = (1/N) sum_j (k_j - k_mean)(v_j - v_mean)^T   (sum_j (k_j - k_mean) = 0 lets v_mean in)
    Cov is a mean, not a sum, and g N multiplies q before Cov: in fp16 every product then stays near
    the size of the output, so it does not overflow where the output itself fits.

    Changing Eq. 5's mean: the centred form cancels any constant c put in k_mean's place, since
    sum_j (k_j - c)(v_j - v_mean)^T = sum_j k_j (v_j - v_mean)^T for every c: swap in a median here
    and nothing changes. Another statistic c belongs in the uncentred form, o_i = g q_i^T sum_j
    (k_j - c) v_j^T + v_mean, which equals inline_weights with c in place of k_mean
    (test_recipe_another_statistic_in_place_of_eq5s_mean)."""
    N = q.shape[2]
    s = attention_scale(q.shape[-1]) if scale is None else scale
    k_mean = k.mean(dim=2, keepdim=True)  # (B, H, 1, D)
    v_mean = v.mean(dim=2, keepdim=True)  # (B, H, 1, D)
    # (B, H, D, D), each side times N^-1/2; equals K^T V / N - k_mean^T v_mean, so o is the released
    # models' uncentred q^T (K^T V) - N (q.k_mean) v_mean, but centred keeps its precision in bf16
    # when the means are large
    cov = ((k - k_mean) * N ** -0.5).transpose(-2, -1) @ ((v - v_mean) * N ** -0.5)
    # Eq. 5 summed over j, (B, H, N, D)
    return (eq5_gain(s, N, scale_by_count) * N * q) @ cov + v_mean


# --------------------------------------------------------------------------------------------------
# Eq. 6, the local attention residual: o_i += sum_t r_t v_{N_t(i)} over the k x k neighbourhood of
# token i

# the option eq6: Eq. 6 over k x k neighbours; o_i += r * v_i (a 1x1 neighbourhood); no Eq. 6
EQ6_FORMS = ('local', 'plain', 'none')
# the side k of Eq. 6's k x k neighbourhood in the paper: every default of it is this name
LOCAL_SIZE = 3


def neighbourhood_size(eq6, local_size=LOCAL_SIZE):
    """Eq. 6's neighbourhood side k, decided here for every piece that depends on it (T = k^2
    weights per channel): eq6 'local': local_size, odd (3 is the paper's); 'plain': 1,
    o_i += r * v_i; 'none': None."""
    if eq6 not in EQ6_FORMS:
        raise ValueError(f"unknown eq6 {eq6!r} (Eq. 6's form); choose one of {list(EQ6_FORMS)}")
    if not (isinstance(local_size, int) and local_size >= 1 and local_size % 2 == 1):
        raise ValueError(f"local_size (the side of Eq. 6's neighbourhood) must be an odd whole "
                         f"number >= 1, so that the neighbourhood is centred on its token; "
                         f"got {local_size!r}")
    return {'local': local_size, 'plain': 1, 'none': None}[eq6]


def residual_mlp(dim, num_heads, T=9):
    """Eq. 6's weight predictor: W1 (C -> C), GELU, W2 (C -> T*C), T the weights per channel, each
    block-diagonal with one block per head, as the released two 1x1 grouped convolutions, so the
    keys (residual.0.*, residual.2.*) are the checkpoints'. Output channel T*c + t is the weight of
    neighbour t (row-major over the k x k neighbourhood) for channel c."""
    return nn.Sequential(
        nn.Conv1d(dim, dim, kernel_size=1, groups=num_heads),
        nn.GELU(),
        nn.Conv1d(dim, dim * T, kernel_size=1, groups=num_heads),
    )


def residual_weights(mlp, m):
    """Eq. 6's weights r = W2 GELU(W1 m + b1) + b2 from m, the token mean of the attention's input:
    (B, C) -> (B, T*C), or one set per mean, (B, M, C) -> (B, M, T*C) (sequence.py's prefix means).
    Each head's slice of m meets its own block: H small matmuls in one batch, what the grouped
    convolutions compute."""
    conv1, act, conv2 = mlp
    H, device = conv1.groups, m.device.type
    C = m.shape[-1]
    # In the weights' dtype, outside autocast: for B vectors, autocast's casts of W1 and W2 would
    # cost more than the matmuls. r comes out in the autocast dtype, as from autocast's matmuls.
    autocast = (torch.amp.is_autocast_available(device)  # not on 'meta'
                and torch.is_autocast_enabled(device))
    with torch.autocast(device, enabled=False) if autocast else contextlib.nullcontext():
        heads = m.to(conv1.weight.dtype).reshape(-1, H, C // H).transpose(0, 1)  # (H, B*M, D)
        w1 = conv1.weight.reshape(H, -1, C // H).transpose(1, 2)  # (H, D, D): W1's blocks
        w2 = conv2.weight.reshape(H, -1, C // H).transpose(1, 2)  # (H, D, T*D): W2's blocks
        hidden = act(torch.baddbmm(conv1.bias.reshape(H, 1, -1), heads, w1))  # (H, B*M, D)
        r = torch.baddbmm(conv2.bias.reshape(H, 1, -1), hidden, w2)  # (H, B*M, T*D)
    r = r.transpose(0, 1).reshape(*m.shape[:-1], -1)  # (B, T*C) or (B, M, T*C)
    return r.to(torch.get_autocast_dtype(device)) if autocast else r


def local_residual(v, r, grid, size=LOCAL_SIZE, dilation=1):
    """Eq. 6 on the last h*w tokens of v (B, H, N, D): the sum over the k x k neighbours t of each
    of r[b, T*c + t] * v at the neighbour, zero padding outside the grid; zero for the P leading
    tokens. r (B, T*C), T = size^2, from residual_weights; or (B, N, T*C), per token too (README,
    "Changing the method"). Neighbour t = size*dy + dx sits at dilation*(dy - size//2, dx -
    size//2). Weights per sample and channel: one convolution with B*C groups."""
    B, H, N, D = v.shape
    P, (h, w) = check_grid(N, grid), grid
    T = size * size
    if r.shape not in ((B, T * H * D), (B, N, T * H * D)):
        raise ValueError(f"r must hold {size}x{size} neighbour weights per channel, (B, {T}C) = "
                         f"{(B, T * H * D)}, or per token too, (B, N, {T}C); got {tuple(r.shape)}")
    # per token: each token's k x k neighbours unfolded beside it, channel c's at rows T*c + t
    if r.dim() == 3:
        planes = v[:, :, P:].transpose(-2, -1).reshape(B, H * D, h, w)  # (B, C, h, w)
        # (B, T*C, h*w)
        cols = F.unfold(planes, size, dilation=dilation, padding=dilation * (size // 2))
        # Eq. 6, (B, C, h*w)
        out = (cols * r[:, P:].transpose(1, 2)).unflatten(1, (H * D, -1)).sum(2)
        # (B, H, N, D), 0 for the P
        return F.pad(out.reshape(B, H, D, h * w).transpose(-2, -1), (0, 0, P, 0))
    planes = v[:, :, P:].transpose(-2, -1).reshape(1, B * H * D, h, w)  # (1, B*C, h, w)
    # each sample's and channel's weights as a filter
    weight = r.reshape(B * H * D, 1, size, size)  # (B*C, 1, k, k)
    # Eq. 6
    out = F.conv2d(planes, weight, padding=dilation * (size // 2), dilation=dilation,
                   groups=B * H * D)
    # (B, H, N, D), zero for the P
    return F.pad(out.reshape(B, H, D, h * w).transpose(-2, -1), (0, 0, P, 0))


# --------------------------------------------------------------------------------------------------
# The core: Eq. 5, then Eq. 6, and its fast twins. Every core takes these arguments and returns
# (B, H, N, D); InLineBase.attend calls one.

def inline_core(q, k, v, r, grid, scale=None, size=LOCAL_SIZE, dilation=1, scale_by_count=True):
    """Eq. 5 over all N tokens, then Eq. 6 on the last h*w tokens: the whole InLine attention after
    phi. q, k, v (B, H, N, D) through phi; r (B, T*C) Eq. 6's weights, T = size^2, or None
    (no Eq. 6); grid (h, w); size and dilation of Eq. 6's neighbourhood; scale_by_count: eq5_gain.
    Returns (B, H, N, D)."""
    o = inline_attention(q, k, v, scale, scale_by_count)  # Eq. 5, (B, H, N, D)
    return o if r is None else o + local_residual(v, r, grid, size, dilation)  # Eq. 6


def linear_core(q, k, v, r, grid, scale=None, size=LOCAL_SIZE, dilation=1, scale_by_count=True):
    """inline_core with vanilla linear attention's division in place of Eq. 5: the baseline's core
    (the division cancels scale and eq5_gain, so they go unused)."""
    o = linear_attention(q, k, v)  # division in place of Eq. 5, (B, H, N, D)
    return o if r is None else o + local_residual(v, r, grid, size, dilation)  # Eq. 6


# The switch `fast` of every InLine module: None runs its core, from this file or sequence.py;
# 'compile' or 'triton' runs the core's fast twin, with the same arguments and result, from the file
# this table names. fast_twin imports it when it is called, so inline.py imports only torch and no
# file fills this table; kernels.enable_fast checks a twin against its core before switching it on.
FAST = (None, 'compile', 'triton')
FAST_TWINS = {
    'inline.inline_core': {'compile': 'kernels.inline_core_fast',  # torch.compile, any device
                           'triton': 'triton_core.inline_core_triton'},  # a Triton kernel, CUDA
    'sequence.sequence_core': {'compile': 'sequence.sequence_core_fast'},  # a 1-D neighbourhood
    'sequence.causal_core': {'compile': 'sequence.causal_core_fast'},  # over each prefix
    # InLineAttention.steps where no gradient is asked: forward's steps, attend and its core's
    # twin included, as one graph
    'inline.steps': {'compile': 'kernels.steps_fast'},
}


def fast_twin(core, fast):
    """The fast twin of the function core for the switch value fast (FAST_TWINS). A core without
    that twin (the linear baseline's: none) is refused, naming the ones it has."""
    name = f"{core.__module__}.{core.__name__}"
    twins = FAST_TWINS.get(name, {})
    if fast not in twins:
        raise ValueError(f"{name} has no fast twin {fast!r}; it has {sorted(twins) or 'none'} "
                         f"(fast=None runs it on the reference path)")
    module, function = twins[fast].rsplit('.', 1)
    if module not in sys.modules:  # imported at the first call; torch.compile traces sys.modules
        importlib.import_module(module)
    return getattr(sys.modules[module], function)


# --------------------------------------------------------------------------------------------------
# The module

# options renamed so that each name means one thing: old -> new, refused under the old name
RENAMED = {'kernel': 'feature_map', 'residual': 'eq6'}


def add_projections(module, dim, qkv_bias, separate_q):
    """The attention's input and output projections under the released names: `qkv` C->3C, or PVT's
    `q` C->C and `kv` C->2C; `proj` C->C. Shared by InLineAttention and the softmax attention of
    models.py."""
    if separate_q:
        module.q = nn.Linear(dim, dim, bias=qkv_bias)
        module.kv = nn.Linear(dim, 2 * dim, bias=qkv_bias)
    else:
        module.qkv = nn.Linear(dim, 3 * dim, bias=qkv_bias)
    module.proj = nn.Linear(dim, dim)


class InLineBase(nn.Module):
    """What every InLine attention shares: phi, Eq. 5's scale, Eq. 6's weight predictor and the
    options that shape them, the switch `fast`, and `attend`, the method after the projections.
    InLineAttention adds the projections and the forward; CSwin's whole-map branch
    (models.CSwinInLine) calls attend between CSwin's own steps; sequence.SequenceAttention carries
    it to 1-D sequences.

    feature_map: phi, one of PHI. eq6, local_size: Eq. 6's form and neighbourhood
    (neighbourhood_size); dilation: its spread. leading_tokens: P, the tokens before the grid
    (DeiT's class token: 1), in Eq. 5 but not in Eq. 6. scale_by_count: eq5_gain. nonneg: every
    weight >= 0 (an ablation: UnitLength).
    """
    token_dims = 2  # Eq. 6's neighbourhood is k x k: T = k^2 weights per channel (a sequence's: k)
    attention = 'inline'  # the baselines' is 'linear'

    def __init__(self, dim, num_heads, *, feature_map='identity', eq6='local',
                 local_size=LOCAL_SIZE, dilation=1, leading_tokens=0, scale_by_count=True,
                 nonneg=False, **unknown):
        super().__init__()
        if unknown:  # an option under its old name (RENAMED) is refused with its new one
            said = [f"{k} (now {RENAMED[k]})" if k in RENAMED else k for k in sorted(unknown)]
            raise TypeError(f"{type(self).__name__} got unknown option(s) {', '.join(said)}")
        if dim % num_heads != 0:
            raise ValueError(f"channels ({dim}) must be divisible by heads ({num_heads})")
        size = neighbourhood_size(eq6, local_size)
        if not (isinstance(dilation, int) and dilation >= 1) or (dilation > 1 and (size or 1) == 1):
            raise ValueError(f"dilation must be a whole number >= 1, and > 1 only where Eq. 6 has "
                             f"neighbours (eq6='local', local_size > 1), got {dilation!r} "
                             f"with eq6={eq6!r}")
        if not (isinstance(leading_tokens, int) and leading_tokens >= 0):
            raise ValueError(f"leading_tokens (the tokens before the grid, e.g. a class token) "
                             f"must be a whole number >= 0; got {leading_tokens!r}")
        if nonneg and not scale_by_count:
            raise ValueError("nonneg keeps every weight >= 0 with s = 1/2 and the factor s/N; "
                             "scale_by_count=False drops the 1/N, so it needs scale_by_count=True")
        self.num_heads, self.head_dim, self.leading_tokens = (num_heads, dim // num_heads,
                                                              leading_tokens)
        self.feature_map, self.nonneg = feature_map, nonneg
        self.scale_by_count = bool(scale_by_count)
        self.local_size, self.dilation = size, dilation
        self.phi = get_phi(feature_map, dim // num_heads)
        self.scale = attention_scale(dim // num_heads)  # Eq. 5's s
        if nonneg:  # q and k of unit length and s = 1/2: every weight of Eq. 5 >= 0 (UnitLength)
            self.phi, self.scale = UnitLength(self.phi), 0.5
        # Eq. 6's weight predictor (the released key `residual`)
        self.residual = residual_mlp(dim, num_heads, size ** self.token_dims) if size else None
        self.fast = None  # or a name in FAST: set by kernels.enable_fast, after its check

    def attend(self, q, k, v, x, grid):
        """The method after the projections: q, k, v (B, H, N, D) and x (B, N, C), the input Eq. 6's
        weights are predicted from, -> o (B, H, N, D) on grid. Every InLine attention runs this, on
        both paths, with and without a gradient: a line added here reaches them all."""
        q, k = self.phi(q), self.phi(k)  # the feature map phi
        # Eq. 6's weights (B, T*C), predicted from x's token mean; None without Eq. 6
        r = None if self.residual is None else residual_weights(self.residual, self.eq6_mean(x))
        core = self.core()  # inline_core: Eq. 5, then Eq. 6
        if self.fast:  # its fast twin: the same arguments, the same result
            core = fast_twin(core, self.fast)
        return core(q, k, v, r, grid, self.scale, self.local_size, self.dilation,
                    self.scale_by_count)  # (B, H, N, D)

    def eq6_mean(self, x):
        """The token mean Eq. 6's weights are predicted from: x (B, N, C) -> (B, C). Causal
        sequences override it: each prefix's mean, one set of weights per token."""
        return x.mean(dim=1)

    def core(self):
        """The core function attend runs: Eq. 5, then Eq. 6. The linear baseline overrides it."""
        return inline_core


class InLineAttention(InLineBase):
    """x (B, N, C) on the token grid (h, w) -> (B, N, C): the projections, then attend (phi, Eq. 6's
    weights, Eq. 5 and Eq. 6), then proj. The layer of all four backbones (1-D sequences:
    sequence.SequenceAttention).

    dim, num_heads: C and H. qkv_bias, separate_q: add_projections. ape_tokens: N of the authors'
    absolute position embedding (1, N, C), added to x first, for their ablations without Eq. 6
    (their repository's issue #6); None: none. The other options: InLineBase's. fast: InLineBase's
    switch. The paper's baseline and other ablations are the subclasses at the end of this file
    (make_attention chooses).
    """

    def __init__(self, dim, num_heads, *, qkv_bias=True, separate_q=False, ape_tokens=None,
                 **options):
        super().__init__(dim, num_heads, **options)
        add_projections(self, dim, qkv_bias, separate_q)
        self.ape = None
        if ape_tokens:
            self.ape = nn.Parameter(torch.zeros(1, ape_tokens, dim))
            nn.init.trunc_normal_(self.ape, std=.02)

    def project(self, x):
        """x (B, N, C) -> q, k, v (B, H, N, D), through `qkv` (or PVT's `q` and `kv`)."""
        B, N, C = x.shape
        if hasattr(self, 'qkv'):
            q, k, v = self.qkv(x).chunk(3, dim=-1)  # 3 x (B, N, C)
        else:
            q = self.q(x)  # (B, N, C)
            k, v = self.kv(x).chunk(2, dim=-1)  # 2 x (B, N, C)
        # (B, H, N, D)
        return [t.reshape(B, N, self.num_heads, -1).transpose(1, 2) for t in (q, k, v)]

    def forward(self, x, grid=None):
        self.check_input(x, grid)
        # No gradient asked, on a grid: steps' fast twin runs them, attend included, as one compiled
        # graph per token grid (a sequence's length varies: sequence.py compiles its core alone)
        if (self.fast == 'compile' and grid is not None and not torch.is_grad_enabled()
                and not torch.compiler.is_compiling()):
            return fast_twin(InLineAttention.steps, self.fast)(self, x, grid)
        return self.steps(x, grid)

    def steps(self, x, grid):
        """forward's steps on x, checked: the projections, attend (phi, Eq. 6's weights, Eq. 5 and
        Eq. 6), proj."""
        B, N, C = x.shape
        if self.ape is not None:  # the authors' ablations without Eq. 6 only
            x = x + self.ape
        q, k, v = self.project(x)  # (B, H, N, D) each
        o = self.attend(q, k, v, x, grid)  # phi, Eq. 6's weights, Eq. 5 and Eq. 6: (B, H, N, D)
        return self.proj(o.transpose(1, 2).reshape(B, N, C))  # (B, N, C): heads side by side

    def weights(self, x, grid=None):
        """The explicit N x N weights of Eq. 5 (B, H, N, N) that this module applies to x
        (B, N, C)."""
        self.check_input(x, grid)
        q, k, _ = self.project(x if self.ape is None else x + self.ape)
        return inline_weights(self.phi(q), self.phi(k), self.scale, self.scale_by_count)

    def check_input(self, x, grid):
        """x's shape (B, N, C), once it is known to fit: C channels, N = leading_tokens + h*w on
        grid."""
        if x.dim() != 3 or x.shape[-1] != self.proj.in_features:
            image = (': an image (B, C, h, w) is x.flatten(2).transpose(1, 2), grid (h, w)'
                     * (x.dim() == 4))
            raise ValueError(f"this attention takes tokens (B, N, C), C = {self.proj.in_features} "
                             f"channels (its dim); got {tuple(x.shape)}{image}")
        if grid is None:
            raise ValueError("this attention was built for a token grid: pass grid=(h, w), or use "
                             "sequence.SequenceAttention for a 1-D sequence")
        check_grid(x.shape[1], grid, self.leading_tokens)
        if self.ape is not None and self.ape.shape[1] != x.shape[1]:
            raise ValueError(f"this attention's position embedding (ape) covers "
                             f"{self.ape.shape[1]} tokens, got {x.shape[1]}: build the model for "
                             f"this input size")
        return x.shape

    def example_inputs(self, generator, batch=2):
        """A small call of forward (x, grid), drawn from generator: what kernels.enable_fast checks
        on. With a position embedding, its tokens on one row."""
        grid = (6, 7) if self.ape is None else (1, self.ape.shape[1] - self.leading_tokens)
        x = torch.randn(batch, self.leading_tokens + grid[0] * grid[1], self.proj.in_features,
                        generator=generator)
        return x, grid


# --------------------------------------------------------------------------------------------------
# The paper's baseline and ablations, each overriding one step of InLineAttention: linear
# attention's division in place of Eq. 5; q of unit length (its length cannot change the weights);
# every weight >= 0; a learnable phi. phi = 0, the floor, is one entry of PHI.

class LinearAttention(InLineAttention):
    """Vanilla linear attention, the paper's baseline: linear_core, division in place of Eq. 5, the
    rest as InLine's (Eq. 6 too, unless eq6='none'). Needs phi >= 0 unless allow_divergent (Table 3:
    it then diverges). It has no fast twin: kernels.enable_fast refuses it."""
    attention = 'linear'

    def __init__(self, dim, num_heads, *, feature_map='relu', allow_divergent=False, **options):
        check_linear_options(feature_map, allow_divergent, options.get('nonneg'))
        super().__init__(dim, num_heads, feature_map=feature_map, **options)

    def core(self):
        return linear_core  # division in place of Eq. 5, then Eq. 6

    def weights(self, x, grid=None):
        self.check_input(x, grid)
        q, k, _ = self.project(x if self.ape is None else x + self.ape)
        return linear_attention_weights(self.phi(q), self.phi(k))


def check_linear_options(feature_map, allow_divergent, nonneg):
    """Refuse what linear attention's division cannot take (LinearAttention,
    sequence.SequenceAttention, models.CSwinInLine)."""
    if feature_map not in NON_NEGATIVE_PHI and not allow_divergent:
        raise ValueError(f"vanilla linear attention divides by q.k, so it needs a non-negative "
                         f"feature map {NON_NEGATIVE_PHI}, got {feature_map!r}; pass "
                         f"allow_divergent=True to "
                         f"run it anyway (the paper's Table 3 reports that it does not converge)")
    if nonneg:
        raise ValueError("nonneg (every weight >= 0) is an option of InLine attention, not of "
                         "linear attention, whose weights are already non-negative")


class NormalisedQ(nn.Module):
    """q (B, H, N, D) -> q / |q| times a learned gain per head (init sqrt(D)). q and a*q (a > 0)
    then give the same weights, while the gain still lets each head learn how sharp its weights
    are."""

    def __init__(self, num_heads, head_dim):
        super().__init__()
        self.gain = nn.Parameter(torch.full((1, num_heads, 1, 1), head_dim ** 0.5))

    def forward(self, q):
        return F.normalize(q, dim=-1) * self.gain  # (B, H, N, D)


class NormalisedQAttention(InLineAttention):
    """InLine attention whose queries are of unit length times a learned per-head gain
    (NormalisedQ), before phi: an ablation of ours, asking whether injectivity in q's length
    matters. Overrides the projections."""

    def __init__(self, dim, num_heads, **options):
        if options.get('nonneg'):
            raise ValueError("normalise_q is an option of InLine attention without nonneg, which "
                             "normalises q itself")
        super().__init__(dim, num_heads, **options)
        self.normalise_q = NormalisedQ(num_heads, dim // num_heads)

    def project(self, x):
        q, k, v = super().project(x)  # (B, H, N, D) each
        return self.normalise_q(q), k, v


class UnitLength(nn.Module):
    """phi, then every vector of unit length: with s = 1/2, |q.(k_j - k_mean)| <= 2, so s |q.(k_j -
    k_mean)| <= 1 and, with the factor s/N, every weight of Eq. 5 >= 0. InLineAttention's
    nonneg=True (an ablation of ours: are the negative weights needed?)."""

    def __init__(self, phi):
        super().__init__()
        self.phi = phi

    def forward(self, x):
        return F.normalize(self.phi(x), dim=-1)  # (..., D)


class ReLUAffine(nn.Module):
    """phi(x) = ReLU(A x + b), one A (D x D) and b per layer, shared by q, k and the heads: Table
    3's 'relu_affine', our construction (none was released). Starts as relu: A = I, b = 0."""

    def __init__(self, head_dim):
        super().__init__()
        self.weight = nn.Parameter(torch.eye(head_dim))
        self.bias = nn.Parameter(torch.zeros(head_dim))

    def forward(self, x):
        return F.relu(F.linear(x, self.weight, self.bias))  # (..., D) -> (..., D)


def make_attention(dim, num_heads, *, attention='inline', normalise_q=False, **options):
    """The attention a backbone's I or L block builds: attention 'inline' (InLineAttention) or
    'linear' (LinearAttention); normalise_q: NormalisedQAttention. Other options:
    InLineAttention's."""
    if attention not in ('inline', 'linear'):
        raise ValueError(f"unknown attention {attention!r}; choose 'inline' or 'linear'")
    if normalise_q and attention == 'linear':
        raise ValueError("normalise_q is an option of InLine attention: linear attention's "
                         "division cancels q's length already")
    if attention == 'linear':
        return LinearAttention(dim, num_heads, **options)
    options.pop('allow_divergent', None)  # a switch of linear attention's alone
    return (NormalisedQAttention if normalise_q else InLineAttention)(dim, num_heads, **options)

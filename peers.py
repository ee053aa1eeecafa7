"""The peers of InLine attention: two linear attentions a user would pick instead, as baselines.

Han et al., "Bridging the Divide: Reconsidering Softmax and Linear Attention", NeurIPS 2024, arXiv
2412.06590. The authors' rebuttal compares InLine with
  - FLatten's focused linear attention (Han et al., "FLatten Transformer: Vision Transformer using
    Focused Linear Attention", ICCV 2023, arXiv 2308.00442; code LeapLabTHU/FLatten-Transformer,
    `models/flatten_swin.py` and `models/flatten_pvt.py`): vanilla division-normalised linear
    attention on q, k through a "focused function" (relu, a learned per-channel scale, each entry
    raised to the power p with the token's norm kept), plus a depthwise convolution of v (`dwc`)
    added to the output;
  - TransNormer's NormAttention (Qin et al., "The Devil in Linear Transformer", EMNLP 2022, arXiv
    2210.10340; code OpenNLPLab/Transnormer): linear attention with no denominator at all, o =
    Norm(phi(q) (phi(k)^T v)), the normalisation moved from the weights to the output.
Both modules here take what inline.InLineAttention takes: x (B, N, C) on the token grid (h, w) ->
(B, N, C), and keep the released parameter names (qkv or PVT's q and kv, proj, and FLatten's scale,
positional_encoding, dwc, sr, norm), so FLatten's checkpoints load. The math is in pure functions
beside them, tested in test_peers.py. They are baselines: models.py builds them from its layout
letters F and N in its PVT and Swin (make_peer, at the end; the registry's flatten_* and
transnormer_swin_t).

Notation, used in every shape comment: B batch, H heads, N query tokens, n key tokens (n = N but
with PVT's spatial reduction, n = N / r^2), D head dim, C = H*D channels, (h, w) the token grid.
"""
import torch
import torch.nn as nn
import torch.nn.functional as F

import inline

# --------------------------------------------------------------------------------------------------
# FLatten: the focused function, the division, the depthwise convolution of v

# FLatten's: added after the relu (every entry > 0) and to the division's denominator
FLATTEN_EPS = 1e-6
# FocusedLinearAttention's: FLatten's, or InLine's Eq. 5
NORMALISATIONS = ('division', 'subtraction')


def focusing(x, p):
    """FLatten's focusing function f_p(x) = (x^p / |x^p|) |x| on x (..., C) with every entry > 0,
    norms over the last dimension (all C channels of a token, before the split into heads): each
    entry raised to the power p, which turns the token towards its largest channels, with the
    token's length kept."""
    return x ** p / (x ** p).norm(dim=-1, keepdim=True) * x.norm(dim=-1, keepdim=True)  # (..., C)


def focused_function(x, scale, p, eps=FLATTEN_EPS):
    """FLatten's focused function phi_p on queries or keys x (B, N, C): relu(x) + eps, divided by
    softplus(scale), the learned per-channel scale (1, 1, C), then focusing(., p). In the authors'
    order: the norm the focusing keeps is the scaled token's."""
    x = (F.relu(x) + eps) / F.softplus(scale)  # (B, N, C), every entry > 0
    return focusing(x, p)


def focused_linear_weights(q, k, eps=FLATTEN_EPS):
    """The explicit N x n weights of FLatten's division, w_ij = q_i.k_j / (q_i . sum_t k_t + n eps),
    for q (B, H, N, D) and k (B, H, n, D) through phi_p: vanilla linear attention's (rows sum
    to 1 up to eps)."""
    w = q @ k.transpose(-2, -1)  # (B, H, N, n)
    return w / (w.sum(dim=-1, keepdim=True) + k.shape[2] * eps)


def focused_linear_attention(q, k, v, eps=FLATTEN_EPS):
    """FLatten's division in linear form, O(n D^2): o_i = q_i^T (K^T V / n) / (q_i . k_mean + eps),
    q (B, H, N, D), k, v (B, H, n, D). Numerator and denominator of q_i^T K^T V / (q_i . sum_t k_t +
    n eps) each divided by n: the same number as focused_linear_weights(q, k) @ v (and
    inline.linear_attention with eps n*eps), written so that the sums of n products stay in fp16's
    range, the authors' form."""
    n = k.shape[2]
    # (B, H, N, 1): 1 / (q_i . k_mean + eps)
    z = 1 / (q @ k.mean(dim=2, keepdim=True).transpose(-2, -1) + eps)
    kv = (k.transpose(-2, -1) * n ** -0.5) @ (v * n ** -0.5)  # (B, H, D, D): K^T V / n
    return q @ kv * z  # (B, H, N, D)


def depthwise_residual(v, grid, conv):
    """FLatten's rank restoration: v (B, H, N, D) on grid (h, w) through conv, a depthwise k x k
    convolution over one head's D channels (zero padding), the same for every head. Returns
    (B, H, N, D), added to the output."""
    B, H, N, D = v.shape
    # each head's v as a D-channel map
    planes = v.transpose(-2, -1).reshape(B * H, D, *grid)  # (B*H, D, h, w)
    return conv(planes).reshape(B, H, D, N).transpose(-2, -1)  # (B, H, N, D)


class FocusedLinearAttention(nn.Module):
    """FLatten's focused linear attention, `FocusedLinearAttention` in both of the authors' model
    files: x (B, N, C) on grid (h, w) -> q, k, v -> k + positional_encoding -> the focused function
    on q and k -> the division -> + dwc(v) -> proj -> (B, N, C).

    dim, num_heads: C and H.
    tokens: the N of every call, which sizes positional_encoding (tokens / sr_ratio^2 keys):
        FLatten-Swin's window (in its focused stages the whole stage: 3136 for stage 1 at 224 px),
        FLatten-PVT's stage (their num_patches).
    qkv_bias: biases in the input projections (True in every FLatten model).
    separate_q: PVT's parameter layout (`q` C->C and `kv` C->2C) instead of Swin's `qkv` C->3C.
    sr_ratio: PVT's spatial reduction r of keys and values (a conv of size and stride r, `sr`, then
        LayerNorm, `norm`); v is resampled linearly back to N tokens for dwc. Every released
        FLatten-PVT has r = 1 (their config.py's PVT_LA_SR_RATIOS 1111).
    focusing_factor: p of the focusing function (3, their config's FOCUSING_FACTOR).
    kernel_size: the side of dwc (5, their KERNEL_SIZE), a Conv2d D -> D with groups D and a bias,
        shared by the heads.
    normalisation: 'division', FLatten's; or 'subtraction', InLine's Eq. 5 (inline.inline_attention,
        the released s/N factor) on the same focused q and k: the rebuttal's "FLatten without
        division", read as InLine's normalisation in FLatten's place (every row of weights still
        sums to 1). Needs sr_ratio 1: Eq. 5's 1/N is over as many keys as queries.
    """
    # kernels.enable_fast refuses it
    no_fast_path = "FLatten's focused linear attention (layout letter F)"

    def __init__(self, dim, num_heads, tokens, *, qkv_bias=True, separate_q=False, sr_ratio=1,
                 focusing_factor=3, kernel_size=5, normalisation='division'):
        super().__init__()
        if normalisation not in NORMALISATIONS:
            raise ValueError(f"unknown normalisation {normalisation!r}; choose one of "
                             f"{list(NORMALISATIONS)}")
        if normalisation == 'subtraction' and sr_ratio > 1:
            raise ValueError("normalisation='subtraction' (Eq. 5) needs as many keys as "
                             "queries: sr_ratio 1")
        if dim % num_heads != 0:
            raise ValueError(f"channels ({dim}) must be divisible by heads ({num_heads})")
        if sr_ratio > 1 and not separate_q:
            raise ValueError("spatial reduction (sr_ratio > 1) is PVT's: it needs PVT's layout, "
                             "separate_q=True")
        if kernel_size % 2 != 1:
            raise ValueError(f"kernel_size must be odd, so that dwc keeps the grid, "
                             f"got {kernel_size}")
        self.num_heads, self.sr_ratio, self.focusing_factor = num_heads, sr_ratio, focusing_factor
        self.normalisation = normalisation
        D = dim // num_heads
        inline.add_projections(self, dim, qkv_bias, separate_q)
        if sr_ratio > 1:
            self.sr = nn.Conv2d(dim, dim, sr_ratio, stride=sr_ratio)
            self.norm = nn.LayerNorm(dim)
        self.dwc = nn.Conv2d(D, D, kernel_size, padding=kernel_size // 2, groups=D)
        self.scale = nn.Parameter(torch.zeros(1, 1, dim))  # softplus(0) = log 2 at the start
        # on the n keys
        self.positional_encoding = nn.Parameter(torch.zeros(1, tokens // sr_ratio ** 2, dim))

    def project(self, x, grid):
        """x (B, N, C) -> q (B, N, C), k and v (B, n, C), n = N / sr_ratio^2."""
        B, N, C = x.shape
        if hasattr(self, 'qkv'):
            return self.qkv(x).chunk(3, dim=-1)  # 3 x (B, N, C)
        kv_input = x
        if self.sr_ratio > 1:  # keys and values from the map reduced by a conv of size and stride r
            planes = x.transpose(1, 2).reshape(B, C, *grid)  # (B, C, h, w)
            kv_input = self.norm(self.sr(planes).flatten(2).transpose(1, 2))  # (B, n, C)
        return (self.q(x), *self.kv(kv_input).chunk(2, dim=-1))

    def forward(self, x, grid):
        B, N, C = x.shape
        inline.check_grid(N, grid, 0)
        q, k, v = self.project(x, grid)
        n, pe = k.shape[1], self.positional_encoding
        if pe.shape[1] != n:
            raise ValueError(f"this attention's positional_encoding covers {pe.shape[1]} keys, got "
                             f"{n}: build it with tokens = N of the call ({N} here) or resize the "
                             f"parameter for this input size")
        q = focused_function(q, self.scale, self.focusing_factor)  # (B, N, C)
        # position before the focused function
        k = focused_function(k + pe, self.scale, self.focusing_factor)  # (B, n, C)
        q, k, v = (self.split(t) for t in (q, k, v))  # (B, H, N or n, D)
        # the division or Eq. 5's subtraction, (B, H, N, D)
        o = (focused_linear_attention(q, k, v) if self.normalisation == 'division'
             else inline.inline_attention(q, k, v))
        # v back to N tokens for dwc, linearly along the flattened token order
        if self.sr_ratio > 1:
            # (B*H, D, N)
            v = F.interpolate(v.transpose(-2, -1).flatten(0, 1), size=N, mode='linear')
            v = v.reshape(B, self.num_heads, -1, N).transpose(-2, -1)  # (B, H, N, D)
        o = o + depthwise_residual(v, grid, self.dwc)  # (B, H, N, D)
        return self.proj(o.transpose(1, 2).reshape(B, N, C))  # (B, N, C)

    def weights(self, x, grid):
        """The explicit weights (B, H, N, n) of the division this module applies to x (B, N, C);
        dwc's are per channel, not among them."""
        q, k, _ = self.project(x, grid)
        q = focused_function(q, self.scale, self.focusing_factor)
        k = focused_function(k + self.positional_encoding, self.scale, self.focusing_factor)
        weights = (focused_linear_weights if self.normalisation == 'division'
                   else inline.inline_weights)
        return weights(self.split(q), self.split(k))  # (B, H, N, n)

    def split(self, t):
        """(B, N, C) -> (B, H, N, D)."""
        return t.reshape(t.shape[0], t.shape[1], self.num_heads, -1).transpose(1, 2)


# --------------------------------------------------------------------------------------------------
# TransNormer's NormAttention: no denominator, a normalisation of the output instead

NORMS = ('srmsnorm', 'layernorm')  # NormAttention's output normalisations over the C channels


def simple_rms_norm(x, eps=1e-6):
    """x / sqrt(mean(x^2) + eps) over the last dimension, no parameters, in fp32 (or wider) and
    rounded back: TransNormer's SimpleRMSNorm (their vision models' default output norm)."""
    y = x.to(torch.promote_types(x.dtype, torch.float32))
    return (y * torch.rsqrt(y.pow(2).mean(dim=-1, keepdim=True) + eps)).to(x.dtype)


def norm_linear_attention(q, k, v):
    """Linear attention without its denominator: o_i = q_i^T sum_j k_j v_j^T, q (B, H, N, D),
    k, v (B, H, n, D) already through phi. O(n D^2). The explicit form is (q k^T) v, weights that
    are not normalised at all: NormAttention normalises the output instead."""
    return q @ (k.transpose(-2, -1) @ v)  # (B, H, N, D)


class NormAttention(nn.Module):
    """TransNormer's NormAttention: x (B, N, C) -> q, k, v -> o = Norm(phi(q) (phi(k)^T v)) -> proj
    -> (B, N, C).

    Our reading of their code (OpenNLPLab's vision NormLinearAttention, and fairseq-evo's for
    language): phi is applied to q and k of each head; no scale, no denominator; the heads' outputs
    are concatenated and normalised over all C channels by `norm`; then the output projection. No
    checkpoint of theirs is for a vision backbone with these names, so the names are this project's
    (timm's): qkv (or PVT's q, kv), proj, norm.

    dim, num_heads: C and H.
    qkv_bias, separate_q: as inline.InLineAttention's.
    feature_map: phi, one of inline.PHI ('one_plus_elu', 1 + elu, their default; 'relu' the other
        they use).
    norm: 'srmsnorm', their SimpleRMSNorm without parameters (simple_rms_norm, their vision
        default), or 'layernorm', nn.LayerNorm(C) with its weight and bias (`norm`), their language
        code's default.
    leading_tokens: the tokens before the grid (a class token: 1); the grid is only checked, never
        used.
    """
    no_fast_path = "TransNormer's NormAttention (layout letter N)"  # kernels.enable_fast refuses it

    def __init__(self, dim, num_heads, *, qkv_bias=True, separate_q=False,
                 feature_map='one_plus_elu', norm='srmsnorm', leading_tokens=0):
        super().__init__()
        if dim % num_heads != 0:
            raise ValueError(f"channels ({dim}) must be divisible by heads ({num_heads})")
        if norm not in NORMS:
            raise ValueError(f"unknown norm {norm!r}; choose one of {list(NORMS)}")
        if feature_map == 'relu_affine':
            raise ValueError("NormAttention takes a stateless feature map: relu_affine is "
                             "InLine's ablation")
        self.num_heads, self.leading_tokens = num_heads, leading_tokens
        self.phi = inline.get_phi(feature_map)
        inline.add_projections(self, dim, qkv_bias, separate_q)
        self.norm = nn.LayerNorm(dim) if norm == 'layernorm' else simple_rms_norm

    def project(self, x, grid=None):
        """x (B, N, C) -> phi(q), phi(k), v (B, H, N, D)."""
        B, N, C = x.shape
        if grid is not None:
            inline.check_grid(N, grid, self.leading_tokens)
        if hasattr(self, 'qkv'):
            q, k, v = self.qkv(x).chunk(3, dim=-1)  # 3 x (B, N, C)
        else:
            q, (k, v) = self.q(x), self.kv(x).chunk(2, dim=-1)
        # (B, H, N, D)
        q, k, v = (t.reshape(B, N, self.num_heads, -1).transpose(1, 2) for t in (q, k, v))
        return self.phi(q), self.phi(k), v

    def forward(self, x, grid=None):
        B, N, C = x.shape
        q, k, v = self.project(x, grid)
        o = norm_linear_attention(q, k, v)  # (B, H, N, D)
        # the norm over all C, (B, N, C)
        return self.proj(self.norm(o.transpose(1, 2).reshape(B, N, C)))

    def weights(self, x, grid=None):
        """The explicit, unnormalised weights phi(q_i).phi(k_j) (B, H, N, N) before the output's
        norm."""
        q, k, _ = self.project(x, grid)
        return q @ k.transpose(-2, -1)


# --------------------------------------------------------------------------------------------------
# The peers inside models.py's backbones: layout letters F and N, in PVT and Swin

LETTERS = 'FN'  # F: FocusedLinearAttention, N: NormAttention
# the families that build them: the released FLatten models' two
FAMILIES = ('InLine-PVT', 'InLine-Swin')
# their attention options (models.attention_options): FLatten's config.py (FOCUSING_FACTOR,
# KERNEL_SIZE) and TransNormer's vision default for NormAttention's norm
OPTIONS = dict(focusing_factor=3, kernel_size=5, focused_normalisation='division',
               output_norm='srmsnorm')


def make_peer(letter, dim, num_heads, options, tokens, separate_q=False, sr_ratio=1):
    """The attention of an F or N block, from the attention options (models.attention_options).
    tokens: the N of every call (F's positional_encoding: the stage's h*w in PVT, the window's in
        Swin).
    separate_q, sr_ratio: PVT's layout and F's spatial reduction (FLatten-PVT's la_sr_ratios)."""
    if letter == 'F':
        return FocusedLinearAttention(dim, num_heads, tokens, separate_q=separate_q,
                                      sr_ratio=sr_ratio, focusing_factor=options['focusing_factor'],
                                      kernel_size=options['kernel_size'],
                                      normalisation=options['focused_normalisation'])
    if sr_ratio > 1:
        raise ValueError("NormAttention (layout letter N) has no spatial reduction: its "
                         "sr_ratio must be 1")
    return NormAttention(dim, num_heads, separate_q=separate_q,
                         feature_map=options['feature_map'] or 'one_plus_elu',
                         norm=options['output_norm'])

"""The four InLine backbones (DeiT, PVT, Swin, CSwin), all 15 released variants, and the peers'
models.

Han et al., "Bridging the Divide: Reconsidering Softmax and Linear Attention", NeurIPS 2024,
arXiv 2412.06590. The attention itself lives in inline.py and is imported, never copied; this file
builds the authors' four architectures around it, with module names that reproduce the released
checkpoints' keys exactly (golden/keys/<variant>.tsv.gz), so released weights load unchanged.

    python -m paper models  # every variant: params and GMACs beside the paper's figures

    # a released checkpoint
    model = create_model('inline_swin_t', checkpoint='inline_swin_t.pth')
    # Table 3's linear baseline
    model = create_model('inline_swin_t', layout='LLLS', eq6='none')
    # non-square features
    model = create_model('inline_cswin_t', img_size=(224, 320), num_classes=0)
    # a Table 4 ablation
    model = create_model('inline_swin_t', window=7, eq6='none')
    # stage maps for detection and segmentation
    backbone = dense.create_backbone('inline_pvt_s')

Attention layout, one letter per stage: I = InLine attention (Eq. 5 + Eq. 6); L = vanilla linear
attention (division normalisation, phi = relu by default), the paper's baseline; S = softmax
attention (DeiT: over all tokens; PVT: with spatial reduction; Swin: shifted windows with relative
position bias; CSwin: cross-shaped stripes); M = the stage's first k blocks are I and the rest S, k
after the letters ('IIMS2'). PVT and Swin also take the peers (peers.py): F = FLatten's focused
linear attention, N = TransNormer's NormAttention. The other switches are attention_options' and
InLineSwin's; the lab (paper/) names the paper's combinations of them.

Notation, used in every shape comment: B batch, H heads, N tokens, D head dim, C = H*D channels,
(h, w) the token grid, P leading tokens off the grid (DeiT's class token), nW windows per image,
(wh, ww) a window, (Hp, Wp) the grid padded to whole windows. Images are (B, 3, *img_size).
"""
import inspect
import math
import os
from collections import OrderedDict

import torch
import torch.nn as nn
import torch.nn.functional as F
from torch.nn.init import trunc_normal_
import torch.utils.checkpoint
from torch.utils.flop_counter import FlopCounterMode
from torchvision.ops import StochasticDepth

import inline
import peers
from checkpoints import (IN_MEMORY, load_checkpoint, pair, read_file, recorded_build,
                         resize_grid)

# The authors' figures for each variant at its released size: params and GMACs of their model
# definitions, counted as count_macs counts, and the ImageNet-1K top-1 the paper reports for the
# released weights (README, "Models", shows the table; `python -m paper models` prints ours beside
# it).
RELEASED = {
    'inline_deit_t': (6_477_736, 1.109, 74.5), 'inline_deit_s': (16_734_760, 4.966, 80.2),
    'inline_deit_b': (23_797_096, 17.169, 82.3),
    'inline_pvt_t': (12_032_232, 1.976, 78.2), 'inline_pvt_s': (21_556_136, 3.915, 82.0),
    'inline_pvt_m': (37_618_856, 6.862, 83.2), 'inline_pvt_l': (51_154_280, 10.130, 83.6),
    'inline_swin_t': (29_223_544, 4.459, 82.4), 'inline_swin_s': (49_793_296, 8.719, 83.6),
    'inline_swin_b': (88_350_120, 15.398, 84.1), 'inline_swin_b_384': (88_465_320, 46.200, None),
    'inline_cswin_t': (20_604_520, 4.312, 83.2), 'inline_cswin_s': (33_032_872, 6.773, 83.8),
    'inline_cswin_b': (73_413_640, 14.885, 84.5), 'inline_cswin_b_384': (73_413_640, 46.220, 85.7),
    # the peers: FLatten's (their README's top-1; -PVT-S's from their paper) and our
    # TransNormer-Swin-T, whose params and GMACs are our construction's and whose top-1 is the
    # rebuttal's "TransNormer 30M 4.5G 79.9"
    'flatten_swin_t': (29_192_384, 4.483, 82.1), 'flatten_pvt_t': (12_150_504, 2.037, 77.8),
    'flatten_pvt_s': (21_670_248, 4.030, 81.7), 'transnormer_swin_t': (28_268_074, 4.473, 79.9),
}

# --------------------------------------------------------------------------------------------------
# Pieces every family shares

def check_image_size(size, stride, what):
    """The one constraint on input size: height and width divisible by the total stride."""
    H, W = size
    if H % stride or W % stride or H < stride or W < stride:
        raise ValueError(f"{what} needs image height and width divisible by {stride} (its total "
                         f"stride: patch embedding and downsampling), got {H}x{W}")


def parse_layout(layout, depths, letters):
    """One attention letter per block of every stage: 'IIMS2' with depths (2, 2, 5, 2) ->
    [['I', 'I'], ['I', 'I'], ['I', 'I', 'S', 'S', 'S'], ['S', 'S']]. M: the stage's first k blocks
    are I, the rest S, with k written after the stage letters."""
    stages, k = layout[:len(depths)], layout[len(depths):]
    if set(stages) & set(peers.LETTERS) - set(letters):
        raise ValueError(f"layout {layout!r}: F (FLatten) and N (TransNormer) are built in the PVT "
                         f"and Swin families only ({', '.join(peers.FAMILIES)})")
    valid = (len(stages) == len(depths) and all(c in letters for c in stages)
             and stages.count('M') <= 1)
    if 'M' in stages:
        valid = valid and k.isdigit() and int(k) <= depths[stages.index('M')]
    else:
        valid = valid and not k
    if not valid:
        raise ValueError(f"layout {layout!r}: need {len(depths)} letters from {' '.join(letters)}, "
                         f"one per stage; "
                         f"M at most once, with its count of leading I blocks (at most the stage's "
                         f"depth) written after the letters, e.g. 'IIMS2'")
    return [['I'] * int(k) + ['S'] * (depth - int(k)) if c == 'M' else [c] * depth
            for c, depth in zip(stages, depths)]


def stage_grids(img_size):
    """The (h, w) token grids of the four stages of PVT, Swin and CSwin: strides 4, 8, 16, 32."""
    return [(img_size[0] // 2 ** (i + 2), img_size[1] // 2 ** (i + 2)) for i in range(4)]


# InLine's options and their defaults, written there alone (linear attention's allow_divergent too)
INLINE_DEFAULTS = {name: p.default for cls in (inline.InLineBase, inline.LinearAttention)
                   for name, p in inspect.signature(cls.__init__).parameters.items()
                   if p.kind is p.KEYWORD_ONLY}
# every family's attention switches and their defaults: InLineBase's, but the feature map (None:
# each letter's, below), and normalise_q, the letters of the blocks it acts on
ATTENTION_OPTIONS = dict(feature_map=None,
                         **{k: INLINE_DEFAULTS[k]
                            for k in ('eq6', 'local_size', 'dilation', 'nonneg')},
                         normalise_q='', allow_divergent=INLINE_DEFAULTS['allow_divergent'],
                         **peers.OPTIONS)


def attention_options(family, options, letters):
    """The attention switches a family was given, checked and completed with the defaults:
    feature_map (phi; None: identity for I, relu for L, 1 + elu for N), eq6 ('local' Eq. 6,
    'plain', 'none'), local_size (Eq. 6's neighbourhood side), dilation, nonneg (I), normalise_q
    (the normalised-q ablation, asking the paper's Table 1 question of whether q's length matters:
    the letters, 'S' and/or 'I', of the blocks whose q is L2-normalised with a learned per-head
    gain, inline.NormalisedQ), allow_divergent (L with a signed phi); focusing_factor, kernel_size,
    focused_normalisation (F), output_norm (N): the peers' (peers.make_peer).
    letters: every block's attention letter, among which normalise_q's must be."""
    unknown = sorted(set(options) - set(ATTENTION_OPTIONS))
    if family != 'InLine-Swin' and {'window', 'ape'} & set(unknown):
        raise ValueError(f"{family}: window and ape are InLine-Swin's options (the authors' "
                         f"window ablation)")
    if unknown:
        said = [f"{k} (now {inline.RENAMED[k]})" if k in inline.RENAMED else k for k in unknown]
        raise ValueError(f"{family}: unknown argument(s) {said}; allowed are its sizes "
                         f"(the arguments of its class) and the attention options "
                         f"{list(ATTENTION_OPTIONS)}")
    normalise = options.get('normalise_q', '')
    allowed = {'I', 'S'} if family != 'InLine-CSwin' else {'I'}
    if (not isinstance(normalise, str) or not set(normalise) <= allowed & set(letters)
            or len(set(normalise)) < len(normalise)):
        stripes = ", nor CSwin's stripe softmax" if family == 'InLine-CSwin' else ''
        raise ValueError(f"{family}: normalise_q takes the letters of the blocks whose q it "
                         f"normalises, each once, of {sorted(allowed & set(letters))} in this "
                         f"layout ('S' softmax, 'I' InLine; not 'L': division cancels q's length "
                         f"already{stripes}), got {normalise!r}")
    return {**ATTENTION_OPTIONS, **options}


def block_attention(letter, dim, num_heads, options, sr_ratio=1, **kwargs):
    """The attention of a DeiT or PVT block by its layout letter. I: InLine attention (phi identity
    unless given); L: vanilla linear attention (relu unless given); S: softmax attention over all
    tokens (DeiT), with PVT's spatial reduction sr_ratio."""
    if letter == 'S':
        return SoftmaxAttention(dim, num_heads, sr_ratio=sr_ratio,
                                normalise_q='S' in options['normalise_q'], **kwargs)
    return inline.make_attention(dim, num_heads, **inline_options(letter, options), **kwargs)


def inline_options(letter, options):
    """The InLineBase options of an I or L block."""
    o = {k: options[k] for k in ('eq6', 'local_size', 'dilation', 'nonneg', 'allow_divergent')}
    o['normalise_q'] = letter in options['normalise_q']
    return dict(o, feature_map=options['feature_map'] or ('identity' if letter == 'I' else 'relu'),
                attention='inline' if letter == 'I' else 'linear')


def drop_path_rates(rate, depths):
    """Stochastic depth rising linearly from 0 to `rate` over all blocks, split per stage."""
    # torch.linspace, in plain floats
    rates = [rate * i / max(sum(depths) - 1, 1) for i in range(sum(depths))]
    return [rates[sum(depths[:i]):sum(depths[:i + 1])] for i in range(len(depths))]


class Mlp(nn.Sequential):
    """Linear C -> hidden, GELU, Linear hidden -> C, under the released names fc1 and fc2."""

    def __init__(self, dim, hidden):
        super().__init__(OrderedDict(fc1=nn.Linear(dim, hidden), act=nn.GELU(),
                                     fc2=nn.Linear(hidden, dim)))


class SoftmaxAttention(nn.Module):
    """Softmax attention over all tokens, DeiT's (`qkv`) and PVT's (`q`, `kv`, with spatial
    reduction: keys and values from the map downsampled by a conv of size and stride sr_ratio, then
    LayerNorm; keys `sr`, `norm`), computed with F.scaled_dot_product_attention. normalise_q: the
    normalised-q ablation (ours, on the paper's Table 1 question: does q's length matter?): softmax
    over L2-normalised queries times a learned per-head gain (inline.NormalisedQ), so q and a*q
    (a > 0) get the same weights; scale D^-1/2 as usual."""

    def __init__(self, dim, num_heads, qkv_bias=True, separate_q=False, sr_ratio=1,
                 normalise_q=False, leading_tokens=0):
        super().__init__()
        if dim % num_heads != 0:
            raise ValueError(f"channels ({dim}) must be divisible by heads ({num_heads})")
        self.num_heads, self.sr_ratio = num_heads, sr_ratio
        self.normalise_q = inline.NormalisedQ(num_heads, dim // num_heads) if normalise_q else None
        # tokens before the grid (DeiT's class token), as InLineAttention's
        self.leading_tokens = leading_tokens
        inline.add_projections(self, dim, qkv_bias, separate_q)
        if sr_ratio > 1:
            self.sr = nn.Conv2d(dim, dim, sr_ratio, stride=sr_ratio)
            self.norm = nn.LayerNorm(dim)

    def project(self, x, grid):
        """x (B, N, C) -> q (B, H, N, D), normalised where normalise_q, k and v (B, H, N', D),
        N' = N / sr_ratio^2 with spatial reduction."""
        B, N, C = x.shape
        inline.check_grid(N, grid, self.leading_tokens)
        split = lambda t: t.reshape(B, t.shape[1], self.num_heads, -1).transpose(1, 2)  # noqa: E731
        if hasattr(self, 'qkv'):
            q, k, v = [split(t) for t in self.qkv(x).chunk(3, dim=-1)]
        else:
            kv_input = x
            if self.sr_ratio > 1:  # PVT's grid has no leading tokens
                # (B, N', C)
                kv_input = self.norm(self.sr(to_map(x, grid)).flatten(2).transpose(1, 2))
            q, (k, v) = split(self.q(x)), [split(t) for t in self.kv(kv_input).chunk(2, dim=-1)]
        return (q if self.normalise_q is None else self.normalise_q(q)), k, v

    def forward(self, x, grid):
        B, N, C = x.shape
        q, k, v = self.project(x, grid)
        o = F.scaled_dot_product_attention(q, k, v)  # (B, H, N, D)
        return self.proj(o.transpose(1, 2).reshape(B, N, C))

    def weights(self, x, grid):
        """The explicit attention weights (B, H, N, N') this module applies to x (B, N, C)."""
        q, k, _ = self.project(x, grid)
        return torch.softmax(inline.attention_scale(q.shape[-1]) * q @ k.transpose(-2, -1), dim=-1)


class Block(nn.Module):
    """Pre-norm block around InLine attention, DeiT's and PVT's: x (B, P + h*w, C) on grid
    (h, w)."""

    def __init__(self, dim, mlp_ratio, drop_path, eps, attn):
        super().__init__()
        self.norm1 = nn.LayerNorm(dim, eps=eps)
        self.attn = attn
        self.norm2 = nn.LayerNorm(dim, eps=eps)
        self.mlp = Mlp(dim, int(dim * mlp_ratio))
        self.drop_path = StochasticDepth(drop_path, 'row')

    def forward(self, x, grid):
        x = x + self.drop_path(self.attn(self.norm1(x), grid))
        return x + self.drop_path(self.mlp(self.norm2(x)))


class PatchEmbed(nn.Module):
    """Non-overlapping patches: conv of size and stride = patch, optional LayerNorm. Keys proj,
    norm."""

    def __init__(self, in_chans, dim, patch, norm_eps=None):
        super().__init__()
        self.proj = nn.Conv2d(in_chans, dim, patch, stride=patch)
        self.norm = nn.LayerNorm(dim, eps=norm_eps) if norm_eps else nn.Identity()

    def forward(self, x):
        x = self.proj(x)  # (B, C, h, w)
        return self.norm(x.flatten(2).transpose(1, 2)), tuple(x.shape[2:])  # (B, h*w, C), (h, w)


def to_map(x, grid):
    return x.transpose(1, 2).reshape(x.shape[0], x.shape[2], *grid)  # (B, N, C) -> (B, C, h, w)


class Backbone(nn.Module):
    """What the four models share: init, head, timm's classifier API, activation checkpointing."""
    family = img_size = None
    grad_checkpointing = False
    arch = {}  # the create_model overrides it was built with (create_model fills it)

    def set_grad_checkpointing(self, enable=True):
        """Recompute each block's activations in the backward instead of storing them (the authors'
        --use-checkpoint): less memory for the B variants, about one more forward of compute."""
        self.grad_checkpointing = enable

    def setup(self, img_size, stride, layout, depths, letters, drop_path_rate, attention):
        """The opening every family's constructor shares: the image size (a multiple of the total
        stride), the layout parsed into one letter per block of every stage, the attention options
        checked against it, and the stochastic depth rate of every block. Returns (letters, rates),
        each one list per stage."""
        self.img_size, self.layout = pair(img_size), layout
        check_image_size(self.img_size, stride, self.name)
        letters = parse_layout(layout, depths, letters)
        self.options = attention_options(self.name, attention,
                                         [c for stage in letters for c in stage])
        return letters, drop_path_rates(drop_path_rate, depths)

    @property
    def name(self):
        # InLineSwin -> InLine-Swin, as errors say it
        return type(self).__name__.replace('InLine', 'InLine-')

    def run_block(self, block, x, *args):
        if self.grad_checkpointing and self.training and torch.is_grad_enabled():
            return torch.utils.checkpoint.checkpoint(block, x, *args, use_reentrant=False)
        return block(x, *args)

    def init_weights(self):
        """Truncated normal (std .02) for Linear weights, zero biases, LayerNorm ones/zeros;
        convolutions keep PyTorch's default init: the released code's initialisation."""
        for m in self.modules():
            if isinstance(m, nn.Linear):
                trunc_normal_(m.weight, std=.02)
                if m.bias is not None:
                    nn.init.zeros_(m.bias)
            elif isinstance(m, nn.LayerNorm):
                nn.init.ones_(m.weight)
                nn.init.zeros_(m.bias)

    def reset_classifier(self, num_classes):
        self.num_classes = num_classes
        self.head = nn.Linear(self.num_features, num_classes) if num_classes > 0 else nn.Identity()
        if num_classes > 0:
            trunc_normal_(self.head.weight, std=.02)
            nn.init.zeros_(self.head.bias)

    def forward_head(self, x):
        return self.head(x.mean(dim=1))  # (B, N, C) -> token mean (B, C) -> (B, num_classes)

    def forward(self, x):
        return self.forward_head(self.forward_features(x))

    def position_grids(self, img_size):
        """{parameter name: (P, (h, w))}: every parameter that holds one vector per token of a grid
        (a position embedding), P leading vectors off the grid first, with the grid it has when the
        model is built for img_size. load_checkpoint resizes these from the grids a checkpoint was
        trained on to the model's; a family without any has none."""
        return {}

    def no_weight_decay(self):
        """relu_affine's A starts at the identity: decaying it would pull phi towards zero, not
        towards relu; the normalised-q ablation's gain (inline.NormalisedQ) is a temperature, which
        decay would pull towards uniform weights."""
        return {name for name, _ in self.named_parameters()
                if name.endswith(('phi.weight', 'normalise_q.gain'))}


# --------------------------------------------------------------------------------------------------
# InLine-DeiT: isotropic, patch 16, one class token that takes part in attention but not in Eq. 6

class InLineDeiT(Backbone):
    family = 'deit'

    def __init__(self, img_size=224, embed_dim=192, depth=12, num_heads=6, mlp_ratio=4.,
                 patch_size=16, num_classes=1000, drop_path_rate=0.1, layout='I', **attention):
        super().__init__()
        (letters,), (rates,) = self.setup(img_size, patch_size, layout, [depth], 'ILS',
                                          drop_path_rate, attention)
        self.patch_size = patch_size
        self.grid = (self.img_size[0] // patch_size, self.img_size[1] // patch_size)
        self.num_features = embed_dim
        self.cls_token = nn.Parameter(torch.zeros(1, 1, embed_dim))
        self.pos_embed = nn.Parameter(torch.zeros(1, 1 + self.grid[0] * self.grid[1], embed_dim))
        self.patch_embed = PatchEmbed(3, embed_dim, patch_size)
        self.blocks = nn.ModuleList([
            Block(embed_dim, mlp_ratio, dp, 1e-6,
                  # the class token
                  block_attention(c, embed_dim, num_heads, self.options, leading_tokens=1))
            for c, dp in zip(letters, rates)])
        self.norm = nn.LayerNorm(embed_dim, eps=1e-6)
        self.init_weights()
        trunc_normal_(self.pos_embed, std=.02)
        trunc_normal_(self.cls_token, std=.02)
        self.reset_classifier(num_classes)

    def forward_features(self, x):
        """(B, 3, *img_size) -> normalised tokens (B, 1 + h*w, C), class token first."""
        if tuple(x.shape[2:]) != self.img_size:
            check_image_size(x.shape[2:], self.patch_size, self.name)
            raise ValueError(f"InLine-DeiT built for {self.img_size[0]}x{self.img_size[1]} images "
                             f"got {x.shape[2]}x{x.shape[3]}: its position embedding fixes the "
                             f"size; build it with img_size=({x.shape[2]}, {x.shape[3]}) "
                             f"(checkpoints are resized on load)")
        x, grid = self.patch_embed(x)  # (B, h*w, C)
        x = torch.cat([self.cls_token.expand(x.shape[0], -1, -1), x], dim=1)  # (B, 1 + h*w, C)
        x = x + self.pos_embed
        for block in self.blocks:
            x = self.run_block(block, x, grid)
        return self.norm(x)

    def forward_head(self, x):
        return self.head(x[:, 0])  # the class token, (B, C) -> (B, num_classes)

    def position_grids(self, img_size):
        H, W = pair(img_size)  # the class token's vector first, then one per patch
        return {'pos_embed': (1, (H // self.patch_size, W // self.patch_size))}

    def no_weight_decay(self):
        return super().no_weight_decay() | {'pos_embed', 'cls_token'}


# --------------------------------------------------------------------------------------------------
# InLine-PVT: four stages of patch embedding + position embedding + InLine blocks, no spatial
# reduction

class InLinePVT(Backbone):
    """sr_ratios: the S blocks' spatial reduction per stage; la_sr_ratios: the F blocks' (FLatten's
    PVT_LA_SR_RATIOS, 1111 in every released model). unused_norm: the LayerNorm `norm` over the last
    stage that FLatten-PVT defines and never applies (its forward's call is commented out), kept so
    that their checkpoints load key for key; it takes no part in the forward."""
    family = 'pvt'

    def __init__(self, img_size=224, embed_dims=(64, 128, 320, 512), depths=(2, 2, 2, 2),
                 num_heads=(2, 4, 10, 16), mlp_ratios=(8, 8, 4, 4), sr_ratios=(8, 4, 2, 1),
                 num_classes=1000, drop_path_rate=0.1, layout='IIII', la_sr_ratios=(1, 1, 1, 1),
                 unused_norm=False, **attention):
        super().__init__()
        layout, rates = self.setup(img_size, 32, layout, depths, 'ILSFN', drop_path_rate, attention)
        self.num_features, self.grids = embed_dims[-1], stage_grids(self.img_size)
        # registered first, so the keys come in the released order
        for i, (h, w) in enumerate(self.grids):
            setattr(self, f'pos_embed{i + 1}', nn.Parameter(torch.zeros(1, h * w, embed_dims[i])))
        for i, dim in enumerate(embed_dims):
            in_chans, patch = (3, 4) if i == 0 else (embed_dims[i - 1], 2)
            setattr(self, f'patch_embed{i + 1}', PatchEmbed(in_chans, dim, patch, norm_eps=1e-5))
            setattr(self, f'block{i + 1}', nn.ModuleList([
                Block(dim, mlp_ratios[i], dp, 1e-6,
                      peers.make_peer(c, dim, num_heads[i], self.options, math.prod(self.grids[i]),
                                      separate_q=True, sr_ratio=la_sr_ratios[i])
                      if c in peers.LETTERS
                      else block_attention(c, dim, num_heads[i], self.options,
                                           sr_ratio=sr_ratios[i], separate_q=True))
                for c, dp in zip(layout[i], rates[i])]))
        if unused_norm:
            # frozen: it never gets a gradient, and DDP then needs no find_unused_parameters (the
            # authors' README trains FLatten-PVT with --find-unused-params)
            self.norm = nn.LayerNorm(embed_dims[-1], eps=1e-6).requires_grad_(False)
        self.init_weights()
        for i in range(4):
            trunc_normal_(getattr(self, f'pos_embed{i + 1}'), std=.02)
        self.reset_classifier(num_classes)

    def forward_features(self, x, return_stages=False):
        """(B, 3, H_img, W_img) -> stage-4 tokens (B, h*w, C), or the four maps [(B, C_i, h_i,
        w_i)]."""
        check_image_size(x.shape[2:], 32, self.name)
        stages = []
        for i in range(4):
            x, grid = getattr(self, f'patch_embed{i + 1}')(x)  # (B, h*w, C)
            pos_embed = getattr(self, f'pos_embed{i + 1}')
            if grid != self.grids[i]:  # another input size: resample as the released code does
                pos_embed = resize_grid(pos_embed, self.grids[i], grid, 'bilinear')
            x = x + pos_embed
            for block in getattr(self, f'block{i + 1}'):
                x = self.run_block(block, x, grid)
            stages.append(to_map(x, grid))
            x = stages[-1]  # (B, C, h, w), the next stage's image
        # no final norm in PVT
        return stages if return_stages else stages[-1].flatten(2).transpose(1, 2)

    def position_grids(self, img_size):
        """Each stage's position embedding on its grid; FLatten's positional_encoding on the keys,
        the grid reduced by the block's sr_ratio."""
        found = {}
        for i, (h, w) in enumerate(stage_grids(pair(img_size))):
            found[f'pos_embed{i + 1}'] = (0, (h, w))
            for j, block in enumerate(getattr(self, f'block{i + 1}')):
                if hasattr(block.attn, 'positional_encoding'):
                    r = block.attn.sr_ratio
                    found[f'block{i + 1}.{j}.attn.positional_encoding'] = (0, (h // r, w // r))
        return found

    # no_weight_decay: Backbone's alone. The released PVT decays its position embeddings: its model
    # (the authors' `models/inline_pvt.py`) exempts only a class token that InLine-PVT does not
    # have.


# --------------------------------------------------------------------------------------------------
# Windows, shared by Swin (square windows) and CSwin (stripes: full height or full width)

def to_windows(x, wh, ww):
    """(B, h, w, C) -> (B*nW, wh*ww, C), windows in row-major order."""
    B, h, w, C = x.shape
    x = x.view(B, h // wh, wh, w // ww, ww, C).transpose(2, 3)  # (B, h/wh, w/ww, wh, ww, C)
    return x.reshape(-1, wh * ww, C)


def from_windows(x, wh, ww, h, w):
    """(B*nW, wh*ww, C) -> (B, h, w, C), the inverse of to_windows."""
    C = x.shape[-1]
    x = x.view(-1, h // wh, w // ww, wh, ww, C).transpose(2, 3)  # (B, h/wh, wh, w/ww, ww, C)
    return x.reshape(-1, h, w, C)


def window_mask(h, w, wh, ww, sh, sw, device):
    """Additive mask (nW, wh*ww, wh*ww) for the (wh, ww) windows of an (h, w) map padded to whole
    windows and rolled by (-sh, -sw): -100 between two tokens that were not in the same region
    before the roll (Swin's mask) or where one is padding; None when nothing needs masking."""
    Hp, Wp = h + -h % wh, w + -w % ww
    if (sh, sw, Hp, Wp) == (0, 0, h, w):
        return None

    def regions(L, Lp, window, shift):
        i = torch.arange(Lp, device=device)
        label = ((i >= Lp - window).long() + (i >= Lp - shift).long() if shift
                 else torch.zeros_like(i))
        # Swin's three slices (0, 1, 2); True where it came from padding
        return label, (i + shift) % Lp >= L

    (lh, ph), (lw, pw) = regions(h, Hp, wh, sh), regions(w, Wp, ww, sw)
    # one id per region
    region = 3 * lh[:, None] + lw[None, :] + 9 * (ph[:, None] | pw[None, :])  # (Hp, Wp)
    region = to_windows(region[None, :, :, None], wh, ww).squeeze(-1)  # (nW, wh*ww)
    return (region[:, :, None] != region[:, None, :]).float() * -100.0  # (nW, wh*ww, wh*ww)


def masked_softmax_attention(q, k, v, scale, bias=None, mask=None):
    """softmax(s q k^T + bias + mask) v with F.scaled_dot_product_attention, as a user would run it.
    q, k, v (B*nW, H, N, D); bias (H, N, N); mask (nW, N, N)."""
    if mask is None:
        # (B*nW, H, N, D)
        return F.scaled_dot_product_attention(q, k, v, attn_mask=bias, scale=scale)
    nW = mask.shape[0]
    # one per window
    add = mask[:, None].to(q.dtype) + (0 if bias is None else bias)  # (nW, 1 or H, N, N)
    q, k, v = (t.unflatten(0, (-1, nW)) for t in (q, k, v))  # (B, nW, H, N, D)
    o = F.scaled_dot_product_attention(q, k, v, attn_mask=add, scale=scale)  # (B, nW, H, N, D)
    return o.flatten(0, 1)  # (B*nW, H, N, D)


# --------------------------------------------------------------------------------------------------
# InLine-Swin: hierarchical; I blocks attend over the whole stage, S blocks are Swin's shifted
# windows

def relative_position_index(wh, ww, window, device):
    """(wh*ww, wh*ww) indices into a ((2*window - 1)^2, H) table of biases by relative offset
    (dy, dx)."""
    y, x = torch.meshgrid(torch.arange(wh, device=device), torch.arange(ww, device=device),
                          indexing='ij')
    y, x = y.flatten(), x.flatten()  # (N,), N = wh*ww
    dy = y[:, None] - y[None, :] + window - 1  # (N, N), in [0, 2*window - 2]
    dx = x[:, None] - x[None, :] + window - 1
    return dy * (2 * window - 1) + dx


class WindowAttention(nn.Module):
    """Swin's softmax attention within a window plus a learned bias per relative offset and head."""

    def __init__(self, dim, num_heads, window, normalise_q=False):
        super().__init__()
        self.num_heads, self.window = num_heads, window
        # the normalised-q ablation (the paper's Table 1 question: does q's length matter?)
        self.normalise_q = inline.NormalisedQ(num_heads, dim // num_heads) if normalise_q else None
        self.relative_position_bias_table = nn.Parameter(torch.zeros((2 * window - 1) ** 2,
                                                                     num_heads))
        self.qkv = nn.Linear(dim, 3 * dim)
        self.proj = nn.Linear(dim, dim)
        trunc_normal_(self.relative_position_bias_table, std=.02)

    def forward(self, x, window, mask=None):
        """x (B*nW, wh*ww, C) in windows of shape `window` = (wh, ww); mask (nW, N, N) or None."""
        B_, N, C = x.shape
        # 3 x (B*nW, H, N, D)
        q, k, v = self.qkv(x).view(B_, N, 3, self.num_heads, -1).permute(2, 0, 3, 1, 4)
        q = q if self.normalise_q is None else self.normalise_q(q)
        index = relative_position_index(*window, self.window, x.device)  # (N, N)
        bias = self.relative_position_bias_table[index].permute(2, 0, 1)  # (H, N, N)
        scale = inline.attention_scale(q.shape[-1])
        o = masked_softmax_attention(q, k, v, scale, bias, mask)  # (B*nW, H, N, D)
        return self.proj(o.transpose(1, 2).reshape(B_, N, C))  # (B*nW, N, C)


class SwinBlock(nn.Module):
    """Pre-norm block: x + DropPath(attention(LN(x))), then x + DropPath(MLP(LN(x))); x (B, h*w, C).

    letter: 'S' Swin's softmax in windows with a relative position bias; 'I' InLine; 'L' vanilla
        linear; 'F', 'N' the peers (peers.make_peer), windowed and shifted as I (FLatten-Swin's
        window 56 covers stages 1 and 2: one window, no shift, as their `models/flatten_swin.py`
        has).
    window: the window side in tokens; for I/L, None is the whole map (every released model).
        Smaller I/L windows are the authors' window ablation (Table 4; their
        `models/inline_swin.py`): rolled as Swin's softmax blocks are, but with NO mask, so tokens
        wrapped across the border attend to each other; every window is its own InLine attention,
        with its own means, Eq. 6 weights and zero padding at the window's edges.
    shift: roll the map by window/2 first (odd blocks), along each axis the window does not cover.
    options: the attention options (attention_options) of an I, L, F or N block; ape_tokens: the
        authors' position embedding inside an I or L attention, one per window size (shared by the
        stage's windows), or None; tokens: an F block's window tokens (its positional_encoding's N).
    """

    def __init__(self, dim, num_heads, letter, window, shift, mlp_ratio, drop_path, options,
                 ape_tokens=None, tokens=None):
        super().__init__()
        self.letter, self.window, self.shift = letter, window, shift
        self.norm1 = nn.LayerNorm(dim)
        if letter == 'S':
            self.attn = WindowAttention(dim, num_heads, window, 'S' in options['normalise_q'])
        elif letter in peers.LETTERS:
            self.attn = peers.make_peer(letter, dim, num_heads, options, tokens)
        else:
            self.attn = inline.make_attention(dim, num_heads, ape_tokens=ape_tokens,
                                              **inline_options(letter, options))
        self.norm2 = nn.LayerNorm(dim)
        self.mlp = Mlp(dim, int(dim * mlp_ratio))
        self.drop_path = StochasticDepth(drop_path, 'row')

    def forward(self, x, grid):
        # InLine over the whole stage, as in every released model: no windows
        if self.window is None:
            y = self.attn(self.norm1(x), grid)  # Eq. 5 + Eq. 6, (B, h*w, C)
        else:
            y = self.windowed_attention(self.norm1(x), grid)  # (B, h*w, C)
        x = x + self.drop_path(y)
        return x + self.drop_path(self.mlp(self.norm2(x)))

    def windowed_attention(self, y, grid):
        """The attention in (wh, ww) windows of the normalised map y (B, h*w, C), Swin's cyclic
        shift first on odd blocks: softmax masked across the roll's seams, or every window its own
        InLine (or peer's) attention, unmasked (the authors' window ablation)."""
        B, N, C = y.shape
        h, w = grid
        wh, ww = min(self.window, h), min(self.window, w)  # never beyond the map
        # Swin's cyclic shift of odd blocks: half a window along each axis that the window does not
        # cover
        sh, sw = (self.window // 2 if self.shift and side < size else 0
                  for side, size in ((wh, h), (ww, w)))
        y = y.view(B, h, w, C)  # (B, h, w, C)
        if self.letter == 'S':
            # a map that does not tile is zero-padded after the norm, as Swin does for detection;
            # the padding is masked out
            y = F.pad(y, (0, 0, 0, -w % ww, 0, -h % wh))  # (B, Hp, Wp, C)
        elif h % wh or w % ww:
            raise ValueError(f"InLine-Swin: a {h}x{w} stage does not tile into {wh}x{ww} InLine "
                             f"windows, and padding would change Eq. 5's means; use window=None "
                             f"(the whole stage) or an image size that tiles")
        Hp, Wp = y.shape[1:3]
        # rolled, in windows: (B*nW, wh*ww, C)
        y = to_windows(torch.roll(y, (-sh, -sw), dims=(1, 2)), wh, ww)
        if self.letter == 'S':
            # softmax with the relative position bias, masked across the roll's seams
            y = self.attn(y, (wh, ww), window_mask(h, w, wh, ww, sh, sw, y.device))
        else:
            # every window its own InLine (or peer's) attention, unmasked (the authors' window
            # ablation)
            y = self.attn(y, (wh, ww))  # Eq. 5 + Eq. 6, (B*nW, wh*ww, C)
        # (B, h, w, C)
        y = torch.roll(from_windows(y, wh, ww, Hp, Wp), (sh, sw), dims=(1, 2))[:, :h, :w]
        return y.reshape(B, N, C)


class PatchMerging(nn.Module):
    """2x2 neighbours concatenated -> LayerNorm(4C) -> Linear 4C -> 2C: (B, h*w, C) ->
    (B, h*w/4, 2C)."""

    def __init__(self, dim):
        super().__init__()
        self.reduction = nn.Linear(4 * dim, 2 * dim, bias=False)
        self.norm = nn.LayerNorm(4 * dim)

    def forward(self, x, grid):
        B, N, C = x.shape
        x = x.view(B, *grid, C)  # (B, h, w, C)
        # Swin's order: (even row, even col), (odd, even), (even, odd), (odd, odd); the weights
        # depend on it
        x = torch.cat([x[:, 0::2, 0::2], x[:, 1::2, 0::2], x[:, 0::2, 1::2], x[:, 1::2, 1::2]],
                      dim=-1)  # (B, h/2, w/2, 4C)
        return self.reduction(self.norm(x.view(B, -1, 4 * C)))  # (B, h*w/4, 2C)


class SwinStage(nn.Module):
    """A stage's blocks, then patch merging (keys layers.i.blocks.j.*, layers.i.downsample.*)."""

    def __init__(self, blocks, downsample):
        super().__init__()
        self.blocks = nn.ModuleList(blocks)
        self.downsample = downsample


def authors_ape(options):
    """The authors' rule for the APE in their ablations: on exactly where Eq. 6 gives the attention
    no position of its own, with no residual or the plain one (a neighbourhood of the token alone);
    without Eq. 6 nothing else does (their answer in their repository's issue #6;
    paper/experiments.py). Their final models, with Eq. 6, have none."""
    return (inline.neighbourhood_size(options['eq6'], options['local_size']) or 1) == 1


class InLineSwin(Backbone):
    """InLine-Swin: patch 4, four stages joined by patch merging, final norm, token-mean head.

    img_size: int or (H, W), multiples of 32.
    embed_dim, depths, num_heads: stage 1's width (doubled at every stage), blocks and heads per
        stage.
    layout: one attention letter per stage (I, L, S, M<k>: module docstring).
    window: the InLine window side; None = the whole stage, as every released model (its window 56
        at 224 px, 96 at 384 px in `cfgs/inline_swin_*.yaml`, covers stage 1 and so every stage);
        smaller windows are the window ablation of Table 4 (SwinBlock).
    softmax_window: the S window; None: the authors' for the image size, 12 at 384 x 384 px as in
        their 384 px configs (Swin's too), else 7 as in their 224 px configs, kept at every other
        size. A checkpoint's relative position tables are resized to it (load_checkpoint).
    mlp_ratio, num_classes, drop_path_rate: MLP width over C, head outputs (0: none), final
        stochastic depth.
    ape: the authors' position embedding inside each InLine or linear attention; None: authors_ape's
        rule.
    **attention: the attention options (attention_options).
    """
    family = 'swin'

    def __init__(self, img_size=224, embed_dim=96, depths=(2, 2, 6, 2), num_heads=(3, 6, 12, 24),
                 layout='IIIS', window=None, softmax_window=None, mlp_ratio=4., num_classes=1000,
                 drop_path_rate=0.2, ape=None, **attention):
        super().__init__()
        layout, rates = self.setup(img_size, 32, layout, depths, 'ILSMFN', drop_path_rate,
                                   attention)
        self.ape = authors_ape(self.options) if ape is None else ape
        if window is not None and not (isinstance(window, int) and window >= 1):
            raise ValueError(f"InLine-Swin: window must be a whole number >= 1 or None (the whole "
                             f"stage), got {window!r}")
        self.window, self.num_features = window, embed_dim * 8
        if softmax_window is None:  # the authors' configs: 12 at 384 px, 7 at 224 px and elsewhere
            softmax_window = 12 if self.img_size == (384, 384) else 7
        self.patch_embed = PatchEmbed(3, embed_dim, 4, norm_eps=1e-5)
        self.layers = nn.ModuleList()
        for i, (letters, grid) in enumerate(zip(layout, stage_grids(self.img_size))):
            dim = embed_dim * 2 ** i
            inline_stage = any(c != 'S' for c in letters)
            if inline_stage and window is not None and any(side % min(window, side)
                                                           for side in grid):
                fits = [n for n in range(1, max(grid) + 1)
                        if all(side % min(n, side) == 0 for side in grid)]
                raise ValueError(f"InLine-Swin: InLine window {window} does not tile stage {i + 1} "
                                 f"({grid[0]}x{grid[1]} tokens at "
                                 f"{self.img_size[0]}x{self.img_size[1]} px); windows that tile "
                                 f"it: {fits}, or None (the whole stage)")
            # APE's N, and F's (its positional_encoding)
            window_tokens = math.prod(grid if window is None
                                      else (min(window, side) for side in grid))
            blocks = [SwinBlock(dim, num_heads[i], c, softmax_window if c == 'S' else window,
                                j % 2 == 1, mlp_ratio, rates[i][j], self.options,
                                window_tokens if self.ape else None, window_tokens)
                      for j, c in enumerate(letters)]
            self.layers.append(SwinStage(blocks, PatchMerging(dim) if i < 3 else None))
        self.norm = nn.LayerNorm(self.num_features)
        self.init_weights()
        self.reset_classifier(num_classes)

    def forward_features(self, x, return_stages=False):
        """(B, 3, H_img, W_img) -> final normalised tokens (B, h*w, 8C), or the four stage outputs
        [(B, C_i, h_i, w_i)] before merging (without the final norm), for dense prediction."""
        check_image_size(x.shape[2:], 32, self.name)
        x, grid = self.patch_embed(x)  # (B, h*w, C)
        stages = []
        for layer in self.layers:
            for block in layer.blocks:
                x = self.run_block(block, x, grid)
            stages.append(to_map(x, grid))
            if layer.downsample is not None:
                x = layer.downsample(x, grid)  # (B, h*w/4, 2C)
                grid = (grid[0] // 2, grid[1] // 2)
        return stages if return_stages else self.norm(x)

    def position_grids(self, img_size):
        """The APE of an I or L block and FLatten's positional_encoding (F): one vector per token of
        a window, the block's window clipped to the stage, or the whole stage."""
        found = {}
        for i, grid in enumerate(stage_grids(pair(img_size))):
            for j, block in enumerate(self.layers[i].blocks):
                window = grid if block.window is None else tuple(min(block.window, s) for s in grid)
                for name in ('ape', 'positional_encoding'):
                    if getattr(block.attn, name, None) is not None:
                        found[f'layers.{i}.blocks.{j}.attn.{name}'] = (0, window)
        return found

    def no_weight_decay(self):
        return super().no_weight_decay() | {name for name, _ in self.named_parameters()
                                            if name.endswith('relative_position_bias_table')}


# --------------------------------------------------------------------------------------------------
# InLine-CSwin: cross-shaped windows; every branch adds LePE, a depthwise 3x3 conv of V

class StripeAttention(nn.Module):
    """One softmax branch of a CSwin block (key attns.i): attention within windows of the map, plus
    LePE (get_v, a depthwise 3x3 conv of v). axis None: one window over the whole map; 0: vertical
    stripes (full height, `stripe` wide); 1: horizontal stripes."""

    def __init__(self, dim, num_heads, stripe=None, axis=None):
        super().__init__()
        self.num_heads, self.stripe, self.axis = num_heads, stripe, axis
        self.get_v = nn.Conv2d(dim, dim, 3, padding=1, groups=dim)  # LePE

    def forward(self, q, k, v, x=None):
        """q, k, v (B, h, w, C) this branch's channels of the maps (x, the block input, unused).
        Returns (B, h*w, C)."""
        B, h, w, C = q.shape
        wh, ww = (h, w) if self.axis is None else (
            (h, min(self.stripe, w)) if self.axis == 0 else (min(self.stripe, h), w))
        # Stripes that do not tile the map are padded with zeros and the padding masked out (the
        # released sizes need none); the LePE conv sees zeros there, as at any window border.
        q, k, v = (F.pad(t, (0, 0, 0, -w % ww, 0, -h % wh)) for t in (q, k, v))  # (B, Hp, Wp, C)
        Hp, Wp = q.shape[1:3]
        v_windows = to_windows(v, wh, ww)  # (B*nW, wh*ww, C)
        q, k, v = (to_windows(t, wh, ww).unflatten(-1, (self.num_heads, -1)).transpose(1, 2)
                   for t in (q, k, v))  # (B*nW, H, N, D)
        lepe = self.get_v(v_windows.transpose(1, 2).unflatten(-1, (wh, ww)))  # (B*nW, C, wh, ww)
        # (B*nW, H, N, D)
        lepe = lepe.flatten(2).unflatten(1, (self.num_heads, -1)).transpose(-2, -1)
        mask = window_mask(h, w, wh, ww, 0, 0, q.device)
        o = masked_softmax_attention(q, k, v, inline.attention_scale(q.shape[-1]), mask=mask)
        o = (o + lepe).transpose(1, 2).flatten(2)  # (B*nW, N, C)
        return from_windows(o, wh, ww, Hp, Wp)[:, :h, :w].reshape(B, h * w, C)


class CSwinInLine(inline.InLineBase):
    """The InLine (or linear) branch of a CSwin block (key attns.0), over the whole map: CSwin's own
    steps around InLineBase.attend (phi, Eq. 6's weights, the core), plus LePE (get_v). Its Eq. 6
    weights come from the block input x, not the normalised one (CSwin's quirk, as released).
    attention 'linear': division in place of Eq. 5 (inline.linear_core); normalise_q: q of unit
    length times a learned gain (inline.NormalisedQ)."""

    def __init__(self, dim, num_heads, *, attention='inline', normalise_q=False,
                 allow_divergent=False, **options):
        if attention == 'linear':
            inline.check_linear_options(options.get('feature_map', 'identity'), allow_divergent,
                                        options.get('nonneg'))
        super().__init__(dim, num_heads, **options)
        self.attention = attention
        self.get_v = nn.Conv2d(dim, dim, 3, padding=1, groups=dim)  # LePE
        self.normalise_q = inline.NormalisedQ(num_heads, dim // num_heads) if normalise_q else None

    def core(self):
        return inline.linear_core if self.attention == 'linear' else inline.inline_core

    def forward(self, q, k, v, x):
        """q, k, v (B, h, w, C) this branch's channels of the maps; x (B, h*w, C) its channels of
        the block input, read only by Eq. 6's weights. Returns (B, h*w, C)."""
        B, h, w, C = q.shape
        # (B, H, D, N)
        lepe = self.get_v(v.permute(0, 3, 1, 2)).flatten(2).unflatten(1, (self.num_heads, -1))
        # (B, H, N, D)
        q, k, v = (t.reshape(B, h * w, self.num_heads, -1).transpose(1, 2) for t in (q, k, v))
        q = q if self.normalise_q is None else self.normalise_q(q)
        o = self.attend(q, k, v, x, (h, w))  # phi, Eq. 6's weights, Eq. 5 and Eq. 6: (B, H, N, D)
        return (o + lepe.transpose(-2, -1)).transpose(1, 2).reshape(B, h * w, C)

    def example_inputs(self, generator, batch=2):
        """A small call of forward, drawn from generator: what kernels.enable_fast checks on."""
        C = self.num_heads * self.head_dim
        q, k, v = (torch.randn(batch, 6, 7, C, generator=generator) for _ in range(3))
        return q, k, v, torch.randn(batch, 42, C, generator=generator)

    def weights(self, q, k):
        """The explicit N x N weights (B, H, N, N) for q, k (B, H, N, D) before phi."""
        q = q if self.normalise_q is None else self.normalise_q(q)
        q, k = self.phi(q), self.phi(k)
        if self.attention == 'linear':
            return inline.linear_attention_weights(q, k)
        return inline.inline_weights(q, k, self.scale, self.scale_by_count)


class CSwinBlock(nn.Module):
    """LN -> one qkv -> one branch over the whole map (InLine, or when a stripe covers the map) or
    two half-channel, half-head branches over vertical and horizontal stripes -> proj; then the MLP.

    letter: 'S' softmax in stripes with LePE; 'I' InLine or 'L' vanilla linear over the whole map,
        with LePE.
    stripe: the S stripe width in tokens; None (the last stage) or >= the map: one branch over the
        whole map.
    grid: the stage's (h, w), which decides between one branch and two.
    options: the attention options (attention_options) of an I or L block.
    """

    def __init__(self, dim, num_heads, letter, stripe, grid, mlp_ratio, drop_path, options):
        super().__init__()
        self.qkv = nn.Linear(dim, 3 * dim)
        self.norm1 = nn.LayerNorm(dim)
        self.proj = nn.Linear(dim, dim)
        if letter != 'S':
            self.attns = nn.ModuleList([CSwinInLine(dim, num_heads,
                                                    **inline_options(letter, options))])
        elif stripe is None or stripe >= max(grid):
            self.attns = nn.ModuleList([StripeAttention(dim, num_heads)])
        else:
            self.attns = nn.ModuleList([StripeAttention(dim // 2, num_heads // 2, stripe, axis)
                                        for axis in (0, 1)])
        self.mlp = Mlp(dim, int(dim * mlp_ratio))
        self.norm2 = nn.LayerNorm(dim)
        self.drop_path = StochasticDepth(drop_path, 'row')

    def forward(self, x, grid):
        B, N, C = x.shape
        # 3 x (B, h, w, C)
        q, k, v = (t.view(B, *grid, C) for t in self.qkv(self.norm1(x)).chunk(3, dim=-1))
        # each branch gets its share of the channels of q, k, v and the block input x
        n = len(self.attns)
        parts = zip(self.attns, q.chunk(n, -1), k.chunk(n, -1), v.chunk(n, -1), x.chunk(n, -1))
        o = torch.cat([attn(*p) for attn, *p in parts], dim=-1)  # (B, N, C)
        x = x + self.drop_path(self.proj(o))
        return x + self.drop_path(self.mlp(self.norm2(x)))


class ToTokens(nn.Module):
    def forward(self, x):
        return x.flatten(2).transpose(1, 2)  # (B, C, h, w) -> (B, h*w, C)


class MergeBlock(nn.Module):
    """3x3 stride-2 conv + LayerNorm between stages: (B, h*w, C) -> (B, h*w/4, 2C)."""

    def __init__(self, dim, dim_out):
        super().__init__()
        self.conv = nn.Conv2d(dim, dim_out, 3, stride=2, padding=1)
        self.norm = nn.LayerNorm(dim_out)

    def forward(self, x, grid):
        x = self.conv(to_map(x, grid))  # (B, 2C, h/2, w/2)
        return self.norm(x.flatten(2).transpose(1, 2)), tuple(x.shape[2:])  # (B, h*w/4, 2C)


class InLineCSwin(Backbone):
    """stripes: the S stripe width per stage (1, 2, 7, 7 at 224 px). The last stage is always one
    branch over the whole map, as in the released code; I stages always attend over the whole
    map."""
    family = 'cswin'

    def __init__(self, img_size=224, embed_dim=64, depths=(2, 4, 18, 1), num_heads=(2, 4, 8, 16),
                 layout='IISS', stripes=(1, 2, 7, 7), mlp_ratio=4., num_classes=1000,
                 drop_path_rate=0.2, **attention):

        super().__init__()
        layout, rates = self.setup(img_size, 32, layout, depths, 'ILSM', drop_path_rate, attention)
        self.num_features = embed_dim * 8
        self.stage1_conv_embed = nn.Sequential(nn.Conv2d(3, embed_dim, 7, stride=4, padding=2),
                                               ToTokens(), nn.LayerNorm(embed_dim))
        for i, (letters, grid) in enumerate(zip(layout, stage_grids(self.img_size))):
            dim, stripe = embed_dim * 2 ** i, stripes[i] if i < 3 else None
            setattr(self, f'stage{i + 1}', nn.ModuleList([
                CSwinBlock(dim, num_heads[i], c, stripe, grid, mlp_ratio, rates[i][j], self.options)
                for j, c in enumerate(letters)]))
            if i < 3:
                setattr(self, f'merge{i + 1}', MergeBlock(dim, 2 * dim))
        self.norm = nn.LayerNorm(self.num_features)
        self.init_weights()
        self.reset_classifier(num_classes)

    def forward_features(self, x, return_stages=False):
        """(B, 3, H_img, W_img) -> final normalised tokens (B, h*w, 8C), or the four stage outputs
        [(B, C_i, h_i, w_i)] before merging (without the final norm), for dense prediction."""
        check_image_size(x.shape[2:], 32, self.name)
        grid = (x.shape[2] // 4, x.shape[3] // 4)
        x = self.stage1_conv_embed(x)  # (B, h*w, C)
        stages = []
        for i in range(4):
            for block in getattr(self, f'stage{i + 1}'):
                x = self.run_block(block, x, grid)
            stages.append(to_map(x, grid))
            if i < 3:
                x, grid = getattr(self, f'merge{i + 1}')(x, grid)
        return stages if return_stages else self.norm(x)


# --------------------------------------------------------------------------------------------------
# Registry: each variant is only its sizes; keyword overrides win

SWIN_B = dict(embed_dim=128, depths=(2, 2, 18, 2), num_heads=(4, 8, 16, 32), layout='IIMS2',
              drop_path_rate=0.5)
CSWIN_B = dict(embed_dim=96, depths=(3, 6, 29, 2), num_heads=(4, 8, 16, 32), drop_path_rate=0.5)
# PVT's heads; la_sr_ratios 1111
FLATTEN_PVT = dict(num_heads=(1, 2, 5, 8), layout='FFFF', unused_norm=True)
# name: (its family's class, its sizes), the rest the class's defaults (the released -T or -S)
MODELS = {
    'inline_deit_t': (InLineDeiT, dict(img_size=224, embed_dim=192, num_heads=6)),
    'inline_deit_s': (InLineDeiT, dict(img_size=288, embed_dim=320, num_heads=10)),
    'inline_deit_b': (InLineDeiT, dict(img_size=448, embed_dim=384, num_heads=12)),
    'inline_pvt_t': (InLinePVT, dict(depths=(2, 2, 2, 2))),
    'inline_pvt_s': (InLinePVT, dict(depths=(3, 4, 6, 3))),
    'inline_pvt_m': (InLinePVT, dict(depths=(3, 4, 18, 3), drop_path_rate=0.3)),
    'inline_pvt_l': (InLinePVT, dict(depths=(3, 8, 27, 3), drop_path_rate=0.3)),
    'inline_swin_t': (InLineSwin, dict(depths=(2, 2, 6, 2), layout='IIIS', drop_path_rate=0.2)),
    'inline_swin_s': (InLineSwin, dict(depths=(2, 2, 18, 2), layout='IISS', drop_path_rate=0.3)),
    'inline_swin_b': (InLineSwin, SWIN_B),
    'inline_swin_b_384': (InLineSwin, dict(SWIN_B, img_size=384, softmax_window=12)),
    'inline_cswin_t': (InLineCSwin, dict(depths=(2, 4, 18, 1), drop_path_rate=0.2)),
    'inline_cswin_s': (InLineCSwin, dict(depths=(3, 6, 29, 2), drop_path_rate=0.4)),
    'inline_cswin_b': (InLineCSwin, CSWIN_B),
    'inline_cswin_b_384': (InLineCSwin, dict(CSWIN_B, img_size=384, stripes=(1, 2, 12, 12),
                                             drop_path_rate=0.7)),
    # the peers (peers.py), their authors' configs `cfgs/flatten_swin_t.yaml`,
    # `cfgs/flatten_pvt_{t,s}.yaml`
    'flatten_swin_t': (InLineSwin, dict(layout='FFSS', window=56)),
    'flatten_pvt_t': (InLinePVT, FLATTEN_PVT),
    'flatten_pvt_s': (InLinePVT, dict(FLATTEN_PVT, depths=(3, 4, 6, 3))),
    # OUR CONSTRUCTION, no released code: TransNormer's DiagAttention as Swin's window softmax in
    # stages 1-2, its NormAttention over the whole stage in 3-4; the rebuttal's "TransNormer 30M"
    # cannot be traced to it
    'transnormer_swin_t': (InLineSwin, dict(layout='SSNN')),
}


def released_img_size(name):
    """(H, W): the image size variant `name` is registered at, which its released weights were
    trained at (the authors' files record none: train.py gives this to load_checkpoint for them)."""
    cls, sizes = MODELS[name]
    return pair(sizes.get('img_size', inspect.signature(cls).parameters['img_size'].default))


def create_model(name, *, checkpoint=None, fast=None, finetune=False, **overrides):
    """Build a registered variant.

    name: one of MODELS (inline_<family>_<size>; the peers flatten_swin_t, flatten_pvt_t,
        flatten_pvt_s and transnormer_swin_t, our construction).
    checkpoint: weights to load (load_checkpoint: a path or what the file holds, each change said in
        a line). A train.py checkpoint builds the model it records (its arch); overrides other than
        img_size and drop_path_rate that differ from it are refused, naming the call that builds it.
    finetune: True to start a new head (other num_classes) from a checkpoint's weights, announced;
        without it, a head the checkpoint does not hold is refused, never random.
    fast: the switch of every InLine module (inline.FAST): None, the reference (inline.py);
        'compile', the fast core of kernels.py (torch.compile); 'triton', the Triton kernel
        (triton_core.py, CUDA only). Switched on by kernels.enable_fast, which first checks it
        against the reference; never a silent fallback.
    **overrides, kept in model.arch; each wins over the variant's own value:
        img_size: int or (H, W).
        num_classes: head outputs; 0 for none.
        drop_path_rate: stochastic depth of the last block.
        layout: one attention letter per stage (module docstring).
        feature_map, eq6, local_size, dilation, nonneg, normalise_q, allow_divergent: the
            attention options (attention_options).
        window, ape, softmax_window: InLine-Swin's (InLineSwin).
        any other argument of the family's class: its sizes (embed_dim, depths, num_heads, ...).
    The stage maps for detection and segmentation: dense.create_backbone.
    """
    if name not in MODELS:
        raise ValueError(f"unknown model {name!r}; choose one of {', '.join(MODELS)}")
    if fast not in inline.FAST:
        raise ValueError(f"fast={fast!r}: choose one of {list(inline.FAST)}"
                         + (" (fast=True is now fast='compile')" if fast is True else ''))
    if 'features_only' in overrides:
        raise ValueError("features_only is dense.create_backbone(name, out_indices=..., ...): the "
                         "stage maps for detection and segmentation")
    cls, sizes = MODELS[name]
    if checkpoint is not None:  # read once; a train.py file's record chooses the architecture
        path = os.fspath(checkpoint) if isinstance(checkpoint, (str, os.PathLike)) else IN_MEMORY
        checkpoint = read_file(checkpoint) if path != IN_MEMORY else checkpoint
        own = {k: p.default for k, p in inspect.signature(cls).parameters.items()} | sizes
        overrides = recorded_build(name, checkpoint, path, overrides, finetune, own)
    model = cls(**{**sizes, **overrides})
    model.arch = dict(overrides)
    if checkpoint is not None:
        # resized from the image size the file records, else (the authors' files) from the variant's
        # own
        load_checkpoint(model, checkpoint, img_size=released_img_size(name), finetune=finetune,
                        path=path)
    if fast is not None:
        import kernels  # torch.compile's machinery, loaded only where the fast path is asked for
        kernels.enable_fast(model, fast)
    return model


# --------------------------------------------------------------------------------------------------
# Cost, counted as the paper counts it (`python -m paper models` prints every variant's)

def count_macs(model, img_size=None):
    """Multiply-accumulates of one image: torch.utils.flop_counter's FLOPs / 2 (matmuls and convs;
    elementwise ops are not counted). Works on the meta device, so big models cost no memory."""
    H, W = pair(img_size or model.img_size)
    device = next(model.parameters()).device
    training = model.training
    model.eval()
    with torch.no_grad(), FlopCounterMode(display=False) as counter:
        model(torch.zeros(1, 3, H, W, device=device))
    model.train(training)
    return counter.get_total_flops() / 2

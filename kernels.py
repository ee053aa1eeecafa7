"""The fast InLine attention core: Eq. 5 + Eq. 6 as two compiled graphs with a closed-form backward.

Han et al., "Bridging the Divide: Reconsidering Softmax and Linear Attention", NeurIPS 2024,
arXiv 2412.06590. `inline_core_fast(q, k, v, r, grid, scale=None, size=3, dilation=1, causal=False,
scale_by_count=True)` takes the same arguments, layout and result as inline.inline_core, the reference it replaces;
`enable_fast(model)` swaps it into a model (models.create_model(name, fast=True) calls it) once it has run each of
the model's attention configurations on both paths and found the output and every gradient equal
(check_against_reference), so a change made in the reference that the fast core does not follow is refused when the
model is built. test_inline.py proves the two equal.

    python kernels.py --bench                 # the table: reference, fast, softmax SDPA, matmul floor
    python kernels.py --bench --json          # the same, one JSON object per case
    python kernels.py --choices --threads 1   # two design choices below, timed: D constant, the per-call switches
    python kernels.py --compile               # what the first use in a process costs (compiling, or the cache)
    python kernels.py --per-call              # one call's cost beside its work: 197 tokens, 7x7 windows, 56x56
    python kernels.py --causal-bench          # the causal core against causal softmax SDPA, 1k to 16k tokens
    (a whole-model training step, reference against fast core: python paper.py speed --model-step)

What it does, and why (RESULTS.md has the measurements, each under its command):
- One torch.compile'd graph for the forward and one for the backward, called from a
  torch.autograd.Function whose backward is written in closed form (the means' gradients vanish, so
  there is no centring term to differentiate). Saved for backward: q, the centred k and v that the
  forward writes anyway (in place of k and v, so no more memory), r, v_mean, the D x D covariance and the
  (T, N) neighbour table (T = k^2 neighbours of Eq. 6's k x k neighbourhood). B, H and N are symbolic: one
  graph per dtype, head dim and T serves every batch, head count, token grid and dilation; D is a
  constant, so the channel loops vectorise without remainder loops.
  Inside a torch.compile'd model the closed forms, forward and backward, are traced into the model's graph (run):
  inductor fuses them with the layers around them, no call pays the core's entry, and the model's graph does not
  break at each attention (RESULTS.md, "Whole models against softmax", has what it gains).
- Eq. 5 in centred-covariance form, as inline.py: k and v centred in fp32 before the GEMM, so no sum over
  tokens sees the means. Means and every other sum accumulate in fp32; bf16 GEMMs accumulate in fp32 and
  round once. In fp16 one operand of each sum over tokens is pre-scaled by N^-1/2 (sum_scale), so the
  GEMM outputs stay below fp16's 65504 where the reference's outputs overflow.
- Eq. 6 as T gathered multiply-adds along the token axis (nine for the paper's 3x3; a dilation only
  changes the precomputed neighbour indices and border masks), fused by inductor with v_mean and the
  GEMM output into one pass; the backward's transposed
  shift and the T sums for dr likewise. The released B*C-group convolution needs V transposed to
  channel planes and back; a zero-padded shift would need masked loads, where every gather reads in bounds.
- With no gradient asked (evaluation), a module calls infer_fast instead (InLineBase.attend): Eq. 6's weight
  predictor and the core's forward in one graph (infer_forward), which takes q, k, v as the projection leaves them.
  With DeiT's 197 tokens the predictor's small ops, the copies and a second call cost more than the core's work.
- Compiling: the first process on a node to need a graph compiles it while the others wait, then load it from
  the inductor cache (node_lock). A failed compile or cache load is retried in a private cache folder; only if
  that fails too does the core run its closed form eagerly, after one warning that names any broken cache file.

The causal core (causal=True, for sequences: inline.py's docstring) has the same design: a forward and a
backward graph (CausalCore), Eq. 5 over each prefix in chunks of CHUNK tokens (masked GEMMs within a chunk,
running D x D sums across chunks), with k and v less their first token so that the uncentred sums stay as
small as the spread; Eq. 6 as k gathers with one weight per token.

Notation as in inline.py: B batch, H heads, N tokens, D head dim, C = H*D, (h, w) the token grid,
P = N - h*w leading tokens off the grid (DeiT's class token).
"""
import argparse
import atexit
import contextlib
import copy
import fcntl
import functools
import hashlib
import json
import os
import re
import shutil
import statistics
import sys
import tempfile
import time
import warnings

import torch
import torch.fx.experimental._config
import torch.nn.functional as F
from torch._inductor.runtime.cache_dir_utils import cache_dir

import inline


# ---------------------------------------------------------------------------------------------------
# Eq. 6 on the token axis: neighbour t of grid token n sits at n + (dy - 1) * w + (dx - 1)

def neighbourhood(N, grid, device, size=inline.LOCAL_SIZE, dilation=1):
    """index (T, N) int64: token n's neighbour t, clamped into [0, N) so every read is in bounds;
    masks (T, N, 1) float: 1 where n is on the grid and its neighbour t is too, else 0 (Eq. 6's zero
    padding). T = size^2 neighbours of the size x size neighbourhood, row-major as inline.local_residual
    counts them, spread by dilation; size 1 is the token itself (the plain residual). Clamped indices and
    masks, rather than a zero-padded copy, keep every read in bounds. grid None: a 1-D sequence, T = size."""
    if grid is None:
        return sequence_neighbourhood(N, device, size, dilation)
    h, w = grid
    with torch.inference_mode(False):  # cached below: must stay usable by autograd after an eval pass
        n = torch.arange(N, device=device)
        g = n - (N - h * w)  # grid index; negative for the P leading tokens
        y, x = g.div(w, rounding_mode='floor'), g % w
        steps = [dilation * (i - size // 2) for i in range(size)]
        offsets = [(dy, dx) for dy in steps for dx in steps]  # row-major, as Eq. 6 counts t
        index = torch.stack([(n + dy * w + dx).clamp(0, N - 1) for dy, dx in offsets])  # (T, N)
        masks = torch.stack([(g >= 0) & (y + dy >= 0) & (y + dy < h) & (x + dx >= 0) & (x + dx < w)
                             for dy, dx in offsets])  # (T, N)
        return index, masks.float()[:, :, None]  # (T, N), (T, N, 1)


def sequence_neighbourhood(N, device, size=inline.LOCAL_SIZE, dilation=1, causal=False, flip=False):
    """neighbourhood's index and masks on a 1-D sequence, tap t at offset dilation * (t - (size - 1)) causal (the
    token and the size - 1 before it), else dilation * (t - size // 2), as inline.sequence_residual counts them;
    flip: the opposite offsets, the transposed shift of Eq. 6's backward."""
    with torch.inference_mode(False):
        n = torch.arange(N, device=device)
        offsets = [(-1 if flip else 1) * dilation * (t - (size - 1 if causal else size // 2)) for t in range(size)]
        index = torch.stack([(n + o).clamp(0, N - 1) for o in offsets])  # (T, N)
        masks = torch.stack([(n + o >= 0) & (n + o < N) for o in offsets])  # (T, N)
        return index, masks.float()[:, :, None]  # (T, N), (T, N, 1)


_cached_neighbourhood = functools.lru_cache(maxsize=32)(neighbourhood)
_cached_sequence_neighbourhood = functools.lru_cache(maxsize=32)(sequence_neighbourhood)


def neighbour_table(cached, *args):
    """A neighbour table from its per-shape cache; inside a torch.compile'd model built in the graph instead (a constant
    there), since dynamo would trace past the cache with a warning."""
    return cached.__wrapped__(*args) if torch.compiler.is_compiling() else cached(*args)


def neighbours(x, index, flip=False):
    """The T gathers x[:, :, index[t]] (B, H, N, D). flip=True gives the opposite offsets (the
    transposed shift, which Eq. 6's backward needs): offset T - 1 - t is minus offset t."""
    T = index.shape[0]
    return [x[:, :, index[T - 1 - t if flip else t]] for t in range(T)]


# ---------------------------------------------------------------------------------------------------
# The two halves, each compiled to one graph. taps (B, H, T, D) is r with neighbour t before channel
# (T = size^2 neighbours of Eq. 6).

def wide(x):
    """x in at least fp32: where sums and elementwise math happen."""
    return x.to(torch.promote_types(x.dtype, torch.float32))


def sum_scale(dtype, N):
    """The factor one operand of a GEMM summing over N tokens is scaled by before it is rounded to dtype.
    fp16 tops out at 65504, and N (k - k_mean)^T v or q^T dO can pass it where their means (what Eq. 5
    uses) are small: N^-1/2 keeps both the GEMM output and the scaled operand in range. bf16 has fp32's
    range and needs none."""
    return N ** -0.5 if dtype == torch.float16 else 1.0


def token_major(x):
    """x (B, H, N, D) stored token by token, as (B, N, H, D): the layout in which the module's
    o.transpose(1, 2).reshape(B, N, C) is a view, not a copy, and in which o's gradient comes back."""
    return x.transpose(1, 2).contiguous().transpose(1, 2)


def core_forward(q, k, v, taps, index, masks, scale, scale_by_count):
    """-> o (B, H, N, D) stored token-major, and for the backward (k - k_mean) and (v - v_mean) (B, H, N, D) as
    rounded to the input dtype (the GEMM's operands, computed anyway), v_mean (B, H, 1, D) and g N Cov (B, H, D, D),
    g Eq. 5's factor s/N (scale_by_count) or s (inline.eq5_gain)."""
    N, dtype = q.shape[2], q.dtype
    c = sum_scale(dtype, N)
    k_mean = wide(k).mean(2, keepdim=True)  # (B, H, 1, D)
    v_mean = wide(v).mean(2, keepdim=True)  # (B, H, 1, D)
    k_c = ((wide(k) - k_mean) * c).to(dtype)  # (B, H, N, D)
    v_c = (wide(v) - v_mean).to(dtype)  # (B, H, N, D), written by the same kernel as k_c
    # Cov = (1/N) (k - k_mean)^T (v - v_mean), both sides centred in fp32 and then rounded, as in
    # inline.py; g N / N is folded into the D x D matrix (inline.inline_weights and inline_attention say why).
    # No sum over tokens sees the means.
    gain = inline.eq5_gain(scale, N, scale_by_count)
    cov = (wide(k_c.transpose(-2, -1) @ v_c) * (gain / c)).to(dtype)  # (B, H, D, D)
    o = wide(q @ cov) + v_mean  # Eq. 5: g N q_i^T Cov + v_mean, (B, H, N, D)
    if taps is not None:
        for t, v_t in enumerate(neighbours(v, index)):
            o = o + wide(taps[:, :, t, None]) * masks[t] * wide(v_t)  # Eq. 6
    return token_major(o.to(dtype)), k_c, v_c, v_mean, cov


def core_backward(do, q, k_c, v_c, taps, index, masks, v_mean, cov, scale, scale_by_count):
    """-> the gradients of q, k, v (B, H, N, D) and of taps (B, H, T, D), given do = dLoss/do stored token-major."""
    N, dtype = q.shape[2], q.dtype
    c = sum_scale(dtype, N)
    dq = do @ cov.transpose(-2, -1)  # (B, H, N, D)
    q_s = (wide(q) * c).to(dtype) if c != 1.0 else q
    g = (wide(q_s.transpose(-2, -1) @ do) * (inline.eq5_gain(scale, N, scale_by_count) / c)).to(dtype)  # (B, H, D, D)
    # Cov = (1/N) (k - k_mean)^T (v - v_mean); the means' own gradients vanish because the centred
    # columns sum to zero, so dk = (v - v_mean) g^T and dv = (k - k_mean) g + mean_i do_i.
    dk = v_c @ g.transpose(-2, -1)  # (B, H, N, D)
    g_c = g if c == 1.0 else (wide(g) / c).to(dtype)  # k_c carries the forward's factor c
    dv = wide(k_c @ g_c) + wide(do).mean(2, keepdim=True)  # o += v_mean gives the mean, (B, H, N, D)
    dtaps = None
    if taps is not None:
        for t, do_t in enumerate(neighbours(do, index, flip=True)):  # Eq. 6 transposed
            dv = dv + wide(taps[:, :, t, None]) * masks[-1 - t] * wide(do_t)
        v = wide(v_c) + v_mean  # (B, H, N, D), never stored
        dtaps = torch.stack([(wide(do) * masks[t] * v_t).sum(2)
                           for t, v_t in enumerate(neighbours(v, index))], dim=2).to(taps.dtype)  # (B, H, T, D)
    return dq, dk, dv.to(dtype), dtaps


# ---------------------------------------------------------------------------------------------------
# The causal core, inline.inline_core(..., causal=True): Eq. 5 over each prefix in chunks (inline.inline_chunked),
# Eq. 6 over the last k tokens with one weight per token. The same design: two graphs, the backward in closed form.

CHUNK = 64  # tokens per chunk: the CHUNK x CHUNK products cost N CHUNK D per head, the running D x D sums N D^2 / CHUNK


def scan_dtype(dtype, scale_by_count=True):
    """The dtype of the scans' GEMM operands: the input's, but fp32 for fp16, whose 5-bit exponent cannot hold the
    1/i factors of long sequences nor the uncentred sums' cancellation (and whose GEMMs CPUs run slowly), and fp32
    under the printed factor s (not scale_by_count): without s/i the uncentred sums' bf16 rounding reaches the output
    i times larger, several times the reference's own error by 131 tokens
    (test_fast_causal_core_low_precision_within_twice_the_references)."""
    return torch.float32 if dtype == torch.float16 or not scale_by_count else dtype


def causal_scan(q, k, v, reverse=False):
    """sum_{j<=i} (q_i.k_j) v_j (reverse: j >= i) for every i, in fp32: within a chunk the masked products as
    GEMMs of scan_dtype (bf16's accumulate in fp32, then round once); across chunks the D x D sums of k v^T in
    fp32. q, k, v (B, H, N, D), N a multiple of CHUNK."""
    B, H, N, D = q.shape
    qc, kc, vc = (t.reshape(B, H, N // CHUNK, CHUNK, D) for t in (q, k, v))  # (B, H, N/L, L, D)
    chunk_kv = wide(kc.transpose(-2, -1) @ vc)  # (B, H, N/L, D, D)
    total = chunk_kv.cumsum(2)  # (B, H, N/L, D, D)
    # the later (earlier) chunks' sums; the earlier ones shifted, not subtracted, so no bit depends on a later token
    other = total[:, :, -1:] - total if reverse else F.pad(total[:, :, :-1], (0, 0, 0, 0, 1, 0))
    scores = qc @ kc.transpose(-2, -1)  # (B, H, N/L, L, L)
    scores = scores.triu() if reverse else scores.tril()
    return (wide(qc) @ other + wide(scores @ vc)).reshape(B, H, N, D)


def causal_forward(q, k, v, taps, index, masks, scale, scale_by_count):
    """-> o (B, H, N, D), and for the backward k and v less their first token (B, H, N, D), rounded to
    scan_dtype, and v's first token (B, H, 1, D). taps (B, H, T, N, D): Eq. 6's weights, one per token."""
    N, dtype, mm = q.shape[2], q.dtype, scan_dtype(q.dtype, scale_by_count)
    n = torch.arange(1, N + 1, device=q.device, dtype=torch.float32)[:, None]  # (N, 1): the count i
    # Cov_i and o_i do not change when a constant is taken from every k (or v); taking the first token's, which
    # every output may see, makes the uncentred sums of k v^T as small as the spread, not the means (inline.py:
    # inline_attention says what the means would cost), and keeps the GEMMs' operands small in bf16.
    v_first = wide(v[:, :, :1])  # (B, H, 1, D)
    k_s, v_s = (wide(k) - wide(k[:, :, :1])).to(mm), (wide(v) - v_first).to(mm)  # (B, H, N, D)
    k_mean, v_mean = wide(k_s).cumsum(2) / n, wide(v_s).cumsum(2) / n  # (B, H, N, D): prefix means, shifted
    a = inline.eq5_gain(scale, n, scale_by_count)  # (N, 1) or a number: Eq. 5's factor a_i, s/i or s
    o = a * causal_scan(q.to(mm), k_s, v_s) - a * n * (wide(q) * k_mean).sum(-1, keepdim=True) * v_mean
    o = o + v_mean + v_first  # Eq. 5 over the prefix: a_i i q_i^T Cov_i + v_mean_i
    if taps is not None:
        for t, v_t in enumerate(neighbours(v, index)):
            o = o + wide(taps[:, :, t]) * masks[t] * wide(v_t)  # Eq. 6 over the last k tokens
    return o.to(dtype), k_s, v_s, v_first


def causal_backward(do, q, k_s, v_s, v_first, taps, index, masks, index_t, masks_t, scale, scale_by_count):
    """-> the gradients of q, k, v (B, H, N, D) and of taps (B, H, T, N, D), given do = dLoss/do. With a_i Eq. 5's
    factor (s/i, or s where not scale_by_count) and c_i = a_i i (s, or s i),
    o_i = a_i sum_{j<=i} (q_i.k_j) v_j - c_i (q_i.k_mean_i) v_mean_i + v_mean_i: the sum's gradients are three more
    scans, the means' a reverse prefix sum."""
    N, dtype, mm = q.shape[2], q.dtype, scan_dtype(q.dtype, scale_by_count)
    n = torch.arange(1, N + 1, device=q.device, dtype=torch.float32)[:, None]  # (N, 1)
    k_mean, v_mean = wide(k_s).cumsum(2) / n, wide(v_s).cumsum(2) / n  # (B, H, N, D), recomputed
    g, q_w, do = wide(do), wide(q), do.to(mm)
    a = inline.eq5_gain(scale, n, scale_by_count)  # (N, 1) or a number: s/i or s
    c = a * n  # (N, 1): s, or s i
    qa = (q_w * a).to(mm)  # (B, H, N, D): a_i q_i
    gv = (g * v_mean).sum(-1, keepdim=True)  # (B, H, N, 1)
    dq = a * causal_scan(do, v_s, k_s) - c * gv * k_mean
    later = lambda x: x.flip(2).cumsum(2).flip(2)  # noqa: E731  sum over i >= j: how a prefix mean reaches token j
    dk = causal_scan(v_s, do, qa, reverse=True) + later(-c * gv * q_w / n)
    dv = causal_scan(k_s, qa, do, reverse=True) + later((1 - c * (q_w * k_mean).sum(-1, keepdim=True)) * g / n)
    dtaps = None
    if taps is not None:
        for t in range(taps.shape[2]):  # Eq. 6 transposed: token j feeds token j - offset_t with weight taps_t
            dv = dv + (wide(taps[:, :, t]) * g)[:, :, index_t[t]] * masks_t[t]
        v = wide(v_s) + v_first  # (B, H, N, D), never stored
        dtaps = torch.stack([g * masks[t] * v_t for t, v_t in enumerate(neighbours(v, index))], dim=2)
        dtaps = dtaps.to(taps.dtype)  # (B, H, T, N, D)
    return dq.to(dtype), dk.to(dtype), dv.to(dtype), dtaps


# ---------------------------------------------------------------------------------------------------
# Inference: Eq. 6's weights and the core in one graph (infer_fast). Where the tokens are few (DeiT's 197), the
# predictor's eight small ops, the copies of the module's strided q, k, v and the second call cost more than the core.

def infer_forward(q, k, v, x, w1, b1, w2, b2, index, masks, scale, scale_by_count, dtype):
    """inline.residual_weights then core_forward's o (B, H, N, D), token-major, in dtype: what InLineBase.attend
    computes after prepare, with no gradient. q, k, v (B, H, N, D) as the module's projection leaves them (strided,
    any float dtype); x (B, 1, N, C) the tokens Eq. 6's weights are predicted from; w1, b1, w2, b2 the predictor's
    two 1x1 grouped convolutions' weights and biases ((C, D, 1), (C,), (T*C, D, 1), (T*C,)), or None for no Eq. 6.
    residual_weights' matmuls, with W2's output channels reordered from T*c + t to neighbour-major (t, c), so the
    taps come out (B, H, T, D) with D contiguous: Eq. 6's pass then reads each neighbour's weights as a vector,
    where a transposed view of r is read one channel at a time (5x slower for DeiT-T's sizes). Same numbers."""
    B, H, N, D = q.shape
    # One contiguous copy each, fused with the cast: Eq. 6's gathers and the GEMMs then read a head's tokens in a row.
    # At DeiT-T's 197 tokens the copies cost nothing measurable; at 4,097 reading the projection's layout instead
    # cost about 5% of the model (RESULTS.md, "Whole models against softmax")
    q, k, v = q.to(dtype).contiguous(), k.to(dtype).contiguous(), v.to(dtype).contiguous()
    taps = None
    if w1 is not None:
        T = w2.shape[0] // (H * D)
        m = x.mean(dim=2).to(w1.dtype).reshape(B, H, D).transpose(0, 1)  # (H, B, D): each head's slice of the mean
        hidden = F.gelu(torch.baddbmm(b1.reshape(H, 1, D), m, w1.reshape(H, D, D).transpose(1, 2)))  # (H, B, D)
        w2 = w2.reshape(H, D, T, D).transpose(1, 2).reshape(H, T * D, D)  # rows (t, j), was (j, t): (H, T*D, D)
        b2 = b2.reshape(H, 1, D, T).transpose(2, 3).reshape(H, 1, T * D)
        r = torch.baddbmm(b2, hidden, w2.transpose(1, 2))  # (H, B, T*D): head g's neighbour t, channel j at t*D + j
        taps = r.reshape(H, B, T, D).transpose(0, 1).to(dtype)  # (B, H, T, D)
    return core_forward(q, k, v, taps, index, masks, scale, scale_by_count)[0]


COMPILED = {f.__name__: torch.compile(f) for f in (core_forward, core_backward, causal_forward, causal_backward,
                                                   infer_forward)}
_compile_error = []  # filled once if the compiler cannot run here


def compile_options():
    """torch.compile's symbolic-shape switches for our two graphs, scoped to the calls that may compile
    (they act only when dynamo compiles). Sizes that happen to be equal on one call (N == D, B == H)
    must not become one symbol; a size that changes must not turn symbolic by itself (we choose which
    are, in symbolic_sizes); and the graphs per dtype, head dim and option may pass dynamo's default
    limit of 8 in one process, where it would fall back to eager."""
    patches = [torch._dynamo.config.patch(automatic_dynamic_shapes=False, recompile_limit=64,
                                          fail_on_recompile_limit_hit=True)]
    if hasattr(torch.fx.experimental._config, 'use_duck_shape'):
        patches.append(torch.fx.experimental._config.patch(use_duck_shape=False))
    stack = contextlib.ExitStack()
    for patch in patches:
        stack.enter_context(patch)
    return stack


def symbolic_sizes(args, N):
    """B, H and N compile as symbols, so one graph serves every batch, head count and token grid: dims
    0 and 1 of each (B, H, ...) tensor and every other dim of size N but their last, D. D and the T neighbours
    stay constants, so the loops over channels, which D shapes, vectorise with no remainder loop."""
    for a in args:
        if isinstance(a, torch.Tensor):
            for d in range(a.dim()):
                if (a.dim() >= 4 and d < 2) or (a.shape[d] == N and not (a.dim() >= 4 and d == a.dim() - 1)):
                    torch._dynamo.maybe_mark_dynamic(a, d)


def signature(f, args):
    """A key for what dynamo's guards on f's graph check: the device, inference flag, grad mode, head dim D and
    B, H, N as 0, 1 or more (dynamo specialises 0 and 1) of args[0], whose sizes fix every other
    tensor's but the neighbour count T; each tensor's dtype and the index's T (its only 2-D tensor); the
    other arguments (scale, or None where Eq. 6 is off, and scale_by_count, which changes the graph); for the
    causal core also its chunk count N / CHUNK as 1 or more. Some guards no key can
    foresee: a torch-function mode in force (enable_fast's check steps outside them), or a size bound that inductor's
    choices put on a graph (N <= 4096 on the CPU: 1024 px DeiT has 4097 tokens). Failing under a known key, such a
    guard would make dynamo recompile without our switches, and past its recompile limit of 8 run the closed form
    eagerly, unwarned; run calls a known key's graph under the stance fail_on_recompile instead, and compiles another
    graph with the switches."""
    x = args[0]  # q, or do: (B, H, N, D)
    chunks = (min(x.shape[2] // CHUNK, 2),) if f.__name__.startswith('causal') else ()
    heads = (x.shape[1],) if f is infer_forward else ()  # its weights' shapes (C, D, 1) fix H
    return (f.__name__, x.device, x.is_inference(), torch.is_grad_enabled(), x.shape[3],
            *(min(s, 2) for s in x.shape[:3]), *chunks, *heads,
            *(a.dtype if isinstance(a, torch.Tensor) else a for a in args),
            *(a.shape[0] for a in args if isinstance(a, torch.Tensor) and a.dim() == 2))


_compiled_signatures = set()  # signatures that have a graph: their calls need no switches and no marks
COMPILE_ERRORS = (torch._dynamo.exc.BackendCompilerFailed, ImportError, OSError)


@contextlib.contextmanager
def node_lock(key):
    """Hold an exclusive lock on one file per graph in the inductor cache folder: the first process on a node
    to need the graph compiles it, the others wait and then load it from the cache, rather than all compiling
    the same graph at once (under torchrun every rank does, and the slowest paces them all). The lock goes
    with the file's descriptor, so a process that dies releases it."""
    name = hashlib.sha256(repr(key).encode()).hexdigest()[:24]
    path = os.path.join(cache_dir(), 'locks', f'inline-{name}.lock')
    os.makedirs(os.path.dirname(path), exist_ok=True)
    with open(path, 'a') as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)
        yield


def describe(error):
    """The error dynamo wraps, on one line: 'ImportError: .../c2x...main.so: file too short'."""
    error = getattr(error, 'inner_exception', None) or error.__cause__ or error
    return f"{type(error).__name__}: {(str(error).splitlines() or [''])[0]}"


def broken_file(error):
    """The cache file an error names, or None."""
    found = re.search(r"(/\S+?\.(?:so|py|cpp))\b", describe(error))
    return found and found.group(1)


def compile_and_call(f, args, key):
    """f(*args) through its compiled graph: from the inductor cache, under node_lock; if that fails, compiled
    once more in a private folder of this process. A cache file left broken (a .so cut short by a process
    that died while writing it) otherwise fails every later load of that graph on this machine."""
    symbolic_sizes(args, N=args[0].shape[2])  # args[0] is q, or do: (B, H, N, D)
    try:
        with node_lock(key), compile_options():
            return COMPILED[f.__name__](*args)
    except COMPILE_ERRORS as e:
        error = e
    private = tempfile.mkdtemp(prefix='inline-inductor-')
    atexit.register(shutil.rmtree, private, ignore_errors=True)
    try:
        from torch._inductor.utils import fresh_inductor_cache  # sets TORCHINDUCTOR_CACHE_DIR while it lasts
        with fresh_inductor_cache(dir=private, delete=False), compile_options():
            out = COMPILED[f.__name__](*args)
    except COMPILE_ERRORS as e:
        e.cache_error = error
        raise
    path = broken_file(error)
    warnings.warn(f"kernels.py: loading the compiled InLine core from the inductor cache failed ({describe(error)}); "
                  f"it compiled again in a private folder" + (f". Delete {path}: it is broken, and until it is gone "
                  f"every process compiles this graph again" if path else ""), stacklevel=4)
    return out


def run(f, *args):
    """The compiled f, or, if this machine cannot compile, the same closed form eagerly after one warning."""
    args = [a.detach() if isinstance(a, torch.Tensor) else a for a in args]  # autograd is ours, not f's
    if torch.compiler.is_compiling():  # inside a torch.compile'd model: f is traced into the model's graph
        return f(*args)
    if not _compile_error:
        key = signature(f, args)
        try:
            if key in _compiled_signatures:  # the switches and marks act only when dynamo compiles: skipping them
                try:  # saves time on every call. A guard failing here would recompile without them, so it may not
                    with torch.compiler.set_stance('fail_on_recompile'):  # (signature's docstring):
                        return COMPILED[f.__name__](*args)
                except RuntimeError as e:
                    if 'Detected recompile' not in str(e):
                        raise
            out = compile_and_call(f, args, key)  # a new graph, or another for a key whose guard failed
            _compiled_signatures.add(key)
            return out
        except COMPILE_ERRORS as e:  # e.g. no working C++ compiler: the private folder failed too
            _compile_error.append(e)
            path = broken_file(getattr(e, 'cache_error', e))
            warnings.warn(f"kernels.py: torch.compile failed ({describe(e)}); the fast InLine core now runs its "
                          f"closed form eagerly, correct but much slower" + (f". {path} in the inductor cache may "
                          f"be broken: delete it and rerun" if path else ""), stacklevel=3)
    return f(*args)


def forward_graph(q, k, v, r, grid, scale, size, dilation, scale_by_count):
    """core_forward run on inline_core's arguments: o (B, H, N, D), stored token-major, and what the backward keeps."""
    B, H, N, D = q.shape
    # One memory layout for every caller, so one compiled graph serves them all; the matmuls would
    # need these copies of a model's strided q, k, v views anyway.
    q, k, v = q.contiguous(), k.contiguous(), v.contiguous()
    index = masks = None
    if r is not None:  # built once per shape; traced into a compiled model's graph, a constant there
        index, masks = neighbour_table(_cached_neighbourhood, N, grid, q.device, size, dilation)
    taps = r.reshape(B, H, D, -1).transpose(-2, -1).contiguous() if r is not None else None  # (B, H, T, D)
    o, k_c, v_c, v_mean, cov = run(core_forward, q, k, v, taps, index, masks, scale, scale_by_count)
    return o, (q, k_c, v_c, taps, index, masks, v_mean, cov)


class InLineCore(torch.autograd.Function):
    @staticmethod
    def forward(ctx, q, k, v, r, grid, scale, size, dilation, scale_by_count):
        o, saved = forward_graph(q, k, v, r, grid, scale, size, dilation, scale_by_count)
        ctx.save_for_backward(*saved)
        ctx.scale, ctx.scale_by_count = scale, scale_by_count
        return o

    @staticmethod
    def backward(ctx, do):
        q, k_c, v_c, taps, index, masks, v_mean, cov = ctx.saved_tensors
        B, H, N, D = q.shape
        with torch.autocast(q.device.type, enabled=False):  # do as o was stored: a copy only if it comes otherwise
            dq, dk, dv, dtaps = run(core_backward, token_major(do), q, k_c, v_c, taps, index, masks, v_mean, cov,
                                    ctx.scale, ctx.scale_by_count)
        dr = dtaps.transpose(-2, -1).reshape(B, -1) if dtaps is not None else None  # (B, T*C)
        return dq, dk, dv, dr, None, None, None, None, None


class CausalCore(torch.autograd.Function):
    @staticmethod
    def forward(ctx, q, k, v, r, scale, size, dilation, scale_by_count):
        B, H, N, D = q.shape
        M = N + -N % CHUNK  # whole chunks: zero tokens at the end, which no earlier output sees
        q, k, v = (F.pad(t, (0, 0, 0, M - N)).contiguous() for t in (q, k, v))  # (B, H, M, D)
        taps = index = masks = index_t = masks_t = None
        if r is not None:
            index, masks = neighbour_table(_cached_sequence_neighbourhood, M, q.device, size, dilation, True)
            index_t, masks_t = neighbour_table(_cached_sequence_neighbourhood, M, q.device, size, dilation, True, True)
            taps = F.pad(r, (0, 0, 0, M - N)).reshape(B, M, H, D, size)  # (B, M, H, D, T): r's channel T*c + t
            taps = taps.permute(0, 2, 4, 1, 3).contiguous()  # (B, H, T, M, D)
        o, k_s, v_s, v_first = run(causal_forward, q, k, v, taps, index, masks, scale, scale_by_count)
        ctx.save_for_backward(q, k_s, v_s, v_first, taps, index, masks, index_t, masks_t)
        ctx.scale, ctx.scale_by_count = scale, scale_by_count
        return o[:, :, :N]

    @staticmethod
    def backward(ctx, do):
        q, k_s, v_s, v_first, taps, index, masks, index_t, masks_t = ctx.saved_tensors
        B, H, M, D = q.shape
        N = do.shape[2]
        with torch.autocast(q.device.type, enabled=False):
            dq, dk, dv, dtaps = run(causal_backward, F.pad(do, (0, 0, 0, M - N)).contiguous(), q, k_s, v_s, v_first,
                                    taps, index, masks, index_t, masks_t, ctx.scale, ctx.scale_by_count)
        dr = dtaps.permute(0, 3, 1, 4, 2).reshape(B, M, -1)[:, :N] if dtaps is not None else None  # (B, N, T*C)
        return dq[:, :, :N], dk[:, :, :N], dv[:, :, :N], dr, None, None, None, None


def inline_core_fast(q, k, v, r, grid, scale=None, size=inline.LOCAL_SIZE, dilation=1, causal=False,
                     scale_by_count=True):
    """Eq. 5 over all N tokens, then Eq. 6 on the last h*w: the same arguments, layout and result as
    inline.inline_core. q, k, v (B, H, N, D) through phi; r (B, T*C) with T = size^2 neighbour weights per
    channel, or None; grid = (h, w); size and dilation of Eq. 6's neighbourhood. grid None: a 1-D sequence,
    T = size; causal: Eq. 5 over each prefix and Eq. 6 over the last k tokens (CausalCore), r (B, N, T*C).
    scale_by_count: Eq. 5's factor s/N (s/i on a prefix), else s (inline.eq5_gain); a Python bool, part of the
    compiled graphs' signature. scale: None (D^-1/2), a number, or a tensor that broadcasts against (B, H, N, 1).
    Under autocast the inputs are cast to the autocast dtype, as the reference's matmuls would be. Inside a
    torch.compile'd model it is traced into the model's graph (run)."""
    B, H, N, D = q.shape
    if causal and grid is not None:
        raise ValueError("causal attention runs over a 1-D sequence: grid must be None")
    if grid is not None:
        inline.check_grid(N, grid)
        if r is not None and r.shape != (B, size * size * H * D):
            raise ValueError(f"r must hold {size}x{size} neighbour weights per channel, (B, {size * size}C) = "
                             f"{(B, size * size * H * D)}, got {tuple(r.shape)}; the fast core has no other Eq. 6 "
                             f"weights on a grid (inline.local_residual also takes them per token)")
    elif r is not None and r.shape != ((B, N, size * H * D) if causal else (B, size * H * D)):
        raise ValueError(f"r must hold {size} neighbour weights per channel{' and token' if causal else ''}, "
                         f"{'(B, N, kC)' if causal else '(B, kC)'}, got {tuple(r.shape)} for v of {tuple(v.shape)}")
    q, scale = fold_scale(q, scale)
    device = q.device.type
    if torch.is_autocast_enabled(device):
        dtype = torch.get_autocast_dtype(device)
        q, k, v, r = (t.to(dtype) if t is not None else None for t in (q, k, v, r))
    with torch.autocast(device, enabled=False):
        if causal:
            return CausalCore.apply(q, k, v, r, scale, size, dilation, bool(scale_by_count))
        grid, scale_by_count = None if grid is None else tuple(grid), bool(scale_by_count)
        if torch.is_grad_enabled() and any(t is not None and t.requires_grad for t in (q, k, v, r)):
            return InLineCore.apply(q, k, v, r, grid, scale, size, dilation, scale_by_count)
        return forward_graph(q, k, v, r, grid, scale, size, dilation, scale_by_count)[0]  # no gradient: no Function


def fold_scale(q, scale):
    """q and Eq. 5's s as the compiled graphs take them: s a number (None: D^-1/2), or a tensor that broadcasts
    against (B, H, N, 1), a learnable temperature say, which joins q outside the graphs, s q^T Cov = (s q)^T Cov over
    each prefix too, so that autograd takes its gradient."""
    if isinstance(scale, torch.Tensor):
        return q * scale, 1.0
    return q, inline.attention_scale(q.shape[-1]) if scale is None else scale


def infer_fast(module, q, k, v, x, grid, scale):
    """What InLineBase.attend computes after prepare, Eq. 6's weights (inline.residual_weights) and the core
    (inline_core_fast), for a call with no gradient: one compiled graph (infer_forward). Same arguments as
    module.infer, which enable_fast sets to it on every InLine module but the causal ones, once check_against_reference
    has found the module's output on it equal to the reference's."""
    N = q.shape[2]
    q, scale = fold_scale(q, scale)
    device = q.device.type
    autocast = torch.is_autocast_enabled(device)
    dtype = torch.get_autocast_dtype(device) if autocast else q.dtype
    weights, index, masks = [None] * 4, None, None
    if module.residual is not None:
        conv1, _, conv2 = module.residual
        weights = [conv1.weight, conv1.bias, conv2.weight, conv2.bias]
        index, masks = neighbour_table(_cached_neighbourhood, N, None if grid is None else tuple(grid), q.device,
                                       module.local_size, module.dilation)
    # The graph casts to dtype itself; entered only where needed, since a graph called inside the context costs more
    with torch.autocast(device, enabled=False) if autocast else contextlib.nullcontext():
        return run(infer_forward, q, k, v, x[:, None], *weights, index, masks, scale, module.scale_by_count, dtype)


def unsupported(module):
    """What of an InLine module's options (inline.InLineBase) the fast core does not cover, or None. It covers every
    option of InLine attention (kernel, residual, local_size, dilation, nonneg, APE: they change its inputs or its
    neighbour table; causal and sequence: CausalCore and the 1-D table), but not vanilla linear attention, which
    divides where Eq. 5 subtracts."""
    return "attention='linear' (layout letter L, vanilla linear attention)" if module.attention == 'linear' else None


def configuration(module):
    """What decides an InLine module's computation besides its weights: its class, its plain attributes (options,
    head count and dim, leading tokens, and any a change in code adds) and its parameters' names. Modules alike in
    these run the same code, so one check serves them all."""
    plain = (bool, int, float, str, tuple, type(None))
    attributes = sorted((k, v) for k, v in vars(module).items() if isinstance(v, plain) and k != 'training')
    return type(module), tuple(attributes), tuple(name for name, _ in module.named_parameters())


def check_inputs(module, device, generator):
    """A small random call of module.attend: q, k, v (2, H, N, D) and x (2, N, C) in fp32, and its grid: a 6x7 grid
    after the module's leading tokens, or a 1-D sequence of 130 tokens (three chunks of the causal core)."""
    H, D = module.num_heads, module.head_dim
    grid = None if module.sequence else (6, 7)
    N = 2 * CHUNK + 2 if module.sequence else module.leading_tokens + 42
    q, k, v = (torch.randn(2, H, N, D, generator=generator, device='cpu').to(device) for _ in range(3))
    return q, k, v, torch.randn(2, N, H * D, generator=generator, device='cpu').to(device), grid


def attend_and_differentiate(module, inputs, do):
    """module.attend's output and the gradients of every input and parameter, for upstream gradient do:
    {quantity: tensor, or None where nothing reaches it}."""
    inputs = [t.detach().to(do.dtype).requires_grad_() for t in inputs[:4]] + [inputs[4]]
    o = module.attend(*inputs)
    params = dict(module.named_parameters())
    grads = torch.autograd.grad(o, inputs[:4] + list(params.values()), do.to(o.dtype), allow_unused=True)
    return dict(zip(['output', 'gradient of q', 'gradient of k', 'gradient of v', 'gradient of x'] +
                    [f'gradient of {name}' for name in params], [o, *grads]))


def difference(exact, reference, fast):
    """Why fast is not the reference's number, or None. exact: the reference in float64; reference: in fp32. The
    fast core may err by twice the fp32 reference's own error, plus 1e-5 of the quantity's largest value (summation
    order; a wrong formula or a lost gradient is off by far more). None (no gradient reaches it) counts as 0."""
    if exact is None and fast is None:
        return None
    size = (exact if exact is not None else fast).abs().max().item()
    if fast is None or exact is None:
        return None if size == 0 else f"reference {'none' if exact is None else f'{size:.1e}'}, fast " \
                                      f"{'none' if fast is None else f'{size:.1e}'}"
    error, own = (fast.double() - exact).abs().max().item(), (reference.double() - exact).abs().max().item()
    bound = 2 * own + 1e-5 * size
    if not error <= bound:  # also NaN
        return (f"max |fast - float64 reference| {error:.1e}, beyond {bound:.1e} (twice the fp32 reference's own "
                f"error {own:.1e}, plus 1e-5 of its largest value {size:.1e})")
    return None


@contextlib.contextmanager
def outside_function_modes():
    """Run without the torch-function modes in force, such as the `with torch.device('meta')` a model may be built
    under: a graph compiled under a mode is guarded on it, and every later call without it would compile again."""
    modes = [torch._C._pop_torch_function_stack() for _ in range(torch._C._len_torch_function_stack())]
    try:
        yield
    finally:
        for mode in reversed(modes):
            torch._C._push_on_torch_function_stack(mode)


def check_against_reference(path, module, core, device, infer=None):
    """Raise ValueError unless core, put in module's place of inline.inline_core, gives module.attend the output and
    the gradients of q, k, v, x and every parameter of the reference path (on check_inputs, against the reference in
    float64, with difference's tolerance), and infer (infer_fast, or None), put in module.infer, the same output with
    no gradient. Copies of the module run it, so the model and the global random state
    are untouched; a module on the meta device is checked with random weights."""
    with outside_function_modes():
        generator = torch.Generator().manual_seed(0)
        reference = copy.deepcopy(module)
        if any(p.is_meta for p in reference.parameters()):
            reference.to_empty(device=device)
            with torch.no_grad():
                for p in reference.parameters():
                    p.copy_(0.1 * torch.randn(p.shape, generator=generator, device='cpu'))
            for b in reference.buffers():
                b.zero_()
        reference = reference.to(device).float()
        reference.core, reference.infer = inline.inline_core, None
        fast = copy.deepcopy(reference)
        fast.core, fast.infer = core, infer
        inputs = check_inputs(reference, device, generator)
        do = torch.randn(inputs[0].shape, generator=generator, device='cpu').to(device)
        where = f"{path or 'the model'} ({type(module).__name__})"
        with torch.random.fork_rng(devices=[device] if device.type == 'cuda' else []), torch.enable_grad(), \
                torch.autocast(device.type, enabled=False):
            exact = attend_and_differentiate(copy.deepcopy(reference).double(), inputs, do.double())
            ours = attend_and_differentiate(reference, inputs, do)
            try:
                theirs = attend_and_differentiate(fast, inputs, do)
                if infer is not None:
                    with torch.no_grad():
                        theirs['output with no gradient'] = fast.attend(*inputs)
                    exact['output with no gradient'], ours['output with no gradient'] = exact['output'], ours['output']
            except Exception as e:  # whatever the fast core cannot take: refused here, not at the first step
                theirs = f"the fast core raised {type(e).__name__}: {(str(e).splitlines() or [''])[0]}"
        why = theirs if isinstance(theirs, str) else next(
            (f"{name}: {d}" for name in exact if (d := difference(exact[name], ours[name], theirs[name]))), None)
        if why:
            name = why.split(':')[0].replace('gradient of ', '')
            if name in dict(module.named_parameters()) and path:  # name the parameter by its path in the model
                why = why.replace(f'gradient of {name}', f'gradient of {path}.{name}', 1)
            raise ValueError(f"the fast InLine core does not compute what {where} computes on the reference path: "
                             f"{why}. Build the model with fast=False (train.py: --attention-impl reference), or make "
                             f"the change in a form the fast core follows (README, \"Changing the method\")")


def enable_fast(model, core=inline_core_fast, device=None, log=print):
    """Set `.core = core` (the fast one) on every InLine module of model whose core is the reference, and with the fast
    one `.infer = infer_fast` (Eq. 6's weights and the core in one graph, for calls with no gradient) on those that are
    not causal; returns how many. First every module is checked, so a model is fast throughout or refused when it is
    built, never half fast: an option the fast core lacks (unsupported) is refused by name; then one module of each
    configuration is run on both paths (check_against_reference), so a change made in code that the fast core does
    not follow (a scale without its gradient, Eq. 6 weights of another shape) is refused too, naming the module and
    the quantity that differs. device: where the check runs (default: the model's; the meta device's on the CPU);
    log: how each configuration's check reports its cost (None: silent)."""
    modules = [(path, m) for path, m in model.named_modules() if hasattr(m, 'core')]  # each setup_inline gave one
    lacking = sorted({unsupported(m) for _, m in modules} - {None})
    if lacking:
        raise ValueError(f"the fast InLine core has no {', '.join(lacking)}: build this model with fast=False "
                         f"(train.py: --attention-impl reference)")
    swapped = [(path, m) for path, m in modules if m.core is inline.inline_core]
    if device is None:
        device = next((p.device for p in model.parameters() if not p.is_meta), torch.device('cpu'))
    configurations = {}  # configuration: the modules that have it
    for path, m in swapped:
        configurations.setdefault(configuration(m), []).append((path, m))
    for alike in configurations.values():
        (path, m), start = alike[0], time.perf_counter()
        check_against_reference(path, m, core, torch.device(device), infer_for(m, core))
        if log:
            log(f"kernels.enable_fast: {path or type(m).__name__} ({type(m).__name__}, H {m.num_heads}, "
                f"D {m.head_dim}{', causal' if m.causal else ''}; {len(alike)} module(s) of this configuration) "
                f"equals the reference: {time.perf_counter() - start:.1f} s")
    for _, m in swapped:
        m.core, m.infer = core, infer_for(m, core)
    return len(swapped)


def infer_for(module, core):
    """The inference graph enable_fast puts on module with core: infer_fast with the fast core (the causal core has
    none: its Eq. 6 weights come per token), else None, so that another core (a test's, paper.py's) runs every call."""
    return infer_fast if core is inline_core_fast and not module.causal else None


# ---------------------------------------------------------------------------------------------------
# python kernels.py --bench: median times in one interleaved run, so load from other processes hits all;
# speed-ups are medians of per-round ratios

CASES = {  # name: (batch, heads, grid side, head dim); the InLine stages of InLine-Swin-T, then stage 1 larger
    'swin_t_stage1': (8, 3, 56, 32), 'swin_t_stage2': (8, 6, 28, 32), 'swin_t_stage3': (8, 12, 14, 32),
    'stage1_448px': (2, 3, 112, 32), 'stage1_896px': (1, 3, 224, 32), 'stage1_1024px': (1, 3, 256, 32),
}


def _sync(device):
    if device.type == 'cuda':
        torch.cuda.synchronize()


def time_interleaved(fns, device, budget_s=3.0, max_rounds=25, warm_up=True):
    """{name: [ms per round]}: every round calls each fn once; as many rounds as the slowest fn's budget allows.
    warm_up=False: a first call longer than the budget is its own timing (softmax at 65k tokens)."""
    first = {}
    for name, fn in fns.items():
        for _ in range(2):
            start = time.perf_counter()
            fn(), _sync(device)  # the first call compiles
            first[name] = time.perf_counter() - start
            if not warm_up and first[name] > budget_s:
                break
    rounds = max(1, min(max_rounds, int(budget_s / max(first.values()))))
    times = {name: [] for name in fns}
    for _ in range(rounds - 1):
        for name, fn in fns.items():
            start = time.perf_counter()
            fn(), _sync(device)
            times[name].append(time.perf_counter() - start)
    return {name: [1e3 * t for t in [first[name]] + times[name]] for name in fns}


def paired_ratio(ms, a, b):
    """The median over rounds of a's time / b's. Each round times the two back to back, so a drift in the
    machine's speed (other jobs on a shared machine) cancels, where it would skew a ratio of two medians."""
    return statistics.median(x / y for x, y in zip(ms[a], ms[b]))


def peak_mb(fn, device):
    """Memory fn allocates at its peak, beyond what was allocated before it ran."""
    if device.type == 'cuda':
        torch.cuda.synchronize()
        base = torch.cuda.memory_allocated()
        torch.cuda.reset_peak_memory_stats()
        fn(), torch.cuda.synchronize()
        return (torch.cuda.max_memory_allocated() - base) / 2**20
    with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CPU], profile_memory=True) as prof:
        fn()
    running = peak = 0
    for event in sorted(prof.events(), key=lambda e: e.time_range.start):
        running += event.self_cpu_memory_usage
        peak = max(peak, running)
    return peak / 2**20


def bench_case(name, dtype, device):
    B, H, side, D = CASES[name]
    N = side * side
    gen = torch.Generator(device).manual_seed(0)
    q, k, v, do = (torch.randn(B, H, N, D, generator=gen, device=device, dtype=dtype) for _ in range(4))
    r = 0.1 * torch.randn(B, 9 * H * D, generator=gen, device=device, dtype=dtype)
    C = torch.randn(B, H, D, D, generator=gen, device=device, dtype=dtype)
    inputs = [t.requires_grad_() for t in (q, k, v, r)]

    def fwd(core):
        with torch.no_grad():
            core(q, k, v, r, (side, side))

    def fwdbwd(core):
        torch.autograd.grad(core(q, k, v, r, (side, side)), inputs, do, allow_unused=core is sdpa)

    def sdpa(q, k, v, r, grid):
        return F.scaled_dot_product_attention(q, k, v)

    def floor():  # the six GEMMs of the linear form: K^T V and Q C forward; dQ, dC, dK, dV backward
        q_, k_, v_ = q.detach(), k.detach(), v.detach()
        k_.mT @ v_, q_ @ C, do @ C.mT, q_.mT @ do, v_ @ C.mT, k_ @ C

    ms = time_interleaved({
        'reference_fwd_ms': lambda: fwd(inline.inline_core), 'fast_fwd_ms': lambda: fwd(inline_core_fast),
        'reference_fwdbwd_ms': lambda: fwdbwd(inline.inline_core), 'fast_fwdbwd_ms': lambda: fwdbwd(inline_core_fast),
        'floor_fwdbwd_ms': floor}, device)
    ms.update(time_interleaved({'sdpa_fwd_ms': lambda: fwd(sdpa), 'sdpa_fwdbwd_ms': lambda: fwdbwd(sdpa)}, device,
                                warm_up=False))
    row = dict(case=name, tokens=N, dtype=str(dtype).replace('torch.', ''))
    row.update({key: round(statistics.median(ms[key]), 3) for key in (
        'reference_fwd_ms', 'reference_fwdbwd_ms', 'fast_fwd_ms', 'fast_fwdbwd_ms', 'sdpa_fwd_ms', 'sdpa_fwdbwd_ms',
        'floor_fwdbwd_ms')})
    row.update(fwd_speedup=round(paired_ratio(ms, 'reference_fwd_ms', 'fast_fwd_ms'), 2),
               fwdbwd_speedup=round(paired_ratio(ms, 'reference_fwdbwd_ms', 'fast_fwdbwd_ms'), 2),
               fwdbwd_over_floor=round(paired_ratio(ms, 'fast_fwdbwd_ms', 'floor_fwdbwd_ms'), 2))
    row['fast_peak_mb'] = round(peak_mb(lambda: fwdbwd(inline_core_fast), device), 1)
    return row


CAUSAL_TOKENS = (1024, 2048, 4096, 8192, 16384)  # python kernels.py --causal-bench: B = 1, H = 4, D = 64 (GPT-2's)


def bench_causal(N, dtype, device, B=1, H=4, D=64):
    """One row of --causal-bench: the fast causal core, Eq. 5 alone and with Eq. 6 over 3 tokens, against causal
    softmax (F.scaled_dot_product_attention(is_causal=True)), forward and forward + backward, in one interleaved run.
    (The reference's (B, H, N, D, D) prefix sums need 1 GB per tensor at 16k tokens: it is left out.)"""
    gen = torch.Generator(device).manual_seed(0)
    q, k, v, do = (torch.randn(B, H, N, D, generator=gen, device=device, dtype=dtype) for _ in range(4))
    r = 0.1 * torch.randn(B, N, 3 * H * D, generator=gen, device=device, dtype=dtype)
    inputs = [t.requires_grad_() for t in (q, k, v, r)]
    cores = {'sdpa': lambda: F.scaled_dot_product_attention(q, k, v, is_causal=True),
             'eq5': lambda: inline_core_fast(q, k, v, None, None, causal=True),
             'eq56': lambda: inline_core_fast(q, k, v, r, None, size=3, causal=True)}
    fns = {}
    for name, core in cores.items():
        fns[f'{name}_fwd_ms'] = lambda core=core: torch.no_grad()(core)()
        fns[f'{name}_fwdbwd_ms'] = lambda core=core, n=4 if name == 'eq56' else 3: torch.autograd.grad(
            core(), inputs[:n], do)
    ms = time_interleaved(fns, device, budget_s=60, max_rounds=9)
    row = dict(tokens=N, dtype=str(dtype).replace('torch.', ''), B=B, H=H, D=D)
    row.update({key: round(statistics.median(t), 2) for key, t in ms.items()})
    for name in ('eq5', 'eq56'):  # how many times faster than causal SDPA: medians of per-round ratios
        for part in ('fwd', 'fwdbwd'):
            row[f'{name}_{part}_speedup'] = round(paired_ratio(ms, f'sdpa_{part}_ms', f'{name}_{part}_ms'), 2)
    return row


def bench_compile(device, dtype=torch.float32):
    """What the fast core's first use in a process costs: its first forward and backward on a small case, which
    compile the two graphs, or load them where the inductor cache (TORCHINDUCTOR_CACHE_DIR) already holds them."""
    q, k, v, do = (torch.randn(2, 3, 64, 32, device=device, dtype=dtype, requires_grad=True) for _ in range(4))
    r = torch.randn(2, 9 * 96, device=device, dtype=dtype, requires_grad=True)
    start = time.perf_counter()
    torch.autograd.grad(inline_core_fast(q, k, v, r, (8, 8)), (q, k, v, r), do.detach()), _sync(device)
    print(f"first forward + backward, {str(dtype).replace('torch.', '')}, inductor cache {cache_dir()}: "
          f"{time.perf_counter() - start:.1f} s", flush=True)


def bench_choices(device):
    """Two of the choices above, timed in one interleaved run: D a constant against D symbolic too (the forward
    graph at swin_t_stage1, fp32), and a call whose signature has a graph, straight to it, against one through
    compile_and_call's switches, marks and lock (one head of 49 tokens)."""
    def inputs(B, H, side):  # core_forward's arguments as InLineCore passes them
        gen, N, D = torch.Generator(device).manual_seed(0), side * side, 32
        return [*(torch.randn(B, H, N, D, generator=gen, device=device) for _ in range(3)),
                0.1 * torch.randn(B, H, 9, D, generator=gen, device=device), *neighbourhood(N, (side, side), device),
                inline.attention_scale(D), True]
    B, H, side, _ = CASES['swin_t_stage1']
    constant, symbolic, small = inputs(B, H, side), inputs(B, H, side), inputs(1, 1, 7)
    symbolic_sizes(constant, side * side), symbolic_sizes(symbolic, side * side)
    for a in symbolic[:4]:
        torch._dynamo.maybe_mark_dynamic(a, 3)
    graphs = [torch.compile(core_forward), torch.compile(core_forward)]

    def through_switches():
        _compiled_signatures.discard(signature(core_forward, small))
        run(core_forward, *small)

    with compile_options():
        ms = time_interleaved({'d_constant': lambda: graphs[0](*constant), 'd_symbolic': lambda: graphs[1](*symbolic),
                               'straight': lambda: run(core_forward, *small), 'switches': through_switches}, device)
    print(f"forward graph, swin_t_stage1 fp32: D constant {statistics.median(ms['d_constant']):.1f} ms, D symbolic "
          f"{statistics.median(ms['d_symbolic']):.1f} ms: {paired_ratio(ms, 'd_symbolic', 'd_constant'):.2f}x")
    extra = statistics.median(s - c for s, c in zip(ms['switches'], ms['straight']))
    print(f"a call whose signature has a graph: straight {statistics.median(ms['straight']):.3f} ms, through the "
          f"switches {statistics.median(ms['switches']):.3f} ms: {extra:.3f} ms more", flush=True)


PER_CALL = {  # python kernels.py --per-call: (batch, heads, tokens before the grid, grid side, head dim)
    'InLine-DeiT-T, 224 px (197 tokens)': (1, 6, 1, 14, 32), 'InLine-Swin-T windows of 7x7 (49 tokens)': (64, 3, 0, 7, 32),
    'InLine-Swin-T stage 1 (56x56 tokens)': (1, 3, 0, 56, 32),
}


def bench_per_call(device, dtypes):
    """What one call of the fast core costs beside its work, forward only, in one interleaved run per case: the whole
    call without and with a gradient asked (the autograd Function), the two GEMMs of Eq. 5 alone (K^T V and Q Cov,
    eager: the work no implementation avoids) and softmax SDPA on the same q, k, v. Call minus GEMMs is what the
    call adds: the fused passes over q, k, v (means, centring, Eq. 6) and the cost of calling a compiled graph."""
    print(f"{'case':44s} {'dtype':>8s} | {'call us':>8s} {'w/ grad':>8s} | {'GEMMs':>7s} {'call - GEMMs':>12s} | "
          f"{'SDPA us':>8s}")
    for name, (B, H, P, side, D) in PER_CALL.items():
        for dtype in dtypes:
            N, gen = P + side * side, torch.Generator(device).manual_seed(0)
            q, k, v = (torch.randn(B, H, N, D, generator=gen, device=device, dtype=dtype) for _ in range(3))
            r = 0.1 * torch.randn(B, 9 * H * D, generator=gen, device=device, dtype=dtype)
            grads = [t.detach().requires_grad_() for t in (q, k, v, r)]
            cov = torch.randn(B, H, D, D, generator=gen, device=device, dtype=dtype)

            def call():
                with torch.no_grad():
                    inline_core_fast(q, k, v, r, (side, side))

            fns = {'call': call, 'grad': lambda: inline_core_fast(*grads, (side, side)),
                   'gemms': lambda: (k.mT @ v, q @ cov), 'sdpa': lambda: F.scaled_dot_product_attention(q, k, v)}
            us = {n: 1e3 * statistics.median(t) for n, t in time_interleaved(fns, device, 2.0, 200).items()}
            print(f"{name:44s} {str(dtype)[6:]:>8s} | {us['call']:8.0f} {us['grad']:8.0f} | {us['gemms']:7.0f} "
                  f"{us['call'] - us['gemms']:12.0f} | {us['sdpa']:8.0f}", flush=True)


def main():
    parser = argparse.ArgumentParser(description="Benchmark the fast InLine core against the reference")
    parser.add_argument('--bench', action='store_true', help="time the attention-core cases")
    parser.add_argument('--choices', action='store_true', help="time two design choices (see bench_choices)")
    parser.add_argument('--compile', action='store_true', help="time the first use: compiling the two graphs")
    parser.add_argument('--per-call', action='store_true', help="what one call costs beside its work, at 197 tokens, "
                        "49-token windows and 56x56 tokens (see bench_per_call)")
    parser.add_argument('--causal-bench', action='store_true',
                        help="time the causal core against causal softmax SDPA at --tokens")
    parser.add_argument('--tokens', default=','.join(map(str, CAUSAL_TOKENS)),
                        help="comma-separated sequence lengths of --causal-bench")
    parser.add_argument('--json', action='store_true', help="one JSON object per case instead of a table")
    parser.add_argument('--cases', default=','.join(CASES), help="comma-separated subset of " + ', '.join(CASES))
    parser.add_argument('--dtypes', default='float32,bfloat16', help="comma-separated torch dtypes")
    parser.add_argument('--device', default='cuda' if torch.cuda.is_available() else 'cpu')
    parser.add_argument('--threads', type=int, default=None, help="CPU threads (default: torch's)")
    args = parser.parse_args()
    if args.threads:
        torch.set_num_threads(args.threads)
    device, dtypes = torch.device(args.device), [getattr(torch, d) for d in args.dtypes.split(',')]
    print(f"# {device.type}, {torch.get_num_threads()} threads, torch {torch.__version__}", flush=True,
          file=sys.stderr if args.json else sys.stdout)  # --json: stdout holds only JSON lines
    header = (f"{'case':15s} {'tokens':>6s} {'dtype':>8s} | {'reference ms':>15s} | {'fast ms':>15s} | "
              f"{'speed-up':>11s} | {'softmax SDPA ms':>17s} | {'floor':>7s} {'fast/':>6s} | {'peak':>6s}\n"
              f"{'':15s} {'':>6s} {'':>8s} | {'fwd':>7s} {'fwd+bwd':>7s} | {'fwd':>7s} {'fwd+bwd':>7s} | "
              f"{'fwd':>5s} {'f+b':>5s} | {'fwd':>8s} {'fwd+bwd':>8s} | {'f+b ms':>7s} {'floor':>6s} | {'MB':>6s}")
    if args.compile:
        for dtype in dtypes:
            bench_compile(device, dtype)
    if args.choices:
        bench_choices(device)
    if args.per_call:
        bench_per_call(device, dtypes)
    if args.causal_bench:
        if not args.json:
            ms, speedup = f"{'fwd':>7s} {'fwd+bwd':>7s}", f"{'fwd':>5s} {'f+b':>5s}"
            print(f"{'tokens':>6s} {'dtype':>8s} | {'causal SDPA ms':>15s} | {'InLine Eq. 5 ms':>15s} | "
                  f"{'speed-up':>11s} | {'Eq. 5 + 6 ms':>15s} | {'speed-up':>11s}\n{'':>6s} {'':>8s} | "
                  f"{ms} | {ms} | {speedup} | {ms} | {speedup}", flush=True)
        for N in map(int, args.tokens.split(',')):
            for dtype in dtypes:
                row = bench_causal(N, dtype, device)
                if args.json:
                    print(json.dumps(row), flush=True)
                    continue
                print(f"{N:6d} {row['dtype']:>8s} | {row['sdpa_fwd_ms']:7.1f} {row['sdpa_fwdbwd_ms']:7.1f} | " + ' | '.join(
                      f"{row[f'{n}_fwd_ms']:7.1f} {row[f'{n}_fwdbwd_ms']:7.1f} | {row[f'{n}_fwd_speedup']:4.1f}x "
                      f"{row[f'{n}_fwdbwd_speedup']:4.1f}x" for n in ('eq5', 'eq56')), flush=True)
    if args.bench:
        if not args.json:
            print(header, flush=True)
        for name in args.cases.split(','):
            for dtype in dtypes:
                row = bench_case(name, dtype, device)
                if args.json:
                    print(json.dumps(row), flush=True)
                    continue
                ref_f, ref_fb, f, fb = (row[k] for k in ('reference_fwd_ms', 'reference_fwdbwd_ms', 'fast_fwd_ms', 'fast_fwdbwd_ms'))
                print(f"{name:15s} {row['tokens']:6d} {row['dtype']:>8s} | {ref_f:7.1f} {ref_fb:7.1f} | {f:7.1f} {fb:7.1f} | "
                      f"{row['fwd_speedup']:4.1f}x {row['fwdbwd_speedup']:4.1f}x | {row['sdpa_fwd_ms']:8.1f} "
                      f"{row['sdpa_fwdbwd_ms']:8.1f} | {row['floor_fwdbwd_ms']:7.1f} {row['fwdbwd_over_floor']:5.2f}x | "
                      f"{row['fast_peak_mb']:6.1f}", flush=True)

if __name__ == '__main__':
    main()

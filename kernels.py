"""The fast InLine attention core: Eq. 5 + Eq. 6 as two compiled graphs with a closed-form backward.

Han et al., "Bridging the Divide: Reconsidering Softmax and Linear Attention", NeurIPS 2024, arXiv 2412.06590.
`inline_core_fast(q, k, v, r, grid, scale=None, size=3, dilation=1, scale_by_count=True)` takes the same
arguments, layout and result as inline.inline_core, the reference it replaces; `enable_fast(model)` swaps it
into a model (models.create_model(name, fast=True) calls it) once it has run each of the model's attention
configurations on both paths and found the output and every gradient equal (check_against_reference), so a
change made in the reference that the fast core does not follow is refused when the model is built.
test_inline.py proves the two equal.

    (the benchmarks, with their command lines: bench.py; causal InLine's fast core: sequence.py)

What it does, and why (RESULTS.md has the measurements, each under its command):
- One torch.compile'd graph for the forward and one for the backward, called from a
  torch.autograd.Function whose backward is written in closed form (the means' gradients vanish, so there is
  no centring term to differentiate). Saved for backward: q, the centred k and v that the forward writes
  anyway (in place of k and v, so no more memory), r, v_mean, the D x D covariance and the (T, N) neighbour
  table (T = k^2 neighbours of Eq. 6's k x k neighbourhood). B, H and N are symbolic: one graph per dtype,
  head dim and T serves every batch, head count, token grid and dilation; D is a constant, so the channel
  loops vectorise without remainder loops. Inside a torch.compile'd model the closed forms, forward and
  backward, are traced into the model's graph (run): inductor fuses them with the layers around them, no call
  pays the core's entry, and the model's graph does not break at each attention (RESULTS.md, "Whole models
  against softmax", has what it gains).
- Eq. 5 in centred-covariance form, as inline.py: k and v centred in fp32 before the GEMM, so no sum over
  tokens sees the means. Means and every other sum accumulate in fp32; bf16 GEMMs accumulate in fp32 and
  round once. In fp16 one operand of each sum over tokens is pre-scaled by N^-1/2 (sum_scale), so the
  GEMM outputs stay below fp16's 65504 where the reference's outputs overflow.
- Eq. 6 as T gathered multiply-adds along the token axis (nine for the paper's 3x3; a dilation only
  changes the precomputed neighbour indices and border masks), fused by inductor with v_mean and the
  GEMM output into one pass; the backward's transposed
  shift and the T sums for dr likewise. The released B*C-group convolution needs V transposed to
  channel planes and back; a zero-padded shift would need masked loads, where every gather reads in bounds.
- With no gradient asked (evaluation), fast_path (a module's path after phi) runs instead: Eq. 6's weight
  predictor and the core's forward in one graph (infer_forward), which takes q, k, v as the projection leaves
  them. With DeiT's 197 tokens the predictor's small ops, the copies and a second call cost more than the
  core's work.
- Compiling: if a graph cannot compile or load, the core runs its closed form eagerly, after one warning that
  names any broken cache file. compile_lock, a file lock per graph, is held while a graph compiles or
  loads, so that processes on one machine never write the same cache files at once.

Notation as in inline.py: B batch, H heads, N tokens, D head dim, C = H*D, (h, w) the token grid,
P = N - h*w leading tokens off the grid (DeiT's class token).
"""
import contextlib
import copy
import fcntl
import functools
import hashlib
import os
import re
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
    masks, rather than a zero-padded copy, keep every read in bounds. (On a 1-D sequence: sequence.py's.)"""
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


_cached_neighbourhood = functools.lru_cache(maxsize=32)(neighbourhood)


def neighbour_table(cached, *args):
    """A neighbour table from its per-shape cache; inside a torch.compile'd model built in the graph instead
    (a constant there), since dynamo would trace past the cache with a warning."""
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
    """-> o (B, H, N, D) stored token-major, and for the backward (k - k_mean) and (v - v_mean) (B, H, N, D)
    as rounded to the input dtype (the GEMM's operands, computed anyway), v_mean (B, H, 1, D) and g N Cov
    (B, H, D, D), g Eq. 5's factor s/N (scale_by_count) or s (inline.eq5_gain)."""
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
    """-> the gradients of q, k, v (B, H, N, D) and of taps (B, H, T, D), given do = dLoss/do stored
    token-major."""
    N, dtype = q.shape[2], q.dtype
    c = sum_scale(dtype, N)
    dq = do @ cov.transpose(-2, -1)  # (B, H, N, D)
    q_s = (wide(q) * c).to(dtype) if c != 1.0 else q
    # (B, H, D, D)
    g = (wide(q_s.transpose(-2, -1) @ do) * (inline.eq5_gain(scale, N, scale_by_count) / c)).to(dtype)
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
                             for t, v_t in enumerate(neighbours(v, index))], dim=2)
        dtaps = dtaps.to(taps.dtype)  # (B, H, T, D)
    return dq, dk, dv.to(dtype), dtaps


# ---------------------------------------------------------------------------------------------------
# Inference: Eq. 6's weights and the core in one graph (fast_path). Where the tokens are few (DeiT's 197), the
# predictor's eight small ops, the copies of the module's strided q, k, v and the second call cost more than
# the core.

def infer_forward(q, k, v, x, w1, b1, w2, b2, index, masks, scale, scale_by_count, dtype):
    """inline.residual_weights then core_forward's o (B, H, N, D), token-major, in dtype: what
    InLineBase.attend computes after prepare, with no gradient. q, k, v (B, H, N, D) as the module's
    projection leaves them (strided, any float dtype); x (B, 1, N, C) the tokens Eq. 6's weights are predicted
    from; w1, b1, w2, b2 the predictor's two 1x1 grouped convolutions' weights and biases ((C, D, 1), (C,),
    (T*C, D, 1), (T*C,)), or None for no Eq. 6. residual_weights' matmuls, with W2's output channels reordered
    from T*c + t to neighbour-major (t, c), so the taps come out (B, H, T, D) with D contiguous: Eq. 6's pass
    then reads each neighbour's weights as a vector, where a transposed view of r is read one channel at a
    time (5x slower for DeiT-T's sizes). Same numbers."""
    B, H, N, D = q.shape
    # One contiguous copy each, fused with the cast: Eq. 6's gathers and the GEMMs then read a head's tokens
    # in a row. At DeiT-T's 197 tokens the copies cost nothing measurable; at 4,097 reading the projection's
    # layout instead cost about 5% of the model (RESULTS.md, "Whole models against softmax")
    q, k, v = q.to(dtype).contiguous(), k.to(dtype).contiguous(), v.to(dtype).contiguous()
    taps = None
    if w1 is not None:
        T = w2.shape[0] // (H * D)
        # (H, B, D): each head's slice of the mean
        m = x.mean(dim=2).to(w1.dtype).reshape(B, H, D).transpose(0, 1)
        # (H, B, D)
        hidden = F.gelu(torch.baddbmm(b1.reshape(H, 1, D), m, w1.reshape(H, D, D).transpose(1, 2)))
        # rows (t, j), was (j, t): (H, T*D, D)
        w2 = w2.reshape(H, D, T, D).transpose(1, 2).reshape(H, T * D, D)
        b2 = b2.reshape(H, 1, D, T).transpose(2, 3).reshape(H, 1, T * D)
        # (H, B, T*D): head g's neighbour t, channel j at t*D + j
        r = torch.baddbmm(b2, hidden, w2.transpose(1, 2))
        taps = r.reshape(H, B, T, D).transpose(0, 1).to(dtype)  # (B, H, T, D)
    return core_forward(q, k, v, taps, index, masks, scale, scale_by_count)[0]


# sequence.py adds its causal core's two
COMPILED = {f.__name__: torch.compile(f) for f in (core_forward, core_backward, infer_forward)}
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
    """A key for what dynamo's guards on f's graph check: the device, inference flag, grad mode, head dim D
    and B, H, N as 0, 1 or more (dynamo specialises 0 and 1) of args[0], whose sizes fix every other tensor's
    but the neighbour count T; each tensor's dtype and the index's T (its only 2-D tensor); the other
    arguments (scale, or None where Eq. 6 is off, and scale_by_count, which changes the graph); for a graph
    over chunks of f.chunk tokens (sequence.py's causal core) also its chunk count N / f.chunk as 1 or more.
    Some guards no key can foresee: a torch-function mode in force (enable_fast's check steps outside them),
    or a size bound that inductor's choices put on a graph (N <= 4096 on the CPU: 1024 px DeiT has 4097
    tokens). Failing under a known key, such a guard would make dynamo recompile without our switches, and
    past its recompile limit of 8 run the closed form eagerly, unwarned; run calls a known key's graph under
    the stance fail_on_recompile instead, and compiles another graph with the switches."""
    x = args[0]  # q, or do: (B, H, N, D)
    chunks = (min(x.shape[2] // f.chunk, 2),) if hasattr(f, 'chunk') else ()
    heads = (x.shape[1],) if f is infer_forward else ()  # its weights' shapes (C, D, 1) fix H
    return (f.__name__, x.device, x.is_inference(), torch.is_grad_enabled(), x.shape[3],
            *(min(s, 2) for s in x.shape[:3]), *chunks, *heads,
            *(a.dtype if isinstance(a, torch.Tensor) else a for a in args),
            *(a.shape[0] for a in args if isinstance(a, torch.Tensor) and a.dim() == 2))


_compiled_signatures = set()  # signatures that have a graph: their calls need no switches and no marks
COMPILE_ERRORS = (torch._dynamo.exc.BackendCompilerFailed, ImportError, OSError)


@contextlib.contextmanager
def compile_lock(key):
    """Held while the graph of signature key compiles or loads: an exclusive lock on one file per graph in the
    inductor cache folder. Processes on one machine (torchrun's ranks, parallel runs) that need the same graph
    then compile it once, the others waiting to load it, instead of writing the same cache files at once,
    which can corrupt them. The lock goes with the file's descriptor: a process that dies releases it."""
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
    """f(*args) through its compiled graph, compiled or loaded from the inductor cache under compile_lock."""
    symbolic_sizes(args, N=args[0].shape[2])  # args[0] is q, or do: (B, H, N, D)
    with compile_lock(key), compile_options():
        return COMPILED[f.__name__](*args)


def run(f, *args):
    """The compiled f, or, if this machine cannot compile, the same closed form eagerly after one warning."""
    args = [a.detach() if isinstance(a, torch.Tensor) else a for a in args]  # autograd is ours, not f's
    if torch.compiler.is_compiling():  # inside a torch.compile'd model: f is traced into the model's graph
        return f(*args)
    if not _compile_error:
        key = signature(f, args)
        try:
            # The switches and marks act only when dynamo compiles: skipping them saves time on every call.
            # A guard failing here would recompile without them, so it may not (signature's docstring):
            if key in _compiled_signatures:
                try:
                    with torch.compiler.set_stance('fail_on_recompile'):
                        return COMPILED[f.__name__](*args)
                except RuntimeError as e:
                    if 'Detected recompile' not in str(e):
                        raise
            out = compile_and_call(f, args, key)  # a new graph, or another for a key whose guard failed
            _compiled_signatures.add(key)
            return out
        except COMPILE_ERRORS as e:  # e.g. no working C++ compiler, or a cache file left broken
            _compile_error.append(e)
            path = broken_file(e)
            warnings.warn(f"kernels.py: torch.compile failed ({describe(e)}); the fast InLine core now runs "
                          f"its closed form eagerly, correct but much slower" + (f". {path} in the inductor "
                          f"cache may be broken: delete it and rerun" if path else ""), stacklevel=3)
    return f(*args)


def forward_graph(q, k, v, taps, table, scale, scale_by_count):
    """core_forward on the core's inputs: o (B, H, N, D), stored token-major, and what the backward keeps.
    taps (B, H, T, D) Eq. 6's weights, neighbour before channel, and table their (index, masks), or None."""
    # One memory layout for every caller, so one compiled graph serves them all; the matmuls would
    # need these copies of a model's strided q, k, v views anyway.
    q, k, v = q.contiguous(), k.contiguous(), v.contiguous()
    index, masks = table if taps is not None else (None, None)
    o, k_c, v_c, v_mean, cov = run(core_forward, q, k, v, taps, index, masks, scale, scale_by_count)
    return o, (q, k_c, v_c, taps, index, masks, v_mean, cov)


class InLineCore(torch.autograd.Function):
    @staticmethod
    def forward(ctx, q, k, v, taps, table, scale, scale_by_count):
        o, saved = forward_graph(q, k, v, taps, table, scale, scale_by_count)
        ctx.save_for_backward(*saved)
        ctx.scale, ctx.scale_by_count = scale, scale_by_count
        return o

    @staticmethod
    def backward(ctx, do):
        q, k_c, v_c, taps, index, masks, v_mean, cov = ctx.saved_tensors
        # do as o was stored: a copy only if it comes otherwise
        with torch.autocast(q.device.type, enabled=False):
            dq, dk, dv, dtaps = run(core_backward, token_major(do), q, k_c, v_c, taps, index, masks,
                                    v_mean, cov, ctx.scale, ctx.scale_by_count)
        return dq, dk, dv, dtaps, None, None, None


def inline_core_fast(q, k, v, r, grid, scale=None, size=inline.LOCAL_SIZE, dilation=1, scale_by_count=True):
    """Eq. 5 over all N tokens, then Eq. 6 on the last h*w: the same arguments, layout and result as
    inline.inline_core. q, k, v (B, H, N, D) through phi; r (B, T*C) with T = size^2 neighbour weights per
    channel, or None; grid = (h, w); size and dilation of Eq. 6's neighbourhood.
    scale_by_count: Eq. 5's factor s/N, else s (inline.eq5_gain); a Python bool, part of the compiled graphs'
    signature. scale: None (D^-1/2), a number, or a tensor that broadcasts against (B, H, N, 1).
    Under autocast the inputs are cast to the autocast dtype, as the reference's matmuls would be. Inside a
    torch.compile'd model it is traced into the model's graph (run)."""
    B, H, N, D = q.shape
    inline.check_grid(N, grid)
    if r is not None and r.shape != (B, size * size * H * D):
        raise ValueError(f"r must hold {size}x{size} neighbour weights per channel, (B, {size * size}C) "
                         f"= {(B, size * size * H * D)}, got {tuple(r.shape)}; the fast core has no other "
                         f"Eq. 6 weights on a grid (inline.local_residual also takes them per token)")
    table = None
    if r is not None:  # built once per shape; traced into a compiled model's graph, a constant there
        table = neighbour_table(_cached_neighbourhood, N, tuple(grid), q.device, size, dilation)
    return apply_core(q, k, v, r, table, scale, scale_by_count)


def apply_core(q, k, v, r, table, scale, scale_by_count):
    """inline_core_fast after its checks, for any neighbour table (index, masks) of Eq. 6
    (sequence.py's 1-D one too): r (B, T*C) becomes taps (B, H, T, D); the autograd Function only where a
    gradient is asked."""
    B, H, N, D = q.shape
    q, scale = fold_scale(q, scale)
    device = q.device.type
    if torch.is_autocast_enabled(device):
        dtype = torch.get_autocast_dtype(device)
        q, k, v, r = (t.to(dtype) if t is not None else None for t in (q, k, v, r))
    taps = r.reshape(B, H, D, -1).transpose(-2, -1).contiguous() if r is not None else None  # (B, H, T, D)
    with torch.autocast(device, enabled=False):
        if torch.is_grad_enabled() and any(t is not None and t.requires_grad for t in (q, k, v, taps)):
            o = InLineCore.apply(q, k, v, taps, table, scale, bool(scale_by_count))
            return o
        return forward_graph(q, k, v, taps, table, scale, bool(scale_by_count))[0]  # no gradient: no Function


def fold_scale(q, scale):
    """q and Eq. 5's s as the compiled graphs take them: s a number (None: D^-1/2), or a tensor that
    broadcasts against (B, H, N, 1), a learnable temperature say, which joins q outside the graphs, s q^T
    Cov = (s q)^T Cov over each prefix too, so that autograd takes its gradient."""
    if isinstance(scale, torch.Tensor):
        return q * scale, 1.0
    return q, inline.attention_scale(q.shape[-1]) if scale is None else scale


def fast_path(module, q, k, v, x, grid, scale):
    """inline.reference_path's arguments and result, for a module whose core is inline_core_fast: with a
    gradient asked, that path; with none (evaluation), Eq. 6's weights (inline.residual_weights) and the core
    in one compiled graph (infer_forward). enable_fast puts it in module.path once check_against_reference has
    found the module's output on both equal to the reference's."""
    if torch.is_grad_enabled():
        return inline.reference_path(module, q, k, v, x, grid, scale)
    N = q.shape[2]
    q, scale = fold_scale(q, scale)
    device = q.device.type
    autocast = torch.is_autocast_enabled(device)
    dtype = torch.get_autocast_dtype(device) if autocast else q.dtype
    weights, index, masks = [None] * 4, None, None
    if module.residual is not None:
        conv1, _, conv2 = module.residual
        weights = [conv1.weight, conv1.bias, conv2.weight, conv2.bias]
        index, masks = neighbour_table(_cached_neighbourhood, N, tuple(grid), q.device, module.local_size,
                                       module.dilation)
    # The graph casts to dtype itself; entered only where needed, since a graph called inside the context
    # costs more
    with torch.autocast(device, enabled=False) if autocast else contextlib.nullcontext():
        return run(infer_forward, q, k, v, x[:, None], *weights, index, masks, scale,
                   module.scale_by_count, dtype)


# reference core -> its fast twin (sequence.py adds its own)
FAST_CORES = {inline.inline_core: inline_core_fast}
# a fast core -> the path enable_fast puts beside it (default: the same)
FAST_PATHS = {inline_core_fast: fast_path}


def unsupported(module):
    """What of an InLine module's options (inline.InLineBase) the fast core does not cover, or None. It covers
    every option of InLine attention (kernel, residual, local_size, dilation, nonneg, APE: they change its
    inputs or its neighbour table), but not vanilla linear attention, which divides where Eq. 5 subtracts."""
    if module.attention == 'linear':
        return "attention='linear' (layout letter L, vanilla linear attention)"
    return None


def configuration(module):
    """What decides an InLine module's computation besides its weights: its class, its plain attributes
    (options, head count and dim, leading tokens, and any a change in code adds) and its parameters' names.
    Modules alike in these run the same code, so one check serves them all."""
    plain = (bool, int, float, str, tuple, type(None))
    attributes = sorted((k, v) for k, v in vars(module).items() if isinstance(v, plain) and k != 'training')
    return type(module), tuple(attributes), tuple(name for name, _ in module.named_parameters())


def check_inputs(module, device, generator):
    """A small random call of module.attend: q, k, v (2, H, N, D) and x (2, N, C) in fp32, and its grid, of
    the shape module.check_shape() gives (inline.InLineBase: a 6x7 grid after the module's leading tokens)."""
    H, D = module.num_heads, module.head_dim
    N, grid = module.check_shape()
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
    """Why fast is not the reference's number, or None. exact: the reference in float64; reference: in fp32.
    The fast core may err by twice the fp32 reference's own error, plus 1e-5 of the quantity's largest value
    (summation order; a wrong formula or a lost gradient is off by far more). None (no gradient reaches it)
    counts as 0."""
    if exact is None and fast is None:
        return None
    size = (exact if exact is not None else fast).abs().max().item()
    if fast is None or exact is None:
        return None if size == 0 else f"reference {'none' if exact is None else f'{size:.1e}'}, fast " \
                                      f"{'none' if fast is None else f'{size:.1e}'}"
    error, own = (fast.double() - exact).abs().max().item(), (reference.double() - exact).abs().max().item()
    bound = 2 * own + 1e-5 * size
    if not error <= bound:  # also NaN
        return (f"max |fast - float64 reference| {error:.1e}, beyond {bound:.1e} (twice the fp32 "
                f"reference's own error {own:.1e}, plus 1e-5 of its largest value {size:.1e})")
    return None


@contextlib.contextmanager
def outside_function_modes():
    """Run without the torch-function modes in force, such as the `with torch.device('meta')` a model may be
    built under: a graph compiled under a mode is guarded on it, and every later call without it would compile
    again."""
    modes = [torch._C._pop_torch_function_stack() for _ in range(torch._C._len_torch_function_stack())]
    try:
        yield
    finally:
        for mode in reversed(modes):
            torch._C._push_on_torch_function_stack(mode)


def check_against_reference(path, module, core, device, fast_path=None):
    """Raise ValueError unless core, put in module's place of its reference core (module.core), gives
    module.attend the output and the gradients of q, k, v, x and every parameter of the reference path (on
    check_inputs, against the reference in float64, with difference's tolerance), and fast_path
    (None: module.path), put in module.path, the same output with no gradient too where it is not the module's
    own path. Copies of the module run it, so the model and the global random state are untouched; a module on
    the meta device is checked with random weights."""
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
        fast = copy.deepcopy(reference)
        fast.core, fast.path = core, fast_path or reference.path
        inputs = check_inputs(reference, device, generator)
        do = torch.randn(inputs[0].shape, generator=generator, device='cpu').to(device)
        where = f"{path or 'the model'} ({type(module).__name__})"
        with torch.random.fork_rng(devices=[device] if device.type == 'cuda' else []), torch.enable_grad(), \
                torch.autocast(device.type, enabled=False):
            exact = attend_and_differentiate(copy.deepcopy(reference).double(), inputs, do.double())
            ours = attend_and_differentiate(reference, inputs, do)
            try:
                theirs = attend_and_differentiate(fast, inputs, do)
                if fast.path is not reference.path:  # another path with no gradient: its output too
                    with torch.no_grad():
                        theirs['output with no gradient'] = fast.attend(*inputs)
                    exact['output with no gradient'] = exact['output']
                    ours['output with no gradient'] = ours['output']
            except Exception as e:  # whatever the fast core cannot take: refused here, not at the first step
                theirs = f"the fast core raised {type(e).__name__}: {(str(e).splitlines() or [''])[0]}"
        why = theirs if isinstance(theirs, str) else next(
            (f"{name}: {d}" for name in exact if (d := difference(exact[name], ours[name], theirs[name]))),
            None)
        if why:
            name = why.split(':')[0].replace('gradient of ', '')
            # name the parameter by its path in the model
            if name in dict(module.named_parameters()) and path:
                why = why.replace(f'gradient of {name}', f'gradient of {path}.{name}', 1)
            raise ValueError(f"the fast InLine core does not compute what {where} computes on the reference "
                             f"path: {why}. Build the model with fast=False (train.py: --attention-impl "
                             f"reference), or make the change in a form the fast core follows (README, "
                             f"\"Changing the method\")")


def enable_fast(model, core=None, device=None, log=print):
    """Set `.core` to its fast twin (FAST_CORES; or to core, where given) on every InLine module of model
    whose core is a reference, and `.path` to the path beside it (FAST_PATHS: fast_path, which runs Eq. 6's
    weights and the core in one graph when no gradient is asked); returns how many. First every module is
    checked, so a model is fast throughout or refused when it is built, never half fast: an option the fast
    core lacks (unsupported) is refused by name; then one module of each configuration is run on both paths
    (check_against_reference), so a change made in code that the fast core does not follow (a scale without
    its gradient, Eq. 6 weights of another shape) is refused too, naming the module and the quantity that
    differs. device: where the check runs (default: the model's; the meta device's on the CPU); log: how each
    configuration's check reports its cost (None: silent)."""
    # each setup_inline gave one
    modules = [(path, m) for path, m in model.named_modules() if hasattr(m, 'core')]
    lacking = sorted({unsupported(m) for _, m in modules} - {None})
    if lacking:
        raise ValueError(f"the fast InLine core has no {', '.join(lacking)}: build this model with "
                         f"fast=False (train.py: --attention-impl reference)")
    swapped = [(path, m) for path, m in modules if m.core in FAST_CORES]
    if device is None:
        device = next((p.device for p in model.parameters() if not p.is_meta), torch.device('cpu'))
    configurations = {}  # configuration: the modules that have it
    for path, m in swapped:
        configurations.setdefault(configuration(m), []).append((path, m))
    for alike in configurations.values():
        (path, m), start = alike[0], time.perf_counter()
        fast = core or FAST_CORES[m.core]
        check_against_reference(path, m, fast, torch.device(device), path_for(m, fast))
        if log:
            log(f"kernels.enable_fast: {path or type(m).__name__} ({type(m).__name__}, H {m.num_heads}, "
                f"D {m.head_dim}; {len(alike)} module(s) of this configuration) equals the reference: "
                f"{time.perf_counter() - start:.1f} s")
    for _, m in swapped:
        fast = core or FAST_CORES[m.core]
        m.core, m.path = fast, path_for(m, fast)
    return len(swapped)


def path_for(module, core):
    """The path enable_fast puts beside core: FAST_PATHS' (fast_path beside inline_core_fast) where the module
    runs inline.reference_path, else the module's own (a test's core, paper.py's, sequence.py's)."""
    return FAST_PATHS.get(core, module.path) if module.path is inline.reference_path else module.path

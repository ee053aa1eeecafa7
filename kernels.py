"""The fast InLine attention core: Eq. 5 + Eq. 6 as two compiled graphs with a closed-form backward.

Han et al., "Bridging the Divide: Reconsidering Softmax and Linear Attention", NeurIPS 2024, arXiv
2412.06590. `inline_core_fast` takes the arguments, layout and result of inline.inline_core, the
reference it replaces, and is its fast twin 'compile' (inline.FAST_TWINS): an InLine module with
fast='compile' calls it in place of inline_core, with and without a gradient, and nothing else
changes. `enable_fast(model)` (create_model(name, fast='compile')) turns that switch on in every
InLine module once the module's forward on the fast core gives the reference's output and every
gradient, with parameters drawn away from their initial values, and every parameter receives a
gradient: a change the fast core does not follow, or one that does not reach the forward, is
refused when the model is built. test_inline.py proves the two equal; bench.py measures them.

- The backward is in closed form (the means' gradients vanish); compiled models trace both into
  their graph.
- Eq. 5 in centred-covariance form, as inline.py; sums accumulate in fp32, fp16's pre-scaled
  (sum_scale).
- B, H and N are symbolic: one graph per dtype, head dim and T serves every batch, head count and
  grid.
- Where no gradient is asked, an InLineAttention runs its steps whole, projections to proj with
  this core traced in, as one graph (steps_fast), one per module configuration and token grid:
  at a few hundred tokens the cost around the core outweighs the core.
- A graph compiles or loads under compile_lock, a file lock per graph; if it cannot, the core runs
  its closed form eagerly after one warning that names any broken cache file.
"""
import contextlib
import copy
import fcntl
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


# --------------------------------------------------------------------------------------------------
# Eq. 6 on the token axis: neighbour t of grid token n sits at n + (dy - 1) * w + (dx - 1)

def grid_table(N, grid, device, size=inline.LOCAL_SIZE, dilation=1):
    """index (T, N): token n's neighbour t (row-major as inline.local_residual counts), clamped into
    [0, N) so every read is in bounds; masks (T, N, 1): 1 where n and its neighbour are on the grid,
    else 0."""
    h, w = grid
    # cached below: must stay usable by autograd after an eval pass
    with torch.inference_mode(False):
        n = torch.arange(N, device=device)
        g = n - (N - h * w)  # grid index; negative for the P leading tokens
        y, x = g.div(w, rounding_mode='floor'), g % w
        steps = [dilation * (i - size // 2) for i in range(size)]
        offsets = [(dy, dx) for dy in steps for dx in steps]  # row-major, as Eq. 6 counts t
        index = torch.stack([(n + dy * w + dx).clamp(0, N - 1) for dy, dx in offsets])  # (T, N)
        masks = torch.stack([(g >= 0) & (y + dy >= 0) & (y + dy < h) & (x + dx >= 0) & (x + dx < w)
                             for dy, dx in offsets])  # (T, N)
        return index, masks.float()[:, :, None]  # (T, N), (T, N, 1)


_tables = {}  # (builder, its arguments) -> table; the 32 newest kept


def cached_table(build, *args):
    """build(*args), a neighbour table, from a cache per builder and shape, built eagerly at its
    first use. In a graph being traced, a table in the cache is one of the graph's inputs
    (steps_fast builds it first, so its graph reads the table, not builds it at each call); one not
    yet built is built in the graph."""
    key = (build.__name__, *args)
    if key not in _tables:
        if torch.compiler.is_compiling():
            return build(*args)
        _tables[key] = build(*args)
        if len(_tables) > 32:
            del _tables[next(iter(_tables))]  # the oldest
    return _tables[key]


def eq6_table(N, grid, device, size, dilation):
    """Eq. 6's neighbour table on grid from the cache: the one key inline_core_fast reads and
    steps_fast builds ahead of its graph."""
    return cached_table(grid_table, N, tuple(grid), device, size, dilation)


def neighbours(x, index, flip=False):
    """The T gathers x[:, :, index[t]] (B, H, N, D); flip: offset T - 1 - t, minus t's
    (Eq. 6 transposed)."""
    T = index.shape[0]
    return [x[:, :, index[T - 1 - t if flip else t]] for t in range(T)]


# --------------------------------------------------------------------------------------------------
# The two halves, each compiled to one graph. r (B, H, T, D): Eq. 6's weights, neighbour t before
# channel

def wide(x):
    """x in at least fp32: where sums and elementwise math happen."""
    return x.to(torch.promote_types(x.dtype, torch.float32))


# CPUs on which PyTorch multiplies bf16 and fp16 matrices natively, through oneDNN: AVX-512 and
# newer (AVX-512 BF16 and AMX fastest). Elsewhere (AVX2 alone) its fallback GEMM is 5-20x slower
# than fp32's at these shapes (RESULTS.md, "The fast path: the attention core").
NATIVE_CPU_GEMM = {torch.bfloat16: torch.ops.mkldnn._is_mkldnn_bf16_supported(),
                   torch.float16: torch.ops.mkldnn._is_mkldnn_fp16_supported()}


def matmul(a, b):
    """a @ b as a GEMM of a's dtype computes it, fp32 sums rounded once to that dtype; on a CPU
    without native GEMMs of a low-precision dtype (NATIVE_CPU_GEMM), with its operands widened to
    fp32: the same products and sums (a bf16 or fp16 product is exact in fp32), an fp32 GEMM's
    speed."""
    if a.device.type != 'cpu' or NATIVE_CPU_GEMM.get(a.dtype, True):
        return a @ b
    return (wide(a) @ wide(b)).to(a.dtype)


def sum_scale(dtype, N):
    """The factor one operand of a GEMM summing over N tokens is scaled by: in fp16 (max 65504)
    N^-1/2, so that N (k - k_mean)^T v or q^T dO stays in range where its mean does; bf16 has fp32's
    range."""
    return N ** -0.5 if dtype == torch.float16 else 1.0


def token_major(x):
    """x (B, H, N, D) stored as (B, N, H, D): o.transpose(1, 2).reshape(B, N, C) is then a view."""
    return x.transpose(1, 2).contiguous().transpose(1, 2)


def core_forward(q, k, v, r, index, masks, scale, scale_by_count):
    """-> o (B, H, N, D) stored token-major, and for the backward (k - k_mean) and (v - v_mean)
    (B, H, N, D) as the GEMM's operands, v_mean (B, H, 1, D) and g N Cov (B, H, D, D), g =
    inline.eq5_gain."""
    N, dtype = q.shape[2], q.dtype
    c = sum_scale(dtype, N)
    k_mean = wide(k).mean(2, keepdim=True)  # (B, H, 1, D)
    v_mean = wide(v).mean(2, keepdim=True)  # (B, H, 1, D)
    k_c = ((wide(k) - k_mean) * c).to(dtype)  # (B, H, N, D)
    v_c = (wide(v) - v_mean).to(dtype)  # (B, H, N, D), written by the same kernel as k_c
    # Cov centred in fp32, then rounded (inline.inline_attention says why); g N / N is folded into
    # it
    gain = inline.eq5_gain(scale, N, scale_by_count)
    cov = (wide(matmul(k_c.transpose(-2, -1), v_c)) * (gain / c)).to(dtype)  # (B, H, D, D)
    o = wide(matmul(q, cov)) + v_mean  # Eq. 5: g N q_i^T Cov + v_mean, (B, H, N, D)
    if r is not None:
        for t, v_t in enumerate(neighbours(v, index)):
            o = o + wide(r[:, :, t, None]) * masks[t] * wide(v_t)  # Eq. 6
    return token_major(o.to(dtype)), k_c, v_c, v_mean, cov


def core_backward(do, q, k_c, v_c, r, index, masks, v_mean, cov, scale, scale_by_count):
    """-> the gradients of q, k, v (B, H, N, D) and of r (B, H, T, D), given do (token-major)."""
    N, dtype = q.shape[2], q.dtype
    c = sum_scale(dtype, N)
    dq = matmul(do, cov.transpose(-2, -1))  # (B, H, N, D)
    q_s = (wide(q) * c).to(dtype) if c != 1.0 else q
    # (B, H, D, D)
    g = (wide(matmul(q_s.transpose(-2, -1), do))
         * (inline.eq5_gain(scale, N, scale_by_count) / c)).to(dtype)
    # Cov = (1/N) (k - k_mean)^T (v - v_mean); the means' own gradients vanish because the centred
    # columns sum to zero, so dk = (v - v_mean) g^T and dv = (k - k_mean) g + mean_i do_i.
    dk = matmul(v_c, g.transpose(-2, -1))  # (B, H, N, D)
    g_c = g if c == 1.0 else (wide(g) / c).to(dtype)  # k_c carries the forward's factor c
    # o += v_mean gives the mean, (B, H, N, D)
    dv = wide(matmul(k_c, g_c)) + wide(do).mean(2, keepdim=True)
    dr = None
    if r is not None:
        for t, do_t in enumerate(neighbours(do, index, flip=True)):  # Eq. 6 transposed
            dv = dv + wide(r[:, :, t, None]) * masks[-1 - t] * wide(do_t)
        v = wide(v_c) + v_mean  # (B, H, N, D), never stored
        dr = torch.stack([(wide(do) * masks[t] * v_t).sum(2)
                          for t, v_t in enumerate(neighbours(v, index))], dim=2)
        dr = dr.to(r.dtype)  # (B, H, T, D)
    return dq, dk, dv.to(dtype), dr


# sequence.py adds its causal core's two
def core_inference(q, k, v, r, index, masks, scale, scale_by_count, dtype):
    """core_forward's output alone, q, k, v cast to dtype and laid out inside the graph: the same
    forward where no gradient is asked, without the outputs the backward keeps."""
    q, k, v = (t.to(dtype).contiguous() for t in (q, k, v))
    return core_forward(q, k, v, r, index, masks, scale, scale_by_count)[0]


def compile_graphs(*functions):
    """{(name, device kind): f compiled} for each f, one torch.compile per kind of device. On the
    CPU with inductor's C++ wrapper: the code around a graph's kernels and GEMMs (allocating its
    buffers, checking its inputs, calling each) is C++, not Python, ~40 us less a call, a twentieth
    of an attention layer at a few hundred tokens (RESULTS.md, "Level where the tokens are few"),
    compiled in the same time. Elsewhere as torch.compile makes it: on a GPU the C++ wrapper
    needs CUDA's headers, which a pip install of torch does not bring."""
    return {(f.__name__, kind): torch.compile(f, options=options) for f in functions
            for kind, options in (('cpu', {'cpp_wrapper': True}), ('accelerator', {}))}


# the graphs by name and device kind; sequence.py adds its causal core's two
COMPILED = compile_graphs(core_forward, core_backward, core_inference, inline.InLineAttention.steps)
# steps (steps_fast): a whole InLine module where no gradient is asked, every size a constant but
# the batch, one graph per module configuration and token grid
MODULE_GRAPHS = {'steps'}
_compile_error = []  # filled once if the compiler cannot run here


def compile_options():
    """torch.compile's switches: equal sizes stay two symbols, only symbolic_sizes makes one; no
    limit of 8"""
    stack = contextlib.ExitStack()
    stack.enter_context(torch._dynamo.config.patch(automatic_dynamic_shapes=False,
                                                   recompile_limit=64,
                                                   fail_on_recompile_limit_hit=True))
    if hasattr(torch.fx.experimental._config, 'use_duck_shape'):
        stack.enter_context(torch.fx.experimental._config.patch(use_duck_shape=False))
    return stack


def symbolic_sizes(args, N):
    """B, H and N compile as symbols (dims 0 and 1 of each (B, H, ...) tensor, and those of size N
    but the last); D and T stay constants, so the loops over channels vectorise with no remainder
    loop."""
    for a in args:
        if isinstance(a, torch.Tensor):
            for d in range(a.dim()):
                if ((a.dim() >= 4 and d < 2)
                        or (a.shape[d] == N and not (a.dim() >= 4 and d == a.dim() - 1))):
                    torch._dynamo.maybe_mark_dynamic(a, d)


def lead_tensor(f, args):
    """The tensor f's graph takes its sizes and device from: x of a module graph's (module, x, grid)
    (MODULE_GRAPHS), else the first, q or do (B, H, N, D)."""
    return args[1] if f.__name__ in MODULE_GRAPHS else args[0]


def signature(f, args):
    """A key for what dynamo's guards on f's graph check: device, modes, D and B, H, N as 0, 1 or
    more, the dtypes, T, the other arguments, f.chunk's count; for InLineAttention.steps
    (MODULE_GRAPHS), the module's class, the modes, the input's shape, grid and the autocast dtype.
    A guard no key foresees makes the call compile another."""
    x = lead_tensor(f, args)
    if f.__name__ in MODULE_GRAPHS:  # cheap, not whole: two configurations may share a key
        module, _, grid = args
        device = x.device.type
        return (f.__name__, type(module), x.device, x.is_inference(), torch.is_grad_enabled(),
                torch.is_inference_mode_enabled(), x.shape, x.dtype, tuple(grid),
                torch.is_autocast_enabled(device) and torch.get_autocast_dtype(device))
    chunks = (min(x.shape[2] // f.chunk, 2),) if hasattr(f, 'chunk') else ()
    return (f.__name__, x.device, x.is_inference(), torch.is_grad_enabled(), x.shape[3],
            *(min(s, 2) for s in x.shape[:3]), *chunks,
            *(a.dtype if isinstance(a, torch.Tensor) else a for a in args),
            *(a.shape[0] for a in args if isinstance(a, torch.Tensor) and a.dim() == 2))


_eager = []  # non-empty: the closed forms run eagerly (eagerly())


@contextlib.contextmanager
def eagerly():
    """Within it, the fast cores run their closed forms eagerly, not through their compiled graphs:
    how enable_fast checks a module (compiling nothing), and how the tests run them but where they
    prove the graphs (conftest.py)."""
    _eager.append(True)
    try:
        yield
    finally:
        _eager.pop()


# signatures that have a graph: their calls need no switches and no marks
_compiled_signatures = set()
COMPILE_ERRORS = (torch._dynamo.exc.BackendCompilerFailed, ImportError, OSError)


@contextlib.contextmanager
def compile_lock(key):
    """Held while the graph of signature key compiles or loads: an exclusive lock on one file per
    graph in the inductor cache folder. Processes on one machine (torchrun's ranks, parallel runs)
    that need the same graph then compile it once, the others waiting to load it, instead of writing
    the same cache files at once, which can corrupt them. The lock goes with the file's descriptor:
    a process that dies releases it."""
    name = hashlib.sha256(repr(key).encode()).hexdigest()[:24]
    path = os.path.join(cache_dir(), 'locks', f'inline-{name}.lock')
    os.makedirs(os.path.dirname(path), exist_ok=True)
    with open(path, 'a') as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)
        yield


def compiled_call(f, *args):
    """f(*args) through its compiled graph (compiled, or loaded from the inductor cache, under
    compile_lock at its first use); eagerly where the model around it is compiled (f is then traced
    into that graph) and within eagerly(); eagerly after one warning if this machine cannot
    compile."""
    # autograd is ours, not f's
    args = [a.detach() if isinstance(a, torch.Tensor) else a for a in args]
    if torch.compiler.is_compiling() or _eager or _compile_error:
        return f(*args)
    key, x = signature(f, args), lead_tensor(f, args)
    graph = COMPILED[f.__name__, 'cpu' if x.device.type == 'cpu' else 'accelerator']
    try:
        # A known key's graph runs without switches and marks, so it may not recompile (signature):
        if key in _compiled_signatures:
            try:
                with torch.compiler.set_stance('fail_on_recompile'):
                    return graph(*args)
            except RuntimeError as e:
                if 'Detected recompile' not in str(e):
                    raise
        if f.__name__ in MODULE_GRAPHS:  # x's batch a symbol (1 stays 1)
            torch._dynamo.maybe_mark_dynamic(x, 0)
        else:
            symbolic_sizes(args, N=x.shape[2])
        # a new graph, or another for a key whose guard failed
        with compile_lock(key), compile_options():
            out = graph(*args)
        _compiled_signatures.add(key)
        return out
    except COMPILE_ERRORS as e:  # e.g. no working C++ compiler, or a cache file left broken
        _compile_error.append(e)
        inner = getattr(e, 'inner_exception', None) or e.__cause__ or e  # the error dynamo wraps
        what = f"{type(inner).__name__}: {(str(inner).splitlines() or [''])[0]}"
        path = re.search(r"/\S+?\.(?:so|py|cpp)\b", what)  # the cache file it names, if any
        warnings.warn(f"kernels.py: torch.compile failed ({what}); the fast InLine core now runs "
                      f"its closed form eagerly, correct but much slower" + (f". {path[0]} in the "
                      f"inductor cache may be broken: delete it and rerun" if path else ""),
                      stacklevel=3)
    return f(*args)


class InLineCore(torch.autograd.Function):
    """core_forward's output, with core_backward as its gradient."""

    @staticmethod
    def forward(ctx, q, k, v, r, index, masks, scale, scale_by_count):
        o, k_c, v_c, v_mean, cov = compiled_call(core_forward, q, k, v, r, index, masks, scale,
                                                 scale_by_count)
        ctx.save_for_backward(q, k_c, v_c, r, index, masks, v_mean, cov)
        ctx.scale, ctx.scale_by_count = scale, scale_by_count
        return o

    @staticmethod
    def backward(ctx, do):
        q, k_c, v_c, r, index, masks, v_mean, cov = ctx.saved_tensors
        # do as o was stored: a copy only if it comes otherwise
        with torch.autocast(q.device.type, enabled=False):
            dq, dk, dv, dr = compiled_call(core_backward, token_major(do), q, k_c, v_c, r, index,
                                           masks, v_mean, cov, ctx.scale, ctx.scale_by_count)
        return dq, dk, dv, dr, None, None, None, None


def inline_core_fast(q, k, v, r, grid, scale=None, size=inline.LOCAL_SIZE, dilation=1,
                     scale_by_count=True, table=None):
    """inline.inline_core's arguments, layout and result, with and without a gradient: the same
    graph's forward (core_forward), through InLineCore where a gradient is asked. scale_by_count is
    a Python bool, part of the graphs' signature; a tensor scale joins q (s q^T Cov = (s q)^T Cov).
    Under autocast the inputs are cast to its dtype, as the reference's matmuls would be. table: a
    neighbour table (index, masks) of one's own, sequence.py's 1-D one; None: Eq. 6's on grid
    (grid_table)."""
    B, H, N, D = q.shape
    if table is None:
        inline.check_grid(N, grid)
        # built once per shape; in a graph that traces this, one of its inputs (cached_table)
        if r is not None:
            table = eq6_table(N, grid, q.device, size, dilation)
    T = table[0].shape[0] if r is not None else None  # Eq. 6's neighbours
    if r is not None and r.shape != (B, T * H * D):
        raise ValueError(f"r must hold {T} neighbour weights per channel, (B, {T}C) = "
                         f"{(B, T * H * D)}, got {tuple(r.shape)}; the fast core has no other "
                         f"Eq. 6 weights (inline.local_residual also takes them per token)")
    if isinstance(scale, torch.Tensor):
        q, scale = q * scale, 1.0
    scale = inline.attention_scale(D) if scale is None else scale
    device = q.device.type
    autocast = torch.is_autocast_enabled(device)
    dtype = torch.get_autocast_dtype(device) if autocast else q.dtype
    grad = torch.is_grad_enabled() and any(t is not None and t.requires_grad for t in (q, k, v, r))
    index, masks = table if r is not None else (None, None)
    if r is not None:
        # neighbour t before channel, (B, T*C) -> (B, H, T, D): each channel's T weights stacked,
        # which a traced graph lays out once; a transpose's copy inductor would fuse into Eq. 6's
        # pass, reading r with a stride of T, a gather per lane (RESULTS.md, "Level where the tokens
        # are few")
        r = torch.stack(r.reshape(B, H, D, -1).to(dtype).unbind(-1), dim=2)
    if not grad:
        # No gradient: one graph casts q, k, v and lays them out itself (outside, each would cost a
        # copy); outside autocast only where it is on: a graph called under the switch costs more
        with torch.autocast(device, enabled=False) if autocast else contextlib.nullcontext():
            return compiled_call(core_inference, q, k, v, r, index, masks, scale,
                                 bool(scale_by_count), dtype)
    # One memory layout for every caller, so one graph serves them all (the matmuls would copy
    # strided views)
    q, k, v = (t.to(dtype).contiguous() for t in (q, k, v))
    with torch.autocast(device, enabled=False):
        return InLineCore.apply(q, k, v, r, index, masks, scale, bool(scale_by_count))


def steps_fast(module, x, grid):
    """inline.InLineAttention.steps' fast twin where no gradient is asked (forward calls it): the
    module's steps traced whole into one compiled graph, its projections, phi, Eq. 6's predictor
    (inline.residual_weights), this file's core (core_inference, traced in) and proj. At a few
    hundred tokens InLine's arithmetic is small and what surrounds it is not: each eager operation,
    each entry into a compiled graph, the predictor's small matmuls run eagerly. One graph per layer
    pays one entry and fuses the rest into its loops (RESULTS.md, "Level where the tokens are
    few")."""
    if module.local_size:  # Eq. 6's neighbour table, built here, so that the graph reads it
        eq6_table(x.shape[1], grid, x.device, module.local_size, module.dilation)
    return compiled_call(inline.InLineAttention.steps, module, x, grid)


# --------------------------------------------------------------------------------------------------
# enable_fast: the check that the fast twin computes what the module computes, then the switch

def configuration(module):
    """What decides a module's computation besides its weights: class, plain attributes, parameter
    names."""
    # not the head count: H is symbolic in every graph
    plain = (bool, int, float, str, tuple, type(None))
    attributes = sorted((k, v) for k, v in vars(module).items()
                        if isinstance(v, plain) and k not in ('training', 'num_heads'))
    return type(module), tuple(attributes), tuple(name for name, _ in module.named_parameters())


def forward_and_gradients(module, inputs, upstream, prefix=''):
    """{quantity: tensor or None}: module's output on inputs, and with a gradient, the gradients of
    every floating-point input and parameter for the upstream gradient; with none, the output
    alone."""
    inputs = [t.detach().to(upstream.dtype).requires_grad_()
              if torch.is_tensor(t) and t.is_floating_point() else t for t in inputs]
    with torch.no_grad():
        out = {'output with no gradient': module(*inputs)}
    o = module(*inputs)
    tensors = [t for t in inputs if torch.is_tensor(t) and t.requires_grad]
    params = dict(module.named_parameters())
    grads = torch.autograd.grad(o, tensors + list(params.values()), upstream.to(o.dtype),
                                allow_unused=True)
    names = ([f'gradient of input {i}' for i in range(len(tensors))]
             + [f'gradient of {prefix}{n}' for n in params])
    return {'output': o, **out, **dict(zip(names, grads))}


def difference(exact, reference, fast):
    """Why fast is not the reference's number, or None: it may err by twice the fp32 reference's own
    error from exact (float64), plus 1e-5 of the largest value. None (no gradient reaches it) counts
    as 0."""
    if exact is None and fast is None:
        return None
    size = (exact if exact is not None else fast).abs().max().item()
    if fast is None or exact is None:
        return None if size == 0 else (f"reference {'none' if exact is None else f'{size:.1e}'}, "
                                       f"fast {'none' if fast is None else f'{size:.1e}'}")
    error, own = ((fast.double() - exact).abs().max().item(),
                  (reference.double() - exact).abs().max().item())
    bound = 2 * own + 1e-5 * size
    if not error <= bound:  # also NaN
        return (f"max |fast - float64 reference| {error:.1e}, beyond {bound:.1e} (twice the fp32 "
                f"reference's own error {own:.1e}, plus 1e-5 of its largest value {size:.1e})")
    return None


@contextlib.contextmanager
def outside_function_modes():
    """Run without the torch-function modes in force (a model built under `with
    torch.device('meta')`): a graph compiled under a mode is guarded on it, and every later call
    without it would compile again."""
    modes = [torch._C._pop_torch_function_stack()
             for _ in range(torch._C._len_torch_function_stack())]
    try:
        yield
    finally:
        for mode in reversed(modes):
            torch._C._push_on_torch_function_stack(mode)


def check_against_reference(path, module, fast, device):
    """Raise ValueError unless module's forward with fast on gives the reference's output and
    gradients (within difference), with and without a gradient, on copies whose every parameter is
    drawn away from its initial value (a change that agrees at initialisation is caught too), and
    every parameter receives a gradient: one that receives none is a change that does not reach the
    forward, which no comparison could see. The model and the random state are untouched."""
    with outside_function_modes():
        generator = torch.Generator().manual_seed(0)
        reference = copy.deepcopy(module)
        meta = {name for name, p in module.named_parameters() if p.is_meta}
        if meta:
            reference.to_empty(device='cpu')
            for b in reference.buffers():
                b.zero_()
        reference = reference.to('cpu').float()
        with torch.no_grad():  # meta parameters hold no value: drawn around 0
            for name, p in reference.named_parameters():
                start = torch.zeros_like(p) if name in meta else p.clone()
                p.copy_(start + 0.1 * (1 + start.abs()) * torch.randn(p.shape, generator=generator))
        inputs = reference.example_inputs(generator)
        reference, inputs = reference.to(device), [t.to(device) if torch.is_tensor(t) else t
                                                   for t in inputs]
        twin = copy.deepcopy(reference)
        twin.fast = fast
        with torch.no_grad():
            shape = reference(*inputs).shape
        upstream = torch.randn(shape, generator=generator).to(device)
        where, prefix = (f"{path or 'the model'} ({type(module).__name__})",
                         f"{path}." if path else '')
        with torch.random.fork_rng(devices=[device] if device.type == 'cuda' else []), \
                torch.enable_grad(), torch.autocast(device.type, enabled=False):
            exact = forward_and_gradients(copy.deepcopy(reference).double(), inputs,
                                          upstream.double(), prefix)
            unreached = [f'{prefix}{n}' for n, _ in reference.named_parameters()
                         if exact[f'gradient of {prefix}{n}'] is None]
            if unreached:
                raise ValueError(f"{where}: parameter(s) {', '.join(unreached)} receive no "
                                 f"gradient in its forward: a change that does not reach this "
                                 f"module's forward (a line in inline.InLineBase.attend reaches "
                                 f"every InLine attention; README, \"Changing the method\")")
            # parameters named by path
            ours = forward_and_gradients(reference, inputs, upstream, prefix)
            try:
                theirs = forward_and_gradients(twin, inputs, upstream, prefix)
            except Exception as e:
                # whatever the fast core cannot take: refused here, not at the first step
                theirs = (f"the fast core raised {type(e).__name__}: "
                          f"{(str(e).splitlines() or [''])[0]}")
        why = theirs if isinstance(theirs, str) else next(
            (f"{name}: {d}"
             for name in exact if (d := difference(exact[name], ours[name], theirs[name]))),
            None)
        if why:
            raise ValueError(f"the fast InLine core ({fast!r}) and the reference differ in "
                             f"{where}: {why}. Build the model with fast=None (train.py: --fast "
                             f"none), or make the change in a form the fast core follows (README, "
                             f"\"Changing the method\")")


def enable_fast(model, fast='compile', device=None, log=print):
    """Turn the switch `fast` on in every InLine module of model (inline.InLineBase): its attend
    then calls its core's fast twin (inline.fast_twin) in place of the core. Returns how many
    modules it switched. All are checked first, so a model is fast throughout or refused: a core
    without that twin (the linear baseline's) and the peers (peers.py) by name; a change the fast
    core does not follow, or a parameter that receives no gradient, by one module of each
    configuration (check_against_reference). fast: 'compile' (this file, any device) or 'triton'
    (triton_core.py, CUDA). device: where the check runs (the model's, else the CPU); log=None:
    silent."""
    if fast not in inline.FAST[1:]:
        raise ValueError(f"fast={fast!r}: enable_fast switches on one of {list(inline.FAST[1:])} "
                         f"(fast=None is the reference, inline.py)")
    # peers.py's
    peers = sorted({m.no_fast_path for m in model.modules() if hasattr(m, 'no_fast_path')})
    if peers:
        raise ValueError(f"the fast core is InLine's alone; {' and '.join(peers)} "
                         f"{'has' if len(peers) == 1 else 'have'} none: build the model with "
                         f"fast=None (train.py: --fast none)")
    modules = [(path, m) for path, m in model.named_modules() if isinstance(m, inline.InLineBase)]
    device = torch.device(device
                          or next((p.device for p in model.parameters() if not p.is_meta), 'cpu'))
    if (fast == 'triton' and device.type != 'cuda'
            and os.environ.get('TRITON_INTERPRET') != '1'):
        raise ValueError(f"fast='triton' runs InLine's Triton kernel, which needs a CUDA "
                         f"device (the model is on {device.type}); on the CPU use "
                         f"fast='compile' (torch.compile), or run with TRITON_INTERPRET=1 to "
                         f"interpret the kernel, slowly, for testing")
    for path, m in modules:
        try:
            inline.fast_twin(m.core(), fast)
        except ValueError as e:  # the linear baseline: its division has no twin
            what = ", attention='linear': vanilla linear attention" * (m.attention == 'linear')
            raise ValueError(f"{path or 'the model'} ({type(m).__name__}{what}): {e}. Build the "
                             f"model with fast=None (train.py: --fast none)") from None
    swapped = [(path, m) for path, m in modules if not m.fast]
    configurations, start = {}, time.perf_counter()  # configuration: the modules that have it
    for path, m in swapped:
        configurations.setdefault(configuration(m), []).append((path, m))
    # the closed forms eagerly: the graphs compile or load at their first use
    with eagerly():
        for path, m in (alike[0] for alike in configurations.values()):
            check_against_reference(path, m, fast, device)
    if log and swapped:
        log(f"kernels.enable_fast: {len(swapped)} module(s), {len(configurations)} "
            f"configuration(s), equal the reference with {fast!r}: "
            f"{time.perf_counter() - start:.1f} s")
    for _, m in swapped:
        m.fast = fast
    return len(swapped)

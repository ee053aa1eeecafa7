"""InLine attention's core in Triton: Eq. 5 + Eq. 6 as five kernels, beside the reference they
replace.

Han et al., "Bridging the Divide: Reconsidering Softmax and Linear Attention", NeurIPS 2024,
arXiv 2412.06590. `inline_core_triton` takes the arguments, layout and result of inline.inline_core
(read that first: this file computes the same numbers, a block of tokens at a time). Notation as in
inline.py: B batch, H heads, N tokens, D head dim, C = H*D, (h, w) the token grid after P leading
tokens; T = size^2 the weights per channel of Eq. 6, r (B, T*C); g = inline.eq5_gain(s, N);
Cov' = g N Cov.

    forward   1. eq5_covariance  per (b, h):         k_mean, v_mean, then Cov'          (Eq. 5)
              2. inline_forward  per (b, h, block):  o = q Cov' + v_mean + sum_t r_t v_t (Eq. 5, 6)
    backward  3. eq5_sums        per (b, h):         G = g Q^T dO and mean_i dO_i
              4. eq6_dr          per (b, h, t):      dr_t = sum_i dO_i v_{N_t(i)}        (Eq. 6)
              5. inline_backward per (b, h, block):  dq, dk, dv in closed form, Eq. 6 transposed

Every sum accumulates in fp32, whatever the inputs (fp32, fp16, bf16). tl.dot needs sides >= 16, so
the head dim is padded to BLOCK_D = max(16, next power of 2) by masked loads: zero columns add
nothing. It runs on CUDA, or on CPU tensors under Triton's interpreter (TRITON_INTERPRET=1 set
before triton is first imported), which is how test_triton.py proves it against the reference
without a GPU:

    python -m pytest -q test_triton.py                      # starts the interpreted run itself
    TRITON_INTERPRET=1 python -m pytest -q test_triton.py   # that run alone
    python bench.py --gpu                                   # its speed beside the other cores
"""
import torch
import triton
import triton.language as tl

import inline

# tokens a program holds at once; with warps() below, no register spills (ptxas, sm_90)
BLOCK_N = 64
INTERPRETED = triton.knobs.runtime.interpret  # as the kernels below were decorated: numpy on CPU


# --------------------------------------------------------------------------------------------------
# Eq. 6's neighbourhood on the token axis, and the offsets and loads every kernel shares

@triton.jit
def neighbour_offset(t, SIZE: tl.constexpr, dilation):
    """Neighbour t's offset (dy, dx) on the grid from its token: t = SIZE*row + col, row-major over
    the SIZE x SIZE neighbourhood as inline.py counts, centred on the token, spaced by dilation."""
    return dilation * (t // SIZE - SIZE // 2), dilation * (t % SIZE - SIZE // 2)


@triton.jit
def neighbour(n, N, P, h, w, dy, dx):
    """Tokens n (BLOCK_N,) -> the token (dy, dx) away on the grid from each, and whether it counts:
    n and it both on the (h, w) grid after the P leading tokens (never neighbours), so zero
    padding."""
    g = tl.maximum(n - P, 0)  # grid index; the leading tokens are masked by n >= P below
    y, x = g // w, g % w
    ok = (n >= P) & (n < N) & (y + dy >= 0) & (y + dy < h) & (x + dx >= 0) & (x + dx < w)
    return n + dy * w + dx, ok


@triton.jit
def load_rows(ptr, n, d, N, D, ok=None):
    """x[n, d] of one (b, h)'s (N, D) slice as an fp32 tile (BLOCK_N, BLOCK_D); 0 outside, and where
    ok (BLOCK_N,) is given and false."""
    mask = n < N
    if ok is not None:
        mask = mask & ok
    mask = mask[:, None] & (d[None, :] < D)
    return tl.load(ptr + n[:, None] * D + d[None, :], mask=mask, other=0.).to(tl.float32)


@triton.jit
def load_r(r_ptr, bh, d, D, t, T):
    """Eq. 6's weights r[b, T*c + t] of neighbour t for the head's channels c = h*D + d: (BLOCK_D,)
    read in place from r (B, T*C), since T*(h*D + d) + b*T*C = T*(bh*D + d), bh = b*H + h."""
    return tl.load(r_ptr + T * (bh * D + d) + t, mask=d < D, other=0.).to(tl.float32)


@triton.jit
def square(i, d, BLOCK_D: tl.constexpr):
    """Offsets (BLOCK_D, BLOCK_D) of the i-th padded (D, D) fp32 sum in a stack of them, row-major:
    Cov' and G, one per (b, h)."""
    return i * BLOCK_D * BLOCK_D + d[:, None] * BLOCK_D + d[None, :]


# --------------------------------------------------------------------------------------------------
# Forward

@triton.jit
def eq5_covariance(k_ptr, v_ptr, k_mean_ptr, v_mean_ptr, cov_ptr, N, D, gain,
                   BLOCK_N: tl.constexpr, BLOCK_D: tl.constexpr, PRECISION: tl.constexpr):
    """Per (b, h): k_mean, v_mean (D,) and Cov' = g N Cov = g sum_j (k_j - k_mean)(v_j - v_mean)^T,
    gain = g. Two passes over the tokens, as inline.inline_attention: the means, then the centred
    products, so Cov is the reference's sum and keeps its precision where the means are large, which
    K^T V / N - k_mean^T v_mean would cancel away. The second read of k and v is N*D elements,
    against N*D^2 multiply-adds."""
    bh = tl.program_id(0).to(tl.int64)
    k_ptr += bh * N * D
    v_ptr += bh * N * D
    n0, d = tl.arange(0, BLOCK_N), tl.arange(0, BLOCK_D)
    k_sum = tl.zeros([BLOCK_D], tl.float32)
    v_sum = tl.zeros([BLOCK_D], tl.float32)
    for start in range(0, N, BLOCK_N):  # pass 1: the means
        k_sum += tl.sum(load_rows(k_ptr, start + n0, d, N, D), axis=0)
        v_sum += tl.sum(load_rows(v_ptr, start + n0, d, N, D), axis=0)
    k_mean, v_mean = k_sum / N, v_sum / N  # (BLOCK_D,)
    cov = tl.zeros([BLOCK_D, BLOCK_D], tl.float32)
    for start in range(0, N, BLOCK_N):  # pass 2: sum_j (k_j - k_mean)(v_j - v_mean)^T
        n = start + n0
        rows = (n[:, None] < N) & (d[None, :] < D)  # padding stays 0 after centring
        # (BLOCK_N, BLOCK_D)
        k_c = tl.where(rows, load_rows(k_ptr, n, d, N, D) - k_mean[None, :], 0.)
        v_c = tl.where(rows, load_rows(v_ptr, n, d, N, D) - v_mean[None, :], 0.)
        cov += tl.dot(tl.trans(k_c), v_c, input_precision=PRECISION)  # (BLOCK_D, BLOCK_D)
    tl.store(k_mean_ptr + bh * BLOCK_D + d, k_mean)
    tl.store(v_mean_ptr + bh * BLOCK_D + d, v_mean)
    tl.store(cov_ptr + square(bh, d, BLOCK_D), gain * cov)  # Eq. 5's g N Cov, zero in the padding


@triton.jit
def inline_forward(q_ptr, v_ptr, r_ptr, v_mean_ptr, cov_ptr, o_ptr, N, D, P, h, w, dilation,
                   SIZE: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_D: tl.constexpr,
                   PRECISION: tl.constexpr):
    """Per (b, h, token block): o_i = q_i^T Cov' + v_mean, Eq. 5 summed over j (inline_attention),
    then on grid tokens Eq. 6, + sum_t r_t * v at neighbour t; r_ptr None: no Eq. 6."""
    bh = tl.program_id(0).to(tl.int64)
    n = tl.program_id(1) * BLOCK_N + tl.arange(0, BLOCK_N)
    d = tl.arange(0, BLOCK_D)
    q_ptr += bh * N * D
    v_ptr += bh * N * D
    cov = tl.load(cov_ptr + square(bh, d, BLOCK_D))  # (BLOCK_D, BLOCK_D)
    v_mean = tl.load(v_mean_ptr + bh * BLOCK_D + d)  # (BLOCK_D,)
    q = load_rows(q_ptr, n, d, N, D)  # (BLOCK_N, BLOCK_D)
    # Eq. 5, summed over j: sum_j w_ij v_j = g q_i^T sum_j (k_j - k_mean) v_j^T + v_mean
    o = tl.dot(q, cov, input_precision=PRECISION) + v_mean[None, :]
    if r_ptr is not None:  # decided when the kernel is compiled: see InLineTriton.forward
        T: tl.constexpr = SIZE * SIZE
        # a loop, not unrolled: nine gathers in flight spill registers at D = 64 (ptxas, sm_90)
        for t in range(T):
            dy, dx = neighbour_offset(t, SIZE, dilation)
            m, ok = neighbour(n, N, P, h, w, dy, dx)
            # Eq. 6
            o += load_r(r_ptr, bh, d, D, t, T)[None, :] * load_rows(v_ptr, m, d, N, D, ok)
    rows = (n[:, None] < N) & (d[None, :] < D)
    tl.store(o_ptr + bh * N * D + n[:, None] * D + d[None, :], o, mask=rows)


# --------------------------------------------------------------------------------------------------
# Backward. With k_c = k - k_mean, v_c = v - v_mean, Cov' = g sum_j k_c,j v_c,j^T and G = g Q^T dO:
#   dq = dO Cov'^T, dk = v_c G^T, dv = k_c G + mean_i dO_i (from + v_mean) + Eq. 6 transposed.
# The means' own gradients vanish: each meets a column sum of k_c or v_c, which is 0.

@triton.jit
def eq5_sums(q_ptr, do_ptr, g_ptr, do_mean_ptr, N, D, gain,
             BLOCK_N: tl.constexpr, BLOCK_D: tl.constexpr, PRECISION: tl.constexpr):
    """Per (b, h): G = g Q^T dO (D, D), gain = g, and mean_i dO_i (D,)."""
    bh = tl.program_id(0).to(tl.int64)
    q_ptr += bh * N * D
    do_ptr += bh * N * D
    n0, d = tl.arange(0, BLOCK_N), tl.arange(0, BLOCK_D)
    G = tl.zeros([BLOCK_D, BLOCK_D], tl.float32)
    do_sum = tl.zeros([BLOCK_D], tl.float32)
    for start in range(0, N, BLOCK_N):
        q = load_rows(q_ptr, start + n0, d, N, D)  # (BLOCK_N, BLOCK_D)
        do = load_rows(do_ptr, start + n0, d, N, D)
        G += tl.dot(tl.trans(q), do, input_precision=PRECISION)  # (BLOCK_D, BLOCK_D)
        do_sum += tl.sum(do, axis=0)
    tl.store(g_ptr + square(bh, d, BLOCK_D), gain * G)
    tl.store(do_mean_ptr + bh * BLOCK_D + d, do_sum / N)


@triton.jit
def eq6_dr(do_ptr, v_ptr, dr_ptr, N, D, P, h, w, dilation,
           SIZE: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_D: tl.constexpr):
    """Per (b, h, neighbour t): the gradient of Eq. 6's weights, dr[b, T*c + t] = sum_i dO_i * v at
    neighbour t of i, for the head's channels c. One program a sum: no atomics, the same every
    run."""
    bh, t = tl.program_id(0).to(tl.int64), tl.program_id(1)
    do_ptr += bh * N * D
    v_ptr += bh * N * D
    n0, d = tl.arange(0, BLOCK_N), tl.arange(0, BLOCK_D)
    dy, dx = neighbour_offset(t, SIZE, dilation)
    dr = tl.zeros([BLOCK_D], tl.float32)
    for start in range(0, N, BLOCK_N):
        m, ok = neighbour(start + n0, N, P, h, w, dy, dx)
        v_t = load_rows(v_ptr, m, d, N, D, ok)  # (BLOCK_N, BLOCK_D)
        dr += tl.sum(load_rows(do_ptr, start + n0, d, N, D) * v_t, axis=0)  # Eq. 6's dr
    T: tl.constexpr = SIZE * SIZE
    tl.store(dr_ptr + T * (bh * D + d) + t, dr, mask=d < D)


@triton.jit
def inline_backward(k_ptr, v_ptr, do_ptr, r_ptr, k_mean_ptr, v_mean_ptr, cov_ptr, g_ptr,
                    do_mean_ptr, dq_ptr, dk_ptr, dv_ptr, N, D, P, h, w, dilation,
                    SIZE: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_D: tl.constexpr,
                    PRECISION: tl.constexpr):
    """Per (b, h, token block): dq, dk, dv of the block's tokens from the (D, D) sums above (q
    itself is not needed: it reached them through G); r_ptr None: no Eq. 6."""
    bh = tl.program_id(0).to(tl.int64)
    n = tl.program_id(1) * BLOCK_N + tl.arange(0, BLOCK_N)
    d = tl.arange(0, BLOCK_D)
    for_head = bh * N * D  # where this (b, h)'s (N, D) slice starts
    sums = square(bh, d, BLOCK_D)
    cov, G = tl.load(cov_ptr + sums), tl.load(g_ptr + sums)  # (BLOCK_D, BLOCK_D) each
    do = load_rows(do_ptr + for_head, n, d, N, D)  # (BLOCK_N, BLOCK_D)
    k_c = load_rows(k_ptr + for_head, n, d, N, D) - tl.load(k_mean_ptr + bh * BLOCK_D + d)[None, :]
    v_c = load_rows(v_ptr + for_head, n, d, N, D) - tl.load(v_mean_ptr + bh * BLOCK_D + d)[None, :]
    dq = tl.dot(do, tl.trans(cov), input_precision=PRECISION)  # dO Cov'^T
    dk = tl.dot(v_c, tl.trans(G), input_precision=PRECISION)  # v_c G^T; rows past N are not stored
    dv = tl.dot(k_c, G, input_precision=PRECISION)  # k_c G
    dv += tl.load(do_mean_ptr + bh * BLOCK_D + d)[None, :]  # + mean_i dO_i, from o = ... + v_mean
    # Eq. 6 transposed: v_j reached token i = j - offset_t with weight r_t: dv_j += r_t dO_i
    if r_ptr is not None:
        T: tl.constexpr = SIZE * SIZE
        for t in range(T):
            dy, dx = neighbour_offset(t, SIZE, dilation)
            i, ok = neighbour(n, N, P, h, w, -dy, -dx)
            dv += (load_r(r_ptr, bh, d, D, t, T)[None, :]
                   * load_rows(do_ptr + for_head, i, d, N, D, ok))
    where, rows = for_head + n[:, None] * D + d[None, :], (n[:, None] < N) & (d[None, :] < D)
    tl.store(dq_ptr + where, dq, mask=rows)
    tl.store(dk_ptr + where, dk, mask=rows)
    tl.store(dv_ptr + where, dv, mask=rows)


# --------------------------------------------------------------------------------------------------
# The launches, and autograd

def block_d(D):
    """BLOCK_D: the head dim padded for tl.dot, whose sides must be powers of 2 and at least 16."""
    return max(16, triton.next_power_of_2(D))


def warps(BLOCK_D):
    """Warps per program: 8 at D = 64, where 4 spill registers in the per-block kernels
    (ptxas, sm_90)."""
    return 8 if BLOCK_D >= 64 else 4


def precision(dtype):
    """tl.dot's input precision; its operands are fp32 tiles and it sums in fp32 either way. For
    fp32 inputs exact products ('ieee'). For fp16 and bf16 ones TF32 tensor cores: TF32 holds those
    inputs exactly, in fp32's range (no overflow, as fp16 operands could), and cuts the centred k_c,
    v_c and the (D, D) sums to 10 bits, about one fp16 rounding."""
    return 'ieee' if dtype == torch.float32 else 'tf32'


class InLineTriton(torch.autograd.Function):
    """inline.inline_core as one autograd Function of the kernels above. Per (b, h), in (N, D)
    matrices with the token means subtracted, K_c = K - k_mean and V_c = V - v_mean, g =
    inline.eq5_gain(s, N), N_t(i) the token at neighbour t of token i (no term where it is off the
    grid or i is a leading token) and * per channel:

      forward   Cov' = g K_c^T V_c   (D, D)                  eq5_covariance     (Eq. 5)
                o_i  = q_i^T Cov' + v_mean                   inline_forward     (Eq. 5)
                       + sum_t r_t * v_{N_t(i)}                                 (Eq. 6)
      backward  G = g Q^T dO  (D, D),  mean_i dO_i           eq5_sums
                dr_t = sum_i dO_i * v_{N_t(i)}               eq6_dr             (Eq. 6)
                dQ = dO Cov'^T,  dK = V_c G^T,               inline_backward
                dv_j = (K_c G)_j + mean_i dO_i + sum_t r_t * dO_i where N_t(i) = j   (Eq. 6)

    The backward is closed-form, nothing of the forward replayed: the gradient of Q Cov' is
    dO Cov'^T for Q and Q^T dO for Cov', and Cov' = g K_c^T V_c passes the latter on as V_c G^T and
    K_c G. The means' own gradients vanish, each meeting a column sum of K_c or V_c, which is 0.
    Saved for it: q, k, v, r and the fp32 means and Cov'."""

    @staticmethod
    def forward(ctx, q, k, v, r, grid, s, size, dilation, scale_by_count):
        B, H, N, D = q.shape
        (h, w), BLOCK_D, PRECISION = grid, block_d(D), precision(q.dtype)
        gain = inline.eq5_gain(s, N, scale_by_count)  # Cov' = g N Cov: g times the plain sum
        q, k, v = q.contiguous(), k.contiguous(), v.contiguous()  # (B, H, N, D), one layout
        # (B, T*C), or None: no Eq. 6. Triton compiles a None argument as a constant, so the
        # kernels' `if r_ptr is not None` is decided when they are compiled: without Eq. 6 they
        # are a variant with no r at all, and no stand-in pointer is needed
        r = r.contiguous() if r is not None else None
        f32 = dict(device=q.device, dtype=torch.float32)
        k_mean, v_mean = torch.empty(B * H, BLOCK_D, **f32), torch.empty(B * H, BLOCK_D, **f32)
        cov = torch.empty(B * H, BLOCK_D, BLOCK_D, **f32)
        eq5_covariance[(B * H,)](
            k_ptr=k, v_ptr=v, k_mean_ptr=k_mean, v_mean_ptr=v_mean, cov_ptr=cov, N=N, D=D,
            gain=gain, BLOCK_N=BLOCK_N, BLOCK_D=BLOCK_D, PRECISION=PRECISION)
        o = torch.empty_like(q)  # (B, H, N, D)
        inline_forward[(B * H, triton.cdiv(N, BLOCK_N))](
            q_ptr=q, v_ptr=v, r_ptr=r, v_mean_ptr=v_mean, cov_ptr=cov, o_ptr=o, N=N, D=D,
            P=N - h * w, h=h, w=w, dilation=dilation, SIZE=size, BLOCK_N=BLOCK_N,
            BLOCK_D=BLOCK_D, PRECISION=PRECISION, num_warps=warps(BLOCK_D))
        ctx.save_for_backward(q, k, v, r, k_mean, v_mean, cov)
        ctx.grid, ctx.gain, ctx.size, ctx.dilation = grid, gain, size, dilation
        return o

    @staticmethod
    def backward(ctx, do):
        q, k, v, r, k_mean, v_mean, cov = ctx.saved_tensors
        B, H, N, D = q.shape
        (h, w), BLOCK_D, PRECISION = ctx.grid, block_d(D), precision(q.dtype)
        do = do.to(q.dtype).contiguous()  # (B, H, N, D)
        f32 = dict(device=q.device, dtype=torch.float32)
        G, do_mean = torch.empty(B * H, BLOCK_D, BLOCK_D, **f32), torch.empty(B * H, BLOCK_D, **f32)
        eq5_sums[(B * H,)](
            q_ptr=q, do_ptr=do, g_ptr=G, do_mean_ptr=do_mean, N=N, D=D, gain=ctx.gain,
            BLOCK_N=BLOCK_N, BLOCK_D=BLOCK_D, PRECISION=PRECISION)
        dr = None
        if r is not None:
            dr = torch.empty_like(r)  # (B, T*C)
            eq6_dr[(B * H, ctx.size ** 2)](
                do_ptr=do, v_ptr=v, dr_ptr=dr, N=N, D=D, P=N - h * w, h=h, w=w,
                dilation=ctx.dilation, SIZE=ctx.size, BLOCK_N=BLOCK_N, BLOCK_D=BLOCK_D)
        dq, dk, dv = torch.empty_like(q), torch.empty_like(k), torch.empty_like(v)
        inline_backward[(B * H, triton.cdiv(N, BLOCK_N))](
            k_ptr=k, v_ptr=v, do_ptr=do, r_ptr=r, k_mean_ptr=k_mean, v_mean_ptr=v_mean,
            cov_ptr=cov, g_ptr=G, do_mean_ptr=do_mean, dq_ptr=dq, dk_ptr=dk, dv_ptr=dv, N=N, D=D,
            P=N - h * w, h=h, w=w, dilation=ctx.dilation, SIZE=ctx.size, BLOCK_N=BLOCK_N,
            BLOCK_D=BLOCK_D, PRECISION=PRECISION, num_warps=warps(BLOCK_D))
        return dq, dk, dv, dr, None, None, None, None, None


def inline_core_triton(q, k, v, r, grid, scale=None, size=inline.LOCAL_SIZE, dilation=1,
                       scale_by_count=True):
    """inline.inline_core's arguments, layout and result, in Triton: q, k, v (B, H, N, D) through
    phi; r (B, T*C) or None; grid (h, w) after P = N - h*w leading tokens; scale None, a number or a
    tensor that broadcasts against (B, H, N, 1). Under autocast the inputs are cast to its dtype, as
    the reference's matmuls would be. Refused: r per token, and CPU tensors outside the
    interpreter."""
    B, H, N, D = q.shape
    inline.check_grid(N, grid)
    if not (isinstance(size, int) and size % 2 == 1 and size >= 1
            and isinstance(dilation, int) and dilation >= 1):
        raise ValueError(f"size must be an odd whole number >= 1 and dilation a whole number >= 1, "
                         f"got {size!r} and {dilation!r}")
    if r is not None and r.shape != (B, size * size * H * D):
        raise ValueError(f"r must hold {size}x{size} neighbour weights per channel, (B, "
                         f"{size * size}C) = {(B, size * size * H * D)}, got {tuple(r.shape)}; the "
                         f"Triton core has no other Eq. 6 weights (inline.local_residual also "
                         f"takes them per token)")
    if isinstance(scale, torch.Tensor):
        # autograd gives its gradient
        q, scale = (q * scale).to(q.dtype), 1.0  # s q^T Cov = (s q)^T Cov
    s = inline.attention_scale(D) if scale is None else float(scale)
    if torch.is_autocast_enabled(q.device.type):
        dtype = torch.get_autocast_dtype(q.device.type)
        q, k, v, r = (t.to(dtype) if t is not None else None for t in (q, k, v, r))
    dtypes = {t.dtype for t in (q, k, v, r) if t is not None}
    if len(dtypes) > 1 or not dtypes <= {torch.float32, torch.float16, torch.bfloat16}:
        raise ValueError(f"q, k, v and r must share one dtype, fp32, fp16 or bf16; got "
                         f"{', '.join(sorted(map(str, dtypes)))}")
    if q.device.type != 'cuda' and not INTERPRETED:
        raise RuntimeError(f"inline_core_triton runs on CUDA tensors, or on CPU ones under "
                           f"Triton's interpreter (TRITON_INTERPRET=1 set before triton is first "
                           f"imported); got {q.device.type} tensors: inline.inline_core or "
                           f"kernels.inline_core_fast run there")
    return InLineTriton.apply(q, k, v, r, tuple(grid), s, size, dilation, bool(scale_by_count))

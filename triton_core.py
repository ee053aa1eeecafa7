"""InLine attention's core in Triton: Eq. 5 + Eq. 6 as six kernels, beside the reference they
replace.

Han et al., "Bridging the Divide: Reconsidering Softmax and Linear Attention", NeurIPS 2024,
arXiv 2412.06590. `inline_core_triton` takes the arguments, layout and result of inline.inline_core
(read that first: this file computes the same numbers, a block of tokens at a time). Notation as in
inline.py: B batch, H heads, N tokens, D head dim, C = H*D, (h, w) the token grid after P leading
tokens; T = size^2 the weights per channel of Eq. 6, r (B, T*C); g = inline.eq5_gain(s, N);
Cov' = g N Cov; S the chunks of the token axis that the sums over all N tokens are split into.

    forward   1. eq5_means       per (b, h, chunk):  k_mean, v_mean                      (Eq. 5)
              2. eq5_covariance  per (b, h, chunk):  Cov', centred on those means        (Eq. 5)
              3. inline_forward  per (b, h, block):  o = q Cov' + v_mean + sum_t r_t v_t (Eq. 5, 6)
    backward  4. eq5_sums        per (b, h, chunk):  G = g Q^T dO and mean_i dO_i
              5. eq6_dr          per (b, h, t):      dr_t = sum_i dO_i v_{N_t(i)}        (Eq. 6)
              6. inline_backward per (b, h, block):  dq, dk, dv in closed form, Eq. 6 transposed

A sum over all N tokens in one program per (b, h) would leave most of a GPU idle while B*H is
under its SM count, so programs 1, 2 and 4 each sum one chunk of the tokens (split() picks the
chunks), and torch adds the S chunks' shares (add_shares). torch rather than a seventh kernel: its
sum adds the shares in fp32, in one fixed order (the same every run), in one launch, all such a
kernel would do; and the shares are small, about one (D, D) sum per SM. Every sum accumulates in
fp32, whatever the inputs (fp32, fp16, bf16). tl.dot needs sides >= 16, so the head dim is padded
to BLOCK_D = max(16, next power of 2) by masked loads: zero columns add nothing. It runs on CUDA,
or on CPU tensors under Triton's interpreter (TRITON_INTERPRET=1 set before triton is first
imported), which is how test_triton.py proves it against the reference without a GPU:

    python -m pytest -q test_triton.py                      # starts the interpreted run itself
    TRITON_INTERPRET=1 python -m pytest -q test_triton.py   # that run alone
    python bench.py --gpu                                   # its speed beside the other cores
    python bench.py --triton-cost                           # each launch costed for an H100
"""
import torch
import triton
import triton.language as tl

import inline

# tokens a program holds at once; with warps() below, no register spills (ptxas, sm_90)
BLOCK_N = 64
INTERPRETED = triton.knobs.runtime.interpret  # as the kernels below were decorated: numpy on CPU
# split(): a (b, h) of fewer tokens is summed by one program, whose loop is then about as short as
# the two launches a split adds (eq5_means's own and the shares' sum); bench.py --triton-cost
SPLIT_FROM = 1024
# the SMs split() counts for CPU tensors under the interpreter: few, so that a test's shape of
# about SPLIT_FROM tokens makes several chunks
INTERPRETED_SMS = 4


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
    Cov' and G, one per (b, h), and their chunks' shares, one per (chunk, b, h)."""
    return i * BLOCK_D * BLOCK_D + d[:, None] * BLOCK_D + d[None, :]


# --------------------------------------------------------------------------------------------------
# Forward

@triton.jit
def eq5_means(k_ptr, v_ptr, mean_shares_ptr, N, D, CHUNK,
              BLOCK_N: tl.constexpr, BLOCK_D: tl.constexpr):
    """Per (b, h, chunk of CHUNK tokens): the chunk's shares of k_mean and v_mean, sum_j k_j / N and
    sum_j v_j / N over its tokens j, (BLOCK_D,) each into mean_shares (S, 2, B*H, BLOCK_D); torch
    sums them over the S chunks."""
    bh, chunk = tl.program_id(0).to(tl.int64), tl.program_id(1)
    k_ptr += bh * N * D
    v_ptr += bh * N * D
    n0, d = tl.arange(0, BLOCK_N), tl.arange(0, BLOCK_D)
    k_sum = tl.zeros([BLOCK_D], tl.float32)
    v_sum = tl.zeros([BLOCK_D], tl.float32)
    for start in range(chunk * CHUNK, tl.minimum(chunk * CHUNK + CHUNK, N), BLOCK_N):
        k_sum += tl.sum(load_rows(k_ptr, start + n0, d, N, D), axis=0)
        v_sum += tl.sum(load_rows(v_ptr, start + n0, d, N, D), axis=0)
    row = 2 * chunk * tl.num_programs(0) + bh  # k's row in mean_shares; v's is B*H rows further
    tl.store(mean_shares_ptr + row * BLOCK_D + d, k_sum / N)  # zero in the padding
    tl.store(mean_shares_ptr + (row + tl.num_programs(0)) * BLOCK_D + d, v_sum / N)


@triton.jit
def eq5_covariance(k_ptr, v_ptr, k_mean_ptr, v_mean_ptr, cov_shares_ptr, N, D, CHUNK, gain,
                   BLOCK_N: tl.constexpr, BLOCK_D: tl.constexpr, PRECISION: tl.constexpr):
    """Per (b, h, chunk): the chunk's share of Cov' = g N Cov = g sum_j (k_j - k_mean)(v_j -
    v_mean)^T, gain = g, into cov_shares (S, B*H, BLOCK_D, BLOCK_D); torch sums them. Centred on the
    means of all N tokens (eq5_means), as inline.inline_attention: the sum of the shares is the
    reference's sum and keeps its precision where the means are large, which K^T V / N - k_mean^T
    v_mean would cancel away. This second read of k and v is N*D elements, against N*D^2
    multiply-adds."""
    bh, chunk = tl.program_id(0).to(tl.int64), tl.program_id(1)
    k_ptr += bh * N * D
    v_ptr += bh * N * D
    n0, d = tl.arange(0, BLOCK_N), tl.arange(0, BLOCK_D)
    k_mean = tl.load(k_mean_ptr + bh * BLOCK_D + d)  # (BLOCK_D,)
    v_mean = tl.load(v_mean_ptr + bh * BLOCK_D + d)
    cov = tl.zeros([BLOCK_D, BLOCK_D], tl.float32)
    for start in range(chunk * CHUNK, tl.minimum(chunk * CHUNK + CHUNK, N), BLOCK_N):
        n = start + n0
        rows = (n[:, None] < N) & (d[None, :] < D)  # padding stays 0 after centring
        # (BLOCK_N, BLOCK_D)
        k_c = tl.where(rows, load_rows(k_ptr, n, d, N, D) - k_mean[None, :], 0.)
        v_c = tl.where(rows, load_rows(v_ptr, n, d, N, D) - v_mean[None, :], 0.)
        cov += tl.dot(tl.trans(k_c), v_c, input_precision=PRECISION)  # (BLOCK_D, BLOCK_D)
    share = chunk * tl.num_programs(0) + bh
    # Eq. 5's g N Cov, this chunk's terms; zero in the padding
    tl.store(cov_shares_ptr + square(share, d, BLOCK_D), gain * cov)


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
def eq5_sums(q_ptr, do_ptr, g_shares_ptr, do_shares_ptr, N, D, CHUNK, gain,
             BLOCK_N: tl.constexpr, BLOCK_D: tl.constexpr, PRECISION: tl.constexpr):
    """Per (b, h, chunk): the chunk's shares of G = g Q^T dO (D, D), gain = g, and of mean_i dO_i
    (D,), into g_shares (S, B*H, BLOCK_D, BLOCK_D) and do_shares (S, B*H, BLOCK_D); torch sums
    them."""
    bh, chunk = tl.program_id(0).to(tl.int64), tl.program_id(1)
    q_ptr += bh * N * D
    do_ptr += bh * N * D
    n0, d = tl.arange(0, BLOCK_N), tl.arange(0, BLOCK_D)
    G = tl.zeros([BLOCK_D, BLOCK_D], tl.float32)
    do_sum = tl.zeros([BLOCK_D], tl.float32)
    for start in range(chunk * CHUNK, tl.minimum(chunk * CHUNK + CHUNK, N), BLOCK_N):
        q = load_rows(q_ptr, start + n0, d, N, D)  # (BLOCK_N, BLOCK_D)
        do = load_rows(do_ptr, start + n0, d, N, D)
        G += tl.dot(tl.trans(q), do, input_precision=PRECISION)  # (BLOCK_D, BLOCK_D)
        do_sum += tl.sum(do, axis=0)
    share = chunk * tl.num_programs(0) + bh
    tl.store(g_shares_ptr + square(share, d, BLOCK_D), gain * G)
    tl.store(do_shares_ptr + share * BLOCK_D + d, do_sum / N)


@triton.jit
def eq6_dr(do_ptr, v_ptr, dr_ptr, N, D, P, h, w, dilation,
           SIZE: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_D: tl.constexpr):
    """Per (b, h, neighbour t): the gradient of Eq. 6's weights, dr[b, T*c + t] = sum_i dO_i * v at
    neighbour t of i, for the head's channels c. One program a sum: no atomics, the same every
    run. t varies fastest along the programs, so the T programs that read one (b, h)'s dO and v
    run side by side and share them in the L2 cache."""
    T: tl.constexpr = SIZE * SIZE
    bh, t = tl.program_id(0).to(tl.int64) // T, tl.program_id(0) % T
    do_ptr += bh * N * D
    v_ptr += bh * N * D
    n0, d = tl.arange(0, BLOCK_N), tl.arange(0, BLOCK_D)
    dy, dx = neighbour_offset(t, SIZE, dilation)
    dr = tl.zeros([BLOCK_D], tl.float32)
    for start in range(0, N, BLOCK_N):
        m, ok = neighbour(start + n0, N, P, h, w, dy, dx)
        v_t = load_rows(v_ptr, m, d, N, D, ok)  # (BLOCK_N, BLOCK_D)
        dr += tl.sum(load_rows(do_ptr, start + n0, d, N, D) * v_t, axis=0)  # Eq. 6's dr
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


def split(BH, N, sms):
    """Tokens per chunk of the per-(b, h) sums (eq5_means, eq5_covariance, eq5_sums): whole blocks
    of BLOCK_N, as many blocks a chunk as still give every SM a program (B*H*S >= sms, S chunks),
    or one where even that does not. One program per (b, h) would leave most SMs idle while
    B*H < sms: 24 programs at Swin-T's stage 1, batch 8, on an H100's 132. More chunks than the
    SMs need would only add shares to sum. Under SPLIT_FROM tokens, one chunk."""
    blocks = triton.cdiv(N, BLOCK_N)
    if N < SPLIT_FROM:
        return blocks * BLOCK_N
    return BLOCK_N * min(blocks, max(1, BH * blocks // sms))


def add_shares(shares):
    """(S, ...) -> (...): the S chunks' shares of a sum added up in fp32, in one fixed order. With
    one chunk, the shares are the sum: no launch."""
    return shares[0] if len(shares) == 1 else shares.sum(0)


def sm_count(device):
    """The SMs the programs spread over: the GPU's; for CPU tensors under the interpreter,
    INTERPRETED_SMS."""
    if device.type == 'cuda':
        return torch.cuda.get_device_properties(device).multi_processor_count
    return INTERPRETED_SMS


def launch_grids(B, H, N, size, chunk):
    """Each kernel's launch grid, programs along each axis, as InLineTriton launches them (bench.py
    --triton-cost costs them); chunk: split's tokens per chunk, size: Eq. 6's side."""
    S, blocks = triton.cdiv(N, chunk), triton.cdiv(N, BLOCK_N)
    return {'eq5_means': (B * H, S), 'eq5_covariance': (B * H, S),
            'inline_forward': (B * H, blocks), 'eq5_sums': (B * H, S),
            'eq6_dr': (B * H * size * size,), 'inline_backward': (B * H, blocks)}


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

      forward   k_mean, v_mean                               eq5_means          (Eq. 5)
                Cov' = g K_c^T V_c   (D, D)                  eq5_covariance     (Eq. 5)
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
        chunk = split(B * H, N, sm_count(q.device))
        grids = launch_grids(B, H, N, size, chunk)
        S, f32 = triton.cdiv(N, chunk), dict(device=q.device, dtype=torch.float32)
        mean_shares = torch.empty(S, 2, B * H, BLOCK_D, **f32)
        eq5_means[grids['eq5_means']](
            k_ptr=k, v_ptr=v, mean_shares_ptr=mean_shares, N=N, D=D, CHUNK=chunk,
            BLOCK_N=BLOCK_N, BLOCK_D=BLOCK_D)
        # (B*H, BLOCK_D) each
        k_mean, v_mean = add_shares(mean_shares)
        cov_shares = torch.empty(S, B * H, BLOCK_D, BLOCK_D, **f32)
        eq5_covariance[grids['eq5_covariance']](
            k_ptr=k, v_ptr=v, k_mean_ptr=k_mean, v_mean_ptr=v_mean, cov_shares_ptr=cov_shares,
            N=N, D=D, CHUNK=chunk, gain=gain, BLOCK_N=BLOCK_N, BLOCK_D=BLOCK_D,
            PRECISION=PRECISION)
        cov = add_shares(cov_shares)  # (B*H, BLOCK_D, BLOCK_D): Eq. 5's g N Cov
        o = torch.empty_like(q)  # (B, H, N, D)
        inline_forward[grids['inline_forward']](
            q_ptr=q, v_ptr=v, r_ptr=r, v_mean_ptr=v_mean, cov_ptr=cov, o_ptr=o, N=N, D=D,
            P=N - h * w, h=h, w=w, dilation=dilation, SIZE=size, BLOCK_N=BLOCK_N,
            BLOCK_D=BLOCK_D, PRECISION=PRECISION, num_warps=warps(BLOCK_D))
        ctx.save_for_backward(q, k, v, r, k_mean, v_mean, cov)
        ctx.grid, ctx.gain, ctx.size, ctx.dilation = grid, gain, size, dilation
        ctx.chunk, ctx.grids = chunk, grids
        return o

    @staticmethod
    def backward(ctx, do):
        q, k, v, r, k_mean, v_mean, cov = ctx.saved_tensors
        B, H, N, D = q.shape
        (h, w), BLOCK_D, PRECISION = ctx.grid, block_d(D), precision(q.dtype)
        do = do.to(q.dtype).contiguous()  # (B, H, N, D)
        S, f32 = triton.cdiv(N, ctx.chunk), dict(device=q.device, dtype=torch.float32)
        g_shares = torch.empty(S, B * H, BLOCK_D, BLOCK_D, **f32)
        do_shares = torch.empty(S, B * H, BLOCK_D, **f32)
        eq5_sums[ctx.grids['eq5_sums']](
            q_ptr=q, do_ptr=do, g_shares_ptr=g_shares, do_shares_ptr=do_shares, N=N, D=D,
            CHUNK=ctx.chunk, gain=ctx.gain, BLOCK_N=BLOCK_N, BLOCK_D=BLOCK_D, PRECISION=PRECISION)
        # (B*H, BLOCK_D, BLOCK_D) and (B*H, BLOCK_D)
        G, do_mean = add_shares(g_shares), add_shares(do_shares)
        dr = None
        if r is not None:
            dr = torch.empty_like(r)  # (B, T*C)
            eq6_dr[ctx.grids['eq6_dr']](
                do_ptr=do, v_ptr=v, dr_ptr=dr, N=N, D=D, P=N - h * w, h=h, w=w,
                dilation=ctx.dilation, SIZE=ctx.size, BLOCK_N=BLOCK_N, BLOCK_D=BLOCK_D)
        dq, dk, dv = torch.empty_like(q), torch.empty_like(k), torch.empty_like(v)
        inline_backward[ctx.grids['inline_backward']](
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

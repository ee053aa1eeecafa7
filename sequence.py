"""Causal InLine: InLine attention on 1-D sequences, over each prefix (causal) or both ways, and its
fast core.

Han et al., "Bridging the Divide: Reconsidering Softmax and Linear Attention", NeurIPS 2024, arXiv
2412.06590, carried to sequences: Eq. 5 over each prefix 1..i, w_ij = g_i (q_i.k_j - q_i.k_mean_i) +
1/i for j <= i, 0 for j > i, in three forms (prefix sums, chunks for training, a recurrent step for
generation), and Eq. 6 over token i and the k - 1 before it, its weights from the mean of x_1..x_i,
so that no output sees a later token. SequenceAttention(dim, num_heads) is the module, called on
(B, N, C) with no grid (causal=False: Eq. 5 over all N tokens and Eq. 6 over the k tokens centred on
each); DecoderBlock the README's decoder block. inline.py holds the equations on a grid; this file
imports it and kernels.py, never the reverse.

Notation as in inline.py: B batch, H heads, N tokens, D head dim, C = H*D; i a token's count in its
prefix, g_i Eq. 5's factor s/i (scale_by_count, the released models' s/N on each prefix) or s
(Eq. 5 as printed); T = k neighbour weights per channel.
"""
import functools

import torch
import torch.nn as nn
import torch.nn.functional as F

import inline
import kernels
from kernels import matmul, neighbours, wide

# --------------------------------------------------------------------------------------------------
# The baseline and Eq. 5 over each prefix: q, k, v (B, H, N, D) through phi -> (B, H, N, D)

def causal_linear_attention(q, k, v, eps=1e-6):
    """inline.linear_attention over each prefix: q_i^T sum_{j<=i} k_j v_j^T /
    (q_i . sum_{j<=i} k_j), in chunks (causal_products)."""
    # (B, H, N, D)
    return causal_products(q, k, v)[0] / ((q * k.cumsum(2)).sum(-1, keepdim=True) + eps)


def causal_linear_attention_weights(q, k, eps=1e-6):
    """The N x N weights of causal linear attention: token i sees j <= i only."""
    w = (q @ k.transpose(-2, -1)).tril()  # (B, H, N, N)
    return w / (w.sum(dim=-1, keepdim=True) + eps)


def causal_inline_weights(q, k, scale=None, scale_by_count=True):
    """The explicit weights of Eq. 5 over each prefix, w_ij = g_i (q_i.k_j - q_i.k_mean_i) + 1/i for
    j <= i, 0 for j > i, with k_mean_i the mean of k_1..k_i and g_i = s/i or s (inline.eq5_gain);
    rows still sum to 1. Injective in q_i from token D + 1 on, as inline.inline_weights says."""
    N = q.shape[2]
    s = inline.attention_scale(q.shape[-1]) if scale is None else scale
    # the count i of row i
    n = torch.arange(1, N + 1, dtype=q.dtype, device=q.device)[:, None]  # (N, 1)
    k_mean = k.cumsum(2) / n  # (B, H, N, D): k_mean_i
    g = inline.eq5_gain(s, n, scale_by_count)  # s/i or s
    # Eq. 5, (B, H, N, N)
    w = g * (q @ k.transpose(-2, -1) - (q * k_mean).sum(-1, keepdim=True)) + 1 / n
    return w.tril()  # 0 for j > i


def causal_inline_attention(q, k, v, scale=None, scale_by_count=True):
    """inline.inline_attention over each prefix, o_i = g_i i q_i^T Cov_i + v_mean_i, from prefix
    sums of k v^T, k and v: O(N D^2) with (B, H, N, D, D) prefix sums (inline_chunked does without
    them)."""
    N = q.shape[2]
    s = inline.attention_scale(q.shape[-1]) if scale is None else scale
    # Cov_i = (1/i) sum_{j<=i} k_j v_j^T - k_mean_i v_mean_i^T: the uncentred form, since centring
    # on a mean that moves with i would revisit every earlier token. Its subtraction cancels the
    # leading digits the means share: with means m times the spread, about 2 log2(m) bits are lost,
    # most of bf16's 8 but few of fp32's 24. So the sums accumulate and subtract in fp32 (or wider)
    # and the output is rounded once.
    dtype, acc = q.dtype, torch.promote_types(q.dtype, torch.float32)
    q, k, v = q.to(acc), k.to(acc), v.to(acc)
    n = torch.arange(1, N + 1, dtype=acc, device=q.device)[:, None]  # (N, 1): the count i
    k_mean, v_mean = k.cumsum(2) / n, v.cumsum(2) / n  # (B, H, N, D): the prefix means
    kv = (k.unsqueeze(-1) * v.unsqueeze(-2)).cumsum(2)  # (B, H, N, D, D): sum_{j<=i} k_j v_j^T
    cov = kv / n[..., None] - k_mean.unsqueeze(-1) * v_mean.unsqueeze(-2)  # (B, H, N, D, D): Cov_i
    g = inline.eq5_gain(s, n, scale_by_count) * n  # (N, 1): s, or s i
    # Eq. 5 over the prefix, (B, H, N, D)
    return (g * (q.unsqueeze(-2) @ cov).squeeze(-2) + v_mean).to(dtype)


def causal_products(q, k, v, kv=None, chunk=64):
    """sum_{j<=i} (q_i.k_j) v_j for every token i, (B, H, N, D), in chunks of L tokens: the masked
    L x L products within a chunk, a running D x D sum of k v^T across chunks, which starts from kv
    (B, H, D, D), the sum over the tokens before these (None: none). Returns them and the running
    sum after the last token. O(N L D + N D^2)."""
    B, H, N, D = q.shape
    L = min(chunk, N)
    # (B, H, N/L, L, D)
    qc, kc, vc = (F.pad(t, (0, 0, 0, -N % L)).reshape(B, H, -1, L, D) for t in (q, k, v))
    # (B, H, N/L, D, D): each chunk's sum of k v^T (zero padding adds none)
    chunk_kv = kc.transpose(-2, -1) @ vc
    # (B, H, N/L, D, D): the earlier chunks' sums
    before = F.pad(chunk_kv.cumsum(2)[:, :, :-1], (0, 0, 0, 0, 1, 0))
    before = before if kv is None else before + kv.unsqueeze(2)  # and the tokens' before these
    # q_i.k_j within the chunk, j <= i
    scores = (qc @ kc.transpose(-2, -1)).tril()  # (B, H, N/L, L, L)
    out = (qc @ before + scores @ vc).reshape(B, H, -1, D)[:, :, :N]  # (B, H, N, D)
    return out, before[:, :, -1] + chunk_kv[:, :, -1]


def inline_chunked(q, k, v, scale=None, state=None, chunk=64, scale_by_count=True):
    """Causal Eq. 5 in chunks, for training: causal_inline_attention's output without its
    (B, H, N, D, D) prefix sums. state: inline_step's, the tokens before these (None: none), so a
    sequence goes on where a call stopped. Returns o (B, H, N, D) and the state after the last
    token. Sums in fp32, as in causal_inline_attention."""
    B, H, N, D = q.shape
    s = inline.attention_scale(D) if scale is None else scale
    dtype, acc = q.dtype, torch.promote_types(q.dtype, torch.float32)
    zeros = torch.zeros(B, H, D, D, dtype=acc, device=q.device)  # (B, H, D, D)
    kv, k_sum, v_sum, count = (state if state is not None
                               else (zeros, zeros[..., 0], zeros[..., 0], 0))
    q, k, v = q.to(acc), k.to(acc), v.to(acc)
    n = count + torch.arange(1, N + 1, dtype=acc, device=q.device)[:, None]  # (N, 1): the count i
    qkv, kv = causal_products(q, k, v, kv, chunk)  # (B, H, N, D): q_i^T sum_{j<=i} k_j v_j^T
    # (B, H, N, D): through i
    k_sums, v_sums = k_sum.unsqueeze(2) + k.cumsum(2), v_sum.unsqueeze(2) + v.cumsum(2)
    # g_i i q_i^T Cov_i + v_mean_i, with i Cov_i = sum_{j<=i} k_j v_j^T - i k_mean_i v_mean_i^T
    g = inline.eq5_gain(s, n, scale_by_count)  # (N, 1): s/i or s
    # Eq. 5 over the prefix
    o = g * (qkv - (q * k_sums).sum(-1, keepdim=True) * v_sums / n) + v_sums / n
    return o.to(dtype), (kv, k_sums[:, :, -1], v_sums[:, :, -1], count + N)


def inline_step(q_t, k_t, v_t, state=None, scale=None, scale_by_count=True):
    """One token of causal Eq. 5, for generation: q_t, k_t, v_t (B, H, D) -> o_t (B, H, D) and the
    state after it, (sum k v^T (B, H, D, D), sum k (B, H, D), sum v (B, H, D), count): one size
    however long the sequence, and inline_chunked's; None starts a sequence. Sums in fp32, as in
    causal_inline_attention. Eq. 6 as well: a module's step (SequenceAttention.step) adds
    sequence_residual_step."""
    s = inline.attention_scale(q_t.shape[-1]) if scale is None else scale
    dtype, acc = q_t.dtype, torch.promote_types(q_t.dtype, torch.float32)
    kv, k_sum, v_sum, count = state if state is not None else (0, 0, 0, 0)
    q_t, k_t, v_t = q_t.to(acc), k_t.to(acc), v_t.to(acc)
    kv = kv + k_t.unsqueeze(-1) * v_t.unsqueeze(-2)  # (B, H, D, D)
    k_sum, v_sum, count = k_sum + k_t, v_sum + v_t, count + 1  # (B, H, D)
    # t Cov over 1..t: sum k v^T - t k_mean v_mean^T, (B, H, D, D)
    cov = kv - (k_sum / count).unsqueeze(-1) * v_sum.unsqueeze(-2)
    g = inline.eq5_gain(s, count, scale_by_count)  # s/t or s
    # Eq. 5 over tokens 1..t, (B, H, D)
    o_t = g * (q_t.unsqueeze(-2) @ cov).squeeze(-2) + v_sum / count
    return o_t.to(dtype), (kv, k_sum, v_sum, count)


# --------------------------------------------------------------------------------------------------
# Eq. 6 on a sequence: T = k weights per channel, the last k tokens (causal) or the k centred on
# each

def prefix_means(x):
    """The mean m_i of x_1..x_i at each token i, (B, N, C) -> (B, N, C): what causal Eq. 6's weights
    are predicted from (inline.residual_weights gives one set per mean), so that no weight looks
    ahead. The sums in fp32."""
    n = torch.arange(1, x.shape[1] + 1, device=x.device)[:, None]  # (N, 1)
    return (x.to(torch.promote_types(x.dtype, torch.float32)).cumsum(1) / n).to(x.dtype)


def check_sequence_weights(r, v_shape, size, causal=False):
    """Refuse Eq. 6's weights r that do not fit v (B, H, N, D): k = size per channel, (B, k*C), and
    causal one set per token, (B, N, k*C)."""
    B, H, N, D = v_shape
    if r.shape != ((B, N, size * H * D) if causal else (B, size * H * D)):
        raise ValueError(f"r must hold {size} neighbour weights per "
                         f"channel{' and token' if causal else ''}, "
                         f"{'(B, N, kC)' if causal else '(B, kC)'}, got {tuple(r.shape)} for v of "
                         f"{tuple(v_shape)}")


def sequence_residual(v, r, size=inline.LOCAL_SIZE, dilation=1, causal=False):
    """Eq. 6 on a 1-D sequence v (B, H, N, D), T = k = size weights per channel: o_i += sum_t
    r[.., T*c + t] * v_{i + dilation*(t - (k-1))} causal (tokens i, i-1, .., i-k+1; zero before the
    start), else v_{i + dilation*(t - k//2)} (k tokens centred on i; zero outside). r (B, T*C) per
    sample, or causal (B, N, T*C) per token, predicted from the prefix mean
    (prefix_means). A depthwise 1-D convolution."""
    B, H, N, D = v.shape
    check_sequence_weights(r, v.shape, size, causal)
    left = dilation * (size - 1 if causal else size // 2)  # how far back the first tap reaches
    # (B, C, N + pad)
    planes = F.pad(v.transpose(-2, -1).reshape(B, H * D, N), (left, dilation * (size - 1) - left))
    # (B, C, N, T): v_{i + d t - left}
    windows = planes.unfold(-1, dilation * (size - 1) + 1, 1)[..., ::dilation]
    r = r.reshape(B, -1, H * D, size).transpose(1, 2)  # (B, C, N or 1, T)
    return (windows * r).sum(-1).reshape(B, H, D, N).transpose(-2, -1)  # Eq. 6, (B, H, N, D)


def sequence_residual_step(v_t, r_t, recent=None, size=inline.LOCAL_SIZE, dilation=1):
    """One token of causal Eq. 6, for generation: v_t (B, H, D) and its weights r_t (B, T*C), T =
    size, -> sum_t r_t[.., T*c + t] v_{i + dilation*(t - (k-1))} (B, H, D), and recent after it: the
    last dilation*(k-1) values (B, H, dilation*(k-1), D), all Eq. 6 reaches back to (None: none yet,
    zero before the start)."""
    B, H, D = v_t.shape
    reach = dilation * (size - 1)
    # zero before the start, as sequence_residual
    recent = v_t.new_zeros(B, H, reach, D) if recent is None else recent
    # v_{i - d(k-1)} .. v_i
    window = torch.cat([recent, v_t.unsqueeze(2)], 2)[:, :, ::dilation]  # (B, H, T, D)
    # channel c = head*D + j, tap t
    r_t = r_t.reshape(B, H, D, size).permute(0, 1, 3, 2)  # (B, H, T, D)
    # Eq. 6, (B, H, D)
    return (window * r_t).sum(2), torch.cat([recent, v_t.unsqueeze(2)], 2)[:, :, 1:]


# The cores of a sequence: inline.inline_core's arguments and result, grid None. Their fast twins
# (inline.FAST_TWINS) are at the end of this file.

def sequence_core(q, k, v, r, grid=None, scale=None, size=inline.LOCAL_SIZE, dilation=1,
                  scale_by_count=True):
    """inline.inline_core on a 1-D sequence read both ways: Eq. 5 over all N tokens, then Eq. 6 over
    the T = size tokens centred on each, r (B, T*C)."""
    check_no_grid(grid)
    o = inline.inline_attention(q, k, v, scale, scale_by_count)  # Eq. 5, (B, H, N, D)
    return o if r is None else o + sequence_residual(v, r, size, dilation)  # Eq. 6


def causal_core(q, k, v, r, grid=None, scale=None, size=inline.LOCAL_SIZE, dilation=1,
                scale_by_count=True):
    """Causal InLine: Eq. 5 over each prefix, then Eq. 6 over the token and the size - 1 before it,
    r (B, N, T*C), one set per token (from prefix_means)."""
    check_no_grid(grid)
    o = causal_inline_attention(q, k, v, scale, scale_by_count)  # Eq. 5, (B, H, N, D)
    return o if r is None else o + sequence_residual(v, r, size, dilation, causal=True)  # Eq. 6


def sequence_linear_core(q, k, v, r, grid=None, scale=None, size=inline.LOCAL_SIZE, dilation=1,
                         scale_by_count=True):
    """sequence_core with linear attention's division in place of Eq. 5: the baseline, both ways."""
    check_no_grid(grid)
    o = inline.linear_attention(q, k, v)  # division in place of Eq. 5, (B, H, N, D)
    return o if r is None else o + sequence_residual(v, r, size, dilation)  # Eq. 6


def causal_linear_core(q, k, v, r, grid=None, scale=None, size=inline.LOCAL_SIZE, dilation=1,
                       scale_by_count=True):
    """causal_core with linear attention's division in place of Eq. 5: the causal baseline."""
    check_no_grid(grid)
    o = causal_linear_attention(q, k, v)  # division over each prefix, (B, H, N, D)
    return o if r is None else o + sequence_residual(v, r, size, dilation, causal=True)  # Eq. 6


def check_no_grid(grid):
    if grid is not None:
        raise ValueError("attention over a 1-D sequence has no grid: grid must be None")


# --------------------------------------------------------------------------------------------------
# The module

class SequenceAttention(inline.InLineAttention):
    """inline.InLineAttention on a 1-D sequence: x (B, N, C) -> (B, N, C), called with no grid; its
    forward and attend are InLineAttention's, with two steps of its own: the core (core) and,
    causal, the means Eq. 6's weights come from (eq6_mean). causal: Eq. 5 over each prefix, Eq. 6
    over the last k tokens with weights from the prefix mean: no output sees a later token;
    causal=False: both ways, Eq. 5 over all N tokens and Eq. 6 over the k tokens centred on each.
    attention='linear': division in place of Eq. 5 (the baseline). The other options are
    InLineAttention's. step runs a causal module token by token, for generation. A class token
    before a sequence read both ways: InLineAttention with grid (1, L) and leading_tokens=1, whose
    3x3 neighbourhood on one row is Eq. 6 over the k = 3 neighbours centred on each (the other six
    see padding)."""
    token_dims = 1  # Eq. 6's neighbourhood is k tokens: T = k weights per channel

    def __init__(self, dim, num_heads, *, causal=True, attention='inline', allow_divergent=False,
                 **options):
        leading = options.get('leading_tokens', 0)
        if not (isinstance(leading, int) and leading == 0):
            raise ValueError(f"a 1-D sequence has no leading tokens here (got "
                             f"leading_tokens={leading!r}): for a class token before a sequence "
                             f"read both ways, use inline.InLineAttention(dim, heads, "
                             f"leading_tokens=1) with grid (1, L), L the sequence's length; a "
                             f"causal sequence has none (token 1 sees itself alone)")
        if attention not in ('inline', 'linear'):
            raise ValueError(f"unknown attention {attention!r}; choose 'inline' or 'linear'")
        if attention == 'linear':
            inline.check_linear_options(options.get('feature_map', 'identity'), allow_divergent,
                                        options.get('nonneg'))
        super().__init__(dim, num_heads, **options)
        self.causal, self.attention = bool(causal), attention

    def core(self):
        """Eq. 5 over each prefix (causal) or all N tokens, then Eq. 6 on the sequence; the
        baseline's division in Eq. 5's place."""
        if self.attention == 'linear':
            return causal_linear_core if self.causal else sequence_linear_core
        return causal_core if self.causal else sequence_core

    def eq6_mean(self, x):
        """Causal: each prefix's mean (B, N, C), so that Eq. 6's weights, one set per token, never
        look ahead; both ways: InLineBase's, the mean of all N tokens."""
        return prefix_means(x) if self.causal else super().eq6_mean(x)

    def check_input(self, x, grid):
        if grid is not None:
            raise ValueError("this attention was built for a 1-D sequence "
                             "(sequence.SequenceAttention): call it with no grid")
        # one row, no leading tokens
        return super().check_input(x, (1, x.shape[1]) if x.dim() == 3 else None)

    def example_inputs(self, generator, batch=2):
        """kernels.enable_fast's check: a sequence of 130 tokens, three chunks of the fast causal
        core."""
        return (torch.randn(batch, 2 * CHUNK + 2, self.proj.in_features, generator=generator),)

    def weights(self, x, grid=None):
        """The explicit N x N weights (B, H, N, N) this module applies to x (B, N, C): 0 above the
        diagonal when causal."""
        self.check_input(x, grid)
        q, k, _ = self.project(x if self.ape is None else x + self.ape)
        q, k = self.phi(q), self.phi(k)
        if self.attention == 'linear':
            return (causal_linear_attention_weights if self.causal
                    else inline.linear_attention_weights)(q, k)
        if self.causal:
            return causal_inline_weights(q, k, self.scale, self.scale_by_count)
        return inline.inline_weights(q, k, self.scale, self.scale_by_count)

    def step_attend(self, q_t, k_t, v_t, x_t, state=None):
        """One token of attend on a causal module, for generation: q_t, k_t, v_t (B, H, D) before
        phi, x_t (B, C) the token Eq. 6's weights are predicted from. Returns o_t (B, H, D) and the
        state after it: inline_step's, the running sum of x (B, C) for Eq. 6's prefix mean and the
        last dilation*(k-1) values (sequence_residual_step); one size however long the sequence.
        None starts a sequence. attend's recurrent form: a change to attend is made here too
        (test_module_step_with_eq6_equals_the_whole_sequence holds the two equal)."""
        if not self.causal or self.attention != 'inline':
            raise ValueError("a step is causal InLine's: build the module with causal=True and "
                             "attention='inline'")
        eq5, x_sum, recent = state if state is not None else (None, 0, None)
        q, k = self.phi(q_t), self.phi(k_t)  # (B, H, D)
        o_t, eq5 = inline_step(q, k, v_t, eq5, self.scale, self.scale_by_count)  # Eq. 5, (B, H, D)
        if self.residual is None:
            return o_t, (eq5, x_sum, recent)
        # (B, C), fp32 as prefix_means
        x_sum = x_sum + x_t.to(torch.promote_types(x_t.dtype, torch.float32))
        # (B, T*C) from the prefix mean
        r_t = inline.residual_weights(self.residual, (x_sum / eq5[3]).to(x_t.dtype))
        # Eq. 6
        local, recent = sequence_residual_step(v_t, r_t, recent, self.local_size, self.dilation)
        return o_t + local, (eq5, x_sum, recent)

    def step(self, x_t, state=None):
        """One token through a causal module, for generation: x_t (B, C) -> (B, C) and the state
        after it (step_attend), equal to forward's output at that token given the same tokens before
        it."""
        if self.ape is not None:
            raise ValueError("a step has no position embedding (ape): it is made for a fixed "
                             "number of tokens")
        self.check_input(x_t.unsqueeze(1), None)
        q, k, v = self.project(x_t.unsqueeze(1))  # (B, H, 1, D)
        o_t, state = self.step_attend(q[:, :, 0], k[:, :, 0], v[:, :, 0], x_t, state)  # (B, H, D)
        return self.proj(o_t.reshape(x_t.shape)), state  # (B, C)


class DecoderBlock(nn.Module):
    """The README's decoder block, pre-norm: x + attn(norm1(x)), then x + mlp(norm2(x)), on
    (B, N, C); token i sees tokens 1..i. attn: an attention module of one's own, (B, N, C) ->
    (B, N, C) (the recall study's); None: SequenceAttention(dim, heads, causal=True, **options).
    kernels.enable_fast(block) switches on the fast causal core."""

    def __init__(self, dim, heads, mlp_ratio=4, attn=None, **options):
        super().__init__()
        attn = SequenceAttention(dim, heads, causal=True, **options) if attn is None else attn
        self.norm1, self.attn = nn.LayerNorm(dim), attn
        self.norm2 = nn.LayerNorm(dim)
        self.mlp = nn.Sequential(nn.Linear(dim, mlp_ratio * dim), nn.GELU(),
                                 nn.Linear(mlp_ratio * dim, dim))

    def forward(self, x):  # x (B, N, C)
        x = x + self.attn(self.norm1(x))  # token i sees tokens 1..i
        return x + self.mlp(self.norm2(x))


def sequence_table(N, device, size=inline.LOCAL_SIZE, dilation=1, causal=False, flip=False):
    """kernels.grid_table's index and masks on a 1-D sequence, neighbour t at offset dilation *
    (t - (size - 1)) causal (the token and the size - 1 before it), else dilation * (t - size // 2),
    as sequence_residual counts them; flip: the opposite offsets, the transposed shift of Eq. 6's
    backward."""
    with torch.inference_mode(False):
        n = torch.arange(N, device=device)
        offsets = [(-1 if flip else 1) * dilation * (t - (size - 1 if causal else size // 2))
                   for t in range(size)]
        index = torch.stack([(n + o).clamp(0, N - 1) for o in offsets])  # (T, N)
        masks = torch.stack([(n + o >= 0) & (n + o < N) for o in offsets])  # (T, N)
        return index, masks.float()[:, :, None]  # (T, N), (T, N, 1)


# --------------------------------------------------------------------------------------------------
# The fast causal core, causal_core's twin: Eq. 5 over each prefix in chunks
# (inline_chunked), Eq. 6 over the last k tokens with one weight per token. kernels.py's design: two
# graphs, the backward in closed form, through kernels.compiled_call (its compile switches, cache
# lock and warning).

# tokens per chunk: the CHUNK x CHUNK products cost N CHUNK D per head, the running D x D sums N
# D^2 / CHUNK
CHUNK = 64


def scan_dtype(dtype, scale_by_count=True):
    """The dtype of the scans' GEMM operands: the input's, but fp32 for fp16, whose 5-bit exponent
    cannot hold the 1/i factors of long sequences nor the uncentred sums' cancellation, and fp32
    under the printed factor s (not scale_by_count): without s/i the uncentred sums' bf16 rounding
    reaches the output i times larger, several times the reference's own error by 131 tokens
    (test_fast_causal_core_low_precision_within_twice_the_references)."""
    return torch.float32 if dtype == torch.float16 or not scale_by_count else dtype


def causal_scan(q, k, v, reverse=False):
    """sum_{j<=i} (q_i.k_j) v_j (reverse: j >= i) for every i, in fp32: within a chunk the masked
    products as GEMMs of scan_dtype (bf16's accumulate in fp32, then round once); across chunks the
    D x D sums of k v^T in fp32. q, k, v (B, H, N, D), N a multiple of CHUNK."""
    B, H, N, D = q.shape
    qc, kc, vc = (t.reshape(B, H, N // CHUNK, CHUNK, D) for t in (q, k, v))  # (B, H, N/L, L, D)
    chunk_kv = wide(matmul(kc.transpose(-2, -1), vc))  # (B, H, N/L, D, D)
    total = chunk_kv.cumsum(2)  # (B, H, N/L, D, D)
    # the later (earlier) chunks' sums; the earlier ones shifted, not subtracted, so no bit depends
    # on a later token
    other = total[:, :, -1:] - total if reverse else F.pad(total[:, :, :-1], (0, 0, 0, 0, 1, 0))
    scores = matmul(qc, kc.transpose(-2, -1))  # (B, H, N/L, L, L)
    scores = scores.triu() if reverse else scores.tril()
    return (wide(qc) @ other + wide(matmul(scores, vc))).reshape(B, H, N, D)


def causal_forward(q, k, v, r, index, masks, scale, scale_by_count):
    """-> o (B, H, N, D), and for the backward k and v less their first token (B, H, N, D), rounded
    to scan_dtype, and v's first token (B, H, 1, D). r (B, H, T, N, D): Eq. 6's weights, one set
    per token."""
    N, dtype, mm = q.shape[2], q.dtype, scan_dtype(q.dtype, scale_by_count)
    n = torch.arange(1, N + 1, device=q.device, dtype=torch.float32)[:, None]  # (N, 1): the count i
    # Cov_i and o_i do not change when a constant is taken from every k (or v); taking the first
    # token's, which every output may see, makes the uncentred sums of k v^T as small as the spread,
    # not the means (causal_inline_attention says what the means would cost), and keeps the GEMMs'
    # operands small in bf16.
    v_first = wide(v[:, :, :1])  # (B, H, 1, D)
    k_s, v_s = (wide(k) - wide(k[:, :, :1])).to(mm), (wide(v) - v_first).to(mm)  # (B, H, N, D)
    # prefix means, shifted
    k_mean, v_mean = wide(k_s).cumsum(2) / n, wide(v_s).cumsum(2) / n  # (B, H, N, D)
    # Eq. 5's factor a_i, s/i or s
    a = inline.eq5_gain(scale, n, scale_by_count)  # (N, 1) or a number
    o = (a * causal_scan(q.to(mm), k_s, v_s)
         - a * n * (wide(q) * k_mean).sum(-1, keepdim=True) * v_mean)
    o = o + v_mean + v_first  # Eq. 5 over the prefix: a_i i q_i^T Cov_i + v_mean_i
    if r is not None:
        for t, v_t in enumerate(neighbours(v, index)):
            o = o + wide(r[:, :, t]) * masks[t] * wide(v_t)  # Eq. 6 over the last k tokens
    return o.to(dtype), k_s, v_s, v_first


def causal_backward(do, q, k_s, v_s, v_first, r, index, masks, index_t, masks_t, scale,
                    scale_by_count):
    """-> the gradients of q, k, v (B, H, N, D) and of r (B, H, T, N, D), given do = dLoss/do.
    With a_i Eq. 5's factor (s/i, or s where not scale_by_count) and c_i = a_i i (s, or s i), o_i =
    a_i sum_{j<=i} (q_i.k_j) v_j - c_i (q_i.k_mean_i) v_mean_i + v_mean_i: the sum's gradients are
    three more scans, the means' a reverse prefix sum."""
    N, dtype, mm = q.shape[2], q.dtype, scan_dtype(q.dtype, scale_by_count)
    n = torch.arange(1, N + 1, device=q.device, dtype=torch.float32)[:, None]  # (N, 1)
    k_mean, v_mean = wide(k_s).cumsum(2) / n, wide(v_s).cumsum(2) / n  # (B, H, N, D), recomputed
    g, q_w, do = wide(do), wide(q), do.to(mm)
    a = inline.eq5_gain(scale, n, scale_by_count)  # (N, 1) or a number: s/i or s
    c = a * n  # (N, 1): s, or s i
    qa = (q_w * a).to(mm)  # (B, H, N, D): a_i q_i
    gv = (g * v_mean).sum(-1, keepdim=True)  # (B, H, N, 1)
    dq = a * causal_scan(do, v_s, k_s) - c * gv * k_mean
    # sum over i >= j: how a prefix mean reaches token j
    later = lambda x: x.flip(2).cumsum(2).flip(2)  # noqa: E731
    dk = causal_scan(v_s, do, qa, reverse=True) + later(-c * gv * q_w / n)
    dv = causal_scan(k_s, qa, do, reverse=True) + later(
        (1 - c * (q_w * k_mean).sum(-1, keepdim=True)) * g / n)
    dr = None
    if r is not None:
        # Eq. 6 transposed: token j feeds token j - offset_t with weight r_t
        for t in range(r.shape[2]):
            dv = dv + (wide(r[:, :, t]) * g)[:, :, index_t[t]] * masks_t[t]
        v = wide(v_s) + v_first  # (B, H, N, D), never stored
        dr = torch.stack([g * masks[t] * v_t for t, v_t in enumerate(neighbours(v, index))], dim=2)
        dr = dr.to(r.dtype)  # (B, H, T, N, D)
    return dq.to(dtype), dk.to(dtype), dv.to(dtype), dr


class CausalCore(torch.autograd.Function):
    """causal_forward's output, with causal_backward as its gradient."""

    @staticmethod
    def forward(ctx, q, k, v, r, scale, size, dilation, scale_by_count):
        B, H, N, D = q.shape
        M = N + -N % CHUNK  # whole chunks: zero tokens at the end, which no earlier output sees
        q, k, v = (F.pad(t, (0, 0, 0, M - N)).contiguous() for t in (q, k, v))  # (B, H, M, D)
        index = masks = index_t = masks_t = None
        if r is not None:
            table = functools.partial(kernels.cached_table, sequence_table, M, q.device)
            index, masks = table(size, dilation, True)
            index_t, masks_t = table(size, dilation, True, True)
            # (B, M, H, D, T): r's channel T*c + t
            r = F.pad(r, (0, 0, 0, M - N)).reshape(B, M, H, D, size)
            r = r.permute(0, 2, 4, 1, 3).contiguous()  # (B, H, T, M, D)
        o, k_s, v_s, v_first = kernels.compiled_call(causal_forward, q, k, v, r, index, masks,
                                                     scale, scale_by_count)
        ctx.save_for_backward(q, k_s, v_s, v_first, r, index, masks, index_t, masks_t)
        ctx.scale, ctx.scale_by_count = scale, scale_by_count
        return o[:, :, :N]

    @staticmethod
    def backward(ctx, do):
        q, k_s, v_s, v_first, r, index, masks, index_t, masks_t = ctx.saved_tensors
        B, H, M, D = q.shape
        N = do.shape[2]
        with torch.autocast(q.device.type, enabled=False):
            do = F.pad(do, (0, 0, 0, M - N)).contiguous()  # (B, H, M, D)
            dq, dk, dv, dr = kernels.compiled_call(causal_backward, do, q, k_s, v_s, v_first, r,
                                                   index, masks, index_t, masks_t, ctx.scale,
                                                   ctx.scale_by_count)
        # (B, N, T*C)
        dr = dr.permute(0, 3, 1, 4, 2).reshape(B, M, -1)[:, :N] if dr is not None else None
        return dq[:, :, :N], dk[:, :, :N], dv[:, :, :N], dr, None, None, None, None


def sequence_core_fast(q, k, v, r, grid=None, scale=None, size=inline.LOCAL_SIZE, dilation=1,
                       scale_by_count=True):
    """sequence_core's fast twin, its arguments, layout and result: kernels.py's core with the 1-D
    neighbour table."""
    check_no_grid(grid)
    if r is not None:
        check_sequence_weights(r, v.shape, size)
        table = kernels.cached_table(sequence_table, q.shape[2], q.device, size, dilation)
    return kernels.inline_core_fast(q, k, v, r, None, scale, size, dilation, scale_by_count,
                                    table=table if r is not None else None)


def causal_core_fast(q, k, v, r, grid=None, scale=None, size=inline.LOCAL_SIZE, dilation=1,
                     scale_by_count=True):
    """causal_core's fast twin, its arguments, layout and result: the causal core (CausalCore).
    scale, autocast and a compiled model as kernels.inline_core_fast."""
    check_no_grid(grid)
    if r is not None:
        check_sequence_weights(r, v.shape, size, causal=True)
    if isinstance(scale, torch.Tensor):  # as kernels.inline_core_fast: s q^T Cov = (s q)^T Cov
        q, scale = q * scale, 1.0
    scale = inline.attention_scale(q.shape[-1]) if scale is None else scale
    device = q.device.type
    if torch.is_autocast_enabled(device):
        dtype = torch.get_autocast_dtype(device)
        q, k, v, r = (t.to(dtype) if t is not None else None for t in (q, k, v, r))
    with torch.autocast(device, enabled=False):
        return CausalCore.apply(q, k, v, r, scale, size, dilation, bool(scale_by_count))


causal_forward.chunk = causal_backward.chunk = CHUNK  # kernels.signature keys the chunk count
kernels.COMPILED.update(kernels.compile_graphs(causal_forward, causal_backward))

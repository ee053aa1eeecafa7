"""Causal InLine (sequence.py): causal Eq. 5's three forms against the explicit causal weights in float64,
Eq. 6 over the last k tokens, the module's no-look-ahead, and the fast causal core.
"""
import functools

import pytest
import torch
import torch.nn.functional as F

import inline
import kernels
import sequence
from test_inline import BF16_ROUNDING, CUDA, NAMES, assert_fp32_close, core_inputs, run_core
from conftest import qkv

# ===================================================================================================
# InLine on sequences (sequence.py): causal Eq. 5's three forms against the explicit causal weights
# in float64, Eq. 6 over the last k tokens against a loop, the whole module's no-look-ahead, and the fast
# causal core

def sequence_inputs(B, H, N, D, T=3, dtype=torch.float64, seed=0):
    """q, k, v (B, H, N, D) with non-zero means (what the uncentred prefix sums cost), r (B, N, k*C) per
    token, do."""
    g = torch.Generator().manual_seed(seed)
    q, k, v, do = (torch.randn(B, H, N, D, generator=g, dtype=dtype) for _ in range(4))
    k = k + torch.randn(B, H, 1, D, generator=g, dtype=dtype)
    v = v + 0.5
    r = 0.3 * torch.randn(B, N, T * H * D, generator=g, dtype=dtype)
    return q, k, v, r, do


def stepped(q, k, v, state=None, scale_by_count=True):
    """inline_step over every token of q, k, v (B, H, N, D): the outputs (B, H, N, D) and the last state."""
    outs = []
    for t in range(q.shape[2]):
        o_t, state = sequence.inline_step(q[:, :, t], k[:, :, t], v[:, :, t], state,
                                          scale_by_count=scale_by_count)
        outs.append(o_t)
    return torch.stack(outs, dim=2), state


@pytest.mark.parametrize('scale_by_count', [True, False], ids=['s-over-i', 'printed-s'])
def test_causal_weights_match_the_formula_element_by_element(scale_by_count):
    """Each prefix 1..i written out by hand: w_ij = g_i (q_i.k_j - q_i.k_mean_i) + 1/i, g_i = s/i or s
    (printed)."""
    q, k, _ = qkv(1, 1, 7, 4)
    w = sequence.causal_inline_weights(q, k, scale_by_count=scale_by_count)
    s = 4 ** -0.5
    for i in range(7):
        k_mean = k[0, 0, :i + 1].mean(0)
        g = s / (i + 1) if scale_by_count else s
        for j in range(7):
            expected = g * (q[0, 0, i] @ k[0, 0, j] - q[0, 0, i] @ k_mean) + 1 / (i + 1) if j <= i else 0.0
            assert abs(w[0, 0, i, j].item() - float(expected)) < 1e-14
    torch.testing.assert_close(w.sum(-1), torch.ones(1, 1, 7, dtype=torch.float64), rtol=0, atol=1e-14)
    # 2q gives other weights in every row with two tokens or more
    assert (sequence.causal_inline_weights(2 * q, k, scale_by_count=scale_by_count)
            - w)[0, 0, 1:].abs().amax(-1).min() > 1e-3


@pytest.mark.parametrize('scale_by_count', [True, False], ids=['s-over-i', 'printed-s'])
def test_causal_injectivity_needs_d_plus_1_tokens(scale_by_count):
    """Row i is injective in q_i only where the centred keys k_j - k_mean_i (j <= i) span all D dimensions,
    i >= D + 1: a change of q_i orthogonal to all of them (their null space, which exists while i <= D) leaves
    row i as it was, and at i >= D + 1 there is no such change: the same step along the last right-singular
    vector moves the row."""
    D = 6
    q, k, _ = qkv(1, 1, 12, D)
    for i in range(1, 12):  # row i counts i + 1 tokens
        centred = k[0, 0, :i + 1] - k[0, 0, :i + 1].mean(0)  # (i + 1, D)
        direction = torch.linalg.svd(centred).Vh[-1]  # (D,): in the null space while i + 1 <= D
        moved = q.clone()
        moved[0, 0, i] += 3.0 * direction
        w, w_moved = (sequence.causal_inline_weights(t, k, scale_by_count=scale_by_count)[0, 0, i]
                      for t in (q, moved))
        change = (w - w_moved).abs().max().item()
        assert change < 1e-14 if i + 1 <= D else change > 1e-4, (i + 1, change)


@pytest.mark.parametrize('scale_by_count', [True, False], ids=['s-over-i', 'printed-s'])
@pytest.mark.parametrize('N', [1, 37, 131], ids=['N1', 'N37', 'N131'])
def test_causal_forms_equal_the_explicit_weights(N, scale_by_count):
    """Prefix sums (inline_attention), chunks of 16 (inline_chunked, a ragged last chunk) and the recurrent
    step: outputs and the gradients of q, k, v against w @ v with the explicit causal weights, in float64,
    under either factor of Eq. 5 (the explicit weights are the hand formula:
    test_causal_weights_match_the_formula_element_by_element)."""
    q, k, v, _, do = sequence_inputs(2, 3, N, 8)
    c = dict(scale_by_count=scale_by_count)
    forms = {'explicit': lambda q, k, v: sequence.causal_inline_weights(q, k, **c) @ v,
             'prefix sums': lambda q, k, v: sequence.causal_inline_attention(q, k, v, **c),
             'chunked': lambda q, k, v: sequence.inline_chunked(q, k, v, chunk=16, **c)[0],
             'step': lambda q, k, v: stepped(q, k, v, **c)[0]}
    results = {}
    for name, form in forms.items():
        leaves = [t.clone().requires_grad_() for t in (q, k, v)]
        o = form(*leaves)
        results[name] = [o, *torch.autograd.grad(o, leaves, do)]
    for name in list(forms)[1:]:
        for what, a, b in zip(['o', 'dq', 'dk', 'dv'], results[name], results['explicit']):
            torch.testing.assert_close(a, b, rtol=0, atol=1e-11, msg=f"{name}, {what}")


def test_a_sequence_split_in_two_and_resumed_from_its_state_equals_the_whole():
    """The chunked form's state goes on to a second call, or to recurrent steps (a prompt, then generation):
    the outputs and the final state equal one pass over the whole sequence."""
    q, k, v, _, _ = sequence_inputs(2, 2, 61, 8)
    whole, whole_state = sequence.inline_chunked(q, k, v, chunk=8)
    first, state = sequence.inline_chunked(q[:, :, :23], k[:, :, :23], v[:, :, :23], chunk=8)
    second, state = sequence.inline_chunked(q[:, :, 23:], k[:, :, 23:], v[:, :, 23:], state=state, chunk=16)
    generated, step_state = stepped(q[:, :, 40:], k[:, :, 40:], v[:, :, 40:],
                                    sequence.inline_chunked(q[:, :, :40], k[:, :, :40], v[:, :, :40])[1])
    torch.testing.assert_close(torch.cat([first, second], 2), whole, rtol=0, atol=1e-12)
    torch.testing.assert_close(generated, whole[:, :, 40:], rtol=0, atol=1e-12)
    for a, b, c in zip(state, step_state, whole_state):
        torch.testing.assert_close(torch.as_tensor(a), torch.as_tensor(c), rtol=0, atol=1e-11)
        torch.testing.assert_close(torch.as_tensor(b), torch.as_tensor(c), rtol=0, atol=1e-11)
    assert state[3] == 61 and state[0].shape == (2, 2, 8, 8)  # the count, and one D x D sum per head


def state_numel(state):
    """Floats a step's state holds: every tensor in it, however nested."""
    if isinstance(state, (tuple, list)):
        return sum(state_numel(t) for t in state)
    return state.numel() if isinstance(state, torch.Tensor) else 0


@pytest.mark.parametrize('options', [dict(), dict(feature_map='one_plus_elu', scale_by_count=False),
                                     dict(local_size=5, dilation=2), dict(eq6='none')],
                         ids=['eq6', 'one_plus_elu-printed-s', 'eq6-k5-dilation2', 'no-eq6'])
def test_module_step_with_eq6_equals_the_whole_sequence(options):
    """Generation runs the trained module: SequenceAttention(causal=True).step token by token gives forward's
    output on the whole sequence, Eq. 6 included (its weights from the running mean of x, its last
    dilation*(k-1) values kept), in float64; the state's size does not grow with the tokens."""
    torch.manual_seed(0)
    attn = sequence.SequenceAttention(24, 3, causal=True, **options).double()
    x = torch.randn(2, 23, 24, dtype=torch.float64)
    whole, state, sizes = attn(x), None, []
    steps = []
    for t in range(23):
        y_t, state = attn.step(x[:, t], state)
        steps.append(y_t)
        sizes.append(state_numel(state))
    torch.testing.assert_close(torch.stack(steps, 1), whole, rtol=0, atol=1e-12)
    assert len(set(sizes[1:])) == 1, sizes  # from the second token on, one size
    with pytest.raises(ValueError, match="a step is causal InLine's"):
        sequence.SequenceAttention(24, 3, causal=False).double().step(x[:, 0])


def test_causal_linear_attention_matches_its_weights():
    q, k, v = qkv(2, 2, 45, 8)
    q, k = F.relu(q), F.relu(k)
    w = sequence.causal_linear_attention_weights(q, k, eps=0)
    assert w.triu(1).abs().max() == 0
    torch.testing.assert_close(sequence.causal_linear_attention(q, k, v, eps=0), w @ v, rtol=0, atol=1e-12)


def sequence_residual_loop(v, r, size, dilation, causal):
    """Eq. 6 on a sequence, one token, channel and tap at a time."""
    B, H, N, D = v.shape
    out = torch.zeros_like(v)
    for b in range(B):
        for i in range(N):
            for t in range(size):
                j = i + dilation * (t - (size - 1 if causal else size // 2))
                if 0 <= j < N:
                    for h in range(H):
                        for d in range(D):
                            c = h * D + d
                            weight = r[b, i, size * c + t] if causal else r[b, size * c + t]
                            out[b, h, i, d] += weight * v[b, h, j, d]
    return out


@pytest.mark.parametrize('size,dilation,causal', [(3, 1, True), (3, 2, True), (1, 1, True), (5, 1, False),
                                                  (3, 2, False)],
                         ids=['k3-causal', 'k3-d2-causal', 'k1-causal', 'k5-centred', 'k3-d2-centred'])
def test_eq6_on_a_sequence_against_an_explicit_loop(size, dilation, causal):
    q, k, v, r, _ = sequence_inputs(2, 2, 11, 3, T=size)
    r = r if causal else r[:, 0]  # (B, N, kC) per token, or (B, kC) per sample
    expected = sequence_residual_loop(v, r, size, dilation, causal)
    torch.testing.assert_close(sequence.sequence_residual(v, r, size, dilation, causal), expected,
                               rtol=0, atol=1e-13)


def test_causal_eq6_weights_come_from_the_prefix_mean():
    torch.manual_seed(0)
    mlp = inline.residual_mlp(8, 2, T=3).double()
    x = torch.randn(2, 9, 8, dtype=torch.float64)
    r = inline.residual_weights(mlp, sequence.prefix_means(x))
    assert r.shape == (2, 9, 24)
    for i in range(9):
        torch.testing.assert_close(r[:, i], inline.residual_weights(mlp, x[:, :i + 1].mean(1)), rtol=0,
                                   atol=1e-14)


def no_look_ahead(module, x, j):
    """module(x) and module(x with token j changed): outputs before j must be equal bit for bit."""
    changed = x.clone()
    changed[:, j] += torch.randn(x.shape[0], x.shape[2], generator=torch.Generator().manual_seed(1),
                                 dtype=x.dtype)
    y, z = module(x), module(changed)
    assert torch.equal(y[:, :j], z[:, :j]), \
        f"token {j} changed an earlier output by {(y - z)[:, :j].abs().max():.1e}"
    assert (y[:, j] - z[:, j]).abs().max() > 1e-3  # and it does change its own


@pytest.mark.parametrize('attention,kernel', [('inline', 'identity'), ('linear', 'one_plus_elu')],
                         ids=['inline', 'linear-one_plus_elu'])
def test_causal_module_never_looks_ahead(attention, kernel):
    """The whole module with Eq. 6 (prefix-mean weights, the last 3 tokens): change token j, and every output
    before j is unchanged exactly, in float64 and float32."""
    torch.manual_seed(0)
    for dtype in (torch.float64, torch.float32):
        attn = sequence.SequenceAttention(24, 3, causal=True, attention=attention, feature_map=kernel).to(dtype)
        x = torch.randn(2, 45, 24, dtype=dtype)
        for j in (0, 17, 44):
            no_look_ahead(attn, x, j)
    assert attn.residual[2].out_channels == 3 * 24  # k = 3 weights per channel on a sequence, not k^2


def test_decoder_block_never_looks_ahead():
    """sequence.DecoderBlock, the README's decoder block: (B, N, C) in and out, and no output sees a later
    token."""
    torch.manual_seed(0)
    block = sequence.DecoderBlock(32, 4).double()
    x = torch.randn(2, 19, 32, dtype=torch.float64)
    assert block(x).shape == x.shape
    for j in (0, 9, 18):
        no_look_ahead(block, x, j)


def test_sequence_modules_and_their_errors():
    """causal=True and sequence=True take (B, N, C) with no grid; the bidirectional one does look both ways; a
    grid module needs its grid; bad combinations are refused, saying what is allowed."""
    torch.manual_seed(0)
    x = torch.randn(2, 13, 16)
    bidirectional = sequence.SequenceAttention(16, 2, causal=False)
    y = bidirectional(x)
    changed = x.clone()
    changed[:, -1] += 1
    assert y.shape == (2, 13, 16) and (bidirectional(changed)[:, 0] - y[:, 0]).abs().max() > 0
    assert bidirectional.weights(x).shape == (2, 2, 13, 13)
    assert sequence.SequenceAttention(16, 2, causal=True).weights(x).triu(1).abs().max() == 0
    with pytest.raises(ValueError, match=r"built for a 1-D sequence \(sequence.SequenceAttention\): "
                                         r"call it with no grid"):
        sequence.SequenceAttention(16, 2, causal=True)(x, (1, 13))
    with pytest.raises(ValueError, match=r"built for a token grid: pass grid=\(h, w\), "
                                         r"or use sequence.SequenceAttention"):
        inline.InLineAttention(16, 2)(x)
    q, k, v, r, _ = sequence_inputs(2, 2, 13, 8)
    with pytest.raises(ValueError, match=r"attention over a 1-D sequence has no grid: grid must be None"):
        sequence.causal_core(q, k, v, r, (1, 13))
    with pytest.raises(ValueError, match=r"r must hold 3 neighbour weights per channel and token, "
                                         r"\(B, N, kC\)"):
        sequence.causal_core(q, k, v, r[:, 0], None)
    with pytest.raises(ValueError, match=r"r must hold 3 neighbour weights per channel, \(B, kC\)"):
        sequence.sequence_core(q, k, v, r, None)




# (B, H, N, D): odd lengths, ragged last chunks (the fast core's are 64 tokens); B, H, N are symbols of one
# graph
CAUSAL_SHAPES = [(2, 3, 131, 32), (3, 2, 200, 32)]
CAUSAL_OPTIONS = {'eq6': dict(size=3), 'eq6-dilation2': dict(size=3, dilation=2), 'no-eq6': None,
                  # the paper's printed Eq. 5: s, not s/i
                  'eq6-printed-s': dict(size=3, scale_by_count=False)}
# half an ulp at 1, times the tensor's largest entry
ROUNDING = {torch.bfloat16: 2 ** -8, torch.float16: 2 ** -11}


# with Eq. 6, through the compiled graphs; the other options run the same closed forms (conftest.py)
@pytest.mark.parametrize('option', [pytest.param(o, marks=pytest.mark.compiled) if o == 'eq6' else o
                                    for o in CAUSAL_OPTIONS])
@pytest.mark.parametrize('shape', CAUSAL_SHAPES,
                         ids=[f"B{B}-H{H}-N{N}-D{D}-fp32" for B, H, N, D in CAUSAL_SHAPES])
def test_fast_causal_core_equals_reference_fp32(shape, option):
    q, k, v, r, do = sequence_inputs(*shape)
    options = CAUSAL_OPTIONS[option] or {}
    r = r if 'size' in options else None
    fast = run_core(functools.partial(sequence.causal_core_fast, **options), q, k, v, r, do, None, torch.float32)
    reference = run_core(functools.partial(sequence.causal_core, **options), q, k, v, r, do, None, torch.float32)
    assert fast[0].shape == shape
    assert_fp32_close(fast, reference)


# the closed forms, eagerly (conftest.py): the fp32 test above proves the compiled graphs, and a graph
# compiled for each dtype costs ~30 s on 2 cores
@pytest.mark.parametrize('scale_by_count', [True, False], ids=['s-over-i', 'printed-s'])
@pytest.mark.parametrize('dtype', [torch.bfloat16, torch.float16], ids=['bf16', 'fp16'])
def test_fast_causal_core_low_precision_within_twice_the_references(dtype, scale_by_count):
    """In bf16 and fp16 the fast causal core's error against the fp32 reference is at most twice the
    reference's own in that dtype, plus one rounding of the tensor's scale. (The reference sums in fp32
    whatever the dtype, so its own error is little more than its inputs' rounding: the fast core must do as
    well.) Under either factor of Eq. 5: the printed s makes the outputs grow with i, the scans' sums
    unscaled."""
    q, k, v, r, do = sequence_inputs(2, 3, 131, 32)
    c = dict(scale_by_count=scale_by_count)
    truth = run_core(functools.partial(sequence.causal_core, **c), q, k, v, r, do, None, torch.float32)
    fast = run_core(functools.partial(sequence.causal_core_fast, **c), q, k, v, r, do, None, dtype)
    reference = run_core(functools.partial(sequence.causal_core, **c), q, k, v, r, do, None, dtype)
    for name, f, ref, t in zip(NAMES, fast, reference, truth):
        fast_error, reference_error = (f - t).abs().max().item(), (ref - t).abs().max().item()
        noise = ROUNDING[dtype] * t.abs().max().item()
        print(f"{name}: {dtype} error, fast {fast_error:.3e}, reference {reference_error:.3e}, "
              f"noise {noise:.1e}")
        assert fast_error <= 2 * reference_error + noise, name


def test_fast_core_with_the_printed_scale_on_an_image():
    """scale_by_count=False on a 7x7 window (Eq. 5 with s, not s/N): the fast core's output and every gradient
    equal the reference's in fp32, and the module built with it passes enable_fast's check."""
    shape = (2, 3, 0, (7, 7), 32)
    q, k, v, r, do = core_inputs(*shape)
    printed = lambda core: functools.partial(core, scale_by_count=False)  # noqa: E731
    fast = run_core(printed(kernels.inline_core_fast), q, k, v, r, do, (7, 7), torch.float32)
    assert_fp32_close(fast, run_core(printed(inline.inline_core), q, k, v, r, do, (7, 7), torch.float32))
    assert kernels.enable_fast(inline.InLineAttention(32, 2, scale_by_count=False), log=None) == 1


def test_the_scale_option_is_part_of_the_compiled_graphs_key():
    """scale_by_count is a Python bool the graphs specialise on: kernels.signature keys the two apart, so a
    call under one never reuses the switches and marks recorded for the other's graph."""
    q, k, v, _, _ = sequence_inputs(2, 2, 130, 8, dtype=torch.float32)
    for f in (sequence.causal_forward, kernels.core_forward):
        keys = {kernels.signature(f, [q, k, v, None, None, None, 8 ** -0.5, c]) for c in (True, False)}
        assert len(keys) == 2


def test_fast_core_on_a_bidirectional_sequence():
    """grid=None without causal: Eq. 5 over the whole sequence, Eq. 6 over the 3 tokens centred on each."""
    q, k, v, r, do = sequence_inputs(2, 3, 45, 32)
    fast = run_core(sequence.sequence_core_fast, q, k, v, r[:, 0], do, None, torch.float32)
    assert_fp32_close(fast, run_core(sequence.sequence_core, q, k, v, r[:, 0], do, None, torch.float32))


def test_fast_causal_module_never_looks_ahead():
    """The module on the fast path, built by kernels.enable_fast, is the reference module's function and keeps
    its no-look-ahead bit for bit across the fast core's chunks."""
    torch.manual_seed(0)
    reference = sequence.SequenceAttention(64, 2, causal=True)
    fast = sequence.SequenceAttention(64, 2, causal=True)
    fast.load_state_dict(reference.state_dict())
    assert kernels.enable_fast(fast) == 1 and fast.fast == 'compile'
    x = torch.randn(2, 150, 64)
    torch.testing.assert_close(fast(x), reference(x), rtol=0, atol=2e-5 * reference(x).abs().max().item())
    for j in (30, 70, 149):
        no_look_ahead(fast, x, j)
    with pytest.raises(ValueError, match=r"attention='linear'.*sequence\.causal_linear_core has no fast twin"):
        kernels.enable_fast(sequence.SequenceAttention(64, 2, causal=True, attention='linear', feature_map='relu'))


@pytest.mark.compiled
def test_a_guard_failing_under_a_known_signature_compiles_with_the_switches(monkeypatch):
    """Dynamo guards a compiled graph on the torch-function modes in force. A call under a new one, with a
    signature kernels.compiled_call has a graph for, would recompile without the core's switches and, past
    dynamo's limit, run eagerly and silently; instead compiled_call compiles another graph with the switches,
    under its lock, and it returns the reference's output."""
    class Mode(torch.overrides.TorchFunctionMode):
        def __torch_function__(self, func, types, args=(), kwargs=None):
            return func(*args, **(kwargs or {}))
    q, k, v, r = (t.float() for t in core_inputs(2, 2, 0, (5, 6), 16)[:4])
    compiled, compile_lock = [], kernels.compile_lock
    monkeypatch.setattr(kernels, 'compile_lock', lambda key: (compiled.append(key), compile_lock(key))[1])
    with torch.no_grad():
        # the graph for this signature, if this process has none yet
        kernels.inline_core_fast(q, k, v, r, (5, 6))
        compiled.clear()
        with Mode():
            fast = kernels.inline_core_fast(q, k, v, r, (5, 6))
        torch.testing.assert_close(fast, inline.inline_core(q, k, v, r, (5, 6)), rtol=1e-5, atol=1e-5)
    assert len(compiled) == 1  # under the mode: compiled again, with the switches


@pytest.mark.compiled
def test_fast_causal_core_inside_a_compiled_module():
    """torch.compile of a causal module on the fast path: the causal core's closed forms are traced into the
    module's graph, with no break; output and every gradient equal the reference module's."""
    torch.manual_seed(0)
    reference = sequence.SequenceAttention(16, 2, causal=True)
    fast = sequence.SequenceAttention(16, 2, causal=True)
    fast.load_state_dict(reference.state_dict())
    kernels.enable_fast(fast, log=None)
    x, do = torch.randn(2, 70, 16), torch.randn(2, 70, 16)  # two chunks of the fast core, the second ragged
    counters = torch._dynamo.utils.counters
    counters.clear()
    outputs = []
    for module in (reference, torch.compile(fast)):
        x_ = x.clone().requires_grad_()
        out = module(x_)
        out.backward(do)
        outputs.append([out, x_.grad] + [p.grad for p in module.parameters()])
    assert not counters['graph_break'], dict(counters['graph_break'])
    for f, r in zip(outputs[1], outputs[0]):
        torch.testing.assert_close(f, r, rtol=1e-4, atol=1e-5 * r.abs().max().item())


@CUDA
@pytest.mark.parametrize('dtype', [torch.float32, torch.bfloat16], ids=['fp32', 'bf16'])
def test_fast_causal_core_on_cuda(dtype):
    q, k, v, r, do = (t.cuda() for t in sequence_inputs(2, 3, 131, 32))
    truth = run_core(functools.partial(sequence.causal_core), q, k, v, r, do, None, torch.float32)
    fast = run_core(functools.partial(sequence.causal_core_fast), q, k, v, r, do, None, dtype)
    if dtype == torch.float32:
        assert_fp32_close(fast, truth, tolerance=1e-4)  # TF32 may be on for the caller's matmuls
    else:
        reference = run_core(functools.partial(sequence.causal_core), q, k, v, r, do, None, dtype)
        for name, f, ref, t in zip(NAMES, fast, reference, truth):
            fast_error, reference_error = (f - t).abs().max().item(), (ref - t).abs().max().item()
            print(f"{name}: bf16 error, fast {fast_error:.3e}, reference {reference_error:.3e}")
            assert fast_error <= 2 * reference_error + BF16_ROUNDING * t.abs().max().item(), name


def test_fast_causal_core_rejects_what_the_reference_rejects():
    q, k, v, r, _ = sequence_inputs(2, 2, 13, 8)
    with pytest.raises(ValueError, match=r"attention over a 1-D sequence has no grid: grid must be None"):
        sequence.causal_core_fast(q, k, v, r, (1, 13))
    with pytest.raises(ValueError, match=r"r must hold 3 neighbour weights per channel and token, "
                                         r"\(B, N, kC\)"):
        sequence.causal_core_fast(q, k, v, r[:, 0], None)

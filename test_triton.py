"""The Triton core (triton_core.py) against the reference core (inline.inline_core) in float64: the output
and the gradients of q, k, v, r and a tensor scale, under a random upstream gradient.

Without a GPU the kernels run on CPU tensors under Triton's interpreter, which must be switched on before
triton is first imported. So test_the_interpreted_run starts this file again in a subprocess with
TRITON_INTERPRET=1, where the comparisons run (fp32 and fp16; the rest of the suite never sees the
variable), and fails with that run's report. On CUDA the same comparisons run compiled, bf16 too.

    python -m pytest -q test_triton.py                          # the interpreted run in a subprocess
    TRITON_INTERPRET=1 python -m pytest -q -s test_triton.py    # that run alone, its errors printed
"""
import os
import subprocess
import sys

import pytest
import torch

import inline

pytest.importorskip('triton')  # not installed with every torch (macOS): nothing here can run then
import triton_core  # noqa: E402  (after the check; the subprocess's TRITON_INTERPRET=1 is set by then)

ON_CUDA = torch.cuda.is_available() and not triton_core.INTERPRETED  # this process runs compiled on CUDA
REPOSITORY = os.path.dirname(os.path.abspath(__file__))

# (B, H, P, grid, D, label, options): P leading tokens before the (h, w) grid, N = P + h*w; options of
# inline_core ('tensor': a learnable scale per head), and 'shift', added to k and v. BLOCK_N is 64 tokens,
# so N = 197 and 72 end in a partial block, and D = 4, 8, 12 are padded to 16. From 1024 tokens the sums
# over all tokens split into chunks of whole blocks (triton_core.split, with INTERPRETED_SMS = 4 here):
# the 'chunks' case into 3 (test_cases_split_the_tokens).
TRITON_CASES = [
    (1, 3, 1, (14, 14), 32, '', {}),  # DeiT-T at 224 px: a class token, N = 197 = 3 blocks + 5
    (2, 2, 1, (6, 7), 8, '', {}),  # a class token before a non-square grid
    (1, 2, 0, (8, 9), 64, '', {}),  # the other head dim of the backbones
    (1, 1, 0, (1, 1), 4, '', {}),  # one token
    (2, 1, 1, (1, 1), 4, '', {}),  # a class token and a one-token grid
    (2, 2, 1, (1, 11), 16, '', {}),  # one row
    (2, 3, 0, (7, 7), 12, 'unscaled', dict(scale_by_count=False)),  # Eq. 5's s as printed, not s/N
    (2, 3, 1, (6, 7), 16, 'scale-tensor', dict(scale='tensor')),  # a learnable temperature per head
    (2, 2, 1, (6, 7), 16, 'scale0.5', dict(scale=0.5)),  # a number: R-nonneg's s
    (2, 2, 1, (6, 7), 16, 'no-eq6', dict(r=None)),  # eq6='none'
    (2, 2, 1, (8, 8), 16, 'dilation2', dict(dilation=2)),  # R-dil
    (2, 2, 0, (6, 7), 16, 'size5', dict(size=5)),  # a 5x5 neighbourhood
    (2, 2, 0, (6, 7), 16, 'size1', dict(size=1)),  # 'plain': o_i += r * v_i
    # N = 1057: chunks of 512, 512 and 33 tokens; k and v far from 0, where Cov keeps its precision only
    # centred on the means of all N tokens (uncentred, K^T V / N - k_mean^T v_mean, dq missed its fp32
    # bound 400-fold here). Eq. 6 over one neighbour: the split is Eq. 5's, and nine take the
    # interpreter five times as long
    (1, 2, 1, (32, 33), 8, 'chunks', dict(shift=30., size=1)),
]
DTYPES = {'fp32': torch.float32, 'fp16': torch.float16, 'bf16': torch.bfloat16}
# of the tensor's largest entry: fp32 sums over tokens, in another order than torch's
TRITON_FP32_TOLERANCE = 1e-5
HALF_ULP = {'fp16': 2 ** -11, 'bf16': 2 ** -8}  # half an ulp at 1: the rounding of the stored result


def case_id(B, H, P, grid, D, label, options):
    return f"B{B}-H{H}-N{P + grid[0] * grid[1]}-D{D}" + (f"-{label}" if label else '')


def triton_inputs(B, H, P, grid, D, options, dtype, seed=0):
    """{name: float64 tensor} rounded to dtype, so every run sees the same numbers: q, k, v (B, H, N, D)
    with token means away from 0 (what centring is for), r (B, T*C) unless None, the upstream do, and a
    scale (1, H, 1, 1) if asked."""
    g = torch.Generator().manual_seed(seed)
    N, T = P + grid[0] * grid[1], options.get('size', inline.LOCAL_SIZE) ** 2
    q, k, v, do = (torch.randn(B, H, N, D, generator=g, dtype=torch.float64) for _ in range(4))
    shift = options.get('shift', 0.)
    tensors = dict(q=q, k=k + torch.randn(B, H, 1, D, generator=g, dtype=torch.float64) + shift,
                   v=v + 0.5 + shift)
    if 'r' not in options:
        tensors['r'] = 0.3 * torch.randn(B, T * H * D, generator=g, dtype=torch.float64)
    if options.get('scale') == 'tensor':
        tensors['scale'] = 0.1 + 0.2 * torch.rand(1, H, 1, 1, generator=g, dtype=torch.float64)
    tensors['do'] = do
    return {name: t.to(dtype).double() for name, t in tensors.items()}


def run_triton_core(core, tensors, grid, options, dtype, device):
    """{'o': output, 'dq': ..., 'dr', 'dscale'}: core's output and gradients as float64 on the CPU."""
    leaves = {name: t.to(device, dtype).requires_grad_() for name, t in tensors.items() if name != 'do'}
    kwargs = {key: value for key, value in options.items() if key not in ('r', 'scale', 'shift')}
    scale = leaves.get('scale', options.get('scale'))
    o = core(leaves['q'], leaves['k'], leaves['v'], leaves.get('r'), grid, scale=scale, **kwargs)
    assert o.dtype == dtype and o.shape == leaves['q'].shape
    grads = torch.autograd.grad(o, list(leaves.values()), tensors['do'].to(device, dtype))
    assert all(g.dtype == dtype for g in grads)
    return {'o': o.double().cpu(), **{f"d{name}": g.double().cpu() for name, g in zip(leaves, grads)}}


def compare_case(case, dtype_name, device):
    """The Triton core's output and gradients against the float64 reference: within TRITON_FP32_TOLERANCE in
    fp32; in fp16 and bf16 within twice the reference's own error in that dtype, plus one rounding."""
    B, H, P, grid, D, label, options = case
    dtype = DTYPES[dtype_name]
    torch.manual_seed(0)
    tensors = triton_inputs(B, H, P, grid, D, options, dtype)
    print(f"\n{case_id(*case)}-{dtype_name} on {device}")
    exact = run_triton_core(inline.inline_core, tensors, grid, options, torch.float64, 'cpu')
    ours = run_triton_core(triton_core.inline_core_triton, tensors, grid, options, dtype, device)
    reference = None if dtype == torch.float32 else run_triton_core(inline.inline_core, tensors, grid,
                                                                    options, dtype, device)
    failures = []
    for name, t in exact.items():
        error, scale = (ours[name] - t).abs().max().item(), t.abs().max().item()
        if reference is None:
            bound = TRITON_FP32_TOLERANCE * scale
            print(f"{name:6s} fp32 error {error:.1e} of scale {scale:.1e}, bound {bound:.1e}")
        else:
            own = (reference[name] - t).abs().max().item()
            bound = 2 * own + HALF_ULP[dtype_name] * scale
            print(f"{name:6s} {dtype_name} error: triton {error:.2e}, reference {own:.2e}, bound {bound:.2e}")
        if not error <= bound:  # NaN fails too
            failures.append(f"{name}: error {error:.2e} beyond {bound:.2e}")
    assert not failures, '; '.join(failures)


# ---------------------------------------------------------------------------------------------------
# The interpreted run: this file in a subprocess with TRITON_INTERPRET=1

def test_the_interpreted_run():
    """Starts this file under Triton's interpreter; its report (every case's errors) is printed, and the
    failing cases' messages are this test's."""
    if triton_core.INTERPRETED:
        pytest.skip("this is the interpreted run")
    env = {**os.environ, 'TRITON_INTERPRET': '1', 'COLUMNS': '300'}  # FAILED lines keep their messages
    result = subprocess.run([sys.executable, '-m', 'pytest', '-q', '-s', '-rfE', '--tb=short',
                             '-p', 'no:cacheprovider', os.path.join(REPOSITORY, 'test_triton.py')],
                            capture_output=True, text=True, env=env, cwd=REPOSITORY, timeout=600)
    print(result.stdout[-20000:])
    if result.returncode != 0:  # each failing case with its message, else the run's last lines
        failed = [line for line in result.stdout.splitlines() if line.startswith(('FAILED', 'ERROR'))]
        pytest.fail("the Triton core under TRITON_INTERPRET=1 (rerun: TRITON_INTERPRET=1 python -m pytest "
                    "-q -s test_triton.py):\n" + '\n'.join(
                        failed or result.stdout.splitlines()[-30:] + [result.stderr[-3000:]]), pytrace=False)


# fp16 at the backbones' shapes and the split; the edge shapes and options in fp32 (the interpreter
# takes ~1.5 s a case)
INTERPRETED_RUNS = [(case, dtype) for case in TRITON_CASES for dtype in ('fp32', 'fp16')
                    if dtype == 'fp32' or case[5] in ('', 'chunks') and min(case[3]) > 1]


@pytest.mark.skipif(not triton_core.INTERPRETED, reason="runs in test_the_interpreted_run's subprocess")
@pytest.mark.parametrize('case, dtype', INTERPRETED_RUNS,
                         ids=[f'{case_id(*case)}-{dtype}' for case, dtype in INTERPRETED_RUNS])
def test_interpreted_core_matches_reference(case, dtype):
    compare_case(case, dtype, 'cpu')


@pytest.mark.skipif(not triton_core.INTERPRETED, reason="runs in test_the_interpreted_run's subprocess")
def test_interpreted_core_takes_strided_views_and_autocast_and_no_gradient():
    """q, k, v as a model passes them (views of one (B, N, 3C) projection), under fp16 autocast, and
    with no gradient: the same numbers as the contiguous fp16 call."""
    g = torch.Generator().manual_seed(0)
    B, H, N, D, grid = 2, 2, 43, 8, (6, 7)
    qkv = torch.randn(B, N, 3 * H * D, generator=g)
    q, k, v = (t.reshape(B, N, H, D).transpose(1, 2) for t in qkv.chunk(3, dim=-1))  # (B, H, N, D) views
    r = 0.3 * torch.randn(B, 9 * H * D, generator=g)
    plain = triton_core.inline_core_triton(*(t.half().contiguous() for t in (q, k, v, r)), grid)
    with torch.autocast('cpu', dtype=torch.float16):
        cast = triton_core.inline_core_triton(q, k, v, r, grid)
    with torch.no_grad():
        quiet = triton_core.inline_core_triton(q.half(), k.half(), v.half(), r.half(), grid)
    assert cast.dtype == quiet.dtype == torch.float16 and not q.is_contiguous()
    assert torch.equal(cast, plain) and torch.equal(quiet, plain)


def test_cases_split_the_tokens():
    """The split that TRITON_CASES prove under the interpreter: several chunks of whole blocks, the last one
    short, and none under SPLIT_FROM tokens; on an H100's 132 SMs, Swin-T's stage 1 (3 heads, 3136
    tokens = 49 blocks) splits so that every SM gets a program: 49 chunks of one block at batch 1 (147
    programs), 7 of 8 blocks at batch 8 (168), one at batch 128 (384); DeiT-T's 197 tokens do not."""
    chunks = {}
    for B, H, P, grid, D, label, options in TRITON_CASES:
        N = P + grid[0] * grid[1]
        chunk = triton_core.split(B * H, N, triton_core.INTERPRETED_SMS)
        S = -(-N // chunk)
        chunks[label or f"N{N}"] = (S, N - (S - 1) * chunk)  # (chunks, the last one's tokens)
    assert chunks['chunks'] == (3, 33)
    assert all(S == 1 for label, (S, _) in chunks.items() if label != 'chunks'), chunks
    for B, N, chunk, programs in ((1, 3136, 64, 147), (8, 3136, 512, 168), (128, 3136, 3136, 384),
                                  (1, 197, 256, 3)):
        assert triton_core.split(B * 3, N, 132) == chunk
        S = triton_core.launch_grids(B, 3, N, 3, chunk)['eq5_covariance'][1]
        assert B * 3 * S == programs


def test_core_refuses_what_it_does_not_compute():
    """Per-token r, mixed dtypes and a grid that does not fit are refused before any kernel runs;
    outside the interpreter CPU tensors are too, saying what would run them."""
    q, k, v = (torch.randn(1, 2, 13, 4) for _ in range(3))
    with pytest.raises(ValueError, match=r"r must hold 3x3 neighbour weights per channel.*per token"):
        triton_core.inline_core_triton(q, k, v, torch.randn(1, 13, 72), (3, 4))
    with pytest.raises(ValueError, match=r"must share one dtype"):
        triton_core.inline_core_triton(q, k.half(), v, None, (3, 4))
    with pytest.raises(ValueError, match=r"13 tokens cannot hold a 4x4 token grid"):
        triton_core.inline_core_triton(q, k, v, None, (4, 4))
    if not triton_core.INTERPRETED:
        with pytest.raises(RuntimeError, match=r"CUDA tensors, or on CPU ones under Triton's interpreter"):
            triton_core.inline_core_triton(q, k, v, None, (3, 4))


def test_create_model_with_triton_is_refused_on_a_cpu_model():
    """create_model(fast='triton') on a CPU model, outside the interpreter, says why and what to use instead;
    under the interpreter the model builds and enable_fast checks the kernel against the reference on each
    attention configuration, as it checks the compiled core."""
    import models
    small = dict(img_size=64, embed_dim=16, depths=(1, 1, 1, 1), num_heads=(1, 2, 2, 4), softmax_window=2,
                 num_classes=3)
    if not triton_core.INTERPRETED:
        with pytest.raises(ValueError, match=r"fast='triton' runs InLine's Triton kernel, which needs a CUDA "
                                             r"device \(the model is on cpu\); on the CPU use "
                                             r"fast='compile'"):
            models.create_model('inline_swin_t', fast='triton', **small)
        return
    torch.manual_seed(0)
    reference = models.create_model('inline_swin_t', **small).eval()
    fast = models.create_model('inline_swin_t', fast='triton', **small).eval()
    fast.load_state_dict(reference.state_dict())
    assert {m.fast for m in fast.modules() if isinstance(m, inline.InLineBase)} == {'triton'}
    x = torch.randn(2, 3, 64, 64)
    with torch.no_grad():
        torch.testing.assert_close(fast(x), reference(x), rtol=1e-5, atol=1e-5)


# ---------------------------------------------------------------------------------------------------
# CUDA: the same comparisons compiled, bf16 among them, and Swin-T's stage 1; the speed is bench.py's

@pytest.mark.skipif(not ON_CUDA, reason="needs CUDA")
@pytest.mark.parametrize('dtype', list(DTYPES))
@pytest.mark.parametrize('case', TRITON_CASES, ids=[case_id(*case) for case in TRITON_CASES])
def test_cuda_core_matches_reference(case, dtype):
    compare_case(case, dtype, 'cuda')


@pytest.mark.skipif(not ON_CUDA, reason="needs CUDA")
@pytest.mark.parametrize('dtype', list(DTYPES))
def test_cuda_core_at_swin_t_stage1(dtype):
    compare_case((2, 3, 0, (56, 56), 32, '', {}), dtype, 'cuda')  # 3136 tokens: 49 blocks


@pytest.mark.skipif(not ON_CUDA, reason="needs CUDA")
def test_cuda_bench_rows_print_every_core():
    """bench.py --gpu's rows for Swin-T's stage 1 at batch 64, fp16, the compiled core left to
    test_inline.py (it compiles for a minute): each runs, and its times print."""
    import bench
    cores = ('reference', 'triton', 'sdpa')
    rows = bench.bench_gpu_case('swin_t_stage1', torch.float16, torch.device('cuda'), cores=cores)
    for row in rows:
        print(bench.format_gpu_row(row))
    assert [row['status'] for row in rows] == ['ok'] * len(cores)


def test_bench_gpu_smoke_rows_have_their_keys():
    """bench.py --gpu --device cpu's rows, the cheap ones (the compiled core's CPU graphs take minutes):
    a case's row has its times and peak memory, the Triton row says why it does not run here, the step's
    row its time."""
    if triton_core.INTERPRETED:
        pytest.skip("the main run's test")
    import bench
    rows = bench.bench_gpu_case('swin_t_stage1', torch.float32, torch.device('cpu'), smoke=True,
                                cores=('reference', 'triton', 'sdpa'))
    assert [row['core'] for row in rows] == ['reference', 'triton', 'sdpa']
    for row in rows:
        assert {'case', 'batch', 'tokens', 'dtype', 'core', 'status'} <= set(row), row
        if row['status'] == 'ok':
            assert all(row[key] > 0 for key in ('fwd_ms', 'fwdbwd_ms', 'peak_mb')), row
    assert rows[1]['status'] == "not run (needs CUDA or TRITON_INTERPRET=1)"
    assert 0 < rows[1]['expected_fwd_ms'] < rows[1]['expected_fwdbwd_ms'], rows[1]  # an H100's, by model
    step = bench.bench_gpu_step(None, torch.device('cpu'), smoke=True)
    assert step['status'] == 'ok' and step['step_ms'] > 0 and step['peak_mb'] > 0, step
    print('\n'.join(bench.format_gpu_row(row) for row in rows + [step]))


def test_triton_cost_counts_match_hand_formulas():
    """bench.py --triton-cost's counts, written out by hand: Swin-T's stage 1 in fp16 at batch 8 (B*H = 24
    programs a token block, N = 3136 = 49 blocks of 64, split into 7 chunks of 512, D = 32, T = 9) and at
    batch 1, and the H100's times of a memory-bound and an occupancy-bound launch."""
    if triton_core.INTERPRETED:
        pytest.skip("the main run's test")
    import bench
    launches = {launch['name']: launch for launch in bench.triton_launches(8, 3, 3136, 32)}
    assert list(launches) == ['eq5_means', 'sum of mean shares', 'eq5_covariance', "sum of Cov' shares",
                              'inline_forward', 'eq5_sums', 'sum of G shares', 'sum of dO shares', 'eq6_dr',
                              'inline_backward']
    x, r = 8 * 3 * 3136 * 32 * 2, 8 * 9 * 3 * 32 * 2  # one (B, H, N, D) fp16 tensor, 4,816,896 bytes; r
    square, vec = 24 * 32 * 32 * 4, 24 * 32 * 4  # fp32 (B*H, D, D) and (B*H, D)
    assert [launches[name]['programs'] for name in ('eq5_covariance', 'inline_forward', 'eq6_dr')] == [
        24 * 7, 24 * 49, 24 * 9]
    assert launches['eq5_covariance']['bytes'] == 2 * x + 2 * vec + 7 * square  # k, v, means; 7 shares
    assert launches['inline_forward']['bytes'] == 3 * x + r + square + vec == 14_565_888  # q, v, o
    assert launches["sum of Cov' shares"]['bytes'] == 8 * square  # 7 shares in, their sum out
    assert launches['inline_backward']['tensor_flops'] == 3 * 2 * 24 * 3136 * 32 * 32  # three products
    assert launches['eq6_dr']['flops'] == 2 * 9 * 24 * 3136 * 32  # a multiply-add a neighbour, element
    us = bench.launch_us(launches['inline_backward'])
    assert max(us, key=us.get) == 'memory'
    assert us['memory'] == pytest.approx((6 * x + r + 2 * square + 3 * vec) / 3.35e12 * 1e6)  # 8.7 µs
    one = {launch['name']: launch for launch in bench.triton_launches(1, 3, 3136, 32)}
    assert one['eq5_covariance']['programs'] == 3 * 49 and one['eq6_dr']['programs'] == 27
    us = bench.launch_us(one['eq6_dr'])  # 27 programs: 27 of the 132 SMs
    assert us['memory'] == pytest.approx((2 * x + r) / 8 / 3.35e12 / (27 / 132) * 1e6)
    assert len(bench.triton_launches(128, 3, 3136, 32)) == 6  # one chunk: no sums of shares

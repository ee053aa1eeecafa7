"""Benchmarks of the InLine attention cores (arXiv 2412.06590): the fast core (kernels.py) against
the reference (inline.py), softmax SDPA and the matmul floor; the causal core (sequence.py) against
causal SDPA; and the reference's short demonstration. RESULTS.md shows each table under the command
that printed it.

    python bench.py --bench                 # the table: reference, fast, softmax SDPA, matmul floor
    python bench.py --bench --json          # the same, one JSON object per case
    python bench.py --choices --threads 1   # two design choices of kernels.py, timed: D constant,
                                            # and the per-call switches
    python bench.py --compile               # what the first use in a process costs (compiling,
                                            # or the cache)
    python bench.py --per-call              # one call's cost beside its work: 197 tokens, 7x7
                                            # windows, 56x56
    python bench.py --causal-bench          # the causal core against causal softmax SDPA, 1k to
                                            # 16k tokens
    python bench.py --demo                  # injectivity, and the two forms of Eq. 5 agree
    python bench.py --peers                 # InLine against FLatten, a block and PVT-T, beside the
                                            # rebuttal
    python bench.py --gpu                   # on one GPU: reference, compiled, Triton, softmax; a
                                            # Swin-T step
    python bench.py --triton-cost           # each launch of the Triton core costed for an H100
    (a whole-model training step, reference against fast core: python -m paper speed --model-step)

Median times in one interleaved run, so load from other processes hits all; speed-ups are medians of
per-round ratios. Notation as in inline.py.
"""
import argparse
import functools
import json
import math
import statistics
import sys
import time

import torch
import torch.nn.functional as F
from torch._inductor.runtime.cache_dir_utils import cache_dir

import inline
import kernels
import models
import peers
import sequence
from inline import (attention_scale, get_phi, inline_attention, inline_attention_quadratic,
                    inline_weights)
from inline import linear_attention_weights
from kernels import (compile_options, compiled_call, core_forward, grid_table, inline_core_fast,
                     signature)
from kernels import symbolic_sizes

# name: (batch, heads, grid side, head dim); the InLine stages of InLine-Swin-T, then stage 1 larger
CASES = {
    'swin_t_stage1': (8, 3, 56, 32), 'swin_t_stage2': (8, 6, 28, 32),
    'swin_t_stage3': (8, 12, 14, 32), 'stage1_448px': (2, 3, 112, 32),
    'stage1_896px': (1, 3, 224, 32), 'stage1_1024px': (1, 3, 256, 32),
}


def _sync(device):
    if device.type == 'cuda':
        torch.cuda.synchronize()


def time_interleaved(fns, device, budget_s=3.0, max_rounds=25, warm_up=True):
    """{name: [ms per round]}: every round calls each fn once; as many rounds as the slowest fn's
    budget allows. warm_up=False: a first call longer than the budget is its own timing (softmax at
    65k tokens)."""
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
    """The median over rounds of a's time / b's. Each round times the two back to back, so a drift
    in the machine's speed (other jobs on a shared machine) cancels, where it would skew a ratio of
    two medians."""
    return statistics.median(x / y for x, y in zip(ms[a], ms[b]))


def peak_mb(fn, device):
    """Memory fn allocates at its peak, beyond what was allocated before it ran."""
    if device.type == 'cuda':
        torch.cuda.synchronize()
        base = torch.cuda.memory_allocated()
        torch.cuda.reset_peak_memory_stats()
        fn(), torch.cuda.synchronize()
        return (torch.cuda.max_memory_allocated() - base) / 2**20
    cpu = [torch.profiler.ProfilerActivity.CPU]
    with torch.profiler.profile(activities=cpu, profile_memory=True) as prof:
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
    q, k, v, do = (torch.randn(B, H, N, D, generator=gen, device=device, dtype=dtype)
                   for _ in range(4))
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
        'reference_fwd_ms': lambda: fwd(inline.inline_core),
        'fast_fwd_ms': lambda: fwd(inline_core_fast),
        'reference_fwdbwd_ms': lambda: fwdbwd(inline.inline_core),
        'fast_fwdbwd_ms': lambda: fwdbwd(inline_core_fast),
        'floor_fwdbwd_ms': floor}, device)
    ms.update(time_interleaved({'sdpa_fwd_ms': lambda: fwd(sdpa),
                                'sdpa_fwdbwd_ms': lambda: fwdbwd(sdpa)},
                               device, warm_up=False))
    row = dict(case=name, tokens=N, dtype=str(dtype).replace('torch.', ''))
    row.update({key: round(statistics.median(ms[key]), 3) for key in (
        'reference_fwd_ms', 'reference_fwdbwd_ms', 'fast_fwd_ms', 'fast_fwdbwd_ms', 'sdpa_fwd_ms',
        'sdpa_fwdbwd_ms', 'floor_fwdbwd_ms')})
    row.update(fwd_speedup=round(paired_ratio(ms, 'reference_fwd_ms', 'fast_fwd_ms'), 2),
               fwdbwd_speedup=round(paired_ratio(ms, 'reference_fwdbwd_ms', 'fast_fwdbwd_ms'), 2),
               fwdbwd_over_floor=round(paired_ratio(ms, 'fast_fwdbwd_ms', 'floor_fwdbwd_ms'), 2))
    row['fast_peak_mb'] = round(peak_mb(lambda: fwdbwd(inline_core_fast), device), 1)
    return row


# python bench.py --causal-bench: B = 1, H = 4, D = 64 (GPT-2's)
CAUSAL_TOKENS = (1024, 2048, 4096, 8192, 16384)


def bench_causal(N, dtype, device, B=1, H=4, D=64):
    """One row of --causal-bench: the fast causal core, Eq. 5 alone and with Eq. 6 over 3 tokens,
    against causal softmax (F.scaled_dot_product_attention(is_causal=True)), forward and forward +
    backward, in one interleaved run. (The reference's (B, H, N, D, D) prefix sums need 1 GB per
    tensor at 16k tokens: it is left out.)"""
    gen = torch.Generator(device).manual_seed(0)
    q, k, v, do = (torch.randn(B, H, N, D, generator=gen, device=device, dtype=dtype)
                   for _ in range(4))
    r = 0.1 * torch.randn(B, N, 3 * H * D, generator=gen, device=device, dtype=dtype)
    inputs = [t.requires_grad_() for t in (q, k, v, r)]
    cores = {'sdpa': lambda: F.scaled_dot_product_attention(q, k, v, is_causal=True),
             'eq5': lambda: sequence.causal_core_fast(q, k, v, None, None),
             'eq56': lambda: sequence.causal_core_fast(q, k, v, r, None, size=3)}
    fns = {}
    for name, core in cores.items():
        fns[f'{name}_fwd_ms'] = lambda core=core: torch.no_grad()(core)()
        fns[f'{name}_fwdbwd_ms'] = (lambda core=core, n=4 if name == 'eq56' else 3:
                                    torch.autograd.grad(core(), inputs[:n], do))
    ms = time_interleaved(fns, device, budget_s=60, max_rounds=9)
    row = dict(tokens=N, dtype=str(dtype).replace('torch.', ''), B=B, H=H, D=D)
    row.update({key: round(statistics.median(t), 2) for key, t in ms.items()})
    # how many times faster than causal SDPA: medians of per-round ratios
    for name in ('eq5', 'eq56'):
        for part in ('fwd', 'fwdbwd'):
            row[f'{name}_{part}_speedup'] = round(paired_ratio(ms, f'sdpa_{part}_ms',
                                                               f'{name}_{part}_ms'), 2)
    return row


def bench_compile(device, dtype=torch.float32):
    """What the fast core's first use in a process costs: its first forward and backward on a small
    case, which compile the two graphs, or load them where the inductor cache
    (TORCHINDUCTOR_CACHE_DIR) already holds them."""
    q, k, v, do = (torch.randn(2, 3, 64, 32, device=device, dtype=dtype, requires_grad=True)
                   for _ in range(4))
    r = torch.randn(2, 9 * 96, device=device, dtype=dtype, requires_grad=True)
    start = time.perf_counter()
    torch.autograd.grad(inline_core_fast(q, k, v, r, (8, 8)), (q, k, v, r),
                        do.detach()), _sync(device)
    print(f"first forward + backward, {str(dtype).replace('torch.', '')}, inductor cache "
          f"{cache_dir()}: {time.perf_counter() - start:.1f} s", flush=True)


def bench_choices(device):
    """Two of the choices above, timed in one interleaved run: D a constant against D symbolic too
    (the forward graph at swin_t_stage1, fp32), and a call whose signature has a graph, straight to
    it, against one through compiled_call's switches, marks and lock (one head of 49 tokens)."""
    def inputs(B, H, side):  # core_forward's arguments as InLineCore passes them
        gen, N, D = torch.Generator(device).manual_seed(0), side * side, 32
        return [*(torch.randn(B, H, N, D, generator=gen, device=device) for _ in range(3)),
                0.1 * torch.randn(B, H, 9, D, generator=gen, device=device),
                *grid_table(N, (side, side), device),
                inline.attention_scale(D), True]
    B, H, side, _ = CASES['swin_t_stage1']
    constant, symbolic, small = inputs(B, H, side), inputs(B, H, side), inputs(1, 1, 7)
    symbolic_sizes(constant, side * side), symbolic_sizes(symbolic, side * side)
    for a in symbolic[:4]:
        torch._dynamo.maybe_mark_dynamic(a, 3)
    graphs = [torch.compile(core_forward), torch.compile(core_forward)]

    def through_switches():
        kernels._compiled_signatures.discard(signature(core_forward, small))
        compiled_call(core_forward, *small)

    with compile_options():
        ms = time_interleaved({'d_constant': lambda: graphs[0](*constant),
                               'd_symbolic': lambda: graphs[1](*symbolic),
                               'straight': lambda: compiled_call(core_forward, *small),
                               'switches': through_switches}, device)
    print(f"forward graph, swin_t_stage1 fp32: D constant "
          f"{statistics.median(ms['d_constant']):.1f} ms, D symbolic "
          f"{statistics.median(ms['d_symbolic']):.1f} ms: "
          f"{paired_ratio(ms, 'd_symbolic', 'd_constant'):.2f}x")
    extra = statistics.median(s - c for s, c in zip(ms['switches'], ms['straight']))
    print(f"a call whose signature has a graph: straight "
          f"{statistics.median(ms['straight']):.3f} ms, through the switches "
          f"{statistics.median(ms['switches']):.3f} ms: {extra:.3f} ms more", flush=True)


# python bench.py --per-call: (batch, heads, tokens before the grid, grid side, head dim)
PER_CALL = {
    'InLine-DeiT-T, 224 px (197 tokens)': (1, 6, 1, 14, 32),
    'InLine-Swin-T windows of 7x7 (49 tokens)': (64, 3, 0, 7, 32),
    'InLine-Swin-T stage 1 (56x56 tokens)': (1, 3, 0, 56, 32),
}


def bench_per_call(device, dtypes):
    """What one call of the fast core costs beside its work, forward only, in one interleaved run
    per case: the whole call without and with a gradient asked (the autograd Function), the two
    GEMMs of Eq. 5 alone (K^T V and Q Cov, eager: the work no implementation avoids) and softmax
    SDPA on the same q, k, v. Call minus GEMMs is what the call adds: the fused passes over q, k, v
    (means, centring, Eq. 6) and the cost of calling a compiled graph."""
    print(f"{'case':44s} {'dtype':>8s} | {'call us':>8s} {'w/ grad':>8s} | {'GEMMs':>7s} "
          f"{'call - GEMMs':>12s} | {'SDPA us':>8s}")
    for name, (B, H, P, side, D) in PER_CALL.items():
        for dtype in dtypes:
            N, gen = P + side * side, torch.Generator(device).manual_seed(0)
            q, k, v = (torch.randn(B, H, N, D, generator=gen, device=device, dtype=dtype)
                       for _ in range(3))
            r = 0.1 * torch.randn(B, 9 * H * D, generator=gen, device=device, dtype=dtype)
            grads = [t.detach().requires_grad_() for t in (q, k, v, r)]
            cov = torch.randn(B, H, D, D, generator=gen, device=device, dtype=dtype)

            def call():
                with torch.no_grad():
                    inline_core_fast(q, k, v, r, (side, side))

            fns = {'call': call, 'grad': lambda: inline_core_fast(*grads, (side, side)),
                   'gemms': lambda: (k.mT @ v, q @ cov),
                   'sdpa': lambda: F.scaled_dot_product_attention(q, k, v)}
            us = {n: 1e3 * statistics.median(t)
                  for n, t in time_interleaved(fns, device, 2.0, 200).items()}
            print(f"{name:44s} {str(dtype)[6:]:>8s} | {us['call']:8.0f} {us['grad']:8.0f} | "
                  f"{us['gemms']:7.0f} {us['call'] - us['gemms']:12.0f} | {us['sdpa']:8.0f}",
                  flush=True)


# --------------------------------------------------------------------------------------------------
# python bench.py --peers: InLine against FLatten (peers.py), beside the authors' rebuttal

# name: (grid side, C, heads, PVT's q and kv), the stage-1 shapes of Swin-T (InLine's and FLatten's
# whole-stage blocks) and PVT-T (FLatten's heads; neither InLine-PVT nor FLatten-PVT reduces k and
# v: sr 1)
PEER_BLOCKS = {'Swin-T stage 1': (56, 96, 3, False), 'PVT-T stage 1': (56, 64, 1, True)}
# inline_pvt_t against flatten_pvt_t: batch
PEER_MODELS = {'PVT-T infer B1': 1, 'PVT-T train B8': 8}
PEER_IMG = 224  # their image side, px
# "1.8x faster than a FLatten block", "1.2x speed up" (RTX 3090 GPU)
REBUTTAL = {'block': 1.8, 'PVT-T': 1.2}


def bench_peers(device, dtypes, rounds):
    """One interleaved run, every dtype in it (bf16 by autocast, as one trains in it): an attention
    block of InLine (the reference path, inline.py, as the authors' code runs it) and of FLatten at
    each PEER_BLOCKS shape, batch 8, forward and forward + backward, and inline_pvt_t against
    flatten_pvt_t (inference, and a training step: forward, cross-entropy, backward, AdamW). Prints
    medians and FLatten / InLine, the median of per-round ratios, beside the rebuttal's GPU
    figures."""
    gen = torch.Generator(device).manual_seed(0)
    blocks = {name: {'inline': inline.InLineAttention(C, H, separate_q=q_kv).to(device),
                     'flatten': peers.FocusedLinearAttention(C, H, side * side,
                                                             separate_q=q_kv).to(device)}
              for name, (side, C, H, q_kv) in PEER_BLOCKS.items()}
    pvt = {label: models.create_model(f'{label}_pvt_t', img_size=PEER_IMG).to(device)
           for label in ('inline', 'flatten')}
    optimizers = {label: torch.optim.AdamW(model.parameters()) for label, model in pvt.items()}

    def block_step(block, x, grid, dy, dtype):  # dy None: forward only
        with torch.autocast(device.type, torch.bfloat16, enabled=dtype == torch.bfloat16):
            with torch.set_grad_enabled(dy is not None):
                out = block(x, grid)  # (B, N, C)
        if dy is not None:
            out.backward(dy.to(out.dtype))

    def model_step(label, x, y, dtype):  # y None: inference
        model = pvt[label].train(y is not None)
        with torch.autocast(device.type, torch.bfloat16, enabled=dtype == torch.bfloat16):
            with torch.set_grad_enabled(y is not None):
                out = model(x)  # (B, 1000)
        if y is not None:
            F.cross_entropy(out.float(), y).backward()
            optimizers[label].step(), optimizers[label].zero_grad()

    fns = {}  # (case, part, dtype, 'inline' or 'flatten'): one call
    for dtype in dtypes:
        d = str(dtype).replace('torch.', '')
        for name, (side, C, _, _) in PEER_BLOCKS.items():
            x = torch.randn(8, side * side, C, generator=gen, device=device)  # (B, N, C)
            dy = torch.randn(x.shape, generator=gen, device=device)  # a random upstream gradient
            for label, block in blocks[name].items():
                fns[name, 'fwd', d, label] = functools.partial(block_step, block, x, (side, side),
                                                               None, dtype)
                fns[name, 'fwdbwd', d, label] = functools.partial(
                    block_step, block, x.clone().requires_grad_(), (side, side), dy, dtype)
        for name, batch in PEER_MODELS.items():
            x = torch.randn(batch, 3, PEER_IMG, PEER_IMG, generator=gen, device=device)
            y = (torch.randint(0, 1000, (batch,), generator=gen, device=device) if 'train' in name
                 else None)
            for label in pvt:
                fns[name, 'step', d, label] = functools.partial(model_step, label, x, y, dtype)
    ms = time_interleaved(fns, device, budget_s=1e9, max_rounds=rounds)  # every case `rounds` times
    print(f"InLine against FLatten, {rounds} round(s); ratio: FLatten's time / InLine's, median of "
          f"per-round ratios; the rebuttal's figure is an RTX 3090 GPU's")
    print(f"{'case':16s} {'part':>6s} {'dtype':>8s} | {'InLine ms':>9s} {'FLatten ms':>10s} | "
          f"{'ratio':>5s} | {'rebuttal':>8s}")
    for name, part, d, label in fns:
        if label == 'inline':
            ours, theirs = (name, part, d, 'inline'), (name, part, d, 'flatten')
            rebuttal = REBUTTAL['block' if name in PEER_BLOCKS else 'PVT-T']
            print(f"{name:16s} {part:>6s} {d:>8s} | {statistics.median(ms[ours]):9.1f} "
                  f"{statistics.median(ms[theirs]):10.1f} | "
                  f"{paired_ratio(ms, theirs, ours):4.2f}x | {rebuttal:7.1f}x", flush=True)


# --------------------------------------------------------------------------------------------------
# python bench.py --demo: the reference demonstrated (the timings of whole models: python -m paper
# speed)

def _demo():
    torch.manual_seed(0)
    B, H, N, D = 1, 1, 16, 8
    k = torch.randn(B, H, N, D, dtype=torch.float64)
    v = torch.randn(B, H, N, D, dtype=torch.float64)
    q = torch.randn(B, H, 1, D, dtype=torch.float64)
    relu = get_phi('relu')

    print("1. Injectivity: does the query q get different weights from 2q? (16 random keys)")
    pairs = {
        'softmax': lambda q: torch.softmax(q @ k.transpose(-2, -1) * attention_scale(D), dim=-1),
        'linear (relu)': lambda q: linear_attention_weights(relu(q), relu(k), eps=0),
        'InLine': lambda q: inline_weights(q, k),
    }
    for name, weights in pairs.items():
        diff = (weights(q) - weights(2 * q)).abs().max().item()
        verdict = 'distinct' if diff > 1e-9 else 'SAME: not injective'
        print(f"   {name:14s} max |w(q) - w(2q)| = {diff:.3e}   {verdict}")

    q = torch.randn(B, H, N, D, dtype=torch.float64)
    w = inline_weights(q, k)
    print("\n2. Eq. 5, explicit N x N weights vs the linear O(N D^2) form (float64)")
    print(f"   rows of w sum to 1: max |sum_j w_ij - 1| = {(w.sum(-1) - 1).abs().max().item():.1e}")
    gap = (inline_attention_quadratic(q, k, v) - inline_attention(q, k, v)).abs().max().item()
    print(f"   max |w @ v - linear form| = {gap:.1e}")
    print(f"   negative weights: {(w < 0).float().mean().item():.0%} of them (intended: no "
          f"non-negativity constraint)")


# --------------------------------------------------------------------------------------------------
# python bench.py --triton-cost: each launch of the Triton core (triton_core.py) costed for an H100
# SXM from its launch grid and the bytes and FLOPs of its work; no GPU needed, nothing timed

# An H100 SXM: SMs, HBM bytes/s, FLOP/s of tl.dot in TF32 (the core's precision for fp16 and bf16
# inputs, triton_core.precision; dense, half of bf16's 990e12) and of fp32 arithmetic off the
# tensor cores; and the least a launch takes, µs (starting a kernel, filling and draining the SMs,
# Triton's launcher in Python: an assumption until a GPU measures it)
H100 = dict(sms=132, bandwidth=3.35e12, tf32=495e12, fp32=67e12, launch_us=4.0)
# name: (B, H, P, grid side, D), as GPU_CASES: Swin-T's stage 1 at batch 1, 8 and 128; DeiT-T at
# 224 and 1024 px, batch 1 (a single image's latency)
COST_CASES = {
    'swin_t_stage1 B1': (1, 3, 0, 56, 32), 'swin_t_stage1 B8': (8, 3, 0, 56, 32),
    'swin_t_stage1 B128': (128, 3, 0, 56, 32), 'deit_t_224px B1': (1, 3, 1, 14, 64),
    'deit_t_1024px B1': (1, 3, 1, 64, 64),
}


def triton_launches(B, H, N, D, size=inline.LOCAL_SIZE, itemsize=2, gpu=H100):
    """The launches of one forward and backward of triton_core.inline_core_triton with Eq. 6, in
    order, each a dict: name, part, programs (its grid's; None for torch's sum of the chunks'
    shares), bytes from and to memory (each tensor once: what programs read again, the L2 cache
    serves) and FLOPs on the tensor cores (tl.dot, at BLOCK_D) and off them. q, k, v, r, o and the
    gradients take itemsize bytes an element; the means, the (D, D) sums and their shares fp32.
    Not counted: copies where q, k, v arrive as views (the models' are), and the allocations."""
    import triton_core
    T, BH, BD = size * size, B * H, triton_core.block_d(D)
    chunk = triton_core.split(BH, N, gpu['sms'])
    grids, S = triton_core.launch_grids(B, H, N, size, chunk), -(-N // chunk)
    x, r = BH * N * D * itemsize, B * T * H * D * itemsize  # a (B, H, N, D) tensor; r (B, T*C)
    vec, square = 4 * BH * BD, 4 * BH * BD * BD  # fp32 (B*H, BLOCK_D), (B*H, BLOCK_D, BLOCK_D)
    dot, each = 2 * BH * N * BD * BD, BH * N * D  # (N, D) x (D, D) per (b, h); one op an element
    launches = []

    def kernel(name, part, nbytes, tensor_flops, flops):
        if itemsize == 4:  # fp32 inputs: tl.dot exact, off the tensor cores (triton_core.precision)
            tensor_flops, flops = 0, flops + tensor_flops
        launches.append(dict(name=name, part=part, programs=math.prod(grids[name]), bytes=nbytes,
                             tensor_flops=tensor_flops, flops=flops))

    def add_shares(name, part, total):  # triton_core.add_shares: torch's sum, none for one chunk
        if S > 1:
            launches.append(dict(name=name, part=part, programs=None, bytes=(S + 1) * total,
                                 tensor_flops=0, flops=(S - 1) * total // 4))

    kernel('eq5_means', 'forward', 2 * x + 2 * S * vec, 0, 2 * each)
    add_shares('sum of mean shares', 'forward', 2 * vec)
    kernel('eq5_covariance', 'forward', 2 * x + 2 * vec + S * square, dot, 2 * each)
    add_shares('sum of Cov\' shares', 'forward', square)
    # q, v, o; Eq. 5's Q Cov' + v_mean, Eq. 6's T multiply-adds
    kernel('inline_forward', 'forward', 3 * x + r + square + vec, dot, (1 + 2 * T) * each)
    kernel('eq5_sums', 'backward', 2 * x + S * (square + vec), dot, each)
    add_shares('sum of G shares', 'backward', square)
    add_shares('sum of dO shares', 'backward', vec)
    kernel('eq6_dr', 'backward', 2 * x + r, 0, 2 * T * each)
    # k, v, dO in, dq, dk, dv out; three products; centring, + mean dO, Eq. 6 transposed
    kernel('inline_backward', 'backward', 6 * x + r + 2 * square + 3 * vec, 3 * dot,
           (3 + 2 * T) * each)
    return launches


def launch_us(launch, gpu=H100):
    """{'memory', 'compute', 'latency': µs} of one launch: its bytes at the HBM bandwidth, its FLOPs
    at the peaks (on the tensor cores and off them, one after the other), and the least a launch
    takes. A launch of fewer programs than SMs runs on that share of the GPU: each program on one
    SM, at its share of the bandwidth and the peaks. The expected time is the largest of the three,
    and the launch is bound by it."""
    share = 1 if launch['programs'] is None else min(1, launch['programs'] / gpu['sms'])
    return {'memory': 1e6 * launch['bytes'] / gpu['bandwidth'] / share,
            'compute': 1e6 * (launch['tensor_flops'] / gpu['tf32']
                              + launch['flops'] / gpu['fp32']) / share,
            'latency': gpu['launch_us']}


def triton_expected_ms(B, H, N, D, itemsize=2, gpu=H100):
    """(forward, forward + backward) ms of the Triton core by launch_us, launch after launch."""
    us = {'forward': 0., 'backward': 0.}
    for launch in triton_launches(B, H, N, D, itemsize=itemsize, gpu=gpu):
        us[launch['part']] += max(launch_us(launch, gpu).values())
    return us['forward'] / 1e3, (us['forward'] + us['backward']) / 1e3


def bench_triton_cost(gpu=H100):
    """python bench.py --triton-cost: for each case of COST_CASES in fp16/bf16, each launch's
    programs, bytes, FLOPs and µs on gpu (launch_us), then each case's totals: two markdown
    tables."""
    print(f"| case | launch | programs | SMs used | MB | MFLOP tensor / other | µs memory | "
          f"µs compute | µs expected | bound |\n|{'---|' * 10}")
    totals = {}
    for name, (B, H, P, side, D) in COST_CASES.items():
        totals[name] = {'forward': [], 'backward': []}
        for launch in triton_launches(B, H, P + side * side, D, gpu=gpu):
            us, programs = launch_us(launch, gpu), launch['programs']
            bound = max(us, key=us.get)
            totals[name][launch['part']].append(us[bound])
            used = 'all' if programs is None else f"{min(programs, gpu['sms'])}/{gpu['sms']}"
            print(f"| {name} | {launch['name']} | {programs or 'torch'} | {used} | "
                  f"{launch['bytes'] / 1e6:.2f} | {launch['tensor_flops'] / 1e6:.1f} / "
                  f"{launch['flops'] / 1e6:.1f} | {us['memory']:.1f} | {us['compute']:.1f} | "
                  f"{us[bound]:.1f} | {bound} |")
    print(f"\n| case | forward: launches, µs | backward: launches, µs | forward + backward µs | "
          f"launches at the floor |\n|{'---|' * 5}")
    for name, us in totals.items():
        times = us['forward'] + us['backward']
        print(f"| {name} | {len(us['forward'])}, {sum(us['forward']):.1f} | "
              f"{len(us['backward'])}, {sum(us['backward']):.1f} | {sum(times):.1f} | "
              f"{sum(t == gpu['launch_us'] for t in times)} of {len(times)} |")


# --------------------------------------------------------------------------------------------------
# python bench.py --gpu: the reference, the compiled core, the Triton kernel (triton_core.py) and
# softmax SDPA on one GPU, and a whole InLine-Swin-T training step with each InLine core. --device
# cpu: a smoke test at tiny sizes (the Triton rows under the interpreter if TRITON_INTERPRET=1, else
# marked not run).

# name: ((B, H, P, grid side, D) on a GPU, the same for the smoke test); P leading tokens
# (DeiT's class token). Swin-T's stage 1 at the step's batch, 64; DeiT-T (3 heads of 64) at 224, 512
# and 1024 px, 1 + (px/16)^2 tokens, the batch shrinking as the tokens grow.
GPU_CASES = {
    'swin_t_stage1': ((64, 3, 0, 56, 32), (2, 3, 0, 8, 32)),
    'deit_t_224px': ((64, 3, 1, 14, 64), (2, 3, 1, 4, 64)),
    'deit_t_512px': ((32, 3, 1, 32, 64), (1, 3, 1, 6, 64)),
    'deit_t_1024px': ((8, 3, 1, 64, 64), (1, 3, 1, 9, 64)),
}
GPU_CORES = ('reference', 'compiled', 'triton', 'sdpa')
GPU_STEP_BATCH = 64  # the training step's; the smoke test's is 2, on SMOKE_SWIN
SMOKE_SWIN = dict(img_size=64, embed_dim=16, depths=(1, 1, 1, 1), num_heads=(1, 2, 2, 4),
                  softmax_window=2)


def gpu_core(name, device):
    """The core called name, (q, k, v, r, grid) -> o, or why it cannot run on device (a string)."""
    if name == 'reference':
        return inline.inline_core
    if name == 'compiled':
        return inline_core_fast
    if name == 'sdpa':  # softmax attention, FlashAttention where it applies; no Eq. 6
        return lambda q, k, v, r, grid: F.scaled_dot_product_attention(q, k, v)
    try:
        import triton_core  # here, not at the top: bench.py runs where triton is not installed
    except ImportError as e:
        return f"not run ({e})"
    if device.type != 'cuda' and not triton_core.INTERPRETED:
        return "not run (needs CUDA or TRITON_INTERPRET=1)"
    return triton_core.inline_core_triton


def gpu_ms(fn, device, rep_ms=100):
    """Median ms of fn: triton.testing.do_bench on CUDA (rep_ms of calls, the L2 cache flushed
    before each); elsewhere three calls after a warm-up."""
    if device.type == 'cuda':
        import triton.testing
        return triton.testing.do_bench(fn, warmup=25, rep=rep_ms, return_mode='median')
    fn()
    times = []
    for _ in range(3):
        start = time.perf_counter()
        fn()
        times.append(time.perf_counter() - start)
    return 1e3 * statistics.median(times)


def bench_gpu_case(name, dtype, device, smoke=False, cores=GPU_CORES):
    """Rows of --gpu for one case and dtype: each core's forward (no gradient) and forward +
    backward (the gradients of q, k, v and r) in ms, and the peak memory of forward + backward in
    MB."""
    B, H, P, side, D = GPU_CASES[name][smoke]
    N, grid = P + side * side, (side, side)
    gen = torch.Generator(device).manual_seed(0)
    q, k, v, do = (torch.randn(B, H, N, D, generator=gen, device=device, dtype=dtype)
                   for _ in range(4))
    r = 0.1 * torch.randn(B, 9 * H * D, generator=gen, device=device, dtype=dtype)
    inputs = [t.requires_grad_() for t in (q, k, v, r)]
    rows = []
    for core_name in cores:
        core = gpu_core(core_name, device)
        row = dict(case=name, batch=B, tokens=N, dtype=str(dtype).replace('torch.', ''),
                   core=core_name)
        if core_name == 'triton':  # what --triton-cost expects on an H100, beside the measured
            try:
                row['expected_fwd_ms'], row['expected_fwdbwd_ms'] = triton_expected_ms(
                    B, H, N, D, dtype.itemsize)
            except ImportError:  # no triton: the row says so
                pass
        if isinstance(core, str):
            rows.append(dict(row, status=core))
            continue

        def fwd():
            with torch.no_grad():
                core(q, k, v, r, grid)

        def fwdbwd():  # SDPA leaves r unused
            torch.autograd.grad(core(q, k, v, r, grid), inputs, do, allow_unused=True)

        rows.append(dict(row, status='ok', fwd_ms=round(gpu_ms(fwd, device), 3),
                         fwdbwd_ms=round(gpu_ms(fwdbwd, device), 3),
                         peak_mb=round(peak_mb(fwdbwd, device), 1)))
    return rows


def bench_gpu_step(fast, device, smoke=False):
    """A row of --gpu: one training step (forward, cross-entropy, backward) of InLine-Swin-T at 224
    px and batch 64 under bf16 autocast, built on device by models.create_model(fast=fast), in ms,
    and its peak memory in MB. Not run where that does not build, or builds another core than fast
    names."""
    B = 2 if smoke else GPU_STEP_BATCH
    row = dict(case='inline_swin_t step', batch=B, tokens=None, dtype='bfloat16',
               core={None: 'reference', 'compile': 'compiled', 'triton': 'triton'}[fast])
    try:
        with torch.device(device):
            model = models.create_model('inline_swin_t', fast=fast, drop_path_rate=0.0,
                                        **(SMOKE_SWIN if smoke else {}))
    except (ValueError, RuntimeError, ImportError) as e:
        return dict(row, status=f"not run ({(str(e).splitlines() or [''])[0]})")
    built = sorted({str(m.fast) for m in model.modules() if isinstance(m, inline.InLineBase)})
    if built != [str(fast)]:  # each InLine module's switch: None, 'compile' or 'triton'
        return dict(row, status=f"not run (fast={fast!r} built {', '.join(built)})")
    gen = torch.Generator(device).manual_seed(0)
    x = torch.randn(B, 3, *model.img_size, generator=gen, device=device)
    y = torch.randint(0, model.num_classes, (B,), generator=gen, device=device)

    def step():
        with torch.autocast(device.type, torch.bfloat16):
            loss = F.cross_entropy(model(x), y)
        loss.backward()
        model.zero_grad(set_to_none=True)

    return dict(row, status='ok', step_ms=round(gpu_ms(step, device, rep_ms=2000), 1),
                peak_mb=round(peak_mb(step, device), 1))


def format_gpu_row(row):
    """One line of --gpu's table: measured ms, the H100's expected ms (the Triton core's rows) and
    peak MB, or why the row did not run."""
    tokens = '' if row['tokens'] is None else row['tokens']
    start = (f"{row['case']:18s} {row['batch']:3d} {tokens:>6} {row['dtype']:>8s} "
             f"{row['core']:>9s} |")
    expected = (f"{row['expected_fwd_ms']:8.3f} {row['expected_fwdbwd_ms']:8.3f}"
                if 'expected_fwd_ms' in row else f"{'':>17s}")
    if row['status'] != 'ok':
        return f"{start} {'':>17s} | {expected} | {row['status']}"
    if 'step_ms' in row:
        return f"{start} {'':>8s} {row['step_ms']:8.1f} | {expected} | {row['peak_mb']:8.1f}"
    return (f"{start} {row['fwd_ms']:8.3f} {row['fwdbwd_ms']:8.3f} | {expected} | "
            f"{row['peak_mb']:8.1f}")


def bench_gpu(device):
    """python bench.py --gpu: GPU_CASES in fp16 and bf16 with each of GPU_CORES, then the training
    step with each InLine core; on a device other than CUDA, a smoke test at tiny sizes."""
    smoke = device.type != 'cuda'
    where = (torch.cuda.get_device_name(device) if not smoke
             else f"{device.type}: a smoke test, tiny sizes")
    print(f"# {where}; expected: the Triton core on an H100 by python bench.py --triton-cost's "
          f"model\n{'case':18s} {'B':>3s} {'tokens':>6s} {'dtype':>8s} {'core':>9s} | "
          f"{'fwd ms':>8s} {'f+b ms':>8s} | {'expected':>8s} {'f+b':>8s} | {'peak MB':>8s}   "
          f"(a step: its ms under f+b)", flush=True)
    for name in GPU_CASES:
        for dtype in (torch.float16, torch.bfloat16):
            for row in bench_gpu_case(name, dtype, device, smoke):
                print(format_gpu_row(row), flush=True)
    for fast in inline.FAST:
        print(format_gpu_row(bench_gpu_step(fast, device, smoke)), flush=True)


def run_benchmarks():
    parser = argparse.ArgumentParser(
        description="Benchmark the fast InLine core against the reference")
    parser.add_argument('--bench', action='store_true', help="time the attention-core cases")
    parser.add_argument('--choices', action='store_true',
                        help="time two design choices (see bench_choices)")
    parser.add_argument('--compile', action='store_true',
                        help="time the first use: compiling the two graphs")
    parser.add_argument('--per-call', action='store_true',
                        help="what one call costs beside its work, at 197 tokens, 49-token windows "
                             "and 56x56 tokens (see bench_per_call)")
    parser.add_argument('--causal-bench', action='store_true',
                        help="time the causal core against causal softmax SDPA at --tokens")
    parser.add_argument('--tokens', default=','.join(map(str, CAUSAL_TOKENS)),
                        help="comma-separated sequence lengths of --causal-bench")
    parser.add_argument('--json', action='store_true',
                        help="one JSON object per case instead of a table")
    parser.add_argument('--cases', default=','.join(CASES),
                        help="comma-separated subset of " + ', '.join(CASES))
    parser.add_argument('--dtypes', default='float32,bfloat16', help="comma-separated torch dtypes")
    parser.add_argument('--device', default='cuda' if torch.cuda.is_available() else 'cpu')
    parser.add_argument('--demo', action='store_true',
                        help="the reference's demonstration (injectivity, Eq. 5's forms)")
    parser.add_argument('--threads', type=int, default=None, help="CPU threads (default: torch's)")
    parser.add_argument('--peers', action='store_true',
                        help="InLine against FLatten: one attention block and PVT-T "
                             "(see bench_peers)")
    parser.add_argument('--gpu', action='store_true',
                        help="the four cores and an InLine-Swin-T training step on one GPU (see "
                             "bench_gpu); --device cpu: a smoke test at tiny sizes")
    parser.add_argument('--triton-cost', action='store_true',
                        help="each launch of the Triton core costed for an H100 from its grid, "
                             "bytes and FLOPs (see bench_triton_cost); nothing is timed")
    parser.add_argument('--rounds', type=int, default=9,
                        help="rounds of --peers, each timing every case once")
    args = parser.parse_args()
    if args.threads:
        torch.set_num_threads(args.threads)
    device, dtypes = torch.device(args.device), [getattr(torch, d) for d in args.dtypes.split(',')]
    # --json: stdout holds only JSON lines
    print(f"# {device.type}, {torch.get_num_threads()} threads, torch {torch.__version__}",
          flush=True, file=sys.stderr if args.json else sys.stdout)
    header = (f"{'case':15s} {'tokens':>6s} {'dtype':>8s} | {'reference ms':>15s} | "
              f"{'fast ms':>15s} | {'speed-up':>11s} | {'softmax SDPA ms':>17s} | "
              f"{'floor':>7s} {'fast/':>6s} | {'peak':>6s}\n"
              f"{'':15s} {'':>6s} {'':>8s} | {'fwd':>7s} {'fwd+bwd':>7s} | "
              f"{'fwd':>7s} {'fwd+bwd':>7s} | {'fwd':>5s} {'f+b':>5s} | "
              f"{'fwd':>8s} {'fwd+bwd':>8s} | {'f+b ms':>7s} {'floor':>6s} | {'MB':>6s}")
    if args.demo:
        _demo()
    if args.triton_cost:
        bench_triton_cost()
    if args.gpu:
        bench_gpu(device)
    if args.peers:
        bench_peers(device, dtypes, args.rounds)
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
            print(f"{'tokens':>6s} {'dtype':>8s} | {'causal SDPA ms':>15s} | "
                  f"{'InLine Eq. 5 ms':>15s} | {'speed-up':>11s} | {'Eq. 5 + 6 ms':>15s} | "
                  f"{'speed-up':>11s}\n"
                  f"{'':>6s} {'':>8s} | {ms} | {ms} | {speedup} | {ms} | {speedup}", flush=True)
        for N in map(int, args.tokens.split(',')):
            for dtype in dtypes:
                row = bench_causal(N, dtype, device)
                if args.json:
                    print(json.dumps(row), flush=True)
                    continue
                print(f"{N:6d} {row['dtype']:>8s} | "
                      f"{row['sdpa_fwd_ms']:7.1f} {row['sdpa_fwdbwd_ms']:7.1f} | "
                      + ' | '.join(f"{row[f'{n}_fwd_ms']:7.1f} {row[f'{n}_fwdbwd_ms']:7.1f} | "
                                   f"{row[f'{n}_fwd_speedup']:4.1f}x "
                                   f"{row[f'{n}_fwdbwd_speedup']:4.1f}x"
                                   for n in ('eq5', 'eq56')), flush=True)
    if args.bench:
        if not args.json:
            print(header, flush=True)
        for name in args.cases.split(','):
            for dtype in dtypes:
                row = bench_case(name, dtype, device)
                if args.json:
                    print(json.dumps(row), flush=True)
                    continue
                ref_f, ref_fb, f, fb = (row[k] for k in ('reference_fwd_ms', 'reference_fwdbwd_ms',
                                                         'fast_fwd_ms', 'fast_fwdbwd_ms'))
                print(f"{name:15s} {row['tokens']:6d} {row['dtype']:>8s} | "
                      f"{ref_f:7.1f} {ref_fb:7.1f} | {f:7.1f} {fb:7.1f} | "
                      f"{row['fwd_speedup']:4.1f}x {row['fwdbwd_speedup']:4.1f}x | "
                      f"{row['sdpa_fwd_ms']:8.1f} {row['sdpa_fwdbwd_ms']:8.1f} | "
                      f"{row['floor_fwdbwd_ms']:7.1f} {row['fwdbwd_over_floor']:5.2f}x | "
                      f"{row['fast_peak_mb']:6.1f}", flush=True)

if __name__ == '__main__':
    run_benchmarks()

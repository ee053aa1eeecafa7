"""The paper's speed figures, timed on this machine: F5b and F5c, a whole training step, whole models, dense
sizes.

InLine attention: Han et al., "Bridging the Divide: Reconsidering Softmax and Linear Attention", NeurIPS 2024,
arXiv 2412.06590. Run as `python -m paper speed` (its command lines: paper/__main__.py).
"""
import ctypes
import functools
import json
import os
import statistics
import subprocess
import sys

import torch
import torch.nn.functional as F
from tqdm import tqdm

import bench
import dense
import inline
import kernels
import models
import train
from paper.charts import charts, print_table
from paper.experiments import EXPERIMENTS, create_experiment
from paper.runs import ROOT, machine


# F5b, F5c: images/s of softmax models against their InLine versions, as the window or the image grows

# figure: (what varies, its values, the GPU speed-ups of InLine over softmax in the paper's Fig. 5b, 5c)
SPEED = {
    'F5b': ('window', (7, 14, 28, 56), {28: 1.9, 56: 3.7}),
    'F5c': ('image size', (224, 384, 640, 1024), {640: 2.4, 1024: 4.8}),
}
SPEED_QUICK = {'F5b': (7, 56), 'F5c': (224, 640)}


def speed_models(figure, point, device):
    """(softmax model, InLine model) at one point, both as a user runs them: eval mode, InLine with the fast
    core. F5b: Swin-T with every stage softmax in point x point windows ('SSSS') against InLine-Swin-T with
    InLine windows of point x point (its stage 4 stays softmax, as released); both at 224 px. F5c: DeiT-T with
    softmax attention ('S') against InLine-DeiT-T at point x point px."""
    if figure == 'F5b':
        pair = (models.create_model('inline_swin_t', layout='SSSS', softmax_window=point),
                models.create_model('inline_swin_t', window=point, fast='compile'))
    else:
        pair = (models.create_model('inline_deit_t', layout='S', num_heads=3, img_size=point),
                models.create_model('inline_deit_t', img_size=point, fast='compile'))
    return [m.eval().to(device) for m in pair]


class CountSoftmax(torch.overrides.TorchFunctionMode):
    """Counts calls of F.scaled_dot_product_attention and of an explicit softmax while active."""
    def __init__(self):
        super().__init__()
        self.sdpa = self.explicit = 0

    def __torch_function__(self, func, types, args=(), kwargs=None):
        self.sdpa += func is F.scaled_dot_product_attention
        self.explicit += func in (torch.softmax, torch.Tensor.softmax, F.softmax)
        return func(*args, **(kwargs or {}))


def check_sdpa(model, x):
    """Softmax is timed as users run it, through F.scaled_dot_product_attention, never the N x N teaching
    form."""
    with torch.no_grad(), CountSoftmax() as count:
        model(x)
    if count.sdpa == 0 or count.explicit:
        train.fail(f'the softmax model made {count.sdpa} SDPA calls and {count.explicit} explicit '
                         f'softmax calls; speed times softmax only through F.scaled_dot_product_attention')


def speed_point(figure, point, dtype, device, batch, rounds):
    """Interleaved rounds (softmax then InLine, one forward each) at one point: images/s of each, and the
    speed-up as the median over rounds of softmax time / InLine time (the machine's drift cancels in a
    round)."""
    softmax, inline_model = speed_models(figure, point, device)
    x = torch.randn(batch, 3, *softmax.img_size, generator=torch.Generator().manual_seed(0)).to(device)
    check_sdpa(softmax, x[:1])

    def forward(model):
        with torch.inference_mode(), torch.autocast(device.type, dtype=dtype, enabled=dtype != torch.float32):
            model(x)

    ms = bench.time_interleaved({'softmax': lambda: forward(softmax),
                                   'InLine': lambda: forward(inline_model)},
                                  device, budget_s=1e9, max_rounds=rounds)  # exactly `rounds` rounds
    return dict(figure=figure, point=point, device=device.type, dtype=str(dtype).replace('torch.', ''),
                batch=batch, rounds=rounds, softmax_img_s=batch / statistics.median(ms['softmax']) * 1e3,
                inline_img_s=batch / statistics.median(ms['InLine']) * 1e3,
                speedup=bench.paired_ratio(ms, 'softmax', 'InLine'))


def cmd_speed(args):
    if args.level:
        return cmd_speed_level(args)
    if args.dense:
        return cmd_speed_dense(args)
    if args.whole:
        return cmd_speed_whole(args)
    devices = [torch.device('cpu')] + ([torch.device('cuda')] if torch.cuda.is_available() else [])
    dtypes = [torch.float32, torch.bfloat16]
    points = [(fig, p) for fig,
              (_, values, _) in SPEED.items() for p in (SPEED_QUICK[fig] if args.quick else values)]
    jobs = [(fig, p, dt, dev) for dev in devices for dt in dtypes for fig, p in points]
    rows = []
    for fig, point, dtype, device in tqdm(jobs, desc='speed', dynamic_ncols=True):
        batch = args.batch or (1 if device.type == 'cpu' else 32)
        rounds = args.rounds or (3 if args.quick else 5) if device.type == 'cpu' else args.rounds or 20
        name = f'{device.type}-{str(dtype)[6:]}-{fig}-{point}-b{batch}-r{rounds}.json'
        path = os.path.join(args.out, 'speed', name)
        if not os.path.exists(path):  # a finished point is kept; a rerun times only what is missing
            row = speed_point(fig, point, dtype, device, batch, rounds)
            os.makedirs(os.path.dirname(path), exist_ok=True)
            with open(path, 'w') as f:
                json.dump(row, f)
        with open(path) as f:
            rows.append(json.load(f))
    cpu_amp, why = train.default_amp(torch.device('cpu'))
    # private, so guarded; bf16's speed turns on it
    amx = getattr(torch.cpu, '_is_amx_tile_supported', lambda: False)()
    print('\nF5b: Swin-T, softmax (SSSS, window w) vs InLine-Swin-T (window w), 224 px; F5c: DeiT-T, '
          'softmax vs InLine, image size varied. Inference (eval, inference_mode), softmax through SDPA, '
          'InLine through the fast core; speed-up = median of per-round ratios. CPU: '
          f'{torch.get_num_threads()} threads, {torch.backends.cpu.get_cpu_capability()}; {why}, so train.py '
          f'defaults to {cpu_amp} there.\n')
    print_table(['figure', 'point', 'device', 'dtype', 'batch', 'softmax img/s', 'InLine img/s',
                 'InLine speed-up', 'paper (GPU)'],
                [[r['figure'], f"{r['point']}²" if r['figure'] == 'F5b' else f"{r['point']} px", r['device'],
                  r['dtype'], r['batch'], f"{r['softmax_img_s']:.2f}", f"{r['inline_img_s']:.2f}",
                  f"{r['speedup']:.2f}x",
                  f"{SPEED[r['figure']][2][r['point']]}x" if r['point'] in SPEED[r['figure']][2] else '']
                 for r in rows])
    panels = []
    for fig, (what, values, paper) in SPEED.items():
        series = [(f'{dev} {dt}'
                   + ((' (AMX)' if amx else ' (no AMX)') if (dev, dt) == ('cpu', 'bfloat16') else ''),
                   [r['point'] for r in sel], [r['speedup'] for r in sel], None)
                  for dev in dict.fromkeys(r['device'] for r in rows) for dt in ('float32', 'bfloat16')
                  for sel in [[r for r in rows if (r['figure'], r['device'], r['dtype']) == (fig, dev, dt)]]
                  if sel]
        series.append(('paper, GPU', list(paper), list(paper.values()), None))
        panels.append(dict(series=series, xlabel=what, log_x=True, ylabel='InLine speed-up (x)',
                           xticks=list(values),
                           title=('F5b: Swin-T vs InLine-Swin-T, by window' if fig == 'F5b' else
                                  'F5c: DeiT-T vs InLine-DeiT-T, by size'),
                           hlines=[('equal speed', 1.0)],
                           xlabels=[f'{v}x{v}' if fig == 'F5b' else str(v) for v in values]))
    charts(args.png or os.path.join(args.out, 'speed.png'), panels, cols=2, size=(500, 420))
    if args.model_step:
        model_step_table([torch.device('cpu')] + devices[1:], dtypes)
    return rows


def free_core(q, k, v, r, grid, *options):
    """A stand-in for the InLine core that costs nothing, o = v: a step with it is as fast as any core can
    make it (the projections, r and everything else still run)."""
    return v


def model_step(dtype, device, batch=8):
    """One training step of InLine-Swin-T at 224 px (forward, loss, backward): reference core, fast core, fast
    core under whole-model torch.compile, and every InLine core replaced by free_core (the bound: Amdahl's
    law). Returns ms per step (medians over interleaved rounds) and speed-ups (medians of per-round
    ratios)."""
    gen = torch.Generator(device).manual_seed(0)
    x = torch.randn(batch, 3, 224, 224, generator=gen, device=device)
    y = torch.randint(0, 1000, (batch,), generator=gen, device=device)
    reference = models.create_model('inline_swin_t', drop_path_rate=0.0).to(device)
    fast = models.create_model('inline_swin_t', drop_path_rate=0.0, fast='compile').to(device)
    fast.load_state_dict(reference.state_dict())
    free = models.create_model('inline_swin_t', drop_path_rate=0.0).to(device)
    free.load_state_dict(reference.state_dict())
    # a deliberate stand-in, so not through enable_fast's check: a twin of inline_core named 'free'
    inline.FAST_TWINS['inline.inline_core']['free'] = 'paper.speed.free_core'
    for m in free.modules():
        if isinstance(m, inline.InLineBase):
            m.fast = 'free'

    def step(model):
        with torch.autocast(device.type, dtype=dtype, enabled=dtype != torch.float32):
            loss = F.cross_entropy(model(x), y)
        loss.backward()
        model.zero_grad(set_to_none=True)

    compiled = torch.compile(fast)
    try:
        ms = bench.time_interleaved({'reference': lambda: step(reference), 'fast': lambda: step(fast),
                                     'fast + compile': lambda: step(compiled), 'free core': lambda: step(free)},
                                    device, budget_s=60, max_rounds=15)
    finally:
        del inline.FAST_TWINS['inline.inline_core']['free']
    return {name: (statistics.median(t), bench.paired_ratio(ms, 'reference', name))
            for name, t in ms.items()}


def model_step_table(devices, dtypes):
    rows = []
    for device in devices:
        for dtype in dtypes:
            step = model_step(dtype, device)
            rows.append([device.type, str(dtype)[6:], *[f'{t:.0f} ms ({r:.2f}x)' for t, r in step.values()]])
    print('\nA whole InLine-Swin-T training step, batch 8, 224 px (ms, speed-up over the reference). The '
          'free core returns v and costs nothing: no InLine core can make the step faster than that.\n')
    print_table(['device', 'dtype', 'reference core', 'fast core', 'fast core + whole-model torch.compile',
                 'free core (the bound)'], rows)


# ---------------------------------------------------------------------------------------------------
# python -m paper speed --whole: whole models, InLine against the softmax original a user would pick instead

# (what, InLine model, its softmax original (EXPERIMENTS), image side, batch on CPU, training step?)
WHOLE = (
    ('InLine-Swin-T inference', 'inline_swin_t', 's_swin_t', 224, 32, False),
    ('InLine-Swin-T training step', 'inline_swin_t', 's_swin_t', 224, 8, True),
    ('InLine-DeiT-T inference', 'inline_deit_t', 's_deit_t', 224, 1, False),
    ('InLine-DeiT-T inference', 'inline_deit_t', 's_deit_t', 512, 1, False),
    ('InLine-DeiT-T inference', 'inline_deit_t', 's_deit_t', 1024, 1, False),
)


def whole_step(model, x, y, dtype, training):
    """One forward (eval, inference_mode) or one training step (forward, cross-entropy, backward) under
    autocast."""
    autocast = torch.autocast(x.device.type, dtype=dtype, enabled=dtype != torch.float32)
    if not training:
        with torch.inference_mode(), autocast:
            return model(x)
    with autocast:
        loss = F.cross_entropy(model(x), y)
    loss.backward()
    model.zero_grad(set_to_none=True)


def whole_point(row, dtype, device, rounds, compiled):
    """One row of --whole at one dtype: ms of the softmax original, of InLine through the fast core, and
    (compiled) of InLine under whole-model torch.compile, in one interleaved run; speed-ups as medians of
    per-round ratios."""
    what, name, softmax_name, side, batch, training = row
    drop = dict(drop_path_rate=0.0)  # no random depth: every round runs the same blocks
    softmax = create_experiment(softmax_name, img_size=side, **drop).train(training).to(device)
    inline_model = models.create_model(name, img_size=side, fast='compile', **drop).train(training).to(device)
    gen = torch.Generator().manual_seed(0)
    x, y = torch.randn(batch, 3, side, side,
                       generator=gen).to(device), torch.randint(0, 1000, (batch,)).to(device)
    if not training:
        check_sdpa(softmax, x[:1])
    fns = {'softmax': lambda: whole_step(softmax, x, y, dtype, training),
           'InLine': lambda: whole_step(inline_model, x, y, dtype, training)}
    if compiled:
        compiled_model = torch.compile(inline_model)
        fns['compiled'] = lambda: whole_step(compiled_model, x, y, dtype, training)
    ms = bench.time_interleaved(fns, device, budget_s=1e9, max_rounds=rounds)
    out = dict(what=what, side=side, batch=batch, dtype=str(dtype)[6:], device=device.type, rounds=rounds,
               **{f'{n}_ms': statistics.median(t) for n, t in ms.items()},
               speedup=bench.paired_ratio(ms, 'softmax', 'InLine'))
    if compiled:
        out.update(compiled_speedup=bench.paired_ratio(ms, 'softmax', 'compiled'),
                   compiled_over_fast=bench.paired_ratio(ms, 'InLine', 'compiled'))
    return out


# python -m paper speed --level: where the tokens are few, InLine-DeiT-T at least level with DeiT-T
# (what, image side, batch, training step?, the speed-up InLine should reach)
LEVEL = (('inference, batch 1', 224, 1, False, 1.0), ('inference, batch 1', 512, 1, False, 1.3),
         ('training step, batch 16', 224, 16, True, 1.0))


def attention_free_limit(side, dtype):
    """The speed-up over DeiT-T an InLine-DeiT-T whose attention cost nothing would reach at one inference
    row (batch 1): 1 / (1 - SDPA's share of DeiT-T's forward), from forward_profile. Everything else, the
    linear layers, the MLP, LayerNorm and the patch embedding, the two models share; a row whose figure is
    above this limit cannot be met on this machine, however fast InLine's attention."""
    softmax = create_experiment('s_deit_t', img_size=side, drop_path_rate=0.0).eval()
    x = torch.randn(1, 3, side, side, generator=torch.Generator().manual_seed(0))
    groups = forward_profile(softmax, x, dtype, rounds=3)
    return 1 / (1 - groups['softmax attention (SDPA)'][0] / profile_total(groups))


def cmd_speed_level(args):
    """InLine-DeiT-T (fast core, eager) against DeiT-T (SDPA) at 1 and 2 threads, fp32 and bf16, each row
    beside the speed-up it should reach, and for inference the limit were InLine's attention free
    (attention_free_limit): level where the tokens are few (224 px), ahead at 512 px."""
    rows, threads = [], torch.get_num_threads()
    # a forward at 224 px is tens of ms: 31 rounds hold its ratio within this machine's drift; a training
    # step in emulated bf16 is a minute a round
    inference_rounds, training_rounds = (args.rounds, args.rounds) if args.rounds else (31, 7)
    try:
        for n in (1, 2):
            torch.set_num_threads(n)
            for dtype in (torch.float32, torch.bfloat16):
                for what, side, batch, training, goal in LEVEL:
                    row = ('InLine-DeiT-T', 'inline_deit_t', 's_deit_t', side, batch, training)
                    r = whole_point(row, dtype, torch.device('cpu'),
                                    training_rounds if training else inference_rounds, compiled=False)
                    limit = '' if training else f"{attention_free_limit(side, dtype):.2f}x"
                    rows.append([n, r['dtype'], what, f"{side} px", f"{r['softmax_ms']:.1f}",
                                 f"{r['InLine_ms']:.1f}", f"{r['speedup']:.2f}x", f">= {goal}x", limit,
                                 'yes' if r['speedup'] >= goal else 'no'])
                    print(' | '.join(map(str, rows[-1])), flush=True)
    finally:
        torch.set_num_threads(threads)
    info = machine(threads)
    print(f"\nInLine-DeiT-T through the fast core against DeiT-T through SDPA, both eager, the same sizes; "
          f"{inference_rounds} interleaved rounds an inference row, {training_rounds} a training step, "
          f"ms = median, speed-up = median of per-round ratios. CPU: "
          f"{info['cpu']}, {info['cores']} cores, AVX-512 BF16 {'yes' if info['avx512_bf16'] else 'no'}, "
          f"AMX {'yes' if info['amx'] else 'no'}, bf16 GEMMs "
          f"{'native (oneDNN)' if kernels.NATIVE_CPU_GEMM[torch.bfloat16] else 'by a fallback (slow)'}, "
          f"torch {info['torch']}. Limit: the speed-up were InLine's attention free, 1 / (1 - SDPA's share of "
          f"DeiT-T's forward).\n")
    print_table(['threads', 'dtype', 'row', 'image', 'DeiT-T ms', 'InLine-DeiT-T ms', 'speed-up', 'should be',
                 'limit', 'met'], rows)
    return rows


PROFILE_GROUPS = {  # top-level operator -> what it is in a ViT forward
    'aten::linear': 'Linear layers (qkv, proj, MLP, head)', 'aten::layer_norm': 'LayerNorm',
    'aten::gelu': "GELU (the MLP's)", 'aten::scaled_dot_product_attention': 'softmax attention (SDPA)',
    'aten::add': 'residual adds', 'aten::conv2d': 'patch embedding', 'aten::cat': 'class token and position',
    'aten::to': 'casts and copies', 'aten::contiguous': 'casts and copies', 'aten::copy_': 'casts and copies',
}
CORE_LABEL = 'InLine core (kernels.inline_core_fast)'
PREDICTOR_LABEL = 'Eq. 6 predictor (residual_weights)'


def forward_profile(model, x, dtype, rounds=5):
    """Where one forward (eval, inference_mode, batch 1) spends its time: {group: (ms, calls) per forward},
    from torch.profiler's top-level operators, grouped by PROFILE_GROUPS; the InLine core and Eq. 6's
    predictor are labelled around their calls, and the core split into its compiled graph's kernels
    (inductor's code and the GEMMs it calls), dynamo's guards and wrappers around them, and its call in
    Python (checks, the table)."""
    # the twin is looked up by name at every call (inline.fast_twin), so the labelled one is called
    saved = kernels.inline_core_fast, inline.residual_weights
    kernels.inline_core_fast = functools.partial(labelled_call, CORE_LABEL, kernels.inline_core_fast)
    inline.residual_weights = functools.partial(labelled_call, PREDICTOR_LABEL, inline.residual_weights)
    try:
        for _ in range(2):
            whole_step(model, x, None, dtype, False)
        with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CPU]) as prof:
            for _ in range(rounds):
                whole_step(model, x, None, dtype, False)
    finally:
        kernels.inline_core_fast, inline.residual_weights = saved
    groups = {}

    def add(group, us, calls=1):
        ms, n = groups.get(group, (0.0, 0))
        groups[group] = (ms + us / 1e3 / rounds, n + calls / rounds)

    events = prof.events()
    for e in events:
        if e.cpu_parent is None:  # top-level: every microsecond of the forward is in exactly one of these
            add(e.name if e.name in (CORE_LABEL, PREDICTOR_LABEL) else PROFILE_GROUPS.get(e.name, 'other'),
                e.cpu_time_total)
        if e.name.startswith('## Call CompiledFxGraph'):
            add('  of which its compiled graph (kernels and GEMMs)', e.cpu_time_total)
        elif e.name.startswith('Torch-Compiled Region'):
            add("  of which dynamo's guards and wrappers", e.cpu_time_total - sum(
                c.cpu_time_total for c in e.cpu_children if c.name.startswith('## Call CompiledFxGraph')))
        if e.name in ('aten::copy_',):
            add('every copy and cast (aten::copy_), wherever called', e.self_cpu_time_total)
    if CORE_LABEL in groups:
        inner = sum(groups.get(g, (0, 0))[0] for g in groups if g.startswith('  of which'))
        add("  of which the rest of its call: Python (checks, the table, torch.compile's entry)",
            1e3 * rounds * (groups[CORE_LABEL][0] - inner), 0)
    return groups


def profile_total(groups):
    """A forward's ms from forward_profile's groups: the top-level ones alone (the '  of which' parts and
    the copies counted wherever they are called lie inside them)."""
    return sum(ms for g, (ms, _) in groups.items() if not g.startswith('  ') and not g.startswith('every'))


def labelled_call(label, f, *args, **kwargs):
    with torch.profiler.record_function(label):
        return f(*args, **kwargs)


def cmd_speed_whole(args):
    device = torch.device(args.device or 'cpu')
    rounds = args.rounds or (5 if device.type == 'cpu' else 20)
    dtypes = [torch.float32, torch.bfloat16]
    chosen = [row for row in WHOLE if args.whole == 'all' or f'_{args.whole}_' in row[1]]  # 'inline_deit_t'
    rows = [whole_point(row, dtype, device, rounds, args.compile)
            for row in tqdm(chosen, desc='whole', dynamic_ncols=True) for dtype in dtypes]
    info = machine(torch.get_num_threads())
    print("\nWhole models, InLine through the fast core against the softmax original built with "
          f"F.scaled_dot_product_attention, the same sizes; {rounds} interleaved rounds, ms = median, "
          "speed-up = median of per-round ratios (softmax time / InLine time: above 1, InLine is faster). "
          f"{device.type}: {info['cpu']}, AVX-512 BF16 "
          f"{'yes' if info['avx512_bf16'] else 'no'}, AMX {'yes' if info['amx'] else 'no'}, "
          f"{info['threads']} threads, torch {info['torch']}.\n")
    header = ['model', 'image', 'batch', 'dtype', 'softmax ms', 'InLine ms', 'InLine speed-up']
    if args.compile:
        header += ['InLine compiled ms', 'compiled speed-up', 'compiled / fast core alone']
    print_table(header, [[r['what'], f"{r['side']} px", r['batch'], r['dtype'], f"{r['softmax_ms']:.1f}",
                          f"{r['InLine_ms']:.1f}", f"{r['speedup']:.2f}x"] + ([
                          f"{r['compiled_ms']:.1f}", f"{r['compiled_speedup']:.2f}x",
                          f"{r['compiled_over_fast']:.2f}x"]
                          if args.compile else []) for r in rows])
    x = torch.randn(1, 3, 224, 224, generator=torch.Generator().manual_seed(0)).to(device)
    profiles = {}
    for name, model in (('InLine-DeiT-T', models.create_model('inline_deit_t', fast='compile')),
                        ('DeiT-T', create_experiment('s_deit_t'))):
        for dtype in dtypes:
            profiles[f'{name} {str(dtype)[6:]}'] = forward_profile(model.eval().to(device), x, dtype)
    groups = dict.fromkeys(g for p in profiles.values() for g in sorted(p, key=lambda g: -p[g][0]))
    order = []
    for g in (g for g in groups if not g.startswith('  ')):  # the core's parts under it
        order += [g] + ([s for s in groups if s.startswith('  ')] if g == CORE_LABEL else [])
    print("\nWhere a forward of batch 1 at 224 px spends its time (eval, inference_mode; torch.profiler, "
          "the mean of 5 forwards; ms per forward, with calls per forward): InLine-DeiT-T through the fast "
          "core, DeiT-T through SDPA.\n")
    print_table(['where'] + list(profiles), [[g.replace('  ', '… ')] + [
        (f"{p[g][0]:.2f}" + (f" ({p[g][1]:.0f})" if p[g][1] else '')) if g in p else ''
        for p in profiles.values()]
        for g in order] +
        [['total']
         + [f"{profile_total(p):.2f}" for p in profiles.values()]])
    return rows


# ---------------------------------------------------------------------------------------------------
# Dense: backbone forward time and peak memory at detection sizes, each softmax original against InLine

# COCO's 800x1333 padded to 32, as detectors pad
DENSE_SIZES = ((512, 512), (640, 640), (800, 800), (800, 1344))
DENSE = {  # comparison: (softmax original, InLine), EXPERIMENTS and registered names
    # shifted 7x7 windows in every stage; InLine over the whole stage
    'Swin-T': ('s_swin_t', 'inline_swin_t'),
    'PVT-S': ('s_pvt_s', 'inline_pvt_s'),  # softmax with spatial reduction 8-4-2-1; InLine over all tokens
    'DeiT-T': ('s_deit_t', 'inline_deit_t'),  # global softmax over all (H/16)(W/16) + 1 tokens
}


def dense_forward(name, size, device):
    """The forward a detector runs: PVT and Swin as features_only backbones (built at 224 px, fed `size`);
    DeiT, which has no feature pyramid, built for `size`, its forward_features. Eval; InLine through the fast
    core (kernels.py), as train.py runs it, softmax through SDPA."""
    e = EXPERIMENTS.get(name)
    variant, overrides = (e.model, e.overrides) if e else (name, {})
    overrides = dict(overrides, fast=e is None)  # the s_* experiments are the softmax originals
    if variant.startswith('inline_deit'):
        model = models.create_model(variant, img_size=size, **overrides).eval().to(device)
        return model.forward_features
    return dense.create_backbone(variant, **overrides).eval().to(device)


def vm_kib(field):
    with open('/proc/self/status') as f:
        return next(int(line.split()[1]) for line in f if line.startswith(field + ':'))


def dense_peak_rss(name, height, width):
    """Run in a fresh process (cmd_speed_dense starts one per point): how far one CPU forward raises the
    process's peak resident memory (VmHWM, reset first through /proc/self/clear_refs) above its resident
    memory just before, with the model and the image already in place. Prints MiB."""
    fn = dense_forward(name, (height, width), torch.device('cpu'))
    x = torch.randn(1, 3, height, width, generator=torch.Generator().manual_seed(0))
    with torch.inference_mode():
        fn(x)  # the fast core compiles on its first call: the compiler's memory is not the forward's
    ctypes.CDLL(None).malloc_trim(0)  # glibc hands the freed pages back, so the forward's own show again
    with open('/proc/self/clear_refs', 'w') as f:
        f.write('5')  # VmHWM := VmRSS (Linux >= 4.0)
    before = vm_kib('VmRSS')
    with torch.inference_mode():
        fn(x)
    print(json.dumps((vm_kib('VmHWM') - before) / 1024))


def dense_peak_mb(name, size, device):
    if device.type == 'cuda':
        fn, x = dense_forward(name, size, device), torch.randn(1, 3, *size, device=device)
        with torch.inference_mode():
            # max_memory_allocated above what was allocated before
            return bench.peak_mb(lambda: fn(x), device)
    code = f'from paper import speed; speed.dense_peak_rss({name!r}, {size[0]}, {size[1]})'
    run = subprocess.run([sys.executable, '-c', code], cwd=ROOT, capture_output=True, text=True)
    # None: did not fit
    return json.loads(run.stdout.strip().splitlines()[-1]) if run.returncode == 0 else None


def dense_point(comparison, size, device, rounds):
    """Interleaved rounds (softmax then InLine, one forward of batch 1 each) at one size, and each one's
    peak."""
    softmax_name, inline_name = DENSE[comparison]
    fns = {n: dense_forward(n, size, device) for n in (softmax_name, inline_name)}
    x = torch.randn(1, 3, *size, generator=torch.Generator().manual_seed(0)).to(device)

    def forward(fn):
        with torch.inference_mode():
            fn(x)

    ms = bench.time_interleaved({n: lambda fn=fn: forward(fn) for n, fn in fns.items()},
                                  device, budget_s=1e9, max_rounds=rounds)  # exactly `rounds` rounds
    del fns
    return dict(comparison=comparison, size=list(size), device=device.type, rounds=rounds,
                softmax_ms=statistics.median(ms[softmax_name]), inline_ms=statistics.median(ms[inline_name]),
                speedup=bench.paired_ratio(ms, softmax_name, inline_name),
                softmax_mb=dense_peak_mb(softmax_name, size, device),
                inline_mb=dense_peak_mb(inline_name, size, device))


def cmd_speed_dense(args):
    devices = [torch.device('cpu')] + ([torch.device('cuda')] if torch.cuda.is_available() else [])
    rows = []
    jobs = [(c, s, d) for d in devices for c in DENSE for s in DENSE_SIZES]
    for comparison, size, device in tqdm(jobs, desc='dense', dynamic_ncols=True):
        rounds = args.rounds or (3 if device.type == 'cpu' else 20)
        path = os.path.join(args.out, 'dense',
                            f'{device.type}-{comparison}-{size[0]}x{size[1]}-r{rounds}-fast.json')
        if not os.path.exists(path):  # a finished point is kept; a rerun times only what is missing
            row = dense_point(comparison, size, device, rounds)
            os.makedirs(os.path.dirname(path), exist_ok=True)
            with open(path, 'w') as f:
                json.dump(row, f)
        with open(path) as f:
            rows.append(json.load(f))
    cpu = subprocess.run(['sh', '-c', "grep -m1 'model name' /proc/cpuinfo | cut -d: -f2"],
                         capture_output=True, text=True).stdout.strip() or 'unknown CPU'
    print('\nBackbone forward, batch 1, fp32, eval + inference_mode; InLine through the fast core, softmax '
          f'through SDPA; time = median of {rounds} interleaved rounds, speed-up = median of per-round '
          'ratios. Peak: CPU, the rise of peak RSS over one forward in a fresh process; CUDA, '
          f'max_memory_allocated above the model. CPU: {cpu}, {torch.get_num_threads()} threads.\n')
    mb = lambda v: '—' if v is None else f'{v:.0f}'  # noqa: E731  (None: the forward did not fit)
    print_table(['backbone', 'image', 'device', 'softmax ms', 'InLine ms', 'InLine speed-up',
                 'softmax peak MiB', 'InLine peak MiB'],
                [[r['comparison'], '{}×{}'.format(*r['size']), r['device'], f"{r['softmax_ms']:.0f}",
                  f"{r['inline_ms']:.0f}", f"{r['speedup']:.2f}x", mb(r['softmax_mb']),
                  mb(r['inline_mb'])] for r in rows])
    pixels = [h * w for h, w in DENSE_SIZES]
    labels = [f'{h * w / 1e6:.2f}' for h, w in DENSE_SIZES]
    panels = []
    for key, ylabel in (('ms', 'forward ms (batch 1)'), ('mb', 'peak MiB of the forward')):
        series = [(f"{c} {kind}{'' if dev == 'cpu' else ' ' + dev}",
                   [h * w for h, w in (r['size'] for r in sel)], [r[f'{kind.lower()}_{key}'] for r in sel],
                   None)
                  for dev in dict.fromkeys(r['device'] for r in rows) for c in DENSE
                  for kind in ('softmax', 'InLine')
                  for sel in [[r for r in rows if (r['comparison'], r['device']) == (c, dev)
                               and r[f'{kind.lower()}_{key}'] is not None]] if sel]
        panels.append(dict(series=series,
                           xlabel='megapixels: ' + ', '.join(f'{h}x{w}' for h, w in DENSE_SIZES), log_x=True,
                           ylabel=ylabel, xticks=pixels, xlabels=labels, title="Backbone "
                                                 f"{'forward time' if key == 'ms' else 'peak memory'}, "
                                                 "softmax vs InLine"))
    # legend: one row
    charts(args.png or os.path.join(args.out, 'dense.png'), panels, cols=1, size=(820, 400))
    return rows


# ---------------------------------------------------------------------------------------------------

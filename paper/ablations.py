"""The paper's ablations (T3, T4, T10, R-res, R-dil, R-nonneg, T1, S), each experiment trained small by
train.py: the miniatures, the budgets, the plans of runs, and the tables and pictures built from their
records.

InLine attention: Han et al., "Bridging the Divide: Reconsidering Softmax and Linear Attention", NeurIPS 2024,
arXiv 2412.06590. Run as `python -m paper ablations` (its command lines: paper/__main__.py).
"""
import argparse
import json
import math
import os
import statistics

import torch

import data
import models
import train
from paper.charts import ablations_pictures, print_table, short_name
from paper.experiments import EXPERIMENTS, T1_REFERENCE, Experiment, paper_claim
from paper.runs import LabRun, read_records, train_runs
from paper.stats import (ALPHA, EQUIVALENT, MARGIN, PAPER_TIE, compare, half_width, holm, power, scores,
                         seed_correlation, summarise, tests, verdict)
from paper.verdicts import (CONFIRMATORY, EXPLORATORY, READS, power_plan, read_summary, readable, robustness,
                            rules_label, side_by_side)


# The ablations (T3, T4, T10, R-res, R-dil, R-nonneg, T1, S), each experiment trained small by train.py

# The miniature, the same for every experiment of a family, at an image size per family: 64 px
# (Fashion-MNIST's 28 px resized), so Swin's stage 1 is a 16x16 grid (stages 16, 8, 4, 2), against 56x56 at
# 224 px, and DeiT's 8 px patches give an 8x8 grid. Everything measured in stage-1 tokens shrinks by 16/56:
# the InLine windows 7, 14, 28, 56 of T4 become 2, 4, 8, 16 (1/8, 1/4, 1/2 and all of the stage, as in the
# paper); Swin's softmax window becomes 4. Widths shrink by the family's factor with the head dim kept, so
# head counts shrink with them (the softmax originals' own counts too); depths as listed, the same for a
# softmax original as for its InLine version.
MINI = {  # family: (image side, width factor, create_model sizes)
    'swin': (64, 1 / 3, dict(embed_dim=32, depths=(2, 2, 2, 2), num_heads=(1, 2, 4, 8), softmax_window=4)),
    'deit': (64, 1 / 3, dict(patch_size=8, embed_dim=64, depth=6, num_heads=2)),
    'pvt': (64, 1, dict(depths=(1, 1, 1, 1), sr_ratios=(4, 2, 1, 1))),
    # CSwin keeps its width: its two-branch softmax blocks split the heads in halves, and stage 1 has 2
    'cswin': (64, 1, dict(depths=(1, 2, 2, 1), stripes=(1, 2, 2, 2))),
}
# The budget of every run (RESULTS.md, "Ablations"), chosen by a pilot of r_residual_local and
# r_residual_none: the cheapest that lifted both 3 points over a linear read-out of the pixels. The first
# train_images of a fixed random order of the training set, the same for every run and seed; warm-up 1/12 of
# the epochs (the small recipe's 1 of 12). On CUDA, the scale at which the miniatures converge: every training
# image, epochs until the curve is flat.
BUDGET = {'cpu': dict(train_images=60_000, epochs=4), 'cuda': dict(train_images=60_000, epochs=40)}
# The test bed where attention must select (RESULTS.md, "A test bed where attention must select"): train.py's
# fashion_recall mosaics, task 'below', 20,000 training mosaics (new ones each seed) and the same 10,000 test
# mosaics for every run, at the accepted pilot's budget; the Swin miniature with heads of dim 8 in every stage
# (4, 8, 16, 32), so that every InLine layer of stages 1-3 has at least D + 1 tokens (256, 64, 16 against 9)
# and is injective. A network that cannot tell the three candidate blocks apart (the floor, no position in a
# stage) scores 1 in 3 at best. On CUDA, a scale at which the curves should flatten (not yet measured).
MOSAICS = dict(task='below', val_images=10_000, heads=(4, 8, 16, 32), guess=100 / 3)
MOSAIC_BUDGET = {'cpu': dict(train_images=20_000, epochs=4), 'cuda': dict(train_images=100_000, epochs=20)}
# The power plan, fixed before the 16-epoch batch (RESULTS.md, "Verdicts"): the pooled sd of the seeds of the
# six rows with 16-epoch records then (points), and the seeds it asks of a new row: 80% power for TOST at
# Δ = 0 against InLine-Swin-T's 10 seeds, at Holm's strictest step
PLAN_SD, PLAN_SEEDS = 0.25, 12
# The longer budget: every comparison of MOSAIC_ROWS again at 16 epochs (`--rerun`), the family the README
# quotes (RESULTS.md, "Verdicts"). 16 epochs: the pilot at 8 (r_residual_none, t3_inline_relu, seed 0) still
# gained 1.7 and 2.1 points over its last quarter, at 16 r_residual_none 0.7. In bf16 as the 4-epoch rows, so
# that the budget is all that differs. Seeds a row: those read at 16 epochs before the rules keep theirs (a
# seed added after a look is a second look); the rows new to 16 epochs get PLAN_SEEDS, the power plan's
MOSAIC_RERUN = dict(epochs=16, precision='bf16', seeds={
    't3_linear_relu': 5, 't3_inline_relu': 5, 'r_residual_none': 10, 'r_residual_local': 10,
    't4_window14_no_residual': 5, 't4_window56_no_residual': 10, 'p_transnormer_swin': 5,
    's_swin_t': PLAN_SEEDS, 'inline_swin_t': 10, 't1_swin_softmax_normalised_q': PLAN_SEEDS,
    't1_inline_normalised_q': PLAN_SEEDS,
    'r_residual_plain': PLAN_SEEDS, 'p_flatten_swin': PLAN_SEEDS, 'p_flatten_swin_subtraction': PLAN_SEEDS})
# a run at MOSAIC_BUDGET['cpu'] before any record: pilot 2's 1.5-2 CPU-minutes an epoch
MOSAIC_RUN_CPU_MIN = 7.0
# T1 in Swin, on this bed alone: in Fashion-MNIST's miniature (D 32) InLine's stage 3 has 16 tokens, not
# injective; and the peers (P), which the claim rows there never had
MOSAIC_ONLY = ('t1_swin_softmax_normalised_q', 't1_inline_normalised_q', 'p_flatten_swin',
               'p_flatten_swin_subtraction', 'p_transnormer_swin')
# The claims it can test, in the order a batch trains them, two by two: the gate (InLine against its floor); S
# with R-res's no-Eq. 6 row; T3's pair; T1 within softmax and within InLine; R-res's plain row with T4's
# one-cell window; the peers, FLatten and TransNormer (P). r_residual_local and t4_window56_no_residual name
# configurations trained above (InLine-Swin-T, r_residual_none).
MOSAIC_ROWS = ('floor_swin', 'inline_swin_t', 's_swin_t', 'r_residual_none', 't3_linear_relu',
               't3_inline_relu', 't1_swin_softmax_normalised_q', 't1_inline_normalised_q', 'r_residual_plain',
               't4_window14_no_residual', 'r_residual_local', 't4_window56_no_residual', 'p_flatten_swin',
               'p_flatten_swin_subtraction', 'p_transnormer_swin')
# bf16 autocast, training and validation, on both: on this project's CPU (AVX-512 BF16, no AMX) a training
# step of the Swin miniature took 0.13 CPU-s in bf16 against 0.22 in fp32 (batch 64, one thread, interleaved
# rounds). A CPU with AVX2 alone emulates bf16 (a step 9x slower than fp32): --precision fp32 there, a recipe
# of its own (its records never share a table with bf16 ones)
PRECISION = {'cpu': 'bf16', 'cuda': 'bf16'}
# top-1 points over its family's phi = 0 floor (the attention-free miniature, same recipe) that a
# configuration must clear for its comparisons to get a verdict: fixed before the claim runs, then over a
# linear read-out of the pixels, which the floor replaced as the gate after them
FLOOR_MARGIN = 3.0
# CPU-minutes of one run per family at BUDGET['cpu'] on this project's machine, two at a time, to print a
# length before the first record of a recipe exists (then the records' own mean is used); scaled by epochs x
# images. Swin from the pilot's two runs; the others by their step costs relative to Swin's, measured before
RUN_CPU_MIN = {'swin': 9.5, 'deit': 7.2, 'pvt': 17.0, 'cswin': 19.0}
SEEDS = {'T3': 3, 'T4': 3, 'R-res': 3, 'S': 3, 'T10': 3, 'R-dil': 3, 'R-nonneg': 3, 'T1': 3, 'P': 3,
         'floor': 3}
# The claim rows (RESULTS.md, "Verdicts"), with the seeds that give a 1-point effect 80% power at the spreads
# measured (in the order a batch trains them: T3's pair, R-res's (T4's at 56²), S's, then T4's windows)
CLAIM_ROWS = ('t3_linear_relu', 't3_inline_relu', 't4_window56_no_residual', 't4_window56_residual',
              'r_residual_none', 'r_residual_local', 's_swin_t', 'inline_swin_t', 't4_window14_no_residual',
              't4_window28_no_residual')
CLAIM_SEEDS = 5
# a batch gives every configuration 3 seeds, in the chosen order, before it gives any a fourth
FIRST_SEEDS = 3
QUICK = ('r_residual_none', 'r_residual_local')  # R-res, the paper's pair: runs the claim batch shares
QUICK_SEEDS = 3
# The data the lab trains on unless told: Fashion-MNIST, which Debian's dataset-fashion-mnist package installs
# here
FASHION_MNIST_DEB = '/usr/share/datasets/fashion-mnist'


def budgets(dataset):
    """{device: the budget}: MOSAIC_BUDGET on the mosaics (fashion_recall), else BUDGET."""
    return MOSAIC_BUDGET if dataset == 'fashion_recall' else BUDGET


def family(e):
    return e.model.split('_')[1]


def experiments(dataset=None):
    """{name: Experiment}: every entry of EXPERIMENTS that the miniature covers (the smallest size of each
    family: S rows of bigger variants repeat the same miniature), the released InLine variants for S, and each
    family's attention-free floor: InLine with phi = 0, so every weight is 1/N and no token selects another,
    no Eq. 6, no APE, every stage (Swin's softmax stage 4 too); the patch embeddings, merges and MLPs are the
    same. dataset 'fashion_recall': MOSAIC_ROWS alone, each with MOSAICS' heads (given at full size: the
    miniature scales them by its width factor, as it does every head count)."""
    chosen = {n: e for n, e in EXPERIMENTS.items() if (e.table != 'S' or e.model.endswith('_t')) and (
        dataset == 'fashion_recall' or n not in MOSAIC_ONLY)}
    none, local = chosen['r_residual_none'], chosen['r_residual_local']
    chosen['r_residual_none_matched'] = Experiment(
        none.model, {**none.overrides, 'mlp_ratio': matched_mlp_ratio(none, parameters(local))}, 'R-res',
        None, True, "no residual (APE), every MLP widened to Eq. 6's parameter count")
    inline_t = {n: Experiment(n, {}, 'S', str(models.RELEASED[n][2]), False, f'{n} as released')
                for n in ('inline_swin_t', 'inline_deit_t', 'inline_pvt_t', 'inline_cswin_t')}
    floors = {f'floor_{f}': Experiment(f'inline_{f}_t', dict(
        layout='I' if f == 'deit' else 'IIII', feature_map='zero', eq6='none',
        **({'ape': False} if f == 'swin' else {})),
        'floor', None, True, f'{f} miniature, attention-free: every weight 1/N, no Eq. 6') for f in MINI}
    every = {**chosen, **inline_t, **floors}
    if dataset == 'fashion_recall':
        heads = tuple(round(h / MINI['swin'][1]) for h in MOSAICS['heads'])
        return {n: every[n]._replace(overrides={**every[n].overrides, 'num_heads': heads})
                for n in MOSAIC_ROWS}
    return every


def matched_mlp_ratio(e, count):
    """The mlp_ratio (one for every block, 3 decimals) that gives e's miniature `count` parameters: a block of
    width C with hidden width H has (2C + 1) H of its MLP's parameters, so H grows by the gap over sum (2C +
    1) C per unit of ratio. The R-res row that matches Eq. 6 parameter for parameter."""
    model = miniature(e)
    mlps = [m for m in model.modules() if isinstance(m, models.Mlp)]
    ratio = mlps[0].fc1.out_features / mlps[0].fc1.in_features
    per_unit = sum((2 * m.fc1.in_features + 1) * m.fc1.in_features for m in mlps)
    return round(ratio + (count - sum(p.numel() for p in model.parameters())) / per_unit, 3)


def comparisons(chosen):
    """[(tables, row, reference)]: the pairs the verdicts compare, row minus reference seed by seed, in the
    order of the tables; a pair two tables make (T4's Eq. 6 at 56² is R-res's pair) comes once, naming both.
    T3: division against subtraction, the same phi; T4: without against with Eq. 6 at each window, and each
    window against the whole stage, with and without Eq. 6 (the paper's four no-Eq. 6 rows are a tie); R-res:
    against the released InLine-Swin-T, and the two corners of the 2x2 (Eq. 6 x APE) against the row with the
    same APE; T10, R-dil, R-nonneg: against InLine-Swin-T; T1: each over normalised q against itself
    (T1_REFERENCE); S: each softmax original against its InLine version; floor: each family's InLine model
    against its attention-free floor."""
    pairs = []
    for name, e in chosen.items():
        t = e.table
        if t == 'T3' and '_linear_' in name:
            pairs.append((t, name, name.replace('linear', 'inline')))
        elif t == 'T4' and name != 't4_window56_residual':
            pairs.append((t, name, name.replace('_no_residual', '_residual') if 'no_residual' in name else
                          't4_window56_residual'))
            if 'no_residual' in name and name != 't4_window56_no_residual':
                pairs.append((t, name, 't4_window56_no_residual'))
        elif t == 'S' and name.startswith('s_'):
            pairs.append((t, name, name.replace('s_', 'inline_', 1)))
        elif t == 'floor':
            pairs.append((t, e.model, name))
        elif t == 'P':  # each peer against InLine-Swin-T (the rebuttal's orderings); FLatten's subtraction
            # against its division
            pairs.append((t, name, 'p_flatten_swin' if name == 'p_flatten_swin_subtraction'
                          else 'r_residual_local'))
        elif t in ('T10', 'R-res', 'R-dil', 'R-nonneg', 'T1'):
            base = {'T10': 't10_kernel_identity', 'R-res': 'r_residual_local', 'R-dil': 'r_dilation1',
                    'R-nonneg': 'r_residual_local', 'T1': T1_REFERENCE.get(name, 't1_softmax')}[t]
            if name == 'r_residual_local_ape':
                pairs.append((t, name, 'r_residual_none'))  # both with the APE: Eq. 6 alone
            elif name != base:
                pairs.append((t, name, base))
    found, keys = {}, {name: config_key(e) for name, e in chosen.items()}
    for t, name, ref in pairs:
        if name in chosen and ref in chosen:
            tables = found.setdefault(frozenset((keys[name], keys[ref])), ([], name, ref))[0]
            tables += [t] * (t not in tables)
    return [(tuple(tables), name, ref) for tables, name, ref in found.values()]


def mini_kwargs(e):
    """The create_model overrides that make an experiment's miniature, on top of its own: the family's sizes,
    head counts the experiment sets scaled by the family's width factor, windows scaled to Swin's stage 1
    (None, the whole stage, where they cover it). CSwin's softmax original keeps the miniature's depths, not
    its own."""
    img, width, sizes = MINI[family(e)]
    kwargs = dict(sizes)
    if 'num_heads' in e.overrides:
        heads = e.overrides['num_heads']
        scaled = [h * width for h in (heads if isinstance(heads, tuple) else (heads,))]
        if any(abs(h - round(h)) > 1e-9 for h in scaled):
            raise ValueError(f'{e.model}: {heads} heads do not scale by {width:.3g} to whole heads')
        kwargs['num_heads'] = (tuple(round(h) for h in scaled) if isinstance(heads, tuple)
                               else round(scaled[0]))
    if e.overrides.get('window') is not None:
        window = e.overrides['window'] * (img // 4) // 56
        kwargs['window'] = None if window >= img // 4 else window
    return kwargs


def untestable(e):
    """Why an experiment's miniature cannot test what its row claims, or None: T4's windows must be larger
    than Eq. 6's 3x3 neighbourhood, or Eq. 6 covers the window it is compared in (at 64 px, the 7² window is
    2x2)."""
    window = mini_kwargs(e).get('window')
    if e.table == 'T4' and window is not None and window <= 3:
        return f"its {window}x{window} window is not larger than Eq. 6's 3x3"
    return None


def resolve_data(args, need=True):
    """Fill --dataset (default Fashion-MNIST) and --data-path, download once if asked (not once per run), and
    stop with how to get the data when it is missing, before any run starts (need=False: rebuilding from
    records)."""
    args.dataset = args.dataset or 'fashion_mnist'
    if args.data_path is None and args.dataset != 'synthetic':
        args.data_path = FASHION_MNIST_DEB if args.dataset in ('fashion_mnist', 'fashion_recall') and \
            os.path.isdir(FASHION_MNIST_DEB) else 'data'
    if not need:
        args.data_path = args.data_path and os.path.abspath(args.data_path)
        return
    source = 'fashion_mnist' if args.dataset == 'fashion_recall' else args.dataset  # the mosaics' items
    if source in data.SMALL_DATASETS:
        if args.download:  # torchvision fetches every split's files at once
            data.SMALL_DATASETS[source](args.data_path, download=True)
        data.read_small(source, args.data_path, train=False)  # missing: says how to get them
    elif args.dataset == 'imagefolder':
        for split in ('train', 'val'):
            if not os.path.isdir(os.path.join(args.data_path, split)):
                train.fail(f'--data-path {args.data_path} has no {split}/ folder (an ImageFolder root: '
                           'train/ and val/)')
    if args.data_path:
        args.data_path = os.path.abspath(args.data_path)


def resolve_budget(args):
    """--device (cpu; cuda only where there is a GPU), and --epochs, --train-images from BUDGET (MOSAIC_BUDGET
    on fashion_recall) where not given."""
    args.device = getattr(args, 'device', None) or 'cpu'
    args.precision = getattr(args, 'precision', None) or PRECISION[args.device]
    if args.device == 'cuda' and not torch.cuda.is_available():
        train.fail('--device cuda: torch sees no CUDA device here; run on a machine with a GPU, or '
                   '--device cpu')
    for k, v in budgets(getattr(args, 'dataset', None))[args.device].items():
        if getattr(args, k, None) is None:
            setattr(args, k, v)


def recipe(e, args):
    """What makes a run's result, besides its model and seed: the data, the budget, the precision, the device
    and train.py's own recipe for the data (train.SMALL). Records of different recipes never share a table."""
    own = train.SYNTHETIC if args.dataset == 'synthetic' else train.SMALL
    mosaics = {k: MOSAICS[k] for k in ('task', 'val_images')} if args.dataset == 'fashion_recall' else {}
    return dict(dataset=args.dataset, **mosaics, train_images=args.train_images, img_size=MINI[family(e)][0],
                epochs=args.epochs, warmup_epochs=round(args.epochs / 12, 3),
                # cheap on a GPU: every epoch
                val_every=1 if args.device == 'cuda' else max(1, args.epochs // 4),
                precision=args.precision, device=args.device,
                train={k: v for k, v in own.items() if k not in ('epochs', 'warmup_epochs', 'img_size')})


def data_argv(args):
    """train.py's data flags: the dataset and a fixed subset of its training images, or fresh synthetic ones.
    An ImageFolder gets the small datasets' recipe (train.SMALL) in place of the released ImageNet one."""
    if args.dataset == 'synthetic':
        return ['--synthetic-train', str(args.train_images)]
    if args.dataset == 'fashion_recall':  # new training mosaics a seed, the same test ones for every run
        return ['--dataset', 'fashion_recall', '--data-path', args.data_path, '--recall-task',
                MOSAICS['task'], '--synthetic-train', str(args.train_images), '--synthetic-val',
                str(MOSAICS['val_images'])]
    small = [] if args.dataset != 'imagefolder' else ['--accum-steps', '1', '--ema-decay', '0'] + [
        x for k, v in train.SMALL.items() if k not in ('epochs', 'warmup_epochs')
        for x in (f'--{k.replace("_", "-")}', str(v))]
    return ['--dataset', args.dataset, '--data-path', args.data_path, '--train-subset',
            str(args.train_images), *small]


def make_run(name, e, seed, args):
    """One run of an experiment: `python -m paper train`'s command line (the experiment by name, else its
    model with its overrides; its miniature, the budget, the data, the precision, the seed) and what its
    record is keyed by. Validation every val_every epochs and after
    the last: the 10,000 test images, every epoch, would cost much of a short run."""
    r = recipe(e, args)
    registered = name in EXPERIMENTS  # else its overrides go on the command line
    kwargs = {**({} if registered else e.overrides), **mini_kwargs(e)}
    argv = [name if registered else e.model] + [
        '--img-size', str(r['img_size']), '--model-kwargs', *[f'{k}={v!r}' for k, v in kwargs.items()],
        '--epochs', str(r['epochs']), '--warmup-epochs', str(r['warmup_epochs']), '--val-every',
        str(r['val_every']), *data_argv(args), '--amp', r['precision'], '--seed', str(seed)]
    return LabRun(name, config_key(e), r, seed, argv)


def config_key(e):
    """Experiments that build the same model share their runs (InLine-Swin-T is T10's identity row, R-res's
    local row, R-dil's dilation 1 and S's InLine row): the variant, layout, attention options away from their
    defaults (so a new option with a default leaves the keys as they are), Swin's window and APE, the sizes,
    the count."""
    model = miniature(e)
    o = dict(model.options)
    if o['feature_map'] is None and 'L' not in model.layout:  # None is identity when no block is linear
        o['feature_map'] = 'identity'
    o = {k: v for k, v in o.items() if k not in models.ATTENTION_OPTIONS or v != models.ATTENTION_OPTIONS[k]}
    if model.family == 'swin':
        o.update(window=model.window, ape=bool(model.ape))
    count = sum(p.numel() for p in model.parameters())  # tells apart what the options do not name (mlp_ratio)
    return json.dumps([e.model, model.layout, sorted(o.items()),
                       sorted((k, v) for k, v in mini_kwargs(e).items() if k != 'window'), count],
                       default=str)


def miniature(e):
    """An experiment's miniature on the meta device: its architecture and parameter shapes, no memory."""
    with torch.device('meta'):
        return models.create_model(e.model, img_size=MINI[family(e)][0], num_classes=10,
                                   **{**e.overrides, **mini_kwargs(e)})


def parameters(e):
    return sum(p.numel() for p in miniature(e).parameters())


def plan_runs(chosen, every, seeds, args):
    """The runs `chosen` needs, in the order to train them: the first FIRST_SEEDS seeds of every
    configuration, then the further seeds, the configurations two by two in the chosen order and the two seed
    by seed (the chosen order puts a comparison's sides together: a batch stopped early leaves whole
    comparisons), and each chosen name's runs in seed order. A configuration is trained under the first of all
    experiments (`every`) that builds it, whatever subset is chosen, so --quick, --only, locality and the full
    run share their runs; it gets the most seeds any chosen row asks of it. seeds(name) -> how many."""
    keys = {name: config_key(e) for name, e in every.items()}
    first, wanted = {}, {}
    for name in every:
        first.setdefault(keys[name], name)
    for name in chosen:
        if not untestable(every[name]):
            wanted[first[keys[name]]] = max(wanted.get(first[keys[name]], 0), seeds(name))
    planned = {base: [make_run(base, every[base], s, args) for s in range(n)] for base, n in wanted.items()}
    order = {base: i for i, base in enumerate(planned)}
    runs = sorted((r for rs in planned.values() for r in rs),
                  key=lambda r: (r.seed >= FIRST_SEEDS, order[r.name] // 2, r.seed, order[r.name]))
    return runs, {name: planned.get(first[keys[name]], []) for name in chosen}


def estimate(runs, every, records):
    """(minutes, how they were estimated) for the runs without a record: the mean CPU time (on CUDA, wall
    time) of the records of the same family and recipe, else, on CPU, RUN_CPU_MIN (MOSAIC_RUN_CPU_MIN on the
    mosaics) scaled by images x epochs; on CUDA without a record of the recipe, None: this project has
    measured no GPU run."""
    total, guessed = 0.0, False
    for run in runs:
        if run.key() not in records:
            f, cuda = family(every[run.name]), run.recipe['device'] == 'cuda'
            seen = [r['wall_min' if cuda else 'cpu_min'] for r in records.values()
                    if r['recipe'] == run.recipe
                    and r['name'] in every and family(every[r['name']]) == f and r['cpu_min'] > 0]
            if not seen and cuda:
                return None, 'no GPU record of this recipe yet'
            guessed |= not seen
            mosaics = run.recipe['dataset'] == 'fashion_recall'
            budget = budgets(run.recipe['dataset'])['cpu']
            scale = run.recipe['epochs'] * run.recipe['train_images'] / (budget['epochs']
                                                                         * budget['train_images'])
            total += statistics.mean(seen) if seen else (MOSAIC_RUN_CPU_MIN if mosaics
                                                         else RUN_CPU_MIN[f]) * scale
    return total, 'RUN_CPU_MIN' if guessed else 'the records of this recipe'


# ---------------------------------------------------------------------------------------------------


def seeds_option(values, default):
    """--seeds N [TABLE=N ...] -> {table: seeds}: N for every table not named, or SEEDS without N."""
    table = dict(default) if not any('=' not in v for v in values or []) else {}
    for v in values or []:
        key, _, count = v.rpartition('=')
        if not count.isdigit() or int(count) < 1 or key and key not in default:
            train.fail(f'--seeds takes N or TABLE=N (e.g. 3 T3=8; tables {", ".join(default)}), not {v!r}')
        if key:
            table[key] = int(count)
        else:
            table = {t: int(count) for t in default} | {k: n for k, n in table.items() if k in default}
    return table


def choose(args, every):
    """The experiments a command asks for: --quick, --claims (the claim rows: CLAIM_ROWS, or MOSAIC_ROWS on
    fashion_recall, where every row is one), --only NAMES, else all, each with the φ = 0 floor of every family
    it touches (the gate of its verdicts; on the mosaics the guess stands in for a recipe without floor runs,
    so the floor comes only with the rows that name it); and seeds(name): the claim rows CLAIM_SEEDS unless
    --seeds names their table."""
    rows = MOSAIC_ROWS if args.dataset == 'fashion_recall' else CLAIM_ROWS
    if args.quick:
        chosen = QUICK
    elif args.claims:
        chosen = rows
    elif args.only:
        unknown = sorted(set(args.only) - set(every))
        if unknown:
            train.fail(f'unknown experiments {unknown}; choose from {", ".join(every)}')
        chosen = args.only
    else:
        chosen = every
    # the gate: each family's floor; on the mosaics the guess bounds the floor (table_rows), so a recipe
    # needs no floor runs of its own there
    chosen = tuple(dict.fromkeys([*chosen, *(f'floor_{family(every[n])}' for n in chosen
                                             if f'floor_{family(every[n])}' in every
                                             and args.dataset != 'fashion_recall')]))
    per_table = seeds_option(args.seeds, {t: QUICK_SEEDS for t in SEEDS} if args.quick else SEEDS)
    named = {v.rpartition('=')[0] or '*' for v in args.seeds or []}
    claims = () if args.quick else rows

    def seeds(name):
        table = every[name].table
        return per_table[table] if name not in claims or table in named or '*' in named else \
            max(per_table[table], CLAIM_SEEDS)
    return {n: every[n] for n in chosen}, seeds


def rerun_seeds(cap=None):
    """seeds(name) of the 16-epoch rerun: MOSAIC_RERUN's, at most `cap` (--seeds N: the pilot's 1)."""
    return lambda name: min(MOSAIC_RERUN['seeds'][name], cap or math.inf)


def cmd_ablations(args):
    cap = None
    if args.rerun:
        if args.dataset != 'fashion_recall' or args.only or args.claims or args.quick:
            train.fail('--rerun trains MOSAIC_RERUN on its own: with --dataset fashion_recall and none of '
                       '--only, --claims, --quick')
        if args.seeds and (len(args.seeds) > 1 or not args.seeds[0].isdigit() or int(args.seeds[0]) < 1):
            train.fail(f'--rerun takes --seeds N, at most N seeds a row (1: the pilot), not {args.seeds}')
        cap, args.seeds = args.seeds and int(args.seeds[0]), None
        args.epochs, args.precision, args.only = MOSAIC_RERUN['epochs'], MOSAIC_RERUN['precision'], list(
            MOSAIC_RERUN['seeds'])
    resolve_budget(args)
    resolve_data(args, need=not args.no_train)
    every = experiments(args.dataset)
    chosen, seeds = choose(args, every)
    seeds = rerun_seeds(cap) if args.rerun else seeds
    runs, planned = plan_runs(chosen, every, seeds, args)
    records = read_records(args.results)
    minutes, source = estimate(runs, every, records)
    todo = [r for r in runs if r.key() not in records]
    passes = sum(r.recipe['epochs'] * r.recipe['train_images'] for r in todo)
    print(f'{len(chosen)} experiments, {len({tuple(r.key() for r in rs) for rs in planned.values() if rs})} '
          f'distinct configurations, {len(runs)} runs of {args.epochs} epochs x {args.train_images} images '
          f'of {args.dataset} on {args.device} ({args.precision}), {args.jobs} at a time; estimate '
          f'for the {len(todo)} runs without a record ({passes / 1e6:.1f}M training image passes): ' +
          (f'unknown ({source})' if minutes is None else
           f'{minutes:.0f} {"GPU" if args.device == "cuda" else "CPU"}-minutes by {source}, about '
           f'{minutes / args.jobs // 60:.0f} h {minutes / args.jobs % 60:.0f} min {args.jobs} at a time' +
           (f' on {args.jobs} cores of their own' if args.device == 'cpu' else '')))
    train_runs(runs, args, desc='ablation runs')
    records = read_records(args.results)  # again: the records read at the start lack the runs just trained
    if args.dataset != 'fashion_recall':
        t = budget_table(args, every, records, None)
        ablations_pictures(args, *t[:4], t[6], t[4], comparisons(t[0]))
        return t[5], t[6]
    # the mosaics: both budgets' families, each in full, then side by side, the power plan and the robustness
    # read
    tables = [budget_table(argparse.Namespace(**{**vars(args), **b}), every, records, MOSAICS['guess'])
              for b in mosaic_budgets(args)]
    side_by_side(tables, [MOSAIC_BUDGET['cpu']['epochs'], MOSAIC_RERUN['epochs']])
    power_plan(tables[1], MOSAIC_RERUN, PLAN_SD)
    reads = epoch_reads(tables[1], every)
    if reads:
        robustness(*reads)
    t, rerun = tables
    ablations_pictures(args, *t[:4], t[6], t[4], comparisons(t[0]),
                       (MOSAIC_RERUN['epochs'], *rerun[:3], comparisons(rerun[0])))
    return tables[0][5], tables[0][6]


def mosaic_budgets(args):
    """The two recipes of the mosaics' families: MOSAIC_BUDGET's MOSAIC_ROWS (or what the command chose) and
    the 16-epoch rerun's rows, each with its own seeds."""
    short = dict(epochs=budgets(args.dataset)[args.device]['epochs'], precision=PRECISION[args.device],
                 rerun=False, only=None if args.rerun else args.only,
                 seeds=None if args.rerun else args.seeds)
    return [short, dict(epochs=MOSAIC_RERUN['epochs'], precision=MOSAIC_RERUN['precision'], rerun=True,
                        quick=False, claims=False, only=list(MOSAIC_RERUN['seeds']), seeds=None)]


def budget_table(args, every, records, guess):
    """Print one recipe's family from the records: its configurations, then its comparisons, both tests of
    each adjusted together by Holm. Returns (chosen, planned, records, result, points, configs, rows,
    gains)."""
    chosen, seeds = choose(args, every)
    _, planned = plan_runs(chosen, every, rerun_seeds() if args.rerun else seeds, args)
    result = {n: summarise([records[r.key()] for r in planned[n] if r.key() in records]) for n in chosen}
    # the 16-epoch batch's seeds were fixed before it (MOSAIC_RERUN); the 4-epoch records predate any plan
    batch = {n: len(planned[n]) for n in chosen} if args.rerun else None
    configs, rows, points, m = table_rows(chosen, planned, result, every, guess, batch)
    kept = {n: [records[r.key()] for r in planned[n] if r.key() in records] for n in chosen}
    for r in rows:  # confirmatory or exploratory: did its data come after the rules (paper/verdicts.py)?
        r.append(rules_label([kept[x] for x in r[1].rstrip('†').split(' − ')], r[10]))
    family_name = f'{args.dataset}, {args.epochs} epochs x {args.train_images:,} images'
    bed = (f'task {MOSAICS["task"]}, heads {", ".join(map(str, MOSAICS["heads"]))} (D 8 in every stage), the '
           f'same {MOSAICS["val_images"]:,} test mosaics for every run' if guess is not None
           else 'validation on its test set')
    print(f'\nAblations on the miniatures ({family_name.replace(" images", " training images")}, {bed}, '
          f'{args.precision} on {args.device}): one row per distinct configuration (names joined by = build '
          'one model), final-epoch top-1 (%), mean ± sd over (n) seeds, beside the paper\'s ImageNet-1K '
          'top-1; over the φ = 0 floor: its mean minus the mean of its family\'s attention-free miniature '
          f'(the gate: under it when less than {FLOOR_MARGIN:g}); last quarter: the top-1 gained over the '
          'last quarter of the epochs (the cosine schedule, whose rate ends near 0, pulls it toward 0: small '
          'is not a plateau); a diverged run is left out and named. * our construction (no released code).\n')
    print_table(['configuration', 'tables', 'params', 'top-1 here ± sd (seeds)', 'paper (ImageNet)',
                 'over the φ = 0 floor', 'last quarter'], configs)
    gaps = [c[5] for c in configs if c[5] and c[1] != 'floor']
    if gaps and all('(under)' in g for g in gaps):
        print(f'\nNo configuration with attention clears its φ = 0 floor by {FLOOR_MARGIN:g} points: on this '
              'test bed the task does not need attention, and every comparison is untestable.')
    print(f'\nThe family "{family_name}" (RESULTS.md, "Verdicts"): {m} comparisons, {2 * m} tests. Row '
          'minus reference, Welch over all the seeds of each (unpaired), the 95% interval over seeds and the '
          'test set\'s images (over seeds only where a record predates per-image results); r: the '
          'correlation of the two rows\' top-1 over the seed numbers they share. Ordering test: Δ = 0 for a '
          f'paper ordering, "beyond ±{MARGIN:g}" for a paper tie (≤ {PAPER_TIE}); TOST: within ±{MARGIN:g}; '
          f'each p beside its Holm adjustment over all {2 * m} tests (a comparison not yet run, or still '
          'running, enters with p = 1). Verdict from the adjusted p\'s at 5%: reproduced, contradicted (a claim '
          f'the paper makes, on the other side), {EQUIVALENT}, not resolved, untestable (a side under the '
          f'gate: its φ = 0 floor + {FLOOR_MARGIN:g}, or the guess where the recipe has no floor runs), not '
          'yet run (under two seeds a side), running (a side under the seeds its batch plans: the difference '
          'is progress, no verdict is read); "contradicted: the opposite sign, within ±0.5" where the '
          'paper\'s gap is under the margin and the interval reaches inside it. Power: '
          f'TOST\'s at Δ = 0 / the ordering test\'s at |Δ| = {MARGIN:g}, at this difference\'s standard '
          'error and degrees of freedom (the test set\'s term included), at '
          f'Holm\'s strictest step (5% / {2 * max(m, 1)}). Rules: {CONFIRMATORY}, the commit that wrote the '
          f'rules before its data; {EXPLORATORY}, its data came first. † a claim row.\n')
    print_table(['tables', 'row − reference', 'paper (ImageNet)', 'difference here [95% CI]', 'interval over',
                 'seeds', 'r', 'ordering p / Holm', 'TOST p / Holm', 'power', 'verdict', 'rules'], rows)
    gains = {n: result[n].gain for n in chosen}
    return chosen, planned, records, result, points, configs, rows, gains


def epoch_reads(table, every):
    """(the 16-epoch family's rows, {read: the same comparisons' rows at that read}, {name: records}): its
    robustness read (paper/verdicts.py), each read through table_rows as the family itself; None where a run
    has no evaluation at the epoch it reads (a shorter recipe)."""
    chosen, planned, records, *_, rows, _ = table
    kept = {n: [records[r.key()] for r in planned[n] if r.key() in records] for n in chosen}
    if not readable(kept):
        return None
    batch = {n: len(planned[n]) for n in chosen}
    return rows, {read: table_rows(chosen, planned, {n: read_summary(kept[n], read) for n in chosen}, every,
                                   MOSAICS['guess'], batch)[1] for read in READS}, kept


def table_rows(chosen, planned, result, every, guess=None, batch=None):
    """The two tables: one row per distinct configuration (config_rows) and one per distinct comparison
    (comparison_rows), with each comparison's chart entry (label, mean, half-width, the paper's difference)
    and the size of the family. The gate: a configuration clears when its mean is FLOOR_MARGIN over the
    mean of its family's floor (the same recipe); a comparison with a side that does not, or no floor run, is
    untestable, whatever its p. batch: {name: seeds its batch plans}, where the family has such a plan."""
    mean = {n: statistics.mean(result[n].top1.values()) if result[n].top1 else None for n in chosen}
    # each configuration's floor: its family's mean; on the mosaics, the guess where the recipe has no floor
    # runs (the floor's ceiling, so clearing it clears any floor)
    floor = {n: mean.get(f'floor_{family(e)}') for n, e in chosen.items()}
    floor = {n: guess if m is None else m for n, m in floor.items()} if guess is not None else floor
    above = {n: None if mean[n] is None or floor[n] is None else mean[n] - floor[n] for n in chosen}
    cleared = {n: above[n] is not None and above[n] >= FLOOR_MARGIN for n in chosen}
    configs = config_rows(chosen, planned, result, every, above, cleared, guess)
    rows, points, m = comparison_rows(chosen, result, every, above, cleared, batch)
    return configs, rows, points, m


def config_rows(chosen, planned, result, every, above, cleared, guess):
    """One row per distinct configuration (names joined by = build one model): its tables, parameters, top-1
    over seeds, the paper's top-1, how far over its family's φ = 0 floor (above), its last-quarter gain."""
    distinct = {}
    for name, e in chosen.items():
        distinct.setdefault(tuple(r.key() for r in planned[name]) or name, []).append(name)
    configs = []
    for names in distinct.values():
        r, e, n = result[names[0]], every[names[0]], names[0]
        why, accs = untestable(e), list(r.top1.values())
        ours = ('—' if not accs else f'{accs[0]:.1f} (1)' if len(accs) == 1 else
                f'{statistics.mean(accs):.1f} ± {statistics.stdev(accs):.1f} ({len(accs)})')
        ours += f', seed {", ".join(map(str, r.diverged))} diverged' if r.diverged else ''
        configs.append([' = '.join(n + (' *' if every[n].ours else '') for n in names),
                        ', '.join(dict.fromkeys(every[n].table for n in names)),
                        f'{parameters(e) / 1e6:.2f}M', f'not trained: {why}' if why else ours,
                        ' / '.join(dict.fromkeys(every[n].reported or '—' for n in names)),
                        '' if above[n] is None else f'{above[n]:+.1f}'
                        + ('' if cleared[n] or e.table == 'floor' else ' (under)'),
                        '' if r.gain is None else f'{r.gain:+.1f}'])
    if guess is not None:
        configs.insert(0, ['guess: 1 of the 3 candidate cells, the most a network without position in a '
                           'stage can score (the floor\'s ceiling)', '', '', f'{guess:.1f}', '—', '', ''])
    return configs


def comparison_rows(chosen, result, every, above, cleared, batch=None):
    """One row per distinct comparison, row minus reference, Welch over all seeds of each: its difference and
    interval, seeds, seed correlation, both tests' p's beside their Holm adjustment over the family (every
    comparison with a paper number not under the gate, both tests; p = 1 where not yet run or still running),
    the power at Holm's strictest step, the verdict; with each row's chart entry (or None) and the family's
    size. Where a batch fixed its seeds beforehand (batch: {name: seeds}), a side with fewer records is still
    running: its difference and interval are progress, no verdict is read (a look the plan does not have)."""
    rows, family_ps = [], []
    for tables, name, ref in comparisons(chosen):
        a, b = result[name], result[ref]
        paper_text, paper_diff = paper_claim(name, ref, every)
        label = f'{name} − {ref}' + ('†' if name in CLAIM_ROWS and ref in CLAIM_ROWS else '')
        row = [', '.join(tables), label, paper_text] + [''] * 8
        rows.append((row, None))
        if untestable(every[name]) or untestable(every[ref]):
            row[10] = 'untestable'
            continue
        row[5] = f'{len(a.top1)} / {len(b.top1)}' + ''.join(
            f'; seed {", ".join(map(str, s.diverged))} of {n} diverged' for s, n in ((a, name), (b, ref))
            if s.diverged)
        if min(len(a.top1), len(b.top1)) < 2:  # not yet run: in the family at p = 1
            single = [s.top1 for s in (a, b)]
            if all(single):
                row[3] = f'{statistics.mean(single[0].values()) - statistics.mean(single[1].values()):+.1f}'
            row[10] = 'not yet run' if paper_diff is not None else '—'
            if paper_diff is not None:
                family_ps.append((len(rows) - 1, 1.0, 1.0, 0.0, math.inf, 0))
            continue
        mean, se, df = compare(a, b)
        half = half_width(se, df)
        row[3] = f'{mean:+.1f} [{mean - half:+.1f}, {mean + half:+.1f}]'
        row[4] = 'seeds only' if scores(list(a.correct.values())) is None or scores(
            list(b.correct.values())) is None else 'seeds and test images'
        r = seed_correlation(a, b)
        row[6] = '' if math.isnan(r) else f'{r:+.2f}'
        rows[-1] = (row, (short_name(name), mean, half, paper_diff if paper_diff is not None and
                          math.isfinite(paper_diff) else None))
        gate = None if cleared[name] and cleared[ref] else 'untestable (no floor run)' if None in (
            above[name], above[ref]) else 'untestable (under the floor)'
        if paper_diff is None or gate:
            row[10] = '—' if paper_diff is None else gate
            continue
        running = batch and any(len(s.top1) + len(s.diverged) < batch[n] for s, n in ((a, name), (b, ref)))
        if running:  # progress, not yet a result: in the family at p = 1, not drawn
            rows[-1], row[10] = (row, None), f'running ({batch[name]} / {batch[ref]} seeds planned)'
        family_ps.append((len(rows) - 1, *((1.0, 1.0) if running else tests(mean, se, df, paper_diff)), mean,
                          se, df))
    m = len(family_ps)
    adjusted = holm([p for _, p_order, p_tost, *_ in family_ps for p in (p_order, p_tost)])
    for k, (i, p_order, p_tost, mean, se, df) in enumerate(family_ps):
        row, q_order, q_tost = rows[i][0], adjusted[2 * k], adjusted[2 * k + 1]
        row[7], row[8] = (f'{p:.3f} / {q:.3f}' for p, q in ((p_order, q_order), (p_tost, q_tost)))
        if row[10] == 'not yet run' or row[10].startswith('running'):
            continue
        _, paper_diff = paper_claim(*row[1].rstrip('†').split(' − '), every)
        row[10] = verdict(paper_diff, mean, q_order, q_tost, half_width(se, df))
        row[9] = '{:.2f} / {:.2f}'.format(*power(se, df, ALPHA / (2 * m)))
    return [r for r, _ in rows], [p for _, p in rows], m

"""The lab: the paper's figures and tables, rerun small on one machine, with pictures.

InLine attention: Han et al., "Bridging the Divide: Reconsidering Softmax and Linear Attention", NeurIPS 2024,
arXiv 2412.06590. One subcommand per figure or group of tables of the paper (README, "The evidence
in brief"). Each prints a table (markdown, for the README), draws a PNG (OUT/<subcommand>.png, or
--png PATH) and keeps what it has finished under OUT (default runs/paper/), so a rerun resumes where
the last one stopped. From the repository root:

    python -m paper models                 # every released variant: params and GMACs beside the authors'
    python -m paper experiments            # every experiment of the paper by name, with the paper's top-1
    python -m paper train NAME [train.py flags]  # one experiment (or released model), train.py's loop
    python -m paper injectivity            # F1: the weights of q, 2q, 3q, 4q under softmax, linear, InLine
    python -m paper locality               # F4: per layer, the weight on the 3x3, own and class tokens
    python -m paper maps                   # F3: attention maps of a few query tokens, laid over an image
    python -m paper speed [--quick]        # F5b, F5c: images/s against window and resolution
    python -m paper speed --model-step     # a whole InLine-Swin-T training step: reference vs fast core
    python -m paper speed --dense          # backbones at detection sizes: forward time and peak memory
    python -m paper speed --whole [--compile]  # whole models against softmax; where a forward's time goes
    python -m paper speed --level          # InLine-DeiT-T against DeiT-T at 1 and 2 threads, fp32 and bf16
    python -m paper ablations --claims     # the claim rows at 5 seeds and their floor: the first batch
    python -m paper ablations [--quick]    # T3, T4, T10, R-res, R-dil, R-nonneg, T1, S: trained small
    python -m paper ablations --no-train   # every table and picture from results/runs.jsonl alone, in seconds
    python -m paper ablations --device cuda  # the same set where the miniatures converge (all 60,000 images)
    python -m paper ablations --dataset fashion_recall  # the test bed where attention must select
    python -m paper ablations --dataset fashion_recall --rerun [--seeds 1]  # every comparison at 16 epochs
    python -m paper recall [--no-train]    # InLine on sequences: associative recall (MQAR)
    python -m paper mosaics --png figures/fashion_recall.png  # the fashion_recall mosaics, with their labels

The trained ones (locality, maps, ablations) train on Fashion-MNIST unless told (--dataset, --data-path: any
ImageFolder too): locality and maps their four small DeiTs, ablations every experiment of
paper/experiments.py, each on first use, a model that several need trained once. Every image run is a `python
-m paper train ...` subprocess, through train.py's loop, the project's one, and each finished run appends its
record to results/runs.jsonl, from which the tables are rebuilt; recall's small sequence models train in this
process (paper/recall.py says why) and keep theirs in results/recall.jsonl. The verdicts' rules are fixed in
paper/stats.py and in the tests. Files, one job each: charts (pictures), stats, runs (the scheduler, the
records, the train command), experiments, ablations, verdicts (labels, robustness, power plan), figures (F1,
F4, F3), speed, recall, mosaics.
"""
import argparse
import os
import sys

import data
from paper import mosaics
from paper.ablations import BUDGET, CLAIM_SEEDS, FASHION_MNIST_DEB, QUICK, QUICK_SEEDS, SEEDS, cmd_ablations
from paper.experiments import cmd_experiments, cmd_models
from paper.figures import cmd_injectivity, cmd_locality, cmd_maps
from paper.recall import add_recall_parser, cmd_recall
from paper.runs import RECORDS, cmd_train
from paper.speed import cmd_speed


def lab(argv=None):
    """The command line; `train` hands the rest of it to train.py's parser (paper/runs.py, train_args)."""
    argv = sys.argv[1:] if argv is None else list(argv)
    if argv[:1] == ['train']:
        return cmd_train(argv[1:])
    common = argparse.ArgumentParser(add_help=False)
    common.add_argument('--out', default=os.path.join('runs', 'paper'),
                        help='results, cached runs and pictures (default runs/paper)')
    common.add_argument('--png', help='write the picture here instead of OUT/<subcommand>.png')
    parser = argparse.ArgumentParser(description=__doc__.split('\n')[0])
    sub = parser.add_subparsers(dest='command', required=True)
    sub.add_parser('train',
                   help='train one experiment or released model: python -m paper train NAME [train.py flags]',
                   add_help=False)
    sub.add_parser('models',
                   help="every released variant's params and GMACs beside the authors' and the paper's")
    sub.add_parser('experiments',
                   help='every experiment of the paper by name, with its params and the paper\'s top-1')
    budget = add_budget(common)
    add_figures(sub, common, budget)
    add_speed(sub, common)
    add_ablations(sub, budget)
    add_recall_parser(sub, common)
    p = sub.add_parser('mosaics', parents=[common],
                       help="the fashion_recall mosaics (paper/mosaics.py), with their labels")
    p.add_argument('--data-path', default=FASHION_MNIST_DEB, help='Fashion-MNIST\'s IDX files')
    args = parser.parse_args(argv)
    if args.command in ('locality', 'maps') and args.dataset == 'fashion_recall':
        parser.error(f'{args.command} measures DeiT checkpoints of the small datasets; fashion_recall is the '
                     'ablations\' test bed (python -m paper ablations --dataset fashion_recall)')
    return {'models': cmd_models, 'experiments': cmd_experiments, 'injectivity': cmd_injectivity,
            'locality': cmd_locality, 'maps': cmd_maps, 'speed': cmd_speed, 'ablations': cmd_ablations,
            'recall': cmd_recall, 'mosaics': mosaics.cmd_mosaics}[args.command](args)


def add_budget(common):
    """The flags of every command that trains through train.py: the budget, the data, the records."""
    budget = argparse.ArgumentParser(add_help=False, parents=[common])  # what each train.py run gets
    budget.add_argument('--epochs', type=int,
                        help=f'epochs of every training run (CPU {BUDGET["cpu"]["epochs"]}, '
                                                   f'CUDA {BUDGET["cuda"]["epochs"]})')
    budget.add_argument('--train-images', type=int,
                        help='training images: a fixed subset of the dataset, or synthetic ones per epoch '
                             f'(CPU {BUDGET["cpu"]["train_images"]:,}, CUDA '
                             f'{BUDGET["cuda"]["train_images"]:,})')
    budget.add_argument('--device', choices=['cpu', 'cuda'], default='cpu',
                        help='where train.py runs: cpu, or cuda at the scale where the miniatures '
                        'converge (BUDGET)')
    budget.add_argument('--precision', choices=['bf16', 'fp32'],
                        help='autocast of every run (default bf16, the recorded recipes; fp32 on a CPU that '
                             'emulates bf16, AVX2 alone: a recipe of its own)')
    budget.add_argument('--results', default=RECORDS, help='the run records, one JSON line per finished run '
                                                          '(default results/runs.jsonl)')
    budget.add_argument('--no-train', action='store_true',
                        help='train nothing: rebuild from the records, leaving out the runs without one')
    budget.add_argument('--dataset',
                        choices=['synthetic', 'imagefolder', *data.SMALL_DATASETS, 'fashion_recall'],
                        help='the data every run trains on (default fashion_mnist; ablations on '
                             'fashion_recall: the test bed where attention must select, MOSAIC_ROWS at '
                             'MOSAIC_BUDGET); with --checkpoints, the images to measure on (default: each '
                             'checkpoint\'s own)')
    budget.add_argument('--data-path', help=f'its root (default {FASHION_MNIST_DEB} for fashion_mnist where '
                                            'Debian\'s dataset-fashion-mnist package put it, else data/)')
    budget.add_argument('--download', action='store_true',
                        help='download a small dataset first (torchvision)')
    budget.add_argument('--jobs', type=int, default=2, help='train.py processes at a time, sharing the cores')
    return budget


def add_figures(sub, common, budget):
    """F1 (no training), then F4 and F3, which measure trained DeiT checkpoints (or train the four small
    ones)."""
    sub.add_parser('injectivity', parents=[common],
                   help='F1: identical weight rows under softmax, linear and InLine')
    trained = argparse.ArgumentParser(add_help=False, parents=[budget])
    trained.add_argument('--checkpoints', nargs='+', metavar='[NAME=]PATH',
                         help='train.py checkpoints of DeiT models, a NAME again for another seed (default: '
                              'train the four small ones)')
    p = sub.add_parser('locality', parents=[trained],
                       help='F4: attention mass on the 3x3 neighbourhood per layer')
    p.add_argument('--images', type=int, default=512, help='validation images to average over')
    p.add_argument('--seeds', type=int, default=3, help='seeds of each of the four models (0, 1, ...)')
    p = sub.add_parser('maps', parents=[trained], help='F3: attention maps of query tokens over an image')
    p.add_argument('--image', help='an image file (default: a validation image of the checkpoint\'s data)')
    p.add_argument('--index', type=int, default=0, help='which validation image')
    p.add_argument('--queries', nargs='+', default=['1,1', '3,4', '6,5'], metavar='ROW,COL',
                   help='query tokens on the token grid, from 0')
    p.add_argument('--layers', nargs='+', default=[], metavar='L',
                   help='layers to show, from 1 (default first, last)')


def add_speed(sub, common):
    """F5b, F5c and the speed tables: every timing command, none of which trains."""
    p = sub.add_parser('speed', parents=[common], help='F5b, F5c: images/s against window and image size')
    p.add_argument('--quick', action='store_true', help='two points per figure, 3 rounds on CPU')
    p.add_argument('--batch', type=int, help='images per forward (default: CPU 1, CUDA 32)')
    p.add_argument('--rounds', type=int,
                   help='interleaved rounds per point (default: CPU 5, quick 3; CUDA 20)')
    p.add_argument('--model-step', action='store_true',
                   help='also time a whole InLine-Swin-T training step: reference vs fast core')
    p.add_argument('--whole', nargs='?', const='all', choices=['all', 'swin', 'deit'],
                   help='whole models against their softmax originals: InLine-Swin-T inference and training '
                        'step, InLine-DeiT-T inference at 224, 512, 1024 px (swin, deit: those rows only), '
                        'and a profile of an InLine-DeiT-T forward (instead of F5b, F5c)')
    p.add_argument('--compile', action='store_true',
                   help='--whole: also time InLine under whole-model torch.compile '
                   '(compiling takes minutes)')
    p.add_argument('--device', help='--whole: cpu (default) or cuda')
    p.add_argument('--level', action='store_true',
                   help='InLine-DeiT-T against DeiT-T where the tokens are few (224 px, and 512 px), at 1 and 2 '
                   'threads, fp32 and bf16, each beside the speed-up it should reach (instead of F5b, F5c)')
    p.add_argument('--dense', action='store_true',
                   help='backbone forward time and peak memory at detection sizes, '
                   '512x512 to 800x1344: Swin-T, PVT-S, DeiT-T, each softmax against InLine (instead '
                   'of F5b, F5c)')


def add_ablations(sub, budget):
    """The ablation tables: which experiments, how many seeds, the mosaics' rerun."""
    p = sub.add_parser('ablations', parents=[budget],
                       help='T3, T4, T10, R-res, R-dil, R-nonneg, T1, S: trained small')
    p.add_argument('--quick', action='store_true',
                   help=f'{QUICK_SEEDS} seeds of {len(QUICK)} experiments: {", ".join(QUICK)}')
    p.add_argument('--only', nargs='+', metavar='NAME', help='these experiments only')
    p.add_argument('--claims', action='store_true',
                   help=f'the claim rows ({CLAIM_SEEDS} seeds) and their floors')
    p.add_argument('--rerun', action='store_true',
                   help='fashion_recall: every comparison again at 16 epochs (MOSAIC_RERUN: its epochs, '
                   'precision and seeds a row; --seeds N: at most N a row, 1 for the pilot)')
    p.add_argument('--seeds', nargs='+', metavar='[TABLE=]N',
                   help=f'seeds (0, 1, ...): N for every table, TABLE=N '
                   f'for one (default {" ".join(f"{t}={n}" for t, n in SEEDS.items())})')


if __name__ == '__main__':
    lab()

"""Train and evaluate the InLine backbones: plain DDP, the authors' recipe to the letter, resumable.

InLine attention: Han et al., "Bridging the Divide: Reconsidering Softmax and Linear Attention",
NeurIPS 2024, arXiv 2412.06590. With --data-path, the released ImageNet-1K recipe (VARIANTS below;
README, "Training"); without it, a small recipe for a built-in synthetic task.

The main job: no dataset, no download; >= 90% validation accuracy in minutes on a 2-core CPU
(README, "Quick start"):
    torchrun --standalone --nproc_per_node=2 train.py --model inline_swin_t
Fashion-MNIST from its four IDX .gz files as distributed (Debian's dataset-fashion-mnist; or
--download), CIFAR too:
    python train.py --model inline_deit_t --dataset fashion_mnist --data-path DIR --img-size 64 \
        --train-subset 5000

ImageNet-1K (DIR/train/<class>/<image>, DIR/val/<class>/<image>), as the authors ran it on 8 GPUs
(total batch = the variant's per-process batch x 8; fewer processes reach it by gradient
accumulation, printed at start):
    torchrun --standalone --nproc_per_node=8 train.py --model inline_swin_t --data-path DIR
    # the 384 px variants fine-tune from the 224 px weights (from their EMA where the file has one:
    # CSwin)
    torchrun --standalone --nproc_per_node=8 train.py --model inline_cswin_b_384 --data-path DIR \
        --finetune FILE
Evaluate a checkpoint, ours or the authors' released file (and its EMA weights where it has them):
    torchrun --standalone --nproc_per_node=8 train.py --model inline_swin_t --data-path DIR \
        --eval --checkpoint FILE
Inference throughput (images/s of one process, at the model's released image size):
    python train.py --model inline_swin_t --throughput --batch-size 64

Nothing is lost: rerunning the same command resumes from OUTPUT_DIR/checkpoint.pt, written
atomically every epoch; SIGTERM or Ctrl-C (SIGINT) saves at the step and exits with 143 or 130
(128 + the signal's number, as a shell reports it); on CPU, a run killed with -9 and rerun ends with
an uninterrupted run's weights. An image that cannot be read stops the run at a saved step, naming
it; --skip-bad-images leaves such files out, listed every epoch. predict.py classifies images with
a checkpoint.
"""
import argparse
import ast
import contextlib
import functools
import hashlib
import json
import math
import os
import re
import shlex
import signal
import sys
import threading
import time
from dataclasses import dataclass, field

import torch
import torch.distributed as dist
import torch.nn as nn
from torch.nn.parallel import DistributedDataParallel as DDP
from torch.optim.swa_utils import AveragedModel, get_ema_multi_avg_fn
from torchvision.transforms import v2 as T
from tqdm import tqdm

import inline
import models
from checkpoints import (CHECKPOINT, EMA_KEYS, check_architecture, check_output_dir, load_initial,
                         load_weights, pair, read_checkpoint, resume, save_checkpoint, save_correct,
                         saved_record)
from data import (DATASETS, GO_ON, SyntheticShapes, count_images, dataset, leave_out_unreadable,
                  load_data, pixels, train_loader, unreadable, val_loader)
from ranks import fail, print0

# ------------------------------------------------------------------------------------------- recipe
# The released recipe, one row per variant (the authors' cfgs/inline_<variant>.yaml; PVT-L's is
# inline_pvt_b.yaml).
# Learning rates are per 512 images of total batch and scale linearly with it (build_optimizer).
# clip 0: none.
COLUMNS = ('batch_size', 'lr', 'epochs', 'warmup_epochs', 'warmup_lr', 'min_lr', 'cooldown_epochs',
           'weight_decay', 'clip_grad', 'drop_path')
# batch  peak lr  epochs  warm-up: epochs, lr  min lr  cool-down  wd  clip  drop path
VARIANTS = {
    'inline_deit_t':      (512, 5e-4, 300, 20, 5e-7, 5e-6, 0, 0.05, 5.0, 0.1),
    'inline_deit_s':      (128, 5e-4, 300, 20, 5e-7, 5e-6, 0, 0.05, 5.0, 0.1),
    'inline_deit_b':      (64, 5e-4, 300, 20, 5e-7, 5e-6, 0, 0.05, 5.0, 0.1),
    'inline_pvt_t':       (128, 5e-4, 300, 5, 1e-6, 1e-5, 10, 0.05, 0.0, 0.1),
    'inline_pvt_s':       (128, 5e-4, 300, 5, 1e-6, 1e-5, 10, 0.05, 0.0, 0.1),
    'inline_pvt_m':       (128, 5e-4, 300, 5, 1e-6, 1e-5, 10, 0.05, 1.0, 0.3),
    'inline_pvt_l':       (64, 5e-4, 300, 5, 1e-6, 1e-5, 10, 0.05, 1.0, 0.3),
    'inline_swin_t':      (128, 5e-4, 300, 20, 5e-7, 5e-6, 0, 0.05, 5.0, 0.2),
    'inline_swin_s':      (128, 5e-4, 300, 20, 5e-7, 5e-6, 0, 0.05, 5.0, 0.3),
    'inline_swin_b':      (64, 5e-4, 300, 20, 5e-7, 5e-6, 0, 0.05, 5.0, 0.5),
    'inline_swin_b_384':  (32, 2e-5, 30, 5, 2e-8, 2e-7, 0, 1e-8, 5.0, 0.5),
    'inline_cswin_t':     (128, 5e-4, 300, 20, 1e-6, 1e-5, 10, 0.05, 0.0, 0.2),
    'inline_cswin_s':     (128, 5e-4, 300, 20, 1e-6, 1e-5, 10, 0.05, 0.0, 0.4),
    'inline_cswin_b':     (64, 5e-4, 300, 20, 1e-6, 1e-5, 10, 0.1, 0.0, 0.5),
    'inline_cswin_b_384': (32, 5e-6, 20, 0, 5e-6, 5e-7, 10, 1e-8, 0.0, 0.7),
    # the peers: FLatten's `cfgs/flatten_*.yaml` over their config.py's defaults; ours with Swin-T's
    # recipe
    'flatten_swin_t':     (128, 5e-4, 300, 20, 5e-7, 5e-6, 0, 0.05, 5.0, 0.2),
    'flatten_pvt_t':      (128, 5e-4, 300, 5, 1e-6, 1e-5, 10, 0.05, 0.0, 0.1),
    'flatten_pvt_s':      (64, 5e-4, 300, 5, 1e-6, 1e-5, 10, 0.05, 0.0, 0.1),
    'transnormer_swin_t': (128, 5e-4, 300, 20, 5e-7, 5e-6, 0, 0.05, 5.0, 0.2),
}
# the total batch is the table's per-process batch x 8 processes, as the authors' README launches
PROCESSES = 8
# shared by every variant; colour jitter acts only where RandAugment is off (as in timm), so not in
# the released runs
RELEASED_RECIPE = dict(label_smoothing=0.1, mixup=0.8, cutmix=1.0, mixup_switch_prob=0.5,
                       randaug_n=2, randaug_m=9, randaug_mstd=0.5, color_jitter=0.4,
                       random_erase=0.25)
# decay 0.9996 per step at a total batch of 4096, i.e. 0.9996^(batch / 4096)
EMA_FAMILIES = ('cswin',)
# The synthetic task: fresh procedurally generated images every epoch, so no augmentation is needed
# and none of Mixup/CutMix/RandAugment/erasing is used (they would only slow a 10-minute run down).
SYNTHETIC = dict(batch_size=128, lr=2e-3, epochs=5, warmup_epochs=0.5, warmup_lr=1e-5, min_lr=1e-5,
                 cooldown_epochs=0, weight_decay=0.05, clip_grad=5.0, drop_path=0.0,
                 label_smoothing=0.1, mixup=0.0, cutmix=0.0, mixup_switch_prob=0.5, randaug_n=0,
                 randaug_m=0, randaug_mstd=0.0, color_jitter=0.0, random_erase=0.0,
                 synthetic_train=12_800, synthetic_val=2_000)
# The synthetic task for Swin's InLine windows smaller than the stage (Table 4's 7, 14, 28): 224 px,
# the one size below 448 at which they tile every stage they are smaller than, and fewer, smaller
# steps, to end in minutes on a CPU; the rate per 512 images is raised so that 2 x 8 images a step
# see 5e-4.
SYNTHETIC_WINDOWED = dict(SYNTHETIC, img_size=224, batch_size=8, epochs=3, warmup_epochs=0.3,
                          synthetic_train=640, synthetic_val=320, lr=1.6e-2)
# Fashion-MNIST and CIFAR: the synthetic recipe, with a random crop (padded by 1/8) and a flip
# (load_data), batches of 64 at 7.5e-4 a step: a small subset gives few steps, and 128 at 5e-4 left
# a DeiT learning in its last epoch
SMALL = ({k: v for k, v in SYNTHETIC.items() if not k.startswith('synthetic')}
         | dict(batch_size=64, lr=6e-3, epochs=15, warmup_epochs=1))
# An ImageFolder gets the released recipe where an epoch gives RELEASED_MIN_STEPS optimizer steps or
# more at the authors' total batch (ImageNet-1K: 1,251 at 1,024), else SMALL with the small
# datasets' crop and flip (1,437 images get one step an epoch from the released recipe, and 20
# warm-up epochs)
RELEASED_MIN_STEPS = 100
# fewer optimizer steps an epoch than this, or a warm-up as long as the run, is said at start
FEW_STEPS = 10
# never taken from a checkpoint
INVOCATION = ('amp', 'workers', 'threads', 'finetune', 'resume', 'fast')
ARCH_FLAGS = ('layout', 'feature_map', 'eq6', 'local_size', 'dilation', 'window', 'ape', 'nonneg',
              'normalise_q')
# flags renamed so that each name means one thing: refused under the old name, naming the new
RENAMED_FLAGS = {'--kernel': '--feature-map', '--residual': '--eq6',
                 '--attention-impl': '--fast (reference: none; fast: compile; triton: triton)'}
# the create_model arguments train.py sets itself, and their flags
RUN_KEYS = {'img_size': 'img-size', 'num_classes': 'data-path', 'drop_path_rate': 'drop-path'}


class Renamed(argparse.Action):
    """A flag under its old name (RENAMED_FLAGS): refused, naming the new one."""

    def __call__(self, parser, namespace, values, option_string=None):
        parser.error(f'{option_string} is now {RENAMED_FLAGS[option_string]}')


class ImageSize(argparse.Action):
    """--img-size S, H W or HxW, in pixels: an int for a square, else (H, W)."""

    def __call__(self, parser, namespace, values, option_string=None):
        sides = [side for value in values for side in value.lower().split('x')]
        if len(sides) > 2 or not all(side.isdigit() and int(side) > 0 for side in sides):
            parser.error(f'{option_string} {" ".join(values)}: give one side (32), or the height '
                         f'and width (64 96, or 64x96), in whole pixels')
        H, W = int(sides[0]), int(sides[-1])
        setattr(namespace, self.dest, H if H == W else (H, W))


def get_args_parser():
    p = argparse.ArgumentParser(description=__doc__.split('\n')[0],
                                epilog='Flags without a default take the recipe\'s value '
                                       '(printed at start).')
    a = p.add_argument
    a('--model', choices=sorted(models.MODELS), metavar='NAME',
      help=f'variant (README, "Models"; default: the checkpoint\'s, else inline_swin_t): '
           f'{", ".join(models.MODELS)}')
    a('--layout',
      help='attention per stage: I InLine, L linear, S softmax, M<k> after the '
           'letters (e.g. IIMS2)')
    a('--feature-map', help=f'phi of the I and L blocks: {", ".join(inline.PHI)}')
    a('--eq6', help='Eq. 6\'s form: local (k x k neighbours, released), plain (r * v_i) or none')
    a('--local-size', type=int, help='side k of Eq. 6\'s k x k neighbourhood (odd; released: 3)')
    a('--dilation', type=int, help='dilation of Eq. 6\'s neighbourhood')
    a('--window', type=int,
      help='Swin: InLine window side in tokens (default: the whole stage, as released)')
    a('--ape', action=argparse.BooleanOptionalAction,
      help='Swin: the authors\' absolute position embedding in InLine attention (default: '
           'on without Eq. 6)')
    a('--nonneg', action=argparse.BooleanOptionalAction,
      help='InLine weights forced >= 0 (the non-negative weights ablation)')
    a('--normalise-q', metavar='LETTERS',
      help="the normalised-q ablation (the paper's Table 1 question: does q's length matter?): "
      "the blocks whose q is L2-normalised with a learned per-head gain, S (softmax), I (InLine) "
      "or SI")
    a('--model-kwargs', nargs='+', metavar='KEY=VALUE',
      help='more create_model overrides, values as Python literals, else strings, each quoted '
           "for the shell where it has brackets: 'depths=(1,1,2,1)' embed_dim=48")
    a('--dataset', choices=list(DATASETS),
      help='default: synthetic, imagefolder with --data-path; the small ones '
      'read their files as distributed in --data-path (data/): IDX .gz, CIFAR batches')
    a('--data-path',
      help='the dataset\'s root: for imagefolder train/<class>/<image> and val/<class>/<image>')
    a('--recipe', choices=['released', 'small'],
      help='an ImageFolder\'s recipe (default: released where an '
      f'epoch gives {RELEASED_MIN_STEPS}+ steps at the authors\' total batch, ImageNet-sized, '
      f'else small)')
    a('--download', action='store_true',
      help='download a small dataset into --data-path (torchvision)')
    a('--train-subset', type=int,
      help='train on this many images, a fixed random subset (the same for every seed)')
    a('--img-size', nargs='+', action=ImageSize, metavar='PX',
      help='input size in pixels: one side, or the height and width (64 96, or 64x96; default: '
      'the variant\'s own; on the synthetic task 32, DeiT 64, Swin with InLine windows smaller '
      'than the stage 224)')
    a('--fast', choices=['compile', 'triton', 'none'],
      help='the InLine core: compile, kernels.py\'s (torch.compile; the default), triton, '
      'triton_core.py\'s (CUDA only), or none, the reference of inline.py (the default for vanilla '
      'linear attention, layout L, and the peers, F and N, which have no fast core)')
    for old in RENAMED_FLAGS:
        a(old, action=Renamed, default=argparse.SUPPRESS, help=argparse.SUPPRESS)
    a('--drop-path', type=float, help='stochastic depth rate')
    a('--finetune',
      help='initial weights, its EMA where it has one (e.g. the 224 px weights for a '
           '384 px variant)')
    a('--skip-bad-images', action='store_true',
      help='leave out images that cannot be read, counted and listed every epoch (without it, the '
      'first stops the run at a saved step, naming it)')
    a('--grad-checkpoint', action='store_true',
      help='recompute each block in the backward: less memory, slower')
    a('--synthetic-train', type=int,
      help=f'synthetic training images per epoch ({SYNTHETIC["synthetic_train"]:,})')
    a('--synthetic-val', type=int,
      help=f'synthetic validation images ({SYNTHETIC["synthetic_val"]:,})')
    a('--epochs', type=int, help='epochs of the cosine schedule (cool-down epochs come on top)')
    a('--val-every', type=int, default=1,
      help='validate every this many epochs, and after the last (1)')
    a('--batch-size', type=int, help='per-process batch size (images)')
    a('--accum-steps', type=int,
      help='gradient accumulation steps (default: enough for the recipe\'s total batch)')
    a('--lr', type=float, help='peak learning rate per 512 images of total batch')
    a('--warmup-lr', type=float, help='learning rate at the start of warm-up, per 512 images')
    a('--min-lr', type=float,
      help='learning rate at the end of the cosine and in the cool-down, per 512 images')
    a('--warmup-epochs', type=float, help='linear warm-up (epochs)')
    a('--cooldown-epochs', type=int, help='epochs at --min-lr after the cosine')
    a('--weight-decay', type=float,
      help='AdamW weight decay (none on 1-D parameters and the model\'s exemptions)')
    a('--clip-grad', type=float, help='gradient norm clipping (0: off)')
    a('--label-smoothing', type=float)
    a('--mixup', type=float, help='Mixup alpha (0: off)')
    a('--cutmix', type=float, help='CutMix alpha (0: off)')
    a('--mixup-switch-prob', type=float,
      help='probability of CutMix rather than Mixup when both are on')
    a('--randaug-n', type=int, help='RandAugment operations per image (0: off)')
    a('--randaug-m', type=int, help='RandAugment magnitude, 0..10')
    a('--randaug-mstd', type=float, help='std of each operation\'s RandAugment magnitude')
    a('--color-jitter', type=float,
      help='colour jitter strength (used only when RandAugment is off, as in timm)')
    a('--random-erase', type=float, help='random erasing probability (random per-pixel values)')
    a('--ema-decay', type=float,
      help='EMA decay per optimizer step, 0: off (CSwin: 0.9996^(total batch/4096))')
    a('--amp', choices=['bf16', 'fp16', 'fp32'],
      help='autocast dtype (default, for training: the faster one here, '
      'default_amp: bf16 on a GPU with bf16 or a CPU with AMX, fp16 on other GPUs, '
      'on a CPU with AVX-512 BF16 alone '
      'bf16 if a probe finds it faster, else fp32; validation in fp32, as released, unless '
      '--amp is given)')
    a('--compile', action='store_true', help='torch.compile the model for training')
    a('--workers', type=int, help='data-loading processes per training process')
    a('--threads', type=int,
      help='CPU threads per process (default: this node\'s cores shared out among them)')
    a('--seed', type=int, help='the seed of every random stream (0)')
    a('--output-dir',
      help='checkpoints, metrics.jsonl and val_correct.pt (default: '
           'runs/<model>[-<overrides>]-<data>)')
    a('--resume', help=f'checkpoint to resume from (default: OUTPUT_DIR/{CHECKPOINT} if it exists)')
    a('--eval', action='store_true', help='only evaluate --checkpoint on the validation set')
    a('--checkpoint', help='weights to evaluate: ours, or the authors\' released file')
    a('--throughput', action='store_true', help='only measure inference images/s')
    return p


# ---------------------------------------------------------------------------------- resolving a run
@dataclass
class Run:
    """What every part of a run shares: the resolved flags, where it runs, and the checkpoint it
    starts from."""
    args: argparse.Namespace
    rank: int = 0
    world: int = 1
    device: torch.device = torch.device('cpu')
    total_batch: int = 0  # images per optimizer step
    amp_given: bool = False  # --amp on the command line: validation uses it too
    amp_why: str = ''  # why args.amp: 'given by --amp', or default_amp's reason
    recipe_why: str = ''  # why an ImageFolder's recipe: its size, or given
    arch: dict = None  # the model's create_model overrides besides RUN_KEYS (models' model.arch)
    name: str = ''  # the model and its overrides, short: the output folder's name
    saved: dict = None  # --eval's checkpoint, or the one to resume from
    saved_path: str = None
    classes: list = None  # the class names in label order, which every checkpoint records

    def autocast(self, training):
        """Training in --amp's dtype; validation in fp32, as the authors validated, unless --amp was
        given."""
        dtype = {'bf16': torch.bfloat16, 'fp16': torch.float16}.get(self.args.amp)  # None: fp32
        enabled = dtype is not None and (training or self.amp_given)
        return torch.autocast(self.device.type, dtype, enabled=enabled)


def model_kwargs(args):
    """--model-kwargs KEY=VALUE ... and the named architecture flags given, as create_model
    overrides."""
    kwargs = {}
    for item in args.model_kwargs or []:
        key, sep, value = item.partition('=')
        if not sep or not key.isidentifier():
            fail(f"--model-kwargs takes KEY=VALUE pairs (e.g. 'depths=(1,1,2,1)' embed_dim=48), "
                 f"not {item!r}")
        if key in RUN_KEYS:
            fail(f'--model-kwargs {key}: train.py sets it; use --{RUN_KEYS[key]}'
                 + ' (one side, or the height and width: 64 96)' * (key == 'img_size'))
        try:
            kwargs[key] = ast.literal_eval(value)
        except (ValueError, SyntaxError):  # not a Python literal: a string such as layout=IISS
            kwargs[key] = value
    return {**kwargs, **{k: getattr(args, k) for k in ARCH_FLAGS if getattr(args, k) is not None}}


def resolve_architecture(run):
    """The model and its create_model overrides (run.arch: --model-kwargs and the architecture
    flags), and run.name, the output folder's name without the data."""
    args = run.args
    run.arch = model_kwargs(args)
    args.model = args.model or 'inline_swin_t'
    summary = [re.sub(r'[^\w.]+', '',
                      f'{k}{".".join(map(str, v)) if isinstance(v, (tuple, list)) else v}')
               for k, v in sorted(run.arch.items())]
    run.name = '-'.join([args.model] + summary)


def default_output_dir(run):
    """runs/<model>[-<its overrides>]-<data>: two ablations never resume into each other."""
    data = dataset(run.args)
    data = os.path.basename(os.path.normpath(run.args.data_path)) if data == 'imagefolder' else data
    return os.path.join('runs', f'{run.name}-{data}')


def open_checkpoint(run):
    """The one way in for the checkpoint a run starts from, read once: --checkpoint (--eval),
    --resume FILE, else OUTPUT_DIR/checkpoint.pt where it exists. Its saved arguments fill the flags
    left unset, and another model or architecture than the flags ask for is refused; the authors'
    files save neither, and are taken as the flags say."""
    args = run.args
    path = args.checkpoint or args.resume
    if path is None:  # where this command's flags put its output folder
        resolve_architecture(run)
        args.output_dir = args.output_dir or default_output_dir(run)
        path = os.path.join(args.output_dir, CHECKPOINT)
        if args.eval or not os.path.exists(path):
            return
    run.saved, run.saved_path = read_checkpoint(path), path
    saved_args, saved_arch = saved_record(run.saved)  # under the options' new names
    if args.eval and args.data_path is None and (saved_args is None
                                                 or saved_args['data_path'] is not None):
        fail(f'--eval of {path} needs --data-path DIR: '
             'only checkpoints of our synthetic runs evaluate without data')
    if saved_args and args.model not in (None, saved_args['model']):
        fail(f'{path} is a checkpoint of {saved_args["model"]}, not of --model {args.model}')
    mine = INVOCATION + ('data_path',) * args.eval  # an eval's data is its own
    # a resumed run goes on as it was, an eval sees what it saw
    for key, value in (saved_args or {}).items():
        if getattr(args, key, False) is None and key not in mine:
            setattr(args, key, value)
    resolve_architecture(run)
    if saved_arch is not None:  # less what train.py sets: image size, classes, drop path
        check_architecture(path, {k: v for k, v in saved_arch.items() if k not in RUN_KEYS},
                           run.arch)


def resolve(run):
    """Fill every flag left unset, from the checkpoint the run starts from, then from the recipe:
    VARIANTS on an ImageFolder (ImageNet), SMALL on a small dataset, else SYNTHETIC; set the total
    batch."""
    open_checkpoint(run)  # which resolves the architecture
    args = run.args
    args.dataset = dataset(args)
    run.recipe_why = choose_recipe(args)
    # neither: the small recipe
    synthetic, imagenet = args.recipe == 'synthetic', args.recipe == 'released'
    folder = args.dataset == 'imagefolder'
    family = args.model.split('_')[1]  # registry names are inline_<family>_<size>
    recipe = SYNTHETIC if synthetic else SMALL
    if imagenet:
        recipe = {**RELEASED_RECIPE, **dict(zip(COLUMNS, VARIANTS[args.model]))}
    if (synthetic and args.img_size is None and not args.throughput
            and (run.arch.get('window') or 56) < 56):
        recipe = SYNTHETIC_WINDOWED
    for key, value in {**recipe, 'seed': 0}.items():
        if getattr(args, key) is None:
            setattr(args, key, value)
    if args.img_size is None and (folder or args.throughput):
        # the variant's own size; on the meta device a model costs no memory
        with torch.device('meta'):
            # (H, W); the released sizes are square
            args.img_size = models.create_model(args.model).img_size[0]
    if args.img_size is None:  # DeiT's 16 px patches: a 4x4 token grid
        args.img_size = 64 if family == 'deit' else 32
    if args.accum_steps is None:
        wanted = recipe['batch_size'] * PROCESSES  # the released total batch
        args.accum_steps = (1 if not imagenet
                            else max(1, round(wanted / args.batch_size / run.world)))
    run.total_batch = args.batch_size * run.world * args.accum_steps
    if args.ema_decay is None:
        args.ema_decay = (0.9996 ** (run.total_batch / 4096) if family in EMA_FAMILIES and imagenet
                          else 0.0)
    # kernels.enable_fast refuses a model with linear attention or a peer's (F, N): they have no
    # fast core
    if args.fast is None:
        layout = str(run.arch.get('layout', models.MODELS[args.model][1].get('layout', '')))
        args.fast = 'none' if set(layout) & set('LFN') else 'compile'
    run.amp_given = args.amp is not None
    amp = [(args.amp, 'given by --amp') if run.amp_given else default_amp(run.device)]
    # rank 0's, which a probe may have measured: every rank in the same precision
    if dist.is_initialized():
        dist.broadcast_object_list(amp)
    args.amp, run.amp_why = amp[0]
    if args.workers is None:
        local = int(os.environ.get('LOCAL_WORLD_SIZE', 1))
        args.workers = 0 if not folder else min(8, cpu_count() // local)
    args.output_dir = args.output_dir or default_output_dir(run)
    check_args(args)


def choose_recipe(args):
    """Set args.recipe: 'released' or 'small' for an ImageFolder (from its size, unless given),
    'small' for the small datasets, 'synthetic'; returns why, for the recipe: line."""
    if args.dataset != 'imagefolder':
        if args.recipe == 'released':
            fail("--recipe released is the authors' ImageNet-1K recipe: give --data-path "
                 "of an ImageFolder")
        args.recipe = 'synthetic' if args.dataset == 'synthetic' else 'small'
        return ''
    if args.recipe is not None or args.eval:  # an authors' file is evaluated as they evaluated it
        args.recipe = args.recipe or 'released'
        return 'given'
    images, total = (count_images(os.path.join(args.data_path, 'train')),
                     VARIANTS[args.model][0] * PROCESSES)
    args.recipe = 'released' if images >= RELEASED_MIN_STEPS * total else 'small'
    return (f'{images:,} training images, {images // total:,} steps an epoch at the authors\' '
            f'total batch of {total:,}: {RELEASED_MIN_STEPS} or more take the released recipe; '
            f'--recipe chooses')


def default_amp(device):
    """(--amp's default, the fact it rests on): bf16 where it is faster than fp32, else fp16 on
    CUDA, else fp32."""
    # emulated bf16 (before Ampere) is slower: fp16 there, with the loss scaler
    if device.type == 'cuda':
        gpu = torch.cuda.get_device_name(device)
        if torch.cuda.is_bf16_supported(including_emulation=False):
            return 'bf16', f'{gpu} computes bf16'
        return 'fp16', f'{gpu} has no bf16 (fp16, with the loss scaler)'
    # private functions, so guarded
    if getattr(torch.cpu, '_is_amx_tile_supported', lambda: False)():
        return 'bf16', 'this CPU has AMX, where bf16 is faster than fp32'
    if not getattr(torch.cpu, '_is_avx512_bf16_supported', lambda: False)():
        return 'fp32', 'this CPU has no AMX or AVX-512 BF16, where bf16 would be emulated'
    # AVX-512 BF16 alone decides nothing: bf16 trained 2x faster on one such CPU, slower on another
    x = bf16_speedup()
    why = (f'this CPU has AVX-512 BF16 but no AMX; bf16 ran {x:.1f}x the speed of fp32 in a '
           f'1-thread probe, 1.25x needed')
    # 1.25: a whole training step gains less than the probe
    return ('bf16' if x >= 1.25 else 'fp32'), why


@functools.cache
def bf16_speedup(rounds=7):
    """fp32 time / bf16 time of a transformer MLP's training step (LayerNorm, 128 -> 512 -> 128,
    2048 tokens): median of interleaved rounds, one thread, process CPU time (two threads on a
    shared machine scattered it). ~0.5 s, once."""
    with torch.random.fork_rng(devices=[]):  # the run's random streams stay as they were
        mlp = nn.Sequential(nn.LayerNorm(128), nn.Linear(128, 512), nn.GELU(), nn.Linear(512, 128))
        x = torch.randn(2048, 128)
    threads, seconds = torch.get_num_threads(), {False: [], True: []}
    torch.set_num_threads(1)
    for bf16 in [False, True] * (rounds + 1):  # the first pair warms up
        start = time.process_time()
        with torch.autocast('cpu', torch.bfloat16, enabled=bf16):
            mlp(x).float().square().mean().backward()
        seconds[bf16].append(time.process_time() - start)
    torch.set_num_threads(threads)
    return sorted(a / b for a, b in zip(seconds[False][1:], seconds[True][1:]))[rounds // 2]


def check_args(args):
    for name, ok, allowed in (('batch_size', args.batch_size >= 1, '>= 1'),
                              ('lr', 0 < args.lr <= 1, 'in (0, 1]'),
                              ('min_lr', 0 <= args.min_lr <= args.lr, 'in [0, --lr]'),
                              ('warmup_lr', 0 <= args.warmup_lr <= args.lr, 'in [0, --lr]'),
                              ('epochs', args.epochs >= 1, '>= 1'),
                              ('accum_steps', args.accum_steps >= 1, '>= 1'),
                              ('weight_decay', args.weight_decay >= 0, '>= 0'),
                              ('label_smoothing', 0 <= args.label_smoothing < 1, 'in [0, 1)'),
                              ('ema_decay', 0 <= args.ema_decay < 1, 'in [0, 1)'),
                              ('random_erase', 0 <= args.random_erase <= 1, 'in [0, 1]')):
        if not ok:
            fail(f'--{name.replace("_", "-")} {getattr(args, name)} is out of range: it '
                 f'must be {allowed}')


def setup(args):
    """Rank, world size and device from torchrun's environment (a plain `python train.py` is rank 0
    of 1); the checkpoint to start from; every flag resolved."""
    rank, world, local_rank = (int(os.environ.get(k, 0))
                               for k in ('RANK', 'WORLD_SIZE', 'LOCAL_RANK'))
    run = Run(args, rank, max(world, 1))
    local, gpus = int(os.environ.get('LOCAL_WORLD_SIZE', 1)), torch.cuda.device_count()
    if torch.cuda.is_available() and local > gpus:  # checked before any process touches a GPU
        if local_rank == 0:  # one message per node: the node's count is what is wrong
            print(f'error: torchrun started {local} processes on this node, which has {gpus} '
                  f'GPU(s); launch at most {gpus} with --nproc-per-node={gpus}', file=sys.stderr,
                  flush=True)
        raise SystemExit(1)
    if torch.cuda.is_available():
        run.device = torch.device('cuda', local_rank)
        torch.cuda.set_device(run.device)
        # for --amp fp32
        torch.backends.cuda.matmul.allow_tf32 = torch.backends.cudnn.allow_tf32 = True
    else:
        torch.set_num_threads(args.threads or max(1, cpu_count() // local))
    if run.world > 1:
        dist.init_process_group('nccl' if run.device.type == 'cuda' else 'gloo')
    if args.eval != bool(args.checkpoint):  # each needs the other
        fail('--eval needs --checkpoint FILE' if args.eval else
             '--checkpoint is for --eval; continue training with --resume, '
             'start from weights with --finetune')
    resolve(run)
    print0(f'args: {json.dumps(vars(args))}')
    return run


# ------------------------------------------------------------------------------ model and optimizer
def build_model(run, num_classes):
    """The variant at the run's image size and drop path, with the fast core unless --fast none."""
    args = run.args
    if run.saved and run.saved.get('num_classes', num_classes) != num_classes:
        fail(f'{run.saved_path} has {run.saved["num_classes"]} classes; the data has {num_classes}')
    overrides = dict(run.arch, img_size=args.img_size, drop_path_rate=args.drop_path)
    torch.manual_seed(args.seed)  # the same initial weights on every rank
    try:
        model = models.create_model(args.model, num_classes=num_classes, **overrides)
    except (ValueError, TypeError) as e:
        fail(f'cannot build {args.model} with {overrides}: {e}')
    # checked against the reference on the run's device, before any step
    if args.fast != 'none':
        try:
            import kernels
            kernels.enable_fast(model, args.fast, device=run.device, log=print0)
        except ImportError as e:
            fail(f'the fast core is unavailable ({e}); pass --fast none for the reference')
        except ValueError as e:
            fail(str(e))
    # the authors' 384 px fine-tunes start from the 224 px weights, the EMA where there is one
    if args.finetune:
        load_initial(model, args.finetune, models.released_img_size(args.model))
    model.set_grad_checkpointing(args.grad_checkpoint)
    print0(f'model: {args.model}, {sum(p.numel() for p in model.parameters()) / 1e6:.1f}M '
           f'parameters, {pixels(args.img_size)}, fast {args.fast}, amp {args.amp} '
           f'({run.amp_why}), device {run.device} x {run.world}')
    print0(f'architecture: layout {model.layout}, attention {model.options}; '
           f'overrides {model.arch}')
    return model.to(run.device)


def build_optimizer(model, args, total_batch, steps_per_epoch):
    """(AdamW, its per-step schedule): no weight decay on 1-D parameters (biases, norms) and the
    model's no_weight_decay() names; a cosine to --min-lr whose start a linear warm-up replaces,
    then --cooldown-epochs at --min-lr, as timm's CosineLRScheduler ran in the released trainer."""
    skip = model.no_weight_decay()
    decay, no_decay = [], []
    for name, param in model.named_parameters():
        if param.requires_grad:
            exempt = param.ndim <= 1 or name in skip or name.split('.')[-1] in skip
            (no_decay if exempt else decay).append(param)
    groups = [{'params': decay, 'weight_decay': args.weight_decay},
              {'params': no_decay, 'weight_decay': 0.0}]
    # the rates are given per 512 images and scale linearly with the total batch, as the released
    # trainer's
    peak, warmup_lr, min_lr = (lr * total_batch / 512
                               for lr in (args.lr, args.warmup_lr, args.min_lr))
    optimizer = torch.optim.AdamW(groups, lr=peak, betas=(0.9, 0.999), eps=1e-8, fused=True)
    warmup, total = round(args.warmup_epochs * steps_per_epoch), args.epochs * steps_per_epoch

    def lr_at(step):
        if step < warmup:
            return warmup_lr + (peak - warmup_lr) * step / warmup
        if step >= total:
            return min_lr
        return min_lr + 0.5 * (peak - min_lr) * (1 + math.cos(math.pi * step / total))
    return optimizer, torch.optim.lr_scheduler.LambdaLR(optimizer, lambda step: lr_at(step) / peak)


# ------------------------------------------------------------------------------------------ threads
def cpu_count():
    return len(os.sched_getaffinity(0)) if hasattr(os, 'sched_getaffinity') else os.cpu_count() or 1


# ----------------------------------------------------------------------------------- train and eval
@dataclass
class Training:
    """What fit() builds once and every epoch uses; a checkpoint holds all of it."""
    model: nn.Module  # what runs: compiled and DDP-wrapped as asked
    raw: nn.Module  # the plain module that model wraps, whose weights are saved
    optimizer: torch.optim.Optimizer
    scheduler: torch.optim.lr_scheduler.LRScheduler
    scaler: torch.amp.GradScaler
    ema: AveragedModel  # None: no EMA
    mix: nn.Module  # Mixup/CutMix, or None
    criterion: nn.Module
    steps_per_epoch: int
    epoch: int = 0  # the next epoch to run
    step: int = 0  # optimizer steps already done in it (non-zero only after SIGTERM or SIGINT)
    best_acc: float = -1.0
    log: list = field(default_factory=list)
    unreadable: list = field(default_factory=list)  # this epoch's unreadable images, on this rank


def train_one_epoch(run, t, loader, epoch, stop):
    """One pass over the loader; returns (mean loss, images/s, optimizer steps done, why it stopped
    early: None, 'signal', or 'unreadable' for an image it could not read, without
    --skip-bad-images)."""
    args, device = run.args, run.device
    t.model.train()
    desc = f'epoch {epoch + 1}/{args.epochs + args.cooldown_epochs}'
    bar = tqdm(total=t.steps_per_epoch - t.step, desc=desc, leave=False, disable=run.rank != 0,
               mininterval=1.0, dynamic_ncols=True)
    losses, step, micro_loss, speed, stopped, start = [], 0, 0.0, 0.0, None, time.perf_counter()
    unread = []  # this step's unreadable images on this rank
    for i, (x, y) in enumerate(loader):
        if step == t.steps_per_epoch - t.step:  # the last incomplete accumulation group is dropped
            break
        x, y = x.to(device, non_blocking=True), y.to(device, non_blocking=True)
        x, y, weight = leave_out_unreadable(x, y, unread, args.skip_bad_images)
        if t.mix is not None:
            x, y = t.mix(x, y)  # y becomes (B, classes) soft targets
        last_micro = (i + 1) % args.accum_steps == 0
        with t.model.no_sync() if run.world > 1 and not last_micro else contextlib.nullcontext():
            with run.autocast(training=True):
                loss = t.criterion(t.model(x), y) * weight / args.accum_steps
            t.scaler.scale(loss).backward()
        micro_loss += loss.item()
        if not last_micro:
            continue
        # one small all-reduce per step: the mean loss, whether any rank saw a bad loss, a signal or
        # an image it could not read
        flags = torch.tensor([micro_loss, not math.isfinite(micro_loss), stop.is_set(),
                              len(unread)], device=device)
        if run.world > 1:
            dist.all_reduce(flags)
        if flags[1] > 0:
            latest = os.path.join(args.output_dir, CHECKPOINT)
            kept = 'nothing saved'
            if os.path.exists(latest):
                kept = f'the last good checkpoint, {latest}, is untouched'
            bar.close()
            fail(f'the loss is not finite ({micro_loss}) at epoch {epoch + 1}, step '
                 f'{t.step + step + 1}; stopped, {kept}. Try a lower --lr, '
                 f'--clip-grad, or --amp fp32.')
        t.unreadable, unread = t.unreadable + unread, []
        if flags[3] > 0 and not args.skip_bad_images:  # this step is dropped; fit saves the last
            t.optimizer.zero_grad(set_to_none=True)
            stopped = 'unreadable'
            break
        if args.clip_grad > 0:
            t.scaler.unscale_(t.optimizer)
            nn.utils.clip_grad_norm_(t.raw.parameters(), args.clip_grad)
        t.scaler.step(t.optimizer)
        t.scaler.update()
        t.optimizer.zero_grad(set_to_none=True)
        t.scheduler.step()
        if t.ema is not None:
            t.ema.update_parameters(t.raw)
        losses.append(flags[0].item() / run.world)
        step, micro_loss = step + 1, 0.0
        speed = step * run.total_batch / (time.perf_counter() - start)
        bar.set_postfix(loss=f'{losses[-1]:.3f}', lr=f'{t.scheduler.get_last_lr()[0]:.2e}',
                        img_s=f'{speed:.0f}', refresh=False)
        bar.update()
        if flags[2] > 0:
            stopped = 'signal'
            break
    bar.close()
    return sum(losses) / max(len(losses), 1), speed, step, stopped


@torch.no_grad()
def evaluate(run, model, loader):
    """Loss, top-1 and top-5 over the whole validation set, and `correct`: which images top-1 got
    right, a bool tensor in the validation set's own order; each rank holds a disjoint slice, summed
    here. Images that cannot be read (label -1 - index, data.ImageFolder) are left out of the counts
    and returned as `unreadable`, their indices."""
    model.eval()
    # loss sum, top-1 hits, top-5 hits, images
    totals = torch.zeros(4, dtype=torch.float64, device=run.device)
    rights, misses = [], []  # top-1 right or not, unreadable or not, in the loader's order
    for x, y in loader:
        x, y = x.to(run.device, non_blocking=True), y.to(run.device, non_blocking=True)
        read = y >= 0  # (B,)
        y = y.clamp(min=0)
        with run.autocast(training=False):
            logits = model(x).float()
        top5 = logits.topk(min(5, logits.shape[1]), dim=1).indices  # (B, 5)
        hits = (top5 == y[:, None]) & read[:, None]  # (B, 5): the top 5 against y
        rights.append(hits[:, 0].int())
        misses.append((~read).int())
        loss = nn.functional.cross_entropy(logits, y, reduction='none')[read]
        totals += torch.stack([loss.sum().double(), hits[:, 0].sum().double(),
                               hits.any(1).sum().double(), read.sum().double()])
    # (2, images): right, unreadable
    correct = torch.zeros(2, len(loader.dataset.dataset), dtype=torch.int32, device=run.device)
    if rights:  # a rank of more ranks than images has none: it adds zeros
        places = torch.as_tensor(loader.dataset.indices, device=run.device)  # val_loader's Subset
        correct[:, places] = torch.stack([torch.cat(rights), torch.cat(misses)])
    if run.world > 1:
        dist.all_reduce(totals)
        dist.all_reduce(correct)
    loss, top1, top5, n = totals.tolist()
    seen = max(n, 1)  # no image read: zeros
    return {'loss': loss / seen, 'acc1': 100 * top1 / seen, 'acc5': 100 * top5 / seen,
            'images': int(n), 'correct': correct[0].cpu().bool(),
            'unreadable': correct[1].nonzero().flatten().tolist()}


def evaluate_checkpoint(run, model, val_set):
    """--eval: the file's weights, then its EMA weights where it has them (ours or the authors'
    CSwin). The per-image results are printed as their SHA-256 (16 hex digits of the bool tensor's
    bytes): enough to tell two apart."""
    loader = val_loader(run, val_set)
    for key in ('model', *(k for k in EMA_KEYS if run.saved.get(k) is not None)):
        load_weights(model, run.saved, key, run.saved_path,
                     models.released_img_size(run.args.model))
        result = evaluate(run, model, loader)
        if names := unreadable(val_set, result.pop('unreadable'), run.args.data_path, gather=False):
            print0(f'warning: {names}, left out of the validation')
        result['correct_sha256'] = hashlib.sha256(
            result.pop('correct').numpy().tobytes()).hexdigest()[:16]
        print0(f'eval {"model" if key == "model" else "ema"}: {json.dumps(result)}')
    if run.saved.get('log'):
        print0('logged when saved: ' + json.dumps(run.saved['log'][-1]))


@torch.no_grad()
def prepare_training(run, raw, train_set):
    """The sampler, loader, optimizer, schedule, scaler, EMA, Mixup/CutMix and loss, restored from
    the checkpoint to resume; the recipe and the schedule they run, printed."""
    args, num_classes = run.args, len(train_set.classes)
    sampler, loader = train_loader(run, train_set)
    steps_per_epoch = len(loader) // args.accum_steps
    if steps_per_epoch == 0:
        most = len(train_set) // (run.world * args.accum_steps)  # the batch of one step an epoch
        fix = (f'pass --batch-size {max(1, most // FEW_STEPS)} ({FEW_STEPS} steps an epoch) or at '
               f'most {most} (one step)' if most else
               f'pass --accum-steps {max(1, len(train_set) // run.world)} or fewer')
        fail(f'--batch-size {args.batch_size} x {run.world} processes x {args.accum_steps} '
             f'accumulation steps exceeds the {len(train_set):,} training images: {fix}')
    optimizer, scheduler = build_optimizer(raw, args, run.total_batch, steps_per_epoch)
    model = torch.compile(raw) if args.compile else raw
    if run.world > 1:
        model = DDP(model, device_ids=[run.device.index] if run.device.type == 'cuda' else None)
    scaler = torch.amp.GradScaler(run.device.type, enabled=args.amp == 'fp16')
    ema = None
    if args.ema_decay > 0:
        ema = AveragedModel(raw, multi_avg_fn=get_ema_multi_avg_fn(args.ema_decay))
    criterion = nn.CrossEntropyLoss(label_smoothing=args.label_smoothing)
    mixup = T.MixUp(alpha=args.mixup, num_classes=num_classes) if args.mixup > 0 else None
    cutmix = T.CutMix(alpha=args.cutmix, num_classes=num_classes) if args.cutmix > 0 else None
    # one of the two per batch; soft targets, which the criterion takes as they are
    mix = (T.RandomChoice([mixup, cutmix], p=[1 - args.mixup_switch_prob, args.mixup_switch_prob])
           if mixup and cutmix else mixup or cutmix)
    t = Training(model, raw, optimizer, scheduler, scaler, ema, mix, criterion, steps_per_epoch)
    if run.saved is not None:
        resume(run, t)
    else:
        # augmentation, Mixup/CutMix and drop path differ between ranks
        torch.manual_seed(args.seed + run.rank)
    small = '; '.join(filter(None, [run.recipe_why,
                                    f'random crop padded by {min(pair(args.img_size)) // 8} px, '
                                    f'flip']))
    recipe = {'synthetic': 'synthetic (no Mixup/CutMix/RandAugment/erasing; '
                           '--data-path gives an ImageFolder)',
              'released': f'released ImageNet-1K recipe for {args.model} '
                          f'({run.recipe_why or "given"})'}.get(
        args.recipe, f'small-data recipe for {args.dataset} ({small})')
    print0(f'recipe: {recipe}; mixup {args.mixup}, cutmix {args.cutmix}, '
           f'randaug {args.randaug_n}x{args.randaug_m}, '
           f'erase {args.random_erase}, label smoothing {args.label_smoothing}, drop path '
           f'{args.drop_path}, clip {args.clip_grad}, ema {args.ema_decay:.6g}')
    print0(f'schedule: {args.epochs + args.cooldown_epochs} epochs ({args.epochs} cosine '
           f'with {args.warmup_epochs} of warm-up, then {args.cooldown_epochs} cool-down) '
           f'x {steps_per_epoch} steps of {run.total_batch} images ({args.batch_size} per process '
           f'x {run.world} processes x {args.accum_steps} accumulation steps); '
           f'peak lr {scheduler.base_lrs[0]:.3g}, weight decay {args.weight_decay}')
    if steps_per_epoch < FEW_STEPS:
        print0(f'warning: {steps_per_epoch} optimizer step(s) an epoch ({len(train_set):,} images, '
               f'{run.total_batch} a step) are too few to learn from: lower --batch-size '
               f'or --accum-steps')
    if args.warmup_epochs >= args.epochs:
        print0(f'warning: the warm-up ({args.warmup_epochs} epochs) is as long as the run '
               f'({args.epochs}): the learning rate never reaches its peak; lower --warmup-epochs')
    return t, sampler, loader


def fit(run, raw, train_set, val_set):
    """Train epoch after epoch, validating and saving after each; SIGTERM or SIGINT (Ctrl-C) saves
    mid-epoch and stops, exiting 143 or 130."""
    args = run.args
    t, sampler, loader = prepare_training(run, raw, train_set)
    val = val_loader(run, val_set)
    stop, received = threading.Event(), []  # set by SIGTERM or SIGINT: the step ends, then a save

    def interrupt(sig, frame):
        received.append(signal.Signals(sig))
        stop.set()
    for sig in (signal.SIGTERM, signal.SIGINT):  # Ctrl-C too: no KeyboardInterrupt mid-step
        signal.signal(sig, interrupt)
    epochs, start = args.epochs + args.cooldown_epochs, time.perf_counter()
    for epoch in range(t.epoch, epochs):
        sampler.set_epoch(epoch)
        sampler.start = t.step * args.accum_steps * args.batch_size
        if isinstance(train_set, SyntheticShapes):
            train_set.epoch = epoch  # a fresh set of images every epoch
        loader.generator.manual_seed(hash((args.seed, epoch, run.rank)) % 2**62)  # worker seeds
        loss, speed, steps, stopped = train_one_epoch(run, t, loader, epoch, stop)
        if stopped:
            t.step += steps
            save_checkpoint(run, t)
            latest = os.path.join(args.output_dir, CHECKPOINT)
            if stopped == 'unreadable':
                fail(f'{unreadable(train_set, t.unreadable, args.data_path)}, met at epoch '
                     f'{epoch + 1}, step {t.step + 1}; saved {latest} at step {t.step}. {GO_ON}')
            why = received[0].name if received else 'stopped with the other processes'
            print0(f'{why}: saved {latest} at epoch {epoch + 1}, step {t.step}; to continue, rerun '
                   f'the same command (or give --resume {shlex.quote(latest)})')
            # as a shell reports a process a signal ended, 128 + its number: SIGINT 130, SIGTERM
            # 143 (a process another's signal stopped: as SIGTERM), so no script reads it as done
            raise SystemExit(128 + (received[0] if received else signal.SIGTERM))
        if args.skip_bad_images and (names := unreadable(train_set, t.unreadable, args.data_path)):
            print0(f'warning: epoch {epoch + 1} left out {names}')
        t.unreadable = []
        # and always after the last epoch
        validate = (epoch + 1) % args.val_every == 0 or epoch + 1 == epochs
        entry = {'epoch': epoch + 1, 'train_loss': loss, 'lr': t.scheduler.get_last_lr()[0],
                 'images_per_s': speed}
        for prefix, module in (('val', raw),
                               ('ema_val', t.ema.module if t.ema is not None else None)):
            if validate and module is not None:
                result = evaluate(run, module, val)
                bad_val = result.pop('unreadable')  # the same on every rank
                # OUTPUT_DIR/val_correct.pt
                save_correct(run, f'{prefix}_correct', result.pop('correct'))
                entry.update({f'{prefix}_{k}': v for k, v in result.items()})
        entry['arch'] = json.loads(json.dumps(raw.arch))  # as metrics.jsonl has it
        # CSwin reports its EMA (main_ema.py)
        acc = entry.get('ema_val_acc1' if t.ema is not None else 'val_acc1', -1.0)
        is_best, t.best_acc = acc > t.best_acc, max(acc, t.best_acc)
        t.log.append(entry)
        t.epoch, t.step = epoch + 1, 0
        save_checkpoint(run, t, is_best)
        if validate and bad_val:
            names = unreadable(val_set, bad_val, args.data_path, gather=False)  # every rank's
            names += ', left out of the validation'
            if not args.skip_bad_images:
                fail(f'{names}; epoch {epoch + 1} is saved. {GO_ON}')
            print0(f'warning: {names}')
        print0(f'epoch {epoch + 1}/{epochs}  train loss {loss:.4f}' +
               (f'  val loss {entry["val_loss"]:.4f}  acc@1 {entry["val_acc1"]:.2f}  '
                f'acc@5 {entry["val_acc5"]:.2f}' if validate else '') +

               (f'  ema acc@1 {entry["ema_val_acc1"]:.2f}' if t.ema and validate else '') +
               f'  lr {entry["lr"]:.2e}  {speed:.0f} img/s  {time.perf_counter() - start:.0f} s')
    print0(f'done: best acc@1 {t.best_acc:.2f}; checkpoints and metrics.jsonl in {args.output_dir}')


def throughput(run, model, x, warmup=10, timed=30):
    """--throughput: inference images/s of model on the batch x, in the training precision: `warmup`
    batches (compilation included), then `timed` batches timed."""
    sync = torch.cuda.synchronize if x.device.type == 'cuda' else lambda: None
    for i in range(warmup + timed):
        if i == warmup:
            sync()
            start = time.perf_counter()
        with torch.no_grad(), run.autocast(training=True):
            model(x)
    sync()
    return timed * len(x) / (time.perf_counter() - start)


def main(args):
    run = setup(args)
    if args.throughput:  # random input, the released 1000-class head
        x = torch.randn(args.batch_size, 3, *pair(args.img_size), device=run.device)
        model = build_model(run, num_classes=1000).eval()
        speed = throughput(run, model, x)
        return print0(f'throughput: {speed:.1f} images/s (one process, batch {args.batch_size}, '
                      f'{pixels(args.img_size)}, {args.amp})')
    if not args.eval:  # before the data and the model: a run that cannot save says so first
        check_output_dir(args.output_dir)
    train_set, val_set = load_data(args)
    run.classes = list(val_set.classes)
    model = build_model(run, num_classes=len(run.classes))
    if args.eval:
        evaluate_checkpoint(run, model, val_set)
    else:
        fit(run, model, train_set, val_set)


if __name__ == '__main__':
    try:
        main(get_args_parser().parse_args())
    except KeyboardInterrupt:  # before training starts or after it ends: nothing to save
        print0('interrupted (Ctrl-C) outside the training loop: nothing was saved')
        raise SystemExit(130)
    if dist.is_initialized():
        dist.destroy_process_group()

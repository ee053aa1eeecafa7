"""Train and evaluate the InLine backbones: plain DDP, the authors' recipe to the letter, resumable.

InLine attention: Han et al., "Bridging the Divide: Reconsidering Softmax and Linear Attention", NeurIPS 2024,
arXiv 2412.06590. With --data-path, the released ImageNet-1K recipe (VARIANTS below; README, "Training and
evaluation"); without it, a small recipe for a built-in synthetic task.

The main job: no dataset, no download; >= 90% validation accuracy in minutes on a 2-core CPU (README, "Quick start"):
    torchrun --standalone --nproc_per_node=2 train.py --model inline_swin_t
Fashion-MNIST from its four IDX .gz files as distributed (Debian's dataset-fashion-mnist; or --download), CIFAR too:
    python train.py --model inline_deit_t --dataset fashion_mnist --data-path DIR --img-size 64 --train-subset 5000

ImageNet-1K (DIR/train/<class>/<image>, DIR/val/<class>/<image>), as the authors ran it on 8 GPUs (total batch =
the variant's per-process batch x 8; fewer processes reach it by gradient accumulation, printed at start):
    torchrun --standalone --nproc_per_node=8 train.py --model inline_swin_t --data-path DIR
    # the 384 px variants fine-tune from the 224 px weights (from their EMA where the file has one: CSwin)
    torchrun --standalone --nproc_per_node=8 train.py --model inline_cswin_b_384 --data-path DIR --finetune FILE
Evaluate a checkpoint, ours or the authors' released file (and its EMA weights where it has them):
    torchrun --standalone --nproc_per_node=8 train.py --model inline_swin_t --data-path DIR --eval --checkpoint FILE
Inference throughput (images/s of one process, at the model's released image size):
    python train.py --model inline_swin_t --throughput --batch-size 64

Nothing is lost: rerunning the same command resumes from OUTPUT_DIR/checkpoint.pt, written atomically every epoch;
SIGTERM saves and exits; on CPU, a run killed with -9 and rerun ends with an uninterrupted run's weights.
"""
import argparse
import ast
import base64
import contextlib
import functools
import gzip
import hashlib
import json
import math
import os
import pickle
import random
import re
import shutil
import signal
import struct
import sys
import threading
import time
from dataclasses import dataclass, field

import torch
import torch.distributed as dist
import torch.nn as nn
from PIL import Image
from torch.nn.parallel import DistributedDataParallel as DDP
from torch.optim.swa_utils import AveragedModel, get_ema_multi_avg_fn
from torch.utils.data import DataLoader, Dataset, DistributedSampler, Subset
from torchvision import datasets
from torchvision.transforms import v2 as T
from torchvision.transforms.v2 import functional as F
from tqdm import tqdm

import inline
import models

# ------------------------------------------------------------------------------------------------- recipe
# The released recipe, one row per variant (the authors' cfgs/inline_<variant>.yaml; PVT-L's is inline_pvt_b.yaml).
# Learning rates are per 512 images of total batch and scale linearly with it (build_optimizer). clip 0: none.
COLUMNS = ('batch_size', 'lr', 'epochs', 'warmup_epochs', 'warmup_lr', 'min_lr', 'cooldown_epochs', 'weight_decay',
           'clip_grad', 'drop_path')
VARIANTS = {  #      batch  peak lr  epochs  warm-up: epochs, lr  min lr  cool-down  wd  clip  drop path
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
}
PROCESSES = 8  # the total batch is the table's per-process batch x 8 processes, as the authors' README launches
# shared by every variant; colour jitter acts only where RandAugment is off (as in timm), so not in the released runs
RELEASED = dict(label_smoothing=0.1, mixup=0.8, cutmix=1.0, mixup_switch_prob=0.5, randaug_n=2, randaug_m=9,
                randaug_mstd=0.5, color_jitter=0.4, random_erase=0.25)
EMA_FAMILIES = ('cswin',)  # decay 0.9996 per step at a total batch of 4096, i.e. 0.9996^(batch / 4096)
NO_EVAL_CROP = ('inline_swin_b_384',)  # its config's TEST.CROP is False: resized straight to 384 x 384
# The synthetic task: fresh procedurally generated images every epoch, so no augmentation is needed and none
# of Mixup/CutMix/RandAugment/erasing is used (they would only slow a 10-minute run down).
SYNTHETIC = dict(batch_size=128, lr=2e-3, epochs=5, warmup_epochs=0.5, warmup_lr=1e-5, min_lr=1e-5, cooldown_epochs=0,
                 weight_decay=0.05, clip_grad=5.0, drop_path=0.0, label_smoothing=0.1, mixup=0.0, cutmix=0.0,
                 mixup_switch_prob=0.5, randaug_n=0, randaug_m=0, randaug_mstd=0.0, color_jitter=0.0, random_erase=0.0,
                 synthetic_train=12_800, synthetic_val=2_000)
# The synthetic task for Swin's InLine windows smaller than the stage (Table 4's 7, 14, 28; README, "Training and
# evaluation"): 224 px, the one size below 448 at which they tile every stage they are smaller than, and fewer,
# smaller steps, to end in minutes on a CPU; the rate per 512 images is raised so that 2 x 8 images a step see 5e-4.
SYNTHETIC_WINDOWED = dict(SYNTHETIC, img_size=224, batch_size=8, epochs=3, warmup_epochs=0.3, synthetic_train=640,
                          synthetic_val=320, lr=1.6e-2)
# Fashion-MNIST and CIFAR: the synthetic recipe, with a random crop (padded by 1/8) and a flip (load_data),
# batches of 64 at 7.5e-4 a step: a small subset gives few steps, and 128 at 5e-4 left a DeiT learning in its last epoch
SMALL = {k: v for k, v in SYNTHETIC.items() if not k.startswith('synthetic')} | dict(batch_size=64, lr=6e-3, epochs=15,
                                                                                    warmup_epochs=1)
SMALL_DATASETS = {'fashion_mnist': datasets.FashionMNIST, 'cifar10': datasets.CIFAR10, 'cifar100': datasets.CIFAR100}
MEAN, STD = (0.485, 0.456, 0.406), (0.229, 0.224, 0.225)
FILL = [round(255 * m) for m in MEAN]  # RandAugment's geometric ops fill with the mean colour
BICUBIC = T.InterpolationMode.BICUBIC
TO_TENSOR = [T.ToImage(), T.ToDtype(torch.float32, scale=True), T.Normalize(MEAN, STD)]
CHECKPOINT = 'checkpoint.pt'  # OUTPUT_DIR's latest checkpoint, which a rerun of the same command resumes
INVOCATION = ('amp', 'workers', 'threads', 'finetune', 'resume', 'attention_impl')  # never taken from a checkpoint
ARCH_FLAGS = ('layout', 'kernel', 'residual', 'local_size', 'dilation', 'window', 'ape', 'nonneg', 'normalise_q')
RUN_KEYS = {'img_size': 'img-size', 'num_classes': 'data-path', 'drop_path_rate': 'drop-path'}  # and their flags


def get_args_parser():
    p = argparse.ArgumentParser(description=__doc__.split('\n')[0],
                                epilog='Flags without a default take the recipe\'s value (printed at start).')
    a = p.add_argument
    a('--model', choices=sorted(models.MODELS), metavar='NAME',
      help=f'variant (README, "Models"; default: the experiment\'s or the checkpoint\'s, else inline_swin_t): '
           f'{", ".join(models.MODELS)}')
    a('--experiment', metavar='NAME', help='one of the paper\'s experiments (`python paper.py experiments` '
      'lists them): its model and overrides, under which the flags below win')
    a('--layout', help='attention per stage: I InLine, L linear, S softmax, M<k> after the letters (e.g. IIMS2)')
    a('--kernel', help=f'phi of the I and L blocks: {", ".join(inline.KERNELS)}')
    a('--residual', help='InLine\'s residual: local (Eq. 6, released), plain (r * v_i) or none')
    a('--local-size', type=int, help='side k of Eq. 6\'s k x k neighbourhood (odd; released: 3)')
    a('--dilation', type=int, help='dilation of Eq. 6\'s neighbourhood')
    a('--window', type=int, help='Swin: InLine window side in tokens (default: the whole stage, as released)')
    a('--ape', action=argparse.BooleanOptionalAction,
      help='Swin: the authors\' absolute position embedding in InLine attention (default: on without Eq. 6)')
    a('--nonneg', action=argparse.BooleanOptionalAction, help='InLine weights forced >= 0 (R-nonneg)')
    a('--normalise-q', metavar='LETTERS', help="T1: the blocks whose q is L2-normalised with a learned per-head gain, "
      "S (softmax), I (InLine) or SI")
    a('--model-kwargs', nargs='+', metavar='KEY=VALUE',
      help='more create_model overrides, values as Python literals, else strings: depths=(1,1,2,1) embed_dim=48')
    a('--dataset', choices=['synthetic', 'imagefolder', *SMALL_DATASETS, 'fashion_recall'], help='default: synthetic, '
      'imagefolder with --data-path; the small ones read their files as distributed in --data-path (data/): IDX .gz, '
      'CIFAR batches; fashion_recall: mosaics of Fashion-MNIST items (FashionRecall), 64 px')
    a('--recall-task', default='recall', choices=['recall', 'below'], help="fashion_recall's task: recall (a key's value) or below (the item below "
      "the framed one)")
    a('--recall-pairs', type=int, help="fashion_recall's key-value pairs, 1-4 (recall only; default 2)")
    a('--recall-query', choices=['other', 'same'], help="fashion_recall's query: another image of the key's class "
      "(default), or the key's own (recall only)")
    a('--data-path', help='the dataset\'s root: for imagefolder train/<class>/<image> and val/<class>/<image>')
    a('--download', action='store_true', help='download a small dataset into --data-path (torchvision)')
    a('--train-subset', type=int, help='train on this many images, a fixed random subset (the same for every seed)')
    a('--img-size', type=int, help='input side in pixels (default: the variant\'s own; on the synthetic task 32, '
      'DeiT 64, Swin with InLine windows smaller than the stage 224)')
    a('--attention-impl', choices=['fast', 'reference'], help='the InLine core: kernels.py (fast; the default) or '
      'inline.py (reference; the default for vanilla linear attention, layout L, which has no fast path)')
    a('--drop-path', type=float, help='stochastic depth rate')
    a('--finetune', help='initial weights, its EMA where it has one (e.g. the 224 px weights for a 384 px variant)')
    a('--grad-checkpoint', action='store_true', help='recompute each block in the backward: less memory, slower')
    a('--synthetic-train', type=int, help=f'synthetic training images per epoch ({SYNTHETIC["synthetic_train"]:,})')
    a('--synthetic-val', type=int, help=f'synthetic validation images ({SYNTHETIC["synthetic_val"]:,}); '
      f'fashion_recall: its training and test mosaics (20,000 and 10,000)')
    a('--epochs', type=int, help='epochs of the cosine schedule (cool-down epochs come on top)')
    a('--val-every', type=int, default=1, help='validate every this many epochs, and after the last (1)')
    a('--batch-size', type=int, help='per-process batch size (images)')
    a('--accum-steps', type=int, help='gradient accumulation steps (default: enough for the recipe\'s total batch)')
    a('--lr', type=float, help='peak learning rate per 512 images of total batch')
    a('--warmup-lr', type=float, help='learning rate at the start of warm-up, per 512 images')
    a('--min-lr', type=float, help='learning rate at the end of the cosine and in the cool-down, per 512 images')
    a('--warmup-epochs', type=float, help='linear warm-up (epochs)')
    a('--cooldown-epochs', type=int, help='epochs at --min-lr after the cosine')
    a('--weight-decay', type=float, help='AdamW weight decay (none on 1-D parameters and the model\'s exemptions)')
    a('--clip-grad', type=float, help='gradient norm clipping (0: off)')
    a('--label-smoothing', type=float)
    a('--mixup', type=float, help='Mixup alpha (0: off)')
    a('--cutmix', type=float, help='CutMix alpha (0: off)')
    a('--mixup-switch-prob', type=float, help='probability of CutMix rather than Mixup when both are on')
    a('--randaug-n', type=int, help='RandAugment operations per image (0: off)')
    a('--randaug-m', type=int, help='RandAugment magnitude, 0..10')
    a('--randaug-mstd', type=float, help='std of each operation\'s RandAugment magnitude')
    a('--color-jitter', type=float, help='colour jitter strength (used only when RandAugment is off, as in timm)')
    a('--random-erase', type=float, help='random erasing probability (random per-pixel values)')
    a('--ema-decay', type=float, help='EMA decay per optimizer step, 0: off (CSwin: 0.9996^(total batch/4096))')
    a('--amp', choices=['bf16', 'fp16', 'fp32'], help='autocast dtype (default, for training: the faster one here, '
      'default_amp: bf16 on a GPU with bf16 or a CPU with AMX, fp16 on other GPUs, on a CPU with AVX-512 BF16 alone '
      'bf16 if a probe finds it faster, else fp32; validation in fp32, as released, unless --amp is given)')
    a('--compile', action='store_true', help='torch.compile the model for training')
    a('--workers', type=int, help='data-loading processes per training process')
    a('--threads', type=int, help='CPU threads per process (default: this node\'s cores shared out among them)')
    a('--seed', type=int, help='the seed of every random stream (0)')
    a('--output-dir', help='checkpoints and metrics.jsonl (default: runs/<experiment or model>[-<overrides>]-<data>)')
    a('--resume', help=f'checkpoint to resume from (default: OUTPUT_DIR/{CHECKPOINT} if it exists)')
    a('--eval', action='store_true', help='only evaluate --checkpoint on the validation set')
    a('--checkpoint', help='weights to evaluate: ours, or the authors\' released file')
    a('--throughput', action='store_true', help='only measure inference images/s')
    return p


def print0(*args, **kwargs):
    if int(os.environ.get('RANK', 0)) == 0:
        print(*args, **kwargs, flush=True)


def fail(message):
    """Stop on bad input. Every rank checks the same arguments and files and meets the same error; rank 0 says it."""
    print0(f'error: {message}', file=sys.stderr)
    raise SystemExit(1)


# --------------------------------------------------------------------------------------------------- data
class SyntheticShapes(Dataset):
    """Ten procedurally drawn classes: five shapes at a random place, size and rotation, four stripe
    orientations and a checkerboard, each under random colours and noise. Sample i is a pure function of
    (seed, epoch, i) (train; a fresh set every epoch) or of (seed, i) (validation), so nothing needs saving."""
    classes = ['disc', 'ring', 'square', 'triangle', 'cross', 'stripes 0°', 'stripes 45°', 'stripes 90°',
               'stripes 135°', 'checkerboard']

    def __init__(self, size, img_size, seed, train):
        self.size, self.img_size, self.seed, self.train, self.epoch = size, img_size, seed, train, 0

    def __len__(self):
        return self.size

    def __getitem__(self, index):
        # hash() of a tuple of ints is the same in every process and every run
        g = torch.Generator().manual_seed(hash((self.seed, self.epoch if self.train else -1, index)) % 2**62)
        uniform = lambda: torch.rand((), generator=g).item()  # noqa: E731
        label, S = index % len(self.classes), self.img_size
        t = torch.linspace(-1 + 1 / S, 1 - 1 / S, S)  # pixel centres in [-1, 1]
        y, x = torch.meshgrid(t, t, indexing='ij')  # (S, S) each
        if label < 5:  # a shape, upright within +-15 degrees; f > 0 inside, in units of half the image side
            r, angle = 0.45 + 0.3 * uniform(), math.radians(30 * (uniform() - 0.5))
            x, y = x - (2 * uniform() - 1) * (1 - r), y - (2 * uniform() - 1) * (1 - r)
            x, y = math.cos(angle) * x + math.sin(angle) * y, -math.sin(angle) * x + math.cos(angle) * y
            d = (x ** 2 + y ** 2).sqrt()
            if label == 0:
                f = r - d
            elif label == 1:
                f = torch.minimum(r - d, d - 0.55 * r)
            elif label == 2:
                f = 0.8 * r - torch.maximum(x.abs(), y.abs())
            elif label == 3:  # equilateral triangle, pointing up: inside three half-planes at distance r/2
                f = torch.stack([r / 2 - x * math.cos(a) - y * math.sin(a)
                                 for a in (math.pi / 2, math.pi * 7 / 6, -math.pi / 6)]).amin(0)
            else:
                a = 0.3 * r  # half the width of an arm, whose length is r
                f = torch.maximum(torch.minimum(a - x.abs(), r - y.abs()), torch.minimum(a - y.abs(), r - x.abs()))
            mask = (f * S / 2 + 0.5).clamp(0, 1)  # about one pixel of anti-aliased edge
        else:  # a texture over the whole image: a grating (wave vector at 0/45/90/135° +- 10°) or a checkerboard
            period, angle = 0.25 + 0.25 * uniform(), 2 * math.pi * uniform()
            if label < 9:
                angle = math.radians(45 * (label - 5) + 20 * (uniform() - 0.5))
            u = (x * math.cos(angle) + y * math.sin(angle)) * 2 * math.pi / period + 2 * math.pi * uniform()
            v = (y * math.cos(angle) - x * math.sin(angle)) * 2 * math.pi / period + 2 * math.pi * uniform()
            mask = ((u.sin() if label < 9 else u.sin() * v.sin()) * 2 + 0.5).clamp(0, 1)
        fg = torch.rand(3, generator=g)
        bg = (fg + 0.3 + 0.4 * torch.rand(3, generator=g)) % 1  # every channel differs from fg by >= 0.3
        img = bg[:, None, None] + mask * (fg - bg)[:, None, None]  # (3, S, S)
        img = img + 0.08 * uniform() * torch.randn((3, S, S), generator=g)
        return F.normalize((img.clamp(0, 1)), MEAN, STD), label


def affine(img, shear=(0.0, 0.0), translate=(0.0, 0.0)):
    """timm's shear and translation, PIL's affine map about the top-left corner: output pixel (x, y) reads input
    (x + shear_x * y + translate_x, y + shear_y * x + translate_y). torchvision takes the shear as an angle and the
    translation as where the content moves, hence atan and the minus."""
    return F.affine(img, angle=0.0, translate=[-t for t in translate], scale=1.0, center=[0, 0], interpolation=BICUBIC,
                    shear=[math.degrees(math.atan(s)) for s in shear], fill=FILL)


def posterize(img, bits):
    """Keep each channel's top `bits` bits; 0 bits is black, which PIL's posterize refuses to compute."""
    return F.posterize(img, bits) if bits > 0 else img.point(lambda _: 0)


def solarize_add(img, add):
    """timm's SolarizeAdd: pixels below 128 brightened by `add`, saturating at 255."""
    return img.point([min(255, i + add) if i < 128 else i for i in range(256)] * len(img.getbands()))


# timm's RandAugment ops for 'inc1', on PIL images as timm's: (image, f = magnitude / 10, sign) -> image
RANDAUG_OPS = {
    'AutoContrast': lambda img, f, s: F.autocontrast(img),
    'Equalize': lambda img, f, s: F.equalize(img),
    'Invert': lambda img, f, s: F.invert(img),
    'Rotate': lambda img, f, s: F.rotate(img, s * 30 * f, BICUBIC, fill=FILL),
    'PosterizeIncreasing': lambda img, f, s: posterize(img, 4 - int(4 * f)),
    'SolarizeIncreasing': lambda img, f, s: F.solarize(img, 256 - int(256 * f)),
    'SolarizeAdd': lambda img, f, s: solarize_add(img, int(110 * f)),
    'ColorIncreasing': lambda img, f, s: F.adjust_saturation(img, 1 + s * 0.9 * f),
    'ContrastIncreasing': lambda img, f, s: F.adjust_contrast(img, 1 + s * 0.9 * f),
    'BrightnessIncreasing': lambda img, f, s: F.adjust_brightness(img, 1 + s * 0.9 * f),
    'SharpnessIncreasing': lambda img, f, s: F.adjust_sharpness(img, 1 + s * 0.9 * f),
    'ShearX': lambda img, f, s: affine(img, shear=(s * 0.3 * f, 0)),
    'ShearY': lambda img, f, s: affine(img, shear=(0, s * 0.3 * f)),
    'TranslateXRel': lambda img, f, s: affine(img, translate=(s * 0.45 * f * img.width, 0)),
    'TranslateYRel': lambda img, f, s: affine(img, translate=(0, s * 0.45 * f * img.height)),
}


class RandAugment(nn.Module):
    """timm's RandAugment 'rand-m9-mstd0.5-inc1', the released trainer's (torchvision's is another policy): each of
    num_ops operations, drawn with replacement, applied with probability 0.5 at its own magnitude."""
    def __init__(self, num_ops, magnitude, std, prob=0.5):
        super().__init__()
        self.num_ops, self.magnitude, self.std, self.prob = num_ops, magnitude, std, prob

    def forward(self, img):
        names = list(RANDAUG_OPS)
        for i in torch.randint(len(names), (self.num_ops,)).tolist():
            if torch.rand(()) < self.prob:
                m = min(max(self.magnitude + self.std * torch.randn(()).item(), 0.0), 10.0)
                img = RANDAUG_OPS[names[i]](img, m / 10, 1 if torch.rand(()) < 0.5 else -1)
        return img


def train_transform(args):
    """The released training augmentation; RandAugment works on PIL images, as timm's."""
    t = [T.RandomResizedCrop(args.img_size, interpolation=BICUBIC), T.RandomHorizontalFlip()]
    if args.randaug_n > 0:
        t.append(RandAugment(args.randaug_n, args.randaug_m, args.randaug_mstd))
    elif args.color_jitter > 0:
        t.append(T.ColorJitter(args.color_jitter, args.color_jitter, args.color_jitter))
    erase = [T.RandomErasing(args.random_erase, value='random')] if args.random_erase > 0 else []
    return T.Compose(t + TO_TENSOR + erase)


def eval_transform(img_size, crop=True):
    """The released evaluation (the authors' TEST.CROP): resize to a square of int(img * 256 / 224), aspect not
    kept, then the centre img x img; without crop (inline_swin_b_384's config) straight to img x img. Bicubic."""
    side = int(img_size * 256 / 224) if crop else img_size
    return T.Compose([T.Resize((side, side), BICUBIC), T.CenterCrop(img_size)] + TO_TENSOR)


def load_rgb(path):
    try:
        with Image.open(path) as img:
            return img.convert('RGB')
    except Exception as e:  # name the file: one bad image among a million must be findable
        raise RuntimeError(f'cannot decode image {path}: {e}') from None


def read_idx(path):
    """An IDX file (MNIST's format, gzipped or not) as a uint8 tensor: bytes 0 0 8 D, D big-endian sizes, data."""
    with (gzip.open if path.endswith('.gz') else open)(path, 'rb') as f:
        data = f.read()
    shape = struct.unpack(f'>{data[3]}I', data[4:4 + 4 * data[3]])
    return torch.frombuffer(bytearray(data[4 + 4 * data[3]:]), dtype=torch.uint8).reshape(shape)


def read_small(name, root, train):
    """(images (N, 3, H, W) uint8, grayscale as 3 equal channels; labels; class names) from the files as distributed,
    in ROOT or where torchvision's download puts them: Fashion-MNIST's IDX files, CIFAR's pickled python batches."""
    if name == 'fashion_mnist':
        for folder, ext in [(f, e) for f in (root, os.path.join(root, 'FashionMNIST', 'raw')) for e in ('.gz', '')]:
            split = 'train' if train else 't10k'
            paths = [os.path.join(folder, f'{split}-{kind}-ubyte{ext}') for kind in ('images-idx3', 'labels-idx1')]
            if all(map(os.path.exists, paths)):  # (N, 28, 28) -> (N, 3, 28, 28), a view
                return read_idx(paths[0])[:, None].expand(-1, 3, -1, -1), read_idx(paths[1]).long(), \
                    datasets.FashionMNIST.classes
    else:
        folder, files, key = (('cifar-10-batches-py', [f'data_batch_{i}' for i in range(1, 6)] if train else
                               ['test_batch'], 'label') if name == 'cifar10' else
                              ('cifar-100-python', ['train' if train else 'test'], 'fine_label'))
        folder = next((f for f in (os.path.join(root, folder), root) if os.path.exists(os.path.join(f, files[0]))), '')
        if folder:
            batches, meta = [], 'batches.meta' if name == 'cifar10' else 'meta'
            for file in files + [meta]:
                with open(os.path.join(folder, file), 'rb') as f:
                    batches.append(pickle.load(f, encoding='latin1'))
            images = torch.cat([torch.as_tensor(b['data']).reshape(-1, 3, 32, 32) for b in batches[:-1]])
            labels = torch.cat([torch.as_tensor(b[key + 's']) for b in batches[:-1]])
            return images, labels, batches[-1][key + '_names']
    fail(f'no {name} files in {root}' + (' (Debian: apt-get install dataset-fashion-mnist puts them in '
                                         '/usr/share/datasets/fashion-mnist)' if name == 'fashion_mnist' else '') +
         '; --download fetches them there')


class TensorImages(Dataset):
    """A small dataset held as one uint8 tensor (N, 3, H, W)."""
    def __init__(self, images, labels, classes, transform):
        self.images, self.labels, self.classes, self.transform = images, labels, list(classes), transform

    def __len__(self):
        return len(self.labels)

    def __getitem__(self, index):
        return self.transform(self.images[index]), int(self.labels[index])


class FashionRecall(Dataset):
    """Visual associative recall on Fashion-MNIST, a task where attention must select: pooling keeps which items a
    mosaic holds but cannot bind one to the query. Mosaic i is a pure function of (seed, split, i) (layout), drawn
    from one split's images only, so test mosaics hold test images alone.

    A 64-px mosaic of 4x4 cells of 16 px, each empty or holding one item at 14 px, one cell framed (its 1-px border
    lit). task 'recall': `pairs` (1-4, default 2) key-value pairs, each key right above its value, in cells at
    random; key classes distinct, value classes distinct; the framed query cell holds another image of one key's
    class (query='same': the key's own image), and the label is that key's value's class. task 'below': every cell
    filled, the framed item in row 1 and the label the class of the item right below it, in row 2.
    No augmentation: a flip or a crop would move the roles."""
    classes = datasets.FashionMNIST.classes
    PAIRS, QUERY = 2, 'other'  # recall's defaults (default_output_dir names them too)

    def __init__(self, images, labels, size, seed, train, task='recall', pairs=None, query=None):
        if task == 'below' and (pairs, query) != (None, None):
            fail(f"fashion_recall: task 'below' fills every cell and has no query; pairs and query are recall's "
                 f"(got pairs {pairs!r}, query {query!r})")
        pairs, query = (pairs or self.PAIRS, query or self.QUERY) if task == 'recall' else (pairs, query)
        if task not in ('recall', 'below') or task == 'recall' and (query not in ('other', 'same') or not 1 <= pairs <= 4):
            fail(f"fashion_recall: task is 'recall' or 'below'; recall's query 'other' or 'same', its pairs 1 to 4 (4 "
                 f"pairs always fit the 4x4 cells); got {task!r}, {query!r}, {pairs!r}")
        self.size, self.seed, self.train, self.task, self.pairs, self.query = size, seed, train, task, pairs, query
        items = F.resize(images[:, :1], [14, 14], antialias=True)  # (N, 1, 14, 14) uint8: one channel of the gray
        self.items, self.labels = items[:, 0], labels
        self.by_class = [torch.nonzero(labels == c).flatten() for c in range(len(self.classes))]
        self.to_tensor = T.Compose(TO_TENSOR)

    def __len__(self):
        return self.size

    def layout(self, index):
        """(classes (4, 4): each cell's item class, -1 if empty; roles (4, 4) of 'key', 'value', 'query', 'item',
        'framed', 'below', 'decoy' or ''; images (4, 4): the source image of each cell, -1 if empty; the label)."""
        g = torch.Generator().manual_seed(hash((self.seed, self.train, index)) % 2**62)
        pick = lambda n, k: torch.randperm(n, generator=g)[:k].tolist()  # noqa: E731  k distinct of range(n)
        image = lambda c: int(self.by_class[c][torch.randint(len(self.by_class[c]), (), generator=g)])  # noqa: E731
        classes, roles, images = [[-1] * 4 for _ in range(4)], [[''] * 4 for _ in range(4)], [[-1] * 4 for _ in range(4)]

        def put(cell, c, role, source=None):
            (r, col) = cell
            classes[r][col], roles[r][col], images[r][col] = c, role, image(c) if source is None else source
        if self.task == 'below':
            # Without attention (the phi = 0 floor: patch merges, MLPs, means over the stage) a network sees the four
            # 2x2-cell blocks that stage 4 merges as a set, each block knowing its cells' slots within it: it finds
            # the framed item's slot, hence the label's (row 0 of a block, the framed item's column in it), but not
            # which of the other three blocks lies below. Those three cells ('below' and two 'decoy's) hold distinct
            # classes and the rest are drawn alike, so the floor can do no better than 1 in 3.
            col = pick(4, 1)[0]
            kinds = pick(10, 4)  # the framed item's, the label's and the decoys' classes, distinct
            put((1, col), kinds[0], 'framed')
            put((2, col), kinds[1], 'below')
            put((0, col ^ 2), kinds[2], 'decoy')  # col ^ 2: the same column within the other half
            put((2, col ^ 2), kinds[3], 'decoy')
            for r, c in (divmod(i, 4) for i in range(16)):
                if classes[r][c] < 0:
                    put((r, c), int(torch.randint(10, (), generator=g)), 'item')
            return classes, roles, images, kinds[1]
        tops = [divmod(i, 4) for i in pick(12, 12)]  # key cells in rows 0-2, so the value below fits
        keys = []
        for top in tops:  # the first `pairs` that do not overlap: each blocks at most 3 tops, so 4 always fit
            if len(keys) < self.pairs and all(top != k and top != (k[0] + 1, k[1]) and (top[0] + 1, top[1]) != k
                                              for k in keys):
                keys.append(top)
        key_classes, value_classes = pick(10, self.pairs), pick(10, self.pairs)
        for (r, col), kc, vc in zip(keys, key_classes, value_classes):
            put((r, col), kc, 'key')
            put((r + 1, col), vc, 'value')
        asked = pick(self.pairs, 1)[0]
        free = [divmod(i, 4) for i in pick(16, 16) if classes[i // 4][i % 4] < 0]
        r, col = keys[asked]
        source = images[r][col]
        while self.query == 'other' and source == images[r][col] and len(self.by_class[key_classes[asked]]) > 1:
            source = image(key_classes[asked])  # another image of the key's class
        put(free[0], key_classes[asked], 'query', source)
        return classes, roles, images, value_classes[asked]

    def __getitem__(self, index):
        classes, roles, images, label = self.layout(index)
        mosaic = torch.zeros(64, 64, dtype=torch.uint8)
        for r in range(4):
            for col in range(4):
                if images[r][col] >= 0:
                    mosaic[16 * r + 1:16 * r + 15, 16 * col + 1:16 * col + 15] = self.items[images[r][col]]
                if roles[r][col] in ('query', 'framed'):
                    cell = mosaic[16 * r:16 * r + 16, 16 * col:16 * col + 16]
                    cell[[0, -1], :], cell[:, [0, -1]] = 255, 255
        return self.to_tensor(mosaic.expand(3, -1, -1)), label


def load_data(args):
    """(training set, validation set): the synthetic task; ROOT/train and ROOT/val as ImageFolders with the
    released transforms; or a small dataset's training and test sets, --train-subset of the training images."""
    if args.dataset == 'synthetic':
        train_set = SyntheticShapes(args.synthetic_train, args.img_size, args.seed, train=True)
        val_set = SyntheticShapes(args.synthetic_val, args.img_size, args.seed, train=False)
        print0(f'data: synthetic, {len(val_set.classes)} classes ({", ".join(val_set.classes)}), {args.img_size} '
               f'px, {len(train_set):,} fresh training images per epoch, {len(val_set):,} validation images')
        return train_set, val_set
    found, root = [], args.data_path
    if args.dataset == 'fashion_recall':
        options = dict(task=args.recall_task, pairs=args.recall_pairs, query=args.recall_query)
        # training mosaics by the run's seed; the test mosaics the same for every run (seed 0), so that the per-image
        # results of runs of different seeds are on the same images (paper.py's intervals pair them)
        found = [FashionRecall(*read_small('fashion_mnist', root or 'data', train)[:2], size, args.seed if train else 0,
                               train, **options)
                 for train, size in ((True, args.synthetic_train or 20_000), (False, args.synthetic_val or 10_000))]
    elif args.dataset in SMALL_DATASETS:
        root = root or 'data'
        if args.download:  # torchvision fetches every split's files at once
            SMALL_DATASETS[args.dataset](root, download=True)
        # the small-image recipe: resized, then (training) randomly cropped with an eighth of padding and flipped
        resize = [T.ToImage(), T.Resize((args.img_size, args.img_size), BICUBIC, antialias=True)]
        augment = [T.RandomCrop(args.img_size, padding=args.img_size // 8, padding_mode='reflect'),
                   T.RandomHorizontalFlip()]
        found = [TensorImages(*read_small(args.dataset, root, train), T.Compose(transform + TO_TENSOR))
                 for train, transform in ((True, resize + augment), (False, resize))]
    else:
        for split in ('train', 'val'):
            if not os.path.isdir(os.path.join(root, split)):
                fail(f'--data-path {root} has no {split}/ folder (expected {split}/<class>/<image> inside)')
        for split, transform in (('train', train_transform(args)),
                                 ('val', eval_transform(args.img_size, args.model not in NO_EVAL_CROP))):
            try:
                found.append(datasets.ImageFolder(os.path.join(root, split), transform, loader=load_rgb))
            except FileNotFoundError as e:
                fail(f'no images in {os.path.join(root, split)}: {e}')
    train_set, val_set = found
    if train_set.classes != val_set.classes:
        fail(f'train/ has {len(train_set.classes)} classes and val/ has {len(val_set.classes)}; they must match')
    if args.train_subset and args.train_subset < len(train_set):
        train_set, train_set.classes = Subset(train_set, subset_indices(len(train_set), args.train_subset)), \
            train_set.classes
    print0(f'data: {args.dataset} in {root}, {len(train_set.classes)} classes, {len(train_set):,} training and '
           f'{len(val_set):,} validation images, {args.img_size} px')
    return train_set, val_set


def subset_indices(total, size):
    """--train-subset's images: the first `size` of one fixed random order of the `total` (the same whatever
    --seed, and a larger subset holds every smaller one)."""
    return torch.randperm(total, generator=torch.Generator().manual_seed(0))[:size].tolist()


class ResumableSampler(DistributedSampler):
    """DistributedSampler that can skip the first `start` samples of an epoch (resuming after SIGTERM)."""
    start = 0

    def __iter__(self):
        return iter(list(super().__iter__())[self.start:])

    def __len__(self):
        return super().__len__() - self.start


# ---------------------------------------------------------------------------------------- resolving a run
@dataclass
class Run:
    """What every part of a run shares: the resolved flags, where it runs, and the checkpoint it starts from."""
    args: argparse.Namespace
    rank: int = 0
    world: int = 1
    device: torch.device = torch.device('cpu')
    total_batch: int = 0  # images per optimizer step
    amp_given: bool = False  # --amp on the command line: validation uses it too
    amp_why: str = ''  # why args.amp: 'given by --amp', or default_amp's reason
    arch: dict = None  # the model's create_model overrides besides RUN_KEYS (models' model.arch)
    name: str = ''  # the experiment or model and the overrides beyond its own, short: the output folder's name
    saved: dict = None  # --eval's checkpoint, or the one to resume from
    saved_path: str = None

    def autocast(self, training):
        """Training in --amp's dtype; validation in fp32, as the authors validated, unless --amp was given."""
        dtype = {'bf16': torch.bfloat16, 'fp16': torch.float16}.get(self.args.amp)  # None: fp32
        return torch.autocast(self.device.type, dtype, enabled=dtype is not None and (training or self.amp_given))


def model_kwargs(args):
    """--model-kwargs KEY=VALUE ... and the named architecture flags given, as create_model overrides."""
    kwargs = {}
    for item in args.model_kwargs or []:
        key, sep, value = item.partition('=')
        if not sep or not key.isidentifier():
            fail(f'--model-kwargs takes KEY=VALUE pairs (e.g. depths=(1,1,2,1) embed_dim=48), not {item!r}')
        if key in RUN_KEYS:
            fail(f'--model-kwargs {key}: train.py sets it; use --{RUN_KEYS[key]}')
        try:
            kwargs[key] = ast.literal_eval(value)
        except (ValueError, SyntaxError):  # not a Python literal: a string such as layout=IISS
            kwargs[key] = value
    return {**kwargs, **{k: getattr(args, k) for k in ARCH_FLAGS if getattr(args, k) is not None}}


def resolve_architecture(run):
    """The model and its create_model overrides (run.arch): --experiment's, under which the flags given win; and
    run.name, the output folder's name without the data."""
    args = run.args
    if args.experiment is not None and args.experiment not in models.EXPERIMENTS:
        fail(f'unknown experiment {args.experiment}; choose one of {", ".join(models.EXPERIMENTS)}')
    experiment = models.EXPERIMENTS.get(args.experiment)
    base, flags = (experiment.overrides if experiment else {}), model_kwargs(args)
    say = print0 if (run.saved or {}).get('arch') is None else lambda _: None  # not again for a checkpoint's flags
    won = [f'{k}={v!r} (its {base[k]!r})' for k, v in flags.items() if base.get(k, v) != v]
    if won:
        say(f'the flags given win over experiment {args.experiment}: {", ".join(won)}')
    run.arch = {**base, **flags}
    args.model = args.model or (experiment.model if experiment else 'inline_swin_t')
    name = args.experiment or args.model
    if experiment and args.model != experiment.model:
        say(f'--model {args.model} wins over experiment {args.experiment}\'s {experiment.model}')
        name += f'-{args.model}'
    summary = [re.sub(r'[^\w.]+', '', f'{k}{".".join(map(str, v)) if isinstance(v, (tuple, list)) else v}')
               for k, v in sorted(run.arch.items()) if k not in base or base[k] != v]
    run.name = '-'.join([name] + summary)


def dataset(args):
    """--dataset, or what --data-path implies: an ImageFolder with it, the synthetic task without."""
    return args.dataset or ('imagefolder' if args.data_path else 'synthetic')


def default_output_dir(run):
    """runs/<experiment or model>[-<overrides beyond its own>]-<data>: two ablations never resume into each other."""
    data = dataset(run.args)
    data = os.path.basename(os.path.normpath(run.args.data_path)) if data == 'imagefolder' else data
    if data == 'fashion_recall':  # another task is another run
        a = run.args
        data += ('-below' if a.recall_task == 'below' else
                 f'-recall{a.recall_pairs or FashionRecall.PAIRS}-{a.recall_query or FashionRecall.QUERY}')
    return os.path.join('runs', f'{run.name}-{data}')


def open_checkpoint(run):
    """The one way in for the checkpoint a run starts from, read once: --checkpoint (--eval), --resume FILE, else
    OUTPUT_DIR/checkpoint.pt where it exists. Its saved arguments fill the flags left unset, and another model or
    architecture than the flags ask for is refused; the authors' files save neither, and are taken as the flags say."""
    args = run.args
    path = args.checkpoint or args.resume
    if path is None:  # where this command's flags put its output folder
        resolve_architecture(run)
        args.output_dir = args.output_dir or default_output_dir(run)
        path = os.path.join(args.output_dir, CHECKPOINT)
        if args.eval or not os.path.exists(path):
            return
    run.saved, run.saved_path = read_checkpoint(path), path
    saved_args, saved_arch = run.saved.get('args'), run.saved.get('arch')
    if args.eval and args.data_path is None and (saved_args is None or saved_args['data_path'] is not None):
        fail(f'--eval of {path} needs --data-path DIR: only checkpoints of our synthetic runs evaluate without data')
    if saved_args and args.model not in (None, saved_args['model']):
        fail(f'{path} is a checkpoint of {saved_args["model"]}, not of --model {args.model}')
    mine = INVOCATION + ('data_path',) * args.eval  # an eval's data is its own
    for key, value in (saved_args or {}).items():  # a resumed run goes on as it was, an eval sees what it saw
        if getattr(args, key, False) is None and key not in mine:
            setattr(args, key, value)
    resolve_architecture(run)
    # the saved model.arch, less what train.py sets for the run (image size, classes, drop path)
    saved_arch = {k: v for k, v in saved_arch.items() if k not in RUN_KEYS} if saved_arch is not None else run.arch
    differ = sorted(k for k in {**saved_arch, **run.arch} if saved_arch.get(k) != run.arch.get(k))
    if differ:
        fail(f'{path} holds a model built with {saved_arch}; this run asks for ' +
             ', '.join(f'{k}={run.arch[k]!r}' if run.arch.get(k) is not None else f'no {k}' for k in differ) +
             f'. They differ in {", ".join(differ)}: leave the architecture flags out to continue or evaluate the '
             'model as it was built, or give another --output-dir')


def resolve(run):
    """Fill every flag left unset, from the checkpoint the run starts from, then from the recipe: VARIANTS on an
    ImageFolder (ImageNet), SMALL on a small dataset, else SYNTHETIC; set the total batch."""
    open_checkpoint(run)  # which resolves the architecture
    args = run.args
    args.dataset = dataset(args)
    synthetic, imagenet = args.dataset == 'synthetic', args.dataset == 'imagefolder'  # small datasets: neither
    family = args.model.split('_')[1]  # registry names are inline_<family>_<size>
    recipe = {**RELEASED, **dict(zip(COLUMNS, VARIANTS[args.model]))} if imagenet else SYNTHETIC if synthetic else SMALL
    if synthetic and args.img_size is None and not args.throughput and (run.arch.get('window') or 56) < 56:
        recipe = SYNTHETIC_WINDOWED
    for key, value in {**recipe, 'seed': 0}.items():
        if getattr(args, key) is None:
            setattr(args, key, value)
    if args.img_size is None and (imagenet or args.throughput):
        with torch.device('meta'):  # the variant's own size; on the meta device a model costs no memory
            args.img_size = models.create_model(args.model).img_size[0]  # (H, W); the released sizes are square
    if args.img_size is None:  # DeiT's 16 px patches: a 4x4 token grid; fashion_recall's mosaics are 64 px
        args.img_size = 64 if family == 'deit' or args.dataset == 'fashion_recall' else 32
    if args.accum_steps is None:
        wanted = recipe['batch_size'] * PROCESSES  # the released total batch
        args.accum_steps = 1 if not imagenet else max(1, round(wanted / args.batch_size / run.world))
    run.total_batch = args.batch_size * run.world * args.accum_steps
    if args.ema_decay is None:
        args.ema_decay = 0.9996 ** (run.total_batch / 4096) if family in EMA_FAMILIES and imagenet else 0.0
    if args.attention_impl is None:  # kernels.enable_fast refuses a model with linear attention: it has no fast path
        args.attention_impl = 'reference' if 'L' in str(run.arch.get('layout', '')) else 'fast'
    run.amp_given = args.amp is not None
    amp = [(args.amp, 'given by --amp') if run.amp_given else default_amp(run.device)]
    if dist.is_initialized():  # rank 0's, which a probe may have measured: every rank in the same precision
        dist.broadcast_object_list(amp)
    args.amp, run.amp_why = amp[0]
    if args.workers is None:
        args.workers = 0 if not imagenet else min(8, cpu_count() // int(os.environ.get('LOCAL_WORLD_SIZE', 1)))
    args.output_dir = args.output_dir or default_output_dir(run)
    check_args(args)


def default_amp(device):
    """(--amp's default, the fact it rests on): bf16 where it is faster than fp32, else fp16 on CUDA, else fp32."""
    if device.type == 'cuda':  # emulated bf16 (before Ampere) is slower: fp16 there, with the loss scaler
        bf16, gpu = torch.cuda.is_bf16_supported(including_emulation=False), torch.cuda.get_device_name(device)
        return ('bf16', f'{gpu} computes bf16') if bf16 else ('fp16', f'{gpu} has no bf16 (fp16, with the loss scaler)')
    if getattr(torch.cpu, '_is_amx_tile_supported', lambda: False)():  # private functions, so guarded
        return 'bf16', 'this CPU has AMX, where bf16 is faster than fp32'
    if not getattr(torch.cpu, '_is_avx512_bf16_supported', lambda: False)():
        return 'fp32', 'this CPU has no AMX or AVX-512 BF16, where bf16 would be emulated'
    x = bf16_speedup()  # AVX-512 BF16 alone decides nothing: bf16 trained 2x faster on one such CPU, slower on another
    why = f'this CPU has AVX-512 BF16 but no AMX; bf16 ran {x:.1f}x the speed of fp32 in a 1-thread probe, 1.25x needed'
    return ('bf16' if x >= 1.25 else 'fp32'), why  # 1.25: a whole training step gains less than the probe


@functools.cache
def bf16_speedup(rounds=7):
    """fp32 time / bf16 time of a transformer MLP's training step (LayerNorm, 128 -> 512 -> 128, 2048 tokens): median of
    interleaved rounds, one thread, process CPU time (two threads on a shared machine scattered it). ~0.5 s, once."""
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
    for name, ok, allowed in (('batch_size', args.batch_size >= 1, '>= 1'), ('lr', 0 < args.lr <= 1, 'in (0, 1]'),
                              ('min_lr', 0 <= args.min_lr <= args.lr, 'in [0, --lr]'),
                              ('warmup_lr', 0 <= args.warmup_lr <= args.lr, 'in [0, --lr]'),
                              ('epochs', args.epochs >= 1, '>= 1'), ('accum_steps', args.accum_steps >= 1, '>= 1'),
                              ('weight_decay', args.weight_decay >= 0, '>= 0'),
                              ('label_smoothing', 0 <= args.label_smoothing < 1, 'in [0, 1)'),
                              ('ema_decay', 0 <= args.ema_decay < 1, 'in [0, 1)'),
                              ('random_erase', 0 <= args.random_erase <= 1, 'in [0, 1]')):
        if not ok:
            fail(f'--{name.replace("_", "-")} {getattr(args, name)} is out of range: it must be {allowed}')
    if args.dataset == 'fashion_recall' and args.img_size != 64:
        fail(f'--dataset fashion_recall makes 64 px mosaics of 4x4 cells; --img-size {args.img_size} would resample '
             f'them: leave it unset or give 64')


def setup(args):
    """Rank, world size and device from torchrun's environment (a plain `python train.py` is rank 0 of 1); the
    checkpoint to start from; every flag resolved."""
    rank, world, local_rank = (int(os.environ.get(k, 0)) for k in ('RANK', 'WORLD_SIZE', 'LOCAL_RANK'))
    run = Run(args, rank, max(world, 1))
    local, gpus = int(os.environ.get('LOCAL_WORLD_SIZE', 1)), torch.cuda.device_count()
    if torch.cuda.is_available() and local > gpus:  # checked before any process touches a GPU
        if local_rank == 0:  # one message per node: the node's count is what is wrong
            print(f'error: torchrun started {local} processes on this node, which has {gpus} GPU(s); launch at most '
                  f'{gpus} with --nproc-per-node={gpus}', file=sys.stderr, flush=True)
        raise SystemExit(1)
    if torch.cuda.is_available():
        run.device = torch.device('cuda', local_rank)
        torch.cuda.set_device(run.device)
        torch.backends.cuda.matmul.allow_tf32 = torch.backends.cudnn.allow_tf32 = True  # for --amp fp32
    else:
        torch.set_num_threads(args.threads or max(1, cpu_count() // local))
    if run.world > 1:
        dist.init_process_group('nccl' if run.device.type == 'cuda' else 'gloo')
    if args.eval != bool(args.checkpoint):  # each needs the other
        fail('--eval needs --checkpoint FILE' if args.eval else
             '--checkpoint is for --eval; continue training with --resume, start from weights with --finetune')
    resolve(run)
    print0(f'args: {json.dumps(vars(args))}')
    return run


# ---------------------------------------------------------------------------------- model and optimizer
def build_model(run, num_classes):
    """The variant at the run's image size and drop path, with the fast core unless --attention-impl reference."""
    args = run.args
    if run.saved and run.saved.get('num_classes', num_classes) != num_classes:
        fail(f'{run.saved_path} has {run.saved["num_classes"]} classes; the data has {num_classes}')
    overrides = dict(run.arch, img_size=args.img_size, drop_path_rate=args.drop_path)
    torch.manual_seed(args.seed)  # the same initial weights on every rank
    try:
        model = models.create_model(args.model, num_classes=num_classes, **overrides)
    except (ValueError, TypeError) as e:
        fail(f'cannot build {args.model} with {overrides}: {e}')
    if args.attention_impl == 'fast':  # checked against the reference on the run's device, before any step
        try:
            import kernels
            kernels.enable_fast(model, device=run.device, log=print0)
        except ImportError as e:
            fail(f'the fast attention path is unavailable ({e}); pass --attention-impl reference')
        except ValueError as e:
            fail(str(e))
    if args.finetune:  # the authors' 384 px fine-tunes start from the 224 px weights, the EMA where there is one
        saved = read_checkpoint(args.finetune)
        key = next((k for k in models.EMA_KEYS if saved.get(k) is not None), 'model')
        load_weights(model, saved, key, args.finetune)
        print0(f'initial weights: {args.finetune} ({key})')
    model.set_grad_checkpointing(args.grad_checkpoint)
    print0(f'model: {args.model}, {sum(p.numel() for p in model.parameters()) / 1e6:.1f}M parameters, {args.img_size} '
           f'px, attention {args.attention_impl}, amp {args.amp} ({run.amp_why}), device {run.device} x {run.world}')
    if args.experiment:
        e = models.EXPERIMENTS[args.experiment]
        print0(f'experiment: {args.experiment} ({e.table}, reported {e.reported}{", our construction" * e.ours}): '
               f'{e.what}')
    print0(f'architecture: {models.describe(model)}; overrides {model.arch}')
    return model.to(run.device)


def build_optimizer(model, args, total_batch, steps_per_epoch):
    """(AdamW, its per-step schedule): no weight decay on 1-D parameters (biases, norms) and the model's
    no_weight_decay() names; a cosine to --min-lr whose start a linear warm-up replaces, then --cooldown-epochs at
    --min-lr, as timm's CosineLRScheduler ran in the released trainer."""
    skip = model.no_weight_decay()
    decay, no_decay = [], []
    for name, param in model.named_parameters():
        if param.requires_grad:
            (no_decay if param.ndim <= 1 or name in skip or name.split('.')[-1] in skip else decay).append(param)
    groups = [{'params': decay, 'weight_decay': args.weight_decay}, {'params': no_decay, 'weight_decay': 0.0}]
    # the rates are given per 512 images and scale linearly with the total batch, as the released trainer's
    peak, warmup_lr, min_lr = (lr * total_batch / 512 for lr in (args.lr, args.warmup_lr, args.min_lr))
    optimizer = torch.optim.AdamW(groups, lr=peak, betas=(0.9, 0.999), eps=1e-8, fused=True)
    warmup, total = round(args.warmup_epochs * steps_per_epoch), args.epochs * steps_per_epoch

    def lr_at(step):
        if step < warmup:
            return warmup_lr + (peak - warmup_lr) * step / warmup
        if step >= total:
            return min_lr
        return min_lr + 0.5 * (peak - min_lr) * (1 + math.cos(math.pi * step / total))
    return optimizer, torch.optim.lr_scheduler.LambdaLR(optimizer, lambda step: lr_at(step) / peak)


# ----------------------------------------------------------------------------------------- files, ranks
def cpu_count():
    return len(os.sched_getaffinity(0)) if hasattr(os, 'sched_getaffinity') else os.cpu_count() or 1


def link_atomic(src, dst):
    """dst becomes the same file as src (a hard link, or a copy where links are unsupported), atomically."""
    if os.path.exists(dst) and os.path.samefile(src, dst):  # renaming a link onto itself would leave dst.tmp
        return
    with contextlib.suppress(FileNotFoundError):
        os.remove(dst + '.tmp')
    try:
        os.link(src, dst + '.tmp')
    except OSError:
        shutil.copyfile(src, dst + '.tmp')
    os.replace(dst + '.tmp', dst)


def read_checkpoint(path):
    """models.read_checkpoint (weights only, never code from the file), its refusals said once, by rank 0."""
    try:
        return models.read_checkpoint(path)
    except (FileNotFoundError, ValueError) as e:  # no file; Python objects besides weights, with the line to strip them
        fail(str(e))
    except Exception as e:
        fail(f'cannot read checkpoint {path}: {e}')


def load_weights(model, saved, key, path):
    """saved[key] (the whole of saved for a bare state dict) into model, with models.load_checkpoint's checks."""
    try:
        models.load_checkpoint(model, saved.get(key, saved))
    except RuntimeError as e:
        fail(f'cannot load {path} ({key}): {e}')


# --------------------------------------------------------------------------------------- train and eval
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
    step: int = 0  # optimizer steps already done in it (non-zero only after SIGTERM)
    best_acc: float = -1.0
    log: list = field(default_factory=list)


def train_one_epoch(run, t, loader, epoch, stop):
    """One pass over the loader; returns (mean loss, images/s, optimizer steps done, stopped by SIGTERM)."""
    args, device = run.args, run.device
    t.model.train()
    bar = tqdm(total=t.steps_per_epoch - t.step, desc=f'epoch {epoch + 1}/{args.epochs + args.cooldown_epochs}',
               leave=False, disable=run.rank != 0, mininterval=1.0, dynamic_ncols=True)
    losses, step, micro_loss, speed, stopped, start = [], 0, 0.0, 0.0, False, time.perf_counter()
    for i, (x, y) in enumerate(loader):
        if step == t.steps_per_epoch - t.step:  # the last incomplete accumulation group is dropped
            break
        x, y = x.to(device, non_blocking=True), y.to(device, non_blocking=True)
        if t.mix is not None:
            x, y = t.mix(x, y)  # y becomes (B, classes) soft targets
        last_micro = (i + 1) % args.accum_steps == 0
        with t.model.no_sync() if run.world > 1 and not last_micro else contextlib.nullcontext():
            with run.autocast(training=True):
                loss = t.criterion(t.model(x), y) / args.accum_steps
            t.scaler.scale(loss).backward()
        micro_loss += loss.item()
        if not last_micro:
            continue
        # one small all-reduce per step: the mean loss, and whether any rank saw a bad loss or a SIGTERM
        flags = torch.tensor([micro_loss, not math.isfinite(micro_loss), stop.is_set()], device=device)
        if run.world > 1:
            dist.all_reduce(flags)
        if flags[1] > 0:
            latest = os.path.join(args.output_dir, CHECKPOINT)
            kept = f'the last good checkpoint, {latest}, is untouched' if os.path.exists(latest) else 'nothing saved'
            bar.close()
            fail(f'the loss is not finite ({micro_loss}) at epoch {epoch + 1}, step {t.step + step + 1}; stopped, '
                 f'{kept}. Try a lower --lr, --clip-grad, or --amp fp32.')
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
        bar.set_postfix(loss=f'{losses[-1]:.3f}', lr=f'{t.scheduler.get_last_lr()[0]:.2e}', img_s=f'{speed:.0f}',
                        refresh=False)
        bar.update()
        if stopped := flags[2].item() > 0:
            break
    bar.close()
    return sum(losses) / max(len(losses), 1), speed, step, stopped


@torch.no_grad()
def evaluate(run, model, loader):
    """Loss, top-1 and top-5 over the whole validation set, and which images top-1 got right (pack_correct, in the
    validation set's own order); each rank holds a disjoint slice, summed here."""
    model.eval()
    totals = torch.zeros(4, dtype=torch.float64, device=run.device)  # loss sum, top-1 hits, top-5 hits, images
    rights = []  # top-1 right or not, image by image in the loader's order
    for x, y in loader:
        x, y = x.to(run.device, non_blocking=True), y.to(run.device, non_blocking=True)
        with run.autocast(training=False):
            logits = model(x).float()
        hits = logits.topk(min(5, logits.shape[1]), dim=1).indices == y[:, None]  # (B, 5): the top 5 against y
        rights.append(hits[:, 0].int())
        totals += torch.stack([nn.functional.cross_entropy(logits, y, reduction='sum').double(),
                               hits[:, 0].sum().double(), hits.any(1).sum().double(), totals.new_tensor(len(y))])
    correct = torch.zeros(len(loader.dataset.dataset), dtype=torch.int32, device=run.device)  # (images,)
    if rights:  # a rank of more ranks than images has none: it adds zeros
        correct[torch.as_tensor(loader.dataset.indices, device=run.device)] = torch.cat(rights)  # val_loader's Subset
    if run.world > 1:
        dist.all_reduce(totals)
        dist.all_reduce(correct)
    loss, top1, top5, n = totals.tolist()
    return {'loss': loss / n, 'acc1': 100 * top1 / n, 'acc5': 100 * top5 / n, 'images': int(n),
            'correct': pack_correct(correct.cpu())}


def pack_correct(correct):
    """Per-image right (1) or wrong (0), in a fixed image order, as base64 text, 8 images to a byte, the first in
    the lowest bit: 10,000 images in 1,668 characters. unpack_correct reads it back."""
    bits = nn.functional.pad(correct.to(torch.uint8), (0, -len(correct) % 8)).view(-1, 8)  # (bytes, 8)
    return base64.b64encode(bytes((bits << torch.arange(8, dtype=torch.uint8)).sum(1, dtype=torch.uint8).tolist())
                            ).decode()


def unpack_correct(text, images):
    """pack_correct's text back to a bool tensor of `images` entries."""
    data = torch.frombuffer(bytearray(base64.b64decode(text)), dtype=torch.uint8)
    return ((data[:, None] >> torch.arange(8, dtype=torch.uint8)) & 1).flatten()[:images].bool()


def val_loader(run, val_set):
    """Every validation image exactly once across ranks: rank r takes images r, r + world, ... (no padding)."""
    subset = Subset(val_set, range(run.rank, len(val_set), run.world))
    return DataLoader(subset, run.args.batch_size, num_workers=run.args.workers,
                      pin_memory=run.device.type == 'cuda', generator=torch.Generator())


def evaluate_checkpoint(run, model, val_set):
    """--eval: the file's weights, then its EMA weights where it has them (ours or the authors' CSwin)."""
    loader = val_loader(run, val_set)
    for key in ('model', *(k for k in models.EMA_KEYS if run.saved.get(k) is not None)):
        load_weights(model, run.saved, key, run.saved_path)
        result = evaluate(run, model, loader)
        print0(f'eval {"model" if key == "model" else "ema"}: {json.dumps(readable(result))}')
    if run.saved.get('log'):
        print0('logged when saved: ' + json.dumps(readable(run.saved['log'][-1])))


def readable(entry):
    """A result or log entry with its per-image results (pack_correct: 8,336 characters for ImageNet's 50,000) as
    their SHA-256, 16 hex digits: enough to tell two evaluations apart."""
    return {k + ('_sha256' if k.endswith('correct') else ''): hashlib.sha256(v.encode()).hexdigest()[:16]
            if k.endswith('correct') else v for k, v in entry.items()}


@torch.no_grad()
def measure_throughput(run, model, warmup=10, timed=30):
    """Inference images/s on random input: `warmup` batches (compilation included), then `timed` batches."""
    args = run.args
    model.eval()
    x = torch.randn(args.batch_size, 3, args.img_size, args.img_size, device=run.device)
    sync = torch.cuda.synchronize if run.device.type == 'cuda' else lambda: None
    for i in range(warmup + timed):
        if i == warmup:
            sync()
            start = time.perf_counter()
        with run.autocast(training=True):
            model(x)
    sync()
    speed = timed * args.batch_size / (time.perf_counter() - start)
    print0(f'throughput: {speed:.1f} images/s (one process, batch {args.batch_size}, {args.img_size} px, {args.amp})')


def prepare_training(run, raw, train_set):
    """The sampler, loader, optimizer, schedule, scaler, EMA, Mixup/CutMix and loss, restored from the checkpoint
    to resume; the recipe and the schedule they run, printed."""
    args, num_classes = run.args, len(train_set.classes)
    sampler = ResumableSampler(train_set, run.world, run.rank, shuffle=True, seed=args.seed, drop_last=True)
    loader = DataLoader(train_set, args.batch_size, sampler=sampler, num_workers=args.workers, drop_last=True,
                        pin_memory=run.device.type == 'cuda', generator=torch.Generator())
    steps_per_epoch = len(loader) // args.accum_steps
    if steps_per_epoch == 0:
        fail(f'--batch-size {args.batch_size} x {run.world} processes x {args.accum_steps} accumulation steps exceeds '
             f'the {len(train_set):,} training images')
    optimizer, scheduler = build_optimizer(raw, args, run.total_batch, steps_per_epoch)
    model = torch.compile(raw) if args.compile else raw
    if run.world > 1:
        model = DDP(model, device_ids=[run.device.index] if run.device.type == 'cuda' else None)
    scaler = torch.amp.GradScaler(run.device.type, enabled=args.amp == 'fp16')
    ema = AveragedModel(raw, multi_avg_fn=get_ema_multi_avg_fn(args.ema_decay)) if args.ema_decay > 0 else None
    criterion = nn.CrossEntropyLoss(label_smoothing=args.label_smoothing)
    mixup = T.MixUp(alpha=args.mixup, num_classes=num_classes) if args.mixup > 0 else None
    cutmix = T.CutMix(alpha=args.cutmix, num_classes=num_classes) if args.cutmix > 0 else None
    mix = (T.RandomChoice([mixup, cutmix], p=[1 - args.mixup_switch_prob, args.mixup_switch_prob])  # one per batch
           if mixup and cutmix else mixup or cutmix)  # soft targets, which the criterion takes as they are
    t = Training(model, raw, optimizer, scheduler, scaler, ema, mix, criterion, steps_per_epoch)
    if run.saved is not None:
        resume(run, t)
    else:
        torch.manual_seed(args.seed + run.rank)  # augmentation, Mixup/CutMix and drop path differ between ranks
    recipe = {'synthetic': 'synthetic (no Mixup/CutMix/RandAugment/erasing; --data-path gives the released recipe)',
              'imagefolder': f'released ImageNet-1K recipe for {args.model}',
              'fashion_recall': 'small-image recipe without its crop and flip, which would move the roles'}.get(
        args.dataset, f'small-image recipe for {args.dataset} (random crop padded by {args.img_size // 8} px, flip)')
    print0(f'recipe: {recipe}; mixup {args.mixup}, cutmix {args.cutmix}, randaug {args.randaug_n}x{args.randaug_m}, '
           f'erase {args.random_erase}, label smoothing {args.label_smoothing}, drop path {args.drop_path}, '
           f'clip {args.clip_grad}, ema {args.ema_decay:.6g}')
    print0(f'schedule: {args.epochs + args.cooldown_epochs} epochs ({args.epochs} cosine with {args.warmup_epochs} '
           f'of warm-up, then {args.cooldown_epochs} cool-down) x {steps_per_epoch} steps of {run.total_batch} images '
           f'({args.batch_size} per process x {run.world} processes x {args.accum_steps} accumulation steps); '
           f'peak lr {scheduler.base_lrs[0]:.3g}, weight decay {args.weight_decay}')
    return t, sampler, loader


def resume(run, t):
    """Continue exactly where the checkpoint stopped: weights, optimizer, schedule, EMA, log and random streams."""
    saved, path, args = run.saved, run.saved_path, run.args
    try:
        t.raw.load_state_dict(saved['model'])
        t.optimizer.load_state_dict(saved['optimizer'])
    except (RuntimeError, ValueError, KeyError) as e:
        fail(f'cannot resume from {path}: {e}')
    t.scheduler.load_state_dict(saved['scheduler'])
    t.scaler.load_state_dict(saved['scaler'])
    if t.ema is not None and saved.get('model_ema') is not None:
        t.ema.module.load_state_dict(saved['model_ema'])
        t.ema.n_averaged.fill_(saved['ema_updates'])
    t.epoch, t.step, t.best_acc, t.log = saved['epoch'], saved['step'], saved['best_acc1'], saved['log']
    if len(saved['rng']) == run.world:  # this rank's random streams, as save_checkpoint gathered them
        state = saved['rng'][run.rank]
        torch.set_rng_state(state['torch'])
        random.setstate(state['python'])
        if state['cuda']:
            torch.cuda.set_rng_state_all(state['cuda'])
    else:
        print0(f'warning: saved with {len(saved["rng"])} processes, now {run.world}; random streams differ')
    changed = sorted(k for k, v in saved['args'].items()
                     if vars(args).get(k) != v and k not in ('resume', 'workers', 'threads', 'output_dir'))
    print0(f'resumed from {path}: epoch {t.epoch + 1}, step {t.step}' +
           (f' (changed since saved: {", ".join(changed)})' if changed else ''))
    if path == os.path.join(args.output_dir, CHECKPOINT):
        publish(run, t, saved.get('is_best', False))


def publish(run, t, is_best):
    """best.pt and metrics.jsonl follow checkpoint.pt (redone on resume, in case a kill came in between)."""
    if run.rank != 0:
        return
    out = run.args.output_dir
    if is_best:
        link_atomic(os.path.join(out, CHECKPOINT), os.path.join(out, 'best.pt'))
    metrics = os.path.join(out, 'metrics.jsonl')  # rewritten whole: always the checkpoint's log
    with open(metrics + '.tmp', 'w') as f:
        f.writelines(json.dumps(e) + '\n' for e in t.log)
    os.replace(metrics + '.tmp', metrics)


def save_checkpoint(run, t, is_best=False):
    """Everything a rerun needs to continue exactly, with every rank's random generators, written atomically."""
    state = {'torch': torch.get_rng_state(), 'python': random.getstate(),
             'cuda': torch.cuda.get_rng_state_all() if torch.cuda.is_available() else []}
    states = [state] * run.world
    if run.world > 1:
        dist.all_gather_object(states, state)
    if run.rank == 0:
        path = os.path.join(run.args.output_dir, CHECKPOINT)
        with open(path + '.tmp', 'wb') as f:
            torch.save({'model': t.raw.state_dict(), 'optimizer': t.optimizer.state_dict(),
                        'scheduler': t.scheduler.state_dict(), 'scaler': t.scaler.state_dict(),
                        'model_ema': t.ema.module.state_dict() if t.ema else None,
                        'ema_updates': int(t.ema.n_averaged) if t.ema else 0, 'epoch': t.epoch, 'step': t.step,
                        'best_acc1': t.best_acc, 'is_best': is_best, 'log': t.log, 'rng': states,
                        'args': vars(run.args), 'arch': t.raw.arch, 'num_classes': t.raw.num_classes}, f)
            f.flush()
            os.fsync(f.fileno())
        os.replace(path + '.tmp', path)  # flushed to disk, then renamed: a crash leaves the old file or the new
    publish(run, t, is_best)


def fit(run, raw, train_set, val_set):
    """Train epoch after epoch, validating and saving after each; SIGTERM saves mid-epoch and stops."""
    args = run.args
    t, sampler, loader = prepare_training(run, raw, train_set)
    val = val_loader(run, val_set)
    os.makedirs(args.output_dir, exist_ok=True)
    stop = threading.Event()
    signal.signal(signal.SIGTERM, lambda *_: stop.set())
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
            print0(f'SIGTERM: saved {os.path.join(args.output_dir, CHECKPOINT)} at epoch {epoch + 1}, step {t.step}; '
                   'rerun to continue')
            return
        last = epoch + 1 == epochs
        validate = (epoch + 1) % args.val_every == 0 or last  # and always after the last epoch
        entry = {'epoch': epoch + 1, 'train_loss': loss, 'lr': t.scheduler.get_last_lr()[0], 'images_per_s': speed,
                 **{f'val_{k}': v for k, v in (evaluate(run, raw, val) if validate else {}).items()
                    if k != 'correct' or last},  # per-image results from the final evaluation only (paper.py's record)
                 'experiment': args.experiment, 'arch': json.loads(json.dumps(raw.arch))}  # as metrics.jsonl has it
        if t.ema is not None and validate:
            entry.update({f'ema_val_{k}': v for k, v in evaluate(run, t.ema.module, val).items()
                          if k != 'correct' or last})
        acc = entry.get('ema_val_acc1' if t.ema is not None else 'val_acc1', -1.0)  # CSwin reports its EMA (main_ema.py)
        is_best, t.best_acc = acc > t.best_acc, max(acc, t.best_acc)
        t.log.append(entry)
        t.epoch, t.step = epoch + 1, 0
        save_checkpoint(run, t, is_best)
        print0(f'epoch {epoch + 1}/{epochs}  train loss {loss:.4f}' + (f'  val loss {entry["val_loss"]:.4f}  acc@1 '
               f'{entry["val_acc1"]:.2f}  acc@5 {entry["val_acc5"]:.2f}' if validate else '') +
               (f'  ema acc@1 {entry["ema_val_acc1"]:.2f}' if t.ema and validate else '') +
               f'  lr {entry["lr"]:.2e}  {speed:.0f} img/s  {time.perf_counter() - start:.0f} s')
    print0(f'done: best acc@1 {t.best_acc:.2f}; checkpoints and metrics.jsonl in {args.output_dir}')


def main(args):
    run = setup(args)
    if args.throughput:  # random input, the released 1000-class head
        return measure_throughput(run, build_model(run, num_classes=1000))
    train_set, val_set = load_data(args)
    model = build_model(run, num_classes=len(val_set.classes))
    if args.eval:
        evaluate_checkpoint(run, model, val_set)
    else:
        fit(run, model, train_set, val_set)


if __name__ == '__main__':
    main(get_args_parser().parse_args())
    if dist.is_initialized():
        dist.destroy_process_group()

"""Train and evaluate the InLine backbones: plain DDP, the authors' recipe, runnable anywhere, resumable.

InLine attention: Han et al., "Bridging the Divide: Reconsidering Softmax and Linear Attention", NeurIPS 2024,
arXiv 2412.06590. The recipe is the released one (SPEC §4) with --data-path, and a small recipe for the
built-in synthetic task without it.

The main job: no dataset, no download; on a 2-core CPU it reaches >= 90% validation accuracy in about 10 min
    torchrun --standalone --nproc_per_node=2 train.py --model inline_swin_t

ImageNet-1K (DIR/train/<class>/<image>, DIR/val/<class>/<image>) with the released recipe (total batch 1024;
fewer GPUs reach it by gradient accumulation, printed at start):
    torchrun --standalone --nproc_per_node=8 train.py --model inline_swin_t --data-path DIR
    # two nodes: run on each, HOST being the first node's address
    torchrun --nnodes=2 --nproc_per_node=8 --rdzv-id=inline --rdzv-backend=c10d --rdzv-endpoint=HOST:29500 \
        train.py --model inline_swin_t --data-path DIR --batch-size 64
Evaluate a checkpoint (ours, or the authors' released file): top-1, top-5 and loss on DIR/val
    torchrun --standalone --nproc_per_node=8 train.py --model inline_swin_t --data-path DIR --eval --checkpoint FILE
Inference throughput (images/s of one process, at the model's released image size):
    python train.py --model inline_swin_t --throughput --batch-size 64

Nothing is lost: OUTPUT_DIR/checkpoint.pt is written atomically every epoch (best.pt beside it) and rerunning
the same command resumes from it (--resume FILE names another); SIGTERM saves and exits; kill -9 loses at most
the current epoch, and the rerun ends with the same weights as a run never interrupted (fixed seed, CPU).
"""
import argparse
import contextlib
import json
import math
import os
import random
import shutil
import signal
import threading
import time

import torch
import torch.distributed as dist
import torch.nn as nn
from PIL import Image
from torch.nn.parallel import DistributedDataParallel as DDP
from torch.optim.swa_utils import AveragedModel, get_ema_multi_avg_fn
from torch.utils.data import DataLoader, Dataset, DistributedSampler, Subset
from torchvision import datasets
from torchvision.transforms import v2 as T
from tqdm import tqdm

import models

# The released recipe, SPEC §4. Learning rates are per 512 images of total batch and scale linearly with it.
RELEASED = dict(epochs=300, batch_size=128, total_batch=1024, lr=5e-4, warmup_lr=5e-7, min_lr=5e-6,
                warmup_epochs=20, cooldown_epochs=0, weight_decay=0.05, clip_grad=5.0, label_smoothing=0.1,
                mixup=0.8, cutmix=1.0, mixup_switch_prob=0.5, randaug_n=2, randaug_m=9, randaug_mstd=0.5,
                color_jitter=0.4, random_erase=0.25, ema=False)
FAMILY = {'pvt': dict(warmup_epochs=5, warmup_lr=1e-6, min_lr=1e-5, cooldown_epochs=10, clip_grad=0.0),
          'cswin': dict(warmup_lr=1e-6, min_lr=1e-5, cooldown_epochs=10, clip_grad=0.0, ema=True)}
# The 384 px variants are fine-tuned from the 224 px weights (--finetune FILE). SPEC §4 gives their epochs, lr
# and weight decay; the warm-up (5 epochs) and the warm-up/minimum rates (lr/1000, lr/100) are Swin's
# fine-tuning config, which the SPEC is silent on.
VARIANT = {'inline_pvt_m': dict(clip_grad=1.0), 'inline_pvt_l': dict(clip_grad=1.0),
           'inline_cswin_b': dict(weight_decay=0.1),
           'inline_swin_b_384': dict(epochs=30, lr=2e-5, warmup_lr=2e-8, min_lr=2e-7, warmup_epochs=5,
                                     weight_decay=1e-8),
           'inline_cswin_b_384': dict(epochs=20, lr=5e-6, warmup_lr=5e-9, min_lr=5e-8, warmup_epochs=5,
                                      cooldown_epochs=0, weight_decay=1e-8)}
# The synthetic task: fresh procedurally generated images every epoch, so no augmentation is needed and none
# of Mixup/CutMix/RandAugment/erasing is used (they would only slow a 10-minute run down).
SYNTHETIC = dict(epochs=5, batch_size=128, total_batch=None, lr=2e-3, warmup_lr=1e-5, min_lr=1e-5,
                 warmup_epochs=0.5, cooldown_epochs=0, weight_decay=0.05, clip_grad=5.0, label_smoothing=0.1,
                 mixup=0.0, cutmix=0.0, mixup_switch_prob=0.5, randaug_n=0, randaug_m=0, randaug_mstd=0.0,
                 color_jitter=0.0, random_erase=0.0, ema=False, drop_path=0.0)
SYNTHETIC_TRAIN, SYNTHETIC_VAL = 12_800, 2_000
MEAN, STD = (0.485, 0.456, 0.406), (0.229, 0.224, 0.225)


def get_args_parser():
    p = argparse.ArgumentParser(description=__doc__.split('\n')[0],
                                epilog='Flags without a default take the recipe\'s value (printed at start).')
    a = p.add_argument
    a('--model', default='inline_swin_t', choices=sorted(models.MODELS), metavar='NAME',
      help=f'variant (SPEC §3): {", ".join(models.MODELS)}')
    a('--data-path', help='ImageFolder root with train/ and val/; without it, the built-in synthetic task')
    a('--img-size', type=int, help='input side in pixels (default: the variant\'s own; 32 for the synthetic task)')
    a('--attention-impl', default='fast', choices=['fast', 'reference'],
      help='the InLine core: kernels.py (fast) or inline.py (reference)')
    a('--drop-path', type=float, help='stochastic depth rate (default: the variant\'s own)')
    a('--finetune', help='initial weights (e.g. 224 px weights for a 384 px variant)')
    a('--synthetic-train', type=int, default=SYNTHETIC_TRAIN, help='synthetic training images per epoch')
    a('--synthetic-val', type=int, default=SYNTHETIC_VAL, help='synthetic validation images')
    a('--epochs', type=int, help='epochs of the cosine schedule (cool-down epochs come on top)')
    a('--batch-size', type=int, help='per-process batch size (images)')
    a('--accum-steps', type=int, help='gradient accumulation steps (default: enough for the total batch, 1024)')
    a('--lr', type=float, help='peak learning rate per 512 images of total batch')
    a('--warmup-lr', type=float, help='learning rate at the start of warm-up, per 512 images')
    a('--min-lr', type=float, help='learning rate at the end of the cosine and in the cool-down, per 512 images')
    a('--warmup-epochs', type=float, help='linear warm-up (epochs)')
    a('--cooldown-epochs', type=int, help='epochs at --min-lr after the cosine')
    a('--weight-decay', type=float, help='AdamW weight decay (none on biases, norms, embeddings, tables)')
    a('--clip-grad', type=float, help='gradient norm clipping (0: off)')
    a('--label-smoothing', type=float)
    a('--mixup', type=float, help='Mixup alpha (0: off)')
    a('--cutmix', type=float, help='CutMix alpha (0: off)')
    a('--mixup-switch-prob', type=float, help='probability of CutMix rather than Mixup when both are on')
    a('--randaug-n', type=int, help='RandAugment operations per image (0: off)')
    a('--randaug-m', type=int, help='RandAugment magnitude, 0..10')
    a('--randaug-mstd', type=float, help='std of the per-image RandAugment magnitude')
    a('--color-jitter', type=float, help='colour jitter strength (used only when RandAugment is off, as in timm)')
    a('--random-erase', type=float, help='random erasing probability (random per-pixel values)')
    a('--ema-decay', type=float, help='EMA decay per optimizer step, 0: off (CSwin: 0.9996^(total batch/4096))')
    a('--amp', choices=['bf16', 'fp16', 'fp32'], help='autocast dtype (default: bf16 where native, else fp16 or fp32)')
    a('--compile', action='store_true', help='torch.compile the model for training')
    a('--workers', type=int, help='data-loading processes per training process')
    a('--threads', type=int, help='CPU threads per process (default: this node\'s cores shared out among them)')
    a('--seed', type=int, default=0)
    a('--output-dir', help='checkpoints and metrics.jsonl (default: runs/<model>-<data>)')
    a('--resume', help='checkpoint to resume from (default: OUTPUT_DIR/checkpoint.pt if it exists)')
    a('--eval', action='store_true', help='only evaluate --checkpoint on the validation set')
    a('--checkpoint', help='weights to evaluate: ours, or the authors\' released file')
    a('--throughput', action='store_true', help='only measure inference images/s')
    return p


def fail(message):
    raise SystemExit(f'error: {message}')


def print0(*args):
    if int(os.environ.get('RANK', 0)) == 0:
        print(*args, flush=True)


# --------------------------------------------------------------------------------------------------- data
class SyntheticShapes(Dataset):
    """Ten procedurally drawn classes: five shapes at a random place, size and rotation, four stripe
    orientations and a checkerboard, each under random colours and noise. Sample i is a pure function of
    (seed, epoch, i) (train; a fresh set every epoch) or of (seed, i) (validation), so nothing needs saving."""
    CLASSES = ('disc', 'ring', 'square', 'triangle', 'cross', 'stripes 0°', 'stripes 45°', 'stripes 90°',
               'stripes 135°', 'checkerboard')

    def __init__(self, size, img_size, seed, train):
        self.size, self.img_size, self.seed, self.train, self.epoch = size, img_size, seed, train, 0
        self.classes = list(self.CLASSES)

    def set_epoch(self, epoch):
        self.epoch = epoch

    def __len__(self):
        return self.size

    def __getitem__(self, index):
        # hash() of a tuple of ints is the same in every process and every run
        g = torch.Generator().manual_seed(hash((self.seed, self.epoch if self.train else -1, index)) % 2**62)
        uniform = lambda: torch.rand((), generator=g).item()  # noqa: E731
        label, S = index % len(self.CLASSES), self.img_size
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
                arm, a = r, 0.3 * r
                f = torch.maximum(torch.minimum(a - x.abs(), arm - y.abs()),
                                  torch.minimum(a - y.abs(), arm - x.abs()))
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
        return T.functional.normalize((img.clamp(0, 1)), MEAN, STD), label


class RandAugment(T.RandAugment):
    """torchvision's RandAugment with timm's per-image magnitude noise ('rand-m9-mstd0.5'). With 11 bins,
    magnitude m is m/10 of each operation's range, timm's scale; timm draws a continuous magnitude, we round."""
    def __init__(self, num_ops, magnitude, std, **kwargs):
        super().__init__(num_ops, magnitude, num_magnitude_bins=11, **kwargs)
        self.mean, self.std = magnitude, std

    def forward(self, *inputs):
        self.magnitude = int(round(min(max(self.mean + self.std * torch.randn(()).item(), 0), 10)))
        return super().forward(*inputs)


def load_rgb(path):
    try:
        with Image.open(path) as img:
            return img.convert('RGB')
    except Exception as e:  # name the file: one bad image among a million must be findable
        raise RuntimeError(f'cannot decode image {path}: {e}') from None


def image_folders(root):
    """ROOT/train and ROOT/val as ImageFolders; their transforms are set once the image size is known."""
    for split in ('train', 'val'):
        if not os.path.isdir(os.path.join(root, split)):
            fail(f'--data-path {root} has no {split}/ folder (expected {split}/<class>/<image> inside)')
    found = []
    for split in ('train', 'val'):
        try:
            found.append(datasets.ImageFolder(os.path.join(root, split), loader=load_rgb))
        except FileNotFoundError as e:
            fail(f'no images in {os.path.join(root, split)}: {e}')
    if found[0].classes != found[1].classes:
        fail(f'train/ has {len(found[0].classes)} classes and val/ has {len(found[1].classes)}; they must match')
    return found


def image_transforms(args):
    """The released training and evaluation transforms (SPEC §4)."""
    bicubic = T.InterpolationMode.BICUBIC
    train = [T.RandomResizedCrop(args.img_size, interpolation=bicubic), T.RandomHorizontalFlip()]
    if args.randaug_n > 0:  # timm applies colour jitter only without RandAugment; the released runs had RandAugment
        train.append(RandAugment(args.randaug_n, args.randaug_m, args.randaug_mstd, interpolation=bicubic,
                                 fill=[round(255 * m) for m in MEAN]))
    elif args.color_jitter > 0:
        train.append(T.ColorJitter(args.color_jitter, args.color_jitter, args.color_jitter))
    to_tensor = [T.ToImage(), T.ToDtype(torch.float32, scale=True), T.Normalize(MEAN, STD)]
    train += to_tensor + ([T.RandomErasing(args.random_erase, value='random')] if args.random_erase > 0 else [])
    # evaluation: the shorter side to img/0.875 (aspect kept, as in the released code), then a square centre crop;
    # the 384 px fine-tunes resize straight to a 384 x 384 square
    val = ([T.Resize((args.img_size, args.img_size), bicubic)] if args.model.endswith('_384') else
           [T.Resize(int(args.img_size / 0.875), bicubic), T.CenterCrop(args.img_size)]) + to_tensor
    return T.Compose(train), T.Compose(val)


class ResumableSampler(DistributedSampler):
    """DistributedSampler that can skip the first `start` samples of an epoch (resuming after SIGTERM)."""
    start = 0

    def __iter__(self):
        return iter(list(super().__iter__())[self.start:])

    def __len__(self):
        return super().__len__() - self.start


# ------------------------------------------------------------------------------------------------- recipe
def apply_recipe(args, family, world, device):
    """Fill every flag left unset from the recipe; return the total batch (images per optimizer step)."""
    synthetic = args.data_path is None
    recipe = SYNTHETIC if synthetic else {**RELEASED, **FAMILY.get(family, {}), **VARIANT.get(args.model, {})}
    if synthetic and args.img_size is None and not args.throughput:  # throughput: at the variant's own size
        args.img_size = 64 if family == 'deit' else 32  # DeiT's 16 px patches: a 4x4 token grid
    for key, value in recipe.items():
        if key in vars(args) and getattr(args, key) is None:
            setattr(args, key, value)
    if args.accum_steps is None:
        args.accum_steps = 1 if synthetic else max(1, round(recipe['total_batch'] / max(args.batch_size * world, 1)))
    total_batch = args.batch_size * world * args.accum_steps
    if args.ema_decay is None:
        args.ema_decay = 0.9996 ** (total_batch / 4096) if recipe['ema'] else 0.0
    if args.amp is None:
        cpu_has = lambda f: getattr(torch.cpu, f, lambda: False)()  # noqa: E731  (private, so guarded)
        native_bf16 = (torch.cuda.is_bf16_supported() if device.type == 'cuda' else
                       cpu_has('_is_avx512_bf16_supported') or cpu_has('_is_amx_tile_supported'))
        args.amp = 'bf16' if native_bf16 else 'fp16' if device.type == 'cuda' else 'fp32'
    if args.workers is None:
        args.workers = 0 if synthetic else min(8, cpu_count() // int(os.environ.get('LOCAL_WORLD_SIZE', 1)))
    if args.output_dir is None:
        data = 'synthetic' if synthetic else os.path.basename(os.path.normpath(args.data_path))
        args.output_dir = os.path.join('runs', f'{args.model}-{data}')
    return total_batch


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
    if args.eval and not args.checkpoint:
        fail('--eval needs --checkpoint FILE')
    if args.checkpoint and not args.eval:
        fail('--checkpoint is for --eval; continue training with --resume, start from weights with --finetune')


def build_optimizer(model, args, total_batch):
    """AdamW without weight decay on 1-D parameters (biases, norms) and the model's no_weight_decay() names."""
    skip = model.no_weight_decay()
    decay, no_decay = [], []
    for name, param in model.named_parameters():
        if param.requires_grad:
            (no_decay if param.ndim <= 1 or name in skip or name.split('.')[-1] in skip else decay).append(param)
    groups = [{'params': decay, 'weight_decay': args.weight_decay}, {'params': no_decay, 'weight_decay': 0.0}]
    return torch.optim.AdamW(groups, lr=args.lr * total_batch / 512, betas=(0.9, 0.999), eps=1e-8, fused=True)


def build_scheduler(optimizer, args, total_batch, steps_per_epoch):
    """Per-iteration cosine from the peak to --min-lr over --epochs, a linear warm-up from --warmup-lr replacing
    its start, then --cooldown-epochs at --min-lr (timm's CosineLRScheduler as the released code used it)."""
    scale = total_batch / 512
    peak, warmup_lr, min_lr = args.lr * scale, args.warmup_lr * scale, args.min_lr * scale
    warmup, total = round(args.warmup_epochs * steps_per_epoch), args.epochs * steps_per_epoch

    def lr_at(step):
        if step < warmup:
            return warmup_lr + (peak - warmup_lr) * step / warmup
        if step >= total:
            return min_lr
        return min_lr + 0.5 * (peak - min_lr) * (1 + math.cos(math.pi * step / total))
    return torch.optim.lr_scheduler.LambdaLR(optimizer, lambda step: lr_at(step) / peak)


def build_mix(args, num_classes):
    """Mixup or CutMix on every batch (one of the two, chosen per batch), giving soft targets."""
    mixup = T.MixUp(alpha=args.mixup, num_classes=num_classes) if args.mixup > 0 else None
    cutmix = T.CutMix(alpha=args.cutmix, num_classes=num_classes) if args.cutmix > 0 else None
    if mixup and cutmix:
        return T.RandomChoice([mixup, cutmix], p=[1 - args.mixup_switch_prob, args.mixup_switch_prob])
    return mixup or cutmix


# ------------------------------------------------------------------------------------ distributed, files
def cpu_count():
    return len(os.sched_getaffinity(0)) if hasattr(os, 'sched_getaffinity') else os.cpu_count() or 1


def world_size():
    return dist.get_world_size() if dist.is_initialized() else 1


def setup_distributed(threads=None):
    """Rank, world size and device from torchrun's environment; a plain `python train.py` is rank 0 of 1."""
    rank, world, local_rank = (int(os.environ.get(k, 0)) for k in ('RANK', 'WORLD_SIZE', 'LOCAL_RANK'))
    world = max(world, 1)
    if torch.cuda.is_available():
        device = torch.device('cuda', local_rank)
        torch.cuda.set_device(device)
        torch.backends.cuda.matmul.allow_tf32 = torch.backends.cudnn.allow_tf32 = True  # for --amp fp32
    else:
        device = torch.device('cpu')
        torch.set_num_threads(threads or max(1, cpu_count() // int(os.environ.get('LOCAL_WORLD_SIZE', 1))))
    if world > 1:
        dist.init_process_group('nccl' if device.type == 'cuda' else 'gloo')
    return rank, world, device


def rng_state():
    return {'torch': torch.get_rng_state(), 'python': random.getstate(),
            'cuda': torch.cuda.get_rng_state_all() if torch.cuda.is_available() else []}


def set_rng_state(state):
    torch.set_rng_state(state['torch'])
    random.setstate(state['python'])
    if state['cuda']:
        torch.cuda.set_rng_state_all(state['cuda'])


def save_atomic(obj, path):
    """Write to a temporary file, flush it to disk, then rename: a crash leaves the old file or the new one."""
    with open(path + '.tmp', 'wb') as f:
        torch.save(obj, f)
        f.flush()
        os.fsync(f.fileno())
    os.replace(path + '.tmp', path)


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


def load_file(path):
    if not os.path.isfile(path):
        fail(f'no checkpoint at {path}')
    try:
        return torch.load(path, map_location='cpu', weights_only=True)
    except Exception as e:
        fail(f'cannot read checkpoint {path}: {e}')


def check_checkpoint(ckpt, path, args, num_classes):
    """A checkpoint of ours records its model and classes; refuse one that does not fit this run."""
    saved = ckpt.get('args', {}).get('model')
    if saved is not None and saved != args.model:
        fail(f'{path} is a checkpoint of {saved}, not of --model {args.model}')
    if ckpt.get('num_classes', num_classes) != num_classes:
        fail(f'{path} has {ckpt["num_classes"]} classes; the data has {num_classes}')


# --------------------------------------------------------------------------------------- train and eval
def train_one_epoch(model, raw_model, ema, loader, mix, criterion, optimizer, scheduler, scaler, autocast, args,
                    epoch, stop):
    """One pass over the loader; returns (mean loss, images/s, optimizer steps done, stopped by SIGTERM).
    model is what runs (DDP-wrapped, compiled); raw_model the plain module it wraps."""
    model.train()
    device, steps, world = next(raw_model.parameters()).device, len(loader) // args.accum_steps, world_size()
    total_batch = args.batch_size * world * args.accum_steps
    bar = tqdm(total=steps, desc=f'epoch {epoch + 1}/{args.epochs + args.cooldown_epochs}', leave=False,
               disable=int(os.environ.get('RANK', 0)) != 0, mininterval=1.0, dynamic_ncols=True)
    losses, step, micro_loss, stopped, start = [], 0, 0.0, False, time.perf_counter()
    for i, (x, y) in enumerate(loader):
        if step == steps:  # the last incomplete accumulation group is dropped
            break
        x, y = x.to(device, non_blocking=True), y.to(device, non_blocking=True)
        if mix is not None:
            x, y = mix(x, y)  # y becomes (B, classes) soft targets
        last_micro = (i + 1) % args.accum_steps == 0
        sync = model.no_sync() if world > 1 and not last_micro else contextlib.nullcontext()
        with sync:
            with autocast:
                loss = criterion(model(x), y) / args.accum_steps
            scaler.scale(loss).backward()
        micro_loss += loss.item()
        if not last_micro:
            continue
        # one small all-reduce per step: the mean loss, and whether any rank saw a bad loss or a SIGTERM
        flags = torch.tensor([micro_loss, not math.isfinite(micro_loss), stop.is_set()], device=device)
        if world > 1:
            dist.all_reduce(flags)
        if flags[1] > 0:
            latest = os.path.join(args.output_dir, 'checkpoint.pt')
            kept = f'the last good checkpoint, {latest}, is untouched' if os.path.exists(latest) else 'nothing saved'
            bar.close()
            fail(f'the loss is not finite ({micro_loss}) at epoch {epoch + 1}, step {step + 1}; stopped, {kept}. '
                 'Try a lower --lr, --clip-grad, or --amp fp32.')
        if args.clip_grad > 0:
            scaler.unscale_(optimizer)
            nn.utils.clip_grad_norm_(raw_model.parameters(), args.clip_grad)
        scaler.step(optimizer)
        scaler.update()
        optimizer.zero_grad(set_to_none=True)
        scheduler.step()
        if ema is not None:
            ema.update_parameters(raw_model)
        losses.append(flags[0].item() / world)
        step, micro_loss = step + 1, 0.0
        speed = step * total_batch / (time.perf_counter() - start)
        bar.set_postfix(loss=f'{losses[-1]:.3f}', lr=f'{scheduler.get_last_lr()[0]:.2e}', img_s=f'{speed:.0f}',
                        refresh=False)
        bar.update()
        if flags[2] > 0:
            stopped = True
            break
    bar.close()
    speed = step * total_batch / max(time.perf_counter() - start, 1e-9)
    return sum(losses) / max(len(losses), 1), speed, step, stopped


@torch.no_grad()
def evaluate(model, loader, autocast):
    """Loss, top-1 and top-5 over the whole validation set; each rank holds a disjoint slice, summed here."""
    model.eval()
    device = next(model.parameters()).device
    totals = torch.zeros(4, dtype=torch.float64, device=device)  # loss sum, top-1 hits, top-5 hits, images
    for x, y in loader:
        x, y = x.to(device, non_blocking=True), y.to(device, non_blocking=True)
        with autocast:
            logits = model(x).float()
        top5 = logits.topk(min(5, logits.shape[1]), dim=1).indices  # (B, 5)
        hits = top5 == y[:, None]
        totals += torch.stack([nn.functional.cross_entropy(logits, y, reduction='sum').double(),
                               hits[:, 0].sum().double(), hits.any(1).sum().double(), totals.new_tensor(len(y))])
    if world_size() > 1:
        dist.all_reduce(totals)
    loss, top1, top5, n = totals.tolist()
    return {'loss': loss / n, 'acc1': 100 * top1 / n, 'acc5': 100 * top5 / n, 'images': int(n)}


@torch.no_grad()
def measure_throughput(model, args, device, autocast, warmup=10, timed=30):
    """Inference images/s on random input: `warmup` batches (compilation included), then `timed` batches."""
    model.eval()
    x = torch.randn(args.batch_size, 3, args.img_size, args.img_size, device=device)
    for i in range(warmup + timed):
        if i == warmup:
            if device.type == 'cuda':
                torch.cuda.synchronize()
            start = time.perf_counter()
        with autocast:
            model(x)
    if device.type == 'cuda':
        torch.cuda.synchronize()
    return timed * args.batch_size / (time.perf_counter() - start)


def main(args):
    rank, world, device = setup_distributed(args.threads)
    family = args.model.split('_')[1]  # registry names are inline_<family>_<size>
    total_batch = apply_recipe(args, family, world, device)
    check_args(args)
    synthetic = args.data_path is None
    autocast = torch.autocast(device.type, dtype=torch.bfloat16 if args.amp == 'bf16' else torch.float16,
                              enabled=args.amp != 'fp32')
    if args.throughput:  # no data: the released 1000-class head
        num_classes = 1000
    else:
        if synthetic:
            train_set = SyntheticShapes(args.synthetic_train, args.img_size, args.seed, train=True)
            val_set = SyntheticShapes(args.synthetic_val, args.img_size, args.seed, train=False)
        else:
            train_set, val_set = image_folders(args.data_path)
        num_classes = len(train_set.classes)

    torch.manual_seed(args.seed)  # the same initial weights on every rank
    overrides = {k: v for k, v in (('img_size', args.img_size), ('drop_path_rate', args.drop_path)) if v is not None}
    try:
        raw_model = models.create_model(args.model, checkpoint=args.finetune, fast=args.attention_impl == 'fast',
                                        num_classes=num_classes, **overrides).to(device)
    except ImportError as e:
        fail(f'the fast attention path is unavailable ({e}); pass --attention-impl reference')
    except ValueError as e:
        fail(f'cannot build {args.model} with {overrides}: {e}')
    args.img_size = args.img_size or raw_model.img_size[0]  # (H, W); the released sizes are square
    print0(f'args: {json.dumps(vars(args))}')
    print0(f'model: {args.model}, {sum(p.numel() for p in raw_model.parameters()) / 1e6:.1f}M parameters, '
           f'{args.img_size} px, attention {args.attention_impl}, amp {args.amp}, device {device} x {world}')
    if args.throughput:
        speed = measure_throughput(raw_model, args, device, autocast)
        print0(f'throughput: {speed:.1f} images/s (one process, batch {args.batch_size}, {args.img_size} px, '
               f'{args.amp})')
        return
    if not synthetic:
        train_set.transform, val_set.transform = image_transforms(args)

    val_loader = DataLoader(Subset(val_set, range(rank, len(val_set), world)), args.batch_size,  # no padding
                            num_workers=args.workers, pin_memory=device.type == 'cuda', generator=torch.Generator())
    if synthetic:
        print0(f'data: synthetic, {len(val_set.classes)} classes ({", ".join(val_set.classes)}), {args.img_size} px, '
               f'{len(train_set):,} fresh training images per epoch, {len(val_set):,} validation images')
    else:
        print0(f'data: {args.data_path}, {len(train_set.classes)} classes, {len(train_set):,} training and '
               f'{len(val_set):,} validation images, {args.img_size} px')
    if args.eval:
        ckpt = load_file(args.checkpoint)
        check_checkpoint(ckpt, args.checkpoint, args, num_classes)
        try:  # ours or the authors' layout; models.py checks the keys and resizes for another image size
            models.load_checkpoint(raw_model, args.checkpoint)
        except RuntimeError as e:
            fail(str(e))
        print0('eval model: ' + json.dumps(evaluate(raw_model, val_loader, autocast)))
        if ckpt.get('model_ema') is not None:
            raw_model.load_state_dict(ckpt['model_ema'])
            print0('eval ema: ' + json.dumps(evaluate(raw_model, val_loader, autocast)))
        if ckpt.get('log'):
            print0('logged when saved: ' + json.dumps(ckpt['log'][-1]))
        return

    sampler = ResumableSampler(train_set, world, rank, shuffle=True, seed=args.seed, drop_last=True)
    train_loader = DataLoader(train_set, args.batch_size, sampler=sampler, num_workers=args.workers, drop_last=True,
                              pin_memory=device.type == 'cuda', generator=torch.Generator())
    steps_per_epoch = len(train_loader) // args.accum_steps
    if steps_per_epoch == 0:
        fail(f'--batch-size {args.batch_size} x {world} processes x {args.accum_steps} accumulation steps exceeds '
             f'the {len(train_set):,} training images')
    optimizer = build_optimizer(raw_model, args, total_batch)
    scheduler = build_scheduler(optimizer, args, total_batch, steps_per_epoch)
    scaler = torch.amp.GradScaler(device.type, enabled=args.amp == 'fp16')
    ema = AveragedModel(raw_model, multi_avg_fn=get_ema_multi_avg_fn(args.ema_decay)) if args.ema_decay > 0 else None
    criterion = nn.CrossEntropyLoss(label_smoothing=args.label_smoothing)
    mix = build_mix(args, num_classes)
    model = torch.compile(raw_model) if args.compile else raw_model
    if world > 1:
        model = DDP(model, device_ids=[device.index] if device.type == 'cuda' else None)
    epochs = args.epochs + args.cooldown_epochs
    recipe = ('synthetic (no Mixup/CutMix/RandAugment/erasing; --data-path gives the released recipe)' if synthetic
              else f'released ImageNet-1K recipe for {family} (SPEC §4)')
    drop_path = "the variant's" if args.drop_path is None else args.drop_path
    print0(f'recipe: {recipe}; mixup {args.mixup}, cutmix {args.cutmix}, randaug {args.randaug_n}x{args.randaug_m}, '
           f'erase {args.random_erase}, label smoothing {args.label_smoothing}, drop path {drop_path}, '
           f'clip {args.clip_grad}, ema {args.ema_decay:.6g}')
    print0(f'schedule: {epochs} epochs ({args.epochs} cosine with {args.warmup_epochs} of warm-up, then '
           f'{args.cooldown_epochs} cool-down) x {steps_per_epoch} steps of {total_batch} images ({args.batch_size} '
           f'per process x {world} processes x {args.accum_steps} accumulation steps); peak lr '
           f'{args.lr * total_batch / 512:.3g}, weight decay {args.weight_decay}')

    os.makedirs(args.output_dir, exist_ok=True)
    latest, best_path = os.path.join(args.output_dir, 'checkpoint.pt'), os.path.join(args.output_dir, 'best.pt')

    def publish(is_best):
        """best.pt and metrics.jsonl follow checkpoint.pt (redone on resume, in case a kill came in between)."""
        if rank == 0:
            if is_best:
                link_atomic(latest, best_path)
            metrics = os.path.join(args.output_dir, 'metrics.jsonl')  # rewritten whole: always the checkpoint's log
            with open(metrics + '.tmp', 'w') as f:
                f.writelines(json.dumps(e) + '\n' for e in log)
            os.replace(metrics + '.tmp', metrics)

    def checkpoint(epoch, step, is_best=False):
        """Everything a rerun needs to continue exactly: `epoch` is the next to run, `step` the optimizer steps
        already done in it (non-zero only after SIGTERM), `rng` every rank's random generators."""
        states = [rng_state()] * world
        if world > 1:
            dist.all_gather_object(states, rng_state())
        if rank == 0:
            save_atomic({'model': raw_model.state_dict(), 'optimizer': optimizer.state_dict(),
                         'scheduler': scheduler.state_dict(), 'scaler': scaler.state_dict(),
                         'model_ema': ema.module.state_dict() if ema else None,
                         'ema_updates': int(ema.n_averaged) if ema else 0, 'epoch': epoch, 'step': step,
                         'best_acc1': best_acc, 'is_best': is_best, 'log': log, 'rng': states, 'args': vars(args),
                         'num_classes': num_classes}, latest)
        publish(is_best)

    start_epoch, start_step, best_acc, log = 0, 0, -1.0, []
    resume = args.resume or (latest if os.path.exists(latest) else None)
    if resume:
        ckpt = load_file(resume)
        check_checkpoint(ckpt, resume, args, num_classes)
        try:
            raw_model.load_state_dict(ckpt['model'])
            optimizer.load_state_dict(ckpt['optimizer'])
        except (RuntimeError, ValueError, KeyError) as e:
            fail(f'cannot resume from {resume}: {e}')
        scheduler.load_state_dict(ckpt['scheduler'])
        scaler.load_state_dict(ckpt['scaler'])
        if ema is not None and ckpt.get('model_ema') is not None:
            ema.module.load_state_dict(ckpt['model_ema'])
            ema.n_averaged.fill_(ckpt['ema_updates'])
        start_epoch, start_step, best_acc, log = ckpt['epoch'], ckpt['step'], ckpt['best_acc1'], ckpt['log']
        if len(ckpt['rng']) == world:
            set_rng_state(ckpt['rng'][rank])
        else:
            print0(f'warning: saved with {len(ckpt["rng"])} processes, now {world}; random streams differ')
        changed = sorted(k for k, v in ckpt['args'].items() if vars(args).get(k) != v and k not in
                         ('resume', 'workers', 'threads', 'output_dir'))
        print0(f'resumed from {resume}: epoch {start_epoch + 1}, step {start_step}' +
               (f' (changed since saved: {", ".join(changed)})' if changed else ''))
        if resume == latest:
            publish(ckpt.get('is_best', False))
    else:
        torch.manual_seed(args.seed + rank)  # augmentation, Mixup/CutMix and drop path differ between ranks
    stop = threading.Event()
    signal.signal(signal.SIGTERM, lambda *_: stop.set())

    run_start = time.perf_counter()
    for epoch in range(start_epoch, epochs):
        sampler.set_epoch(epoch)
        sampler.start = start_step * args.accum_steps * args.batch_size
        if synthetic:
            train_set.set_epoch(epoch)
        train_loader.generator.manual_seed(hash((args.seed, epoch, rank)) % 2**62)  # worker seeds
        loss, speed, steps, stopped = train_one_epoch(model, raw_model, ema, train_loader, mix, criterion, optimizer,
                                                      scheduler, scaler, autocast, args, epoch, stop)
        if stopped:
            checkpoint(epoch, start_step + steps)
            print0(f'SIGTERM: saved {latest} at epoch {epoch + 1}, step {start_step + steps}; rerun to continue')
            return
        start_step = 0
        val = evaluate(raw_model, val_loader, autocast)
        entry = {'epoch': epoch + 1, 'train_loss': loss, 'lr': scheduler.get_last_lr()[0], 'images_per_s': speed,
                 **{f'val_{k}': v for k, v in val.items()}}
        if ema is not None:
            entry.update({f'ema_val_{k}': v for k, v in evaluate(ema.module, val_loader, autocast).items()})
        acc = entry['ema_val_acc1' if ema is not None else 'val_acc1']  # CSwin reports its EMA (SPEC §4)
        is_best, best_acc = acc > best_acc, max(acc, best_acc)
        log.append(entry)
        checkpoint(epoch + 1, 0, is_best)
        print0(f'epoch {epoch + 1}/{epochs}  train loss {loss:.4f}  val loss {val["loss"]:.4f}  acc@1 {val["acc1"]:.2f}'
               f'  acc@5 {val["acc5"]:.2f}' + (f'  ema acc@1 {entry["ema_val_acc1"]:.2f}' if ema else '') +
               f'  lr {entry["lr"]:.2e}  {speed:.0f} img/s  {time.perf_counter() - run_start:.0f} s')
    print0(f'done: best acc@1 {best_acc:.2f}; checkpoints and metrics.jsonl in {args.output_dir}')


if __name__ == '__main__':
    main(get_args_parser().parse_args())
    if dist.is_initialized():
        dist.destroy_process_group()

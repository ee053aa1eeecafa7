"""The data train.py trains on: the synthetic task, ImageFolders (ImageNet-1K), Fashion-MNIST and
CIFAR, and the released augmentation (timm's RandAugment, Mixup/CutMix in train.py) and evaluation
transforms.

InLine attention: Han et al., "Bridging the Divide: Reconsidering Softmax and Linear Attention",
NeurIPS 2024, arXiv 2412.06590. DATASETS maps each --dataset name to its loader; load_data(args)
returns (training set, validation set) for the flags train.py resolved, train_loader and val_loader
a run's loaders, val_transform the evaluation transform of a recipe (predict.py's too). The small
datasets are read from their files as distributed (Fashion-MNIST's IDX .gz files, CIFAR's python
batches), so no download is needed where they are installed.
"""
import gzip
import math
import os
import pickle
import signal
import struct

import torch
import torch.distributed as dist
import torch.nn as nn
from PIL import Image
from torch.utils.data import DataLoader, Dataset, DistributedSampler, Subset
from torchvision import datasets
from torchvision.transforms import v2 as T
from torchvision.transforms.v2 import functional as F

from checkpoints import pair
from ranks import fail, print0

# its config's TEST.CROP is False: resized straight to 384 x 384
NO_EVAL_CROP = ('inline_swin_b_384',)
SMALL_DATASETS = {'fashion_mnist': datasets.FashionMNIST, 'cifar10': datasets.CIFAR10,
                  'cifar100': datasets.CIFAR100}
MEAN, STD = (0.485, 0.456, 0.406), (0.229, 0.224, 0.225)
FILL = [round(255 * m) for m in MEAN]  # RandAugment's geometric ops fill with the mean colour
BICUBIC = T.InterpolationMode.BICUBIC
TO_TENSOR = [T.ToImage(), T.ToDtype(torch.float32, scale=True), T.Normalize(MEAN, STD)]


class SyntheticShapes(Dataset):
    """Ten procedurally drawn classes: five shapes at a random place, size and rotation, four stripe
    orientations and a checkerboard, each under random colours and noise. Sample i is a pure
    function of (seed, epoch, i) (train; a fresh set every epoch) or of (seed, i) (validation), so
    nothing needs saving."""
    classes = ['disc', 'ring', 'square', 'triangle', 'cross', 'stripes 0°', 'stripes 45°',
               'stripes 90°', 'stripes 135°', 'checkerboard']

    def __init__(self, size, img_size, seed, train):
        self.size, self.img_size, self.seed, self.train, self.epoch = size, img_size, seed, train, 0

    def __len__(self):
        return self.size

    def __getitem__(self, index):
        # hash() of a tuple of ints is the same in every process and every run
        g = torch.Generator().manual_seed(hash((self.seed, self.epoch if self.train else -1, index))
                                          % 2**62)
        uniform = lambda: torch.rand((), generator=g).item()  # noqa: E731
        label, S = index % len(self.classes), self.img_size
        t = torch.linspace(-1 + 1 / S, 1 - 1 / S, S)  # pixel centres in [-1, 1]
        y, x = torch.meshgrid(t, t, indexing='ij')  # (S, S) each
        if label < 5:
            # a shape, upright within +-15 degrees; f > 0 inside, in units of half the image side
            r, angle = 0.45 + 0.3 * uniform(), math.radians(30 * (uniform() - 0.5))
            x, y = x - (2 * uniform() - 1) * (1 - r), y - (2 * uniform() - 1) * (1 - r)
            x, y = (math.cos(angle) * x + math.sin(angle) * y,
                    -math.sin(angle) * x + math.cos(angle) * y)
            d = (x ** 2 + y ** 2).sqrt()
            if label == 0:
                f = r - d
            elif label == 1:
                f = torch.minimum(r - d, d - 0.55 * r)
            elif label == 2:
                f = 0.8 * r - torch.maximum(x.abs(), y.abs())
            elif label == 3:
                # equilateral triangle, pointing up: inside three half-planes at distance r/2
                f = torch.stack([r / 2 - x * math.cos(a) - y * math.sin(a)
                                 for a in (math.pi / 2, math.pi * 7 / 6, -math.pi / 6)]).amin(0)
            else:
                a = 0.3 * r  # half the width of an arm, whose length is r
                f = torch.maximum(torch.minimum(a - x.abs(), r - y.abs()),
                                  torch.minimum(a - y.abs(), r - x.abs()))
            mask = (f * S / 2 + 0.5).clamp(0, 1)  # about one pixel of anti-aliased edge
        else:
            # a texture over the image: a grating (wave vector at 0/45/90/135° +- 10°) or a
            # checkerboard
            period, angle = 0.25 + 0.25 * uniform(), 2 * math.pi * uniform()
            if label < 9:
                angle = math.radians(45 * (label - 5) + 20 * (uniform() - 0.5))
            u = ((x * math.cos(angle) + y * math.sin(angle)) * 2 * math.pi / period
                 + 2 * math.pi * uniform())
            v = ((y * math.cos(angle) - x * math.sin(angle)) * 2 * math.pi / period
                 + 2 * math.pi * uniform())
            mask = ((u.sin() if label < 9 else u.sin() * v.sin()) * 2 + 0.5).clamp(0, 1)
        fg = torch.rand(3, generator=g)
        # every channel differs from fg by >= 0.3
        bg = (fg + 0.3 + 0.4 * torch.rand(3, generator=g)) % 1
        img = bg[:, None, None] + mask * (fg - bg)[:, None, None]  # (3, S, S)
        img = img + 0.08 * uniform() * torch.randn((3, S, S), generator=g)
        return F.normalize((img.clamp(0, 1)), MEAN, STD), label


def affine(img, shear=(0.0, 0.0), translate=(0.0, 0.0)):
    """timm's shear and translation, PIL's affine map about the top-left corner: output pixel (x, y)
    reads input (x + shear_x * y + translate_x, y + shear_y * x + translate_y). torchvision takes
    the shear as an angle and the translation as where the content moves, hence atan and the
    minus."""
    return F.affine(img, angle=0.0, translate=[-t for t in translate], scale=1.0, center=[0, 0],
                    interpolation=BICUBIC, shear=[math.degrees(math.atan(s)) for s in shear],
                    fill=FILL)


def posterize(img, bits):
    """Keep each channel's top `bits` bits; 0 bits is black, which PIL's posterize refuses to
    compute."""
    return F.posterize(img, bits) if bits > 0 else img.point(lambda _: 0)


def solarize_add(img, add):
    """timm's SolarizeAdd: pixels below 128 brightened by `add`, saturating at 255."""
    return img.point([min(255, i + add) if i < 128 else i for i in range(256)]
                     * len(img.getbands()))


# timm's RandAugment ops for 'inc1', on PIL images as timm's: (image, f = magnitude / 10, sign) ->
# image
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
    """timm's RandAugment 'rand-m9-mstd0.5-inc1', the released trainer's (torchvision's is another
    policy): each of num_ops operations, drawn with replacement, applied with probability 0.5 at its
    own magnitude."""
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
    """The released evaluation (the authors' TEST.CROP): resize each side to int(side * 256 / 224)
    (a square for a square img_size), aspect not kept, then the centre H x W; without crop
    (inline_swin_b_384's config) straight to H x W. Bicubic."""
    H, W = pair(img_size)
    resize = (int(H * 256 / 224), int(W * 256 / 224)) if crop else (H, W)
    return T.Compose([T.Resize(resize, BICUBIC), T.CenterCrop((H, W))] + TO_TENSOR)


def val_transform(args):
    """The validation transform of a run's recipe (args: its resolved flags, or a checkpoint's):
    the released one (eval_transform) on the released recipe, else the small recipe's resize (the
    synthetic task draws its images at the model's size: an image file is resized to it)."""
    if args.recipe == 'released':
        return eval_transform(args.img_size, args.model not in NO_EVAL_CROP)
    return T.Compose([T.ToImage(), T.Resize(pair(args.img_size), BICUBIC, antialias=True)]
                     + TO_TENSOR)


def pixels(img_size):
    """'32 px' for a square, '64x96 px' (H x W) for another size, as the runs print it."""
    H, W = pair(img_size)
    return f'{H} px' if H == W else f'{H}x{W} px'


def load_rgb(path):
    """An image file as RGB; PIL raises for a file it cannot read."""
    with Image.open(path) as img:
        return img.convert('RGB')


class ImageFolder(datasets.ImageFolder):
    """torchvision's ImageFolder, which does not stop at a file it cannot read (truncated, not an
    image): it returns a blank image (zeros, the transforms' output shape) with the label
    -1 - index, so that train.py learns, from whichever process read it, which file it was
    (samples[-1 - label]) and decides: leave it out (--skip-bad-images) or stop at a saved step and
    name it."""

    def __init__(self, root, transform, img_size):
        super().__init__(root, transform, loader=load_rgb)
        self.blank = torch.zeros(3, *pair(img_size))  # (3, H, W), as TO_TENSOR ends

    def __getitem__(self, index):
        path, label = self.samples[index]
        try:
            img = self.loader(path)
        except Exception:  # PIL raises OSError, ValueError, SyntaxError... for a broken file
            return self.blank, -1 - index
        return self.transform(img), label


def leave_out_unreadable(x, y, found, skip):
    """(x, y, weight) of a batch, its unreadable images (label -1 - index, ImageFolder) noted in
    `found`: left out where skip (--skip-bad-images) and others remain, else kept with weight 0 (the
    step is dropped, or has nothing to learn from)."""
    bad = y < 0
    if not bad.any():
        return x, y, 1.0
    found += (-1 - y[bad]).tolist()
    if skip and not bad.all():
        return x[~bad], y[~bad], 1.0
    return x, y.clamp(min=0), 0.0


def unreadable(dataset, indices, root, gather=True, shown=20):
    """'N unreadable image(s) under ROOT: train/a/1.png (why), ...', '' for none: the images of
    `indices`, every rank's where gather (each rank then calls this), each file named with its split
    and class folder, and why PIL cannot read it."""
    found = [indices]
    if gather and dist.is_initialized():
        found = [None] * dist.get_world_size()
        dist.all_gather_object(found, indices)
    folder = getattr(dataset, 'dataset', dataset)  # an ImageFolder, or the Subset of one
    paths = [folder.samples[i][0] for i in sorted(set(sum(found, [])))]
    if not paths:
        return ''

    def why(path):
        try:
            load_rgb(path)
        except Exception as e:
            return str(e).replace(f" '{path}'", '') or type(e).__name__
        return 'readable now'
    named = ', '.join(f'{os.path.relpath(p, root)} ({why(p)})' for p in paths[:shown])
    more = f', and {len(paths) - shown} more' if len(paths) > shown else ''
    return f'{len(paths)} unreadable image(s) under {root}: {named}{more}'


# what a run that met an unreadable image says, after naming it
GO_ON = ('To go on, rerun the same command with --skip-bad-images (unreadable images left out, '
         'counted and listed every epoch), or replace or remove the files and rerun it')


def read_idx(path):
    """An IDX file (MNIST's format, gzipped or not) as a uint8 tensor: bytes 0 0 8 D, D big-endian
    sizes, data."""
    with (gzip.open if path.endswith('.gz') else open)(path, 'rb') as f:
        data = f.read()
    shape = struct.unpack(f'>{data[3]}I', data[4:4 + 4 * data[3]])
    return torch.frombuffer(bytearray(data[4 + 4 * data[3]:]), dtype=torch.uint8).reshape(shape)


def read_small(name, root, train):
    """(images (N, 3, H, W) uint8, grayscale as 3 equal channels; labels; class names) from the
    files as distributed, in ROOT or where torchvision's download puts them: Fashion-MNIST's IDX
    files, CIFAR's pickled python batches."""
    if name == 'fashion_mnist':
        folders = (root, os.path.join(root, 'FashionMNIST', 'raw'))
        for folder, ext in [(f, e) for f in folders for e in ('.gz', '')]:
            split = 'train' if train else 't10k'
            paths = [os.path.join(folder, f'{split}-{kind}-ubyte{ext}')
                     for kind in ('images-idx3', 'labels-idx1')]
            if all(map(os.path.exists, paths)):  # (N, 28, 28) -> (N, 3, 28, 28), a view
                return (read_idx(paths[0])[:, None].expand(-1, 3, -1, -1),
                        read_idx(paths[1]).long(), datasets.FashionMNIST.classes)
    else:
        folder, files, key = (('cifar-10-batches-py',
                               [f'data_batch_{i}' for i in range(1, 6)] if train else
                               ['test_batch'], 'label') if name == 'cifar10' else
                              ('cifar-100-python', ['train' if train else 'test'], 'fine_label'))
        folder = next((f for f in (os.path.join(root, folder), root)
                       if os.path.exists(os.path.join(f, files[0]))), '')
        if folder:
            batches, meta = [], 'batches.meta' if name == 'cifar10' else 'meta'
            for file in files + [meta]:
                with open(os.path.join(folder, file), 'rb') as f:
                    batches.append(pickle.load(f, encoding='latin1'))
            images = torch.cat([torch.as_tensor(b['data']).reshape(-1, 3, 32, 32)
                                for b in batches[:-1]])
            labels = torch.cat([torch.as_tensor(b[key + 's']) for b in batches[:-1]])
            return images, labels, batches[-1][key + '_names']
    debian = (' (Debian: apt-get install dataset-fashion-mnist puts them in '
              '/usr/share/datasets/fashion-mnist)' if name == 'fashion_mnist' else '')
    fail(f'no {name} files in {root}{debian}; --download fetches them there')


class TensorImages(Dataset):
    """A small dataset held as one uint8 tensor (N, 3, H, W)."""
    def __init__(self, images, labels, classes, transform):
        self.images, self.labels, self.classes, self.transform = (images, labels, list(classes),
                                                                  transform)

    def __len__(self):
        return len(self.labels)

    def __getitem__(self, index):
        return self.transform(self.images[index]), int(self.labels[index])


def load_synthetic(args):
    """The synthetic task: fresh images every training epoch (fit sets the epoch), a fixed
    validation set; square."""
    if len(set(pair(args.img_size))) > 1:
        fail(f'the synthetic task draws square images; --img-size {pixels(args.img_size)} is not: '
             f'give one side, or an ImageFolder (--data-path) for other sizes')
    return (SyntheticShapes(args.synthetic_train, args.img_size, args.seed, train=True),
            SyntheticShapes(args.synthetic_val, args.img_size, args.seed, train=False))


def count_images(folder):
    """The image files under folder, as ImageFolder counts them (0 for a folder that is not
    there)."""
    return sum(name.lower().endswith(datasets.folder.IMG_EXTENSIONS)
               for _, _, names in os.walk(folder)
               for name in names)


def load_image_folder(args):
    """ROOT/train and ROOT/val as ImageFolders (ImageNet-1K's layout), with the released transforms
    or, on the small-data recipe, the small datasets' (small_transforms)."""
    root, found = args.data_path, []
    for split in ('train', 'val'):
        if not os.path.isdir(os.path.join(root, split)):
            fail(f'--data-path {root} has no {split}/ folder (expected '
                 f'{split}/<class>/<image> inside)')
    transforms = (('train', train_transform(args)), ('val', val_transform(args)))
    if getattr(args, 'recipe', None) == 'small':
        transforms = zip(('train', 'val'), small_transforms(args))
    for split, transform in transforms:
        try:
            found.append(ImageFolder(os.path.join(root, split), transform, args.img_size))
        except FileNotFoundError as e:
            fail(f'no images in {os.path.join(root, split)}: {e}')
    return found


def load_small(args):
    """A small dataset's training and test sets from its files (--download fetches them), resized,
    then (training) randomly cropped with an eighth of padding and flipped: the small-image recipe's
    augmentation."""
    root = args.data_path or 'data'
    if args.download:  # torchvision fetches every split's files at once
        SMALL_DATASETS[args.dataset](root, download=True)
    return [TensorImages(*read_small(args.dataset, root, train), transform)
            for train, transform in zip((True, False), small_transforms(args))]


def small_transforms(args):
    """(training, validation) transforms of the small-data recipe: resized to the model's size,
    then (training) randomly cropped with an eighth of padding and flipped."""
    size, val = pair(args.img_size), val_transform(args)  # val: ToImage, Resize, then TO_TENSOR
    augment = [T.RandomCrop(size, padding=min(size) // 8, padding_mode='reflect'),
               T.RandomHorizontalFlip()]
    return T.Compose(val.transforms[:2] + augment + TO_TENSOR), val


# --dataset NAME -> load(args) -> (training set, validation set), each with .classes. train.py's
# --dataset choices are these keys; a dataset other than synthetic and imagefolder trains with
# train.py's small-image recipe (SMALL). The lab adds its own (paper/).
DATASETS = {'synthetic': load_synthetic, 'imagefolder': load_image_folder,
            **{name: load_small for name in SMALL_DATASETS}}


def dataset(args):
    """--dataset, or what --data-path implies: an ImageFolder with it, the synthetic task
    without."""
    return args.dataset or ('imagefolder' if args.data_path else 'synthetic')


def load_data(args):
    """(training set, validation set) of --dataset, with --train-subset of the training images (not
    synthetic)."""
    root = args.data_path
    if root and not os.path.isdir(root) and not getattr(args, 'download', False):
        holds = ('train/<class>/<image> and val/<class>/<image>' if args.dataset == 'imagefolder'
                 else f"{args.dataset}'s files (or add --download)")
        fail(f'--data-path {root} does not exist{" as a folder" * os.path.exists(root)}: give the '
             f'folder that holds {holds}')
    train_set, val_set = DATASETS[args.dataset](args)
    if len(train_set.classes) < 2:
        fail(f'{args.dataset} in {args.data_path} has {len(train_set.classes)} class(es) '
             f'({", ".join(train_set.classes)}): a classifier needs at least two, one folder each')
    if train_set.classes != val_set.classes:  # the class folders, each split's sorted
        only = [', '.join(sorted(set(a) - set(b))) or 'none' for a, b in
                ((train_set.classes, val_set.classes), (val_set.classes, train_set.classes))]
        fail(f'train/ and val/ of {args.data_path} must hold the same class folders: only in '
             f'train/: {only[0]}; only in val/: {only[1]}')
    if args.dataset == 'synthetic':
        print0(f'data: synthetic, {len(val_set.classes)} classes ({", ".join(val_set.classes)}), '
               f'{pixels(args.img_size)}, {len(train_set):,} fresh training images per epoch, '
               f'{len(val_set):,} validation images')
        return train_set, val_set
    if args.train_subset and args.train_subset < len(train_set):
        classes = train_set.classes
        train_set = Subset(train_set, subset_indices(len(train_set), args.train_subset))
        train_set.classes = classes
    own, (h, w) = typical_size(train_set), pair(args.img_size)
    H, W = own
    print0(f'data: {args.dataset} in {args.data_path or "data"}, {len(train_set.classes)} classes, '
           f'{len(train_set):,} training and {len(val_set):,} validation images'
           + f' of about {H}x{W} px' * bool(H) + f', resized to {pixels(args.img_size)}')
    if H and h * w >= 9 * H * W:  # a third of the side or less: 32 px images at 224 px
        fit = [max(32, round(side / 32) * 32) for side in own]  # multiples of every stride
        print0(f'warning: the images are about {H}x{W} px, the model\'s input {h}x{w} px: '
               f'upsampled {min(h / H, w / W):.0f}x, each costs a {h}x{w} input\'s compute for no '
               f'more detail. Choose --img-size near the images\' size, height and width '
               f'multiples of the model\'s stride (16 DeiT, 32 the others): here --img-size '
               f'{" ".join(map(str, dict.fromkeys(fit)))}')
    return train_set, val_set


def typical_size(train_set):
    """(H, W): the median height and width of the training images, from 16 spread over the set (of
    an ImageFolder, each file's header only); (0, 0) where none can be read."""
    folder = getattr(train_set, 'dataset', train_set)  # the Subset of --train-subset
    if isinstance(folder, TensorImages):
        return tuple(folder.images.shape[2:])
    sizes = []
    samples = getattr(folder, 'samples', [])  # an ImageFolder's; none in the lab's own datasets
    for path, _ in samples[::max(1, len(samples) // 16)][:16]:
        try:
            with Image.open(path) as img:
                sizes.append(img.size[::-1])  # PIL's (W, H)
        except Exception:  # unreadable: named when it is read for training
            pass
    return tuple(sorted(size[i] for size in sizes)[len(sizes) // 2] if sizes else 0
                 for i in (0, 1))


def subset_indices(total, size):
    """--train-subset's images: the first `size` of one fixed random order of the `total` (the same
    whatever --seed, and a larger subset holds every smaller one)."""
    return torch.randperm(total, generator=torch.Generator().manual_seed(0))[:size].tolist()


class ResumableSampler(DistributedSampler):
    """DistributedSampler that can skip the first `start` samples of an epoch (resuming after
    SIGTERM)."""
    start = 0

    def __iter__(self):
        return iter(list(super().__iter__())[self.start:])

    def __len__(self):
        return super().__len__() - self.start


def train_loader(run, train_set):
    """(sampler, loader) of a run's training images (run: a train.Run): each rank its share of a
    fresh shuffle every epoch, whole batches only; the sampler resumes mid-epoch."""
    sampler = ResumableSampler(train_set, run.world, run.rank, shuffle=True, seed=run.args.seed,
                               drop_last=True)
    loader = DataLoader(train_set, run.args.batch_size, sampler=sampler, drop_last=True,
                        num_workers=run.args.workers, pin_memory=run.device.type == 'cuda',
                        generator=torch.Generator(), worker_init_fn=ignore_interrupt)
    return sampler, loader


def val_loader(run, val_set):
    """Every validation image exactly once across ranks: rank r takes images r, r + world, ... (no
    padding)."""
    subset = Subset(val_set, range(run.rank, len(val_set), run.world))
    return DataLoader(subset, run.args.batch_size, num_workers=run.args.workers,
                      pin_memory=run.device.type == 'cuda', generator=torch.Generator(),
                      worker_init_fn=ignore_interrupt)


def ignore_interrupt(worker_id):
    """A DataLoader worker's start: Ctrl-C signals the whole process group, and only the training
    process acts on it (it ends the step, then saves); a worker that stopped at it could leave that
    step without its next batch."""
    signal.signal(signal.SIGINT, signal.SIG_IGN)

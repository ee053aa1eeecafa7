"""The mosaics: visual associative recall on Fashion-MNIST, the ablations' test bed where attention must
select.

InLine attention: Han et al., "Bridging the Divide: Reconsidering Softmax and Linear Attention", NeurIPS 2024,
arXiv 2412.06590. The dataset `fashion_recall` of train.py's loop, registered in train.DATASETS by the lab's
own training command, with its flags (--recall-task, --recall-pairs, --recall-query). Commands (from the
repository root):

    python -m paper train NAME --dataset fashion_recall --recall-task below  # train on the mosaics
    python -m paper mosaics --png figures/fashion_recall.png  # samples of the mosaics, with their labels
"""
import os

import torch
from PIL import Image, ImageDraw, ImageFont
from torch.utils.data import Dataset
from torchvision import datasets
from torchvision.transforms import v2 as T
from torchvision.transforms.v2 import functional as F

import data
import train
from ranks import fail
from data import TO_TENSOR  # FashionRecall's argument `train` is the split

NAME = 'fashion_recall'
TRAIN_MOSAICS, TEST_MOSAICS = 20_000, 10_000  # unless --synthetic-train, --synthetic-val say otherwise


class FashionRecall(Dataset):
    """Visual associative recall on Fashion-MNIST, a task where attention must select: pooling keeps which
    items a mosaic holds but cannot bind one to the query. Mosaic i is a pure function of (seed, split, i)
    (layout), drawn from one split's images only, so test mosaics hold test images alone.

    A 64-px mosaic of 4x4 cells of 16 px, each empty or holding one item at 14 px, one cell framed (its 1-px
    border lit). task 'recall': `pairs` (1-4, default 2) key-value pairs, each key right above its value, in
    cells at random; key classes distinct, value classes distinct; the framed query cell holds another image
    of one key's class (query='same': the key's own image), and the label is that key's value's class. task
    'below': every cell filled, the framed item in row 1 and the label the class of the item right below it,
    in row 2. No augmentation: a flip or a crop would move the roles."""
    classes = datasets.FashionMNIST.classes
    PAIRS, QUERY = 2, 'other'  # recall's defaults (the run folders name them too)

    def __init__(self, images, labels, size, seed, train, task='recall', pairs=None, query=None):
        if task == 'below' and (pairs, query) != (None, None):
            fail("fashion_recall: task 'below' fills every cell and has no query; pairs and query are "
                 f"recall's (got pairs {pairs!r}, query {query!r})")
        pairs, query = (pairs or self.PAIRS, query or self.QUERY) if task == 'recall' else (pairs, query)
        if (task not in ('recall', 'below')
                or task == 'recall' and (query not in ('other', 'same') or not 1 <= pairs <= 4)):
            fail("fashion_recall: task is 'recall' or 'below'; recall's query 'other' or 'same', its pairs "
                 f"1 to 4 (4 pairs always fit the 4x4 cells); got {task!r}, {query!r}, {pairs!r}")
        self.size, self.seed, self.train = size, seed, train
        self.task, self.pairs, self.query = task, pairs, query
        # (N, 1, 14, 14) uint8: one channel of the gray
        items = F.resize(images[:, :1], [14, 14], antialias=True)
        self.items, self.labels = items[:, 0], labels
        self.by_class = [torch.nonzero(labels == c).flatten() for c in range(len(self.classes))]
        self.to_tensor = T.Compose(TO_TENSOR)

    def __len__(self):
        return self.size

    def layout(self, index):
        """(classes (4, 4): each cell's item class, -1 if empty; roles (4, 4) of 'key', 'value', 'query',
        'item', 'framed', 'below', 'decoy' or ''; images (4, 4): the source image of each cell, -1 if empty;
        the label)."""
        g = torch.Generator().manual_seed(hash((self.seed, self.train, index)) % 2**62)
        pick = lambda n, k: torch.randperm(n, generator=g)[:k].tolist()  # noqa: E731  k distinct of range(n)
        image = lambda c: int(self.by_class[c][torch.randint(len(self.by_class[c]), (),  # noqa: E731
                                                             generator=g)])
        classes, roles = [[-1] * 4 for _ in range(4)], [[''] * 4 for _ in range(4)]
        images = [[-1] * 4 for _ in range(4)]

        def put(cell, c, role, source=None):
            (r, col) = cell
            classes[r][col], roles[r][col], images[r][col] = c, role, image(c) if source is None else source
        if self.task == 'below':
            # Without attention (the phi = 0 floor: patch merges, MLPs, means over the stage) a network sees
            # the four 2x2-cell blocks that stage 4 merges as a set, each block knowing its cells' slots
            # within it: it finds the framed item's slot, hence the label's (row 0 of a block, the framed
            # item's column in it), but not which of the other three blocks lies below. Those three cells
            # ('below' and two 'decoy's) hold distinct classes and the rest are drawn alike, so the floor can
            # do no better than 1 in 3.
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
            if len(keys) < self.pairs and all(top != k and top != (k[0] + 1, k[1])
                                              and (top[0] + 1, top[1]) != k
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
        while (self.query == 'other' and source == images[r][col]
               and len(self.by_class[key_classes[asked]]) > 1):
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


def add_flags(parser):
    """The mosaics' flags, on train.py's parser (`python -m paper train`)."""
    a = parser.add_argument
    a('--recall-task', default='recall', choices=['recall', 'below'],
      help="fashion_recall's task: recall (a key's value) or below (the item below the framed one)")
    a('--recall-pairs', type=int, help="fashion_recall's key-value pairs, 1-4 (recall only; default 2)")
    a('--recall-query', choices=['other', 'same'],
      help="fashion_recall's query: another image of the key's class (default), or the key's own "
      "(recall only)")


def load(args):
    """(training mosaics, test mosaics) for train.DATASETS: --synthetic-train and --synthetic-val of them
    (20,000 and 10,000), 64 px, from Fashion-MNIST's files in --data-path (data/). The training mosaics by the
    run's seed; the test mosaics the same for every run (seed 0), so that the per-image results of runs of
    different seeds are on the same images (the lab's intervals pair them)."""
    if args.img_size != 64:
        train.fail(f'--dataset fashion_recall makes 64 px mosaics of 4x4 cells; --img-size {args.img_size} '
                   'would resample them: leave it unset or give 64')
    options = dict(task=args.recall_task, pairs=args.recall_pairs, query=args.recall_query)
    found = [FashionRecall(*data.read_small('fashion_mnist', args.data_path or 'data', split)[:2], size,
                           args.seed if split else 0, split, **options)
             for split, size in ((True, args.synthetic_train or TRAIN_MOSAICS),
                                 (False, args.synthetic_val or TEST_MOSAICS))]
    task = 'below' if args.recall_task == 'below' else \
        f'recall {found[1].pairs} pairs, query {found[1].query}'
    train.print0(f'data: fashion_recall ({task}), {len(found[0]):,} training and {len(found[1]):,} test '
                 'mosaics, 64 px')
    return found


def register():
    """train.DATASETS['fashion_recall'] = load: train.py's --dataset choices then offer it."""
    train.DATASETS[NAME] = load


def font(size=13):
    return ImageFont.load_default(size=size)


def cmd_mosaics(args):
    """Samples of train.py's --dataset fashion_recall, test split, each task a row, every mosaic under its
    label."""
    images, labels, classes = data.read_small('fashion_mnist', args.data_path, train=False)
    rows = [(f'recall, {p} pairs', FashionRecall(images, labels, 8, 0, False, task='recall', pairs=p))
            for p in (2, 4)] + [('below, 16 items', FashionRecall(images, labels, 8, 0, False, task='below'))]
    scale, pad, text = 3, 12, 30  # each 64 px mosaic drawn 192 px wide, its label under it
    img = Image.new('RGB', (150 + 8 * (64 * scale + pad), len(rows) * (64 * scale + text + pad)), 'white')
    draw = ImageDraw.Draw(img)
    for r, (name, mosaics) in enumerate(rows):
        y = r * (64 * scale + text + pad)
        draw.text((8, y + 90), name, fill='black', font=font(14))
        for i in range(8):
            x, label = mosaics[i]
            # (64, 64), the gray channel
            pixels = (x[0] * data.STD[0] + data.MEAN[0]).clamp(0, 1).mul(255).byte()
            tile = Image.fromarray(pixels.numpy(), 'L').resize((64 * scale,) * 2, Image.NEAREST)
            img.paste(tile, (150 + i * (64 * scale + pad), y))
            draw.text((150 + i * (64 * scale + pad), y + 64 * scale + 6), classes[label], fill='black',
                      font=font(14))
    # the mosaics themselves, pixel for pixel: data drawn with Pillow, not a chart
    path = args.png or os.path.join(args.out, 'mosaics.png')
    os.makedirs(os.path.dirname(os.path.abspath(path)), exist_ok=True)
    img.save(path, format='PNG', optimize=True)
    print(f'picture: {path} ({img.width}x{img.height})')

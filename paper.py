"""The paper's figures and tables, rerun small on one machine, with pictures.

InLine attention: Han et al., "Bridging the Divide: Reconsidering Softmax and Linear Attention", NeurIPS 2024,
arXiv 2412.06590. One subcommand per figure or group of tables of the paper (README, "The paper's experiments").
Each prints a table (markdown, for the README), draws a PNG (OUT/<subcommand>.png, or --png PATH) and keeps what
it has finished under OUT (default runs/paper/), so a rerun resumes where the last one stopped.

    python paper.py models                 # every released variant: params and GMACs beside the authors'
    python paper.py experiments            # every experiment of the paper by name, with the paper's top-1
    python paper.py injectivity            # F1: the weights of q, 2q, 3q, 4q under softmax, linear, InLine
    python paper.py locality               # F4: per layer, the weight on the 3x3, own and class tokens; Eq. 6's share
    python paper.py maps                   # F3: attention maps of a few query tokens, laid over an image
    python paper.py speed [--quick]        # F5b, F5c: images/s against window and resolution
    python paper.py speed --model-step     # a whole InLine-Swin-T training step: reference vs fast core
    python paper.py speed --dense          # backbones at detection sizes: forward time and peak memory
    python paper.py speed --whole [--compile]  # whole models against softmax; where a forward's time goes
    python paper.py ablations --claims     # the claim rows at 5 seeds and their floor: the first batch
    python paper.py ablations [--quick]    # T3, T4, T10, R-res, R-dil, R-nonneg, T1, S: trained small
    python paper.py ablations --no-train   # every table and picture from results/runs.jsonl alone, in seconds
    python paper.py ablations --device cuda  # the same set where the miniatures converge (all 60,000 images)
    python paper.py recall                 # InLine on sequences: associative recall (MQAR), injectivity where it holds
    python paper.py mosaics --png figures/fashion_recall.png  # train.py's fashion_recall mosaics, with their labels

The trained ones (locality, maps, ablations) train on Fashion-MNIST unless told (--dataset, --data-path: any
ImageFolder too): locality and maps their four small DeiTs, ablations every experiment of models.EXPERIMENTS,
each on first use, a model that several need trained once. Nothing here trains images by itself: every image
run is a `python train.py ...` subprocess, the project's one training loop, and each finished run appends its
record to results/runs.jsonl, from which the tables are rebuilt; recall's small sequence models train in this
process (its section says why) and keep theirs in results/recall.jsonl. The verdicts' rules are fixed below (verdict, holm) and in
the tests.
"""
import argparse
import contextlib
import ctypes
import fcntl
import functools
import hashlib
import io
import itertools
import json
import math
import os
import re
import resource
import signal
import statistics
import subprocess
import sys
import time
from typing import NamedTuple

import torch
import torch.nn.functional as F
from PIL import Image, ImageDraw, ImageFont
from torchvision.transforms import functional as TF
from tqdm import tqdm

import inline
import kernels
import models
import train

HERE = os.path.dirname(os.path.abspath(__file__))


# ---------------------------------------------------------------------------------------------------
# Output: markdown tables and PNG pictures, drawn with Pillow (which torchvision brings). One place for all
# drawing: heat-map cells, line/dot charts, image tiles.

PALETTE = [(31, 119, 180), (214, 39, 40), (44, 160, 44), (255, 127, 14), (148, 103, 189), (140, 86, 75),
           (227, 119, 194), (127, 127, 127), (188, 189, 34), (23, 190, 207)]  # 10 series before a colour repeats
MARK = (230, 0, 120)  # identical rows, query tokens


def print_table(header, rows):
    """A markdown table, so what is printed can be pasted into the README as it is."""
    print('| ' + ' | '.join(header) + ' |')
    print('|' + '---|' * len(header))
    for row in rows:
        print('| ' + ' | '.join(str(c) for c in row) + ' |')


def font(size=13):
    return ImageFont.load_default(size=size)


def diverging(t):
    """t in [-1, 1] -> RGB: blue for negative, white at 0, red for positive."""
    t = max(-1.0, min(1.0, t))
    end = (178, 24, 43) if t >= 0 else (33, 102, 172)
    return tuple(round(255 + abs(t) * (e - 255)) for e in end)


def save_png(img, path):
    os.makedirs(os.path.dirname(os.path.abspath(path)), exist_ok=True)
    img.save(path, format='PNG', optimize=True)
    print(f'picture: {path} ({img.width}x{img.height})')


def nice_ticks(lo, hi, n=5):
    """About n round numbers spanning [lo, hi]."""
    raw = (hi - lo) / max(n - 1, 1)
    step = 10 ** math.floor(math.log10(raw))
    step *= next(m for m in (1, 2, 5, 10) if m * step >= raw)
    return [i * step for i in range(math.floor(lo / step), math.ceil(hi / step) + 1)]


def chart(draw, box, series, *, title, xlabel, ylabel, xticks, xlabels=None, log_x=False, hlines=(), lines=True,
          ylim=None):
    """A line (or, lines=False, dot) chart in box = (left, top, right, bottom) of draw.

    series: [(label, xs, ys, errs or None)]; hlines: [(label, y)] drawn dashed; xticks the x positions to
    label with xlabels (default the numbers themselves). Errors are drawn as vertical bars (+- err), cut at
    ylim = (lo, hi) where given (a percentage's interval beyond 0 or 100, say)."""
    left, top, right, bottom = box
    x0, x1 = left + 58, right - 14
    places, row, run = [], 0, 0  # each legend label's (x offset, row): labels wrap at the plot's width
    for label, *_ in series:
        width = len(str(label)) * 6 + 40
        row, run = (row + 1, 0) if run + width > x1 - x0 and run else (row, run)
        places.append((run, row))
        run += width
    rows = row + 1
    y0, y1 = top + 44, bottom - 50 - 16 * rows  # the plotting area; title above, x label and legend below
    ys = [y + s * (e or 0) for _, _, values, errs in series for y, e in zip(values, errs or [0] * len(values))
          for s in (-1, 1) if y is not None and math.isfinite(y)] + [y for _, y in hlines]
    lo, hi = (max(min(ys), ylim[0]), min(max(ys), ylim[1])) if ylim else (min(ys), max(ys))
    pad = 0.08 * (hi - lo or abs(hi) or 1)
    top_y = min(hi + pad, ylim[1]) if ylim else hi + pad
    yt = nice_ticks(lo - pad if lo < 0 else max(lo - pad, 0), top_y)  # no negative axis for positive data
    lo, hi = yt[0], yt[-1]
    fx = (lambda x: math.log(x)) if log_x else (lambda x: x)
    xa, xb = fx(min(xticks)), fx(max(xticks))
    xspan = (xb - xa) or 1
    margin = 0.06 * xspan if not lines else 0.0
    px = lambda x: x0 + (fx(x) - xa + margin) / (xspan + 2 * margin) * (x1 - x0)  # noqa: E731
    clip = (lambda y: min(max(y, lo), hi)) if ylim else (lambda y: y)  # noqa: E731
    py = lambda y: y1 - (clip(y) - lo) / (hi - lo) * (y1 - y0)  # noqa: E731
    draw.text(((left + right) / 2, top + 4), title, fill='black', font=font(14), anchor='ma')
    for y in yt:
        draw.line([(x0, py(y)), (x1, py(y))], fill=(225, 225, 225))
        draw.text((x0 - 6, py(y)), f'{y:g}', fill='black', font=font(11), anchor='rm')
    labels = [str(label) for label in xlabels or [f'{x:g}' for x in xticks]]
    gap = min((px(b) - px(a) for a, b in zip(xticks, xticks[1:])), default=x1 - x0)
    stagger = max(draw.textlength(label, font=font(11)) for label in labels) + 6 > gap  # else they overlap
    for i, (x, label) in enumerate(zip(xticks, labels)):
        down = 14 * (stagger and i % 2)  # every other label one row lower
        draw.line([(px(x), y1), (px(x), y1 + 4 + down)], fill='black')
        draw.text((px(x), y1 + 6 + down), label, fill='black', font=font(11), anchor='ma')
    draw.rectangle([x0, y0, x1, y1], outline='black')
    draw.text(((x0 + x1) / 2, y1 + 22 + 14 * stagger), xlabel, fill='black', font=font(12), anchor='ma')
    draw.text((x0 - 50, y0 - 6), ylabel, fill='black', font=font(11), anchor='ld')
    for label, y in hlines:
        for xs in range(int(x0), int(x1), 12):
            draw.line([(xs, py(y)), (min(xs + 6, x1), py(y))], fill=(90, 90, 90), width=2)
        draw.text((x1 - 4, py(y) + 4), label, fill=(90, 90, 90), font=font(11), anchor='ra')  # under the line
    for i, (label, xs, values, errs) in enumerate(series):
        c = PALETTE[i % len(PALETTE)]
        points = [(px(x), py(y)) for x, y in zip(xs, values) if y is not None and math.isfinite(y)]
        if lines and len(points) > 1:
            draw.line(points, fill=c, width=2)
        for j, (x, y) in enumerate(zip(xs, values)):
            if y is None or not math.isfinite(y):
                continue
            if errs and errs[j]:
                draw.line([(px(x), py(y - errs[j])), (px(x), py(y + errs[j]))], fill=c, width=2)
            draw.ellipse([px(x) - 4, py(y) - 4, px(x) + 4, py(y) + 4], fill=c)
    for i, ((label, *_), (dx, row)) in enumerate(zip(series, places)):  # the legend, its rows under the x label
        legend_x, legend_y = x0 + dx, bottom - 12 - 16 * (rows - 1 - row)
        draw.rectangle([legend_x, legend_y - 5, legend_x + 12, legend_y + 5], fill=PALETTE[i % len(PALETTE)])
        draw.text((legend_x + 17, legend_y), str(label), fill='black', font=font(11), anchor='lm')


def charts(path, panels, cols, size):
    """Several charts side by side in one PNG: panels are chart()'s keyword arguments, size one panel's."""
    W, H = size
    img = Image.new('RGB', (min(cols, len(panels)) * W, math.ceil(len(panels) / cols) * H), 'white')
    draw = ImageDraw.Draw(img)
    for i, panel in enumerate(panels):
        chart(draw, ((i % cols) * W, (i // cols) * H, (i % cols + 1) * W, (i // cols + 1) * H), **panel)
    save_png(img, path)


def heatmaps(path, matrices, groups, labels, caption, cell=46):
    """One heat map per matrix {title: (rows, cols)}, a number in every cell, a shared colour scale; the row
    groups {title: [[i, j, ...]]} outlined and bracketed."""
    pad_left, pad_top = 40, 46
    vmax = max(w.abs().max().item() for w in matrices.values())
    R, C = next(iter(matrices.values())).shape
    panel_w, panel_h = pad_left + C * cell + 40, pad_top + R * cell + 10
    img = Image.new('RGB', (panel_w * len(matrices) + 10, panel_h + 30), 'white')
    draw = ImageDraw.Draw(img)
    for p, (name, w) in enumerate(matrices.items()):
        ox = 10 + p * panel_w
        draw.text((ox + pad_left + C * cell / 2, 8), name, fill='black', font=font(14), anchor='ma')
        for j in range(C):
            draw.text((ox + pad_left + (j + 0.5) * cell, 28), f'k{j + 1}', fill='black', font=font(11), anchor='ma')
        for i in range(R):
            y = pad_top + i * cell
            draw.text((ox + pad_left - 6, y + cell / 2), labels[i], fill='black', font=font(12), anchor='rm')
            for j in range(C):
                x, value = ox + pad_left + j * cell, w[i, j].item()
                draw.rectangle([x, y, x + cell - 1, y + cell - 1], fill=diverging(value / vmax))
                draw.text((x + cell / 2, y + cell / 2), f'{value:.2f}', fill='black', font=font(11), anchor='mm')
        xr = ox + pad_left + C * cell
        for g in groups[name]:
            for i in g:
                draw.rectangle([ox + pad_left, pad_top + i * cell, xr - 1, pad_top + (i + 1) * cell - 1],
                               outline=MARK, width=3)
            ya, yb = pad_top + g[0] * cell + cell / 2, pad_top + g[-1] * cell + cell / 2
            draw.line([(xr + 6, ya), (xr + 12, ya), (xr + 12, yb), (xr + 6, yb)], fill=MARK, width=3)
            draw.text((xr + 16, (ya + yb) / 2), '=', fill=MARK, font=font(18), anchor='lm')
    draw.text((10, panel_h + 8), caption, fill='black', font=font(12))
    save_png(img, path)


def overlay(image, w, grid, scale, vmax):
    """image (3, S, S) in [0, 1] with the weights w (h, w) laid over it: red positive, blue negative, the colour's
    strength sqrt(|w| / vmax), so weights near 0 leave the image visible and small ones still show. vmax is shared
    by every map of a figure: a flat map looks faint, a peaked one strong. Returns a PIL image, S*scale wide."""
    t = (w / vmax).clamp(-1, 1).repeat_interleave(image.shape[1] // grid[0], 0)
    t = t.repeat_interleave(image.shape[2] // grid[1], 1)  # (S, S) in [-1, 1]
    red, blue = torch.tensor(diverging(1.0)) / 255, torch.tensor(diverging(-1.0)) / 255
    colour = torch.where(t[None] >= 0, red[:, None, None], blue[:, None, None])  # (3, S, S)
    alpha = 0.85 * t.abs().sqrt()[None]
    out = image * (1 - alpha) + colour * alpha
    return TF.to_pil_image(out).resize((image.shape[2] * scale, image.shape[1] * scale), Image.NEAREST)


def image_grid(path, image, rows, queries, grid):
    """For each row (label, [one (h, w) weight map per query]): the image with the queries marked, then each
    query's map laid over it (overlay), all maps on one colour scale."""
    S = image.shape[1]
    scale, top = max(1, 128 // S), 40
    label_w = max(150, 16 + max(ImageDraw.Draw(Image.new('RGB', (1, 1))).textlength(label, font=font(12))
                                for label, _ in rows))
    label_w = math.ceil(label_w)
    T = S * scale
    img = Image.new('RGB', (label_w + (len(queries) + 1) * (T + 8), top + len(rows) * (T + 8) + 46), 'white')
    draw = ImageDraw.Draw(img)
    plain = TF.to_pil_image(image).resize((T, T), Image.NEAREST)
    vmax = max(tile.abs().max().item() for _, tiles in rows for tile in tiles)
    cell = (T / grid[1], T / grid[0])
    draw.text((label_w + T / 2, top - 8), 'image', fill='black', font=font(12), anchor='md')
    for j, (y, x_) in enumerate(queries):
        draw.text((label_w + (j + 1) * (T + 8) + T / 2, top - 8), f'query ({y},{x_})', fill='black', font=font(12),
                  anchor='md')
    for i, (label, tiles) in enumerate(rows):
        oy = top + i * (T + 8)
        draw.text((label_w - 8, oy + T / 2), label, fill='black', font=font(12), anchor='rm')
        img.paste(plain, (label_w, oy))
        for j, ((y, x_), tile) in enumerate(zip(queries, tiles)):
            ox = label_w + (j + 1) * (T + 8)
            img.paste(overlay(image, tile, grid, scale, vmax), (ox, oy))
            for bx in (label_w, ox):  # the query's patch, on the image and on its own map
                draw.rectangle([bx + x_ * cell[0], oy + y * cell[1], bx + (x_ + 1) * cell[0] - 1,
                                oy + (y + 1) * cell[1] - 1], outline=MARK, width=2)
    draw.text((10, img.height - 40), 'weights on the token grid (class token not drawn), mean over heads;',
              fill='black', font=font(12))
    draw.text((10, img.height - 22), f'red > 0, blue < 0; strength sqrt(|w| / {vmax:.3f}), the largest |w| shown',
              fill='black', font=font(12))
    save_png(img, path)


# ---------------------------------------------------------------------------------------------------
# F1, injectivity: which queries does each attention tell apart?

def injectivity_weights(seed=0, D=8, keys=4):
    """The weights of 8 queries against `keys` keys under each method: rows 0-3 are q, 2q, 3q, 4q (collinear),
    rows 4-7 four random queries. float64, so rows that coincide do so to rounding (~1e-16).

    relu_affine is inline.ReLUAffine, ReLU(A x + b), with a fixed random A (identity + noise, seeded) in place
    of its initial identity, and b = 0, its initial bias: with b = 0 the map is homogeneous, ReLU(A a q) =
    a ReLU(A q), so it confuses q and a*q exactly as relu does. A learned b != 0 moves the confused set off the
    ray {a q} but does not remove it: queries x with A x + b = a (A q + b) get identical weights;
    `relu_affine_bias_check` shows both."""
    g = torch.Generator().manual_seed(seed)
    k = torch.randn(1, 1, keys, D, generator=g, dtype=torch.float64)  # (B, H, N, D) = (1, 1, 4, D)
    q = torch.randn(1, 1, 1, D, generator=g, dtype=torch.float64).abs()  # positive, so relu keeps all of q
    queries = torch.cat([a * q for a in (1, 2, 3, 4)] + [torch.randn(1, 1, 4, D, generator=g, dtype=torch.float64)],
                        dim=2)  # (1, 1, 8, D)
    relu, relu_affine = inline.get_kernel('relu'), inline.get_kernel('relu_affine', D).double()
    with torch.no_grad():
        relu_affine.weight.add_(0.3 * torch.randn(D, D, generator=g, dtype=torch.float64))  # A = I + noise; b = 0
    eye = torch.eye(keys, dtype=torch.float64).expand(1, 1, keys, keys)
    weights = {
        # softmax_attention with V = identity returns its weights: row i of W @ I is row i of W
        'softmax': inline.softmax_attention(queries, k, eye),
        'linear (relu)': inline.linear_attention_weights(relu(queries), relu(k), eps=0),
        'linear (relu_affine)': inline.linear_attention_weights(relu_affine(queries), relu_affine(k), eps=0),
        # inline_weights takes N from the queries (self-attention: as many queries as keys), so 4 at a time
        'InLine (identity)': torch.cat([inline.inline_weights(queries[:, :, i:i + keys], k)
                                        for i in range(0, 8, keys)], dim=2),
    }
    return {name: w[0, 0].detach() for name, w in weights.items()}, (relu_affine, k, q)  # each (8, keys)


def identical_rows(w, tol=1e-12):
    """Groups (lists of row indices, each of 2 or more) of rows equal to within tol."""
    groups, seen = [], set()
    for i in range(len(w)):
        if i in seen:
            continue
        group = [j for j in range(i, len(w)) if (w[i] - w[j]).abs().max().item() <= tol]
        if len(group) > 1:
            groups.append(group)
            seen.update(group)
    return groups


@torch.no_grad()
def relu_affine_bias_check(relu_affine, k, q, seed=1):
    """With a random b > 0 in relu_affine: max |w(q) - w(a q)| (not 0: the ray is no longer confused) and max
    |w(x) - w(x_a)| for x_a = A^-1 (a (A q + b) - b), whose features are collinear (0 to rounding)."""
    A, b = relu_affine.weight, relu_affine.bias
    b.copy_(torch.randn(b.shape, generator=torch.Generator().manual_seed(seed), dtype=b.dtype).abs())
    w = lambda x: inline.linear_attention_weights(relu_affine(x), relu_affine(k), eps=0)[0, 0]  # noqa: E731
    on_ray = torch.cat([a * q for a in (1, 2, 3, 4)], dim=2)  # (1, 1, 4, D)
    on_line = torch.cat([torch.linalg.solve(A, a * (A @ q[0, 0, 0] + b) - b)[None, None, None] for a in (1, 2, 3, 4)],
                        dim=2)  # (1, 1, 4, D)
    spread = lambda x: (w(x) - w(x)[0]).abs().max().item()  # noqa: E731
    return spread(on_ray), spread(on_line)


def cmd_injectivity(args):
    weights, (relu_affine, k, q) = injectivity_weights()
    labels = ['q', '2q', '3q', '4q', 'r1', 'r2', 'r3', 'r4']
    groups = {name: identical_rows(w) for name, w in weights.items()}
    print('F1: attention weights of 8 queries against 4 random keys (D = 8, float64). Rows q..4q are collinear,\n'
          'r1..r4 random. relu_affine: inline.ReLUAffine, ReLU(A x + b), with a fixed random A = I + 0.3 N(0, 1) and\n'
          'b = 0 (its initial bias).\n')
    for name, w in weights.items():
        same = {i: f'= {labels[g[0]]}' for g in groups[name] for i in g[1:]}
        print(f'{name}:')
        print_table(['query', *[f'key {j + 1}' for j in range(w.shape[1])], 'identical to'],
                    [[labels[i], *[f'{x:.4f}' for x in row.tolist()], same.get(i, '')] for i, row in enumerate(w)])
        print()
    print('identical rows: ' + '; '.join(f'{n}: {[[labels[i] for i in g] for g in gs] or "none"}'
                                          for n, gs in groups.items()))
    ray, line = relu_affine_bias_check(relu_affine, k, q)
    print(f'relu_affine with a random b != 0: q..4q differ by up to {ray:.3f}, but x_a = A^-1(a(Aq + b) - b), '
          f'a = 1..4, still coincide (max difference {line:.1e}): the confusion moves, it does not go away.')

    heatmaps(args.png or os.path.join(args.out, 'injectivity.png'), weights, groups, labels,
             'rows q..4q: collinear queries; r1..r4: random. Outlined and bracketed: rows identical to 1e-12. '
             'Colour: weight / max |weight| (blue < 0 < red).')
    return groups


# ---------------------------------------------------------------------------------------------------
# Training runs: every model here is trained by `python train.py`; each finished run appends its record (the
# model, recipe, seed, per-epoch metrics, command line, CPU time, machine) to results/runs.jsonl, kept in the
# repository, and every table and picture is rebuilt from the records: a run with a record is never redone

RECORDS = os.path.join(HERE, 'results', 'runs.jsonl')
# the per-epoch metrics a record keeps; val_correct (train.pack_correct) only the final epoch has
KEPT = ('epoch', 'train_loss', 'lr', 'val_loss', 'val_acc1', 'val_acc5', 'val_images', 'val_correct')


class Run(NamedTuple):
    """One training run: the experiment it trains under, its model (config_key), its recipe (data, budget,
    precision, device and train.py's own recipe: records of two recipes never mix), its seed, train.py's flags."""
    name: str
    config: str
    recipe: dict
    seed: int
    argv: list

    def key(self):
        return record_key(self._asdict())

    def folder(self, out):
        """OUT/runs/<name>-seed<seed>-<digest of the key>: the run's checkpoints, log and CPU time while it trains."""
        return os.path.join(out, 'runs', f'{self.name}-seed{self.seed}-'
                                         f'{hashlib.sha1(self.key().encode()).hexdigest()[:8]}')


def record_key(r):
    return json.dumps([r['config'], r['recipe'], r['seed']], sort_keys=True)


def read_records(path, key=record_key):
    """{key(record): record} of every line of a records file ({} before the first); the first record of a key
    counts. A line that is not a record stops with its number, never skipped."""
    found = {}
    if not os.path.exists(path):
        return found
    with open(path) as f:
        for i, line in enumerate(f, 1):
            try:
                record = json.loads(line)
                found.setdefault(key(record), record)
            except (json.JSONDecodeError, KeyError, TypeError) as e:
                train.fail(f'{path}, line {i}, is not a record ({e}); fix or delete that line')
    return found


def append_record(path, record):
    """One line at the end of the records file, written under an exclusive lock on it and flushed to disk, so
    commands finishing runs at the same moment never interleave their lines."""
    os.makedirs(os.path.dirname(os.path.abspath(path)), exist_ok=True)
    with open(path, 'a') as f:
        fcntl.flock(f, fcntl.LOCK_EX)
        f.write(json.dumps(record) + '\n')
        f.flush()
        os.fsync(f.fileno())


def lock_run(folder, wait=False):
    """An open descriptor holding an exclusive flock on FOLDER/lock, or None when another process holds it (and
    not wait). The train.py process inherits it, so the lock lasts as long as the run, even if paper.py dies."""
    os.makedirs(folder, exist_ok=True)
    fd = os.open(os.path.join(folder, 'lock'), os.O_RDWR | os.O_CREAT)
    try:
        fcntl.flock(fd, fcntl.LOCK_EX | (0 if wait else fcntl.LOCK_NB))
        return fd
    except BlockingIOError:
        os.close(fd)
        return None


def machine(threads):
    """What a record says its run ran on: the CPU (and whether it has AVX-512 BF16 and AMX), the GPU if any."""
    with open('/proc/cpuinfo') as f:
        info = f.read()
    name = re.search(r'model name\s*:\s*(.*)', info)
    return dict(cpu=name.group(1).strip() if name else 'unknown', cores=os.cpu_count(), threads=threads,
                avx512_bf16='avx512_bf16' in info, amx='amx_tile' in info, torch=torch.__version__,
                gpu=torch.cuda.get_device_name() if torch.cuda.is_available() else None)


def run_state(path, epochs):
    """'done' (metrics.jsonl has the last epoch), 'diverged' (train.py stopped on a non-finite loss: a result,
    kept so it is not retried) or None (not started, or interrupted: train.py resumes it)."""
    if os.path.exists(os.path.join(path, 'diverged')):
        return 'diverged'
    try:
        return 'done' if metrics(path)[-1]['epoch'] == epochs else None
    except (FileNotFoundError, IndexError):
        return None


def metrics(path):
    with open(os.path.join(path, 'metrics.jsonl')) as f:
        return [json.loads(line) for line in f]


def make_record(run, folder, state, threads):
    """The record of a run finished in its folder: its CPU and wall time summed over every attempt (cpu.json)."""
    spent = read_json(os.path.join(folder, 'cpu.json'), {'cpu_s': 0.0, 'wall_s': 0.0})
    log = metrics(folder) if os.path.exists(os.path.join(folder, 'metrics.jsonl')) else []
    return dict(run._asdict(), argv=['train.py', *run.argv], state=state,
                epochs=[{k: e[k] for k in KEPT if k in e} for e in log], cpu_min=round(spent['cpu_s'] / 60, 3),
                wall_min=round(spent['wall_s'] / 60, 3), machine=machine(threads),
                finished=time.strftime('%Y-%m-%d %H:%M:%S'))


def read_json(path, default):
    try:
        with open(path) as f:
            return json.load(f)
    except FileNotFoundError:
        return default


def write_json(path, value):
    with open(path + '.tmp', 'w') as f:
        json.dump(value, f)
    os.replace(path + '.tmp', path)


def train_runs(runs, args, desc='training'):
    """Train each run (Run) without a record in args.results, args.jobs at a time (cores/jobs threads each), as
    `python train.py ARGV --output-dir FOLDER`, holding a lock on FOLDER: a run another command is training is
    left to it and waited for at the end. Each finished run appends its record; an interrupted one resumes when
    rerun. Stopped (SIGTERM, Ctrl-C, a failed run), it stops the running train.py (they save) and keeps their
    CPU time. With args.no_train nothing is trained. Returns {run key: record} of the runs that have one."""
    threads = max(1, (os.cpu_count() or 1) // args.jobs)
    todo = [r for r in runs if r.key() not in read_records(args.results)]
    if len(todo) < len(runs):
        print(f'{len(runs) - len(todo)} of {len(runs)} runs have their record in {args.results}')
    if todo and args.no_train:
        print(f'--no-train: {len(todo)} runs without a record are left out')
        todo = []
    count, cpu_before, running, waiting = len(todo), children_cpu_s(), {}, []
    env = dict(os.environ, **({'CUDA_VISIBLE_DEVICES': ''} if args.device == 'cpu' else {}))
    bar = tqdm(total=count, desc=desc, dynamic_ncols=True)
    stop = signal.signal(signal.SIGTERM, lambda *_: sys.exit(143))  # SIGTERM unwinds through the finally below
    try:
        while todo or running or waiting:
            while todo and len(running) < args.jobs:
                run = todo.pop(0)
                folder = run.folder(args.out)
                lock = lock_run(folder)
                if lock is None:  # another command is training it
                    waiting.append(run)
                    continue
                state = run_state(folder, run.recipe['epochs'])
                if run.key() in read_records(args.results) or state:  # finished meanwhile, or never recorded
                    if run.key() not in read_records(args.results):
                        append_record(args.results, make_record(run, folder, state, threads))
                    os.close(lock)
                    bar.update()
                    continue
                running[run.key()] = (*launch(run, folder, lock, threads, env), run, lock, time.time())
            if not running:
                if waiting:  # only other commands' runs are left: wait for the first to end, then take it up again
                    run = waiting.pop(0)
                    os.close(lock_run(run.folder(args.out), wait=True))
                    todo.append(run)
                continue
            key, cpu_s = wait_any(running)
            proc, log, run, lock, start = running.pop(key)
            log.close()
            folder = run.folder(args.out)
            spend(folder, cpu_s, time.time() - start)
            check_ended(proc, run, folder)
            append_record(args.results, make_record(run, folder, run_state(folder, run.recipe['epochs']), threads))
            os.close(lock)
            bar.update()
    finally:  # the runs still going are stopped (train.py saves on SIGTERM; a rerun resumes them), their CPU kept
        signal.signal(signal.SIGTERM, stop)
        for proc, *_ in running.values():
            proc.terminate()
        for proc, log, run, lock, start in running.values():
            before = children_cpu_s()
            proc.wait()
            spend(run.folder(args.out), children_cpu_s() - before, time.time() - start)
    bar.close()
    if count:  # CPU time hardly depends on what else the machine runs; wall time does
        cpu = children_cpu_s() - cpu_before
        print(f'{count} train.py runs took {cpu / 60:.1f} CPU-minutes ({cpu / 60 / count:.1f} per run): '
              f'about {cpu / 60 / (threads * args.jobs):.1f} min of wall time on {threads * args.jobs} cores of '
              f'their own')
    records = read_records(args.results)
    return {r.key(): records[r.key()] for r in runs if r.key() in records}


def launch(run, folder, lock, threads, env):
    """Start `python train.py ARGV --output-dir FOLDER` (output appended to FOLDER/train.log), handing it the run's
    lock: (the process, its open log)."""
    log = open(os.path.join(folder, 'train.log'), 'a')
    argv = [sys.executable, os.path.join(HERE, 'train.py'), *run.argv, '--output-dir', folder, '--threads',
            str(threads)]
    log.write('$ ' + ' '.join(argv) + '\n')
    log.flush()
    return subprocess.Popen(argv, stdout=log, stderr=subprocess.STDOUT, cwd=HERE, env=env, pass_fds=(lock,)), log


def check_ended(proc, run, folder):
    """A train.py that stopped on a non-finite loss leaves FOLDER/diverged (a result, not retried); any other
    failure, or an exit before the last epoch, stops paper.py with the end of its log."""
    with open(os.path.join(folder, 'train.log')) as f:
        tail = f.read()[-3000:]
    if proc.returncode and 'the loss is not finite' in tail:
        with open(os.path.join(folder, 'diverged'), 'w') as f:
            f.write(tail[tail.rfind('error:'):])
    elif proc.returncode or run_state(folder, run.recipe['epochs']) != 'done':
        train.fail(f'train.py failed (exit {proc.returncode}) in {folder}; its log ends:\n{tail}')


def spend(folder, cpu_s, wall_s):
    """Add one attempt's CPU and wall seconds to FOLDER/cpu.json, the run's total over its attempts."""
    spent = read_json(os.path.join(folder, 'cpu.json'), {'cpu_s': 0.0, 'wall_s': 0.0})
    write_json(os.path.join(folder, 'cpu.json'), {'cpu_s': spent['cpu_s'] + cpu_s, 'wall_s': spent['wall_s'] + wall_s})


def children_cpu_s():
    """User + system CPU seconds of every finished child process so far (the train.py runs)."""
    usage = resource.getrusage(resource.RUSAGE_CHILDREN)
    return usage.ru_utime + usage.ru_stime


def wait_any(running):
    """(the first of the running {key: (process, ...)} to finish, its CPU seconds): the children's CPU time grows
    by exactly the process that poll() reaps."""
    while True:
        for key, (proc, *_) in running.items():
            before = children_cpu_s()
            if proc.poll() is not None:
                return key, children_cpu_s() - before
        time.sleep(0.5)


def load_trained(path):
    """A model trained by train.py, rebuilt from its checkpoint: 'args' names the variant, 'arch' holds the
    overrides it was built with, 'model' the weights (loaded by models.load_checkpoint, strict on parameters)."""
    ckpt = train.read_checkpoint(path)  # a clear error for a missing or unreadable file
    if not isinstance(ckpt, dict) or not {'model', 'arch', 'args'} <= ckpt.keys():
        train.fail(f'{path} is not a checkpoint written by train.py (it needs model, arch and args)')
    try:
        model = models.create_model(ckpt['args']['model'], checkpoint=ckpt['model'], **ckpt['arch'])
    except (ValueError, RuntimeError, KeyError) as e:
        train.fail(f'cannot rebuild the model of {path}: {e}')
    return model.eval(), ckpt


# ---------------------------------------------------------------------------------------------------
# F4 and F3: the explicit N x N weights of each layer of small trained DeiT models, and Eq. 6's share beside them

F4_MODELS = {'softmax': 's_deit_t', 'linear (relu)': 'deit_linear_relu', 'InLine without Eq. 6': 'deit_no_residual',
             'InLine': 'inline_deit_t'}  # label: experiment; softmax is the S row's miniature (one head of 64)
F4_EXTRA = {  # the ablations' miniature DeiT with vanilla linear attention, and InLine without Eq. 6
    'deit_linear_relu': models.Experiment('inline_deit_t', dict(layout='L', kernel='relu', residual='none'), 'F4',
                                          None, True, 'DeiT miniature, vanilla linear attention (relu), no Eq. 6'),
    'deit_no_residual': models.Experiment('inline_deit_t', dict(residual='none'), 'F4', None, True,
                                          'InLine-DeiT miniature without Eq. 6')}


def deit_runs(args, seeds):
    """{label: [checkpoint of each seed]}: the four models F4 and F3 look at by default, the ablations' miniature
    DeiT (64 px images, 8 px patches: an 8x8 token grid, on which a 3x3 neighbourhood is 9 of 64 tokens; 6 blocks of
    width 64) trained with the ablations' budget and data; the runs the ablations share are not trained twice."""
    resolve_budget(args)
    every = {**experiments(), **F4_EXTRA}
    runs, planned = plan_runs({n: every[n] for n in F4_MODELS.values()}, every, lambda name: seeds, args)
    train_runs(runs, args, desc='training the four DeiT models')
    return {label: [(r.key(), os.path.join(r.folder(args.out), train.CHECKPOINT)) for r in planned[n]]
            for label, n in F4_MODELS.items()}


def checkpoints(args, seeds=1):
    """{name: [(run key or None, checkpoint)]}: --checkpoints NAME=PATH ... (a name given again is another seed
    of it), or the four small DeiTs (trained on first use), each with the key of its run record."""
    if not args.checkpoints:
        resolve_data(args, need=not args.no_train)
        return deit_runs(args, seeds)
    found = {}
    for c in args.checkpoints:
        name, path = c.split('=', 1) if '=' in c else (os.path.basename(os.path.dirname(c)) or c, c)
        found.setdefault(name, []).append((None, path))
    return found


def eval_images(ckpt, model, args, count, spread=True):
    """(images (B, 3, S, S) as the model saw them, labels, class names, what they are): `count` validation images,
    evenly spaced through the set (else the first `count`), of the data the checkpoint was trained on (its stored
    arguments), or of --dataset/--data-path when given."""
    ns = train.get_args_parser().parse_args([])
    vars(ns).update({k: v for k, v in ckpt.get('args', {}).items() if k in vars(ns)})
    if args.dataset:
        resolve_data(args)
        ns.dataset, ns.data_path = args.dataset, args.data_path
    ns.dataset = train.dataset(ns)
    ns.img_size, ns.download, ns.train_subset, ns.seed = model.img_size[0], False, None, ns.seed or 0
    ns.synthetic_train, ns.synthetic_val, ns.model = 1, max(count, ns.synthetic_val or 0), ns.model or 'inline_deit_t'
    with contextlib.redirect_stdout(io.StringIO()):
        val = train.load_data(ns)[1]
    picked = range(0, len(val), max(1, len(val) // count) if spread else 1)[:count]
    x, y = zip(*(val[i] for i in picked))
    return torch.stack(x), torch.tensor(y), val.classes, f'{len(picked)} {ns.dataset} validation images'


def attention_inputs(model, images):
    """[x] per block: the input (B, N, C) each block's attention gets, seen by a forward pre-hook."""
    if getattr(model, 'family', None) != 'deit':
        train.fail(f'this needs an isotropic DeiT model (one token grid, layers in order); got '
                   f'{type(model).__name__}')
    captured = {}
    handles = [block.attn.register_forward_pre_hook(lambda module, inputs, i=i: captured.__setitem__(i, inputs[0]))
               for i, block in enumerate(model.blocks)]
    try:
        with torch.no_grad():
            model(images)
    finally:
        for h in handles:
            h.remove()
    return [captured[i] for i in range(len(model.blocks))]


def attention_weights(model, images):
    """[(B, H, N, N)] per block: the explicit weights of every block's attention for the input it really gets."""
    with torch.no_grad():
        return [block.attn.weights(x, model.grid) for block, x in zip(model.blocks, attention_inputs(model, images))]


def neighbourhood(grid):
    """(h*w, h*w) boolean: token j is in the 3x3 neighbourhood of token i (itself included)."""
    y, x = torch.meshgrid(torch.arange(grid[0]), torch.arange(grid[1]), indexing='ij')
    y, x = y.flatten(), x.flatten()
    return ((y[:, None] - y[None, :]).abs() <= 1) & ((x[:, None] - x[None, :]).abs() <= 1)


def weight_shares(w, grid):
    """{'class', 'own', 'near'}: (H,) means over images and grid queries of w (B, H, N, N), whose last h*w tokens
    are the grid (DeiT's class token first). class: the weight on the class token. own and near: the query's own
    token and the other 8 of its 3x3 neighbourhood, among the grid weights renormalised without the class token,
    w_ij / (1 - w_i,cls), so a class token that takes much weight does not look like a loss of locality."""
    hw = grid[0] * grid[1]
    P = w.shape[-1] - hw
    cls = w[:, :, P:, :P].sum(-1)  # (B, H, hw)
    g = w[:, :, P:, P:] / (1 - cls).clamp_min(1e-6)[..., None]  # (B, H, hw, hw), rows sum to 1
    near = neighbourhood(grid) & ~torch.eye(hw, dtype=torch.bool)
    return {'class': cls.mean((0, 2)), 'own': g.diagonal(dim1=-2, dim2=-1).mean((0, 2)),
            'near': (g * near.to(g.dtype)).sum(-1).mean((0, 2))}


def eq6_share(attn, x, grid):
    """(H,): Eq. 6's share of each grid token's output, |res_i| / (|att_i| + |res_i|) per head (0 without Eq. 6),
    the mean over images and tokens; att_i = sum_j w_ij v_j is Eq. 5's part, res_i Eq. 6's, which the N x N weights
    do not hold (its weights are per channel)."""
    if getattr(attn, 'residual', None) is None:
        return torch.zeros(attn.num_heads)
    x, q, k, v = attn.project(x, grid)
    P = v.shape[2] - grid[0] * grid[1]
    att = (attn.explicit_weights(q, k) @ v)[:, :, P:]  # Eq. 5, (B, H, hw, D)
    r = inline.residual_weights(attn.residual, x)  # (B, T*C)
    res = inline.local_residual(v, r, grid, attn.local_size, attn.dilation)[:, :, P:]  # Eq. 6, (B, H, hw, D)
    return (res.norm(dim=-1) / (att.norm(dim=-1) + res.norm(dim=-1)).clamp_min(1e-12)).mean((0, 2))


@torch.no_grad()
def layer_shares(model, images, batch=128):
    """[{'class', 'own', 'near', 'eq6'}: (H,)] per block, means over the images (in batches)."""
    sums = None
    for i in range(0, len(images), batch):
        xs = attention_inputs(model, images[i:i + batch])
        part = [{**weight_shares(block.attn.weights(x, model.grid), model.grid),
                 'eq6': eq6_share(block.attn, x, model.grid)} for block, x in zip(model.blocks, xs)]
        n = len(images[i:i + batch])
        sums = [{k: v * n + (sums[j][k] if sums else 0) for k, v in layer.items()} for j, layer in enumerate(part)]
    return [{k: v / len(images) for k, v in layer.items()} for layer in sums]


SHARES = {'near': 'other 8 of the 3x3', 'own': 'own token', 'class': 'class token', 'eq6': "Eq. 6's share"}


def initial_model(model, ckpt):
    """The model a trained one's run started from: built as train.py builds it, after torch.manual_seed(its seed)."""
    torch.manual_seed(ckpt['args'].get('seed') or 0)
    return models.create_model(ckpt['args']['model'], **{**ckpt['arch'], 'img_size': model.img_size,
                                                         'num_classes': model.num_classes}).eval()


def measure_locality(path, args, key):
    """F4's measurement of one checkpoint, trained and as its run started, as a record (lists, not tensors):
    kept in results/locality.jsonl beside the run records when the checkpoint is one of theirs (key)."""
    if key and not os.path.exists(path):
        train.fail(f'{path} is not here and results/locality.jsonl has no measurement of it at {args.images} '
                   f'images; rerun without --no-train (it trains the run), or with the --out that holds it')
    model, ckpt = load_trained(path)
    images, _, _, what = eval_images(ckpt, model, args, args.images)
    lists = lambda shares: [{k: v.tolist() for k, v in layer.items()} for layer in shares]  # noqa: E731
    trained = lists(layer_shares(model, images))  # first: it says plainly when the model is not a DeiT
    return dict(run=key, images=args.images, what=what, grid=list(model.grid), trained=trained,
                top1=(ckpt.get('log') or [{}])[-1].get('val_acc1'),
                untrained=lists(layer_shares(initial_model(model, ckpt), images)))


def cmd_locality(args):
    results, top1, grid, what = {}, {}, None, ''
    measures = os.path.join(os.path.dirname(os.path.abspath(args.results)), 'locality.jsonl')
    stored = read_records(measures, key=lambda m: (m['run'], m['images']))
    for name, items in tqdm(checkpoints(args, args.seeds).items(), desc='locality', dynamic_ncols=True):
        for key, path in items:
            m = stored.get((key, args.images)) if key else None
            if m is None:
                m = measure_locality(path, args, key)
                if key:
                    append_record(measures, m)
            for label, shares, acc in ((name, m['trained'], m['top1']), (f'{name}, untrained', m['untrained'], None)):
                results.setdefault(label, []).append([{k: torch.tensor(v) for k, v in layer.items()}
                                                      for layer in shares])
                top1.setdefault(label, []).append(acc)
            if grid not in (None, tuple(m['grid'])):
                train.fail(f'the checkpoints have different token grids ({grid} and {tuple(m["grid"])})')
            grid, what = tuple(m['grid']), m['what']
    hw = grid[0] * grid[1]
    uniform = {'own': 1 / hw, 'near': (neighbourhood(grid).sum().item() - hw) / hw / hw}  # 1/hw each
    stat = lambda v: (statistics.mean(v), statistics.stdev(v) if len(v) > 1 else 0.0)  # noqa: E731
    print(f'F4: per layer, means over {what}, the {grid[0]}x{grid[1]} grid queries and the heads (per head in '
          f'brackets), ± the standard deviation over seeds. Own token and the other 8 of the 3x3: among the grid '
          f'weights renormalised without the class token; uniform weights give {uniform["own"]:.4f} and '
          f'{uniform["near"]:.4f}. Eq. 6\'s share: |Eq. 6| / (|Eq. 5| + |Eq. 6|) of each output. "untrained": the '
          f'same model at the weights its run started from; the last column, the 3x3 share trained minus untrained, '
          f'seed by seed, with its 95% Student-t interval: what training did to locality at this budget.\n')
    rows, curves = [], {k: [] for k in SHARES}
    for name, per_seed in results.items():
        accs = [a for a in top1[name] if a is not None]
        start = results.get(f'{name}, untrained')
        for layer in range(len(per_seed[0])):
            cells = []
            for key in SHARES:
                heads = torch.stack([seed[layer][key] for seed in per_seed])  # (seeds, H)
                m, s = stat(heads.mean(1).tolist())
                cells.append(f'{m:.3f} ± {s:.3f} (' + ' / '.join(f'{h:.2f}' for h in heads.mean(0).tolist()) + ')')
            moved = ''
            if start and len(per_seed) > 1:  # seed by seed: the trained model against the one it started from
                mean, half = interval([(a[layer]['near'] - b[layer]['near']).mean().item()
                                       for a, b in zip(per_seed, start)])
                moved = f'{mean:+.3f} [{mean - half:+.3f}, {mean + half:+.3f}]'
            rows.append([name, layer + 1, (f'{statistics.mean(accs):.1f} ({len(accs)} seeds)' if accs else '—')
                         if layer == 0 else '', *cells, moved])
        for key in SHARES:
            series = [stat([seed[layer][key].mean().item() for seed in per_seed]) for layer in range(len(per_seed[0]))]
            curves[key].append((name, list(range(1, len(series) + 1)), [m for m, _ in series], [s for _, s in series]))
    print_table(['model', 'layer', 'top-1', *SHARES.values(), '3x3: trained − untrained [95% CI]'], rows)
    layers = max(len(s[1]) for s in curves['near'])
    charts(args.png or os.path.join(args.out, 'locality.png'), [dict(
        series=curves[key], title=f'F4: {label}, by layer', xlabel='layer', ylabel='share',
        xticks=list(range(1, layers + 1)),
        hlines=[(f'uniform ({uniform[key]:.3f})', uniform[key])] if key in uniform else [])
        for key, label in SHARES.items()], cols=2, size=(520, 380))
    return results, uniform


def read_image(path, size):
    """An image file as the models see it: RGB, resized to size x size (bicubic), normalised like train.py's data."""
    try:
        with Image.open(path) as img:
            img = img.convert('RGB')
    except Exception as e:
        train.fail(f'cannot read image {path}: {e}')
    x = TF.to_tensor(img.resize((size, size), Image.BICUBIC))  # (3, size, size) in [0, 1]
    return TF.normalize(x, train.MEAN, train.STD)


def cmd_maps(args):
    loaded = {name: load_trained(items[0][1]) for name, items in checkpoints(args).items()}  # the first seed
    sizes = {m.img_size for m, _ in loaded.values()}
    grids = {m.grid for m, _ in loaded.values()}
    if len(sizes) > 1 or len(grids) > 1:
        train.fail(f'the checkpoints take different images or grids ({sizes}, {grids}); maps compares '
                   f'one image across models of one size')
    (S, _), grid = sizes.pop(), grids.pop()
    if args.image:
        x, what = read_image(args.image, S), args.image
    else:
        model, ckpt = next(iter(loaded.values()))
        images, labels, classes, what = eval_images(ckpt, model, args, args.index + 1, spread=False)
        x, what = images[args.index], f'{what.split()[1]} validation image {args.index} ({classes[labels[args.index]]})'
    queries = [tuple(int(v) for v in q.split(',')) for q in args.queries]
    if any(not (0 <= y < grid[0] and 0 <= x_ < grid[1]) for y, x_ in queries):
        train.fail(f'--queries must lie on the {grid[0]}x{grid[1]} token grid (row,col from 0)')
    image = (x * torch.tensor(train.STD)[:, None, None] + torch.tensor(train.MEAN)[:, None, None]).clamp(0, 1)
    P = 1  # DeiT's class token, before the grid
    rows, table = [], []
    for name, (model, _) in loaded.items():
        weights = attention_weights(model, x[None])
        layers = [int(layer) for layer in args.layers] or [1, len(weights)]
        for layer in layers:
            if not 1 <= layer <= len(weights):
                train.fail(f'--layers: {name} has layers 1..{len(weights)}, not {layer}')
            w = weights[layer - 1][0].mean(0)  # (N, N), the mean over heads
            tiles = []
            for y, x_ in queries:
                row = w[P + y * grid[1] + x_]  # (N,) the query's weights
                tiles.append(row[P:].reshape(grid))
                local = (row[P:] * neighbourhood(grid)[y * grid[1] + x_]).sum().item()
                table.append([name, layer, f'({y},{x_})', f'{row[P + y * grid[1] + x_].item():.3f}', f'{local:.3f}',
                              f'{row[0].item():.3f}', f'{row[P:].min().item():.3f}', f'{row[P:].max().item():.3f}'])
            rows.append((f'{name}, layer {layer}', tiles))
    print(f'F3: attention weights of {len(queries)} query tokens in {what}, the mean over heads (Eq. 6 not among '
          f'them: F4 gives its share)\n')
    print_table(['model', 'layer', 'query (row,col)', 'on itself', 'on its 3x3', 'on the class token', 'min', 'max'],
                table)

    image_grid(args.png or os.path.join(args.out, 'maps.png'), image, rows, queries, grid)
    return rows


# ---------------------------------------------------------------------------------------------------
# F5b, F5c: images/s of softmax models against their InLine versions, as the window or the image grows

SPEED = {  # figure: (what varies, its values, the GPU speed-ups of InLine over softmax in the paper's Fig. 5b, 5c)
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
                models.create_model('inline_swin_t', window=point, fast=True))
    else:
        pair = (models.create_model('inline_deit_t', layout='S', num_heads=3, img_size=point),
                models.create_model('inline_deit_t', img_size=point, fast=True))
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
    """Softmax is timed as users run it, through F.scaled_dot_product_attention, never the N x N teaching form."""
    with torch.no_grad(), CountSoftmax() as count:
        model(x)
    if count.sdpa == 0 or count.explicit:
        train.fail(f'the softmax model made {count.sdpa} SDPA calls and {count.explicit} explicit '
                         f'softmax calls; speed times softmax only through F.scaled_dot_product_attention')


def speed_point(figure, point, dtype, device, batch, rounds):
    """Interleaved rounds (softmax then InLine, one forward each) at one point: images/s of each, and the
    speed-up as the median over rounds of softmax time / InLine time (the machine's drift cancels in a round)."""
    softmax, inline_model = speed_models(figure, point, device)
    x = torch.randn(batch, 3, *softmax.img_size, generator=torch.Generator().manual_seed(0)).to(device)
    check_sdpa(softmax, x[:1])

    def forward(model):
        with torch.inference_mode(), torch.autocast(device.type, dtype=dtype, enabled=dtype != torch.float32):
            model(x)

    ms = kernels.time_interleaved({'softmax': lambda: forward(softmax), 'InLine': lambda: forward(inline_model)},
                                  device, budget_s=1e9, max_rounds=rounds)  # exactly `rounds` rounds
    return dict(figure=figure, point=point, device=device.type, dtype=str(dtype).replace('torch.', ''), batch=batch,
                rounds=rounds, softmax_img_s=batch / statistics.median(ms['softmax']) * 1e3,
                inline_img_s=batch / statistics.median(ms['InLine']) * 1e3,
                speedup=kernels.paired_ratio(ms, 'softmax', 'InLine'))


def cmd_speed(args):
    if args.dense:
        return cmd_speed_dense(args)
    if args.whole:
        return cmd_speed_whole(args)
    devices = [torch.device('cpu')] + ([torch.device('cuda')] if torch.cuda.is_available() else [])
    dtypes = [torch.float32, torch.bfloat16]
    points = [(fig, p) for fig, (_, values, _) in SPEED.items() for p in (SPEED_QUICK[fig] if args.quick else values)]
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
    amx = getattr(torch.cpu, '_is_amx_tile_supported', lambda: False)()  # private, so guarded; bf16's speed turns on it
    print(f'\nF5b: Swin-T, softmax (SSSS, window w) vs InLine-Swin-T (window w), 224 px; F5c: DeiT-T, softmax vs '
          f'InLine, image size varied. Inference (eval, inference_mode), softmax through SDPA, InLine through the '
          f'fast core; speed-up = median of per-round ratios. CPU: {torch.get_num_threads()} threads, '
          f'{torch.backends.cpu.get_cpu_capability()}; {why}, so train.py defaults to {cpu_amp} there.\n')
    print_table(['figure', 'point', 'device', 'dtype', 'batch', 'softmax img/s', 'InLine img/s', 'InLine speed-up',
                 'paper (GPU)'],
                [[r['figure'], f"{r['point']}²" if r['figure'] == 'F5b' else f"{r['point']} px", r['device'], r['dtype'],
                  r['batch'], f"{r['softmax_img_s']:.2f}", f"{r['inline_img_s']:.2f}", f"{r['speedup']:.2f}x",
                  f"{SPEED[r['figure']][2][r['point']]}x" if r['point'] in SPEED[r['figure']][2] else '']
                 for r in rows])
    panels = []
    for fig, (what, values, paper) in SPEED.items():
        series = [(f'{dev} {dt}' + ((' (AMX)' if amx else ' (no AMX)') if (dev, dt) == ('cpu', 'bfloat16') else ''),
                   [r['point'] for r in sel], [r['speedup'] for r in sel], None)
                  for dev in dict.fromkeys(r['device'] for r in rows) for dt in ('float32', 'bfloat16')
                  for sel in [[r for r in rows if (r['figure'], r['device'], r['dtype']) == (fig, dev, dt)]] if sel]
        series.append(('paper, GPU', list(paper), list(paper.values()), None))
        panels.append(dict(series=series, xlabel=what, log_x=True, ylabel='InLine speed-up (x)', xticks=list(values),
                           title=('F5b: Swin-T vs InLine-Swin-T, by window' if fig == 'F5b' else
                                  'F5c: DeiT-T vs InLine-DeiT-T, by size'),
                           hlines=[('equal speed', 1.0)], xlabels=[f'{v}x{v}' if fig == 'F5b' else str(v) for v in values]))
    charts(args.png or os.path.join(args.out, 'speed.png'), panels, cols=2, size=(500, 420))
    if args.model_step:
        model_step_table([torch.device('cpu')] + devices[1:], dtypes)
    return rows


def free_core(q, k, v, r, grid, *options):
    """A stand-in for the InLine core that costs nothing, o = v: a step with it is as fast as any core can make
    it (the projections, r and everything else still run)."""
    return v


def model_step(dtype, device, batch=8):
    """One training step of InLine-Swin-T at 224 px (forward, loss, backward): reference core, fast core, fast
    core under whole-model torch.compile, and every InLine core replaced by free_core (the bound: Amdahl's law).
    Returns ms per step (medians over interleaved rounds) and speed-ups (medians of per-round ratios)."""
    gen = torch.Generator(device).manual_seed(0)
    x = torch.randn(batch, 3, 224, 224, generator=gen, device=device)
    y = torch.randint(0, 1000, (batch,), generator=gen, device=device)
    reference = models.create_model('inline_swin_t', drop_path_rate=0.0).to(device)
    fast = models.create_model('inline_swin_t', drop_path_rate=0.0, fast=True).to(device)
    fast.load_state_dict(reference.state_dict())
    free = models.create_model('inline_swin_t', drop_path_rate=0.0).to(device)
    free.load_state_dict(reference.state_dict())
    kernels.enable_fast(free, core=free_core)

    def step(model):
        with torch.autocast(device.type, dtype=dtype, enabled=dtype != torch.float32):
            loss = F.cross_entropy(model(x), y)
        loss.backward()
        model.zero_grad(set_to_none=True)

    compiled = torch.compile(fast)
    ms = kernels.time_interleaved({'reference': lambda: step(reference), 'fast': lambda: step(fast),
                                   'fast + compile': lambda: step(compiled), 'free core': lambda: step(free)},
                                  device, budget_s=60, max_rounds=15)
    return {name: (statistics.median(t), kernels.paired_ratio(ms, 'reference', name)) for name, t in ms.items()}


def model_step_table(devices, dtypes):
    rows = []
    for device in devices:
        for dtype in dtypes:
            step = model_step(dtype, device)
            rows.append([device.type, str(dtype)[6:], *[f'{t:.0f} ms ({r:.2f}x)' for t, r in step.values()]])
    print('\nA whole InLine-Swin-T training step, batch 8, 224 px (ms, speed-up over the reference). The free core '
          'returns v and costs nothing: no InLine core can make the step faster than that.\n')
    print_table(['device', 'dtype', 'reference core', 'fast core', 'fast core + whole-model torch.compile',
                 'free core (the bound)'], rows)


# ---------------------------------------------------------------------------------------------------
# python paper.py speed --whole: whole models, InLine against the softmax original a user would pick instead

WHOLE = (  # (what, InLine model, its softmax original (models.EXPERIMENTS), image side, batch on CPU, training step?)
    ('InLine-Swin-T inference', 'inline_swin_t', 's_swin_t', 224, 32, False),
    ('InLine-Swin-T training step', 'inline_swin_t', 's_swin_t', 224, 8, True),
    ('InLine-DeiT-T inference', 'inline_deit_t', 's_deit_t', 224, 1, False),
    ('InLine-DeiT-T inference', 'inline_deit_t', 's_deit_t', 512, 1, False),
    ('InLine-DeiT-T inference', 'inline_deit_t', 's_deit_t', 1024, 1, False),
)


def whole_step(model, x, y, dtype, training):
    """One forward (eval, inference_mode) or one training step (forward, cross-entropy, backward) under autocast."""
    autocast = torch.autocast(x.device.type, dtype=dtype, enabled=dtype != torch.float32)
    if not training:
        with torch.inference_mode(), autocast:
            return model(x)
    with autocast:
        loss = F.cross_entropy(model(x), y)
    loss.backward()
    model.zero_grad(set_to_none=True)


def without_infer(model, f):
    """f() with every InLine module's inference graph (kernels.infer_fast) off: Eq. 6's weights, then the fast core,
    two calls, as the fast path ran inference before that graph."""
    saved = [(m, m.infer) for m in model.modules() if getattr(m, 'infer', None) is not None]
    for m, _ in saved:
        m.infer = None
    try:
        return f()
    finally:
        for m, infer in saved:
            m.infer = infer


def whole_point(row, dtype, device, rounds, compiled):
    """One row of --whole at one dtype: ms of the softmax original, of InLine through the fast core, for inference
    also without its inference graph (without_infer), and (compiled) of InLine under whole-model torch.compile, in one
    interleaved run; speed-ups as medians of per-round ratios."""
    what, name, softmax_name, side, batch, training = row
    drop = dict(drop_path_rate=0.0)  # no random depth: every round runs the same blocks
    softmax = models.create_experiment(softmax_name, img_size=side, **drop).train(training).to(device)
    inline_model = models.create_model(name, img_size=side, fast=True, **drop).train(training).to(device)
    gen = torch.Generator().manual_seed(0)
    x, y = torch.randn(batch, 3, side, side, generator=gen).to(device), torch.randint(0, 1000, (batch,)).to(device)
    if not training:
        check_sdpa(softmax, x[:1])
    fns = {'softmax': lambda: whole_step(softmax, x, y, dtype, training),
           'InLine': lambda: whole_step(inline_model, x, y, dtype, training)}
    if not training:
        fns['two_calls'] = lambda: without_infer(inline_model, lambda: whole_step(inline_model, x, y, dtype, False))
    if compiled:
        compiled_model = torch.compile(inline_model)
        fns['compiled'] = lambda: whole_step(compiled_model, x, y, dtype, training)
    ms = kernels.time_interleaved(fns, device, budget_s=1e9, max_rounds=rounds)
    out = dict(what=what, side=side, batch=batch, dtype=str(dtype)[6:], device=device.type, rounds=rounds,
               **{f'{n}_ms': statistics.median(t) for n, t in ms.items()},
               speedup=kernels.paired_ratio(ms, 'softmax', 'InLine'),
               two_calls_speedup=None if training else kernels.paired_ratio(ms, 'softmax', 'two_calls'))
    if compiled:
        out.update(compiled_speedup=kernels.paired_ratio(ms, 'softmax', 'compiled'),
                   compiled_over_fast=kernels.paired_ratio(ms, 'InLine', 'compiled'))
    return out


PROFILE_GROUPS = {  # top-level operator -> what it is in a ViT forward
    'aten::linear': 'Linear layers (qkv, proj, MLP, head)', 'aten::layer_norm': 'LayerNorm',
    'aten::gelu': "GELU (the MLP's)", 'aten::scaled_dot_product_attention': 'softmax attention (SDPA)',
    'aten::add': 'residual adds', 'aten::conv2d': 'patch embedding', 'aten::cat': 'class token and position',
    'aten::to': 'casts and copies', 'aten::contiguous': 'casts and copies', 'aten::copy_': 'casts and copies',
}
CORE_LABEL = "InLine core with Eq. 6's weights, one graph (kernels.infer_fast)"
PREDICTOR_LABEL = 'Eq. 6 predictor (residual_weights)'


def forward_profile(model, x, dtype, rounds=5):
    """Where one forward (eval, inference_mode, batch 1) spends its time: {group: (ms, calls) per forward}, from
    torch.profiler's top-level operators, grouped by PROFILE_GROUPS; the InLine core and Eq. 6's predictor are
    labelled around their calls (with no gradient the fast path computes both in one graph, kernels.infer_fast), and
    the core split into its compiled graph's kernels (inductor's code and the GEMMs
    it calls), dynamo's guards and wrappers around them, and its call in Python (checks, the table)."""
    cores = [m for m in model.modules() if getattr(m, 'core', None) is not None]
    saved = [(m, m.core, m.infer) for m in cores], inline.residual_weights
    for m in cores:
        m.core = functools.partial(labelled_call, CORE_LABEL, m.core)
        m.infer = m.infer and functools.partial(labelled_call, CORE_LABEL, m.infer)
    inline.residual_weights = functools.partial(labelled_call, PREDICTOR_LABEL, inline.residual_weights)
    try:
        for _ in range(2):
            whole_step(model, x, None, dtype, False)
        with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CPU]) as prof:
            for _ in range(rounds):
                whole_step(model, x, None, dtype, False)
    finally:
        for m, core, infer in saved[0]:
            m.core, m.infer = core, infer
        inline.residual_weights = saved[1]
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
    print(f"\nWhole models, InLine through the fast core against the softmax original built with F.scaled_dot_product_"
          f"attention, the same sizes; {rounds} interleaved rounds, ms = median, speed-up = median of per-round "
          f"ratios (softmax time / InLine time: above 1, InLine is faster); without the inference graph: Eq. 6's weights "
          f"and the fast core as two calls, as the fast path ran inference before kernels.infer_fast. {device.type}: "
          f"{info['cpu']}, "
          f"AVX-512 BF16 {'yes' if info['avx512_bf16'] else 'no'}, AMX {'yes' if info['amx'] else 'no'}, "
          f"{info['threads']} threads, torch {info['torch']}.\n")
    header = ['model', 'image', 'batch', 'dtype', 'softmax ms', 'InLine ms', 'InLine speed-up',
              'speed-up without the inference graph']
    if args.compile:
        header += ['InLine compiled ms', 'compiled speed-up', 'compiled / fast core alone']
    print_table(header, [[r['what'], f"{r['side']} px", r['batch'], r['dtype'], f"{r['softmax_ms']:.1f}",
                          f"{r['InLine_ms']:.1f}", f"{r['speedup']:.2f}x",
                          '—' if r['two_calls_speedup'] is None else f"{r['two_calls_speedup']:.2f}x"] + ([
                          f"{r['compiled_ms']:.1f}", f"{r['compiled_speedup']:.2f}x", f"{r['compiled_over_fast']:.2f}x"]
                          if args.compile else []) for r in rows])
    x = torch.randn(1, 3, 224, 224, generator=torch.Generator().manual_seed(0)).to(device)
    profiles = {}
    for name, model in (('InLine-DeiT-T', models.create_model('inline_deit_t', fast=True)),
                        ('DeiT-T', models.create_experiment('s_deit_t'))):
        for dtype in dtypes:
            profiles[f'{name} {str(dtype)[6:]}'] = forward_profile(model.eval().to(device), x, dtype)
    groups = dict.fromkeys(g for p in profiles.values() for g in sorted(p, key=lambda g: -p[g][0]))
    order = []
    for g in (g for g in groups if not g.startswith('  ')):  # the core's parts under it
        order += [g] + ([s for s in groups if s.startswith('  ')] if g == CORE_LABEL else [])
    print(f"\nWhere a forward of batch 1 at 224 px spends its time (eval, inference_mode; torch.profiler, the mean "
          f"of 5 forwards; ms per forward, with calls per forward): InLine-DeiT-T through the fast core, DeiT-T "
          f"through SDPA.\n")
    print_table(['where'] + list(profiles), [[g.replace('  ', '… ')] + [
        (f"{p[g][0]:.2f}" + (f" ({p[g][1]:.0f})" if p[g][1] else '')) if g in p else '' for p in profiles.values()]
        for g in order] +
        [['total'] + [f"{sum(v[0] for k, v in p.items() if not k.startswith('  ') and not k.startswith('every')):.2f}"
                      for p in profiles.values()]])
    return rows


# ---------------------------------------------------------------------------------------------------
# Dense: backbone forward time and peak memory at detection sizes, each softmax original against InLine

DENSE_SIZES = ((512, 512), (640, 640), (800, 800), (800, 1344))  # COCO's 800x1333 padded to 32, as detectors pad
DENSE = {  # comparison: (softmax original, InLine), models.EXPERIMENTS and registered names
    'Swin-T': ('s_swin_t', 'inline_swin_t'),  # shifted 7x7 windows in every stage; InLine over the whole stage
    'PVT-S': ('s_pvt_s', 'inline_pvt_s'),  # softmax with spatial reduction 8-4-2-1; InLine over all tokens
    'DeiT-T': ('s_deit_t', 'inline_deit_t'),  # global softmax over all (H/16)(W/16) + 1 tokens
}


def dense_forward(name, size, device):
    """The forward a detector runs: PVT and Swin as features_only backbones (built at 224 px, fed `size`);
    DeiT, which has no feature pyramid, built for `size`, its forward_features. Eval; InLine through the fast
    core (kernels.py), as train.py runs it, softmax through SDPA."""
    e = models.EXPERIMENTS.get(name)
    variant, overrides = (e.model, e.overrides) if e else (name, {})
    overrides = dict(overrides, fast=e is None)  # the s_* experiments are the softmax originals
    if variant.startswith('inline_deit'):
        model = models.create_model(variant, img_size=size, **overrides).eval().to(device)
        return model.forward_features
    return models.create_model(variant, features_only=True, **overrides).eval().to(device)


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
            return kernels.peak_mb(lambda: fn(x), device)  # max_memory_allocated above what was allocated before
    code = f'import paper; paper.dense_peak_rss({name!r}, {size[0]}, {size[1]})'
    run = subprocess.run([sys.executable, '-c', code], cwd=HERE, capture_output=True, text=True)
    return json.loads(run.stdout.strip().splitlines()[-1]) if run.returncode == 0 else None  # None: did not fit


def dense_point(comparison, size, device, rounds):
    """Interleaved rounds (softmax then InLine, one forward of batch 1 each) at one size, and each one's peak."""
    softmax_name, inline_name = DENSE[comparison]
    fns = {n: dense_forward(n, size, device) for n in (softmax_name, inline_name)}
    x = torch.randn(1, 3, *size, generator=torch.Generator().manual_seed(0)).to(device)

    def forward(fn):
        with torch.inference_mode():
            fn(x)

    ms = kernels.time_interleaved({n: lambda fn=fn: forward(fn) for n, fn in fns.items()},
                                  device, budget_s=1e9, max_rounds=rounds)  # exactly `rounds` rounds
    del fns
    return dict(comparison=comparison, size=list(size), device=device.type, rounds=rounds,
                softmax_ms=statistics.median(ms[softmax_name]), inline_ms=statistics.median(ms[inline_name]),
                speedup=kernels.paired_ratio(ms, softmax_name, inline_name),
                softmax_mb=dense_peak_mb(softmax_name, size, device), inline_mb=dense_peak_mb(inline_name, size, device))


def cmd_speed_dense(args):
    devices = [torch.device('cpu')] + ([torch.device('cuda')] if torch.cuda.is_available() else [])
    rows = []
    jobs = [(c, s, d) for d in devices for c in DENSE for s in DENSE_SIZES]
    for comparison, size, device in tqdm(jobs, desc='dense', dynamic_ncols=True):
        rounds = args.rounds or (3 if device.type == 'cpu' else 20)
        path = os.path.join(args.out, 'dense', f'{device.type}-{comparison}-{size[0]}x{size[1]}-r{rounds}-fast.json')
        if not os.path.exists(path):  # a finished point is kept; a rerun times only what is missing
            row = dense_point(comparison, size, device, rounds)
            os.makedirs(os.path.dirname(path), exist_ok=True)
            with open(path, 'w') as f:
                json.dump(row, f)
        with open(path) as f:
            rows.append(json.load(f))
    cpu = subprocess.run(['sh', '-c', "grep -m1 'model name' /proc/cpuinfo | cut -d: -f2"], capture_output=True,
                         text=True).stdout.strip() or 'unknown CPU'
    print(f'\nBackbone forward, batch 1, fp32, eval + inference_mode; InLine through the fast core, softmax through '
          f'SDPA; time = median of {rounds} interleaved rounds, speed-up = median of per-round ratios. Peak: CPU, the rise '
          f'of peak RSS over one forward in a fresh process; CUDA, max_memory_allocated above the model. CPU: {cpu}, '
          f'{torch.get_num_threads()} threads.\n')
    mb = lambda v: '—' if v is None else f'{v:.0f}'  # noqa: E731  (None: the forward did not fit)
    print_table(['backbone', 'image', 'device', 'softmax ms', 'InLine ms', 'InLine speed-up', 'softmax peak MiB',
                 'InLine peak MiB'],
                [[r['comparison'], '{}×{}'.format(*r['size']), r['device'], f"{r['softmax_ms']:.0f}",
                  f"{r['inline_ms']:.0f}", f"{r['speedup']:.2f}x", mb(r['softmax_mb']), mb(r['inline_mb'])] for r in rows])
    pixels = [h * w for h, w in DENSE_SIZES]
    labels = [f'{h * w / 1e6:.2f}' for h, w in DENSE_SIZES]
    panels = []
    for key, ylabel in (('ms', 'forward ms (batch 1)'), ('mb', 'peak MiB of the forward')):
        series = [(f"{c} {kind}{'' if dev == 'cpu' else ' ' + dev}", [h * w for h, w in (r['size'] for r in sel)],
                   [r[f'{kind.lower()}_{key}'] for r in sel], None)
                  for dev in dict.fromkeys(r['device'] for r in rows) for c in DENSE for kind in ('softmax', 'InLine')
                  for sel in [[r for r in rows if (r['comparison'], r['device']) == (c, dev)
                               and r[f'{kind.lower()}_{key}'] is not None]] if sel]
        panels.append(dict(series=series, xlabel='megapixels: ' + ', '.join(f'{h}x{w}' for h, w in DENSE_SIZES),
                           log_x=True, ylabel=ylabel, xticks=pixels,
                           xlabels=labels, title=f"Backbone {'forward time' if key == 'ms' else 'peak memory'}, "
                                                 f"softmax vs InLine"))
    charts(args.png or os.path.join(args.out, 'dense.png'), panels, cols=1, size=(820, 400))  # legend: one row
    return rows


# ---------------------------------------------------------------------------------------------------
# The ablations (T3, T4, T10, R-res, R-dil, R-nonneg, T1, S), each experiment trained small by train.py

# The miniature, the same for every experiment of a family, at an image size per family: 64 px (Fashion-MNIST's
# 28 px resized), so Swin's stage 1 is a 16x16 grid (stages 16, 8, 4, 2), against 56x56 at 224 px, and DeiT's 8 px
# patches give an 8x8 grid. Everything measured in stage-1 tokens shrinks by 16/56: the InLine windows 7, 14, 28,
# 56 of T4 become 2, 4, 8, 16 (1/8, 1/4, 1/2 and all of the stage, as in the paper); Swin's softmax window becomes
# 4. Widths shrink by the family's factor with the head dim kept, so head counts shrink with them (the softmax
# originals' own counts too); depths as listed, the same for a softmax original as for its InLine version.
MINI = {  # family: (image side, width factor, create_model sizes)
    'swin': (64, 1 / 3, dict(embed_dim=32, depths=(2, 2, 2, 2), num_heads=(1, 2, 4, 8), softmax_window=4)),
    'deit': (64, 1 / 3, dict(patch_size=8, embed_dim=64, depth=6, num_heads=2)),
    'pvt': (64, 1, dict(depths=(1, 1, 1, 1), sr_ratios=(4, 2, 1, 1))),
    # CSwin keeps its width: its two-branch softmax blocks split the heads in halves, and stage 1 has 2
    'cswin': (64, 1, dict(depths=(1, 2, 2, 1), stripes=(1, 2, 2, 2))),
}
# The budget of every run (RESULTS.md, "Ablations"), chosen by a pilot of r_residual_local and r_residual_none: the
# cheapest that lifted both 3 points over a linear read-out of the pixels. The first train_images of a fixed random order
# of the training set, the same for every run and seed; warm-up 1/12 of the epochs (the small recipe's 1 of 12).
# On CUDA, the scale at which the miniatures converge: every training image, epochs until the curve is flat.
BUDGET = {'cpu': dict(train_images=60_000, epochs=4), 'cuda': dict(train_images=60_000, epochs=40)}
# The test bed where attention must select (RESULTS.md, "A test bed where attention must select"): train.py's
# fashion_recall mosaics, task 'below', 20,000 training mosaics (new ones each seed) and the same 10,000 test mosaics
# for every run, at the accepted pilot's budget; the Swin miniature with heads of dim 8 in every stage (4, 8, 16, 32),
# so that every InLine layer of stages 1-3 has at least D + 1 tokens (256, 64, 16 against 9) and is injective. A
# network that cannot tell the three candidate blocks apart (the floor, no position in a stage) scores 1 in 3 at best.
# On CUDA, a scale at which the curves should flatten (not yet measured).
MOSAICS = dict(task='below', val_images=10_000, heads=(4, 8, 16, 32), guess=100 / 3)
MOSAIC_BUDGET = {'cpu': dict(train_images=20_000, epochs=4), 'cuda': dict(train_images=100_000, epochs=20)}
MOSAIC_RUN_CPU_MIN = 7.0  # a run at MOSAIC_BUDGET['cpu'] before any record: pilot 2's 1.5-2 CPU-minutes an epoch
# T1 in Swin, on this bed alone: in Fashion-MNIST's miniature (D 32) InLine's stage 3 has 16 tokens, not injective
MOSAIC_ONLY = ('t1_swin_softmax_normalised_q', 't1_inline_normalised_q')
# The claims it can test, in the order a batch trains them, two by two: the gate (InLine against its floor); S with
# R-res's no-Eq. 6 row; T3's pair; T1 within softmax and within InLine; R-res's plain row with T4's one-cell window.
# r_residual_local and t4_window56_no_residual name configurations trained above (InLine-Swin-T, r_residual_none).
MOSAIC_ROWS = ('floor_swin', 'inline_swin_t', 's_swin_t', 'r_residual_none', 't3_linear_relu', 't3_inline_relu',
               't1_swin_softmax_normalised_q', 't1_inline_normalised_q', 'r_residual_plain', 't4_window14_no_residual',
               'r_residual_local', 't4_window56_no_residual')
# bf16 autocast, training and validation, on both: on this project's CPU (AVX-512 BF16, no AMX) a training step of
# the Swin miniature took 0.13 CPU-s in bf16 against 0.22 in fp32 (batch 64, one thread, interleaved rounds)
PRECISION = {'cpu': 'bf16', 'cuda': 'bf16'}
# top-1 points over its family's phi = 0 floor (the attention-free miniature, same recipe) that a configuration must
# clear for its comparisons to get a verdict: fixed before the claim runs, then over a linear read-out of the pixels,
# which the floor replaced as the gate after them
FLOOR_MARGIN = 3.0
# CPU-minutes of one run per family at BUDGET['cpu'] on this project's machine, two at a time, to print a length
# before the first record of a recipe exists (then the records' own mean is used); scaled by epochs x images.
# Swin from the pilot's two runs; the others by their step costs relative to Swin's, measured before
RUN_CPU_MIN = {'swin': 9.5, 'deit': 7.2, 'pvt': 17.0, 'cswin': 19.0}
SEEDS = {'T3': 3, 'T4': 3, 'R-res': 3, 'S': 3, 'T10': 3, 'R-dil': 3, 'R-nonneg': 3, 'T1': 3, 'floor': 3}
# The claim rows (RESULTS.md, "Verdicts"), with the seeds that give a 1-point effect 80% power at the spreads measured
# (in the order a batch trains them: T3's pair, R-res's (T4's at 56²), S's, then T4's windows)
CLAIM_ROWS = ('t3_linear_relu', 't3_inline_relu', 't4_window56_no_residual', 't4_window56_residual', 'r_residual_none',
              'r_residual_local', 's_swin_t', 'inline_swin_t', 't4_window14_no_residual', 't4_window28_no_residual')
CLAIM_SEEDS = 5
FIRST_SEEDS = 3  # a batch gives every configuration 3 seeds, in the chosen order, before it gives any a fourth
QUICK = ('r_residual_none', 'r_residual_local')  # R-res, the paper's pair: runs the claim batch shares
QUICK_SEEDS = 3
# The data paper.py trains on unless told: Fashion-MNIST, which Debian's dataset-fashion-mnist package installs here
FASHION_MNIST_DEB = '/usr/share/datasets/fashion-mnist'


def budgets(dataset):
    """{device: the budget}: MOSAIC_BUDGET on the mosaics (fashion_recall), else BUDGET."""
    return MOSAIC_BUDGET if dataset == 'fashion_recall' else BUDGET


def family(e):
    return e.model.split('_')[1]


def experiments(dataset=None):
    """{name: Experiment}: every entry of models.EXPERIMENTS that the miniature covers (the smallest size of each
    family: S rows of bigger variants repeat the same miniature), the released InLine variants for S, and each
    family's attention-free floor: InLine with phi = 0, so every weight is 1/N and no token selects another, no
    Eq. 6, no APE, every stage (Swin's softmax stage 4 too); the patch embeddings, merges and MLPs are the same.
    dataset 'fashion_recall': MOSAIC_ROWS alone, each with MOSAICS' heads (given at full size: the miniature scales
    them by its width factor, as it does every head count)."""
    chosen = {n: e for n, e in models.EXPERIMENTS.items() if (e.table != 'S' or e.model.endswith('_t')) and (
        dataset == 'fashion_recall' or n not in MOSAIC_ONLY)}
    none, local = chosen['r_residual_none'], chosen['r_residual_local']
    chosen['r_residual_none_matched'] = models.Experiment(
        none.model, {**none.overrides, 'mlp_ratio': matched_mlp_ratio(none, parameters(local))}, 'R-res', None,
        True, "no residual (APE), every MLP widened to Eq. 6's parameter count")
    inline_t = {n: models.Experiment(n, {}, 'S', str(models.RELEASED[n][2]), False, f'{n} as released')
                for n in ('inline_swin_t', 'inline_deit_t', 'inline_pvt_t', 'inline_cswin_t')}
    floors = {f'floor_{f}': models.Experiment(f'inline_{f}_t', dict(
        layout='I' if f == 'deit' else 'IIII', kernel='zero', residual='none', **({'ape': False} if f == 'swin' else {})),
        'floor', None, True, f'{f} miniature, attention-free: every weight 1/N, no Eq. 6') for f in MINI}
    every = {**chosen, **inline_t, **floors}
    if dataset == 'fashion_recall':
        heads = tuple(round(h / MINI['swin'][1]) for h in MOSAICS['heads'])
        return {n: every[n]._replace(overrides={**every[n].overrides, 'num_heads': heads}) for n in MOSAIC_ROWS}
    return every


def matched_mlp_ratio(e, count):
    """The mlp_ratio (one for every block, 3 decimals) that gives e's miniature `count` parameters: a block of
    width C with hidden width H has (2C + 1) H of its MLP's parameters, so H grows by the gap over sum (2C + 1) C
    per unit of ratio. The R-res row that matches Eq. 6 parameter for parameter."""
    model = miniature(e)
    mlps = [m for m in model.modules() if isinstance(m, models.Mlp)]
    ratio = mlps[0].fc1.out_features / mlps[0].fc1.in_features
    per_unit = sum((2 * m.fc1.in_features + 1) * m.fc1.in_features for m in mlps)
    return round(ratio + (count - sum(p.numel() for p in model.parameters())) / per_unit, 3)


def comparisons(chosen):
    """[(tables, row, reference)]: the pairs the verdicts compare, row minus reference seed by seed, in the
    order of the tables; a pair two tables make (T4's Eq. 6 at 56² is R-res's pair) comes once, naming both. T3:
    division against subtraction, the same phi; T4: without against with Eq. 6 at each window, and each window
    against the whole stage, with and without Eq. 6 (the paper's four no-Eq. 6 rows are a tie); R-res: against
    the released InLine-Swin-T, and the two corners of the 2x2 (Eq. 6 x APE) against the row with the same APE;
    T10, R-dil, R-nonneg: against InLine-Swin-T; T1: each over normalised q against itself (T1_REFERENCE); S: each
    softmax original against its InLine version; floor: each family's InLine model against its attention-free
    floor."""
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


# The paper's claim for rows it has no number for but whose comparison tests one of its claims: R-res's corners of
# the 2x2 test "Eq. 6 adds 2.2 points" (its r_residual_local 82.4 against r_residual_none 80.2) with the APE held,
# and the matched row tests it parameter for parameter
CLAIMS = {'r_residual_none_no_ape': ('R-res: -2.2', -2.2), 'r_residual_local_ape': ('R-res: +2.2', 2.2),
          'r_residual_none_matched': ('R-res: -2.2', -2.2),
          # T1's claim, that softmax loses by losing injectivity (DeiT-T 72.2 -> 70.6 / 69.9), in Swin and in InLine
          't1_swin_softmax_normalised_q': ('T1 (DeiT-T): -1.6', -1.6), 't1_inline_normalised_q': ('T1 (DeiT-T): -1.6', -1.6)}
T1_REFERENCE = {'t1_swin_softmax_normalised_q': 's_swin_t', 't1_inline_normalised_q': 'inline_swin_t'}  # else t1_softmax


def mini_kwargs(e):
    """The create_model overrides that make an experiment's miniature, on top of its own: the family's sizes, head
    counts the experiment sets scaled by the family's width factor, windows scaled to Swin's stage 1 (None, the
    whole stage, where they cover it). CSwin's softmax original keeps the miniature's depths, not its own."""
    img, width, sizes = MINI[family(e)]
    kwargs = dict(sizes)
    if 'num_heads' in e.overrides:
        heads = e.overrides['num_heads']
        scaled = [h * width for h in (heads if isinstance(heads, tuple) else (heads,))]
        if any(abs(h - round(h)) > 1e-9 for h in scaled):
            raise ValueError(f'{e.model}: {heads} heads do not scale by {width:.3g} to whole heads')
        kwargs['num_heads'] = tuple(round(h) for h in scaled) if isinstance(heads, tuple) else round(scaled[0])
    if e.overrides.get('window') is not None:
        window = e.overrides['window'] * (img // 4) // 56
        kwargs['window'] = None if window >= img // 4 else window
    return kwargs


def untestable(e):
    """Why an experiment's miniature cannot test what its row claims, or None: T4's windows must be larger than
    Eq. 6's 3x3 neighbourhood, or Eq. 6 covers the window it is compared in (at 64 px, the 7² window is 2x2)."""
    window = mini_kwargs(e).get('window')
    if e.table == 'T4' and window is not None and window <= 3:
        return f"its {window}x{window} window is not larger than Eq. 6's 3x3"
    return None


def resolve_data(args, need=True):
    """Fill --dataset (default Fashion-MNIST) and --data-path, download once if asked (not once per run), and stop
    with how to get the data when it is missing, before any run starts (need=False: rebuilding from records)."""
    args.dataset = args.dataset or 'fashion_mnist'
    if args.data_path is None and args.dataset != 'synthetic':
        args.data_path = FASHION_MNIST_DEB if args.dataset in ('fashion_mnist', 'fashion_recall') and \
            os.path.isdir(FASHION_MNIST_DEB) else 'data'
    if not need:
        args.data_path = args.data_path and os.path.abspath(args.data_path)
        return
    source = 'fashion_mnist' if args.dataset == 'fashion_recall' else args.dataset  # the mosaics' items
    if source in train.SMALL_DATASETS:
        if args.download:  # torchvision fetches every split's files at once
            train.SMALL_DATASETS[source](args.data_path, download=True)
        train.read_small(source, args.data_path, train=False)  # missing: says how to get them
    elif args.dataset == 'imagefolder':
        for split in ('train', 'val'):
            if not os.path.isdir(os.path.join(args.data_path, split)):
                train.fail(f'--data-path {args.data_path} has no {split}/ folder (an ImageFolder root: train/ and val/)')
    if args.data_path:
        args.data_path = os.path.abspath(args.data_path)


def resolve_budget(args):
    """--device (cpu; cuda only where there is a GPU), and --epochs, --train-images from BUDGET (MOSAIC_BUDGET on
    fashion_recall) where not given."""
    args.device = getattr(args, 'device', None) or 'cpu'
    if args.device == 'cuda' and not torch.cuda.is_available():
        train.fail('--device cuda: torch sees no CUDA device here; run on a machine with a GPU, or --device cpu')
    for k, v in budgets(getattr(args, 'dataset', None))[args.device].items():
        if getattr(args, k, None) is None:
            setattr(args, k, v)


def recipe(e, args):
    """What makes a run's result, besides its model and seed: the data, the budget, the precision, the device and
    train.py's own recipe for the data (train.SMALL). Records of different recipes never share a table."""
    own = train.SYNTHETIC if args.dataset == 'synthetic' else train.SMALL
    mosaics = {k: MOSAICS[k] for k in ('task', 'val_images')} if args.dataset == 'fashion_recall' else {}
    return dict(dataset=args.dataset, **mosaics, train_images=args.train_images, img_size=MINI[family(e)][0],
                epochs=args.epochs, warmup_epochs=round(args.epochs / 12, 3),
                val_every=1 if args.device == 'cuda' else max(1, args.epochs // 4),  # cheap on a GPU: every epoch
                precision=PRECISION[args.device], device=args.device,
                train={k: v for k, v in own.items() if k not in ('epochs', 'warmup_epochs', 'img_size')})


def data_argv(args):
    """train.py's data flags: the dataset and a fixed subset of its training images, or fresh synthetic ones. An
    ImageFolder gets the small datasets' recipe (train.SMALL) in place of the released ImageNet one."""
    if args.dataset == 'synthetic':
        return ['--synthetic-train', str(args.train_images)]
    if args.dataset == 'fashion_recall':  # new training mosaics a seed, the same test ones for every run
        return ['--dataset', 'fashion_recall', '--data-path', args.data_path, '--recall-task', MOSAICS['task'],
                '--synthetic-train', str(args.train_images), '--synthetic-val', str(MOSAICS['val_images'])]
    small = [] if args.dataset != 'imagefolder' else ['--accum-steps', '1', '--ema-decay', '0'] + [
        x for k, v in train.SMALL.items() if k not in ('epochs', 'warmup_epochs')
        for x in (f'--{k.replace("_", "-")}', str(v))]
    return ['--dataset', args.dataset, '--data-path', args.data_path, '--train-subset', str(args.train_images), *small]


def make_run(name, e, seed, args):
    """One run of an experiment: train.py's command line (the experiment by name, its miniature, the budget, the
    data, the precision, the seed) and what its record is keyed by. Validation every val_every epochs and after
    the last: the 10,000 test images, every epoch, would cost much of a short run."""
    r = recipe(e, args)
    registered = name in models.EXPERIMENTS  # else its overrides go on the command line
    kwargs = {**({} if registered else e.overrides), **mini_kwargs(e)}
    argv = (['--experiment', name] if registered else ['--model', e.model]) + [
        '--img-size', str(r['img_size']), '--model-kwargs', *[f'{k}={v!r}' for k, v in kwargs.items()],
        '--epochs', str(r['epochs']), '--warmup-epochs', str(r['warmup_epochs']), '--val-every', str(r['val_every']),
        *data_argv(args), '--amp', r['precision'], '--seed', str(seed)]
    return Run(name, config_key(e), r, seed, argv)


def config_key(e):
    """Experiments that build the same model share their runs (InLine-Swin-T is T10's identity row, R-res's local
    row, R-dil's dilation 1 and S's InLine row): the variant, layout, attention options away from their defaults
    (so a new option with a default leaves the keys as they are), Swin's window and APE, the sizes, the count."""
    model = miniature(e)
    o = dict(model.options)
    if o['kernel'] is None and 'L' not in model.layout:  # kernel=None is identity when no block is linear
        o['kernel'] = 'identity'
    o = {k: v for k, v in o.items() if k not in models.ATTENTION_OPTIONS or v != models.ATTENTION_OPTIONS[k]}
    if model.family == 'swin':
        o.update(window=model.window, ape=bool(model.ape))
    count = sum(p.numel() for p in model.parameters())  # tells apart what the options do not name (mlp_ratio)
    return json.dumps([e.model, model.layout, sorted(o.items()),
                       sorted((k, v) for k, v in mini_kwargs(e).items() if k != 'window'), count], default=str)


def miniature(e):
    """An experiment's miniature on the meta device: its architecture and parameter shapes, no memory."""
    with torch.device('meta'):
        return models.create_model(e.model, img_size=MINI[family(e)][0], num_classes=10,
                                   **{**e.overrides, **mini_kwargs(e)})


def parameters(e):
    return sum(p.numel() for p in miniature(e).parameters())


def plan_runs(chosen, every, seeds, args):
    """The runs `chosen` needs, in the order to train them: the first FIRST_SEEDS seeds of every configuration,
    then the further seeds, the configurations two by two in the chosen order and the two seed by seed (the chosen
    order puts a comparison's sides together: a batch stopped early leaves whole comparisons), and each chosen
    name's runs in seed order. A configuration is trained under the first of all
    experiments (`every`) that builds it, whatever subset is chosen, so --quick, --only, locality and the full run
    share their runs; it gets the most seeds any chosen row asks of it. seeds(name) -> how many."""
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
    """(minutes, how they were estimated) for the runs without a record: the mean CPU time (on CUDA, wall time) of
    the records of the same family and recipe, else, on CPU, RUN_CPU_MIN (MOSAIC_RUN_CPU_MIN on the mosaics) scaled
    by images x epochs; on CUDA without a record of the recipe, None: this project has measured no GPU run."""
    total, guessed = 0.0, False
    for run in runs:
        if run.key() not in records:
            f, cuda = family(every[run.name]), run.recipe['device'] == 'cuda'
            seen = [r['wall_min' if cuda else 'cpu_min'] for r in records.values() if r['recipe'] == run.recipe
                    and r['name'] in every and family(every[r['name']]) == f and r['cpu_min'] > 0]
            if not seen and cuda:
                return None, 'no GPU record of this recipe yet'
            guessed |= not seen
            mosaics = run.recipe['dataset'] == 'fashion_recall'
            budget = budgets(run.recipe['dataset'])['cpu']
            scale = run.recipe['epochs'] * run.recipe['train_images'] / (budget['epochs'] * budget['train_images'])
            total += statistics.mean(seen) if seen else (MOSAIC_RUN_CPU_MIN if mosaics else RUN_CPU_MIN[f]) * scale
    return total, 'RUN_CPU_MIN' if guessed else 'the records of this recipe'


# ---------------------------------------------------------------------------------------------------
# Verdicts, fixed before the runs (RESULTS.md, "Verdicts"): t-tests of the mean difference of runs paired by seed, its
# error over seeds and over the test set's images, computed here from the t distribution itself (no table, no
# scipy); Holm's adjustment over a table's family

MARGIN = 1.0  # top-1 points: TOST's tie margin, and the effect the claim rows' seeds are chosen to detect
PAPER_TIE = 0.2  # the paper's own ties: rows 0.2 or less apart, as it reads T10 (82.4, 82.5) and T4 (82.3, 82.4)
ALPHA, POWER = 0.05, 0.8  # every test's level (two-sided; TOST 2.5% a side) and the power seeds are chosen for
WORDS = ('reproduced', 'contradicted', 'not resolved')


def incomplete_beta(x, a, b):
    """The regularized incomplete beta function I_x(a, b) = B(x; a, b) / B(a, b), from its continued fraction
    x^a (1-x)^b / (a B(a, b)) / (1 + d1 / (1 + d2 / ...)), d_2m = m (b - m) x / ((a + 2m - 1)(a + 2m)),
    d_2m+1 = -(a + m)(a + b + m) x / ((a + 2m)(a + 2m + 1)), evaluated by Lentz's method; where it converges
    slowly (x above the mean (a + 1) / (a + b + 2)) through I_x(a, b) = 1 - I_1-x(b, a)."""
    if x <= 0 or x >= 1:
        return float(x >= 1)
    if x > (a + 1) / (a + b + 2):
        return 1 - incomplete_beta(1 - x, b, a)
    log_front = a * math.log(x) + b * math.log1p(-x) + math.lgamma(a + b) - math.lgamma(a) - math.lgamma(b)
    tiny, f, c, d = 1e-300, 1e-300, 1e-300, 0.0  # f = c = tiny stands for the fraction's leading 0
    for j in range(1, 1000):
        m = (j - 1) // 2
        num = (1.0 if j == 1 else m * (b - m) * x / ((a + 2 * m - 1) * (a + 2 * m)) if j % 2 == 1 else
               -(a + m) * (a + b + m) * x / ((a + 2 * m) * (a + 2 * m + 1)))  # j = 1: 1; then d_1, d_2, ...
        d = 1 / (1 + num * d if abs(1 + num * d) > tiny else tiny)
        c = 1 + num / c if abs(1 + num / c) > tiny else tiny
        f *= c * d
        if abs(c * d - 1) < 1e-15:
            break
    return math.exp(log_front) / a * f


def t_cdf(t, df):
    """P(T <= t) for Student's t with df degrees of freedom: 1 - I_x(df/2, 1/2) / 2 at x = df / (df + t^2)."""
    if math.isinf(t):
        return float(t > 0)
    tail = incomplete_beta(df / (df + t * t), df / 2, 0.5) / 2  # P(T > |t|)
    return 1 - tail if t > 0 else tail


@functools.lru_cache(maxsize=None)
def t_quantile(p, df):
    """The t with P(T <= t) = p, by bisection on t_cdf (to 1e-12); infinite without degrees of freedom."""
    if df < 1:
        return math.inf if p > 0.5 else -math.inf if p < 0.5 else 0.0
    lo, hi = -1.0, 1.0
    while t_cdf(lo, df) > p:
        lo *= 2
    while t_cdf(hi, df) < p:
        hi *= 2
    while hi - lo > 1e-12 * max(1.0, abs(hi)):
        mid = (lo + hi) / 2
        lo, hi = (mid, hi) if t_cdf(mid, df) < p else (lo, mid)
    return (lo + hi) / 2


def image_term(images):
    """(variance, its Satterthwaite term): what the test set's sampling adds to the variance of a comparison's mean
    difference (points²), from `images`, the per-image differences (seeds, M): 1 where only the row's model is right,
    -1 where only the reference's is. The two-way random-effects model (seed + image + residual), one run per seed
    and model, read by its mean squares: the mean's variance is (MS_seed + MS_image - MS_residual) / (n M), of
    which MS_seed / (n M) is the seeds' term (sd² / n of the per-seed differences) and (MS_image - MS_residual) /
    (n M) the test set's, kept at 0 or more; the second number is that term's share of Satterthwaite's
    denominator, (MS_image² / (M - 1) + MS_residual² / ((n - 1)(M - 1))) / (n M)²."""
    d = 100 * images.double()  # (n, M), points
    n, M = d.shape
    by_image = d.mean(0)  # (M,)
    ms_image = n * by_image.var().item()
    ms_residual = (d - d.mean(1, keepdim=True) - by_image + d.mean()).pow(2).sum().item() / ((n - 1) * (M - 1))
    return (max(0.0, ms_image - ms_residual) / (n * M),
            (ms_image ** 2 / (M - 1) + ms_residual ** 2 / ((n - 1) * (M - 1))) / (n * M) ** 2)


def paired(diffs, images=None):
    """(mean, standard error, degrees of freedom) of a comparison's mean difference, from its per-seed differences
    (points) and, where given, the per-image differences behind them (image_term; their rows in the seeds'
    order). Seeds only: sd / sqrt(n) on n - 1 degrees of freedom, which holds the test set's images fixed and so
    leaves out their sampling error (it shrinks with images, never with seeds). With images, the test set's term is
    added, on Satterthwaite's degrees of freedom for the sum. Infinite error with one seed."""
    n, mean = len(diffs), statistics.mean(diffs)
    if n < 2:
        return mean, math.inf, 0
    seeds = statistics.variance(diffs) / n
    image_var, term = image_term(images) if images is not None else (0.0, 0.0)
    if image_var == 0:
        return mean, math.sqrt(seeds), n - 1
    return mean, math.sqrt(seeds + image_var), (seeds + image_var) ** 2 / (seeds ** 2 / (n - 1) + term)


def upper(mean, delta, se, df):
    """P(T > (mean - delta) / se): the one-sided p of "the true mean is delta or less"; with no spread (se = 0,
    every seed alike) 0 or 1."""
    if se == 0:
        return 0.0 if mean > delta else 1.0 if mean < delta else 0.5
    return 1 - t_cdf((mean - delta) / se, df)


def interval(diffs, images=None):
    """(mean, half-width) of the 95% interval of a comparison's mean difference, t(0.975, df) times paired's
    standard error: over seeds, and over the test set's images where they are given; infinite with one seed."""
    mean, se, df = paired(diffs, images)
    return mean, t_quantile(1 - ALPHA / 2, df) * se if df else math.inf


def pooled_sd(groups):
    """(sd, degrees of freedom) of per-seed differences pooled over a table's comparisons (groups: each one's
    per-seed differences): sqrt(sum (n_k - 1) sd_k² / sum (n_k - 1)); (None, 0) without two seeds anywhere. One
    comparison's own sd on 2 degrees of freedom ranges over 0.5x to 6x the truth (95%); the pool narrows that."""
    df = sum(len(g) - 1 for g in groups if len(g) > 1)
    if not df:
        return None, 0
    return math.sqrt(sum((len(g) - 1) * statistics.variance(g) for g in groups if len(g) > 1) / df), df


def mde(sd, seeds, image_var=0.0):
    """The minimum detectable effect at 80% power: the true mean difference that the two-sided 5% paired t-test on
    `seeds` seeds rejects 0 for with probability 0.8, (t_0.975,n-1 + t_0.8,n-1) sqrt(sd² / n + image_var), the
    usual approximation to the noncentral t (it counts only the side the effect is on); sd, the per-seed
    differences' (the table's pooled_sd); image_var, the comparison's image_term, which more seeds do not shrink."""
    if seeds < 2:
        return math.inf
    t = t_quantile(1 - ALPHA / 2, seeds - 1) + t_quantile(POWER, seeds - 1)
    return t * math.sqrt(sd ** 2 / seeds + image_var)


def seeds_for(sd, image_var=0.0, effect=MARGIN):
    """The fewest seeds (2 to 1000) whose mde is `effect` or less; None where none is (the test set's term alone
    can keep it above)."""
    return next((n for n in range(2, 1001) if mde(sd, n, image_var) <= effect), None)


def p_values(diffs, paper_diff, images=None):
    """(p that the paper's claim is reproduced, p that it is contradicted), each rejected at ALPHA. A paper ordering:
    the two-sided paired t-test of a zero mean, counted on the side the mean is on. A paper tie (|paper_diff| <=
    PAPER_TIE): TOST, the two one-sided tests of -MARGIN and +MARGIN at 2.5% each (the 95% interval inside
    +-MARGIN), its larger p doubled to the 5% scale; contradicted when the difference lies beyond the margin on
    one side at 2.5% (the whole interval outside +-MARGIN), likewise doubled. On paired's error: over seeds, and over
    the test set where images (image_term) are given."""
    mean, se, df = paired(diffs, images)
    if df < 1:
        return 1.0, 1.0
    if round(abs(paper_diff), 1) <= PAPER_TIE:  # as printed: 80.2 - 80.0 is 0.2000000000000028
        inside = max(upper(mean, -MARGIN, se, df), 1 - upper(mean, MARGIN, se, df))  # H0: <= -M; H0: >= M
        outside = min(upper(mean, MARGIN, se, df), 1 - upper(mean, -MARGIN, se, df))  # H0: <= M; H0: >= -M
        return min(1.0, 2 * inside), min(1.0, 2 * outside)
    p = min(1.0, 2 * min(upper(mean, 0, se, df), 1 - upper(mean, 0, se, df)))
    return (p, 1.0) if mean != 0 and (mean > 0) == (paper_diff > 0) else (1.0, p)


def verdict(diffs, paper_diff, images=None):
    """reproduced, contradicted or not resolved: the paper's difference paper_diff against ours, the per-seed
    differences diffs (row minus reference, seed by seed); '—' when the paper gives no difference. An ordering is
    reproduced when the 95% interval excludes 0 on the paper's side, contradicted on the other; a tie is
    reproduced when the interval lies within +-MARGIN (TOST), contradicted when wholly outside. Else not resolved.
    images: as in paired."""
    if paper_diff is None:
        return '—'
    reproduce, contradict = p_values(diffs, paper_diff, images)
    return 'reproduced' if reproduce < ALPHA else 'contradicted' if contradict < ALPHA else 'not resolved'


def holm(ps):
    """Holm's step-down adjustment of p-values [p_1 .. p_m], in their order: the i-th smallest is multiplied by
    m - i + 1, each kept at least the one before it, at most 1. Rejecting where the adjusted p < ALPHA keeps the
    chance of any false rejection among the m at ALPHA."""
    order, adjusted, running = sorted(range(len(ps)), key=lambda i: ps[i]), [1.0] * len(ps), 0.0
    for rank, i in enumerate(order):
        running = max(running, min(1.0, (len(ps) - rank) * ps[i]))
        adjusted[i] = running
    return adjusted


class Summary(NamedTuple):
    """A configuration's runs: final-epoch top-1 by seed and which test images it got right by seed (None where the
    record predates train.py's per-image results), the seeds that diverged (left out of every mean and comparison,
    and listed), and the mean gain in top-1 over the last quarter of the epochs (near 0 where the curve is flat)."""
    top1: dict
    correct: dict
    diverged: list
    gain: float | None


def summarise(records):
    """The Summary of a configuration's records. A diverged run has no final top-1: counting it at a guess (10%)
    would put one extreme outlier into a t-test of seeds 1 point apart, so it is left out and named instead."""
    done = [r for r in records if r['state'] == 'done']
    gains = []
    for r in done:
        curve = [(e['epoch'], e['val_acc1']) for e in r['epochs'] if 'val_acc1' in e]
        earlier = [acc for epoch, acc in curve if epoch <= r['recipe']['epochs'] * 3 / 4]
        if earlier:
            gains.append(curve[-1][1] - earlier[-1])
    last = {r['seed']: r['epochs'][-1] for r in done}
    return Summary({s: e['val_acc1'] for s, e in sorted(last.items())},
                   {s: train.unpack_correct(e['val_correct'], e['val_images']) if 'val_correct' in e else None
                    for s, e in last.items()},
                   sorted(r['seed'] for r in records if r['state'] == 'diverged'),
                   statistics.mean(gains) if gains else None)


def matched(a, b):
    """A comparison of two Summaries, paired by seed number (the runs of one seed share their initialisation stream
    and data order; a seed one side lacks drops that pair, never shifts the others): (the seeds, the per-seed
    differences a - b in points, the per-image differences (seeds, images) where every run of those seeds kept its
    per-image results, else None)."""
    seeds = sorted(a.top1.keys() & b.top1.keys())
    diffs = [a.top1[s] - b.top1[s] for s in seeds]
    if not seeds or any(a.correct[s] is None or b.correct[s] is None for s in seeds):
        return seeds, diffs, None
    return seeds, diffs, torch.stack([a.correct[s].to(torch.int8) - b.correct[s].to(torch.int8) for s in seeds])


def reported_value(text):
    """The paper's number as a float: the first figure given; 'does not converge' as -inf; None when unreported."""
    if text is None:
        return None
    if 'not converge' in text:
        return float('-inf')
    digits = ''.join(c if c.isdigit() or c == '.' else ' ' for c in text).split()
    return float(digits[0]) if digits else None


def paper_claim(name, ref, every):
    """(text, difference) the paper gives for row minus reference; difference None where it gives none."""
    if name in CLAIMS:
        return CLAIMS[name]
    if every[ref].table == 'floor':
        return '—', None
    paper, paper_ref = reported_value(every[name].reported), reported_value(every[ref].reported)
    if paper is None or paper_ref is None:
        return every[name].reported or '—', None
    return f'{every[name].reported} vs {every[ref].reported}', paper - paper_ref


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
    fashion_recall, where every row is one), --only NAMES, else all, each with the φ = 0 floor of every family it
    touches (the gate of its verdicts); and seeds(name): the claim rows CLAIM_SEEDS unless --seeds names their
    table."""
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
    chosen = tuple(dict.fromkeys([*chosen, *(f'floor_{family(every[n])}' for n in chosen  # the gate: each family's
                                             if f'floor_{family(every[n])}' in every)]))  # floor, on every test bed
    per_table = seeds_option(args.seeds, {t: QUICK_SEEDS for t in SEEDS} if args.quick else SEEDS)
    named = {v.rpartition('=')[0] or '*' for v in args.seeds or []}
    claims = () if args.quick else rows

    def seeds(name):
        table = every[name].table
        return per_table[table] if name not in claims or table in named or '*' in named else \
            max(per_table[table], CLAIM_SEEDS)
    return {n: every[n] for n in chosen}, seeds


def cmd_ablations(args):
    resolve_budget(args)
    resolve_data(args, need=not args.no_train)
    every = experiments(args.dataset)
    chosen, seeds = choose(args, every)
    runs, planned = plan_runs(chosen, every, seeds, args)
    records = read_records(args.results)
    minutes, source = estimate(runs, every, records)
    todo = [r for r in runs if r.key() not in records]
    passes = sum(r.recipe['epochs'] * r.recipe['train_images'] for r in todo)
    print(f'{len(chosen)} experiments, {len({tuple(r.key() for r in rs) for rs in planned.values() if rs})} distinct '
          f'configurations, {len(runs)} runs of {args.epochs} epochs x {args.train_images} images of {args.dataset} '
          f'on {args.device} ({PRECISION[args.device]}), {args.jobs} at a time; estimate for the {len(todo)} runs '
          f'without a record ({passes / 1e6:.1f}M training image passes): ' +
          (f'unknown ({source})' if minutes is None else
           f'{minutes:.0f} {"GPU" if args.device == "cuda" else "CPU"}-minutes by {source}, about '
           f'{minutes / args.jobs // 60:.0f} h {minutes / args.jobs % 60:.0f} min {args.jobs} at a time' +
           (f' on {args.jobs} cores of their own' if args.device == 'cpu' else '')))
    done = train_runs(runs, args, desc='ablation runs')
    result = {n: summarise([done[r.key()] for r in planned[n] if r.key() in done]) for n in chosen}
    mosaics = args.dataset == 'fashion_recall'
    configs, rows, points, (sd, df, m) = table_rows(chosen, planned, result, every,
                                                    MOSAICS['guess'] if mosaics else None)
    family_name = f'{args.dataset}, {args.epochs} epochs x {args.train_images:,} images'
    bed = (f'task {MOSAICS["task"]}, heads {", ".join(map(str, MOSAICS["heads"]))} (D 8 in every stage), the same '
           f'{MOSAICS["val_images"]:,} test mosaics for every run' if mosaics else 'validation on its test set')
    print(f'\nAblations on the miniatures ({args.dataset}, {args.epochs} epochs x {args.train_images:,} training '
          f'images, {bed}, {PRECISION[args.device]} on {args.device}): one row per distinct '
          f'configuration (names joined by = build one model), final-epoch top-1 (%), mean ± sd over (n) seeds, '
          f'beside the paper\'s ImageNet-1K top-1; over the φ = 0 floor: its mean minus the mean of its family\'s '
          f'attention-free miniature (the gate: under it when less than {FLOOR_MARGIN:g}); last quarter: the top-1 '
          f'gained over the last quarter of the epochs (near 0: flat); a diverged run is left out and named. * our '
          f'construction (no released code).\n')
    print_table(['configuration', 'tables', 'params', 'top-1 here ± sd (seeds)', 'paper (ImageNet)',
                 'over the φ = 0 floor', 'last quarter'], configs)
    gaps = [c[5] for c in configs if c[5] and c[1] != 'floor']  # the attention configurations' gaps to their floor
    if gaps and all('(under)' in g for g in gaps):
        print(f'\nNo configuration with attention clears its φ = 0 floor by {FLOOR_MARGIN:g} points: on this test bed '
              f'the task does not need attention, and every comparison is untestable.')
    header = ['tables', 'row − reference', 'paper (ImageNet)', 'difference here [95% CI]', 'interval over', 'seeds',
              'MDE at 80% power', 'seeds for 1 point', 'p', 'verdict', 'Holm verdict']
    print(f'\nComparisons, row minus reference, runs paired by seed number: the mean difference and its 95% interval, '
          f'over seeds and the test set\'s images (a two-way random-effects model, t on Satterthwaite\'s degrees of '
          f'freedom), or over seeds only (Student-t) where a record predates per-image results: those leave out the '
          f'test set\'s sampling error. MDE, the minimum detectable effect at 80% power: the true difference a 5% '
          f'two-sided paired t-test at these seeds catches 4 times in 5, (t_0.975 + t_0.8) sqrt(sd² / n + the test '
          f'set\'s term), sd the per-seed differences\' pooled over this table\'s comparisons ' +
          ('(none has two seeds)' if sd is None else f'({sd:.2f} on {df} degrees of freedom)') +
          f'; seeds for 1 point: how many would bring the MDE to 1. Verdict (RESULTS.md, "Verdicts"): an ordering is '
          f'reproduced when the interval excludes 0 on the paper\'s side, contradicted on the other; a paper tie '
          f'(≤ {PAPER_TIE}) by TOST, reproduced when the interval lies within ±{MARGIN}, contradicted wholly outside '
          f'it; else not resolved; untestable where a side is under its φ = 0 floor + {FLOOR_MARGIN:g} (p is still '
          f'shown). Holm verdict: the same test with its p adjusted by Holm\'s method over this table\'s family, '
          f'"{family_name}": the {m} comparisons with a verdict, so that the chance of any false verdict among them '
          f'is at most 5%. † a claim row.\n')
    print_table(header, rows)
    ablations_pictures(args, chosen, planned, done, result, rows, points)
    return configs, rows


def ablations_pictures(args, chosen, planned, done, result, rows, points):
    """The ablations' picture (each comparison's difference and interval beside the paper's, a panel per table;
    top-1 per experiment where none has a comparison) and, beside it, every run's learning curves."""
    default = 'ablations_fashion_recall.png' if args.dataset == 'fashion_recall' else 'ablations.png'
    out = args.png or os.path.join(args.out, default)
    panels = {}
    for r, point in zip(rows, points):  # one panel per table, the first a comparison names
        if point is not None:
            panels.setdefault(r[0].split(',')[0], []).append(point)
    charts(out, [dict(  # each comparison: our mean difference and interval beside the paper's difference
        series=[(f'here ({args.dataset}), mean difference, 95% CI', xs, [d for _, d, _, _ in entries],
                 [h or 0 for _, _, h, _ in entries]),
                ('paper (ImageNet)', xs, [p for _, _, _, p in entries], None)],
        title=table, xlabel='', ylabel='top-1 minus the reference row\'s (points)', xticks=xs,
        xlabels=[label for label, _, _, _ in entries], hlines=[('', 0.0)], lines=False)
        for table, entries in panels.items() for xs in [list(range(1, len(entries) + 1))]] or [dict(
        series=[('here', list(range(1, len(chosen) + 1)),
                 [statistics.mean(result[n].top1.values() or [0]) for n in chosen], None)], title='top-1 here',
        xlabel='', ylabel='top-1 (%)', xticks=list(range(1, len(chosen) + 1)), xlabels=[short_name(n) for n in chosen],
        lines=False)], cols=4, size=(420, 330))
    name = os.path.basename(out)  # figures/ablations_quick.png -> figures/curves_quick.png
    curves = name.replace('ablations', 'curves') if 'ablations' in name else 'curves_' + name
    learning_curves(os.path.join(os.path.dirname(out), curves), chosen, planned, done)


def table_rows(chosen, planned, result, every, guess=None):
    """The two tables: one row per distinct configuration (its names, tables, top-1, how far over its family's
    φ = 0 floor), and one per distinct comparison, with its verdict and Holm's; with each comparison's chart entry
    (label, mean, half-width, the paper's difference) and (the pooled sd, its degrees of freedom, the size of the
    Holm family). The gate: a configuration clears when its mean is FLOOR_MARGIN over the mean of its family's floor
    (the same recipe); a comparison with a side that does not, or no floor run, is untestable, whatever its p."""
    distinct = {}
    for name, e in chosen.items():
        distinct.setdefault(tuple(r.key() for r in planned[name]) or name, []).append(name)
    mean = {n: statistics.mean(result[n].top1.values()) if result[n].top1 else None for n in chosen}
    floor = {n: f'floor_{family(e)}' for n, e in chosen.items()}
    above = {n: None if mean[n] is None or mean.get(floor[n]) is None else mean[n] - mean[floor[n]] for n in chosen}
    cleared, configs = {n: above[n] is not None and above[n] >= FLOOR_MARGIN for n in chosen}, []
    for names in distinct.values():
        r, e, n = result[names[0]], every[names[0]], names[0]
        why, accs = untestable(e), list(r.top1.values())
        ours = ('—' if not accs else f'{mean[n]:.1f} ± {statistics.stdev(accs):.1f} ({len(accs)})' if len(accs) > 1
                else f'{accs[0]:.1f} (1)') + (f', seed {", ".join(map(str, r.diverged))} diverged' if r.diverged else '')
        configs.append([' = '.join(n + (' *' if every[n].ours else '') for n in names),
                        ', '.join(dict.fromkeys(every[n].table for n in names)), f'{parameters(e) / 1e6:.2f}M',
                        f'not trained: {why}' if why else ours,
                        ' / '.join(dict.fromkeys(every[n].reported or '—' for n in names)),
                        '' if above[n] is None else f'{above[n]:+.1f}' + ('' if cleared[n] or e.table == 'floor'
                                                                         else ' (under)'),
                        '' if r.gain is None else f'{r.gain:+.1f}'])
    if guess is not None:
        configs.insert(0, ['guess: 1 of the 3 candidate cells, the most a network without position in a stage can '
                           'score (the floor\'s ceiling)', '', '', f'{guess:.1f}', '—', '', ''])
    pairs = [(tables, name, ref, *matched(result[name], result[ref])) for tables, name, ref in comparisons(chosen)]
    sd, df = pooled_sd([diffs for *_, diffs, _ in pairs])
    rows, tested = [], []
    for tables, name, ref, seeds, diffs, images in pairs:
        paper_text, paper_diff = paper_claim(name, ref, every)
        label = f'{name} − {ref}' + ('†' if name in CLAIM_ROWS and ref in CLAIM_ROWS else '')
        if untestable(every[name]) or untestable(every[ref]):
            rows.append([', '.join(tables), label, paper_text, '', '', '', '', '', '', 'untestable', '', None])
            continue
        unpaired = sorted((result[name].top1.keys() | result[ref].top1.keys() |
                           set(result[name].diverged + result[ref].diverged)) - set(seeds))
        count = f'{len(seeds)}' + (f' (seed {", ".join(map(str, unpaired))} unpaired)' if unpaired else '')
        over = 'seeds only' if images is None else 'seeds and test images'
        gate = None if cleared[name] and cleared[ref] else 'untestable (no floor run)' if None in (
            above[name], above[ref]) else 'untestable (under the floor)'
        if len(seeds) < 2:
            rows.append([', '.join(tables), label, paper_text, f'{diffs[0]:+.1f} (1 seed)' if seeds else '', over,
                         count, '∞' if seeds else '', '', '', 'not run' if not seeds else gate or (
                             'not resolved' if paper_diff is not None else '—'), '', None])
            continue
        mid, half = interval(diffs, images)
        image_var = 0.0 if images is None else image_term(images)[0]  # the test set's term: two seeds or more
        p = p_values(diffs, paper_diff, images) if paper_diff is not None else None
        word = verdict(diffs, paper_diff, images) if gate is None or paper_diff is None else gate
        needed = seeds_for(sd, image_var)
        rows.append([', '.join(tables), label, paper_text, f'{mid:+.1f} [{mid - half:+.1f}, {mid + half:+.1f}]', over,
                     count, f'{mde(sd, len(seeds), image_var):.1f}', '> 1000' if needed is None else str(needed),
                     '' if p is None else f'{min(p):.3f}', word, '',
                     (short_name(name), mid, half, paper_diff if paper_diff is not None and math.isfinite(paper_diff)
                      else None)])
        if p is not None and gate is None:  # Holm's family: the comparisons with a verdict; each row's p, its smaller
            tested.append((len(rows) - 1, min(p), word))
    for (i, _, word), q in zip(tested, holm([p for _, p, _ in tested])):
        rows[i][10] = word if q < ALPHA else 'not resolved'
    for r in rows:
        r[10] = r[10] or ('—' if r[9] in ('—', 'not run') else r[9].split(' (')[0])
    return configs, [r[:11] for r in rows], [r[11] for r in rows], (sd, df, len(tested))


def learning_curves(path, chosen, planned, done):
    """One panel per table: validation top-1 by epoch, the mean over seeds, for every distinct configuration of
    the table (each drawn once, in the first table that has it), so a reader sees
    whether training had flattened for every model the text speaks of."""
    panels, drawn = [], set()
    for table in dict.fromkeys(e.table for e in chosen.values()):
        series = []
        for name in (n for n, e in chosen.items() if e.table == table):
            key = tuple(r.key() for r in planned[name])
            logs = [[e for e in done[r.key()]['epochs'] if 'val_acc1' in e] for r in planned[name]
                    if r.key() in done and done[r.key()]['state'] == 'done']
            if not logs or key in drawn:
                continue
            drawn.add(key)
            points = min(len(log) for log in logs)
            series.append((short_name(name), [e['epoch'] for e in logs[0][:points]],
                           [statistics.mean(log[i]['val_acc1'] for log in logs) for i in range(points)], None))
        if series:
            panels.append(dict(series=series, title=f'{table}: validation top-1 by epoch', xlabel='epoch',
                               ylabel='top-1 (%)', xticks=sorted({x for s in series for x in s[1]})))
    if panels:
        charts(path, panels, cols=2, size=(480, 360))


def short_name(name):
    """An experiment's name short enough to label a chart's x axis: t4_window7_residual -> w7 + res."""
    for pattern, short in ((r't3_linear_(\w+)', r'lin \1'), (r't3_inline_(\w+)', r'InL \1'),
                           (r't4_window(\d+)_no_residual', r'w\1'), (r't4_window(\d+)_residual', r'w\1 + res'),
                           (r't10_kernel_(\w+)', r'\1'), (r'r_residual_(\w+)', r'\1'), (r'r_dilation(\d)', r'dil \1'),
                           (r't1_softmax_normalised_q', 'normalised q'), (r's_(\w+)_t', r'softmax \1'),
                           (r'inline_(\w+)_t', r'InLine \1'), (r'floor_(\w+)', r'floor \1')):
        if re.fullmatch(pattern, name):
            return re.sub(pattern, short, name)
    return name


# ---------------------------------------------------------------------------------------------------
# The paper's model table and its experiments by name, built on the meta device (no memory, no training)

def cmd_models(args):
    """Every released variant: params and GMACs of ours beside the authors' model definitions, and the paper's
    top-1 (models.RELEASED)."""
    rows = []
    for name, (params, gmacs, top1) in models.RELEASED.items():
        with torch.device('meta'):
            model = models.create_model(name)
        ours, macs = sum(p.numel() for p in model.parameters()), models.count_macs(model) / 1e9
        rows.append([name, model.img_size[0], f'{ours:,}', f'{params:,}', f'{macs:.3f}', f'{gmacs:.3f}',
                     f'{(macs / gmacs - 1) * 100:+.2f}%', top1 or '-'])
    print_table(['variant', 'img', 'params', 'released', 'GMACs', 'released', 'diff', 'top-1'], rows)
    print("GMACs = torch.utils.flop_counter FLOPs / 2 (matmuls and convolutions). Ours are lower by the released\n"
          "code's q.k_mean product alone (N*D per head), which the centred form of Eq. 5 does not need.")


def cmd_experiments(args):
    """Every experiment of the paper by name (models.EXPERIMENTS) at full size, with the paper's top-1."""
    rows = []
    for name, e in models.EXPERIMENTS.items():
        with torch.device('meta'):
            model = models.create_experiment(name)
        rows.append([name, e.table, e.model, f'{sum(p.numel() for p in model.parameters()):,}',
                     f'{models.count_macs(model) / 1e9:.2f}', e.reported or '-', '(ours) ' * e.ours + e.what])
    print_table(['experiment', 'table', 'model', 'params', 'GMACs', 'paper top-1', 'what'], rows)
    print("paper top-1: ImageNet-1K as the paper reports it; (ours): our construction, no code was released.\n"
          "Train one: torchrun --standalone --nproc_per_node=2 train.py --experiment NAME")


# ---------------------------------------------------------------------------------------------------
# recall: multi-query associative recall (MQAR; Arora et al. 2023, "Zoology"), the test linear attentions are judged
# by: key-value pairs, filler, then queries for the keys, the loss on the answers only. Small causal transformers
# (2 layers, 2 heads) with softmax, vanilla linear attention (division) and causal InLine (subtraction), each with
# causal Eq. 6 in the study (the short causal convolution that binds a key to the value after it). InLine is
# injective in q_i only where the prefix's centred keys span D dimensions (inline.inline_weights), so every query
# sits at token D + 1 or later: what is compared is injective where it claims to be. The models have 20k-100k
# parameters and a run takes minutes on one core (2.5 at 20000 steps, compiled), so they train here, in process:
# train.py is the image loop (its data pipeline, DDP and checkpoints serve runs of hours to days). Finished runs are
# JSON lines in RECALL_RESULTS (committed), so the tables and the picture rebuild without training and a rerun
# trains only what is missing.

RECALL_RESULTS = os.path.join(HERE, 'results', 'recall.jsonl')
RECALL_VOCAB = 64  # keys are tokens 0..63, values 64..127, filler 128..191
RECALL_HEADS = 2
RECALL_SIZES = ((32, 4, 20), (32, 6, 24), (32, 8, 24))  # (C, key-value pairs, tokens); D = C / 2, queries from D + 1
RECALL_MODELS = {  # name: how its attention is built (RecallLM); without Eq. 6 here, with it below
    'softmax': dict(attention='softmax'),
    'softmax q-norm': dict(attention='softmax', normalise_q=True),  # T1 on sequences: q/|q| times a learned gain
    'floor phi=0': dict(kernel='zero', residual='none'),  # every weight 1/i: attention that cannot select
    'linear relu': dict(attention='linear', kernel='relu', residual='none'),  # division, the other usual kernel
    'linear 1+elu': dict(attention='linear', kernel='one_plus_elu', residual='none'),  # division
    'InLine 1+elu s/i': dict(kernel='one_plus_elu', residual='none'),  # subtraction, Eq. 5 with s/i
    'InLine 1+elu s': dict(kernel='one_plus_elu', residual='none', scale_by_count=False),  # the printed Eq. 5
    'InLine s/i': dict(residual='none'),  # phi = identity, the paper's
    'InLine s': dict(residual='none', scale_by_count=False),
    'InLine s/i q-norm': dict(residual='none', normalise_q=True),
}
# The study's models: each of the above with causal Eq. 6 (the token and the 2 before it), softmax too. Without a
# token shift a linear-state layer cannot bind a key to the value after it, and none of them left the guess (RESULTS.md)
RECALL_EQ6 = ' + Eq. 6'
RECALL_STUDY = [name + RECALL_EQ6 for name in RECALL_MODELS]
RECALL_MODELS.update({name + RECALL_EQ6: {**options, 'residual': 'local'} for name, options in list(RECALL_MODELS.items())})
RECALL_FLOOR = 'floor phi=0'
RECALL_COMPARISONS = (  # (question, a, b): the claim is "b recalls more than a", read seed by seed; with and without Eq. 6
    ('injectivity within softmax', 'softmax q-norm', 'softmax'),
    ('injectivity within InLine', 'InLine s/i q-norm', 'InLine s/i'),
    ('subtraction over division, 1+elu', 'linear 1+elu', 'InLine 1+elu s/i'),
    ('scale s over s/i, identity', 'InLine s/i', 'InLine s'),
    ('scale s over s/i, 1+elu', 'InLine 1+elu s/i', 'InLine 1+elu s'),
    ('kernel identity over 1+elu', 'InLine 1+elu s/i', 'InLine s/i'),
)
RECALL_LRS = (1e-3, 3e-3, 1e-2)  # each model's learning rate: the best of these on held-out sequences, seed 0
RECALL_SEEDS, RECALL_STEPS, RECALL_BATCH = 5, 20000, 64  # 20000 steps: every seed of InLine 1+elu left the guess
RECALL_FIRST_STEPS = 2000  # the first study's budget, where no linear-state run left the guess reliably
RECALL_GATE = 3.0  # recall points over the floor and the guess that both models of a comparison must clear
RECALL_CLAIM = 1.0  # "b recalls more than a", as verdict reads a paper's difference
RECALL_VALID, RECALL_TEST = 777, 12345  # the held-out sequences' generators: learning rates, then the test
RECALL_HELD_OUT = 1024  # sequences of each


def mqar_batch(batch, pairs, tokens, generator):
    """x, y (batch, tokens): `pairs` distinct keys, each followed by its value, filler tokens, then `pairs` queries
    (keys drawn again, with repeats) at the end; y holds the value at the queries and -100 (no loss) elsewhere."""
    keys = torch.rand(batch, RECALL_VOCAB, generator=generator).argsort(-1)[:, :pairs]  # (batch, pairs), distinct
    values = RECALL_VOCAB + torch.randint(RECALL_VOCAB, (batch, pairs), generator=generator)  # (batch, pairs)
    filler = 2 * RECALL_VOCAB + torch.randint(RECALL_VOCAB, (batch, tokens - 3 * pairs), generator=generator)
    asked = torch.randint(pairs, (batch, pairs), generator=generator)  # (batch, pairs)
    x = torch.cat([torch.stack([keys, values], -1).flatten(1), filler, keys.gather(1, asked)], 1)  # (batch, tokens)
    y = torch.full_like(x, -100)
    y[:, tokens - pairs:] = values.gather(1, asked)
    return x, y


def most_frequent_guess(x, y, pairs):
    """Recall (%) of a model that knows each sequence's values but not which key has which: it answers the value
    most frequent in the sequence (ties broken at random). What attention that cannot select (the floor) can reach."""
    values = x[:, 1:2 * pairs:2]  # (batch, pairs)
    counts = (values.unsqueeze(-1) == values.unsqueeze(-2)).sum(-1).double()  # (batch, pairs): each value's count
    counts = counts + torch.rand(counts.shape, generator=torch.Generator().manual_seed(0), dtype=torch.float64)
    guess = values.gather(1, counts.argmax(-1, keepdim=True))  # (batch, 1)
    answers = y[y != -100].reshape(len(y), -1)  # (batch, pairs)
    return 100 * (answers == guess).double().mean().item()


class CausalSoftmax(torch.nn.Module):
    """Causal softmax attention between InLineAttention's projections: x (B, N, C) -> (B, N, C); with
    residual='local', plus causal Eq. 6 as InLine has it (inline.sequence_residual over the last 3 tokens), so that
    softmax and InLine differ only in the attention."""

    def __init__(self, dim, num_heads, normalise_q=False, residual='none'):
        super().__init__()
        self.num_heads = num_heads
        inline.add_projections(self, dim, qkv_bias=True, separate_q=False)
        self.normalise_q = inline.NormalisedQ(num_heads, dim // num_heads) if normalise_q else None  # T1
        self.local_size = inline.neighbourhood_size(residual)
        self.residual = inline.residual_mlp(dim, num_heads, self.local_size) if self.local_size else None

    def forward(self, x):
        B, N, C = x.shape
        q, k, v = (t.reshape(B, N, self.num_heads, -1).transpose(1, 2) for t in self.qkv(x).chunk(3, -1))
        q = self.normalise_q(q) if self.normalise_q is not None else q  # (B, H, N, D)
        o = F.scaled_dot_product_attention(q, k, v, is_causal=True)  # (B, H, N, D)
        if self.residual is not None:
            r = inline.residual_weights(self.residual, x, causal=True)  # (B, N, T*C) from each prefix's mean
            o = o + inline.sequence_residual(v, r, self.local_size, causal=True)  # Eq. 6, (B, H, N, D)
        return self.proj(o.transpose(1, 2).reshape(B, N, C))


class CausalInLine(inline.InLineAttention):
    """inline.InLineAttention(causal=True) through short_sequence_core (T1's normalise_q is InLine's own option)."""

    def __init__(self, dim, num_heads, **options):
        super().__init__(dim, num_heads, causal=True, **options)
        if self.core is inline.inline_core:
            self.core = short_sequence_core


class DecoderBlock(torch.nn.Module):
    """The README's decoder block: x + attn(norm1(x)), then x + mlp(norm2(x)), on (B, N, C)."""

    def __init__(self, dim, attn):
        super().__init__()
        self.norm1, self.attn = torch.nn.LayerNorm(dim), attn
        self.norm2 = torch.nn.LayerNorm(dim)
        self.mlp = torch.nn.Sequential(torch.nn.Linear(dim, 2 * dim), torch.nn.GELU(), torch.nn.Linear(2 * dim, dim))

    def forward(self, x):
        x = x + self.attn(self.norm1(x))
        return x + self.mlp(self.norm2(x))


class RecallLM(torch.nn.Module):
    """Token and learned position embeddings, 2 decoder blocks, a norm and a head: (B, N) -> logits (B, N, 3V)."""

    def __init__(self, name, width, tokens):
        super().__init__()
        options = dict(RECALL_MODELS[name])
        softmax = options.get('attention') == 'softmax'
        if softmax:
            del options['attention']
        self.embed = torch.nn.Embedding(3 * RECALL_VOCAB, width)
        self.pos = torch.nn.Parameter(0.02 * torch.randn(1, tokens, width))
        self.blocks = torch.nn.Sequential(*[DecoderBlock(width, CausalSoftmax(width, RECALL_HEADS, **options) if softmax
                                                         else CausalInLine(width, RECALL_HEADS, **options))
                                            for _ in range(2)])
        self.norm, self.head = torch.nn.LayerNorm(width), torch.nn.Linear(width, 3 * RECALL_VOCAB)

    def forward(self, x, answers=None):
        """Logits at every token, or with `answers`, at the last `answers` tokens only (B, answers, 3V): where the
        queries sit, the only places a loss or a score reads (it saves about a tenth of a step)."""
        h = self.blocks(self.embed(x) + self.pos[:, :x.shape[1]])  # (B, N, C)
        return self.head(self.norm(h if answers is None else h[:, -answers:]))


def short_sequence_core(q, k, v, r, grid, scale=None, size=3, dilation=1, causal=False, scale_by_count=True):
    """inline.inline_core through the explicit causal weights: at 64 tokens the N x N form costs a CPU the least
    (the prefix sums' (B, H, N, D, D) tensors made a step ten times slower); the two are the same function
    (test_causal_forms_equal_the_explicit_weights)."""
    o = inline.inline_attention_quadratic(q, k, v, scale, causal, scale_by_count)  # Eq. 5, (B, H, N, D)
    return o if r is None else o + inline.local_residual(v, r, grid, size, dilation, causal)  # Eq. 6


def recall_answers(model, pairs, tokens, seed):
    """Which answers the model gets right, (RECALL_HELD_OUT, pairs) bool, on held-out sequences drawn from generator
    seed (RECALL_VALID or RECALL_TEST)."""
    x, y = mqar_batch(RECALL_HELD_OUT, pairs, tokens, torch.Generator().manual_seed(seed))
    with torch.no_grad():
        return model(x, pairs).argmax(-1) == y[:, -pairs:]


def recall_run(name, width, pairs, tokens, seed, lr, steps, compiled=False):
    """Train one model on fresh batches (AdamW, one-cycle schedule; no weight decay: every batch is new, so there is
    nothing to overfit, and decay would pull against the q length that s/i asks to grow) and count its right
    answers on the held-out sequences (for the learning rate) and the test ones, keeping which test answers it got
    right (train.pack_correct, sequence by sequence), for the intervals over the test set. compiled: the training
    forward through torch.compile (the same function, about 1.4x faster a step on a CPU after about 12 s of
    compiling; scoring stays eager). Returns the run's JSON line."""
    torch.manual_seed(seed)
    model = RecallLM(name, width, tokens)
    forward = torch.compile(model, dynamic=False) if compiled else model
    opt = torch.optim.AdamW(model.parameters(), lr=lr, weight_decay=0.0, betas=(0.9, 0.98))
    schedule = torch.optim.lr_scheduler.OneCycleLR(opt, lr, total_steps=steps, pct_start=0.1)
    data, start = torch.Generator().manual_seed(1000 + seed), time.process_time()

    def step():
        x, y = mqar_batch(RECALL_BATCH, pairs, tokens, data)
        loss = F.cross_entropy(forward(x, pairs).flatten(0, 1), y[:, -pairs:].flatten())  # the answers only
        opt.zero_grad(set_to_none=True)
        loss.backward()
        opt.step()
        schedule.step()
        return loss

    with torch._dynamo.config.patch(recompile_limit=64):  # compiled: a graph per model and size, none dropped to eager
        # the first step compiles them: one process at a time, the others then load them from the inductor cache
        with kernels.node_lock(('recall', name, width, pairs, tokens)) if compiled else contextlib.nullcontext():
            loss = step()
        for _ in range(steps - 1):
            loss = step()
    valid, test = (recall_answers(model, pairs, tokens, s) for s in (RECALL_VALID, RECALL_TEST))
    return dict(model=name, width=width, pairs=pairs, tokens=tokens, seed=seed, steps=steps, batch=RECALL_BATCH,
                lr=lr, valid=round(100 * valid.double().mean().item(), 2),
                recall=round(100 * test.double().mean().item(), 2), correct=train.pack_correct(test.flatten()),
                final_loss=round(loss.item(), 4), params=sum(p.numel() for p in model.parameters()),
                cpu_s=round(time.process_time() - start, 1), threads=torch.get_num_threads(), compiled=compiled)


def recall_key(name, width, pairs, tokens, seed, lr, steps, batch=RECALL_BATCH):
    """What makes a run: a stored run made with another batch, length or learning rate is not this one."""
    return json.dumps([name, width, pairs, tokens, seed, lr, steps, batch])


def recall_row_key(row):
    """A stored run's recall_key, for read_records: the recall runs are records too, one JSON line each."""
    return recall_key(*(row[k] for k in ('model', 'width', 'pairs', 'tokens', 'seed', 'lr', 'steps', 'batch')))


def held_out(runs, name, size, steps):
    """Seed 0's held-out recall at each of RECALL_LRS (None where it has no record): what chooses the rate."""
    return [runs[k]['valid'] if (k := recall_key(name, *size, 0, lr, steps)) in runs else None for lr in RECALL_LRS]


def best_lr(runs, name, size, steps):
    """The learning rate of RECALL_LRS whose seed-0 run recalls most on the held-out sequences (the smaller on a
    tie), or None until all of them have run."""
    valid = held_out(runs, name, size, steps)
    return None if None in valid else max(zip(valid, RECALL_LRS), key=lambda pair: (pair[0], -pair[1]))[1]


def recall_plan(runs, models, sizes, seeds, steps):
    """The runs still to train, in the order that leaves a stopped study balanced: every model at every learning rate
    (seed 0), then seed 1 of every model at its best, then seed 2, ... (cmd_recall: one size at a time)."""
    first = [(n, *size, 0, lr) for size in sizes for n in models for lr in RECALL_LRS]
    chosen = {(n, size): best_lr(runs, n, size, steps) for size in sizes for n in models}
    later = [(n, *size, s, chosen[n, size]) for s in range(1, seeds) for size in sizes for n in models
             if chosen[n, size] is not None]
    return [run for run in first + later if recall_key(*run, steps) not in runs]


def cmd_recall(args):
    models = args.models or RECALL_STUDY
    unknown = sorted(set(models) - set(RECALL_MODELS))
    if unknown:
        train.fail(f"unknown recall models {unknown}; choose from {list(RECALL_MODELS)}")
    if args.seeds < 1 or args.steps < 1 or args.threads < 1:
        train.fail(f"--seeds, --steps and --threads must be at least 1, got {args.seeds}, {args.steps}, {args.threads}")
    sizes = [tuple(map(int, size.split('x'))) for size in args.sizes if re.fullmatch(r'\d+x\d+x\d+', size)]
    if len(sizes) != len(args.sizes) or any(not 2 <= p <= RECALL_VOCAB or w < 1 or w % RECALL_HEADS
                                            or n - p < w // RECALL_HEADS or n < 3 * p for w, p, n in sizes):
        train.fail(f"--sizes takes CxPAIRSxTOKENS: the width C a multiple of the {RECALL_HEADS} heads, 2 <= PAIRS <= "
                   f"{RECALL_VOCAB} (distinct keys of {RECALL_VOCAB}), TOKENS >= 3 PAIRS and TOKENS - PAIRS >= D = "
                   f"C/{RECALL_HEADS}, so that every query sits at token D + 1 or later; got {args.sizes}")
    runs = read_records(args.results, key=recall_row_key)
    if not args.no_train:
        threads = torch.get_num_threads()
        torch.set_num_threads(args.threads)
        try:
            for size in sizes:  # a size finished before the next, so a stopped study has verdicts where it went
                for stage in ('first pass', 'second pass'):  # the second trains the seeds of learning rates the first chose
                    train_recall(runs, recall_plan(runs, models, [size], args.seeds, args.steps),
                                 f"{'x'.join(map(str, size))}, {stage}", args)
        finally:  # a caller in this process (the tests) keeps its threads
            torch.set_num_threads(threads)
    return recall_report(runs, models, sizes, args)


def recall_claim(out, key, wait=False):
    """lock_run on OUT/recall-claims/<the run>: the descriptor, or None while another command trains that run (and
    not wait)."""
    return lock_run(os.path.join(out, 'recall-claims', hashlib.sha256(key.encode()).hexdigest()[:24]), wait)


def train_recall(runs, todo, stage, args):
    """Train the runs of todo, each added to args.results (and runs) the moment it finishes. Each run is claimed
    first (recall_claim), so several commands share one plan: a run another command is training is left to it and
    waited for at the end (trained here if it left no record), so that the next stage is planned from every run of
    this one; and one command compiles a model's graph while the others wait to load it from the cache."""
    def rate(name):  # CPU seconds per token of a step: the model's own records (compiled or not), else every record's
        done = [r for r in runs.values() if r['batch'] == RECALL_BATCH and r['model'] == name
                and r.get('compiled', False) == args.compile] or list(runs.values())
        return sum(r['cpu_s'] for r in done) / max(sum(r['tokens'] * r['steps'] for r in done), 1)
    estimate = sum(rate(name) * tokens * args.steps for name, _, _, tokens, _, _ in todo) / 60
    print(f"recall (MQAR), {stage}: {len(todo)} runs to train at {args.threads} thread(s), {args.steps} steps of "
          f"{RECALL_BATCH}, about {estimate:.0f} CPU-min (from the records' CPU time per token)", flush=True)
    trained = []

    def attempt(run, wait):  # False: another command holds the run
        key = recall_key(*run, args.steps)
        claim = recall_claim(args.out, key, wait)
        if claim is None:
            return False
        try:
            runs.update(read_records(args.results, key=recall_row_key))
            if key not in runs:  # not recorded by another command meanwhile
                runs[key] = recall_run(*run, args.steps, args.compile)
                append_record(args.results, runs[key])
                trained.append(runs[key]['cpu_s'])
        finally:
            os.close(claim)
        return True
    others = [run for run in tqdm(todo, desc='recall', disable=not todo) if not attempt(run, wait=False)]
    for run in others:
        attempt(run, wait=True)
    if trained:
        print(f"trained {len(trained)} runs in {sum(trained) / 60:.1f} CPU-min (process CPU time)")


def chosen_runs(runs, name, size, steps, seeds):
    """(the model's best learning rate or None, its records at that rate in seed order, those of seeds 0..seeds-1
    that exist)."""
    lr = best_lr(runs, name, size, steps)
    return lr, [] if lr is None else [runs[k] for s in range(seeds) if (k := recall_key(name, *size, s, lr, steps)) in runs]


def first_study(runs, name, size, seeds):
    """The model's recall at the first study's budget, RECALL_FIRST_STEPS (its own best learning rate there, mean
    over its seeds), '-' without those records: what ten times the steps changed."""
    rows = chosen_runs(runs, name, size, RECALL_FIRST_STEPS, seeds)[1]
    return f"{statistics.mean(r['recall'] for r in rows):.1f} ({len(rows)})" if rows else '-'


def by_sequence(rows, pairs):
    """(seeds, RECALL_HELD_OUT): each run's share of right answers on each test sequence, from its record's
    `correct`, the test set's side of the intervals; None where a record predates them."""
    if not rows or any('correct' not in r for r in rows):
        return None
    return torch.stack([train.unpack_correct(r['correct'], RECALL_HELD_OUT * pairs).view(RECALL_HELD_OUT, pairs)
                        .double().mean(1) for r in rows])


def recall_report(runs, models, sizes, args):
    """The tables and the picture from the records: the learning rates, recall by model against the floor and the
    guess, and each comparison's verdict, gated by both."""
    guesses = {(w, p, n): most_frequent_guess(*mqar_batch(RECALL_HELD_OUT, p, n, torch.Generator().manual_seed(
        RECALL_TEST)), p) for w, p, n in sizes}
    recall, sequences = recall_table(runs, models, sizes, guesses, args)
    recall_comparisons(recall, sequences, guesses, models, sizes)
    panels = []
    for size in sizes:
        series = [(name, list(RECALL_LRS), held_out(runs, name, size, args.steps), None) for name in models]
        if all(y is None for _, _, ys, _ in series for y in ys):
            continue  # no runs at this size yet
        panels.append(dict(series=series, title='MQAR, C {}, {} pairs, {} tokens: held-out recall, seed 0'.format(
            *size), xlabel='learning rate', ylabel='recall (%)', xticks=list(RECALL_LRS), log_x=True, lines=True,
            ylim=(0, 100), hlines=[('the guess', guesses[size])]))
    if panels:
        charts(args.png or os.path.join(args.out, 'recall.png'), panels, cols=len(panels), size=(560, 460))
    return runs


def recall_table(runs, models, sizes, guesses, args):
    """Print each model's learning rates, recall and seeds at each size; return {(model, C, pairs, tokens): recall
    per seed} and {the same: by_sequence}."""
    print(f"\nMQAR: keys, values and filler from {RECALL_VOCAB} tokens each, 2 layers, {RECALL_HEADS} heads, "
          f"{args.steps} steps of {RECALL_BATCH} sequences; recall = right answers on {RECALL_HELD_OUT} test "
          f"sequences, mean over the seeds with its 95% interval over the seeds and the test sequences (the ablations' "
          f"two-way model), or over the seeds only (Student-t) where a record predates per-answer results; each model "
          f"at the learning rate of {', '.join(map(str, RECALL_LRS))} that recalled most on {RECALL_HELD_OUT} "
          f"held-out sequences (seed 0). Every query sits at token D + 1 or later.\n")
    first = args.steps != RECALL_FIRST_STEPS  # a column for the first study's recall
    recall, sequences, table, missing = {}, {}, [], []
    for (w, p, n), name in itertools.product(sizes, models):
        lr, rows = chosen_runs(runs, name, (w, p, n), args.steps, args.seeds)
        tried = held_out(runs, name, (w, p, n), args.steps)
        recall[name, w, p, n] = values = [r['recall'] for r in rows]
        sequences[name, w, p, n] = by_sequence(rows, p)
        if all(v is None for v in tried):
            missing.append(f"{name} at {w} / {p} / {n}")
            continue
        mean, half = interval(values, sequences[name, w, p, n]) if values else (math.nan, math.nan)
        table.append([f"{w} / {p} / {n}", name, ' '.join('-' if v is None else f'{v:.1f}' for v in tried), lr or '-',
                      f"{mean:.1f} ± {half:.1f}" if values else '-', ' '.join(f'{v:.1f}' for v in values),
                      len(values)] + ([first_study(runs, name, (w, p, n), args.seeds)] if first else []))
    cpu = sum(r['cpu_s'] for r in runs.values() if r['model'] in models and (r['width'], r['pairs'], r['tokens'])
              in sizes and r['steps'] == args.steps)
    print_table(['C / pairs / tokens', 'model', 'held-out % at each lr', 'lr', 'recall %', 'per seed', 'seeds']
                + ([f'at {RECALL_FIRST_STEPS} steps'] if first else []), table)
    print('\nthe guess: a model that knows the values of its sequence and answers the most frequent (simulated on the '
          'test sequences): ' + ', '.join(f"{g:.1f}% at {w} / {p} / {n}" for (w, p, n), g in guesses.items()) +
          f'. CPU time of these runs: {cpu / 60:.1f} min.' + (f' No runs yet: {", ".join(missing)}.' if missing else ''))
    return recall, sequences


def recall_comparisons(recall, sequences, guesses, models, sizes):
    """Print each comparison's difference, verdict and Holm verdict, untestable unless both models clear the floor
    and the guess by RECALL_GATE."""
    verdicts, ps = [], []
    for (question, a, b), eq6 in itertools.product(RECALL_COMPARISONS, ('', RECALL_EQ6)):
        a, b, floor_name = a + eq6, b + eq6, RECALL_FLOOR + eq6  # each model's floor has Eq. 6 where it has
        for w, p, n in sizes:
            if a not in models or b not in models:
                continue
            ra, rb, floor = recall[a, w, p, n], recall[b, w, p, n], recall.get((floor_name, w, p, n), [])
            seeds = min(len(ra), len(rb))
            if seeds < 2:
                continue
            diffs = [y - x for x, y in zip(ra[:seeds], rb[:seeds])]
            sa, sb = sequences[a, w, p, n], sequences[b, w, p, n]
            images = None if sa is None or sb is None else sb[:seeds] - sa[:seeds]  # (seeds, sequences)
            mean, half = interval(diffs, images)
            gate = max(statistics.mean(floor) if floor else math.inf, guesses[w, p, n]) + RECALL_GATE
            cleared = statistics.mean(ra) >= gate and statistics.mean(rb) >= gate
            row = [question + eq6, f"{w} / {p} / {n}", f"{statistics.mean(ra[:seeds]):.1f}",
                   f"{statistics.mean(rb[:seeds]):.1f}", f"{mean:+.1f} ± {half:.1f}", seeds,
                   verdict(diffs, RECALL_CLAIM, images) if cleared else 'untestable']
            verdicts.append(row)
            ps.append(min(p_values(diffs, RECALL_CLAIM, images)) if cleared else None)
    adjusted = iter(holm([q for q in ps if q is not None]))
    for row, q in zip(verdicts, ps):  # Holm over the testable comparisons of this table
        row.append('untestable' if q is None else row[-1] if next(adjusted) < ALPHA else 'not resolved')
    if verdicts:
        print(f'\nComparisons, b minus a seed by seed, with its 95% interval over the seeds and the {RECALL_HELD_OUT} '
              f'test sequences (the ablations\' two-way random-effects model, t on Satterthwaite\'s degrees of freedom), '
              f'or over the seeds only (Student-t) where a record predates per-answer results; the verdict is on "b '
              f'recalls more than a" (RESULTS.md, "Verdicts"), untestable unless both clear the floor (phi = 0) and the '
              f'guess by {RECALL_GATE:g} points; the Holm verdict the same over the testable ones.\n')
        print_table(['question', 'C / pairs / tokens', 'a %', 'b %', 'b - a', 'seeds', 'verdict', 'Holm verdict'],
                    verdicts)


# ---------------------------------------------------------------------------------------------------
# The command line

def cmd_mosaics(args):
    """Samples of train.py's --dataset fashion_recall, test split, each task a row, every mosaic under its label."""
    images, labels, classes = train.read_small('fashion_mnist', args.data_path, train=False)
    rows = [(f'recall, {p} pairs', train.FashionRecall(images, labels, 8, 0, False, task='recall', pairs=p))
            for p in (2, 4)] + [('below, 16 items', train.FashionRecall(images, labels, 8, 0, False, task='below'))]
    scale, pad, text = 3, 12, 30  # each 64 px mosaic drawn 192 px wide, its label under it
    img = Image.new('RGB', (150 + 8 * (64 * scale + pad), len(rows) * (64 * scale + text + pad)), 'white')
    draw = ImageDraw.Draw(img)
    for r, (name, mosaics) in enumerate(rows):
        y = r * (64 * scale + text + pad)
        draw.text((8, y + 90), name, fill='black', font=font(14))
        for i in range(8):
            x, label = mosaics[i]
            pixels = (x[0] * train.STD[0] + train.MEAN[0]).clamp(0, 1).mul(255).byte()  # (64, 64), the gray channel
            tile = Image.fromarray(pixels.numpy(), 'L').resize((64 * scale,) * 2, Image.NEAREST)
            img.paste(tile, (150 + i * (64 * scale + pad), y))
            draw.text((150 + i * (64 * scale + pad), y + 64 * scale + 6), classes[label], fill='black', font=font(14))
    save_png(img, args.png or os.path.join(args.out, 'mosaics.png'))


def add_recall_parser(sub, common):
    """`paper.py recall`'s options."""
    p = sub.add_parser('recall', parents=[common], help='associative recall (MQAR): softmax, linear and causal InLine')
    p.add_argument('--results', default=RECALL_RESULTS, help='finished runs, one JSON line each (default '
                   'results/recall.jsonl beside paper.py); a rerun trains only what is missing')
    p.add_argument('--models', nargs='+', metavar='NAME', help=f'these models (default: the study\'s, every one with Eq. 6), of {", ".join(RECALL_MODELS)}')
    p.add_argument('--sizes', nargs='+', metavar='CxPAIRSxTOKENS', default=[f'{w}x{p}x{n}' for w, p, n in RECALL_SIZES],
                   help=f'model width C ({RECALL_HEADS} heads), key-value pairs and tokens per sequence (default '
                        f'{" ".join(f"{w}x{p}x{n}" for w, p, n in RECALL_SIZES)})')
    p.add_argument('--seeds', type=int, default=RECALL_SEEDS, help='seeds per model and size (0, 1, ...)')
    p.add_argument('--steps', type=int, default=RECALL_STEPS, help=f'training steps of {RECALL_BATCH} sequences')
    p.add_argument('--threads', type=int, default=1, help='CPU threads of this process')
    p.add_argument('--compile', action='store_true', help='train through torch.compile (about 1.4x faster a step '
                   'on a CPU). Several commands at once share the study: each trains what no other has claimed')
    p.add_argument('--no-train', action='store_true', help='train nothing: the tables and picture from the records')


def main(argv=None):
    common = argparse.ArgumentParser(add_help=False)
    common.add_argument('--out', default=os.path.join('runs', 'paper'),
                        help='results, cached runs and pictures (default runs/paper)')
    common.add_argument('--png', help='write the picture here instead of OUT/<subcommand>.png')
    parser = argparse.ArgumentParser(description=__doc__.split('\n')[0])
    sub = parser.add_subparsers(dest='command', required=True)
    sub.add_parser('models', help="every released variant's params and GMACs beside the authors' and the paper's")
    sub.add_parser('experiments', help='every experiment of the paper by name, with its params and the paper\'s top-1')
    sub.add_parser('injectivity', parents=[common], help='F1: identical weight rows under softmax, linear and InLine')
    budget = argparse.ArgumentParser(add_help=False, parents=[common])  # what each train.py run gets
    budget.add_argument('--epochs', type=int, help=f'epochs of every training run (CPU {BUDGET["cpu"]["epochs"]}, '
                                                   f'CUDA {BUDGET["cuda"]["epochs"]})')
    budget.add_argument('--train-images', type=int,
                        help=f'training images: a fixed subset of the dataset, or synthetic ones per epoch (CPU '
                             f'{BUDGET["cpu"]["train_images"]:,}, CUDA {BUDGET["cuda"]["train_images"]:,})')
    budget.add_argument('--device', choices=['cpu', 'cuda'], default='cpu',
                        help='where train.py runs: cpu, or cuda at the scale where the miniatures converge (BUDGET)')
    budget.add_argument('--results', default=RECORDS, help='the run records, one JSON line per finished run '
                                                          '(default results/runs.jsonl beside paper.py)')
    budget.add_argument('--no-train', action='store_true',
                        help='train nothing: rebuild from the records, leaving out the runs without one')
    budget.add_argument('--dataset', choices=['synthetic', 'imagefolder', *train.SMALL_DATASETS, 'fashion_recall'],
                        help='the data every run trains on (default fashion_mnist; ablations on fashion_recall: the '
                             'test bed where attention must select, MOSAIC_ROWS at MOSAIC_BUDGET); with --checkpoints, '
                             'the images to measure on (default: each checkpoint\'s own)')
    budget.add_argument('--data-path', help=f'its root (default {FASHION_MNIST_DEB} for fashion_mnist where '
                                            'Debian\'s dataset-fashion-mnist package put it, else data/)')
    budget.add_argument('--download', action='store_true', help='download a small dataset first (torchvision)')
    budget.add_argument('--jobs', type=int, default=2, help='train.py processes at a time, sharing the cores')
    trained = argparse.ArgumentParser(add_help=False, parents=[budget])
    trained.add_argument('--checkpoints', nargs='+', metavar='[NAME=]PATH',
                         help='train.py checkpoints of DeiT models, a NAME again for another seed (default: train '
                              'the four small ones)')
    p = sub.add_parser('locality', parents=[trained], help='F4: attention mass on the 3x3 neighbourhood per layer')
    p.add_argument('--images', type=int, default=512, help='validation images to average over')
    p.add_argument('--seeds', type=int, default=3, help='seeds of each of the four models (0, 1, ...)')
    p = sub.add_parser('maps', parents=[trained], help='F3: attention maps of query tokens over an image')
    p.add_argument('--image', help='an image file (default: a validation image of the checkpoint\'s data)')
    p.add_argument('--index', type=int, default=0, help='which validation image')
    p.add_argument('--queries', nargs='+', default=['1,1', '3,4', '6,5'], metavar='ROW,COL',
                   help='query tokens on the token grid, from 0')
    p.add_argument('--layers', nargs='+', default=[], metavar='L', help='layers to show, from 1 (default first, last)')
    p = sub.add_parser('speed', parents=[common], help='F5b, F5c: images/s against window and image size')
    p.add_argument('--quick', action='store_true', help='two points per figure, 3 rounds on CPU')
    p.add_argument('--batch', type=int, help='images per forward (default: CPU 1, CUDA 32)')
    p.add_argument('--rounds', type=int, help='interleaved rounds per point (default: CPU 5, quick 3; CUDA 20)')
    p.add_argument('--model-step', action='store_true',
                   help='also time a whole InLine-Swin-T training step: reference vs fast core')
    p.add_argument('--whole', nargs='?', const='all', choices=['all', 'swin', 'deit'], help='whole models against '
                   'their softmax originals: InLine-Swin-T inference and training step, InLine-DeiT-T inference at 224, '
                   '512, 1024 px (swin, deit: those rows only), and a profile of an InLine-DeiT-T forward (instead of '
                   'F5b, F5c)')
    p.add_argument('--compile', action='store_true', help='--whole: also time InLine under whole-model torch.compile '
                   '(compiling takes minutes)')
    p.add_argument('--device', help='--whole: cpu (default) or cuda')
    p.add_argument('--dense', action='store_true', help='backbone forward time and peak memory at detection sizes, '
                   '512x512 to 800x1344: Swin-T, PVT-S, DeiT-T, each softmax against InLine (instead of F5b, F5c)')
    p = sub.add_parser('ablations', parents=[budget], help='T3, T4, T10, R-res, R-dil, R-nonneg, T1, S: trained small')
    p.add_argument('--quick', action='store_true',
                   help=f'{QUICK_SEEDS} seeds of {len(QUICK)} experiments: {", ".join(QUICK)}')
    p.add_argument('--only', nargs='+', metavar='NAME', help='these experiments only')
    p.add_argument('--claims', action='store_true', help=f'the claim rows ({CLAIM_SEEDS} seeds) and their floors')
    p.add_argument('--seeds', nargs='+', metavar='[TABLE=]N', help=f'seeds (0, 1, ...): N for every table, TABLE=N '
                   f'for one (default {" ".join(f"{t}={n}" for t, n in SEEDS.items())})')
    add_recall_parser(sub, common)
    p = sub.add_parser('mosaics', parents=[common], help="train.py's fashion_recall mosaics, with their labels")
    p.add_argument('--data-path', default=FASHION_MNIST_DEB, help='Fashion-MNIST\'s IDX files')
    args = parser.parse_args(argv)
    if args.command in ('locality', 'maps') and args.dataset == 'fashion_recall':
        parser.error(f'{args.command} measures DeiT checkpoints of the small datasets; fashion_recall is the ablations\' '
                     f'test bed (paper.py ablations --dataset fashion_recall)')
    return {'models': cmd_models, 'experiments': cmd_experiments, 'injectivity': cmd_injectivity,
            'locality': cmd_locality, 'maps': cmd_maps, 'speed': cmd_speed, 'ablations': cmd_ablations,
            'recall': cmd_recall, 'mosaics': cmd_mosaics}[args.command](args)


if __name__ == '__main__':
    main()

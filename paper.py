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
    python paper.py ablations [--quick]    # T3, T4, T10, R-res, R-dil, R-nonneg, T1, S: trained small
    python paper.py recall                 # InLine on sequences: associative recall (MQAR) against state size

The trained ones (locality, maps, ablations) train on Fashion-MNIST unless told (--dataset, --data-path: any
ImageFolder too): locality and maps their four small DeiTs, ablations every experiment of models.EXPERIMENTS,
each on first use and cached, a model that several need trained once. Nothing here trains images by itself: every
image run is a `python train.py ...` subprocess, the project's one training loop; recall's small sequence models
train in this process (its section says why). The verdicts' rules are fixed below
(verdict) and in the tests.
"""
import argparse
import ctypes
import contextlib
import hashlib
import io
import json
import math
import os
import re
import resource
import statistics
import subprocess
import sys
import time

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
           (227, 119, 194), (127, 127, 127)]
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
    x0, y0, x1, y1 = left + 58, top + 44, right - 14, bottom - 66  # the plotting area; title above, legend below
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
    legend_x = x0  # one row under the x label, wrapped when it runs out of width
    legend_y = bottom - 12 - 16 * (sum(len(label) * 6 + 40 for label, *_ in series) // (x1 - x0 + 1))
    for i, (label, *_) in enumerate(series):
        width = len(label) * 6 + 40
        if legend_x + width > x1 and legend_x > x0:
            legend_x, legend_y = x0, legend_y + 16
        draw.rectangle([legend_x, legend_y - 5, legend_x + 12, legend_y + 5], fill=PALETTE[i % len(PALETTE)])
        draw.text((legend_x + 17, legend_y), label, fill='black', font=font(11), anchor='lm')
        legend_x += width


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
# Training runs: every model here is trained by `python train.py`, and a finished run is never redone

def run_dir(out, label, argv):
    """OUT/runs/<label>-<hash of the train.py arguments>: a changed configuration is a new run, never a stale one."""
    return os.path.join(out, 'runs', f'{label}-{hashlib.sha1(json.dumps(argv).encode()).hexdigest()[:8]}')


def run_state(path, epochs):
    """'done' (metrics.jsonl has the last epoch), 'diverged' (train.py stopped on a non-finite loss: a result,
    kept so it is not retried) or None (not started, or interrupted: train.py resumes it)."""
    if os.path.exists(os.path.join(path, 'diverged')):
        return 'diverged'
    try:
        with open(os.path.join(path, 'metrics.jsonl')) as f:
            return 'done' if [json.loads(line) for line in f][-1]['epoch'] == epochs else None
    except (FileNotFoundError, IndexError):
        return None


def train_runs(runs, jobs=1, desc='training'):
    """Train each run, {path: (argv, epochs)}, as `python train.py ARGV --output-dir PATH`, `jobs` at a time
    (each with cores/jobs threads), skipping the finished ones; returns {path: 'done' | 'diverged'}."""
    threads = max(1, (os.cpu_count() or 1) // jobs)
    todo = [p for p, (_, epochs) in runs.items() if run_state(p, epochs) is None]
    if len(todo) < len(runs):
        print(f'{len(runs) - len(todo)} of {len(runs)} runs already finished (cached under their folders)')
    count, cpu_before = len(todo), children_cpu_s()
    running, bar = {}, tqdm(total=count, desc=desc, dynamic_ncols=True)
    while todo or running:
        while todo and len(running) < jobs:
            path = todo.pop(0)
            os.makedirs(path, exist_ok=True)
            log = open(os.path.join(path, 'train.log'), 'a')
            argv = [sys.executable, os.path.join(HERE, 'train.py'), *runs[path][0], '--output-dir', path,
                    '--threads', str(threads)]
            log.write('$ ' + ' '.join(argv) + '\n')
            log.flush()
            running[path] = (subprocess.Popen(argv, stdout=log, stderr=subprocess.STDOUT, cwd=HERE), log)
        path, (proc, log) = wait_any(running)
        log.close()
        del running[path]
        with open(os.path.join(path, 'train.log')) as f:
            tail = f.read()[-3000:]
        if proc.returncode and 'the loss is not finite' in tail:
            with open(os.path.join(path, 'diverged'), 'w') as f:
                f.write(tail[tail.rfind('error:'):])
        elif proc.returncode or run_state(path, runs[path][1]) != 'done':
            for other, _ in running.values():
                other.terminate()  # train.py saves on SIGTERM; a rerun resumes them
            train.fail(f'train.py failed (exit {proc.returncode}) in {path}; its log ends:\n{tail}')
        bar.update()
    bar.close()
    if count:  # CPU time hardly depends on what else the machine runs; wall time does
        cpu = children_cpu_s() - cpu_before
        print(f'{count} train.py runs took {cpu / 60:.1f} CPU-minutes ({cpu / 60 / count:.1f} per run): '
              f'about {cpu / 60 / (threads * jobs):.1f} min of wall time on {threads * jobs} cores of their own')
    return {p: run_state(p, epochs) for p, (_, epochs) in runs.items()}


def children_cpu_s():
    """User + system CPU seconds of every finished child process so far (the train.py runs)."""
    usage = resource.getrusage(resource.RUSAGE_CHILDREN)
    return usage.ru_utime + usage.ru_stime


def wait_any(running):
    """The first of the running {path: (process, log)} to finish."""
    while True:
        for path, (proc, log) in running.items():
            if proc.poll() is not None:
                return path, (proc, log)
        time.sleep(0.5)


def metrics(path):
    with open(os.path.join(path, 'metrics.jsonl')) as f:
        return [json.loads(line) for line in f]


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
    every = {**experiments(), **F4_EXTRA}
    runs, folders = plan_runs({n: every[n] for n in F4_MODELS.values()}, every, lambda name: seeds, args)
    states = train_runs(runs, args.jobs, desc='training the four DeiT models')
    return {label: [os.path.join(p, train.CHECKPOINT) for p in folders[n] if states[p] == 'done']
            for label, n in F4_MODELS.items()}


def checkpoints(args, seeds=1):
    """{name: [checkpoints]}: --checkpoints NAME=PATH ... (a name given again is another seed of it), or the four
    small DeiTs (trained on first use)."""
    if not args.checkpoints:
        resolve_data(args)
        return deit_runs(args, seeds)
    found = {}
    for c in args.checkpoints:
        name, path = c.split('=', 1) if '=' in c else (os.path.basename(os.path.dirname(c)) or c, c)
        found.setdefault(name, []).append(path)
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


def cmd_locality(args):
    results, top1, grid, what = {}, {}, None, ''
    for name, paths in tqdm(checkpoints(args, args.seeds).items(), desc='locality', dynamic_ncols=True):
        for path in paths:
            model, ckpt = load_trained(path)
            images, _, _, what = eval_images(ckpt, model, args, args.images)
            results.setdefault(name, []).append(layer_shares(model, images))
            top1.setdefault(name, []).append((ckpt.get('log') or [{}])[-1].get('val_acc1'))
            if grid not in (None, model.grid):
                train.fail(f'the checkpoints have different token grids ({grid} and {model.grid})')
            grid = model.grid
    hw = grid[0] * grid[1]
    uniform = {'own': 1 / hw, 'near': (neighbourhood(grid).sum().item() - hw) / hw / hw}  # 1/hw each
    stat = lambda v: (statistics.mean(v), statistics.stdev(v) if len(v) > 1 else 0.0)  # noqa: E731
    print(f'F4: per layer, means over {what}, the {grid[0]}x{grid[1]} grid queries and the heads (per head in '
          f'brackets), ± the standard deviation over seeds. Own token and the other 8 of the 3x3: among the grid '
          f'weights renormalised without the class token; uniform weights give {uniform["own"]:.4f} and '
          f'{uniform["near"]:.4f}. Eq. 6\'s share: |Eq. 6| / (|Eq. 5| + |Eq. 6|) of each output.\n')
    rows, curves = [], {k: [] for k in SHARES}
    for name, per_seed in results.items():
        accs = [a for a in top1[name] if a is not None]
        for layer in range(len(per_seed[0])):
            cells = []
            for key in SHARES:
                heads = torch.stack([seed[layer][key] for seed in per_seed])  # (seeds, H)
                m, s = stat(heads.mean(1).tolist())
                cells.append(f'{m:.3f} ± {s:.3f} (' + ' / '.join(f'{h:.2f}' for h in heads.mean(0).tolist()) + ')')
            rows.append([name, layer + 1, (f'{statistics.mean(accs):.1f} ({len(accs)} seeds)' if accs else '—')
                         if layer == 0 else '', *cells])
        for key in SHARES:
            series = [stat([seed[layer][key].mean().item() for seed in per_seed]) for layer in range(len(per_seed[0]))]
            curves[key].append((name, list(range(1, len(series) + 1)), [m for m, _ in series], [s for _, s in series]))
    print_table(['model', 'layer', 'top-1', *SHARES.values()], rows)
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
    loaded = {name: load_trained(paths[0]) for name, paths in checkpoints(args).items()}  # the first seed
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

# The miniature, the same for every experiment of a family: 64 px images (Fashion-MNIST's 28 px resized), so Swin's
# stage 1 is a 16x16 grid (stages 16, 8, 4, 2), against 56x56 at 224 px, and DeiT's 8 px patches give an 8x8 grid.
# Everything measured in stage-1 tokens shrinks by 16/56: the InLine windows 7, 14, 28, 56 of T4 become 2, 4, 8, 16
# (1/8, 1/4, 1/2 and all of the stage, as in the paper); Swin's softmax window becomes 4. Widths shrink by the
# family's factor with the head dim kept, so head counts shrink with them (the softmax originals' own counts too);
# depths as listed, the same for a softmax original as for its InLine version. The README says why.
MINI_IMG, MINI_STAGE1 = 64, 16  # image side; Swin's stage-1 side at that size (56 at 224 px)
MINI = {  # family: (width factor, create_model sizes)
    'swin': (1 / 3, dict(embed_dim=32, depths=(2, 2, 2, 2), num_heads=(1, 2, 4, 8), softmax_window=4)),
    'deit': (1 / 3, dict(patch_size=8, embed_dim=64, depth=6, num_heads=2)),
    'pvt': (1, dict(depths=(1, 1, 1, 1), sr_ratios=(4, 2, 1, 1))),
    # CSwin keeps its width: its two-branch softmax blocks split the heads in halves, and stage 1 has 2
    'cswin': (1, dict(depths=(1, 2, 2, 1), stripes=(1, 2, 2, 2))),
}
# The budget of every run, measured before it was chosen (README, "Ablations"): a fixed subset of the training
# images (the small-data regime, where a locality bias matters most), trained until the learning curve is flat
EPOCHS, TRAIN_IMAGES, VAL_EVERY = 12, 4000, 4
# CPU-minutes of one run at that budget per family on this project's 2-core machine (AVX-512 BF16), two runs at a
# time, to print the run's length before it starts; scaled by epochs x images for another budget. Swin and DeiT
# measured by whole runs, PVT and CSwin by their training steps' cost relative to Swin's
RUN_CPU_MIN = {'swin': 2.75, 'deit': 2.1, 'pvt': 5.0, 'cswin': 5.6}
# Seeds per table (README, "Verdicts"): 3, the fewest that give a 95% interval, for every table, so that the whole
# run fits one working session of this machine; each row prints how many would resolve 1 point
SEEDS = {'T3': 3, 'T4': 3, 'R-res': 3, 'S': 3, 'T10': 3, 'R-dil': 3, 'R-nonneg': 3, 'T1': 3}
QUICK = ('s_deit_t', 'inline_deit_t', 'r_residual_none', 'r_residual_local')  # S on DeiT; Eq. 6 with the APE
QUICK_SEEDS = 3  # 2 DeiT and 2 Swin configurations x 3 seeds: the least that gives a 95% interval at all (t = 4.30)
# The data paper.py trains on unless told: Fashion-MNIST, which Debian's dataset-fashion-mnist package installs here
FASHION_MNIST_DEB = '/usr/share/datasets/fashion-mnist'


def experiments():
    """{name: Experiment}: every entry of models.EXPERIMENTS that the miniature covers (the smallest size of each
    family: S rows of bigger variants repeat the same miniature), and the released InLine variants for S."""
    chosen = {n: e for n, e in models.EXPERIMENTS.items() if e.table != 'S' or e.model.endswith('_t')}
    none, local = chosen['r_residual_none'], chosen['r_residual_local']
    chosen['r_residual_none_matched'] = models.Experiment(
        none.model, {**none.overrides, 'mlp_ratio': matched_mlp_ratio(none, parameters(local))}, 'R-res', None,
        True, "no residual (APE), every MLP widened to Eq. 6's parameter count")
    inline_t = {n: models.Experiment(n, {}, 'S', str(models.RELEASED[n][2]), False, f'{n} as released')
                for n in ('inline_swin_t', 'inline_deit_t', 'inline_pvt_t', 'inline_cswin_t')}
    return {**chosen, **inline_t}


def matched_mlp_ratio(e, count):
    """The mlp_ratio (one for every block, 3 decimals) that gives e's miniature `count` parameters: a block of
    width C with hidden width H has (2C + 1) H of its MLP's parameters, so H grows by the gap over sum (2C + 1) C
    per unit of ratio. The R-res row that matches Eq. 6 parameter for parameter."""
    model = miniature(e)
    mlps = [m for m in model.modules() if isinstance(m, models.Mlp)]
    ratio = mlps[0].fc1.out_features / mlps[0].fc1.in_features
    per_unit = sum((2 * m.fc1.in_features + 1) * m.fc1.in_features for m in mlps)
    return round(ratio + (count - sum(p.numel() for p in model.parameters())) / per_unit, 3)


def reference(name, table):
    """The row each row is compared with, so the paper's ordering can be checked pair by pair; None for the table's
    reference row itself. T3: division against subtraction with the same kernel; T4: without against with the
    local residual at each window, and each window against 56; R-res: against the released InLine-Swin-T, and
    the two corners of the 2x2 (Eq. 6 x APE) against the row with the same APE; T10, R-dil, R-nonneg: against the
    released InLine-Swin-T; T1: against softmax; S: each softmax original against its InLine version."""
    if table == 'T3':
        return name.replace('linear', 'inline') if '_linear_' in name else name.replace('inline', 'linear')
    if table == 'T4':
        return (name.replace('_no_residual', '_residual') if name.endswith('_no_residual') else
                't4_window56_residual' if name != 't4_window56_residual' else 't4_window56_no_residual')
    if table == 'S':
        return name.replace('s_', 'inline_', 1) if name.startswith('s_') else None
    if name == 'r_residual_local_ape':
        return 'r_residual_none'  # both with the APE: Eq. 6 alone
    base = {'T10': 't10_kernel_identity', 'R-res': 'r_residual_local', 'R-dil': 'r_dilation1',
            'R-nonneg': 'r_residual_local', 'T1': 't1_softmax'}[table]
    return None if name == base else base


# The paper's claim for rows it has no number for but whose comparison tests one of its claims: R-res's corners of
# the 2x2 test "Eq. 6 adds 2.2 points" (its r_residual_local 82.4 against r_residual_none 80.2) with the APE held,
# and the matched row tests it parameter for parameter
CLAIMS = {'r_residual_none_no_ape': ('R-res: -2.2', -2.2), 'r_residual_local_ape': ('R-res: +2.2', 2.2),
          'r_residual_none_matched': ('R-res: -2.2', -2.2)}


def mini_kwargs(e):
    """The create_model overrides that make an experiment's miniature, on top of its own: the family's sizes, head
    counts the experiment sets scaled by the family's width factor, windows scaled to the 16x16 stage 1 (None,
    the whole stage, where they cover it). CSwin's softmax original keeps the miniature's depths, not its own."""
    width, sizes = MINI[e.model.split('_')[1]]
    kwargs = dict(sizes)
    if 'num_heads' in e.overrides:
        heads = e.overrides['num_heads']
        scaled = [h * width for h in (heads if isinstance(heads, tuple) else (heads,))]
        if any(abs(h - round(h)) > 1e-9 for h in scaled):
            raise ValueError(f'{e.model}: {heads} heads do not scale by {width:.3g} to whole heads')
        kwargs['num_heads'] = tuple(round(h) for h in scaled) if isinstance(heads, tuple) else round(scaled[0])
    if e.overrides.get('window') is not None:
        window = e.overrides['window'] * MINI_STAGE1 // 56
        kwargs['window'] = None if window >= MINI_STAGE1 else window
    return kwargs


def resolve_data(args):
    """Fill --dataset (default Fashion-MNIST) and --data-path, download once if asked (not once per run), and stop
    with how to get the data when it is missing, before any run starts."""
    args.dataset = args.dataset or 'fashion_mnist'
    if args.data_path is None and args.dataset != 'synthetic':
        args.data_path = FASHION_MNIST_DEB if args.dataset == 'fashion_mnist' and os.path.isdir(FASHION_MNIST_DEB) \
            else 'data'
    if args.dataset in train.SMALL_DATASETS:
        if args.download:  # torchvision fetches every split's files at once
            train.SMALL_DATASETS[args.dataset](args.data_path, download=True)
        train.read_small(args.dataset, args.data_path, train=False)  # missing: says how to get them
    elif args.dataset == 'imagefolder':
        for split in ('train', 'val'):
            if not os.path.isdir(os.path.join(args.data_path, split)):
                train.fail(f'--data-path {args.data_path} has no {split}/ folder (an ImageFolder root: train/ and val/)')
    if args.data_path:
        args.data_path = os.path.abspath(args.data_path)


def data_argv(args):
    """train.py's data flags: the dataset and a fixed subset of its training images, or fresh synthetic ones. An
    ImageFolder gets the small datasets' recipe (train.SMALL) in place of the released ImageNet one."""
    if args.dataset == 'synthetic':
        return ['--synthetic-train', str(args.train_images)]
    small = [] if args.dataset != 'imagefolder' else ['--accum-steps', '1', '--ema-decay', '0'] + [
        x for k, v in train.SMALL.items() if k != 'epochs' for x in (f'--{k.replace("_", "-")}', str(v))]
    return ['--dataset', args.dataset, '--data-path', args.data_path, '--train-subset', str(args.train_images), *small]


def ablation_argv(name, e, seed, args):
    """The train.py command line of one run: the experiment by name, its miniature, the budget, the data, the seed.
    Validation every VAL_EVERY epochs and in bf16 where bf16 is train.py's default (training is in bf16 there):
    the 10,000 test images, every epoch in fp32, would cost more than the training itself."""
    registered = name in models.EXPERIMENTS  # else its overrides go on the command line
    kwargs = {**({} if registered else e.overrides), **mini_kwargs(e)}
    argv = (['--experiment', name] if registered else ['--model', e.model]) + ['--img-size', str(MINI_IMG),
                                                                              '--model-kwargs']
    argv += [f'{k}={v!r}' for k, v in kwargs.items()]
    device = torch.device('cuda' if torch.cuda.is_available() else 'cpu')
    amp = ['--amp', 'bf16'] if train.default_amp(device)[0] == 'bf16' else []
    return argv + ['--epochs', str(args.epochs), '--val-every', str(VAL_EVERY), *data_argv(args), *amp,
                   '--seed', str(seed)]


def config_key(e):
    """Experiments that build the same model share their runs (InLine-Swin-T is T10's identity row, R-res's local
    row, R-dil's dilation 1 and S's InLine row): the model's resolved attention (models.describe) and sizes."""
    model = miniature(e)
    described = models.describe(model)
    if 'L' not in model.layout:  # kernel=None and kernel='identity' are the same model when no block is linear
        described = described.replace('kernel identity (I) / relu (L)', 'kernel identity')
    count = sum(p.numel() for p in model.parameters())  # tells apart what describe does not name (mlp_ratio)
    return json.dumps([e.model, described, sorted((k, v) for k, v in mini_kwargs(e).items() if k != 'window'),
                       count], default=str)


def miniature(e):
    """An experiment's miniature on the meta device: its architecture and parameter shapes, no memory."""
    with torch.device('meta'):
        return models.create_model(e.model, img_size=MINI_IMG, num_classes=10, **{**e.overrides, **mini_kwargs(e)})


def parameters(e):
    return sum(p.numel() for p in miniature(e).parameters())


def plan_runs(chosen, every, seeds, args):
    """The runs that `chosen` needs, {path: (argv, epochs)}, and each chosen name's run folders in seed order.
    A configuration is trained under the first of all experiments (`every`) that builds it, whatever subset is
    chosen, so --quick, --only, locality and the full run share their finished runs; it gets the most seeds any
    chosen row asks of it. seeds(name) -> how many."""
    keys = {name: config_key(e) for name, e in every.items()}
    first, wanted = {}, {}
    for name in every:
        first.setdefault(keys[name], name)
    for name in chosen:
        wanted[first[keys[name]]] = max(wanted.get(first[keys[name]], 0), seeds(name))
    runs, folders = {}, {}
    for base, count in wanted.items():
        for seed in range(count):
            argv = ablation_argv(base, every[base], seed, args)
            path = run_dir(args.out, f'{base}-seed{seed}', argv)
            runs[path] = (argv, args.epochs)
            folders.setdefault(base, []).append(path)
    return runs, {name: folders[first[keys[name]]] for name in chosen}


def estimate(runs, every, args):
    """The wall-clock minutes the runs not yet finished should take, from RUN_CPU_MIN."""
    cpu = 0.0
    for path, (argv, epochs) in runs.items():
        if run_state(path, epochs) is None:
            name = os.path.basename(path).rsplit('-seed', 1)[0]
            family = every[name].model.split('_')[1]
            cpu += RUN_CPU_MIN[family] * args.epochs * args.train_images / (EPOCHS * TRAIN_IMAGES)
    return cpu, cpu / max(1, min(args.jobs, os.cpu_count() or 1))


# ---------------------------------------------------------------------------------------------------
# Verdicts, fixed before the runs (README, "Verdicts"): 95% Student-t intervals on per-seed paired differences

T975 = (12.706, 4.303, 3.182, 2.776, 2.571, 2.447, 2.365, 2.306, 2.262, 2.228, 2.201, 2.179, 2.160, 2.145, 2.131,
        2.120, 2.110, 2.101, 2.093, 2.086, 2.080, 2.074, 2.069, 2.064, 2.060, 2.056, 2.052, 2.048, 2.045, 2.042)
MARGIN = 1.0  # top-1 points: a tie here is a difference surely smaller than the 1 point the claim rows resolve
PAPER_TIE = 0.2  # the paper's own ties: rows 0.2 or less apart, as it reads T10 (82.4, 82.5) and T4 (82.3, 82.4)
WORDS = ('reproduced', 'contradicted', 'not resolved')


def t975(df):
    """Student's t 0.975 quantile: the table to 30 degrees of freedom, then the Cornish-Fisher expansion in 1/df
    about the normal's 1.95996 (error under 1e-4 beyond 30)."""
    if df < 1:
        return math.inf
    if df <= len(T975):
        return T975[df - 1]
    z = 1.959964
    return z + (z ** 3 + z) / (4 * df) + (5 * z ** 5 + 16 * z ** 3 + 3 * z) / (96 * df ** 2)


def interval(diffs):
    """(mean, half-width) of the 95% interval of the mean of per-seed differences; infinite with one seed. The
    half-width is also the smallest effect the run could detect: a mean difference this far from 0 excludes 0."""
    n = len(diffs)
    mean = statistics.mean(diffs)
    return mean, t975(n - 1) * statistics.stdev(diffs) / math.sqrt(n) if n > 1 else math.inf


def seeds_for(diffs, effect=1.0):
    """How many seeds would make the 95% half-width smaller than `effect`, at the spread these seeds show;
    None with fewer than 2."""
    if len(diffs) < 2:
        return None
    sd = statistics.stdev(diffs)
    return next((n for n in range(2, 1000) if t975(n - 1) * sd / math.sqrt(n) < effect), 1000)


def verdict(diffs, paper_diff):
    """reproduced, contradicted or not resolved: the paper's difference paper_diff against ours, the per-seed
    differences diffs (row minus reference, seed by seed); '—' when the paper gives no difference. A paper
    ordering is reproduced when the 95% interval excludes 0 on its side, contradicted when on the other; a paper
    tie (|paper_diff| <= PAPER_TIE, as printed) is reproduced when the whole interval lies within +-MARGIN,
    contradicted when it lies wholly outside. Anything else is not resolved."""
    if paper_diff is None:
        return '—'
    mean, half = interval(diffs)
    lo, hi = mean - half, mean + half
    if round(abs(paper_diff), 1) <= PAPER_TIE:  # as printed: 80.2 - 80.0 is 0.2000000000000028
        return 'reproduced' if -MARGIN <= lo and hi <= MARGIN else \
            'contradicted' if hi < -MARGIN or lo > MARGIN else 'not resolved'
    if lo > 0 or hi < 0:
        return 'reproduced' if (lo > 0) == (paper_diff > 0) else 'contradicted'
    return 'not resolved'


def chance(args):
    """Top-1 (%) of a guess on the data the runs train on, where a diverged run is counted: the classes of
    CIFAR-100 or of the ImageFolder's train/ (resolve_data has checked that it is there), else 10."""
    if args.dataset == 'imagefolder':
        classes = sum(e.is_dir() for e in os.scandir(os.path.join(args.data_path, 'train')))
    else:
        classes = 100 if args.dataset == 'cifar100' else 10
    return 100 / classes


def summarise(paths, states, chance):
    """([final-epoch val top-1 of each seed, in seed order], how many diverged); a diverged run counts at chance."""
    accs = [chance if states[path] == 'diverged' else metrics(path)[-1]['val_acc1'] for path in paths]
    return accs, sum(states[path] == 'diverged' for path in paths)


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
    paper, paper_ref = reported_value(every[name].reported), reported_value(every[ref].reported)
    if paper is None or paper_ref is None:
        return every[name].reported or '—', None
    return every[name].reported, paper - paper_ref


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


def cmd_ablations(args):
    resolve_data(args)
    every = experiments()
    chosen = every
    if args.quick:
        chosen = {n: every[n] for n in QUICK}
    elif args.only:
        unknown = sorted(set(args.only) - set(every))
        if unknown:
            train.fail(f'unknown experiments {unknown}; choose from {", ".join(every)}')
        chosen = {n: every[n] for n in args.only}
    per_table = seeds_option(args.seeds, {t: QUICK_SEEDS for t in SEEDS} if args.quick else SEEDS)
    runs, folders = plan_runs(chosen, every, lambda name: per_table[every[name].table], args)
    cpu, wall = estimate(runs, every, args)
    todo = sum(run_state(p, epochs) is None for p, (_, epochs) in runs.items())
    print(f'{len(chosen)} experiments, {len(set(map(tuple, folders.values())))} distinct configurations,'
          f' {len(runs)} runs of {args.epochs} epochs x {args.train_images} images of {args.dataset} '
          f'(seeds per table {per_table}), {args.jobs} at a time; estimate for the {todo} '
          f'runs to do: {cpu:.0f} CPU-minutes, about {wall // 60:.0f} h {wall % 60:.0f} min with {args.jobs} cores of '
          f'their own (RUN_CPU_MIN)')
    states = train_runs(runs, args.jobs, desc='ablation runs')
    guess = chance(args)
    result = {name: summarise(folders[name], states, guess) for name in chosen}

    rows, panels = [], {}
    for name, e in chosen.items():
        wanted = reference(name, e.table)
        ref = wanted if wanted in chosen else None
        accs, diverged = result[name]
        n = len(accs)
        ours = (f'{statistics.mean(accs):.1f} ± {statistics.stdev(accs):.1f} ({n})' if n > 1 else
                f'{accs[0]:.1f} (1)') + (f', {diverged} diverged' if diverged else '')
        cells = ['', '', '', '']
        paper_text = e.reported or '—'
        if ref:
            k = min(n, len(result[ref][0]))  # seed by seed: the runs of one seed share the training order and init
            diffs = [a - b for a, b in zip(accs[:k], result[ref][0][:k])]
            paper_text, paper_diff = paper_claim(name, ref, every)
            mean, half = interval(diffs)
            need = seeds_for(diffs)
            cells = [f'{mean:+.1f} [{mean - half:+.1f}, {mean + half:+.1f}]' if k > 1 else f'{mean:+.1f} (1 seed)',
                     f'±{half:.1f}' if k > 1 else '∞', str(need) if need else '', verdict(diffs, paper_diff)]
            panels.setdefault(e.table, []).append((
                name, mean, half if math.isfinite(half) else None,
                paper_diff if paper_diff is not None and math.isfinite(paper_diff) else None))
        rows.append([e.table, name + (' *' if e.ours else ''), f'{parameters(e) / 1e6:.2f}M', ours, paper_text,
                     ref or (f'({wanted} not chosen)' if wanted else '(reference)'), *cells])
    print(f'\nAblations on the miniature ({MINI_IMG} px {args.dataset}, {args.epochs} epochs x {args.train_images} '
          f'training images, validation on its test set): final-epoch top-1 (%), mean ± standard deviation over '
          f'(n) seeds, beside the paper\'s ImageNet-1K top-1. Difference: the mean of per-seed differences from the '
          f'compared row [its 95% Student-t interval]; detectable: the interval\'s half-width, the smallest '
          f'difference these seeds could tell from 0; seeds for ±1: how many would make it under 1 point. Verdict '
          f'(README, "Verdicts"): a paper ordering is reproduced when the interval excludes 0 on its side, '
          f'contradicted on the other; a paper tie (≤ {PAPER_TIE}) is reproduced when the interval lies within '
          f'±{MARGIN}, contradicted outside it; else not resolved. * our construction (no released code). '
          f'A diverged run counts at chance ({guess:.3g}%).\n')
    print_table(['table', 'experiment', 'params', 'top-1 here ± sd (seeds)', 'paper (ImageNet)', 'compared with',
                 'difference here [95% CI]', 'detectable', 'seeds for ±1', 'verdict'], rows)
    out = args.png or os.path.join(args.out, 'ablations.png')
    charts(out, [dict(  # each row against its reference row
        series=[(f'here ({args.dataset}), mean difference, 95% CI', xs, [d for _, d, _, _ in entries],
                 [h or 0 for _, _, h, _ in entries]),
                ('paper (ImageNet)', xs, [p for _, _, _, p in entries], None)],
        title=table, xlabel='', ylabel='top-1 minus the reference row\'s (points)', xticks=xs,
        xlabels=[short_name(n) for n, _, _, _ in entries], hlines=[('', 0.0)], lines=False)
        for table, entries in panels.items() for xs in [list(range(1, len(entries) + 1))]] or [dict(
        series=[('here', list(range(1, len(chosen) + 1)), [statistics.mean(result[n][0]) for n in chosen], None)],
        title='top-1 here', xlabel='', ylabel='top-1 (%)', xticks=list(range(1, len(chosen) + 1)),
        xlabels=[short_name(n) for n in chosen], lines=False)], cols=4, size=(420, 330))
    name = os.path.basename(out)  # figures/ablations_quick.png -> figures/curves_quick.png
    curves = name.replace('ablations', 'curves') if 'ablations' in name else 'curves_' + name
    learning_curves(os.path.join(os.path.dirname(out), curves), chosen, folders, states)
    return rows


def learning_curves(path, chosen, folders, states):
    """One panel per family: validation top-1 by epoch, mean over seeds, for each of its configurations (up to
    eight, the family's InLine and softmax models first), so a reader sees whether training had flattened."""
    panels = []
    for family in ('swin', 'deit', 'pvt', 'cswin'):
        names = sorted((n for n, e in chosen.items() if e.model.split('_')[1] == family),
                       key=lambda n: (not n.startswith(('inline_', 's_')), n))
        seen, series = set(), []
        for name in names:
            if tuple(folders[name]) in seen or len(series) == 8:
                continue
            seen.add(tuple(folders[name]))
            logs = [[e for e in metrics(p) if 'val_acc1' in e] for p in folders[name] if states[p] == 'done']
            if logs:
                points = min(len(log) for log in logs)
                series.append((short_name(name), [e['epoch'] for e in logs[0][:points]],
                               [statistics.mean(log[i]['val_acc1'] for log in logs) for i in range(points)], None))
        if series:
            panels.append(dict(series=series, title=f'{family}: validation top-1 by epoch', xlabel='epoch',
                               ylabel='top-1 (%)', xticks=sorted({x for s in series for x in s[1]})))
    if panels:
        charts(path, panels, cols=2, size=(480, 360))


def short_name(name):
    """An experiment's name short enough to label a chart's x axis: t4_window7_residual -> w7 + res."""
    for pattern, short in ((r't3_linear_(\w+)', r'lin \1'), (r't3_inline_(\w+)', r'InL \1'),
                           (r't4_window(\d+)_no_residual', r'w\1'), (r't4_window(\d+)_residual', r'w\1 + res'),
                           (r't10_kernel_(\w+)', r'\1'), (r'r_residual_(\w+)', r'\1'), (r'r_dilation(\d)', r'dil \1'),
                           (r't1_softmax_normalised_q', 'normalised q'), (r's_(\w+)_t', r'softmax \1')):
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
# by: key-value pairs, then queries for some of the keys, the loss on the answers only. Small causal transformers
# (2 layers) with softmax, vanilla linear attention (division) and causal InLine (subtraction), recall against
# the state each layer keeps. The models have 30k-110k parameters and a run takes seconds, so they train here, in
# process: train.py is the image loop (its data pipeline, DDP and checkpoints serve runs of minutes to days).
# Finished runs are JSON lines in RECALL_RESULTS (committed), so the tables and the picture rebuild without
# training and a rerun trains only what is missing.

RECALL_RESULTS = os.path.join(HERE, 'results', 'recall.jsonl')
RECALL_VOCAB = 64  # keys are tokens 0..63, values 64..127
RECALL_MODELS = {  # name: inline.InLineAttention's options, causal=True (None: softmax, causal SDPA)
    'softmax': None,
    'linear relu': dict(attention='linear', kernel='relu', residual='none'),
    'linear 1+elu': dict(attention='linear', kernel='one_plus_elu', residual='none'),
    'InLine 1+elu': dict(kernel='one_plus_elu', residual='none'),
    'linear 1+elu + Eq. 6': dict(attention='linear', kernel='one_plus_elu', residual='local'),  # Eq. 6: the token
    'InLine 1+elu + Eq. 6': dict(kernel='one_plus_elu', residual='local'),  # and the 2 before it
    'InLine + Eq. 6': dict(residual='local'),  # the paper's InLine: phi = identity, Eq. 6
}
RECALL_INJECTIVITY = (('linear 1+elu', 'InLine 1+elu'), ('linear 1+elu + Eq. 6', 'InLine 1+elu + Eq. 6'))  # / vs -
RECALL_SIZES = ((32, 4), (64, 4), (64, 8))  # (C, key-value pairs); 2 heads, so D = C/2; N = 2.5 pairs tokens
RECALL_HEADS, RECALL_SEEDS, RECALL_STEPS, RECALL_BATCH, RECALL_LR = 2, 3, 2000, 64, 3e-3
RECALL_STEP_MS = {(32, 4): 11, (64, 4): 17, (64, 8): 25}  # CPU ms per step of InLine 1+elu, 1 thread, measured here
RECALL_STEP_FACTOR = {'softmax': 0.65, 'Eq. 6': 1.5, 'linear': 1.1}  # another model's step against that


def mqar_batch(batch, pairs, generator):
    """x, y (batch, N), N = 2 pairs + pairs // 2: `pairs` distinct keys, each followed by its value, then half the
    keys again in a random order; y holds the value at those queries and -100 (no loss) everywhere else."""
    keys = torch.rand(batch, RECALL_VOCAB, generator=generator).argsort(-1)[:, :pairs]  # (batch, pairs), distinct
    values = RECALL_VOCAB + torch.randint(RECALL_VOCAB, (batch, pairs), generator=generator)  # (batch, pairs)
    asked = torch.rand(batch, pairs, generator=generator).argsort(-1)[:, :pairs // 2]  # (batch, pairs // 2)
    x = torch.cat([torch.stack([keys, values], -1).flatten(1), keys.gather(1, asked)], 1)  # k1 v1 .. kP vP q1 ..
    y = torch.full_like(x, -100)
    y[:, 2 * pairs:] = values.gather(1, asked)
    return x, y


class CausalSoftmax(torch.nn.Module):
    """Causal softmax attention between InLineAttention's projections: x (B, N, C) -> (B, N, C)."""

    def __init__(self, dim, num_heads):
        super().__init__()
        self.num_heads = num_heads
        inline.add_projections(self, dim, qkv_bias=True, separate_q=False)

    def forward(self, x):
        B, N, C = x.shape
        q, k, v = (t.reshape(B, N, self.num_heads, -1).transpose(1, 2) for t in self.qkv(x).chunk(3, -1))
        o = F.scaled_dot_product_attention(q, k, v, is_causal=True)  # (B, H, N, D)
        return self.proj(o.transpose(1, 2).reshape(B, N, C))


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
    """Token and learned position embeddings, 2 decoder blocks, a norm and a head: (B, N) -> logits (B, N, 2V)."""

    def __init__(self, name, width, tokens):
        super().__init__()
        options = RECALL_MODELS[name]
        self.embed = torch.nn.Embedding(2 * RECALL_VOCAB, width)
        self.pos = torch.nn.Parameter(0.02 * torch.randn(1, tokens, width))
        self.blocks = torch.nn.Sequential(*[DecoderBlock(width, CausalSoftmax(width, RECALL_HEADS) if options is None
                                                         else inline.InLineAttention(width, RECALL_HEADS, causal=True,
                                                                                     **options)) for _ in range(2)])
        self.norm, self.head = torch.nn.LayerNorm(width), torch.nn.Linear(width, 2 * RECALL_VOCAB)
        for m in self.modules():
            if getattr(m, 'core', None) is inline.inline_core:
                m.core = short_sequence_core

    def forward(self, x):
        return self.head(self.norm(self.blocks(self.embed(x) + self.pos[:, :x.shape[1]])))


def short_sequence_core(q, k, v, r, grid, scale=None, size=3, dilation=1, causal=False):
    """inline.inline_core through the explicit causal weights: at 20 to 40 tokens the N x N form costs a CPU the
    least (the prefix sums' (B, H, N, D, D) tensors made a step ten times slower); the two are the same function
    (test_causal_forms_equal_the_explicit_weights)."""
    o = inline.inline_weights(q, k, scale, causal) @ v  # Eq. 5, (B, H, N, D)
    return o if r is None else o + inline.local_residual(v, r, grid, size, dilation, causal)  # Eq. 6


def recall_state(name, width, tokens):
    """Floats one layer keeps to make the next token: softmax's keys and values so far, 2 N C at the last token;
    linear attention's H sums of k v^T and of k, H (D^2 + D); InLine's H sums of k v^T, k and v and the count,
    H (D^2 + 2D) + 1; Eq. 6 adds the last 2 tokens' v and the running sum of its input, 3C."""
    options, H, D = RECALL_MODELS[name], RECALL_HEADS, width // RECALL_HEADS
    if options is None:
        return 2 * tokens * width
    if options.get('attention') == 'linear':
        return H * (D * D + D)
    return H * (D * D + 2 * D) + 1 + (3 * width if options['residual'] == 'local' else 0)


def recall_run(name, width, pairs, seed, steps):
    """Train one model on fresh batches (AdamW, one-cycle schedule) and count its right answers on 1024 held-out
    sequences, the same for every run. Returns the run's JSON line as a dict."""
    tokens = 2 * pairs + pairs // 2
    torch.manual_seed(seed)
    model = RecallLM(name, width, tokens)
    opt = torch.optim.AdamW(model.parameters(), lr=RECALL_LR, weight_decay=0.1, betas=(0.9, 0.98))
    schedule = torch.optim.lr_scheduler.OneCycleLR(opt, RECALL_LR, total_steps=steps, pct_start=0.1)
    data, start = torch.Generator().manual_seed(1000 + seed), time.process_time()
    for _ in range(steps):
        x, y = mqar_batch(RECALL_BATCH, pairs, data)
        loss = F.cross_entropy(model(x).flatten(0, 1), y.flatten(), ignore_index=-100)  # the answers only
        opt.zero_grad(set_to_none=True)
        loss.backward()
        opt.step()
        schedule.step()
    x, y = mqar_batch(1024, pairs, torch.Generator().manual_seed(12345))
    with torch.no_grad():
        right = (model(x).argmax(-1) == y)[y != -100].float()
    return dict(model=name, width=width, pairs=pairs, tokens=tokens, seed=seed, steps=steps, batch=RECALL_BATCH,
                lr=RECALL_LR, recall=round(100 * right.mean().item(), 2), final_loss=round(loss.item(), 4),
                state=recall_state(name, width, tokens), params=sum(p.numel() for p in model.parameters()),
                cpu_s=round(time.process_time() - start, 1), threads=torch.get_num_threads())


def recall_key(name, width, pairs, seed, steps, batch=RECALL_BATCH, lr=RECALL_LR):
    """What makes a run: a stored run made with another batch or learning rate is not this one."""
    return json.dumps([name, width, pairs, seed, steps, batch, lr])


def read_recall(path):
    """The finished runs in path, by recall_key; {} when there is no file yet."""
    runs = {}
    if os.path.exists(path):
        with open(path) as f:
            for line in filter(str.strip, f):
                row = json.loads(line)
                runs[recall_key(*(row[k] for k in ('model', 'width', 'pairs', 'seed', 'steps', 'batch', 'lr')))] = row
    return runs


def write_recall(path, runs):
    """Every finished run, one JSON line each, written to a temporary file and renamed: nothing is lost mid-write."""
    os.makedirs(os.path.dirname(os.path.abspath(path)), exist_ok=True)
    with open(path + '.tmp', 'w') as f:
        f.writelines(json.dumps(row) + '\n' for _, row in sorted(runs.items()))
        f.flush()
        os.fsync(f.fileno())
    os.replace(path + '.tmp', path)


def mean_interval(values):
    """(mean, half-width of its 95% Student-t interval over seeds; infinite with one)."""
    n, mean = len(values), statistics.mean(values)
    return mean, t975(n - 1) * statistics.stdev(values) / math.sqrt(n) if n > 1 else math.inf


def injectivity_verdict(diffs):
    """The project's words on "injectivity helps recall" from per-seed differences, InLine minus division with the
    same phi: reproduced when the 95% interval lies above 0, contradicted when below, else not resolved."""
    mean, half = mean_interval(diffs)
    return mean, half, 'reproduced' if mean - half > 0 else 'contradicted' if mean + half < 0 else 'not resolved'


def cmd_recall(args):
    models = args.models or list(RECALL_MODELS)
    unknown = sorted(set(models) - set(RECALL_MODELS))
    if unknown:
        train.fail(f"unknown recall models {unknown}; choose from {list(RECALL_MODELS)}")
    if args.seeds < 1 or args.steps < 1 or args.threads < 1:
        train.fail(f"--seeds, --steps and --threads must be at least 1, got {args.seeds}, {args.steps}, {args.threads}")
    sizes = [tuple(map(int, size.split('x'))) for size in args.sizes if re.fullmatch(r'\d+x\d+', size)]
    if len(sizes) != len(args.sizes) or any(not 2 <= p <= RECALL_VOCAB or w < 1 or w % RECALL_HEADS for w, p in sizes):
        train.fail(f"--sizes takes CxPAIRS, the width C a multiple of the {RECALL_HEADS} heads and 2 <= PAIRS <= "
                   f"{RECALL_VOCAB} (distinct keys of {RECALL_VOCAB}), got {args.sizes}")
    plan = [(name, width, pairs, seed) for width, pairs in sizes for name in models for seed in range(args.seeds)]
    threads = torch.get_num_threads()
    torch.set_num_threads(args.threads)
    try:
        rows = train_recall(plan, args)
    finally:  # a caller in this process (the tests) keeps its threads, and compiled graphs their guards
        torch.set_num_threads(threads)
    return recall_report(rows, models, sizes, args)


def train_recall(plan, args):
    """Every run of plan, from args.results where it is there, else trained and added to it at once."""
    runs = read_recall(args.results)
    todo = [run for run in plan if recall_key(*run, args.steps) not in runs]
    factor = lambda name: next((f for key, f in RECALL_STEP_FACTOR.items() if key in name), 1.0)  # noqa: E731
    # 40 ms a step where a size was not measured
    estimate = sum(RECALL_STEP_MS.get((w, p), 40) * factor(n) * args.steps / 1e3 for n, w, p, _ in todo) / 60
    print(f"recall (MQAR): {len(plan)} runs, {len(plan) - len(todo)} of them finished in {args.results}; training "
          f"{len(todo)} x {args.steps} steps at {args.threads} thread(s): about {estimate:.0f} CPU-min", flush=True)
    spent = 0.0
    for name, width, pairs, seed in tqdm(todo, desc='recall', disable=not todo):
        row = recall_run(name, width, pairs, seed, args.steps)
        runs[recall_key(name, width, pairs, seed, args.steps)] = row
        write_recall(args.results, runs)
        spent += row['cpu_s']
    if todo:
        print(f"trained {len(todo)} runs in {spent / 60:.1f} CPU-min (process CPU time)")
    return {run: runs[recall_key(*run, args.steps)] for run in plan}


def recall_report(rows, models, sizes, args):
    """The two tables and the picture from the finished runs: recall by model and state, and InLine minus division
    with the same phi, seed by seed."""
    recall = {(n, w, p): [rows[n, w, p, s]['recall'] for s in range(args.seeds)] for n, w, p, _ in rows}
    print(f"\nMQAR: keys and values from {RECALL_VOCAB} tokens each, 2 layers, {RECALL_HEADS} heads, {args.steps} "
          f"steps of {RECALL_BATCH} sequences; recall = right answers on 1024 held-out sequences, mean over "
          f"{args.seeds} seeds with its 95% Student-t interval. State: floats per layer for the next token.\n")
    table = []
    for (n, w, p), values in recall.items():
        mean, half = mean_interval(values)
        one = rows[n, w, p, 0]
        table.append([f"{p} ({one['tokens']})", w, n, one['state'], f"{mean:.1f} ± {half:.1f}",
                      ' '.join(f'{v:.1f}' for v in values), one['params']])
    print_table(['pairs (tokens)', 'C', 'model', 'state', 'recall %', 'per seed', 'params'], table)
    verdicts = []
    for division, subtraction in RECALL_INJECTIVITY:
        for w, p in sizes:
            if (division, w, p) in recall and (subtraction, w, p) in recall:
                diffs = [b - a for a, b in zip(recall[division, w, p], recall[subtraction, w, p])]
                mean, half, word = injectivity_verdict(diffs)
                verdicts.append([f"{p} ({rows[division, w, p, 0]['tokens']})", w, division.replace('linear ', ''),
                                 f"{statistics.mean(recall[division, w, p]):.1f}",
                                 f"{statistics.mean(recall[subtraction, w, p]):.1f}", f"{mean:+.1f} ± {half:.1f}",
                                 word])
    if verdicts:
        print('\nInjectivity: InLine (subtraction) minus vanilla linear attention (division), the same phi (and Eq. 6 '
              'or not), seed by seed; the verdict is on "injectivity helps recall".\n')
        print_table(['pairs (tokens)', 'C', 'phi', 'division %', 'InLine %', 'InLine - division', 'verdict'], verdicts)
        words = [v[-1] for v in verdicts]
        print(f"\ninjectivity helps recall in {words.count('reproduced')} of {len(words)} comparisons, hurts it in "
              f"{words.count('contradicted')}, and cannot be told apart in {words.count('not resolved')}.")
    panels = []
    for p in sorted({p for _, p in sizes}):
        widths = [w for w, q in sizes if q == p]
        series = []
        for n in models:
            points = sorted((rows[n, w, p, 0]['state'], *mean_interval(recall[n, w, p])) for w in widths)
            series.append((n, [x for x, _, _ in points], [y for _, y, _ in points],
                           [h if math.isfinite(h) else 0 for _, _, h in points]))
        xs = [x for s in series for x in s[1]]
        ticks = [2 ** e for e in range(int(math.log2(min(xs))), int(math.ceil(math.log2(max(xs)))) + 1)]
        panels.append(dict(series=series, title=f'MQAR, {p} pairs ({rows[models[0], widths[0], p, 0]["tokens"]} '
                           f'tokens): recall against state', xlabel='state per layer (floats), C = ' +
                           ', '.join(map(str, widths)), ylabel='recall (%)', xticks=ticks, log_x=True,
                           xlabels=[f'{t // 1024}k' if t >= 1024 else str(t) for t in ticks], lines=True, ylim=(0, 100),
                           hlines=[('chance', 100 / RECALL_VOCAB), ('guess among its values', 100 / p)]))
    charts(args.png or os.path.join(args.out, 'recall.png'), panels, cols=len(panels), size=(560, 420))
    return rows


# ---------------------------------------------------------------------------------------------------
# The command line

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
    budget.add_argument('--epochs', type=int, default=EPOCHS, help=f'epochs of every training run ({EPOCHS})')
    budget.add_argument('--train-images', type=int, default=TRAIN_IMAGES,
                        help=f'training images: a fixed subset of the dataset, or synthetic ones per epoch '
                             f'({TRAIN_IMAGES})')
    budget.add_argument('--dataset', choices=['synthetic', 'imagefolder', *train.SMALL_DATASETS],
                        help='the data every run trains on (default fashion_mnist); with --checkpoints, the images '
                             'to measure on (default: each checkpoint\'s own)')
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
    p.add_argument('--dense', action='store_true', help='backbone forward time and peak memory at detection sizes, '
                   '512x512 to 800x1344: Swin-T, PVT-S, DeiT-T, each softmax against InLine (instead of F5b, F5c)')
    p = sub.add_parser('ablations', parents=[budget], help='T3, T4, T10, R-res, R-dil, R-nonneg, T1, S: trained small')
    p.add_argument('--quick', action='store_true',
                   help=f'{QUICK_SEEDS} seeds of {len(QUICK)} experiments: {", ".join(QUICK)}')
    p.add_argument('--only', nargs='+', metavar='NAME', help='these experiments only')
    p.add_argument('--seeds', nargs='+', metavar='[TABLE=]N', help=f'seeds (0, 1, ...): N for every table, TABLE=N '
                   f'for one (default {" ".join(f"{t}={n}" for t, n in SEEDS.items())})')
    p = sub.add_parser('recall', parents=[common], help='associative recall (MQAR): softmax, linear and causal InLine')
    p.add_argument('--results', default=RECALL_RESULTS, help='finished runs, one JSON line each (default '
                   'results/recall.jsonl beside paper.py); a rerun trains only what is missing')
    p.add_argument('--models', nargs='+', metavar='NAME', help=f'these models only, of {", ".join(RECALL_MODELS)}')
    p.add_argument('--sizes', nargs='+', metavar='CxPAIRS', default=[f'{w}x{p}' for w, p in RECALL_SIZES],
                   help=f'model width C ({RECALL_HEADS} heads) and key-value pairs per sequence (default '
                        f'{" ".join(f"{w}x{p}" for w, p in RECALL_SIZES)})')
    p.add_argument('--seeds', type=int, default=RECALL_SEEDS, help='seeds per model and size (0, 1, ...)')
    p.add_argument('--steps', type=int, default=RECALL_STEPS, help=f'training steps of {RECALL_BATCH} sequences')
    p.add_argument('--threads', type=int, default=1, help='CPU threads of this process')
    args = parser.parse_args(argv)
    return {'models': cmd_models, 'experiments': cmd_experiments, 'injectivity': cmd_injectivity, 'locality': cmd_locality, 'maps': cmd_maps, 'speed': cmd_speed,
            'ablations': cmd_ablations, 'recall': cmd_recall}[args.command](args)


if __name__ == '__main__':
    main()

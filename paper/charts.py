"""The lab's pictures and tables: markdown tables and PNG charts, heat maps and image tiles, drawn with
Pillow.

InLine attention: Han et al., "Bridging the Divide: Reconsidering Softmax and Linear Attention", NeurIPS 2024,
arXiv 2412.06590. No command of its own: every command of `python -m paper` draws through these
(paper/__main__.py lists them).
"""
import math
import os
import re
import statistics

import torch
from PIL import Image, ImageDraw, ImageFont
from torchvision.transforms import functional as TF


# ---------------------------------------------------------------------------------------------------
# Output: markdown tables and PNG pictures, drawn with Pillow (which torchvision brings). One place for all
# drawing: heat-map cells, line/dot charts, image tiles.

PALETTE = [(31, 119, 180), (214, 39, 40), (44, 160, 44), (255, 127, 14), (148, 103, 189), (140, 86, 75),
           # 10 series before a colour repeats
           (227, 119, 194), (127, 127, 127), (188, 189, 34), (23, 190, 207)]
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


def chart(draw, box, series, *, title, xlabel, ylabel, xticks, xlabels=None, log_x=False, hlines=(),
          lines=True, ylim=None):
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
    # the legend, its rows under the x label
    for i, ((label, *_), (dx, row)) in enumerate(zip(series, places)):
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
            draw.text((ox + pad_left + (j + 0.5) * cell, 28), f'k{j + 1}', fill='black', font=font(11),
                      anchor='ma')
        for i in range(R):
            y = pad_top + i * cell
            draw.text((ox + pad_left - 6, y + cell / 2), labels[i], fill='black', font=font(12), anchor='rm')
            for j in range(C):
                x, value = ox + pad_left + j * cell, w[i, j].item()
                draw.rectangle([x, y, x + cell - 1, y + cell - 1], fill=diverging(value / vmax))
                draw.text((x + cell / 2, y + cell / 2), f'{value:.2f}', fill='black', font=font(11),
                          anchor='mm')
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
    """image (3, S, S) in [0, 1] with the weights w (h, w) laid over it: red positive, blue negative, the
    colour's strength sqrt(|w| / vmax), so weights near 0 leave the image visible and small ones still show.
    vmax is shared by every map of a figure: a flat map looks faint, a peaked one strong. Returns a PIL image,
    S*scale wide."""
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
        draw.text((label_w + (j + 1) * (T + 8) + T / 2, top - 8), f'query ({y},{x_})', fill='black',
                  font=font(12), anchor='md')
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
    draw.text((10, img.height - 22),
              f'red > 0, blue < 0; strength sqrt(|w| / {vmax:.3f}), the largest |w| shown', fill='black',
              font=font(12))
    save_png(img, path)


# The ablations' pictures (paper/ablations.py)


def ablations_pictures(args, chosen, planned, done, result, rows, points, pairs, rerun=None):
    """The ablations' picture (each comparison's difference and interval beside the paper's, a panel per
    table; top-1 per experiment where none has a comparison) and, beside it, every run's learning curves
    (`pairs`: the comparisons, so each panel draws both their sides), and the rerun's (`rerun`: its epochs,
    chosen, planned, records and pairs; curves_..._16_epochs.png) where given."""
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
                 [statistics.mean(result[n].top1.values() or [0]) for n in chosen], None)],
                 title='top-1 here',
        xlabel='', ylabel='top-1 (%)', xticks=list(range(1, len(chosen) + 1)),
        xlabels=[short_name(n) for n in chosen], lines=False)], cols=4, size=(420, 330))
    name = os.path.basename(out)  # figures/ablations_quick.png -> figures/curves_quick.png
    curves = name.replace('ablations', 'curves') if 'ablations' in name else 'curves_' + name
    learning_curves(os.path.join(os.path.dirname(out), curves), chosen, planned, done, pairs)
    if rerun:
        epochs, *curves_of = rerun
        learning_curves(os.path.join(os.path.dirname(out), curves.replace('.png', f'_{epochs}_epochs.png')),
                        *curves_of)


def learning_curves(path, chosen, planned, done, pairs):
    """One panel per table: validation top-1 by epoch, the mean over seeds, for every distinct configuration
    of the table and both sides of each comparison it makes (`pairs`: [(tables, row, reference)]; P's
    InLine-Swin-T is R-res's row, the floor's its S row), so each panel holds its comparisons and a reader sees
    whether training had flattened for every model the text speaks of."""
    panels = []
    for table in dict.fromkeys(e.table for e in chosen.values()):
        series, drawn = [], set()
        names = [n for n, e in chosen.items() if e.table == table] + [
            side for tables, row, ref in pairs if table in tables for side in (row, ref)]
        for name in names:
            key = tuple(r.key() for r in planned[name])
            logs = [[e for e in done[r.key()]['epochs'] if 'val_acc1' in e] for r in planned[name]
                    if r.key() in done and done[r.key()]['state'] == 'done']
            if not logs or key in drawn:
                continue
            drawn.add(key)
            points = min(len(log) for log in logs)
            series.append((short_name(name), [e['epoch'] for e in logs[0][:points]],
                           [statistics.mean(log[i]['val_acc1'] for log in logs) for i in range(points)],
                           None))
        if series:
            panels.append(dict(series=series, title=f'{table}: validation top-1 by epoch', xlabel='epoch',
                               ylabel='top-1 (%)', xticks=sorted({x for s in series for x in s[1]})))
    if panels:
        charts(path, panels, cols=2, size=(480, 360))


def short_name(name):
    """An experiment's name short enough to label a chart's x axis: t4_window7_residual -> w7 + res."""
    for pattern, short in ((r't3_linear_(\w+)', r'lin \1'), (r't3_inline_(\w+)', r'InL \1'),
                           (r't4_window(\d+)_no_residual', r'w\1'),
                           (r't4_window(\d+)_residual', r'w\1 + res'), (r't10_kernel_(\w+)', r'\1'),
                           (r'r_residual_(\w+)', r'\1'), (r'r_dilation(\d)', r'dil \1'),
                           (r't1_(?:swin_)?(\w+)_normalised_q', r'\1 normalised q'), (r's_(\w+)_t', r'softmax \1'),
                           (r'inline_(\w+)_t', r'InLine \1'), (r'floor_(\w+)', r'floor \1'),
                           (r'p_flatten_swin', 'FLatten'), (r'p_flatten_swin_subtraction', 'FLatten subtr.'),
                           (r'p_transnormer_swin', 'TransNormer')):
        if re.fullmatch(pattern, name):
            return re.sub(pattern, short, name)
    return name

"""The lab's pictures and tables: markdown tables, and PNG charts, heat maps and weight maps drawn with
matplotlib on its Agg canvas.

InLine attention: Han et al., "Bridging the Divide: Reconsidering Softmax and Linear Attention", NeurIPS 2024,
arXiv 2412.06590. No command of its own: every command of `python -m paper` draws through these
(paper/__main__.py lists them). Figures are built as matplotlib.figure.Figure objects on a FigureCanvasAgg, so
that no global backend or pyplot state is switched (a library flips no global switch).
"""
import math
import os
import re
import statistics

import torch
from matplotlib.backends.backend_agg import FigureCanvasAgg
from matplotlib.figure import Figure
from matplotlib.patches import Rectangle

# the README's colours: red positive, blue negative, magenta for marks (identical rows, query tokens)
RED, BLUE, MARK = (178 / 255, 24 / 255, 43 / 255), (33 / 255, 102 / 255, 172 / 255), (230 / 255, 0, 120 / 255)
DPI = 100  # a figure's size in pixels is its size in inches times this


def print_table(header, rows):
    """A markdown table, so what is printed can be pasted into the README as it is."""
    print('| ' + ' | '.join(header) + ' |')
    print('|' + '---|' * len(header))
    for row in rows:
        print('| ' + ' | '.join(str(c) for c in row) + ' |')


def figure(width, height):
    """A white Figure of width x height pixels on an Agg canvas, its subplots laid out by matplotlib."""
    fig = Figure(figsize=(width / DPI, height / DPI), dpi=DPI, layout='constrained', facecolor='white')
    FigureCanvasAgg(fig)
    return fig


def save(fig, path):
    os.makedirs(os.path.dirname(os.path.abspath(path)), exist_ok=True)
    fig.savefig(path, format='png', dpi=DPI)
    width, height = (round(v * DPI) for v in fig.get_size_inches())
    print(f'picture: {path} ({width}x{height})')


def chart(ax, series, *, title, xlabel, ylabel, xticks, xlabels=None, log_x=False, hlines=(), lines=True,
          ylim=None):
    """A line (or, lines=False, dot) chart on ax.

    series: [(label, xs, ys, errs or None)], a y of None or nan left out; errors drawn as bars (± err);
    hlines: [(label, y)] drawn dashed; xticks the x positions to label with xlabels (default the numbers
    themselves); ylim = (lo, hi) bounds the axis where the data would pass it (a percentage's interval beyond
    0 or 100, say)."""
    markers = 'osD^vP*Xhp'
    for i, (label, xs, ys, errs) in enumerate(series):
        points = [(x, y, e) for x, y, e in zip(xs, ys, errs or [None] * len(xs))
                  if y is not None and math.isfinite(y)]
        if not points:
            continue
        x, y, e = zip(*points)
        colour, marker = f'C{i % 10}', markers[i % len(markers)]
        ax.plot(x, y, marker=marker, linestyle='-' if lines else 'none', color=colour, label=label, ms=5)
        if any(e):
            ax.errorbar(x, y, yerr=[v or 0 for v in e], fmt='none', ecolor=colour, capsize=3)
    for label, y in hlines:
        ax.axhline(y, linestyle='--', color='0.35', linewidth=1, label=label or None)
    if log_x:
        ax.set_xscale('log')
    labels = [str(label) for label in xlabels or [f'{x:g}' for x in xticks]]
    ax.set_xticks(xticks, labels, rotation=30 if max(map(len, labels)) > 6 else 0,
                  ha='right' if max(map(len, labels)) > 6 else 'center', fontsize=8)
    ax.minorticks_off()
    if not lines:
        ax.set_xlim(min(xticks) - 0.5, max(xticks) + 0.5)
    if ylim:
        lo, hi = ax.get_ylim()
        ax.set_ylim(max(lo, ylim[0]), min(hi, ylim[1]))
    ax.set_title(title, fontsize=10)
    ax.set_xlabel(xlabel, fontsize=9)
    ax.set_ylabel(ylabel, fontsize=9)
    ax.grid(alpha=0.3)
    ax.legend(fontsize=7)


def charts(path, panels, cols, size):
    """Several charts side by side in one PNG: panels are chart()'s keyword arguments, size one panel's
    (width, height) in pixels."""
    cols = min(cols, len(panels))
    rows = math.ceil(len(panels) / cols)
    fig = figure(cols * size[0], rows * size[1])
    axes = fig.subplots(rows, cols, squeeze=False).flatten()
    for ax, panel in zip(axes, panels):
        chart(ax, **panel)
    for ax in axes[len(panels):]:
        ax.set_visible(False)
    save(fig, path)


def heatmaps(path, matrices, groups, labels, caption):
    """One heat map per matrix {title: (rows, cols)}, a number in every cell, a shared colour scale (blue
    negative, white 0, red positive); the row groups {title: [[i, j, ...]]} outlined and bracketed."""
    vmax = max(w.abs().max().item() for w in matrices.values())
    R, C = next(iter(matrices.values())).shape
    fig = figure(len(matrices) * (60 + 46 * C), 110 + 46 * R)
    axes = fig.subplots(1, len(matrices), squeeze=False)[0]
    for ax, (name, w) in zip(axes, matrices.items()):
        ax.imshow(w.numpy(), cmap='RdBu_r', vmin=-vmax, vmax=vmax)
        for i in range(R):
            for j in range(C):
                ax.text(j, i, f'{w[i, j].item():.2f}', ha='center', va='center', fontsize=7)
        ax.set_xticks(range(C), [f'k{j + 1}' for j in range(C)], fontsize=8)
        ax.set_yticks(range(R), labels, fontsize=8)
        ax.xaxis.tick_top()
        ax.set_title(name, fontsize=10)
        for g in groups[name]:
            for i in g:
                ax.add_patch(Rectangle((-0.5, i - 0.5), C, 1, fill=False, edgecolor=MARK, linewidth=2))
            ax.plot([C - 0.4, C - 0.2, C - 0.2, C - 0.4], [g[0], g[0], g[-1], g[-1]], color=MARK,
                    linewidth=2, clip_on=False)
            ax.text(C - 0.1, (g[0] + g[-1]) / 2, '=', color=MARK, fontsize=14, va='center')
    fig.text(0.01, 0.01, caption, fontsize=8)
    fig.get_layout_engine().set(rect=(0, 0.06, 1, 0.94))
    save(fig, path)


def overlay(image, w, grid, vmax):
    """image (3, S, S) in [0, 1] with the weights w (h, w) laid over it: red positive, blue negative, the
    colour's strength sqrt(|w| / vmax), so weights near 0 leave the image visible and small ones still show.
    vmax is shared by every map of a figure: a flat map looks faint, a peaked one strong. Returns
    (S, S, 3)."""
    t = (w / vmax).clamp(-1, 1).repeat_interleave(image.shape[1] // grid[0], 0)
    t = t.repeat_interleave(image.shape[2] // grid[1], 1)  # (S, S) in [-1, 1]
    colour = torch.where(t[None] >= 0, torch.tensor(RED)[:, None, None], torch.tensor(BLUE)[:, None, None])
    alpha = 0.85 * t.abs().sqrt()[None]  # (1, S, S)
    return (image * (1 - alpha) + colour * alpha).permute(1, 2, 0).numpy()


def image_grid(path, image, rows, queries, grid):
    """For each row (label, [one (h, w) weight map per query]): the image with the queries marked, then each
    query's map laid over it (overlay), all maps on one colour scale."""
    S = image.shape[1]
    vmax = max(tile.abs().max().item() for _, tiles in rows for tile in tiles)
    fig = figure(200 + 150 * (len(queries) + 1), 60 + 150 * len(rows))
    axes = fig.subplots(len(rows), len(queries) + 1, squeeze=False)
    cell = (S / grid[1], S / grid[0])
    for i, (label, tiles) in enumerate(rows):
        axes[i, 0].imshow(image.permute(1, 2, 0).numpy(), interpolation='nearest')
        axes[i, 0].set_ylabel(label, rotation=0, ha='right', va='center', fontsize=9)
        for j, ((y, x), tile) in enumerate(zip(queries, tiles)):
            axes[i, j + 1].imshow(overlay(image, tile, grid, vmax), interpolation='nearest')
            for ax in (axes[i, 0], axes[i, j + 1]):  # the query's patch, on the image and on its own map
                ax.add_patch(Rectangle((x * cell[0] - 0.5, y * cell[1] - 0.5), cell[0], cell[1], fill=False,
                                       edgecolor=MARK, linewidth=1.5))
        for ax in axes[i]:
            ax.set_xticks([])
            ax.set_yticks([])
    axes[0, 0].set_title('image', fontsize=9)
    for j, (y, x) in enumerate(queries):
        axes[0, j + 1].set_title(f'query ({y},{x})', fontsize=9)
    fig.text(0.01, 0.01, 'weights on the token grid (class token not drawn), mean over heads; red > 0, '
             f'blue < 0; strength sqrt(|w| / {vmax:.3f}), the largest |w| shown', fontsize=8)
    fig.get_layout_engine().set(rect=(0, 0.05, 1, 0.95))
    save(fig, path)


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
            title='top-1 here', xlabel='', ylabel='top-1 (%)', xticks=list(range(1, len(chosen) + 1)),
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
    InLine-Swin-T is R-res's row, the floor's its S row), so each panel holds its comparisons and a reader
    sees whether training had flattened for every model the text speaks of."""
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
                           (r't1_(?:swin_)?(\w+)_normalised_q', r'\1 normalised q'),
                           (r's_(\w+)_t', r'softmax \1'), (r'inline_(\w+)_t', r'InLine \1'),
                           (r'floor_(\w+)', r'floor \1'), (r'p_flatten_swin', 'FLatten'),
                           (r'p_flatten_swin_subtraction', 'FLatten subtr.'),
                           (r'p_transnormer_swin', 'TransNormer')):
        if re.fullmatch(pattern, name):
            return re.sub(pattern, short, name)
    return name

"""The paper's figures that need no ablation table: F1 (injectivity), F4 (locality by layer), F3 (attention
maps).

InLine attention: Han et al., "Bridging the Divide: Reconsidering Softmax and Linear Attention", NeurIPS 2024,
arXiv 2412.06590. Run as `python -m paper injectivity`, `locality`, `maps` (paper/__main__.py).

locality and maps train their four small DeiTs on first use (through the ablations' runs), or measure
--checkpoints given.
"""
import contextlib
import io
import os
import statistics

import torch
from PIL import Image
from torchvision.transforms import functional as TF
from tqdm import tqdm

import data
import inline
import models
import train
from paper.ablations import experiments, plan_runs, resolve_budget, resolve_data
from paper.charts import charts, heatmaps, image_grid, print_table
from paper.experiments import Experiment
from paper.runs import append_record, read_records, train_runs
from paper.stats import interval


# ---------------------------------------------------------------------------------------------------
# F1, injectivity: which queries does each attention tell apart?

def injectivity_weights(seed=0, D=8, keys=4):
    """The weights of 8 queries against `keys` keys under each method: rows 0-3 are q, 2q, 3q, 4q (collinear),
    rows 4-7 four random queries. float64, so rows that coincide do so to rounding (~1e-16).

    relu_affine is inline.ReLUAffine, ReLU(A x + b), with a fixed random A (identity + noise, seeded) in place
    of its initial identity, and b = 0, its initial bias: with b = 0 the map is homogeneous, ReLU(A a q) =
    a ReLU(A q), so it confuses q and a*q exactly as relu does. A learned b != 0 moves the confused set off
    the ray {a q} but does not remove it: queries x with A x + b = a (A q + b) get identical weights;
    `relu_affine_bias_check` shows both."""
    g = torch.Generator().manual_seed(seed)
    k = torch.randn(1, 1, keys, D, generator=g, dtype=torch.float64)  # (B, H, N, D) = (1, 1, 4, D)
    q = torch.randn(1, 1, 1, D, generator=g, dtype=torch.float64).abs()  # positive, so relu keeps all of q
    queries = torch.cat([a * q for a in (1, 2, 3, 4)]
                        + [torch.randn(1, 1, 4, D, generator=g, dtype=torch.float64)], dim=2)  # (1, 1, 8, D)
    relu, relu_affine = inline.get_phi('relu'), inline.get_phi('relu_affine', D).double()
    with torch.no_grad():
        # A = I + noise; b = 0
        relu_affine.weight.add_(0.3 * torch.randn(D, D, generator=g, dtype=torch.float64))
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
    on_line = torch.cat([torch.linalg.solve(A, a * (A @ q[0, 0, 0] + b) - b)[None, None, None]
                         for a in (1, 2, 3, 4)],
                        dim=2)  # (1, 1, 4, D)
    spread = lambda x: (w(x) - w(x)[0]).abs().max().item()  # noqa: E731
    return spread(on_ray), spread(on_line)


def cmd_injectivity(args):
    weights, (relu_affine, k, q) = injectivity_weights()
    labels = ['q', '2q', '3q', '4q', 'r1', 'r2', 'r3', 'r4']
    groups = {name: identical_rows(w) for name, w in weights.items()}
    print('F1: attention weights of 8 queries against 4 random keys (D = 8, float64). Rows q..4q are '
          'collinear,\nr1..r4 random. relu_affine: inline.ReLUAffine, ReLU(A x + b), with a fixed random A '
          '= I + 0.3 N(0, 1) and\nb = 0 (its initial bias).\n')
    for name, w in weights.items():
        same = {i: f'= {labels[g[0]]}' for g in groups[name] for i in g[1:]}
        print(f'{name}:')
        print_table(['query', *[f'key {j + 1}' for j in range(w.shape[1])], 'identical to'],
                    [[labels[i], *[f'{x:.4f}' for x in row.tolist()], same.get(i, '')]
                     for i, row in enumerate(w)])
        print()
    print('identical rows: ' + '; '.join(f'{n}: {[[labels[i] for i in g] for g in gs] or "none"}'
                                          for n, gs in groups.items()))
    ray, line = relu_affine_bias_check(relu_affine, k, q)
    print(f'relu_affine with a random b != 0: q..4q differ by up to {ray:.3f}, but x_a = A^-1(a(Aq + b) - '
          f'b), a = 1..4, still coincide (max difference {line:.1e}): the confusion moves, it does not go '
          'away.')

    heatmaps(args.png or os.path.join(args.out, 'injectivity.png'), weights, groups, labels,
             'rows q..4q: collinear queries; r1..r4: random. Outlined and bracketed: rows identical to '
             '1e-12. Colour: weight / max |weight| (blue < 0 < red).')
    return groups


def load_trained(path):
    """A model trained by train.py, rebuilt from its checkpoint: 'args' names the variant, 'arch' holds the
    overrides it was built with, 'model' the weights (loaded by models.load_checkpoint, strict on
    parameters)."""
    ckpt = train.read_checkpoint(path)  # a clear error for a missing or unreadable file
    if not isinstance(ckpt, dict) or not {'model', 'arch', 'args'} <= ckpt.keys():
        train.fail(f'{path} is not a checkpoint written by train.py (it needs model, arch and args)')
    try:
        model = models.create_model(ckpt['args']['model'], checkpoint=ckpt['model'], **ckpt['arch'])
    except (ValueError, RuntimeError, KeyError) as e:
        train.fail(f'cannot rebuild the model of {path}: {e}')
    return model.eval(), ckpt


# ---------------------------------------------------------------------------------------------------
# F4 and F3: the explicit N x N weights of each layer of small trained DeiT models, and Eq. 6's share beside
# them

F4_MODELS = {'softmax': 's_deit_t', 'linear (relu)': 'deit_linear_relu',
             # label: experiment; softmax is the S row's miniature (one head of 64)
             'InLine without Eq. 6': 'deit_no_residual', 'InLine': 'inline_deit_t'}
F4_EXTRA = {  # the ablations' miniature DeiT with vanilla linear attention, and InLine without Eq. 6
    'deit_linear_relu': Experiment('inline_deit_t', dict(layout='L', feature_map='relu', eq6='none'), 'F4',
                                          None, True,
                                          'DeiT miniature, vanilla linear attention (relu), no Eq. 6'),
    'deit_no_residual': Experiment('inline_deit_t', dict(eq6='none'), 'F4', None, True,
                                          'InLine-DeiT miniature without Eq. 6')}


def deit_runs(args, seeds):
    """{label: [checkpoint of each seed]}: the four models F4 and F3 look at by default, the ablations'
    miniature DeiT (64 px images, 8 px patches: an 8x8 token grid, on which a 3x3 neighbourhood is 9 of 64
    tokens; 6 blocks of width 64) trained with the ablations' budget and data; the runs the ablations share
    are not trained twice."""
    resolve_budget(args)
    every = {**experiments(), **F4_EXTRA}
    runs, planned = plan_runs({n: every[n] for n in F4_MODELS.values()}, every, lambda name: seeds, args)
    train_runs(runs, args, desc='training the four DeiT models')
    return {label: [(r.key(), os.path.join(r.folder(args.out), train.CHECKPOINT)) for r in planned[n]]
            for label, n in F4_MODELS.items()}


def checkpoints(args, seeds=1):
    """{name: [(run key or None, checkpoint)]}: --checkpoints NAME=PATH ... (a name given again is another
    seed of it), or the four small DeiTs (trained on first use), each with the key of its run record."""
    if not args.checkpoints:
        resolve_data(args, need=not args.no_train)
        return deit_runs(args, seeds)
    found = {}
    for c in args.checkpoints:
        name, path = c.split('=', 1) if '=' in c else (os.path.basename(os.path.dirname(c)) or c, c)
        found.setdefault(name, []).append((None, path))
    return found


def eval_images(ckpt, model, args, count, spread=True):
    """(images (B, 3, S, S) as the model saw them, labels, class names, what they are): `count` validation
    images, evenly spaced through the set (else the first `count`), of the data the checkpoint was trained on
    (its stored arguments), or of --dataset/--data-path when given."""
    ns = train.get_args_parser().parse_args([])
    vars(ns).update({k: v for k, v in ckpt.get('args', {}).items() if k in vars(ns)})
    if args.dataset:
        resolve_data(args)
        ns.dataset, ns.data_path = args.dataset, args.data_path
    ns.dataset = train.dataset(ns)
    ns.img_size, ns.download, ns.train_subset, ns.seed = model.img_size[0], False, None, ns.seed or 0
    ns.synthetic_train, ns.synthetic_val = 1, max(count, ns.synthetic_val or 0)
    ns.model = ns.model or 'inline_deit_t'
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
    handles = [block.attn.register_forward_pre_hook(
                   lambda module, inputs, i=i: captured.__setitem__(i, inputs[0]))
               for i, block in enumerate(model.blocks)]
    try:
        with torch.no_grad():
            model(images)
    finally:
        for h in handles:
            h.remove()
    return [captured[i] for i in range(len(model.blocks))]


def attention_weights(model, images):
    """[(B, H, N, N)] per block: the explicit weights of every block's attention for the input it really
    gets."""
    with torch.no_grad():
        return [block.attn.weights(x, model.grid)
                for block, x in zip(model.blocks, attention_inputs(model, images))]


def neighbourhood(grid):
    """(h*w, h*w) boolean: token j is in the 3x3 neighbourhood of token i (itself included)."""
    y, x = torch.meshgrid(torch.arange(grid[0]), torch.arange(grid[1]), indexing='ij')
    y, x = y.flatten(), x.flatten()
    return ((y[:, None] - y[None, :]).abs() <= 1) & ((x[:, None] - x[None, :]).abs() <= 1)


def weight_shares(w, grid):
    """{'class', 'own', 'near'}: (H,) means over images and grid queries of w (B, H, N, N), whose last h*w
    tokens are the grid (DeiT's class token first). class: the weight on the class token. own and near: the
    query's own token and the other 8 of its 3x3 neighbourhood, among the grid weights renormalised without
    the class token, w_ij / (1 - w_i,cls), so a class token that takes much weight does not look like a loss
    of locality."""
    hw = grid[0] * grid[1]
    P = w.shape[-1] - hw
    cls = w[:, :, P:, :P].sum(-1)  # (B, H, hw)
    g = w[:, :, P:, P:] / (1 - cls).clamp_min(1e-6)[..., None]  # (B, H, hw, hw), rows sum to 1
    near = neighbourhood(grid) & ~torch.eye(hw, dtype=torch.bool)
    return {'class': cls.mean((0, 2)), 'own': g.diagonal(dim1=-2, dim2=-1).mean((0, 2)),
            'near': (g * near.to(g.dtype)).sum(-1).mean((0, 2))}


def eq6_share(attn, x, grid):
    """(H,): Eq. 6's share of each grid token's output, |res_i| / (|att_i| + |res_i|) per head (0 without Eq.
    6), the mean over images and tokens; att_i = sum_j w_ij v_j is Eq. 5's part, res_i Eq. 6's, which the N x
    N weights do not hold (its weights are per channel)."""
    if getattr(attn, 'residual', None) is None:
        return torch.zeros(attn.num_heads)
    w = attn.weights(x, grid)  # Eq. 5's weights, (B, H, N, N)
    x = x if attn.ape is None else x + attn.ape  # as the forward's
    _, _, v = attn.project(x)  # (B, H, N, D)
    P = v.shape[2] - grid[0] * grid[1]
    att = (w @ v)[:, :, P:]  # Eq. 5, (B, H, hw, D)
    r = inline.residual_weights(attn.residual, x.mean(dim=1))  # (B, T*C)
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
        sums = [{k: v * n + (sums[j][k] if sums else 0) for k, v in layer.items()}
                for j, layer in enumerate(part)]
    return [{k: v / len(images) for k, v in layer.items()} for layer in sums]


SHARES = {'near': 'other 8 of the 3x3', 'own': 'own token', 'class': 'class token', 'eq6': "Eq. 6's share"}


def initial_model(model, ckpt):
    """The model a trained one's run started from: built as train.py builds it, after torch.manual_seed(its
    seed)."""
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
            for label, shares, acc in ((name, m['trained'], m['top1']),
                                       (f'{name}, untrained', m['untrained'], None)):
                results.setdefault(label, []).append([{k: torch.tensor(v) for k, v in layer.items()}
                                                      for layer in shares])
                top1.setdefault(label, []).append(acc)
            if grid not in (None, tuple(m['grid'])):
                train.fail(f'the checkpoints have different token grids ({grid} and {tuple(m["grid"])})')
            grid, what = tuple(m['grid']), m['what']
    hw = grid[0] * grid[1]
    uniform = {'own': 1 / hw, 'near': (neighbourhood(grid).sum().item() - hw) / hw / hw}  # 1/hw each
    stat = lambda v: (statistics.mean(v), statistics.stdev(v) if len(v) > 1 else 0.0)  # noqa: E731
    print(f'F4: per layer, means over {what}, the {grid[0]}x{grid[1]} grid queries and the heads (per head '
          'in brackets), ± the standard deviation over seeds. Own token and the other 8 of the 3x3: among '
          f'the grid weights renormalised without the class token; uniform weights give {uniform["own"]:.4f} '
          f'and {uniform["near"]:.4f}. Eq. 6\'s share: |Eq. 6| / (|Eq. 5| + |Eq. 6|) of each output. '
          '"untrained": the same model at the weights its run started from; the last column, the 3x3 share '
          'trained minus untrained, seed by seed, with its 95% Student-t interval: what training did to '
          'locality at this budget.\n')
    rows, curves = [], {k: [] for k in SHARES}
    for name, per_seed in results.items():
        accs = [a for a in top1[name] if a is not None]
        start = results.get(f'{name}, untrained')
        for layer in range(len(per_seed[0])):
            cells = []
            for key in SHARES:
                heads = torch.stack([seed[layer][key] for seed in per_seed])  # (seeds, H)
                m, s = stat(heads.mean(1).tolist())
                cells.append(f'{m:.3f} ± {s:.3f} (' + ' / '.join(f'{h:.2f}' for h in heads.mean(0).tolist())
                             + ')')
            moved = ''
            if start and len(per_seed) > 1:  # seed by seed: the trained model against the one it started from
                mean, half = interval([(a[layer]['near'] - b[layer]['near']).mean().item()
                                       for a, b in zip(per_seed, start)])
                moved = f'{mean:+.3f} [{mean - half:+.3f}, {mean + half:+.3f}]'
            rows.append([name, layer + 1,
                         (f'{statistics.mean(accs):.1f} ({len(accs)} seeds)' if accs else '—')
                         if layer == 0 else '', *cells, moved])
        for key in SHARES:
            series = [stat([seed[layer][key].mean().item() for seed in per_seed])
                      for layer in range(len(per_seed[0]))]
            curves[key].append((name, list(range(1, len(series) + 1)), [m for m, _ in series],
                                [s for _, s in series]))
    print_table(['model', 'layer', 'top-1', *SHARES.values(), '3x3: trained − untrained [95% CI]'], rows)
    layers = max(len(s[1]) for s in curves['near'])
    charts(args.png or os.path.join(args.out, 'locality.png'), [dict(
        series=curves[key], title=f'F4: {label}, by layer', xlabel='layer', ylabel='share',
        xticks=list(range(1, layers + 1)),
        hlines=[(f'uniform ({uniform[key]:.3f})', uniform[key])] if key in uniform else [])
        for key, label in SHARES.items()], cols=2, size=(520, 380))
    return results, uniform


def read_image(path, size):
    """An image file as the models see it: RGB, resized to size x size (bicubic), normalised like train.py's
    data."""
    try:
        with Image.open(path) as img:
            img = img.convert('RGB')
    except Exception as e:
        train.fail(f'cannot read image {path}: {e}')
    x = TF.to_tensor(img.resize((size, size), Image.BICUBIC))  # (3, size, size) in [0, 1]
    return TF.normalize(x, data.MEAN, data.STD)


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
        x, what = images[args.index], (f'{what.split()[1]} validation image {args.index} '
                                       f'({classes[labels[args.index]]})')
    queries = [tuple(int(v) for v in q.split(',')) for q in args.queries]
    if any(not (0 <= y < grid[0] and 0 <= x_ < grid[1]) for y, x_ in queries):
        train.fail(f'--queries must lie on the {grid[0]}x{grid[1]} token grid (row,col from 0)')
    image = (x * torch.tensor(data.STD)[:, None, None] + torch.tensor(data.MEAN)[:, None, None]).clamp(0, 1)
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
                table.append([name, layer, f'({y},{x_})', f'{row[P + y * grid[1] + x_].item():.3f}',
                              f'{local:.3f}', f'{row[0].item():.3f}', f'{row[P:].min().item():.3f}',
                              f'{row[P:].max().item():.3f}'])
            rows.append((f'{name}, layer {layer}', tiles))
    print(f'F3: attention weights of {len(queries)} query tokens in {what}, the mean over heads (Eq. 6 not '
          'among them: F4 gives its share)\n')
    print_table(['model', 'layer', 'query (row,col)', 'on itself', 'on its 3x3', 'on the class token', 'min',
                 'max'],
                table)

    image_grid(args.png or os.path.join(args.out, 'maps.png'), image, rows, queries, grid)
    return rows


# ---------------------------------------------------------------------------------------------------

"""Checkpoint files: the released format, read as weights only and fitted to a model; train.py's,
written atomically and resumed exactly.

InLine attention: Han et al., NeurIPS 2024, arXiv 2412.06590. models.create_model(checkpoint=...)
loads through load_checkpoint. For train.py, its run (a train.Run) and training state (a
train.Training) come in as arguments; OUTPUT_DIR holds checkpoint.pt (the latest, which a rerun of
the same command resumes), best.pt (a link to the best epoch's), metrics.jsonl (the checkpoint's
log) and val_correct.pt (the last validation's per-image results, which the lab reads).
"""
import contextlib
import json
import math
import os
import pickle
import random
import shlex
import shutil
import tempfile

import torch
import torch.distributed as dist
import torch.nn.functional as F

import inline
from ranks import fail, print0

# --------------------------------------------------------------------------------------------------
# The released format {'model': state_dict}, and train.py's, which uses the same key

# released buffers our models compute instead
REBUILT_BUFFERS = ('relative_position_index', 'attn_mask')
# EMA weights beside 'model': train.py's; the authors' CSwin files
EMA_KEYS = ('model_ema', 'state_dict_ema')


def read_file(path):
    """A checkpoint file as torch.load(weights_only=True) reads it, which never runs code from the
    file. A file that also holds other Python objects (the authors' training files keep their yacs
    config) is refused with a ValueError that gives the line keeping only its weights."""
    if not os.path.isfile(path):
        raise FileNotFoundError(f"no checkpoint at {path}")
    try:
        return torch.load(path, map_location='cpu', weights_only=True)
    except pickle.UnpicklingError as e:
        stripped = os.path.splitext(path)[0] + '.weights.pth'
        keep = ', '.join(map(repr, ('model',) + EMA_KEYS))
        strip = (f"import torch; c = torch.load({os.fspath(path)!r}, map_location='cpu', "
                 f"weights_only=False); torch.save({{k: c[k] for k in ({keep}) if k in c}}, "
                 f"{os.fspath(stripped)!r})")
        raise ValueError(
            f"{path} holds Python objects besides weights (such as the authors' yacs config), "
            f"which torch.load(weights_only=True) refuses to unpickle "
            f"({str(e).strip().splitlines()[-1]}).\nIf you trust the file, keep only its weights "
            f"once:\npython -c {shlex.quote(strip)}\nand pass "
            f"{shlex.quote(stripped)} instead.") from None
    except Exception as e:  # a text file, a truncated download: torch.load's own error says little
        raise ValueError(f"{path} is not a checkpoint: torch.load cannot read it "
                         f"({type(e).__name__}: {e}); a checkpoint is a file torch.save wrote, "
                         f"such as train.py's {CHECKPOINT} or a released .pth") from None


def load_checkpoint(model, checkpoint, img_size=None, key='model', finetune=False, log=print,
                    path=None):
    """Load released or project weights into model: strict on parameters, ignoring the buffers we
    rebuild; position embeddings and relative position tables resized to the model's image size
    (resize_positions); each change said in one line through `log` (None: silent).

    checkpoint: a file's path, or what such a file holds, in memory: {'model': state_dict, ...}
        (train.py's, the authors'), or the state dict itself.
    img_size: (H, W) or an int, the image size the weights were trained at, for a checkpoint that
        records none (the authors' files: their variant's own, models.released_img_size); the size a
        checkpoint records (trained_img_size) wins.
    key: which weights of the file: 'model', or an EMA's (EMA_KEYS).
    finetune: a head the file does not hold (other classes) is refused unless True, where the
        file's head is dropped and the model's new one, random, kept to be trained.
    path: the file an in-memory checkpoint was read from, for the messages."""
    named = isinstance(checkpoint, (str, os.PathLike))
    saved = read_file(checkpoint) if named else checkpoint
    path = os.fspath(checkpoint) if named else path or IN_MEMORY
    state = saved.get(key, saved) if isinstance(saved, dict) else None
    if not (isinstance(state, dict) and all(isinstance(v, torch.Tensor) for v in state.values())):
        held = state if isinstance(saved, dict) else saved
        raise ValueError(f"{path} is not a checkpoint: it holds {type(held).__name__}, not a state "
                         "dict of tensors ({'model': state_dict}, or the state dict itself)")
    own = model.state_dict()
    state = {k: v for k, v in state.items()
             if not (k.rsplit('.', 1)[-1] in REBUILT_BUFFERS and k not in own)}
    body = lambda d: {k for k in d if not k.startswith('head.')}  # noqa: E731
    missing, unexpected = sorted(body(own) - body(state)), sorted(body(state) - body(own))
    if missing or unexpected:
        raise RuntimeError(mismatch(path, saved, model, missing, unexpected))
    state = fit_head(state, own, finetune, path, log)
    record = trained_img_size(saved)
    trained = record or (pair(img_size) if img_size else None)
    state = resize_positions(model, state, own, trained, record is not None, path, log)
    wrong = [f"{k}: {tuple(v.shape)} vs {tuple(own[k].shape)}"
             for k, v in state.items() if v.shape != own[k].shape]
    if wrong:
        raise RuntimeError(f"{path}: shapes that cannot be resized: {wrong}" + recorded(saved))
    model.load_state_dict(state, strict=False)  # all checked above; strict=False for a new head
    return model


def classes_of(state):
    """The number of classes of a state dict's head, 0 where it has none."""
    return state['head.weight'].shape[0] if 'head.weight' in state else 0


def fit_head(state, own, finetune, path, log):
    """state, its head kept where it fits the model's; else (other classes, another width, none)
    refused, for a model whose head the file does not hold would answer at random, unless finetune:
    then the file's head is dropped and the model's new one kept, each said through log."""
    head = {k: v for k, v in state.items() if k.startswith('head.')}
    mine = {k: v for k, v in own.items() if k.startswith('head.')}
    if head.keys() == mine.keys() and all(v.shape == mine[k].shape for k, v in head.items()):
        return state
    if mine and not finetune:
        raise RuntimeError(
            f"{path}: its head ({said_head(head)}) does not fit this model's ({said_head(mine)}), "
            f"which would answer at random. To use the file's, build the model with "
            f"num_classes={classes_of(head)}; to fine-tune a new one, pass finetune=True "
            f"(models.create_model, load_checkpoint; train.py: --finetune)")
    if head and log:
        log(f"{path}: dropped its head ({said_head(head)})")
    if mine and log:
        log(f"{path}: a new head ({said_head(mine)}), initialised at random, to fine-tune")
    return {k: v for k, v in state.items() if not k.startswith('head.')}


def said_head(head):
    """'10 classes x 64 features', or 'none'."""
    if 'head.weight' not in head:
        return 'none'
    classes, width = head['head.weight'].shape
    return f"{classes} classes x {width} features"


def pair(size):
    """(H, W) from an image size given as an int or a pair."""
    return tuple(size) if isinstance(size, (tuple, list)) else (size, size)


def trained_img_size(saved):
    """(H, W): the image size a checkpoint records it was trained at, train.py's (its model's
    overrides, 'arch', else its flags, 'args'); None for a bare state dict or the authors' files."""
    for record in ('arch', 'args'):
        size = saved.get(record) if isinstance(saved, dict) else None
        if isinstance(size, dict) and size.get('img_size') is not None:
            return pair(size['img_size'])
    return None


def resize_positions(model, state, own, trained, recorded, path, log=None):
    """state with its position embeddings (model.position_grids) resampled from their grids at the
    image size the checkpoint was trained at (`trained`; None: unknown) to the model's, bicubic on
    the grid, leading vectors (DeiT's class token) kept apart, as timm's resample_abs_pos_embed;
    and its relative position tables resized to the model's windows (resize_table). A grid is never
    guessed from a vector count: 144 vectors are 12x12 or 9x16. A size the file records must fit its
    vectors; a size given for a file that records none (recorded False: the variant's own) is used
    where it fits them. Without one that fits, an equal count is taken as the same grid (a file
    loaded at the size it was trained at), and another count is refused. Each tensor resized is
    said through log, a line each."""
    state = dict(state)
    grids = model.position_grids(model.img_size) if hasattr(model, 'position_grids') else {}
    before = model.position_grids(trained) if trained and grids else {}
    for name, (P, grid) in grids.items():
        value, n = state[name], state[name].shape[1] - P
        if value.shape[-1] != own[name].shape[-1]:
            continue  # other channels: another model's, which the shape check names
        old = before[name][1] if name in before else None
        if old is None or (n != old[0] * old[1] and not recorded):  # no size that fits the file
            if value.shape != own[name].shape:
                raise RuntimeError(unknown_grid(path, name, n, grid, model.img_size, trained, old))
            continue
        if n != old[0] * old[1]:
            raise RuntimeError(
                f"{path}: {name} holds {n} position vectors, but the {trained[0]}x{trained[1]} "
                f"px the checkpoint records make a {old[0]}x{old[1]} grid of {old[0] * old[1]} "
                f"for this {model.name}: the file does not match its record, so it cannot be "
                f"resized to the model's {grid[0]}x{grid[1]}")
        if old != grid:
            resized = resize_grid(value[:, P:], old, grid, 'bicubic')  # (1, h'*w', C)
            state[name] = torch.cat([value[:, :P], resized], dim=1)  # (1, P + h'*w', C)
            kept = ", the class token's vector kept" * bool(P)  # DeiT's, off the grid
            say_resized(log, path, name, f'{old[0]}x{old[1]} grid', f'{grid[0]}x{grid[1]}', kept)
    for name, value in state.items():
        if name.endswith('relative_position_bias_table') and value.shape != own[name].shape:
            state[name] = resize_table(value, own[name].shape)
            old, new = (math.isqrt(v.shape[0]) for v in (value, state[name]))
            if state[name].shape == own[name].shape:  # else the shape check refuses it
                say_resized(log, path, name, f'{old}x{old} table of offsets', f'{new}x{new}')
    return state


def say_resized(log, path, name, old, new, more=''):
    """One line for one tensor resized on load."""
    if log:
        log(f"{path}: resized {name} from its {old} to {new}, bicubic{more}")


def unknown_grid(path, name, n, grid, img_size, given, given_grid):
    """The refusal where a checkpoint's grid cannot be known: the grids its count could be, and the
    one of the size given for it, which does not fit."""
    could = [f'{h}x{n // h}' for h in range(1, n + 1)
             if n % h == 0 and max(h, n // h) <= 4 * min(h, n // h)]  # aspect ratios up to 4:1
    return (f"{path}: cannot tell the grid {name}'s {n} position vectors were trained on (it could "
            f"be {' or '.join(could) or 'none of a sensible shape'}), so it cannot be resized to "
            f"this model's {grid[0]}x{grid[1]} ({img_size[0]}x{img_size[1]} px): the file records "
            f"no image size" + (f", and the {given[0]}x{given[1]} px given for it make "
                                f"{given_grid[0]}x{given_grid[1]}" if given_grid else '') +
            f". Give the size it was trained at, load_checkpoint(model, path, "
            f"img_size=(H, W)) (train.py gives the variant's own for a file without one), or build "
            f"the model at it")


def resize_table(table, shape):
    """A relative position table ((2w - 1)^2, H) -> ((2w' - 1)^2, H) for another window: bicubic
    on the (2w - 1) x (2w - 1) grid of offsets, each head apart, as timm's
    resize_rel_pos_bias_table."""
    old, new = math.isqrt(table.shape[0]), math.isqrt(shape[0])
    if table.shape[1] != shape[1] or old ** 2 != table.shape[0] or new ** 2 != shape[0]:
        return table  # not two square tables of the same heads: left to the shape check
    grid = table.T.reshape(1, -1, old, old)  # (1, H, 2w - 1, 2w - 1)
    grid = F.interpolate(grid, size=(new, new), mode='bicubic', align_corners=False,
                         antialias=False)  # (1, H, 2w' - 1, 2w' - 1)
    return grid.reshape(-1, new * new).T  # ((2w' - 1)^2, H)


def recorded(saved):
    """What a train.py checkpoint says it holds, for a refusal: '' where it records nothing."""
    args = saved.get('args') if isinstance(saved, dict) else None
    held = isinstance(args, dict) and 'model' in args
    return f"; the file holds a {args['model']}" if held else ''


def mismatch(path, saved, model, missing, unexpected):
    """Why a checkpoint's keys do not fit model, in a few lines: the model and sizes a train.py
    checkpoint records and how to rebuild them, else how many keys differ, the first of each."""
    first = lambda keys: ', '.join(keys[:3]) + ', ...' * (len(keys) > 3)  # noqa: E731
    lines = [f"{path} does not fit this {model.name}: {len(missing)} of its keys missing "
             f"({first(missing)}), {len(unexpected)} unexpected ({first(unexpected)})"]
    flags, arch = saved_record(saved)
    if flags and arch is not None:
        name, run_keys = flags['model'], ('img_size', 'num_classes', 'drop_path_rate')
        sizes = {k: v for k, v in arch.items() if k not in run_keys}
        # as train.py's --model-kwargs reads them, each quoted for the shell: 'depths=(2,2,2,2)'
        given = ' '.join(shlex.quote(f'{k}={v}' if isinstance(v, str) else
                                     f'{k}={v!r}'.replace(' ', '')) for k, v in sizes.items())
        lines.append(f"it holds a {name} built with {sizes or 'its defaults'}: build it with "
                     f"{create_call(name, path)}, or train.py --model {name}"
                     + f" --model-kwargs {given}" * bool(sizes))
    else:
        lines.append("another variant's or another size's weights: choose the variant "
                     "(models.MODELS) and the sizes (embed_dim, depths, num_heads, ...) they were "
                     "trained with")
    return '\n'.join(lines)


# how messages name a checkpoint given in memory, not as a file
IN_MEMORY = 'the checkpoint'
# create_model arguments a checkpoint's weights are adapted to when loaded: position grids and
# relative position tables are resized to the image size; drop path holds no weights
ADAPTED = ('img_size', 'drop_path_rate')


def saved_record(saved):
    """(flags, arch) that a train.py checkpoint records: its flags ('args', --model among them) and
    the create_model overrides its model was built with ('arch'), options saved before their
    renaming under their new names (inline.RENAMED); None for each a file does not hold (the
    authors' files, bare state dicts)."""
    held = [saved.get(k) if isinstance(saved, dict) else None for k in ('args', 'arch')]
    return tuple({inline.RENAMED.get(k, k): v for k, v in d.items()} if isinstance(d, dict)
                 else None for d in held)


def create_call(name, path, **overrides):
    """The models.create_model call, as Python reads it, that builds `name` from the checkpoint at
    path (one in memory: the variable `checkpoint`)."""
    where = 'checkpoint' if path == IN_MEMORY else repr(os.fspath(path))
    given = ''.join(f', {k}={v!r}' for k, v in overrides.items())
    return f"models.create_model({name!r}, checkpoint={where}{given})"


def recorded_build(name, saved, path, overrides, finetune, own):
    """create_model's overrides for a checkpoint: the model a train.py file records (its variant
    and arch), the overrides given over it where they adapt it (ADAPTED), or with finetune=True
    (other classes: a new head); else refused, naming what differs and the call that builds the
    file's model. own: the variant's own arguments, for those the file leaves at them. A file that
    records nothing (the authors') takes the overrides as given."""
    flags, arch = saved_record(saved)
    if arch is None:  # the authors' files: a head of other classes only to fine-tune
        state = saved.get('model', saved) if isinstance(saved, dict) else {}
        held = classes_of(state) if isinstance(state, dict) else 0
        wanted = overrides.get('num_classes', own.get('num_classes'))
        if held and held != wanted and not finetune:
            raise ValueError(
                f"{path} holds a head of {held} classes, not {wanted}: "
                f"to use it, {create_call(name, path, **(overrides | {'num_classes': held}))}; "
                f"to fine-tune a new head, {create_call(name, path, **overrides, finetune=True)}")
        return overrides
    held = (flags or {}).get('model', name)
    same = lambda v: tuple(v) if isinstance(v, list) else v  # noqa: E731  a list as its tuple
    differ = [k for k, v in overrides.items()
              if k not in ADAPTED and same(v) != same(arch.get(k, own.get(k)))]
    kept = {k: v for k, v in overrides.items() if k not in differ}
    if held != name:
        adapted = {k: v for k, v in overrides.items() if k in ADAPTED}
        raise ValueError(f"{path} holds a {held}, not a {name}: "
                         f"{create_call(held, path, **adapted)}")
    if differ and not finetune:
        asked = ', '.join(f'{k}={overrides[k]!r}' for k in differ)
        built = ', '.join(f'{k}={arch.get(k, own.get(k))!r}' for k in differ)
        tune = create_call(name, path, **overrides, finetune=True)
        new_head = f"; to fine-tune a new head, {tune}" * (differ == ['num_classes'])
        raise ValueError(f"{path} holds a {name} built with {built}, not {asked}: to build the "
                         f"model it holds, {create_call(name, path, **kept)}{new_head}")
    return {**arch, **overrides}


def resize_grid(tokens, old_grid, new_grid, mode):
    """Resample tokens laid out on a grid, (1, h*w, C) -> (1, h'*w', C): position embeddings. No
    antialiasing, as timm's resize_rel_pos_bias_table (it would act only when shrinking)."""
    x = tokens.transpose(1, 2).reshape(1, tokens.shape[2], *old_grid)  # (1, C, h, w)
    x = F.interpolate(x, size=new_grid, mode=mode, align_corners=False,
                      antialias=False)  # (1, C, h', w')
    return x.flatten(2).transpose(1, 2)  # (1, h'*w', C)


# --------------------------------------------------------------------------------------------------
# train.py's files

# OUTPUT_DIR's latest checkpoint, which a rerun of the same command resumes
CHECKPOINT = 'checkpoint.pt'
METRICS = 'metrics.jsonl'


def check_output_dir(path):
    """Create OUTPUT_DIR and prove it writable, before anything is built: a run must not train only
    to find it cannot save."""
    try:
        os.makedirs(path, exist_ok=True)
        with tempfile.TemporaryFile(dir=path):
            pass
    except OSError as e:
        fail(f'--output-dir {path} cannot be created or written to ({e.strerror or e}): give a '
             'folder you can write in, or leave the flag out for runs/<model>-<data>')


def read_checkpoint(path):
    """read_file (weights only, never code from the file), its refusals said once, by rank 0."""
    try:
        return read_file(path)
    # no file; Python objects besides weights, with the line to strip them
    except (FileNotFoundError, ValueError) as e:
        fail(str(e))
    except Exception as e:
        fail(f'cannot read checkpoint {path}: {e}')


def check_architecture(path, saved, asked):
    """A run that starts from the checkpoint at path goes on with the architecture it saved (its
    create_model overrides, less the image size, classes and drop path train.py sets), else is
    stopped, naming what differs."""
    differ = sorted(k for k in {**saved, **asked} if saved.get(k) != asked.get(k))
    if differ:
        fail(f'{path} holds a model built with {saved}; this run asks for ' +
             ', '.join(f'{k}={asked[k]!r}' if asked.get(k) is not None else f'no {k}'
                       for k in differ) +
             f'. They differ in {", ".join(differ)}: leave the architecture flags out to continue '
             f'or evaluate the model as it was built, or give another --output-dir')


def load_weights(model, saved, key, path, img_size, finetune=False):
    """saved[key] (the whole of saved for a bare state dict) into model, with load_checkpoint's
    checks, each change said; img_size: the variant's own, for a file that records none."""
    try:
        load_checkpoint(model, saved, img_size, key, finetune=finetune, log=print0, path=path)
    except RuntimeError as e:
        fail(f'cannot load {path} ({key}): {e}')


def load_initial(model, path, img_size):
    """train.py --finetune: the file's weights, its EMA where it has one (the authors' 384 px
    fine-tunes start from the 224 px EMA weights), a new head where the classes differ; each
    change said."""
    saved = read_checkpoint(path)
    key = next((k for k in EMA_KEYS if saved.get(k) is not None), 'model')
    print0(f'initial weights: {path} ({key})')
    load_weights(model, saved, key, path, img_size, finetune=True)


def link_atomic(src, dst):
    """dst becomes the same file as src (a hard link, or a copy where links are unsupported),
    atomically."""
    # renaming a link onto itself would leave dst.tmp
    if os.path.exists(dst) and os.path.samefile(src, dst):
        return
    with contextlib.suppress(FileNotFoundError):
        os.remove(dst + '.tmp')
    try:
        os.link(src, dst + '.tmp')
    except OSError:
        shutil.copyfile(src, dst + '.tmp')
    os.replace(dst + '.tmp', dst)


def save_checkpoint(run, t, is_best=False):
    """Everything a rerun needs to continue exactly, with every rank's random generators, and what
    rebuilds the model alone (models.create_model(name, checkpoint=path); predict.py): its variant
    (args), every create_model argument it was built with (arch: sizes, image size, classes) and
    the class names in label order; written atomically."""
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
                        'ema_updates': int(t.ema.n_averaged) if t.ema else 0,
                        'epoch': t.epoch, 'step': t.step,
                        'best_acc1': t.best_acc, 'is_best': is_best, 'log': t.log, 'rng': states,
                        'args': vars(run.args), 'arch': t.raw.arch,
                        'num_classes': t.raw.num_classes, 'classes': run.classes}, f)
            f.flush()
            os.fsync(f.fileno())
        # flushed to disk, then renamed: a crash leaves the old file or the new
        os.replace(path + '.tmp', path)

    publish(run, t, is_best)


def publish(run, t, is_best):
    """best.pt and metrics.jsonl follow checkpoint.pt (redone on resume, in case a kill came in
    between)."""
    if run.rank != 0:
        return
    out = run.args.output_dir
    if is_best:
        link_atomic(os.path.join(out, CHECKPOINT), os.path.join(out, 'best.pt'))
    metrics = os.path.join(out, METRICS)  # rewritten whole: always the checkpoint's log
    with open(metrics + '.tmp', 'w') as f:
        f.writelines(json.dumps(e) + '\n' for e in t.log)
    os.replace(metrics + '.tmp', metrics)


def read_metrics(output_dir):
    """A run's log as publish wrote it: one dict an evaluated epoch."""
    with open(os.path.join(output_dir, METRICS)) as f:
        return [json.loads(line) for line in f]


def resume(run, t):
    """Continue exactly where the checkpoint stopped: weights, optimizer, schedule, EMA, log and
    random streams."""
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
    t.epoch, t.step, t.best_acc, t.log = (saved['epoch'], saved['step'], saved['best_acc1'],
                                          saved['log'])
    # this rank's random streams, as save_checkpoint gathered them
    if len(saved['rng']) == run.world:
        state = saved['rng'][run.rank]
        torch.set_rng_state(state['torch'])
        random.setstate(state['python'])
        if state['cuda']:
            torch.cuda.set_rng_state_all(state['cuda'])
    else:
        print0(f'warning: saved with {len(saved["rng"])} processes, now {run.world}; '
               f'random streams differ')
    changed = sorted(k for k, v in saved['args'].items()
                     if vars(args).get(k) != v
                     and k not in ('resume', 'workers', 'threads', 'output_dir'))
    print0(f'resumed from {path}: epoch {t.epoch + 1}, step {t.step}' +
           (f' (changed since saved: {", ".join(changed)})' if changed else ''))
    if path == os.path.join(args.output_dir, CHECKPOINT):
        publish(run, t, saved.get('is_best', False))


def save_correct(run, name, correct):
    """OUTPUT_DIR/<name>.pt: evaluate's per-image results (a bool tensor, one entry per validation
    image in the validation set's order), which the lab reads; written by rank 0 atomically, as
    checkpoints are."""
    if run.rank == 0:
        path = os.path.join(run.args.output_dir, f'{name}.pt')
        torch.save(correct, path + '.tmp')
        os.replace(path + '.tmp', path)

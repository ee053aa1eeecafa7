"""The checkpoint files of train.py: read (weights only), written atomically, resumed exactly.

InLine attention: Han et al., NeurIPS 2024, arXiv 2412.06590. train.py's run (a train.Run) and its training
state (a train.Training) come in as arguments; OUTPUT_DIR holds checkpoint.pt (the latest, which a rerun of the
same command resumes), best.pt (a link to the best epoch's), metrics.jsonl (the checkpoint's log) and
val_correct.pt (the last validation's per-image results, which the lab reads).
"""
import contextlib
import json
import os
import random
import shutil

import torch
import torch.distributed as dist

import models
from data import fail, print0

CHECKPOINT = 'checkpoint.pt'  # OUTPUT_DIR's latest checkpoint, which a rerun of the same command resumes


def read_checkpoint(path):
    """models.read_checkpoint (weights only, never code from the file), its refusals said once, by rank 0."""
    try:
        return models.read_checkpoint(path)
    except (FileNotFoundError, ValueError) as e:  # no file; Python objects besides weights, with the line to strip them
        fail(str(e))
    except Exception as e:
        fail(f'cannot read checkpoint {path}: {e}')


def load_weights(model, saved, key, path):
    """saved[key] (the whole of saved for a bare state dict) into model, with models.load_checkpoint's
    checks."""
    try:
        models.load_checkpoint(model, saved.get(key, saved))
    except RuntimeError as e:
        fail(f'cannot load {path} ({key}): {e}')


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


def save_checkpoint(run, t, is_best=False):
    """Everything a rerun needs to continue exactly, with every rank's random generators, written
    atomically."""
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


def resume(run, t):
    """Continue exactly where the checkpoint stopped: weights, optimizer, schedule, EMA, log and random
    streams."""
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


def save_correct(run, name, correct):
    """OUTPUT_DIR/<name>.pt: evaluate's per-image results (a bool tensor, one entry per validation image in
    the validation set's order), which the lab reads; written by rank 0 atomically, as checkpoints are."""
    if run.rank == 0:
        path = os.path.join(run.args.output_dir, f'{name}.pt')
        torch.save(correct, path + '.tmp')
        os.replace(path + '.tmp', path)

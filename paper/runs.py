"""The lab's training runs and their records: the scheduler, its locks, the records in results/, and the
command that trains one paper experiment.

InLine attention: Han et al., "Bridging the Divide: Reconsidering Softmax and Linear Attention", NeurIPS 2024,
arXiv 2412.06590. Every image model of the lab is trained by train.py's loop, through

    python -m paper train NAME [train.py flags]   # NAME: an experiment (python -m paper experiments), a model

which the scheduler (train_runs) starts as a subprocess, one per run, from the repository root; each finished
run appends its record to results/runs.jsonl, from which every table and picture is rebuilt.
"""
import base64
import fcntl
import hashlib
import json
import os
import re
import resource
import signal
import subprocess
import sys
import time
from typing import NamedTuple

import torch
import torch.nn.functional as F
from tqdm import tqdm

import models
from checkpoints import METRICS, read_metrics
import train
from paper import mosaics
from paper.experiments import EXPERIMENTS

# the repository: results/, figures/, train.py
ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


# Training runs: every model here is trained by train.py's loop (`python -m paper train`); each finished run
# appends its record (the model, recipe, seed, per-epoch metrics, command line, CPU time, machine) to
# results/runs.jsonl, kept in the repository, and every table and picture is rebuilt from the records: a run
# with a record is never redone

RECORDS = os.path.join(ROOT, 'results', 'runs.jsonl')
# the per-epoch metrics a record keeps; val_correct (pack_correct) only the final epoch has
KEPT = ('epoch', 'train_loss', 'lr', 'val_loss', 'val_acc1', 'val_acc5', 'val_images', 'val_correct')


class LabRun(NamedTuple):
    """One training run: the experiment it trains under, its model (config_key), its recipe (data, budget,
    precision, device and train.py's own recipe: records of two recipes never mix), its seed, train.py's
    flags."""
    name: str
    config: str
    recipe: dict
    seed: int
    argv: list

    def key(self):
        return record_key(self._asdict())

    def folder(self, out):
        """OUT/runs/<name>-seed<seed>-<digest of the key>: the run's checkpoints, log and CPU time while it
        trains."""
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
    """An open descriptor holding an exclusive flock on FOLDER/lock, or None when another process holds it
    (and not wait). The train.py process inherits it, so the lock lasts as long as the run, even if the lab
    dies."""
    os.makedirs(folder, exist_ok=True)
    fd = os.open(os.path.join(folder, 'lock'), os.O_RDWR | os.O_CREAT)
    try:
        fcntl.flock(fd, fcntl.LOCK_EX | (0 if wait else fcntl.LOCK_NB))
        return fd
    except BlockingIOError:
        os.close(fd)
        return None


def machine(threads):
    """What a record says its run ran on: the CPU (and whether it has AVX-512 BF16 and AMX), the GPU if
    any."""
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
        return 'done' if read_metrics(path)[-1]['epoch'] == epochs else None
    except (FileNotFoundError, IndexError):
        return None


def make_record(run, folder, state, threads):
    """The record of a run finished in its folder: its CPU and wall time summed over every attempt (cpu.json),
    and in its last epoch the final validation's per-image results (FOLDER/val_correct.pt, packed)."""
    spent = read_json(os.path.join(folder, 'cpu.json'), {'cpu_s': 0.0, 'wall_s': 0.0})
    log = read_metrics(folder) if os.path.exists(os.path.join(folder, METRICS)) else []
    correct = os.path.join(folder, 'val_correct.pt')
    if log and 'val_acc1' in log[-1] and os.path.exists(correct):
        log[-1]['val_correct'] = pack_correct(torch.load(correct, weights_only=True))
    return dict(run._asdict(), argv=['paper', 'train', *run.argv], state=state,
                epochs=[{k: e[k] for k in KEPT if k in e} for e in log],
                cpu_min=round(spent['cpu_s'] / 60, 3), wall_min=round(spent['wall_s'] / 60, 3),
                machine=machine(threads), finished=time.strftime('%Y-%m-%d %H:%M:%S'))


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
    """Train each run (LabRun) without a record in args.results, args.jobs at a time (cores/jobs threads each),
    as `python -m paper train ARGV --output-dir FOLDER`, holding a lock on FOLDER: a run another command is
    training is left to it and waited for at the end. Each finished run appends its record; an interrupted one
    resumes when rerun. Stopped (SIGTERM, Ctrl-C, a failed run), it stops the running train.py (they save) and
    keeps their CPU time. With args.no_train nothing is trained. Returns {run key: record} of the runs that
    have one."""
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
    # SIGTERM unwinds through the finally below
    stop = signal.signal(signal.SIGTERM, lambda *_: sys.exit(143))
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
                # only other commands' runs are left: wait for the first to end, then take it up again
                if waiting:
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
            append_record(args.results,
                          make_record(run, folder, run_state(folder, run.recipe['epochs']), threads))
            os.close(lock)
            bar.update()
    # the runs still going are stopped (train.py saves on SIGTERM; a rerun resumes them), their CPU kept
    finally:
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
              f'about {cpu / 60 / (threads * args.jobs):.1f} min of wall time on {threads * args.jobs} cores '
              'of their own')
    records = read_records(args.results)
    return {r.key(): records[r.key()] for r in runs if r.key() in records}


def launch(run, folder, lock, threads, env):
    """Start `python -m paper train ARGV --output-dir FOLDER` from the repository root (output appended to
    FOLDER/train.log), handing it the run's lock: (the process, its open log)."""
    log = open(os.path.join(folder, 'train.log'), 'a')
    argv = [sys.executable, '-m', 'paper', 'train', *run.argv, '--output-dir', folder, '--threads',
            str(threads)]
    log.write('$ ' + ' '.join(argv) + '\n')
    log.flush()
    return subprocess.Popen(argv, stdout=log, stderr=subprocess.STDOUT, cwd=ROOT, env=env,
                            pass_fds=(lock,)), log


def check_ended(proc, run, folder):
    """A train.py that stopped on a non-finite loss leaves FOLDER/diverged (a result, not retried); any other
    failure, or an exit before the last epoch, stops the lab with the end of its log."""
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
    write_json(os.path.join(folder, 'cpu.json'),
               {'cpu_s': spent['cpu_s'] + cpu_s, 'wall_s': spent['wall_s'] + wall_s})


def children_cpu_s():
    """User + system CPU seconds of every finished child process so far (the train.py runs)."""
    usage = resource.getrusage(resource.RUSAGE_CHILDREN)
    return usage.ru_utime + usage.ru_stime


def wait_any(running):
    """(the first of the running {key: (process, ...)} to finish, its CPU seconds): the children's CPU time
    grows by exactly the process that poll() reaps."""
    while True:
        for key, (proc, *_) in running.items():
            before = children_cpu_s()
            if proc.poll() is not None:
                return key, children_cpu_s() - before
        time.sleep(0.5)


def pack_correct(correct):
    """Per-image right (1) or wrong (0), in a fixed image order, as base64 text, 8 images to a byte, the first
    in the lowest bit: 10,000 images in 1,668 characters. unpack_correct reads it back."""
    bits = F.pad(correct.to(torch.uint8), (0, -len(correct) % 8)).view(-1, 8)  # (bytes, 8)
    return base64.b64encode(bytes((bits << torch.arange(8,
                                                        dtype=torch.uint8)).sum(1,
                                                                                dtype=torch.uint8).tolist())
                            ).decode()


def unpack_correct(text, images):
    """pack_correct's text back to a bool tensor of `images` entries."""
    data = torch.frombuffer(bytearray(base64.b64decode(text)), dtype=torch.uint8)
    return ((data[:, None] >> torch.arange(8, dtype=torch.uint8)) & 1).flatten()[:images].bool()


# ---------------------------------------------------------------------------------------------------
# python -m paper train NAME [train.py flags]: one paper experiment (or released model) through train.py's
# loop

def train_args(argv):
    """train.py's arguments for `python -m paper train NAME [flags]`: train.py's parser with NAME and the
    mosaics' flags added (fashion_recall registered in train.DATASETS first, so --dataset offers it), and
    NAME's experiment turned into --model and --model-kwargs, under which the flags given win (each said)."""
    mosaics.register()
    parser = train.get_args_parser()
    parser.prog = 'python -m paper train'
    parser.add_argument('name', metavar='NAME',
                        help='an experiment of the paper (python -m paper experiments) or a '
                        f'released model: {", ".join(models.MODELS)}')
    mosaics.add_flags(parser)
    args = parser.parse_args(argv)
    e = EXPERIMENTS.get(args.name)
    if e is None and args.name not in models.MODELS:
        train.fail(f'unknown experiment or model {args.name}; choose an experiment '
                   f'({", ".join(EXPERIMENTS)}) or a model ({", ".join(models.MODELS)})')
    base = e.overrides if e else {}
    given = train.model_kwargs(args)  # --model-kwargs and the attention flags (--layout, ...) given
    won = [f'{k}={v!r} (its {base[k]!r})' for k, v in given.items() if base.get(k, v) != v]
    if won:
        train.print0(f'the flags given win over experiment {args.name}: {", ".join(won)}')
    model = e.model if e else args.name
    if args.model and args.model != model:
        train.print0(f'--model {args.model} wins over {"experiment " * bool(e)}{args.name}\'s {model}')
    args.model = args.model or model
    # the experiment's overrides first: train.py's later --model-kwargs and the named flags win over them
    args.model_kwargs = [f'{k}={v!r}' for k, v in base.items()] + (args.model_kwargs or []) or None
    if args.dataset == mosaics.NAME and args.img_size is None:
        args.img_size = 64  # the mosaics' own size (train.py gives a dataset it does not know 32)
    if e:
        train.print0(f'experiment: {args.name} ({e.table}, reported '
                     f'{e.reported}{", our construction" * e.ours}): {e.what}')
    return args


def cmd_train(argv):
    """python -m paper train NAME [train.py flags]: train.main on train_args; under torchrun, each process."""
    train.main(train_args(argv))
    if torch.distributed.is_initialized():
        torch.distributed.destroy_process_group()

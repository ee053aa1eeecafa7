"""train.py, run as a user runs it: in a subprocess (one process, or two under torchrun with gloo), and
in process.
"""
import argparse
import contextlib
import gzip
import hashlib
import io
import json
import math
import os
import re
import shlex
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import time
import types

import numpy as np
import pytest
import torch
import torch.nn as nn
import torch.nn.functional as F
from PIL import Image, ImageEnhance, ImageOps
from torchvision import datasets

import checkpoints
from checkpoints import read_metrics
import data
import models
import train
from test_models import SMALL_SIZES, TINY, bicubic, perturb

# ===================================================================================================
# train.py, run as a user runs it: in a subprocess (one process, or two under torchrun with gloo), on
# the smallest variant at the smallest size; checks what it leaves behind and what it prints

TRAIN = os.path.join(os.path.dirname(os.path.abspath(__file__)), 'train.py')
# the smallest variant at the smallest size it takes; the reference attention needs no compilation; one thread
# per process, so that a busy machine slows the tests down rather than stalling them
TINY_ARGS = ['--model', 'inline_deit_t', '--fast', 'none', '--img-size', '32',
        '--batch-size', '8', '--workers', '0', '--threads', '1']
SYNTHETIC_ARGS = TINY_ARGS + ['--synthetic-train', '48', '--synthetic-val', '21', '--epochs', '2']


def command(args, nproc=1):
    launcher = [sys.executable, '-m', 'torch.distributed.run', '--standalone', f'--nproc_per_node={nproc}']
    return (launcher if nproc > 1 else [sys.executable]) + [TRAIN, *args]


def run_train(args, nproc=1, ok=True, timeout=600, cwd=None):
    result = subprocess.run(command(args, nproc), capture_output=True, text=True, timeout=timeout, cwd=cwd)
    if ok and result.returncode != 0:
        raise AssertionError(f'train.py failed ({result.returncode}):\n{result.stdout[-3000:]}\n'
                             f'{result.stderr[-3000:]}')
    return result


def printed(stdout, prefix):
    """The JSON object train.py printed after `prefix` (e.g. 'eval model: ')."""
    return json.loads(next(line for line in stdout.splitlines() if line.startswith(prefix))[len(prefix):])


def load_checkpoint_file(path):
    return torch.load(path, map_location='cpu', weights_only=True)


def test_imports_go_one_way():
    """In a fresh interpreter: the backbones import neither the data module (fail and print0 live in
    checkpoints.py) nor train.py, and train.py imports no benchmark."""
    code = ('import sys, models; print(sorted({"data", "train"} & set(sys.modules))); '
            'import train; print(sorted({"bench"} & set(sys.modules)))')
    result = subprocess.run([sys.executable, '-c', code], capture_output=True, text=True,
                            check=True, cwd=os.path.dirname(TRAIN))
    assert result.stdout.split('\n')[:2] == ['[]', '[]'], result.stdout


def test_docstrings_name_only_sections_the_readme_has():
    """Every README section the code names as (README, "..."), in docstrings and comments, wrapped
    lines joined, is a heading of the README."""
    root = os.path.dirname(TRAIN)
    with open(os.path.join(root, 'README.md')) as f:
        headings = {line.lstrip('#').strip() for line in f if line.startswith('#')}
    named = []
    for folder in (root, os.path.join(root, 'paper')):
        for file in sorted(f for f in os.listdir(folder) if f.endswith('.py')):
            with open(os.path.join(folder, file)) as f:
                text = re.sub(r'\s*\n\s*(#\s*)?', ' ', f.read())  # wrapped lines joined
            named += [(file, name) for name in re.findall(r'README, "([A-Z][^"]*)"', text)]
    assert named and [(f, n) for f, n in named if n not in headings] == []


@pytest.fixture(scope='module')
def two_process_run(tmp_path_factory):
    """Two processes under torchrun, two epochs of the synthetic task; shared by the tests below."""
    output_dir = str(tmp_path_factory.mktemp('run'))
    result = run_train(SYNTHETIC_ARGS + ['--output-dir', output_dir], nproc=2)
    return output_dir, result


def test_two_processes_train_and_write_checkpoints(two_process_run):
    output_dir, result = two_process_run
    assert 'schedule: 2 epochs' in result.stdout and 'data: synthetic' in result.stdout
    log = read_metrics(output_dir)
    assert [e['epoch'] for e in log] == [1, 2]
    assert all(e['val_images'] == 21 for e in log)  # every image once: 11 + 10, no padding
    assert not any('val_correct' in e for e in log)  # per-image results: a file of their own, each image once
    # the last validation's
    correct = torch.load(os.path.join(output_dir, 'val_correct.pt'), weights_only=True)
    assert correct.dtype == torch.bool and correct.shape == (21,)
    assert correct.sum().item() == round(log[-1]['val_acc1'] * 21 / 100)
    ckpt = load_checkpoint_file(os.path.join(output_dir, 'checkpoint.pt'))
    assert ckpt['epoch'] == 2 and ckpt['step'] == 0 and len(ckpt['rng']) == 2
    assert ckpt['args']['model'] == 'inline_deit_t' and ckpt['log'] == log
    assert {'model', 'optimizer', 'scheduler', 'scaler', 'model_ema'} <= ckpt.keys()
    best = load_checkpoint_file(os.path.join(output_dir, 'best.pt'))
    assert best['best_acc1'] == max(e['val_acc1'] for e in log)
    assert not [f for f in os.listdir(output_dir) if f.endswith('.tmp')]


def test_eval_reproduces_the_logged_accuracy(two_process_run):
    output_dir, _ = two_process_run
    result = run_train(SYNTHETIC_ARGS + ['--eval', '--checkpoint', os.path.join(output_dir, 'checkpoint.pt')],
                       nproc=2)
    evaluated, logged = printed(result.stdout, 'eval model: '), read_metrics(output_dir)[-1]
    assert evaluated['images'] == 21
    assert evaluated['acc1'] == logged['val_acc1'] and evaluated['acc5'] == logged['val_acc5']
    correct = torch.load(os.path.join(output_dir, 'val_correct.pt'), weights_only=True)
    assert evaluated['correct_sha256'] == hashlib.sha256(correct.numpy().tobytes()).hexdigest()[:16]
    assert evaluated['loss'] == pytest.approx(logged['val_loss'], rel=1e-6)


def test_evaluate_keeps_each_images_result_at_its_place_in_the_validation_set(tmp_path):
    """train.evaluate's per-image results sit at each image's index in the validation set whatever slice a
    rank holds (here rank 1 of 2: images 1, 3, 5, ...; the other rank's places stay False until all_reduce
    adds them) and count the top-1 it reports; save_correct writes them as they are, a bool tensor, to
    OUTPUT_DIR/val_correct.pt (rank 0 only)."""
    torch.manual_seed(0)
    x, y = torch.randn(11, 4), torch.randint(0, 3, (11,))
    model = nn.Linear(4, 3)
    run = types.SimpleNamespace(device=torch.device('cpu'), world=1,
                                autocast=lambda training: contextlib.nullcontext())
    data = torch.utils.data.TensorDataset(x, y)
    result = train.evaluate(run, model, torch.utils.data.DataLoader(
        torch.utils.data.Subset(data, range(1, 11, 2)), batch_size=2))
    right = model(x).argmax(1) == y
    expected = torch.zeros(11, dtype=torch.bool)
    expected[1::2] = right[1::2]
    assert torch.equal(result['correct'], expected) and result['images'] == 5
    assert result['acc1'] == pytest.approx(100 * right[1::2].double().mean().item())
    for rank in (1, 0):
        run.rank, run.args = rank, types.SimpleNamespace(output_dir=str(tmp_path))
        train.save_correct(run, 'val_correct', result['correct'])
        assert os.listdir(tmp_path) == (['val_correct.pt'] if rank == 0 else [])  # no .tmp left
    assert torch.equal(torch.load(tmp_path / 'val_correct.pt', weights_only=True), expected)


def test_evaluate_on_a_rank_with_no_images(monkeypatch):
    """Three ranks, two images: rank 2's slice is empty; its evaluate adds zeros, and all_reduce (here rank
    0's and rank 1's sums, added by a stand-in) gives every image's result."""
    torch.manual_seed(0)
    x, y = torch.randn(2, 4), torch.tensor([0, 1])
    model, data = nn.Linear(4, 3), torch.utils.data.TensorDataset(x, y)
    runs = [types.SimpleNamespace(device=torch.device('cpu'), world=3, rank=r, args=types.SimpleNamespace(
        batch_size=4, workers=0), autocast=lambda training: contextlib.nullcontext()) for r in range(3)]
    monkeypatch.setattr(train.dist, 'all_reduce', lambda t: None)
    parts = [train.evaluate(runs[r], model, train.val_loader(runs[r], data)) for r in (0, 1)]
    others = torch.tensor([float(sum(p['images'] * p['loss'] for p in parts)),
                           float(sum(round(p['acc1'] * p['images'] / 100) for p in parts)), 0.0, 2.0])
    correct = parts[0]['correct'] | parts[1]['correct']

    def add_others(t):  # what the other two ranks contribute
        t += others.to(t.dtype) if t.dtype == torch.float64 else correct.to(t.dtype)
    monkeypatch.setattr(train.dist, 'all_reduce', add_others)
    result = train.evaluate(runs[2], model, train.val_loader(runs[2], data))
    assert result['images'] == 2
    assert torch.equal(result['correct'], model(x).argmax(1) == y)


def test_non_finite_loss_stops_and_keeps_the_last_checkpoint(two_process_run, tmp_path):
    torch.manual_seed(0)
    ckpt = load_checkpoint_file(os.path.join(two_process_run[0], 'checkpoint.pt'))
    name = next(iter(ckpt['model']))
    ckpt['model'][name] = torch.full_like(ckpt['model'][name], float('nan'))
    path = str(tmp_path / 'checkpoint.pt')
    torch.save(ckpt, path)
    digest = hashlib.sha256(open(path, 'rb').read()).hexdigest()
    result = run_train(TINY_ARGS + ['--synthetic-train', '48', '--synthetic-val', '21', '--epochs', '3',
                           '--output-dir', str(tmp_path)], ok=False)
    assert result.returncode != 0 and 'the loss is not finite' in result.stderr
    assert hashlib.sha256(open(path, 'rb').read()).hexdigest() == digest


@pytest.mark.parametrize('mode', ['--eval', '--resume'])
def test_checkpoint_of_another_model_is_refused(two_process_run, mode, tmp_path, capsys):
    """--eval's case runs under torchrun, where the error must print once, not once per process;
    --resume's in this process (main_in_process)."""
    path = os.path.join(two_process_run[0], 'checkpoint.pt')
    args = SYNTHETIC_ARGS + ['--model', 'inline_pvt_t', '--output-dir', str(tmp_path)]
    if mode == '--eval':
        result = run_train(args + [mode, '--checkpoint', path], ok=False, nproc=2)
        code, stderr = result.returncode, result.stderr
    else:
        code, _, stderr = main_in_process(args + [mode, path], capsys)
    message = 'is a checkpoint of inline_deit_t, not of --model inline_pvt_t'
    assert code != 0 and stderr.count(message) == 1, stderr[-2000:]


# the README's two-node launch; here both nodes are this machine, one process each
TWO_NODES = ('torchrun --nnodes=2 --nproc_per_node={nproc} --rdzv-id=inline --rdzv-backend=c10d '
             '--rdzv-endpoint={host}')


def test_two_nodes_end_with_the_weights_of_one_node_with_two_processes(two_process_run, tmp_path):
    """The README's command for two nodes, on 127.0.0.1: two torchrun launchers of one process each train the
    same weights as the two processes of one node."""
    with open(os.path.join(os.path.dirname(TRAIN), 'README.md')) as f:
        assert TWO_NODES.format(nproc=8, host='HOST:29500') in f.read()
    with socket.socket() as s:  # a free port for the rendezvous
        s.bind(('127.0.0.1', 0))
        port = s.getsockname()[1]
    launcher = TWO_NODES.format(nproc=1, host=f'127.0.0.1:{port}').split()[1:]
    output_dir = str(tmp_path)
    nodes = [subprocess.Popen([sys.executable, '-m', 'torch.distributed.run', *launcher, TRAIN,
                               *SYNTHETIC_ARGS, '--output-dir', output_dir],
                              stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
             for _ in range(2)]
    for node in nodes:
        output, _ = node.communicate(timeout=600)
        assert node.returncode == 0, output[-3000:]
    one_node, two_nodes = (load_checkpoint_file(os.path.join(d, 'checkpoint.pt'))
                           for d in (two_process_run[0], output_dir))
    assert two_nodes['epoch'] == 2 and one_node['model'].keys() == two_nodes['model'].keys()
    assert all(torch.equal(one_node['model'][k], two_nodes['model'][k]) for k in one_node['model'])


@pytest.mark.parametrize('local_rank', [0, 1])
def test_more_processes_than_gpus_on_a_node_is_refused(local_rank, monkeypatch, capsys):
    """Two processes on a node with one GPU (faked): stop before any process touches a device; the node's
    first process names both numbers and the flag."""
    monkeypatch.setattr(torch.cuda, 'is_available', lambda: True)
    monkeypatch.setattr(torch.cuda, 'device_count', lambda: 1)
    for name in ('set_device', 'init', 'current_device'):
        monkeypatch.setattr(torch.cuda, name, lambda *a: pytest.fail('a device was touched'))
    monkeypatch.setattr(train.dist, 'init_process_group',
                        lambda *a, **k: pytest.fail('a process group started'))
    for key, value in dict(RANK=2 + local_rank, WORLD_SIZE=4, LOCAL_RANK=local_rank,
                           LOCAL_WORLD_SIZE=2).items():
        monkeypatch.setenv(key, str(value))
    with pytest.raises(SystemExit):
        train.setup(train.get_args_parser().parse_args(TINY_ARGS))
    error = capsys.readouterr().err
    if local_rank == 0:
        assert 'started 2 processes on this node, which has 1 GPU' in error and '--nproc-per-node=1' in error
    else:
        assert error == ''


# ------------------------------------------------------------------------------------- nothing is lost
# Mixup, CutMix, drop path and EMA are on, so any random stream or state not restored changes the weights;
# gradient accumulation too, so a mid-epoch resume must skip whole accumulation groups.
RESUMABLE = TINY_ARGS + ['--synthetic-train', '160', '--synthetic-val', '16', '--epochs', '3',
                    '--mixup', '0.8', '--cutmix', '1.0', '--drop-path', '0.1', '--ema-decay', '0.9',
                    '--accum-steps', '2']


def final_weights(output_dir):
    ckpt = load_checkpoint_file(os.path.join(output_dir, 'checkpoint.pt'))
    assert ckpt['epoch'] == 3
    return {**ckpt['model'], **{f'ema.{k}': v for k, v in ckpt['model_ema'].items()}}


def interrupt(args, output_dir, sig, nproc=2):
    """Start a run (torchrun with two processes); once epoch 1 is saved, send `sig` to torchrun
    (SIGTERM: it forwards it to the workers), to torchrun and both workers (SIGKILL: nothing gets to
    clean up), or to the whole process group (SIGINT, as Ctrl-C in a terminal sends it: torchrun,
    the workers and their data-loading processes)."""
    # its own process group, as a shell's job
    process = subprocess.Popen(command(args, nproc), stdout=subprocess.PIPE,
                               stderr=subprocess.STDOUT, text=True, start_new_session=True)
    deadline = time.time() + 300
    while not os.path.exists(os.path.join(output_dir, 'metrics.jsonl')):
        assert process.poll() is None and time.time() < deadline, 'the run ended before epoch 1 was saved'
        time.sleep(0.05)
    time.sleep(0.3)  # into epoch 2
    assert process.poll() is None, 'the run ended before it could be interrupted'
    if sig == signal.SIGINT:
        os.killpg(process.pid, sig)
    else:
        with open(f'/proc/{process.pid}/task/{process.pid}/children') as f:
            workers = [int(pid) for pid in f.read().split()]
        for pid in [process.pid] + (workers if sig == signal.SIGKILL else []):
            os.kill(pid, sig)
    output, _ = process.communicate(timeout=120)
    assert len(read_metrics(output_dir)) < 3, 'the interruption came too late to test anything'
    return output, process.returncode


@pytest.fixture(scope='module')
def uninterrupted(tmp_path_factory):
    output_dir = str(tmp_path_factory.mktemp('uninterrupted'))
    run_train(RESUMABLE + ['--output-dir', output_dir], nproc=2)
    return output_dir


@pytest.mark.parametrize('sig', [signal.SIGKILL, signal.SIGTERM, signal.SIGINT],
                         ids=['kill-9', 'sigterm', 'ctrl-c'])
def test_interrupted_and_resumed_equals_uninterrupted(uninterrupted, sig, tmp_path):
    """Ctrl-C runs with a data-loading process (--workers 1), which the terminal's SIGINT reaches
    too; on the synthetic task the loader's processes change no number."""
    reference, interrupted = uninterrupted, str(tmp_path / 'interrupted')
    args = RESUMABLE + ['--output-dir', interrupted] + ['--workers', '1'] * (sig == signal.SIGINT)
    output, _ = interrupt(args, interrupted, sig)
    if sig != signal.SIGKILL:  # saved where it stopped, mid-epoch; no worker's traceback
        assert f'{sig.name}: saved' in output and 'KeyboardInterrupt' not in output, output[-3000:]
        assert load_checkpoint_file(os.path.join(interrupted, 'checkpoint.pt'))['step'] > 0
    result = run_train(args, nproc=2)  # the same command, rerun
    assert 'resumed from' in result.stdout
    expected, got = final_weights(reference), final_weights(interrupted)
    assert expected.keys() == got.keys()
    assert all(torch.equal(expected[k], got[k]) for k in expected), 'resumed weights differ'
    val = lambda log: [{k: v for k, v in e.items() if 'val_' in k} for e in log]  # noqa: E731
    assert val(read_metrics(interrupted)) == val(read_metrics(reference))
    correct = [torch.load(os.path.join(d, 'val_correct.pt'), weights_only=True)
               for d in (interrupted, reference)]
    assert torch.equal(*correct)
    assert sorted(os.listdir(interrupted)) == ['best.pt', 'checkpoint.pt', 'ema_val_correct.pt',
                                               'metrics.jsonl', 'val_correct.pt']  # no .tmp


def test_a_save_that_fails_halfway_leaves_the_last_checkpoint_readable(tmp_path, monkeypatch):
    """checkpoint.pt is written to a temporary file renamed over it: a save that dies after half its
    bytes (a full disk) leaves the last good checkpoint whole and readable."""
    run = resolved(SYNTHETIC_ARGS + ['--output-dir', str(tmp_path)])
    torch.manual_seed(0)
    raw = models.create_model('inline_deit_t', img_size=32, num_classes=10)
    t, _, _ = train.prepare_training(run, raw, data.SyntheticShapes(48, 32, 0, True))
    checkpoints.save_checkpoint(run, t)
    path = tmp_path / 'checkpoint.pt'
    good = path.read_bytes()
    save = torch.save

    def save_half(obj, f):  # writes half of what torch.save would, then fails as a full disk does
        whole = io.BytesIO()
        save(obj, whole)
        half = whole.getvalue()[:len(whole.getvalue()) // 2]
        named = isinstance(f, (str, os.PathLike))  # a path, or a file object (save_checkpoint's)
        with open(f, 'wb') if named else contextlib.nullcontext(f) as out:
            out.write(half)
        raise OSError(28, 'No space left on device')
    monkeypatch.setattr(torch, 'save', save_half)
    t.epoch = 1
    with pytest.raises(OSError, match='No space left'):
        checkpoints.save_checkpoint(run, t)
    assert path.read_bytes() == good and load_checkpoint_file(path)['epoch'] == 0


def test_ctrl_c_saves_at_the_step_and_says_how_to_continue(tmp_path):
    """python train.py in a terminal, Ctrl-C mid-epoch: the step ends, the checkpoint is saved
    there, the command to continue is printed, and the run exits with no traceback and status 130
    (128 + SIGINT, as a shell reports it), which no script reads as a finished run."""
    output_dir = str(tmp_path / 'a run')  # a space, which the printed --resume must quote
    output, code = interrupt(RESUMABLE + ['--output-dir', output_dir, '--workers', '1'], output_dir,
                             signal.SIGINT, nproc=1)
    saved = load_checkpoint_file(os.path.join(output_dir, 'checkpoint.pt'))
    assert code == 130 and 'Traceback' not in output, output[-3000:]
    assert f'SIGINT: saved {output_dir}/checkpoint.pt at epoch 2, step {saved["step"]}; ' in output
    assert saved['epoch'] == 1 and saved['step'] > 0
    assert f"rerun the same command (or give --resume '{output_dir}/checkpoint.pt')" in output


def run_main(argv):
    """train.py's main on argv in this process, as `python train.py ARGV` runs it: its exit status (0 at
    the end, else what train.py exits with); the thread count and the signal handlers it sets are undone
    after."""
    threads = torch.get_num_threads()
    handlers = {sig: signal.getsignal(sig) for sig in (signal.SIGTERM, signal.SIGINT)}
    try:
        train.main(train.get_args_parser().parse_args(argv))
        return 0
    except SystemExit as e:
        return e.code
    finally:
        torch.set_num_threads(threads)
        for sig, handler in handlers.items():
            signal.signal(sig, handler)


def main_in_process(argv, capsys):
    """run_main(argv): (exit status, stdout, stderr)."""
    code = run_main(argv)
    out = capsys.readouterr()
    return code, out.out, out.err


def fit_in_process(argv, stop_at=None, signum=signal.SIGTERM, monkeypatch=None):
    """run_main(argv), rerun as a rerun of the command is: resumed from OUTPUT_DIR/checkpoint.pt where
    there is one. stop_at: send this process `signum` while the loop reads its stop_at-th batch (as a
    terminal's Ctrl-C or a scheduler's SIGTERM would); the step ends, then the save."""
    batches = []

    def leave_out_unreadable(*args):  # train.py's, which every batch goes through
        batches.append(1)
        if len(batches) == stop_at:
            os.kill(os.getpid(), signum)
        return data.leave_out_unreadable(*args)
    monkeypatch.setattr(train, 'leave_out_unreadable', leave_out_unreadable)
    return run_main(argv)


def test_a_run_stopped_twice_in_one_epoch_resumes_at_the_right_step(tmp_path, monkeypatch, capsys):
    """SIGTERM after 3 of an epoch's 8 steps, then, resumed, SIGINT after 2 more: each saves at the step
    it ended (3, then 3 + 2 = 5), exits 143 or 130 (128 + the signal, as a shell reports it), and the
    run then ends with the weights of a run never stopped."""
    args = TINY_ARGS + ['--synthetic-train', '64', '--synthetic-val', '8', '--epochs', '1']
    stopped, whole = str(tmp_path / 'stopped'), str(tmp_path / 'whole')
    assert fit_in_process(args + ['--output-dir', whole], monkeypatch=monkeypatch) == 0
    steps = []
    for stop_at, signum in ((3, signal.SIGTERM), (2, signal.SIGINT)):
        code = fit_in_process(args + ['--output-dir', stopped], stop_at, signum, monkeypatch)
        steps.append(load_checkpoint_file(os.path.join(stopped, 'checkpoint.pt'))['step'])
        assert code == 128 + signum and f'{signum.name}: saved' in capsys.readouterr().out
    assert steps == [3, 5]
    assert fit_in_process(args + ['--output-dir', stopped], monkeypatch=monkeypatch) == 0
    expected, got = (load_checkpoint_file(os.path.join(d, 'checkpoint.pt')) for d in (whole, stopped))
    assert got['epoch'] == 1 and expected['model'].keys() == got['model'].keys()
    assert all(torch.equal(expected['model'][k], got['model'][k]) for k in expected['model'])


# ------------------------------------------------------------------------------------------ real images
def write_image_folder(root, counts, seed=0):
    """Two classes of 32 px PNGs told apart by colour: root/<split>/<class>/<i>.png."""
    g = torch.Generator().manual_seed(seed)
    for split, count in counts.items():
        for label, colour in enumerate(('red', 'blue')):
            os.makedirs(os.path.join(root, split, colour), exist_ok=True)
            for i in range(count):
                img = torch.rand(32, 32, 3, generator=g) * 0.3
                img[..., 0 if label == 0 else 2] += 0.7
                Image.fromarray((img * 255).byte().numpy()).save(
                    os.path.join(root, split, colour, f'{i}.png'))


def test_image_folder_trains_and_evaluates(tmp_path):
    """At a non-square size, --img-size H W: trained (crops of 32x48) and evaluated (a 36x54 resize, the
    centre 32x48)."""
    torch.manual_seed(0)
    root, output_dir = str(tmp_path / 'data'), str(tmp_path / 'run')
    write_image_folder(root, {'train': 8, 'val': 3})
    # the released recipe (RandAugment, Mixup/CutMix, random erasing, ...) at a tiny scale: 2 steps of
    # 2 x 4 images
    args = TINY_ARGS + ['--data-path', root, '--batch-size', '4', '--accum-steps', '2', '--epochs', '2',
                   '--warmup-epochs', '1', '--workers', '1', '--output-dir', output_dir,
                   '--recipe', 'released', '--img-size', '32', '48']
    result = run_train(args)
    assert 'released ImageNet-1K recipe for inline_deit_t (given)' in result.stdout
    assert 'inline_deit_t, 6.2M parameters, 32x48 px' in result.stdout
    assert load_checkpoint_file(os.path.join(output_dir, 'checkpoint.pt'))['arch']['img_size'] == (32, 48)
    log = read_metrics(output_dir)
    assert len(log) == 2 and log[-1]['val_images'] == 6
    result = run_train(args + ['--eval', '--checkpoint', os.path.join(output_dir, 'checkpoint.pt')])
    assert printed(result.stdout, 'eval model: ')['acc1'] == log[-1]['val_acc1']


def test_a_small_image_folder_gets_the_small_recipe_and_learns(tmp_path, capsys):
    """The README's command for one's own folder, no recipe flag (train.main in this process): a folder far
    smaller than ImageNet gets the small-data recipe (no accumulation to the authors' total batch, a warm-up
    that fits), says why, warns of an epoch of few steps, and learns the two colours."""
    torch.manual_seed(0)
    root, output_dir = str(tmp_path / 'data'), str(tmp_path / 'run')
    write_image_folder(root, {'train': 24, 'val': 8})
    code, stdout, _ = main_in_process(TINY_ARGS + ['--data-path', root, '--epochs', '3', '--output-dir',
                                                   output_dir], capsys)
    assert code == 0
    assert ("small-data recipe for imagefolder (48 training images, 0 steps an epoch at the authors' total "
            "batch of 4,096: 100 or more take the released recipe" in stdout), stdout
    assert 'x 6 steps of 8 images (8 per process x 1 processes x 1 accumulation steps)' in stdout
    assert 'warning: 6 optimizer step(s) an epoch' in stdout
    log = read_metrics(output_dir)
    assert len(log) == 3 and log[-1]['val_images'] == 16 and log[-1]['val_acc1'] > 50


def test_an_unreadable_image_stops_at_a_saved_step_and_skip_bad_images_goes_on(tmp_path, capsys):
    """One broken file among 8 x 2 training images: the run stops at the step that met it, saved
    there, naming the file with its folder; rerun with --skip-bad-images (in this process) it resumes
    and leaves the file out, listed every epoch; a broken validation image is left out of the counts
    and listed."""
    root, output_dir = str(tmp_path / 'data'), str(tmp_path / 'run')
    write_image_folder(root, {'train': 8, 'val': 3})
    for split, folder in (('train', 'red'), ('val', 'blue')):
        with open(os.path.join(root, split, folder, 'broken.png'), 'wb') as f:
            f.write(b'\x89PNG not a png at all')
    args = TINY_ARGS + ['--data-path', root, '--batch-size', '2', '--epochs', '2', '--output-dir',
                        output_dir]
    result = run_train(args, ok=False)
    assert result.returncode == 1 and 'Traceback' not in result.stderr, result.stderr[-3000:]
    saved = load_checkpoint_file(os.path.join(output_dir, 'checkpoint.pt'))
    assert (f"1 unreadable image(s) under {root}: train/red/broken.png (cannot identify image "
            f"file), met at epoch 1, step {saved['step'] + 1}; saved") in result.stderr
    assert saved['epoch'] == 0 and 'rerun the same command with --skip-bad-images' in result.stderr
    code, stdout, _ = main_in_process(args + ['--skip-bad-images'], capsys)
    assert code == 0 and 'resumed from' in stdout
    for epoch in (1, 2):
        assert f'warning: epoch {epoch} left out 1 unreadable image(s) under {root}: ' \
               f'train/red/broken.png' in stdout
    assert stdout.count('val/blue/broken.png (cannot identify image file), left out of the '
                        'validation') == 2
    assert [e['val_images'] for e in read_metrics(output_dir)] == [6, 6]  # 7 files, 6 images


def test_skip_bad_images_goes_on_past_a_batch_of_one_unreadable_image(tmp_path, monkeypatch, capsys):
    """--batch-size 1: one step's batch is the unreadable image alone. --skip-bad-images takes nothing from
    that step and goes on to the end, the file listed."""
    root = str(tmp_path / 'data')
    write_image_folder(root, {'train': 3, 'val': 1})
    with open(os.path.join(root, 'train', 'red', 'broken.png'), 'wb') as f:
        f.write(b'\x89PNG not a png at all')
    args = TINY_ARGS + ['--data-path', root, '--batch-size', '1', '--epochs', '1', '--skip-bad-images',
                        '--output-dir', str(tmp_path / 'run')]
    assert fit_in_process(args, monkeypatch=monkeypatch) == 0
    assert f'warning: epoch 1 left out 1 unreadable image(s) under {root}: train/red/broken.png' \
        in capsys.readouterr().out
    assert [e['epoch'] for e in read_metrics(str(tmp_path / 'run'))] == [1]


def test_images_much_smaller_than_the_input_are_said_with_the_size_to_choose(tmp_path, capsys):
    """32 px images at the variant's own 224 px: a line says so and which --img-size fits them; at
    --img-size 32, none."""
    root = str(tmp_path / 'data')
    write_image_folder(root, {'train': 2, 'val': 1})
    for size, said in (([], True), (['--img-size', '32'], False)):
        data.load_data(resolved(['--model', 'inline_swin_t', '--data-path', root, *size]).args)
        out = capsys.readouterr().out
        assert 'validation images of about 32x32 px, resized to ' in out
        assert ('warning: the images are about 32x32 px, the model\'s input 224x224 px: upsampled 7x'
                in out) == said and ('here --img-size 32\n' in out) == said, out


# ----------------------------------------------------------- small datasets, read from their own files
def write_idx(path, array):
    """An IDX file as MNIST's are distributed: gzipped, 0 0 8 D, D big-endian sizes, uint8 data."""
    a = np.asarray(array, dtype=np.uint8)
    with gzip.open(path, 'wb') as f:
        f.write(bytes([0, 0, 8, a.ndim]) + b''.join(int(n).to_bytes(4, 'big') for n in a.shape) + a.tobytes())


def write_fashion_mnist(root, train=12, test=6, seed=0):
    """The four .gz files of Fashion-MNIST in one plain folder (as Debian's package installs them), tiny."""
    g = np.random.default_rng(seed)
    data = {}
    for prefix, n in (('train', train), ('t10k', test)):
        images, labels = g.integers(0, 256, (n, 28, 28)), np.arange(n) % 10
        write_idx(os.path.join(root, f'{prefix}-images-idx3-ubyte.gz'), images)
        write_idx(os.path.join(root, f'{prefix}-labels-idx1-ubyte.gz'), labels)
        data[prefix] = images, labels
    return data


def write_cifar(root, name, per_batch=4, seed=0):
    """CIFAR-10's or CIFAR-100's python batches, tiny: rows of 3072 bytes, channel-major, as distributed."""
    import pickle
    g = np.random.default_rng(seed)
    ten = name == 'cifar10'
    folder = os.path.join(root, 'cifar-10-batches-py' if ten else 'cifar-100-python')
    os.makedirs(folder)
    key = 'labels' if ten else 'fine_labels'
    files = [f'data_batch_{i}' for i in range(1, 6)] + ['test_batch'] if ten else ['train', 'test']
    written = {}
    for file in files:
        data, labels = g.integers(0, 256, (per_batch, 3072), dtype=np.uint8), \
            list(g.integers(0, 10, per_batch))
        with open(os.path.join(folder, file), 'wb') as f:
            pickle.dump({'data': data, key: labels}, f)
        written[file] = data, labels
    with open(os.path.join(folder, 'batches.meta' if ten else 'meta'), 'wb') as f:
        pickle.dump({'label_names' if ten else 'fine_label_names':
                     [f'c{i}' for i in range(10 if ten else 100)]}, f)
    return written


def test_fashion_mnist_reads_from_a_plain_folder_of_idx_files(tmp_path):
    written = write_fashion_mnist(str(tmp_path))
    images, labels, classes = data.read_small('fashion_mnist', str(tmp_path), train=True)
    assert images.shape == (12, 3, 28, 28) and all(torch.equal(images[:, c], torch.tensor(written['train'][0],
                                                                                        dtype=torch.uint8))
                                                   for c in range(3))
    assert labels.tolist() == written['train'][1].tolist() and classes == datasets.FashionMNIST.classes
    # torchvision's layout, ROOT/FashionMNIST/raw, uncompressed, reads the same
    raw = tmp_path / 'tv' / 'FashionMNIST' / 'raw'
    raw.mkdir(parents=True)
    for file in os.listdir(tmp_path):
        if file.endswith('.gz'):
            (raw / file[:-3]).write_bytes(gzip.decompress((tmp_path / file).read_bytes()))
    assert torch.equal(data.read_small('fashion_mnist', str(tmp_path / 'tv'), train=False)[0][:, 0],
                       torch.tensor(written['t10k'][0], dtype=torch.uint8))
    # grayscale read as 3 equal channels, at the asked size; a fixed subset of training images whatever the
    # seed
    args = train.get_args_parser().parse_args(['--dataset', 'fashion_mnist', '--data-path', str(tmp_path),
                                               '--img-size', '32', '--train-subset', '5'])
    args.model = 'inline_deit_t'
    train_set, val_set = data.load_data(args)
    x, y = val_set[1]
    pixels = x * torch.tensor(data.STD)[:, None, None] + torch.tensor(data.MEAN)[:, None, None]
    assert x.shape == (3, 32, 32) and y == 1 and torch.allclose(pixels[0], pixels[1], atol=1e-6)
    assert len(train_set) == 5 and train_set.classes == val_set.classes == datasets.FashionMNIST.classes
    args.seed = 7
    assert data.load_data(args)[0].indices == train_set.indices


@pytest.mark.parametrize('name', ['cifar10', 'cifar100'])
def test_cifar_reads_its_python_batches(tmp_path, name):
    written = write_cifar(str(tmp_path), name)
    images, labels, classes = data.read_small(name, str(tmp_path), train=True)
    files = [f'data_batch_{i}' for i in range(1, 6)] if name == 'cifar10' else ['train']
    expected = np.concatenate([written[f][0] for f in files]).reshape(-1, 3, 32, 32)  # channel-major rows
    assert torch.equal(images, torch.from_numpy(expected)) and images.shape == (4 * len(files), 3, 32, 32)
    assert labels.tolist() == sum((list(written[f][1]) for f in files), [])
    assert len(classes) == (10 if name == 'cifar10' else 100)
    test_images = data.read_small(name, str(tmp_path), train=False)[0]
    assert test_images.shape == (4, 3, 32, 32)


def test_a_missing_small_dataset_says_how_to_get_it(tmp_path, capsys):
    with pytest.raises(SystemExit):
        data.read_small('fashion_mnist', str(tmp_path), train=True)
    err = capsys.readouterr().err
    assert 'apt-get install dataset-fashion-mnist' in err and '--download' in err


def test_fashion_mnist_trains_with_the_small_image_recipe(tmp_path):
    """train.py on the tiny IDX files: its recipe printed, validation every --val-every epochs, the dataset
    stored in the checkpoint's arguments."""
    os.makedirs(tmp_path / 'fm')
    write_fashion_mnist(str(tmp_path / 'fm'), train=16, test=6)
    output_dir = str(tmp_path / 'run')
    result = run_train(TINY_ARGS + ['--dataset', 'fashion_mnist', '--data-path', str(tmp_path / 'fm'),
                                    '--epochs', '2',
                                    '--val-every', '2',
                                    '--output-dir', output_dir])
    assert 'small-data recipe for fashion_mnist (random crop padded by 4 px, flip' in result.stdout
    log = read_metrics(output_dir)  # validated every 2 epochs: not after the first
    assert 'val_acc1' not in log[0] and log[1]['val_images'] == 6
    args = load_checkpoint_file(os.path.join(output_dir, 'checkpoint.pt'))['args']
    assert args['dataset'] == 'fashion_mnist' and args['data_path'] == str(tmp_path / 'fm')


def test_throughput_prints_images_per_second():
    """--throughput takes the default precision from train.default_amp, and the model line says why."""
    result = run_train(TINY_ARGS + ['--throughput', '--batch-size', '2'])
    amp, why = re.search(r'amp (bf16|fp16|fp32) \((.+)\), device', result.stdout).groups()
    # (a probe's figure varies between runs)
    mask = lambda reason: re.sub(r'\d+\.\d+x', 'Nx', reason)  # noqa: E731
    assert mask(why) \
        == mask(train.default_amp(torch.device('cuda' if torch.cuda.is_available() else 'cpu'))[1])
    assert f'images/s (one process, batch 2, 32 px, {amp})' in result.stdout


# ------------------------------------------------------------------------------------------- bad input
def bad_data(root, case):
    """A data folder with one thing wrong."""
    if case == 'no-train':
        os.makedirs(os.path.join(root, 'val', 'a'))
    elif case == 'no-val':
        os.makedirs(os.path.join(root, 'train', 'a'))
    elif case == 'no-images':
        for split in ('train', 'val'):
            os.makedirs(os.path.join(root, split, 'a'))
    elif case == 'one-class':
        write_image_folder(root, {'train': 2, 'val': 1})
        for split in ('train', 'val'):
            shutil.rmtree(os.path.join(root, split, 'blue'))
    elif case == 'undecodable':
        write_image_folder(root, {'train': 2, 'val': 1})
        with open(os.path.join(root, 'train', 'red', 'broken.png'), 'wb') as f:
            f.write(b'not a png at all')
    elif case == 'other-classes':  # equal counts, one folder named differently
        write_image_folder(root, {'train': 2, 'val': 1})
        os.rename(os.path.join(root, 'val', 'blue'), os.path.join(root, 'val', 'green'))
    return ['--data-path', root, '--accum-steps', '1', '--epochs', '1', '--warmup-epochs', '0',
            '--batch-size', '5']


BAD = {  # case: (extra arguments or a data-folder case, what the error must say)
    'no-train': ('no-train', 'has no train/ folder'),
    'no-val': ('no-val', 'has no val/ folder'),
    'no-images': ('no-images', 'no images in'),
    'undecodable': ('undecodable', '1 unreadable image(s) under'),
    'other-classes': ('other-classes', 'must hold the same class folders: only in train/: blue; '
                                       'only in val/: green'),
    'no-data-path': (['--data-path', 'no/such/folder'],
                     '--data-path no/such/folder does not exist'),
    'output-dir-unwritable': (['--output-dir', '/dev/null/run'],
                              '--output-dir /dev/null/run cannot be created or written to'),
    'one-class': ('one-class', 'has 1 class(es) (red): a classifier needs at least two'),
    'recipe-released-without-folder': (['--recipe', 'released'],
                                       "--recipe released is the authors' ImageNet-1K"),
    'img-size': (['--img-size', '40'], 'divisible by 16'),
    'batch-size-zero': (['--batch-size', '0'], '--batch-size 0 is out of range'),
    'batch-size-too-big': (['--batch-size', '64'], 'exceeds the 48 training images: pass --batch-size 4 '
                                                   '(10 steps an epoch) or at most 48 (one step)'),
    'lr-negative': (['--lr=-1e-3'], '--lr -0.001 is out of range'),
    'lr-too-big': (['--lr', '3'], '--lr 3.0 is out of range'),
    'eval-without-checkpoint': (['--eval'], '--eval needs --checkpoint'),
    'missing-checkpoint': (['--eval', '--checkpoint', 'no/such/file.pt'], 'no checkpoint at no/such/file.pt'),
}


# launched as a user would (a bad folder, a bad flag); the others call train.main in this process, which
# reads the same arguments and files and stops the same way, without the ~5 s a launch spends importing
LAUNCHED = ('no-train', 'lr-negative')


@pytest.mark.parametrize('case', BAD)
def test_bad_input_gets_a_clear_error(case, tmp_path, capsys):
    torch.manual_seed(0)
    extra, message = BAD[case]
    if isinstance(extra, str):
        extra = bad_data(str(tmp_path / 'data'), extra)
    argv = SYNTHETIC_ARGS + ['--output-dir', str(tmp_path / 'run')] + extra
    if case in LAUNCHED:
        result = run_train(argv, ok=False)
        code, stdout, stderr = result.returncode, result.stdout, result.stderr
    else:
        code, stdout, stderr = main_in_process(argv, capsys)
    assert code != 0
    assert message in stderr, stderr[-2000:]
    if case == 'undecodable':  # named with its split and class folder, and how to go on
        assert 'train/red/broken.png (cannot identify image file)' in stderr
        assert '--skip-bad-images' in stderr
    if case == 'output-dir-unwritable':  # said before the data is read and the model built
        assert 'data:' not in stdout and 'model:' not in stdout


# ------------------------------------------------------------------------------ the recipe, in process
# The released recipe (the authors' cfgs/inline_<variant>.yaml), written out here apart from train.py's
# VARIANTS: batch per process, epochs, (warm-up epochs, warm-up lr), min lr, cool-down, weight decay, clip
# (None: off), drop path; and the peak lr per 512 images
RELEASED_SCHEDULES = {
    'inline_deit_t': (512, 300, (20, 5e-7), 5e-6, 0, 0.05, 5.0, 0.1, 5e-4),
    'inline_deit_s': (128, 300, (20, 5e-7), 5e-6, 0, 0.05, 5.0, 0.1, 5e-4),
    'inline_deit_b': (64, 300, (20, 5e-7), 5e-6, 0, 0.05, 5.0, 0.1, 5e-4),
    'inline_pvt_t': (128, 300, (5, 1e-6), 1e-5, 10, 0.05, None, 0.1, 5e-4),
    'inline_pvt_s': (128, 300, (5, 1e-6), 1e-5, 10, 0.05, None, 0.1, 5e-4),
    'inline_pvt_m': (128, 300, (5, 1e-6), 1e-5, 10, 0.05, 1.0, 0.3, 5e-4),
    'inline_pvt_l': (64, 300, (5, 1e-6), 1e-5, 10, 0.05, 1.0, 0.3, 5e-4),
    'inline_swin_t': (128, 300, (20, 5e-7), 5e-6, 0, 0.05, 5.0, 0.2, 5e-4),
    'inline_swin_s': (128, 300, (20, 5e-7), 5e-6, 0, 0.05, 5.0, 0.3, 5e-4),
    'inline_swin_b': (64, 300, (20, 5e-7), 5e-6, 0, 0.05, 5.0, 0.5, 5e-4),
    'inline_swin_b_384': (32, 30, (5, 2e-8), 2e-7, 0, 1e-8, 5.0, 0.5, 2e-5),
    'inline_cswin_t': (128, 300, (20, 1e-6), 1e-5, 10, 0.05, None, 0.2, 5e-4),
    'inline_cswin_s': (128, 300, (20, 1e-6), 1e-5, 10, 0.05, None, 0.4, 5e-4),
    'inline_cswin_b': (64, 300, (20, 1e-6), 1e-5, 10, 0.1, None, 0.5, 5e-4),
    'inline_cswin_b_384': (32, 20, (0, 5e-6), 5e-7, 10, 1e-8, None, 0.7, 5e-6),
}


def resolved(argv, world=1):
    """train.py's flags as setup() resolves them, in this process, with `world` processes; in an empty folder,
    so that no runs/ folder of an earlier run is resumed."""
    run = train.Run(train.get_args_parser().parse_args(argv), world=world)
    with tempfile.TemporaryDirectory() as empty, contextlib.chdir(empty):
        train.resolve(run)
    return run


def refused(argv, capsys):
    """What train.py says when it refuses argv (in this process)."""
    with pytest.raises(SystemExit):
        resolved(argv)
    return capsys.readouterr().err


def test_the_loop_smooths_labels_and_averages_weights_as_its_flags_say():
    """What fit() trains with, built from --label-smoothing and --ema-decay: the loss of one batch equals
    F.cross_entropy(..., label_smoothing=0.2), and one EMA update is ema = d * ema + (1 - d) * weights,
    d = 0.9."""
    run = resolved(SYNTHETIC_ARGS + ['--label-smoothing', '0.2', '--ema-decay', '0.9'])
    torch.manual_seed(0)
    raw = models.create_model('inline_deit_t', img_size=32, num_classes=10)
    t, _, _ = train.prepare_training(run, raw, data.SyntheticShapes(48, 32, 0, True))
    logits, y = torch.randn(8, 10), torch.randint(0, 10, (8,))
    torch.testing.assert_close(t.criterion(logits, y), F.cross_entropy(logits, y, label_smoothing=0.2))
    assert not torch.allclose(t.criterion(logits, y), F.cross_entropy(logits, y))
    t.ema.update_parameters(raw)  # the first update copies the weights
    before = [p.detach().clone() for p in t.ema.module.parameters()]
    with torch.no_grad():
        for p in raw.parameters():
            p.add_(1.0)
    t.ema.update_parameters(raw)
    for old, new, p in zip(before, t.ema.module.parameters(), raw.parameters()):
        torch.testing.assert_close(new, 0.9 * old + 0.1 * p, rtol=1e-6, atol=1e-6)


@pytest.mark.parametrize('name', list(RELEASED_SCHEDULES))
def test_recipe_is_the_released_table(name, monkeypatch):
    """ImageNet-1K's 1,281,167 training images take the released recipe by themselves; a folder of 1,437 the
    small-data one."""
    batch, epochs, (warmup, warmup_lr), min_lr, cooldown, wd, clip, drop_path, lr = RELEASED_SCHEDULES[name]
    monkeypatch.setattr(train, 'count_images', lambda folder: 1437)
    small = resolved(['--model', name, '--data-path', 'imagenet']).args
    assert (small.recipe, small.accum_steps, small.mixup, small.warmup_epochs) == ('small', 1, 0.0, 1)
    monkeypatch.setattr(train, 'count_images', lambda folder: 1_281_167)
    # 8 processes as the authors ran it; 2 accumulate to the same total batch
    for world, accum in ((8, 1), (2, 4)):
        run = resolved(['--model', name, '--data-path', 'imagenet'], world)
        a = run.args
        assert a.recipe == 'released'
        assert (a.batch_size, a.accum_steps, run.total_batch) == (batch, accum, batch * 8)
        assert (a.lr, a.epochs, a.warmup_epochs, a.warmup_lr, a.min_lr, a.cooldown_epochs) == (
            lr, epochs, warmup, warmup_lr, min_lr, cooldown)
        assert (a.weight_decay, a.clip_grad or None, a.drop_path) == (wd, clip, drop_path)
        # shared by every variant; the EMA is CSwin's, 0.9996 per step at a total batch of 4096
        assert (a.label_smoothing, a.mixup, a.cutmix, a.mixup_switch_prob, a.random_erase) \
            == (0.1, 0.8, 1.0, 0.5, 0.25)
        assert (a.randaug_n, a.randaug_m, a.randaug_mstd) == (2, 9, 0.5)
        assert a.ema_decay == (pytest.approx(0.9996 ** (batch * 8 / 4096)) if 'cswin' in name else 0)
        assert a.img_size == (384 if name.endswith('_384') else 288 if name == 'inline_deit_s' else
                              448 if name == 'inline_deit_b' else 224)


@pytest.mark.parametrize('name', ['inline_deit_t', 'inline_swin_b'])
def test_recipe_threshold_is_100_steps_at_the_authors_total_batch(name, monkeypatch):
    """An ImageFolder takes the released recipe from 100 optimizer steps an epoch at the authors'
    total batch, the table's per-process batch x their 8 processes (inline_deit_t: 512 x 8 = 4,096
    images a step, so 409,600 images), whatever this run's processes; one image fewer takes the
    small-data recipe."""
    threshold = 100 * RELEASED_SCHEDULES[name][0] * 8
    for images, recipe in ((threshold - 1, 'small'), (threshold, 'released')):
        monkeypatch.setattr(train, 'count_images', lambda folder: images)
        for world in (1, 8):
            run = resolved(['--model', name, '--data-path', 'imagenet'], world)
            assert run.args.recipe == recipe, (images, world)


@pytest.mark.parametrize('name', TINY)
def test_weight_decay_groups(name):
    """As released: no decay on 1-D parameters, DeiT's position embedding and class token, Swin's relative
    position bias tables; PVT's position embeddings are decayed."""
    model = models.create_model(name, **SMALL_SIZES[name])
    run = resolved(['--model', name, '--data-path', 'imagenet', '--recipe', 'released'])
    optimizer, _ = train.build_optimizer(model, run.args, run.total_batch, steps_per_epoch=1)
    names = {id(p): n for n, p in model.named_parameters()}
    got = {g['weight_decay']: {names[id(p)] for p in g['params']} for g in optimizer.param_groups}
    exempt = {'inline_deit_t': {'pos_embed', 'cls_token'}}.get(name, set())
    expected = {n for n, p in model.named_parameters()
                if p.ndim <= 1 or n in exempt or n.endswith('relative_position_bias_table')}
    assert got[0.0] == expected and got[0.05] == set(names.values()) - expected
    if name == 'inline_pvt_t':
        assert {f'pos_embed{i}' for i in range(1, 5)} <= got[0.05]


# The default precision's rule (train.default_amp) on faked machines: (device, AMX, AVX-512 BF16, the GPU's
# bf16, what the CPU's bf16 probe measures) -> (the precision, words its reason must hold). None: that query
# is absent (torch.cpu lacks the private function), or must not be made (a CPU run asks nothing of a GPU; only
# AVX-512 BF16 without AMX is probed).
AMP_MACHINES = {
    'cpu-amx': ('cpu', True, True, None, None, 'bf16', 'has AMX'),
    'cpu-avx512bf16-no-amx-bf16-faster': ('cpu', False, True, None, 2.9, 'bf16',
                                          'BF16 but no AMX; bf16 ran 2.9x'),
    'cpu-avx512bf16-no-amx-bf16-slower': ('cpu', False, True, None, 0.8, 'fp32',
                                          'BF16 but no AMX; bf16 ran 0.8x'),
    'cpu-avx512bf16-no-amx-within-margin': ('cpu', False, True, None, 1.2, 'fp32', 'bf16 ran 1.2x'),
    'cpu-avx2-only': ('cpu', False, False, None, None, 'fp32', 'no AMX or AVX-512 BF16'),
    'cpu-private-api-absent': ('cpu', None, None, None, None, 'fp32', 'no AMX or AVX-512 BF16'),
    'cuda-bf16': ('cuda', False, True, True, None, 'bf16', 'Fake GPU computes bf16'),
    'cuda-no-bf16-cpu-amx': ('cuda', True, True, False, None, 'fp16',
                             'Fake GPU has no bf16 (fp16, with the loss'),
}


def fake_machine(monkeypatch, amx, avx512_bf16, gpu_bf16, speedup):
    """torch's capability queries and the bf16 probe answer as the machine would. Counting emulation, as torch
    does by default, every GPU says it has bf16, as a GPU before Ampere really does."""
    for name, value in (('_is_amx_tile_supported', amx), ('_is_avx512_bf16_supported', avx512_bf16)):
        if value is None:
            monkeypatch.delattr(torch.cpu, name, raising=False)
        else:
            monkeypatch.setattr(torch.cpu, name, lambda value=value: value, raising=False)

    def never(*args, **kwargs):
        raise AssertionError('a query this machine must not make')
    monkeypatch.setattr(torch.cuda, 'is_bf16_supported', never if gpu_bf16 is None else
                        lambda including_emulation=True: including_emulation or gpu_bf16)
    monkeypatch.setattr(torch.cuda, 'get_device_name', never if gpu_bf16 is None else
                        lambda device=None: 'Fake GPU')
    monkeypatch.setattr(train, 'bf16_speedup', never if speedup is None else lambda: speedup)


@pytest.mark.parametrize('machine', AMP_MACHINES)
def test_default_precision_is_the_faster_one_on_the_machine(machine, monkeypatch):
    device, *capabilities, amp, reason = AMP_MACHINES[machine]
    fake_machine(monkeypatch, *capabilities)
    got, why = train.default_amp(torch.device(device))
    print(f'{machine}: amp {got} ({why})')
    assert got == amp and reason in why


@pytest.mark.parametrize('machine', ['cpu-amx', 'cpu-avx512bf16-no-amx-bf16-slower'])
def test_resolve_takes_the_default_precision_and_amp_overrides_it(machine, monkeypatch):
    """With no --amp a run takes default_amp's choice and its reason; --amp wins, and the reason says it was
    given."""
    device, *capabilities, amp, reason = AMP_MACHINES[machine]
    fake_machine(monkeypatch, *capabilities)
    run = resolved([])
    assert (run.args.amp, run.amp_given) == (amp, False) and reason in run.amp_why
    for given in ('bf16', 'fp16', 'fp32'):
        run = resolved(['--amp', given])
        assert (run.args.amp, run.amp_given, run.amp_why) == (given, True, 'given by --amp')


def test_bf16_probe_leaves_the_random_streams_and_the_threads_as_they_were():
    torch.manual_seed(0)
    threads, state = torch.get_num_threads(), torch.get_rng_state()
    # a fresh measurement, not the process's cached one
    speedup = train.bf16_speedup.__wrapped__(rounds=1)
    print(f'bf16 probe on this CPU: bf16 {speedup:.2f}x the speed of fp32')
    assert 0 < speedup < math.inf and torch.get_num_threads() == threads \
        and torch.equal(torch.get_rng_state(), state)


def test_validation_runs_in_fp32_unless_amp_is_given():
    run = resolved([])
    run.args.amp = 'bf16'  # as resolved on a machine with AMX or a GPU with bf16
    with run.autocast(training=True):
        assert torch.is_autocast_enabled('cpu') and torch.get_autocast_dtype('cpu') == torch.bfloat16
    with run.autocast(training=False):
        assert not torch.is_autocast_enabled('cpu')
    with resolved(['--amp', 'bf16']).autocast(training=False):
        assert torch.is_autocast_enabled('cpu')


@pytest.mark.parametrize('size,crop,side', [(32, True, 36), (384, True, 438), (384, False, 384)],
                         ids=['32px', 'cswin_b_384', 'swin_b_384'])
def test_eval_transform_is_a_square_resize_then_a_centre_crop(size, crop, side):
    """The released evaluation: a square of int(img * 256/224), the aspect not kept, bicubic, then the centre
    img x img."""
    g = torch.Generator().manual_seed(0)
    img = Image.fromarray(torch.randint(0, 256, (size + 17, size + 40, 3), generator=g,
                                        dtype=torch.uint8).numpy())
    square = torch.from_numpy(np.array(img.resize((side, side), Image.BICUBIC))).permute(2, 0, 1) / 255
    top = (side - size) // 2
    expected = (square[:, top:top + size, top:top + size] - torch.tensor(data.MEAN)[:, None, None]) / \
        torch.tensor(data.STD)[:, None, None]
    torch.testing.assert_close(data.eval_transform(size, crop)(img), expected)
    assert data.NO_EVAL_CROP == ('inline_swin_b_384',)  # inline_cswin_b_384 crops


# timm's rand-m9-mstd0.5-inc1 at magnitude m = 9 (f = 0.9) and sign s: PIL's own operations, as timm calls
# them, with timm's magnitude formulas (README, "Training"); geometric ops bicubic, filled with the mean
# colour
PIL_FILL = (124, 116, 104)
RANDAUG_FORMULAS = {
    'AutoContrast': lambda img, s: ImageOps.autocontrast(img),
    'Equalize': lambda img, s: ImageOps.equalize(img),
    'Invert': lambda img, s: ImageOps.invert(img),
    'Rotate': lambda img, s: img.rotate(s * 27, resample=Image.BICUBIC, fillcolor=PIL_FILL),  # 30 f degrees
    # 4 - int(4 f) = 1 bit
    'PosterizeIncreasing': lambda img, s: Image.fromarray(np.asarray(img) & 0b10000000),
    'SolarizeIncreasing': lambda img, s: Image.fromarray(np.where(
        np.asarray(img) >= 26, 255 - np.asarray(img), np.asarray(img)).astype(np.uint8)),  # 256 - int(256 f)
    'SolarizeAdd': lambda img, s: Image.fromarray(np.where(np.asarray(img) < 128, np.minimum(
        np.asarray(img).astype(int) + 99, 255), np.asarray(img)).astype(np.uint8)),  # int(110 f) = 99
    'ColorIncreasing': lambda img, s: ImageEnhance.Color(img).enhance(1 + s * 0.81),  # 1 +- 0.9 f
    'ContrastIncreasing': lambda img, s: ImageEnhance.Contrast(img).enhance(1 + s * 0.81),
    'BrightnessIncreasing': lambda img, s: ImageEnhance.Brightness(img).enhance(1 + s * 0.81),
    'SharpnessIncreasing': lambda img, s: ImageEnhance.Sharpness(img).enhance(1 + s * 0.81),
    # PIL's affine maps each output pixel (x, y) to the input pixel (a x + b y + c, d x + e y + f)
    'ShearX': lambda img, s: img.transform(img.size, Image.AFFINE, (1, s * 0.27, 0, 0, 1, 0), Image.BICUBIC,
                                           fillcolor=PIL_FILL),  # 0.3 f
    'ShearY': lambda img, s: img.transform(img.size, Image.AFFINE, (1, 0, 0, s * 0.27, 1, 0), Image.BICUBIC,
                                           fillcolor=PIL_FILL),
    'TranslateXRel': lambda img, s: img.transform(img.size, Image.AFFINE,
                                                  (1, 0, s * 0.405 * img.width, 0, 1, 0),
                                                  Image.BICUBIC, fillcolor=PIL_FILL),  # 0.45 f of the side
    'TranslateYRel': lambda img, s: img.transform(img.size, Image.AFFINE,
                                                  (1, 0, 0, 0, 1, s * 0.405 * img.height),
                                                  Image.BICUBIC, fillcolor=PIL_FILL),
}


@pytest.mark.parametrize('sign', [1, -1])
@pytest.mark.parametrize('name', list(RANDAUG_FORMULAS))
def test_randaugment_op_is_its_formula(name, sign):
    # values short of 0 and 255 and enough pixels for Equalize: every op acts
    g = torch.Generator().manual_seed(0)
    img = Image.fromarray(torch.randint(30, 220, (40, 50, 3), generator=g, dtype=torch.uint8).numpy())
    got = np.asarray(data.RANDAUG_OPS[name](img, 0.9, sign)).astype(int)
    expected = np.asarray(RANDAUG_FORMULAS[name](img, sign)).astype(int)
    assert got.shape == expected.shape and (got != np.asarray(img)).any()
    assert (got == expected).all(), f'{(got != expected).sum()} of {got.size} values differ'


def test_randaugment_posterize_at_magnitude_10_is_black():
    img = Image.new('RGB', (5, 4), (200, 100, 50))
    assert not np.asarray(data.RANDAUG_OPS['PosterizeIncreasing'](img, 1.0, 1)).any()


def test_randaugment_policy(monkeypatch):
    """Two ops per image, uniformly with replacement from timm's fifteen, each applied with probability 0.5 at
    its own magnitude N(9, 0.5) clipped to [0, 10], in either direction."""
    assert list(data.RANDAUG_OPS) == list(RANDAUG_FORMULAS)
    calls = []
    monkeypatch.setattr(data, 'RANDAUG_OPS',
                        {name: lambda img, f, s, name=name: calls.append((name, f, s)) or img
                         for name in RANDAUG_FORMULAS})
    torch.manual_seed(0)
    augment, images = data.RandAugment(2, 9, 0.5), 6000
    for _ in range(images):
        augment(None)
    n = len(calls)  # binomial(2 x 6000, 0.5): mean 6000, std 55
    assert abs(n - images) < 5 * 55
    counts = torch.tensor([sum(c[0] == name for c in calls) for name in RANDAUG_FORMULAS],
                          dtype=torch.float64)
    assert (counts - n / 15).abs().max() < 5 * (n / 15) ** 0.5  # uniform over the fifteen
    m = torch.tensor([10 * c[1] for c in calls])
    assert 0 <= m.min() and m.max() == 10  # clipped: about 2% of the draws pass 10
    assert abs(m.mean() - 9) < 0.05 and 0.4 < m.std() < 0.5  # the clip at 10 trims the std of 0.5 a little
    assert abs(sum(c[2] for c in calls)) < 5 * n ** 0.5 and {c[2] for c in calls} == {1, -1}


def test_finetune_starts_from_the_ema_weights(tmp_path):
    """The authors' 384 px CSwin fine-tune starts from the 224 px EMA weights: --finetune takes a file's
    EMA."""
    source = perturb(models.create_model('inline_deit_t', img_size=32, num_classes=10))
    ema = {k: v + 1 for k, v in source.state_dict().items()}
    path = str(tmp_path / 'authors.pth')
    torch.save({'model': source.state_dict(), 'state_dict_ema': ema}, path)
    run = resolved(['--model', 'inline_deit_t', '--img-size', '32', '--fast', 'none',
                    '--finetune', path])
    model = train.build_model(run, num_classes=10)
    assert all(torch.equal(v, ema[k]) for k, v in model.state_dict().items())


def test_finetune_resizes_an_authors_file_from_its_variants_own_grid(tmp_path):
    """The authors' files record no image size: --finetune reads them at the variant's registered
    size (inline_deit_t: 224 px, a 14x14 grid) and resizes to the run's (64 px, 4x4), bicubic."""
    small = dict(embed_dim=32, depth=1, num_heads=2)
    source = perturb(models.create_model('inline_deit_t', num_classes=10, **small))  # 224 px
    path = str(tmp_path / 'authors.pth')
    torch.save({'model': source.state_dict()}, path)
    run = resolved(['--model', 'inline_deit_t', '--model-kwargs', 'embed_dim=32', 'depth=1',
                    'num_heads=2', '--img-size', '64', '--fast', 'none',
                    '--finetune', path])
    model = train.build_model(run, num_classes=10)
    stored = source.pos_embed.detach()
    torch.testing.assert_close(model.pos_embed[:, 1:], bicubic(stored[:, 1:], (14, 14), (4, 4)))


def test_finetune_from_another_models_checkpoint_names_it_and_how_to_rebuild_it(tmp_path, capsys):
    """A train.py checkpoint of a Swin under --finetune of a DeiT: the refusal names the model the
    file records and the command that rebuilds it, which a shell reads back into its sizes."""
    sizes = dict(embed_dim=16, depths=(1, 1, 2, 1), num_heads=(1, 1, 2, 2), layout='IISS')
    source = models.create_model('inline_swin_t', img_size=32, num_classes=10, **sizes)
    path = str(tmp_path / 'swin.pt')
    torch.save({'model': source.state_dict(), 'args': {'model': 'inline_swin_t', 'img_size': 32},
                'arch': source.arch}, path)
    run = resolved(['--model', 'inline_deit_t', '--img-size', '32', '--fast', 'none',
                    '--finetune', path])
    with pytest.raises(SystemExit):
        train.build_model(run, num_classes=10)
    error = capsys.readouterr().err
    assert f'cannot load {path} (model)' in error and 'it holds a inline_swin_t built with' in error
    command = re.search(r'or (train\.py --model .*)$', error, re.MULTILINE).group(1)
    assert ("--model-kwargs embed_dim=16 'depths=(1,1,2,1)' 'num_heads=(1,1,2,2)' layout=IISS"
            in command)
    rebuilt = train.get_args_parser().parse_args(shlex.split(command)[1:])
    assert rebuilt.model == 'inline_swin_t' and train.model_kwargs(rebuilt) == sizes


def test_finetune_at_twice_a_non_square_size_says_what_it_changed(tmp_path, capsys):
    """--finetune of a 32x48 px checkpoint of 3 classes at --img-size 64 96 on 2 classes: its head dropped
    for a new one, the position embedding resized from its 2x3 grid to 4x6 (bicubic, the class token's
    vector kept), each in a line of the log."""
    small = dict(embed_dim=32, depth=1, num_heads=2)
    source = perturb(models.create_model('inline_deit_t', img_size=(32, 48), num_classes=3, **small))
    path = str(tmp_path / 'best.pt')
    torch.save({'model': source.state_dict(), 'args': {'model': 'inline_deit_t'}, 'arch': source.arch}, path)
    run = resolved(['--model', 'inline_deit_t', '--model-kwargs', 'embed_dim=32', 'depth=1', 'num_heads=2',
                    '--img-size', '64x96', '--fast', 'none', '--finetune', path])
    capsys.readouterr()
    model = train.build_model(run, num_classes=2)
    assert capsys.readouterr().out.splitlines()[:4] == [
        f'initial weights: {path} (model)',
        f'{path}: dropped its head (3 classes x 32 features)',
        f'{path}: a new head (2 classes x 32 features), initialised at random, to fine-tune',
        f"{path}: resized pos_embed from its 2x3 grid to 4x6, bicubic, the class token's vector kept"]
    stored = source.pos_embed.detach()
    torch.testing.assert_close(model.pos_embed[:, 1:], bicubic(stored[:, 1:], (2, 3), (4, 6)))
    assert model.img_size == (64, 96) and model(torch.randn(1, 3, 64, 96)).shape == (1, 2)


def test_img_size_takes_one_side_or_the_height_and_width(capsys):
    """--img-size 32, 64 96 or 64x96; anything else is refused, naming the forms it takes; the synthetic
    task, which draws squares, refuses a non-square size by name."""
    for given, size in ((['32'], 32), (['64', '96'], (64, 96)), (['64x96'], (64, 96)), (['48X48'], 48)):
        assert resolved(['--img-size', *given]).args.img_size == size
    for given in (['64', '96', '128'], ['64x'], ['0'], ['64x96', '32']):
        assert (f'--img-size {" ".join(given)}: give one side (32), or the height and width (64 96, or '
                f'64x96), in whole pixels') in refused(['--img-size', *given], capsys)
    with pytest.raises(SystemExit):
        data.load_data(resolved(['--img-size', '32', '64']).args)
    assert 'the synthetic task draws square images; --img-size 32x64 px is not' in capsys.readouterr().err


def test_commands_to_paste_are_quoted_for_the_shell(capsys):
    """--help's --model-kwargs example, and the refusal of a pair without '=', quote the brackets
    that bash would read as syntax."""
    helped = ' '.join(train.get_args_parser().format_help().split())
    assert "'depths=(1,1,2,1)' embed_dim=48" in helped
    assert "(e.g. 'depths=(1,1,2,1)' embed_dim=48)" in refused(['--model-kwargs', 'depths'], capsys)


def test_authors_checkpoint_with_ema_and_a_config_object(tmp_path, capsys):
    """The authors' CSwin file: {'model', 'state_dict_ema'} and their yacs config, which weights_only=True
    refuses. Refused with a line that strips it; stripped, evaluated with its weights and then its EMA
    weights, each giving the loss computed here from the eval transform and the model. The file's
    name has a space and a quote, which the printed command must carry through the shell."""
    torch.manual_seed(0)
    root = str(tmp_path / 'data')
    write_image_folder(root, {'train': 1, 'val': 3})
    small = dict(embed_dim=16, depths=(1, 1, 1, 1), num_heads=(2, 2, 4, 4))
    model = perturb(models.create_model('inline_cswin_t', img_size=32, num_classes=2, **small))
    ema = perturb(models.create_model('inline_cswin_t', img_size=32, num_classes=2, **small), seed=1)
    path = str(tmp_path / "the authors' cswin_t.pth")
    torch.save({'model': model.state_dict(), 'state_dict_ema': ema.state_dict(),
                'config': argparse.Namespace()}, path)
    args = ['--model', 'inline_cswin_t', '--model-kwargs', 'embed_dim=16', 'depths=(1,1,1,1)',
            'num_heads=(2,2,4,4)', '--img-size', '32', '--fast', 'none', '--threads', '1',
            '--eval', '--checkpoint', path]
    error = refused(args + ['--data-path', root], capsys)
    assert 'weights_only=True' in error
    # models.load_checkpoint refuses it the same way
    with pytest.raises(ValueError, match='weights_only=True'):
        models.load_checkpoint(model, path)
    strip = next(line for line in error.splitlines() if line.startswith('python -c '))
    subprocess.run([sys.executable] + shlex.split(strip)[1:], check=True)  # as a shell reads it
    args[-1] = shlex.split(re.search(r'\nand pass (.+) instead', error).group(1))[0]
    assert args[-1] == str(tmp_path / "the authors' cswin_t.weights.pth")
    error = refused(args, capsys)  # not one of our synthetic runs
    assert '--eval of' in error and 'needs --data-path' in error
    result = run_train(args + ['--data-path', root])
    val = datasets.ImageFolder(os.path.join(root, 'val'), data.eval_transform(32))
    x, y = torch.stack([img for img, _ in val]), torch.tensor([label for _, label in val])
    for prefix, module in (('eval model: ', model), ('eval ema: ', ema)):
        with torch.no_grad():
            expected = torch.nn.functional.cross_entropy(module.eval()(x), y).item()
        assert printed(result.stdout, prefix)['loss'] == pytest.approx(expected, rel=1e-5)


# ------------------------------------------------------------------------------------ the paper's ablations
# Table 4's InLine windows of 7 without Eq. 6 in miniature, as the lab passes an experiment to train.py (its
# model and overrides as flags): windows of 7 tokens tile 224 px stages (56-28-14-7), one block per stage
ABLATION = ['--model', 'inline_swin_t', '--window', '7', '--eq6', 'none', '--model-kwargs',
            'depths=(1,1,1,1)', 'embed_dim=16', 'num_heads=(1,1,2,2)', '--fast', 'none',
            '--synthetic-train', '16', '--synthetic-val', '8', '--threads', '1']


def test_every_starting_checkpoint_goes_through_one_function(tmp_path, capsys):
    """--resume FILE, --eval --checkpoint FILE and a rerun finding OUTPUT_DIR/checkpoint.pt are read alike:
    the saved flags fill those left unset, and an architecture other than the flags given ask for is
    refused."""
    out = str(tmp_path / 'run')
    saved = resolved(['--model', 'inline_swin_t', '--window', '7', '--lr', '0.01', '--output-dir', out])
    os.makedirs(out)
    path = os.path.join(out, 'checkpoint.pt')
    torch.save({'args': vars(saved.args), 'arch': dict(saved.arch, img_size=224, num_classes=10)}, path)
    for argv in (['--resume', path], ['--output-dir', out], ['--eval', '--checkpoint', path]):
        run = resolved(argv)
        assert run.saved_path == path and run.arch == saved.arch == dict(window=7)
        assert (run.args.model, run.args.lr, run.args.img_size) == ('inline_swin_t', 0.01, 224)
        assert 'this run asks for window=14. They differ in window' in refused(
            argv + ['--window', '14'], capsys)
        assert 'is a checkpoint of inline_swin_t, not of --model inline_pvt_t' in refused(
            argv + ['--model', 'inline_pvt_t'], capsys)


def test_architecture_flags_and_model_kwargs_resolve():
    run = resolved(['--eq6', 'none', '--window', '14', '--feature-map', 'relu', '--no-ape',
                    '--model-kwargs', 'window=7', 'embed_dim=48', 'depths=(1,1,2,1)', 'layout=IIIS'])
    assert run.args.model == 'inline_swin_t'  # the default model
    assert run.arch == dict(window=14, eq6='none', feature_map='relu', ape=False, embed_dim=48,
                            depths=(1, 1, 2, 1),
                            layout='IIIS')  # the named flag's window wins over --model-kwargs' 7
    assert run.args.output_dir == os.path.join(
        'runs', 'inline_swin_t-apeFalse-depths1.1.2.1-embed_dim48-eq6none-feature_maprelu-layoutIIIS-'
                'window14-synthetic')
    # the synthetic task: Swin's InLine windows smaller than its stages at 224 px, where they tile them
    assert (resolved(['--window', '7']).args.img_size, run.args.batch_size) == (224, 8)
    assert resolved(['--window', '56']).args.img_size == 32
    softmax = resolved(['--model', 'inline_swin_t', '--layout', 'SSSS', '--data-path', 'imagenet', '--recipe',
                        'released'])
    assert softmax.args.drop_path == 0.2  # Swin-T's row


@pytest.mark.parametrize('argv,message', [
    (['--model', 'nope'], "argument --model: invalid choice: 'nope'"),
    (['--model-kwargs', 'depths'], '--model-kwargs takes KEY=VALUE pairs'),
    (['--model-kwargs', 'img_size=64'], '--model-kwargs img_size: train.py sets it; use --img-size'),
    (['--kernel', 'relu'], 'error: --kernel is now --feature-map'),
    (['--residual', 'none'], 'error: --residual is now --eq6'),
    (['--attention-impl', 'reference'], 'error: --attention-impl is now --fast (reference: none; fast: '
                                        'compile; triton: triton)')],
    ids=['unknown-model', 'model-kwargs-without-value', 'model-kwargs-img-size', 'renamed-kernel',
         'renamed-residual', 'renamed-attention-impl'])
def test_bad_architecture_flags_are_refused(argv, message, capsys):
    assert message in refused(argv, capsys)


def test_an_architecture_the_model_refuses_is_a_clear_error(capsys):
    run = resolved(['--model', 'inline_deit_t', '--feature-map', 'bogus', '--fast', 'none'])
    with pytest.raises(SystemExit):
        train.build_model(run, num_classes=10)
    assert "cannot build inline_deit_t with {'feature_map': 'bogus'" in capsys.readouterr().err


def test_an_ablation_trains_resumes_and_evaluates_from_its_checkpoint_alone(tmp_path, capsys,
                                                                           monkeypatch):
    """Trained in this process; resumed and evaluated as a user would, from the file and no
    architecture flag."""
    monkeypatch.chdir(tmp_path)  # the default output folder, runs/NAME, is relative
    assert main_in_process(ABLATION + ['--epochs', '1'], capsys)[0] == 0
    output_dir = tmp_path / 'runs' / ('inline_swin_t-depths1.1.1.1-embed_dim16-eq6none-num_heads1.1.2.2-'
                                      'window7-synthetic')
    path = str(output_dir / 'checkpoint.pt')
    arch = dict(window=7, eq6='none', depths=(1, 1, 1, 1), embed_dim=16, num_heads=(1, 1, 2, 2))
    assert arch.items() <= load_checkpoint_file(path)['arch'].items()
    # no architecture flags
    result = run_train(['--resume', path, '--epochs', '2', '--threads', '1', '--fast', 'none'], cwd=tmp_path)
    assert 'resumed from' in result.stdout and "'window': 7" in result.stdout
    log = read_metrics(str(output_dir))
    assert [e['epoch'] for e in log] == [1, 2] and all(e['arch']['window'] == 7 for e in log)
    result = run_train(['--eval', '--checkpoint', path, '--fast', 'none', '--threads', '1'])
    assert printed(result.stdout, 'eval model: ')['loss'] == pytest.approx(log[-1]['val_loss'], rel=1e-6)
    assert 'this run asks for window=14. They differ in window' in refused(['--eval', '--checkpoint', path,
                                                                             '--window', '14'], capsys)


def test_grad_checkpointing_keeps_the_gradients():
    torch.manual_seed(0)
    name = 'inline_swin_t'
    model = perturb(models.create_model(name, drop_path_rate=0.1, **SMALL_SIZES[name]))
    x = torch.randn(2, 3, *SMALL_SIZES[name]['img_size'])
    upstream = torch.randn(2, model.num_classes)

    def gradients(enable):
        model.set_grad_checkpointing(enable)
        model.zero_grad()
        torch.manual_seed(1)  # the same drop path draws
        model(x).backward(upstream)
        return {n: p.grad.clone() for n, p in model.named_parameters()}
    without, with_ = gradients(False), gradients(True)
    assert all(torch.equal(without[n], with_[n]) for n in without)
    run = resolved(['--model', name, '--img-size', '64', '--fast', 'none',
                    '--grad-checkpoint'])
    assert train.build_model(run, num_classes=10).grad_checkpointing


DEFAULT_FAST = [('inline_swin_t', [], 'compile'), ('inline_swin_t', ['--layout', 'LISS'], 'none'),
                ('flatten_pvt_t', [], 'none'), ('flatten_swin_t', [], 'none'),
                ('transnormer_swin_t', [], 'none')]


@pytest.mark.parametrize('name,flags,fast', DEFAULT_FAST)
def test_fast_defaults_to_none_without_a_fast_core(name, flags, fast):
    """Vanilla linear attention (L) and the peers (F, N, in the registry's layouts) have no fast core."""
    assert resolved(['--model', name, *flags]).args.fast == fast

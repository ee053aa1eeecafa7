"""The lab (paper/): every subcommand runs, draws a valid PNG, and computes what it claims. Skipped where the
lab's own requirements (paper/requirements.txt: scipy, matplotlib) are absent; the statistics' own tests are
in paper/test_stats.py.
"""
import argparse
import contextlib
import glob
import json
import os
import re
import signal
import subprocess
import sys
import tempfile
import threading
import time
import types

import pytest
import torch
from PIL import Image
from torchvision import datasets

import data
import dense
import inline
import models
import sequence
import train
from conftest import qkv
from test_models import SMALL_SIZES, meta_model
from test_train import write_fashion_mnist, write_image_folder

pytest.importorskip('scipy.stats')  # the lab's own requirements (paper/requirements.txt)
pytest.importorskip('matplotlib')
from paper import __main__ as cli  # noqa: E402
from paper import ablations, charts, figures, mosaics, recall, runs, speed, stats, verdicts  # noqa: E402
from paper import experiments as registry  # noqa: E402
from paper.runs import ROOT  # noqa: E402

def tiny_experiment(name, **extra):
    """An experiment at its real 224 px (so its windows tile as in the paper) but a few channels wide."""
    e = registry.EXPERIMENTS[name]
    family = e.model.split('_')[1]
    small = {'deit': dict(embed_dim=24, depth=2),
             'pvt': dict(embed_dims=(8, 16, 40, 64), depths=(1, 1, 1, 1)),
             'swin': dict(embed_dim=8, depths=(2, 2, 2, 2), num_heads=(1, 2, 4, 8)),
             'cswin': dict(embed_dim=8, depths=(1, 2, 2, 1))}[family]
    return registry.create_experiment(name, num_classes=3, **small, **extra)


@pytest.mark.parametrize('name', list(registry.EXPERIMENTS))
def test_every_experiment_builds_and_trains(name):
    torch.manual_seed(0)
    model = tiny_experiment(name)
    x = torch.randn(1, 3, *model.img_size)
    out = model(x)
    assert out.shape == (1, 3) and torch.isfinite(out).all()
    out.backward(torch.randn_like(out))
    assert all(p.grad is not None for p in model.parameters())
    assert registry.describe(model).startswith(model.family)


def test_experiment_registry_matches_the_spec():
    e = registry.EXPERIMENTS
    assert (e['t4_window7_no_residual'].overrides == dict(window=7, eq6='none')
            and e['t4_window7_no_residual'].reported == '80.3')
    assert e['t3_linear_relu_affine'].ours and e['t3_linear_relu_affine'].reported == '70.2'
    assert e['r_dilation3'].reported == '80.8' and e['r_nonneg'].reported == '81.7'
    assert e['t1_softmax_normalised_q'].reported == '70.6 / 69.9' and e['s_swin_t'].reported == '81.3'
    model = meta_model('inline_swin_t', **e['t4_window7_no_residual'].overrides)
    assert model.ape and model.window == 7 and model.layers[0].blocks[1].shift
    assert 'InLine windows 7 (shifted on odd blocks' in registry.describe(model)
    assert models.create_model('inline_deit_t', img_size=32, embed_dim=16, depth=1, num_heads=2,
                               layout='S').arch == dict(img_size=32, embed_dim=16, depth=1, num_heads=2,
                                                        layout='S')


def test_experiment_switches_reject_bad_input():
    with pytest.raises(ValueError, match=r"unknown experiment 't9_nothing'; choose one of t3_linear_relu, "):
        registry.create_experiment('t9_nothing')
    with pytest.raises(ValueError,
                       match=r"InLine window 5 does not tile stage 1 \(56x56 tokens at 224x224 px\); "
                                         r"windows that tile it: \[1, 2, 4, 7, 8, 14, 28, 56\]"):
        meta_model('inline_swin_t', window=5)
    with pytest.raises(ValueError, match=r"dilation must be a whole number >= 1"):
        meta_model('inline_swin_t', dilation=0)
    with pytest.raises(ValueError, match=r"dilation must be .* > 1 only where Eq. 6 has neighbours"):
        meta_model('inline_swin_t', dilation=2, eq6='plain')
    with pytest.raises(ValueError, match=r"dilation must be .* > 1 only where Eq. 6 has neighbours"):
        meta_model('inline_swin_t', dilation=2, local_size=1)
    for size in (4, 0, -1, 3.0):
        with pytest.raises(ValueError, match=rf"local_size .* must be an odd whole number >= 1.* got {size}"):
            meta_model('inline_swin_t', local_size=size)
    with pytest.raises(ValueError, match=r"layout 'M': need 1 letters from I L S"):
        meta_model('inline_deit_t', layout='M')
    with pytest.raises(ValueError, match=r"layout 'IIMI2': need 4 letters from I L S"):
        meta_model('inline_pvt_t', layout='IIMI2')
    with pytest.raises(ValueError,
                       match=r"needs a non-negative feature map .* got 'leakyrelu'; pass allow_divergent=True"):
        meta_model('inline_swin_t', layout='LLLS', feature_map='leakyrelu')
    assert meta_model('inline_swin_t', layout='LLLS', feature_map='relu_affine')  # T3's 70.2 row: allowed
    with pytest.raises(ValueError,
                       match=r"unknown eq6 'global' \(Eq\. 6's form\); choose one of \['local', 'plain', 'none'\]"):
        meta_model('inline_swin_t', eq6='global')
    with pytest.raises(ValueError, match=r"window and ape are InLine-Swin's options"):
        meta_model('inline_deit_t', window=7)
    with pytest.raises(ValueError,
                       match=r"normalise_q takes the letters .* of \['I'\] in this layout .* got 'S'"):
        meta_model('inline_deit_t', normalise_q='S')  # layout I: no softmax block to normalise
    with pytest.raises(ValueError,
                       match=r"of \['I'\] in this layout .*nor CSwin's stripe softmax\), got 'IS'"):
        meta_model('inline_cswin_t', normalise_q='IS')
    with pytest.raises(ValueError, match=r"not 'L': division cancels q's length already\), got 'L'"):
        meta_model('inline_swin_t', layout='LLLS', normalise_q='L')
    with pytest.raises(ValueError, match=r"got True"):
        meta_model('inline_swin_t', normalise_q=True)
    with pytest.raises(ValueError, match=r"unknown argument\(s\) \['depht'\]"):
        meta_model('inline_deit_t', depht=3)



def test_paper_train_resolves_the_experiment_with_the_flags_given_winning(capsys):
    """python -m paper train NAME: the experiment's model and overrides become train.py's --model and
    --model-kwargs, and the flags given (--model-kwargs, the named attention flags) win over them, each
    said."""
    args = runs.train_args(['t4_window7_no_residual', '--eq6', 'local', '--model-kwargs', 'window=14',
                            '--epochs', '1'])
    assert args.model == 'inline_swin_t' and args.epochs == 1
    assert train.model_kwargs(args) == dict(window=14, eq6='local')
    out = capsys.readouterr().out
    assert ("the flags given win over experiment t4_window7_no_residual: window=14 (its 7), eq6='local' "
            "(its 'none')") in out
    assert 'experiment: t4_window7_no_residual (T4, reported 80.3)' in out
    args = runs.train_args(['t3_linear_relu'])  # no flag given: the experiment's own
    assert args.model == 'inline_swin_t'
    assert train.model_kwargs(args) == dict(layout='LLLS', feature_map='relu', eq6='none')
    args = runs.train_args(['t1_softmax', '--model', 'inline_deit_s'])
    assert args.model == 'inline_deit_s' and "--model inline_deit_s wins over experiment t1_softmax's" in \
        capsys.readouterr().out
    args = runs.train_args(['inline_deit_t', '--dataset', 'fashion_recall'])  # a released model, the mosaics
    assert args.model == 'inline_deit_t' and args.model_kwargs is None and args.img_size == 64
    assert train.DATASETS['fashion_recall'] is mosaics.load
    with pytest.raises(SystemExit):
        runs.train_args(['t9_nothing'])
    assert 'unknown experiment or model t9_nothing' in capsys.readouterr().err


def test_recipe_a_new_experiment_by_name(monkeypatch):
    """An experiment is one experiment(...) line in paper/experiments.py: create_experiment, python -m paper
    train and the ablations find it."""
    monkeypatch.setattr(registry, 'EXPERIMENTS', dict(registry.EXPERIMENTS))
    monkeypatch.setattr(runs, 'EXPERIMENTS', registry.EXPERIMENTS)
    monkeypatch.setattr(ablations, 'EXPERIMENTS', registry.EXPERIMENTS)
    registry.experiment('r_local5', 'inline_swin_t', dict(local_size=5), 'R-res', None,
                        "Eq. 6 over 5x5 neighbours", ours=True)
    assert registry.create_experiment('r_local5', img_size=64).options['local_size'] == 5
    args = runs.train_args(['r_local5'])
    assert args.model == 'inline_swin_t' and train.model_kwargs(args) == dict(local_size=5)
    every = ablations.experiments()
    assert 'r_local5' in every
    assert ablations.config_key(every['r_local5']) != ablations.config_key(every['r_residual_local'])


def test_mqar_batches_ask_for_the_values_of_earlier_keys():
    x, y = recall.mqar_batch(16, 8, 30, torch.Generator().manual_seed(0))
    assert x.shape == y.shape == (16, 30)
    keys, values, filler = x[:, 0:16:2], x[:, 1:16:2], x[:, 16:22]
    assert (keys < recall.RECALL_VOCAB).all() and ((values >= recall.RECALL_VOCAB)
                                                   & (values < 2 * recall.RECALL_VOCAB)).all()
    assert (filler >= 2 * recall.RECALL_VOCAB).all()
    assert all(len(set(row.tolist())) == 8 for row in keys)  # distinct keys in each sequence
    assert (y[:, :22] == -100).all() and (y[:, 22:] >= recall.RECALL_VOCAB).all()
    for b in range(16):
        answer = dict(zip(keys[b].tolist(), values[b].tolist()))
        assert [answer[k] for k in x[b, 22:].tolist()] == y[b, 22:].tolist()


def test_recall_sizes_put_every_query_where_inline_is_injective():
    """Every query of the default sizes sits at token D + 1 or later (D = C / 2), where the prefix's centred
    keys can span D dimensions (test_causal_injectivity_needs_d_plus_1_tokens)."""
    for width, pairs, tokens in recall.RECALL_SIZES:
        _, y = recall.mqar_batch(2, pairs, tokens, torch.Generator().manual_seed(0))
        first_query = (y[0] != -100).nonzero().min().item() + 1  # counting tokens from 1
        assert first_query >= width // recall.RECALL_HEADS + 1


def test_most_frequent_guess_against_a_hand_count():
    """Values 64, 64, 65, 66 with queries asking for each key once: the guess answers 64, right 2 times in
    4."""
    x = torch.tensor([[0, 64, 1, 64, 2, 65, 3, 66, 0, 1, 2, 3]])
    y = torch.full_like(x, -100)
    y[0, 8:] = torch.tensor([64, 64, 65, 66])
    assert recall.most_frequent_guess(x, y, 4) == 50.0


def test_recall_models_run_the_reference_function(monkeypatch):
    """RecallLM's explicit-weight core (short_causal_core) gives the reference core's logits, under either
    factor of Eq. 5; q-norm models give q and 2q the same weights (injectivity in q's length off), the others
    do not."""
    torch.manual_seed(0)
    x, _ = recall.mqar_batch(3, 4, 12, torch.Generator().manual_seed(0))
    for name in ('InLine s/i', 'InLine 1+elu s', 'InLine s/i q-norm', 'linear 1+elu', 'floor phi=0',
                 'InLine s + Eq. 6'):
        model = recall.RecallLM(name, 16, 12).double()
        cores = [m for m in model.modules() if isinstance(m, sequence.SequenceAttention)]
        assert len(cores) == 2 and all(m.causal for m in cores)
        assert all(m.scale_by_count == recall.RECALL_MODELS[name].get('scale_by_count', True) for m in cores)
        logits = model(x)
        # the head at the answers only
        torch.testing.assert_close(model(x, 4), logits[:, -4:], rtol=0, atol=1e-12)
        with monkeypatch.context() as patch:  # the reference's causal core in place of the explicit weights
            patch.setattr(recall, 'short_causal_core', sequence.causal_core)
            torch.testing.assert_close(logits, model(x), rtol=0, atol=1e-10)
        assert logits.shape == (3, 12, 3 * recall.RECALL_VOCAB)
    q = torch.randn(2, 2, 12, 8, dtype=torch.float64)
    normalise = inline.NormalisedQ(2, 8).double()
    torch.testing.assert_close(normalise(q), normalise(2 * q))
    x = torch.randn(2, 12, 16, dtype=torch.float64)
    for normalise_q, same in ((True, True), (False, False)):  # q doubled: qkv's first C rows times 2
        attn = recall.CausalInLine(16, 2, normalise_q=normalise_q, eq6='none').double()
        before = attn.weights(x)
        with torch.no_grad():
            attn.qkv.weight[:16] *= 2
            attn.qkv.bias[:16] *= 2
        assert ((attn.weights(x) - before).abs().max() < 1e-12) == same


def test_recall_softmax_adds_causal_eq6_token_by_token():
    """CausalSoftmax with eq6='local' adds, at token i, sum over t of r_i[3c + t] * v_{i-2+t} (zero
    before the start) to softmax's output, r from the prefix mean; token i's output does not move when a later
    token does."""
    torch.manual_seed(0)
    plain, shifted = recall.CausalSoftmax(16,
                                          2).double(), recall.CausalSoftmax(16, 2, eq6='local').double()
    shifted.qkv.load_state_dict(plain.qkv.state_dict())
    shifted.proj.load_state_dict(plain.proj.state_dict())
    x = torch.randn(3, 7, 16, dtype=torch.float64)
    v = plain.qkv(x).chunk(3, -1)[2]  # (B, N, C), channel c = head*D + j
    r = inline.residual_weights(shifted.residual, sequence.prefix_means(x)).reshape(3, 7, 16, 3)  # (B, N, C, T)
    eq6 = torch.stack([sum(r[:, i, :, t] * v[:, i - 2 + t] for t in range(3) if i - 2 + t >= 0)
                       for i in range(7)], 1)
    expected = plain(x) + eq6 @ plain.proj.weight.T  # proj is linear: its bias is in plain(x) already
    torch.testing.assert_close(shifted(x), expected)
    later = x.clone()
    later[:, 4:] += 1.0
    torch.testing.assert_close(shifted(later)[:, :4], shifted(x)[:, :4])


def test_paper_recall_chooses_learning_rates_keeps_finished_runs_and_trains_only_the_rest(tmp_path,
                                                                                          monkeypatch,
                                                                                         capsys):
    """Seed 0 at every learning rate, then seed 1 at the one that recalled most on the held-out sequences; a
    rerun trains only what is missing, a run another command has claimed is left to it, and --no-train trains
    nothing."""
    results, argv = str(tmp_path / 'recall.jsonl'), ['recall', '--steps', '3', '--seeds', '2', '--sizes',
                                                     '8x2x6', '--out', str(tmp_path)]
    threads = torch.get_num_threads()
    recorded = cli.lab(argv + ['--results', results, '--models', 'softmax', 'InLine s/i'])
    assert torch.get_num_threads() == threads  # --threads 1 held for the training only
    with open(results) as f:
        # 2 models x (3 learning rates + seed 1)
        assert len(f.readlines()) == 2 * (len(recall.RECALL_LRS) + 1)
    for r in recorded.values():  # the right test answers kept, 1024 sequences x 2 pairs, are the recall
        right = runs.unpack_correct(r['correct'], 1024 * 2)
        assert 100 * right.double().mean().item() == pytest.approx(r['recall'], abs=0.01)
    for name in ('softmax', 'InLine s/i'):
        best = max((r for r in recorded.values() if r['model'] == name and r['seed'] == 0),
                   key=lambda r: (r['valid'], -r['lr']))
        assert [r['lr'] for r in recorded.values() if r['model'] == name and r['seed'] == 1] == [best['lr']]
    trained = []
    real = recall.recall_run
    monkeypatch.setattr(recall, 'recall_run', lambda *run: trained.append(run) or real(*run))
    # another command holds the first run and gives it up unfinished after 2 s: it is left, waited for, then
    # trained
    claimed = recall.recall_claim(str(tmp_path),
                                  recall.recall_key('linear 1+elu', 8, 2, 6, 0, recall.RECALL_LRS[0], 3))
    threading.Timer(2.0, os.close, (claimed,)).start()
    cli.lab(argv + ['--results', results, '--models', 'softmax', 'InLine s/i', 'linear 1+elu'])
    assert {run[0] for run in trained} == {'linear 1+elu'} and [run[4] for run in trained] == [0, 0, 0, 1]
    assert [run[5] for run in trained[:3]] == [*recall.RECALL_LRS[1:], recall.RECALL_LRS[0]]
    cli.lab(argv + ['--results', results, '--models', 'softmax', 'InLine s', '--no-train'])
    assert len(trained) == len(recall.RECALL_LRS) + 1
    out = capsys.readouterr().out
    assert '| 8 / 2 / 6 | linear 1+elu |' in out and 'No runs yet: InLine s at 8 / 2 / 6.' in out
    assert_png(str(tmp_path / 'recall.png'))
    for bad, message in ((['--models', 'gpt'], "unknown recall models ['gpt']"),
                         (['--sizes', '8x65x200'], '--sizes takes'), (['--sizes', '7x4x12'], '--sizes takes'),
                         (['--sizes', '16x4x10'], 'every query sits at token D + 1 or later'),
                         (['--seeds', '0'], '--seeds, --steps and --threads must be at least 1')):
        with pytest.raises(SystemExit):
            cli.lab(argv + ['--results', results] + bad)
        assert message in capsys.readouterr().err


def test_recall_comparisons_read_the_seeds_that_learn(tmp_path, capsys):
    """Records made up for one size (4 pairs: a guess near 26% and a best of 99%, so 99% learned and 40% did
    not at every line): seed 0 chose the learning rate and stays out of every share; the shares of seeds 1-5
    go through Boschloo's exact test (5 of 5 against 0 of 5: 2 / 2^10, the two extreme tables at the nuisance
    share 1/2), their exact interval is Clopper-Pearson's, the verdict is the same at 50, 60 and 70% of the
    way, and the gate is the study's: softmax against the floor at that size. With Eq. 6 the softmax learns no
    more often than the floor, so every comparison there is untestable whatever its models do."""
    width, pairs, tokens, steps = 16, 4, 12, 7
    hi, lo = [99.0] * 6, [40.0] * 6
    scores = {'softmax': hi, 'floor phi=0': lo, 'InLine s/i q-norm': [40.0] + [40.0] * 5,
              'InLine s/i': [40.0] + [99.0] * 5, 'softmax + Eq. 6': hi, 'floor phi=0 + Eq. 6': hi,
              'InLine s/i q-norm + Eq. 6': lo, 'InLine s/i + Eq. 6': hi}
    path = tmp_path / 'recall.jsonl'
    for name, values in scores.items():
        for lr in recall.RECALL_LRS:
            runs.append_record(str(path), dict(model=name, width=width, pairs=pairs, tokens=tokens, seed=0,
                                                steps=steps, batch=recall.RECALL_BATCH, lr=lr, cpu_s=1.0,
                                                valid=values[0] + (lr == recall.RECALL_LRS[1]),
                                                recall=values[0]))
        for seed, value in enumerate(values[1:], 1):
            runs.append_record(str(path), dict(model=name, width=width, pairs=pairs, tokens=tokens, seed=seed,
                                                steps=steps, batch=recall.RECALL_BATCH,
                                                lr=recall.RECALL_LRS[1], cpu_s=1.0, valid=0.0, recall=value))
    cli.lab(['recall', '--no-train', '--results', str(path), '--steps', str(steps), '--seeds', '6',
              '--sizes', f'{width}x{pairs}x{tokens}', '--models', *scores, '--out', str(tmp_path)])
    out = capsys.readouterr().out
    assert '| 16 / 4 / 12 | InLine s/i | no | 5 of 5 | 1.00 [0.48, 1.00] | 99.0 (5) |' in out
    assert '| 16 / 4 / 12 | InLine s/i q-norm | no | 0 of 5 | 0.00 [0.00, 0.52] | - |' in out
    p = f'{2 / 1024:.3f}'
    line = f'0 / 5 | {p} | {p}: reproduced'
    assert f'| injectivity within InLine | 16 / 4 / 12 | {" | ".join([line] * 3)} | reproduced | ' in out
    line = f'0 / 5 | {p} | untestable'
    cells = " | ".join([line] * 3)
    assert f'| injectivity within InLine + Eq. 6 | 16 / 4 / 12 | {cells} | untestable | ' in out


def test_recall_intervals_count_the_test_sequences(tmp_path, capsys):
    """Made-up records with right answers kept: b gets the same answers right in every seed, so the seeds
    alone give ± 0.0, while the test sequences give the interval of a mean over 1024 sequences: t(0.975, 1023)
    sd / sqrt(1024) of its per-sequence recall (the two-way model with no seed or residual variance)."""
    width, pairs, tokens, steps = 16, 2, 12, 7
    g = torch.Generator().manual_seed(0)
    a = torch.rand(1024 * pairs, generator=g) < 0.5
    b = a.clone()
    wrong = (~a).nonzero().flatten()
    b[wrong[torch.randperm(len(wrong), generator=g)[:410]]] = True
    path = str(tmp_path / 'recall.jsonl')
    for name, bits in (('InLine s/i q-norm', a), ('InLine s/i', b)):
        for seed in range(3):
            for lr in recall.RECALL_LRS if seed == 0 else recall.RECALL_LRS[:1]:
                runs.append_record(path, dict(model=name, width=width, pairs=pairs, tokens=tokens, seed=seed,
                                               steps=steps, batch=recall.RECALL_BATCH, lr=lr, cpu_s=1.0,
                                               valid=50.0, recall=100 * bits.double().mean().item(),
                                               correct=runs.pack_correct(bits)))
    cli.lab(['recall', '--no-train', '--results', path, '--steps', str(steps), '--seeds', '3', '--sizes',
                f'{width}x{pairs}x{tokens}', '--models', 'InLine s/i q-norm', 'InLine s/i', '--out',
                str(tmp_path)])
    row = next(line for line in capsys.readouterr().out.splitlines()
               if line.startswith(f'| {width} / {pairs} / {tokens} | InLine s/i |'))
    d = 100 * b.view(1024, pairs).double().mean(1)  # per test sequence
    half = 1.962339 * d.std().item() / 1024 ** 0.5  # t(0.975, 1023)
    assert 1.0 < half < 5.0 and f'| {d.mean().item():.1f} ± {half:.1f} |' in row


def test_the_committed_records_rebuild_the_results_claim_tables(tmp_path, capsys):
    """RESULTS.md's claim tables are what `python -m paper ablations --claims --no-train` prints from
    results/runs.jsonl, line for line: the evidence cannot drift from its records."""
    cli.lab(['ablations', '--claims', '--no-train', '--out', str(tmp_path), '--png',
              str(tmp_path / 'a.png')])
    tables = [line for line in capsys.readouterr().out.splitlines() if line.startswith('|')]
    with open(os.path.join(ROOT, 'RESULTS.md')) as f:
        results = f.read().splitlines()
    assert len(tables) > 10 and [line for line in tables if line not in results] == []


def tables_of(out):
    """{the line before a table (its caption's start): [its rows as lists of cells]} of a command's output."""
    found, caption = {}, None
    for line in out.splitlines():
        if line.startswith('|') and caption is not None:
            found.setdefault(caption, []).append([c.strip() for c in line.split('|')[1:-1]])
        elif line.strip():
            caption = line[:60]
    return {c: rows[2:] for c, rows in found.items()}  # without the header and its rule


def test_the_committed_records_rebuild_the_results_mosaic_tables(tmp_path, capsys):
    """RESULTS.md's tables of the test bed where attention must select are what `python -m paper ablations
    --dataset fashion_recall --no-train` prints from results/runs.jsonl, line for line, labels and robustness
    read included. The labels are the git history's: at 92b2312, which wrote the rules, results/runs.jsonl
    held the 16-epoch records of T3's pair, R-res's none and local, T4's one-cell window and TransNormer
    (`git show 92b2312:results/runs.jsonl`), so their four comparisons are exploratory and the six whose row
    came after are confirmatory; every 4-epoch record predates the rules. RESULTS' prose on each 16-epoch verdict
    (the bullet naming its comparison) gives its label and its robustness read as the table does."""
    cli.lab(['ablations', '--dataset', 'fashion_recall', '--no-train', '--out', str(tmp_path)])
    out = capsys.readouterr().out
    tables = [line for line in out.splitlines() if line.startswith('|')]
    with open(os.path.join(ROOT, 'RESULTS.md')) as f:
        text = f.read()
    results = text.splitlines()
    assert len(tables) > 10 and [line for line in tables if line not in results] == []
    found = tables_of(out)
    short, long = (next(rows for caption, rows in found.items()
                        if caption.startswith(f'The family "fashion_recall, {e} epochs')) for e in (4, 16))
    assert {r[11] for r in short if r[10] != '—'} == {verdicts.EXPLORATORY}
    exploratory = {'t3_linear_relu − t3_inline_relu†', 'r_residual_none − r_residual_local†',
                   't4_window14_no_residual − t4_window56_no_residual†',
                   'p_transnormer_swin − r_residual_local'}
    assert {r[1]: r[11] for r in long} == {r[1]: verdicts.EXPLORATORY if r[1] in exploratory
                                           else verdicts.CONFIRMATORY for r in long}
    robust = next(rows for caption, rows in found.items()
                  if caption.startswith("The 16-epoch family's robustness"))
    assert [r[0] for r in robust] == [r[1] for r in long] and all(r[1] and r[6] for r in robust)
    bullets = text.split('What the 16-epoch family shows')[1].split('**The 16-epoch batch (run).**')[0]
    for r in robust:
        bullet = next(b for b in (' '.join(b.split()) for b in bullets.split('\n- '))
                      if f'`{r[0].rstrip("†")}`' in b)
        assert r[1] in bullet.lower() and (verdicts.CHANGED in bullet) == (r[6] == verdicts.CHANGED), r[0]


def test_the_committed_recall_records_rebuild_the_results_recall_tables(tmp_path, capsys):
    """RESULTS.md's recall tables are what `python -m paper recall --no-train` prints from
    results/recall.jsonl, line for line."""
    cli.lab(['recall', '--no-train', '--out', str(tmp_path)])
    out = capsys.readouterr().out
    tables = [line for line in out.splitlines() if line.startswith('|')]
    with open(os.path.join(ROOT, 'RESULTS.md')) as f:
        results = f.read().splitlines()
    assert len(tables) > 10 and [line for line in tables if line not in results] == []
    # all 499 records were in before 92b2312 wrote Boschloo's test and the 60% and 70% lines: exploratory
    comparisons = next(rows for caption, rows in tables_of(out).items() if caption.startswith('Comparisons'))
    assert len(comparisons) == 18 and {r[-1] for r in comparisons} == {verdicts.EXPLORATORY}


# ---------------------------------------------------------------------------------------------------
# the lab: every subcommand runs, draws a valid PNG, and computes what it claims

def assert_png(path, min_size=(100, 100)):
    """The file decodes as an RGB(A) PNG of at least min_size (width, height)."""
    with Image.open(path) as img:
        img.load()  # decodes every pixel: a truncated file fails here
        assert img.format == 'PNG' and img.mode in ('RGB', 'RGBA'), (img.format, img.mode)
        assert img.width >= min_size[0] and img.height >= min_size[1], img.size


def test_paper_injectivity_finds_identical_rows_for_linear_only(tmp_path):
    groups = cli.lab(['injectivity', '--out', str(tmp_path)])
    # q, 2q, 3q, 4q (rows 0-3) share their weights under division; no other pair of rows does, anywhere
    assert groups == {'softmax': [], 'linear (relu)': [[0, 1, 2, 3]], 'linear (relu_affine)': [[0, 1, 2, 3]],
                      'InLine (identity)': []}
    assert_png(tmp_path / 'injectivity.png', (800, 400))


def tiny_deit_checkpoint(path, layout='I', **overrides):
    """A train.py-format checkpoint of an untrained tiny DeiT: 64 px, 8 px patches, an 8x8 grid, 2 blocks."""
    torch.manual_seed(0)
    model = models.create_model('inline_deit_t', img_size=64, patch_size=8, depth=2, embed_dim=32,
                                num_heads=1, num_classes=10, layout=layout, **overrides)
    torch.save({'model': model.state_dict(), 'arch': model.arch, 'args': {'model': 'inline_deit_t'}}, path)
    return str(path)


def test_paper_locality_of_known_patterns_equals_the_hand_count():
    """Weights replaced by patterns whose shares are known, on a 4x4 grid + class token (N = 17): all on the
    token itself; uniform (class token 1/17; among the 16 grid tokens own 1/16, and on average 6.25 - 1 = 5.25
    of the others in the 3x3, per axis 2, 3, 3, 2 neighbours); half on the class token and half on the token
    itself (the grid renormalised: own 1); half on itself and half two columns away, outside its 3x3 (own 0.5
    or 1)."""
    torch.manual_seed(0)
    model = models.create_model('inline_deit_t', img_size=64, depth=4, embed_dim=32, num_heads=2,
                                num_classes=10)
    N = 17

    def pattern(kind):
        def weights(x, grid):
            w = torch.zeros(x.shape[0], 2, N, N)
            if kind == 'self':
                w[..., range(N), range(N)] = 1
            elif kind == 'uniform':
                w[:] = 1 / N
            elif kind == 'class token':
                w[..., 0] = 0.5
                w[..., range(1, N), range(1, N)] = 0.5
            else:  # grid token i = 1 + 4y + x: half on itself, half on (y, x + 2) if it exists
                for i in range(1, N):
                    w[..., i, i] = 0.5 if (i - 1) % 4 < 2 else 1.0
                    if (i - 1) % 4 < 2:
                        w[..., i, i + 2] = 0.5
            return w
        return weights

    for block, kind in zip(model.blocks, ['self', 'uniform', 'class token', 'half']):
        block.attn.weights = pattern(kind)
    got = [{k: v.tolist() for k, v in figures.weight_shares(w, model.grid).items()}
           for w in figures.attention_weights(model.eval(), torch.randn(2, 3, 64, 64))]
    expected = [dict(own=1.0, near=0.0, **{'class': 0.0}),
                dict(own=1 / 16, near=5.25 / 16, **{'class': 1 / 17}),
                dict(own=1.0, near=0.0, **{'class': 0.5}), dict(own=0.75, near=0.0, **{'class': 0.0})]
    for layer, want in zip(got, expected):
        for key, value in want.items():
            assert layer[key] == pytest.approx([value] * 2, abs=1e-6), (key, layer)


def test_paper_eq6_share_is_measured_apart_from_the_weights():
    """Eq. 6's share is 0 without it; with it, a fraction in (0, 1); and all of the output where Eq. 5 gives
    0: with q = k = 0 every InLine weight is 1/N, so Eq. 5 returns the mean of v, which is 0 for tokens
    centred over the sequence and no v bias."""
    torch.manual_seed(0)
    sizes = dict(img_size=32, patch_size=8, depth=1, embed_dim=16, num_heads=2)
    with_eq6, without = (models.create_model('inline_deit_t', eq6=r, **sizes) for r in ('local', 'none'))
    x = torch.randn(3, 17, 16)  # (B, 1 + 4*4, C)
    with torch.no_grad():
        assert figures.eq6_share(without.blocks[0].attn, x, (4, 4)).tolist() == [0.0, 0.0]
        share = figures.eq6_share(with_eq6.blocks[0].attn, x, (4, 4))
        assert share.shape == (2,) and ((share > 0) & (share < 1)).all()
        attn = with_eq6.blocks[0].attn
        attn.qkv.weight[:32] = 0  # q = k = 0
        attn.qkv.bias.zero_()
        share = figures.eq6_share(attn, x - x.mean(1, keepdim=True), (4, 4))
        assert share.tolist() == pytest.approx([1.0, 1.0], abs=1e-5)


def test_paper_locality_and_maps_commands(tmp_path):
    """Untrained softmax attention (weights init std .02, so q.k ~ 0) is close to uniform: its shares are near
    the uniform lines the command prints. A name given twice is two seeds. Both commands draw their PNG."""
    softmax = tiny_deit_checkpoint(tmp_path / 'softmax.pt', layout='S')
    ours = tiny_deit_checkpoint(tmp_path / 'inline.pt', layout='I')
    results, uniform = cli.lab(['locality', '--checkpoints', f'softmax={softmax}', f'InLine={ours}',
                                   f'InLine={ours}', '--images', '4', '--out', str(tmp_path)])
    assert len(results['softmax']) == 1 and len(results['InLine']) == 2 and len(results['InLine'][0]) == 2
    assert uniform == pytest.approx({'own': 1 / 64, 'near': ((22 / 8) ** 2 - 1) / 64})
    for layer in results['softmax'][0]:
        assert layer['near'].tolist() == pytest.approx([uniform['near']], abs=2e-3)
        assert layer['class'].tolist() == pytest.approx([1 / 65], abs=2e-3) and layer['eq6'].tolist() == [0.0]
    assert all((layer['eq6'] > 0).all() for layer in results['InLine'][0])
    assert_png(tmp_path / 'locality.png', (500, 300))
    rows = cli.lab(['maps', '--checkpoints', f'softmax={softmax}', f'InLine={ours}', '--queries', '0,0',
                     '7,7',
                       '--out', str(tmp_path)])
    assert [label
            for label, _ in rows] == ['softmax, layer 1', 'softmax, layer 2', 'InLine, layer 1',
                                      'InLine, layer 2']
    assert_png(tmp_path / 'maps.png', (400, 500))


def test_paper_locality_keeps_its_measurements_beside_the_records(tmp_path, monkeypatch):
    """F4 of a run's checkpoint is measured once, trained and untrained, and kept in results/locality.jsonl:
    with the checkpoint gone the same table comes back from the file; a checkpoint that is neither here nor
    measured is a clear error."""
    ours = tiny_deit_checkpoint(tmp_path / 'inline.pt', layout='I')
    monkeypatch.setattr(figures, 'checkpoints', lambda args,
                        seeds=1: {'InLine': [('run-0', ours), ('run-1', ours)]})
    argv = ['locality', '--images', '4', '--out', str(tmp_path), '--results',
            str(tmp_path / 'r' / 'runs.jsonl')]
    first, _ = cli.lab(argv)
    assert sorted(first) == ['InLine', 'InLine, untrained'] and len(first['InLine']) == 2
    os.remove(ours)
    again, _ = cli.lab(argv)
    assert all(torch.equal(a[k], b[k]) for x, y in zip(first['InLine'], again['InLine']) for a, b in zip(x, y)
               for k in a)
    with pytest.raises(SystemExit):
        cli.lab(argv[:2] + ['8'] + argv[3:])  # 8 images: not measured, and the checkpoint is gone


def test_paper_measures_on_the_data_a_checkpoint_was_trained_on(tmp_path):
    """A checkpoint trained on Fashion-MNIST is measured on Fashion-MNIST's test images (its stored
    arguments), not on the synthetic task; --dataset/--data-path choose other images."""
    os.makedirs(tmp_path / 'fm')
    data = write_fashion_mnist(str(tmp_path / 'fm'), test=6)
    path = tiny_deit_checkpoint(tmp_path / 'inline.pt')
    ckpt = torch.load(path, weights_only=True)
    ckpt['args'].update(dataset='fashion_mnist', data_path=str(tmp_path / 'fm'))
    model = figures.load_trained(path)[0]
    args = argparse.Namespace(dataset=None, data_path=None, download=False)
    images, labels, classes, what = figures.eval_images(ckpt, model, args, 3)
    assert images.shape == (3, 3, 64, 64) and labels.tolist() == data['t10k'][1][::2].tolist()
    assert classes == datasets.FashionMNIST.classes and 'fashion_mnist' in what
    args.dataset = 'synthetic'
    assert 'synthetic' in figures.eval_images(ckpt, model, args, 3)[3]


def test_paper_bad_input_is_a_clear_error(tmp_path, capsys):
    ours = tiny_deit_checkpoint(tmp_path / 'inline.pt')
    (tmp_path / 'broken.png').write_bytes(b'not an image')
    swin = models.create_model('inline_swin_t', img_size=64, embed_dim=32, depths=(1, 1, 1, 1),
                               num_heads=(1, 1, 1, 1), num_classes=10)
    torch.save({'model': swin.state_dict(), 'arch': swin.arch, 'args': {'model': 'inline_swin_t'}},
               tmp_path / 'swin.pt')
    torch.save({'weights': 1}, tmp_path / 'other.pt')
    for argv, message in [
            (['maps', '--checkpoints', ours, '--image', str(tmp_path / 'broken.png')],
             'cannot read image .*broken.png'),
            (['locality', '--checkpoints', str(tmp_path / 'swin.pt')], 'needs an isotropic DeiT'),
            (['locality', '--checkpoints', str(tmp_path / 'other.pt')],
             'not a checkpoint written by train.py'),
            (['locality', '--checkpoints', str(tmp_path / 'none.pt')], 'no checkpoint at'),
            (['maps', '--checkpoints', ours, '--queries', '8,0'], '--queries must lie on the 8x8 token grid'),
            (['ablations', '--only', 'no_such_experiment', '--dataset', 'synthetic'], 'unknown experiments'),
            (['ablations', '--data-path', str(tmp_path / 'nothing')],
             'no fashion_mnist files in .*apt-get install dataset-fashion-mnist.*--download')]:
        with pytest.raises(SystemExit):
            cli.lab(argv + ['--out', str(tmp_path)])
        assert re.search('error: .*' + message, capsys.readouterr().err), argv


def test_paper_speed_level_prints_each_row_beside_its_goal_and_the_machine(monkeypatch, capsys):
    """--level: 1 and 2 threads x fp32 and bf16 x LEVEL's three rows, each timed at its own thread count,
    'met' exactly where the speed-up reaches the goal, inference rows beside their attention-free limit; the
    CPU named and the thread count put back."""
    seen = []
    monkeypatch.setattr(speed, 'attention_free_limit', lambda side, dtype: 1.25 if side == 224 else 1.5)

    def point(row, dtype, device, rounds, compiled):
        seen.append((torch.get_num_threads(), dtype, row[3], row[5]))
        return dict(dtype=str(dtype).split('.')[-1], softmax_ms=10.0, InLine_ms=10.0 / (0.5 + len(seen) / 10),
                    speedup=0.5 + len(seen) / 10)
    monkeypatch.setattr(speed, 'whole_point', point)
    threads = torch.get_num_threads()
    rows = cli.lab(['speed', '--level', '--rounds', '2'])
    assert torch.get_num_threads() == threads
    assert [s[0] for s in seen] == [1] * 6 + [2] * 6 and len(rows) == 12
    for (n, dtype, side, training), row in zip(seen, rows):
        goal = {(224, False): 1.0, (512, False): 1.3, (224, True): 1.0}[side, training]
        assert row[0] == n and row[3] == f'{side} px' and row[7] == f'>= {goal}x'
        assert row[8] == ('' if training else '1.25x' if side == 224 else '1.50x')
        assert row[9] == ('yes' if float(row[6][:-1]) >= goal else 'no')
    assert {row[9] for row in rows} == {'yes', 'no'}
    assert 'CPU: ' in capsys.readouterr().out


def test_paper_speed_level_limit_is_the_share_of_the_forward_outside_softmax(monkeypatch):
    """The attention-free limit: 1 / (1 - SDPA's share), the share of the top-level groups alone (a core's
    '  of which' parts and the copies counted wherever they are called are inside them already)."""
    groups = {'softmax attention (SDPA)': (2.0, 12), 'Linear layers (qkv, proj, MLP, head)': (6.0, 49),
              'other': (2.0, 30), "  of which dynamo's guards and wrappers": (9.0, 1),
              'every copy and cast (aten::copy_), wherever called': (9.0, 24)}
    monkeypatch.setattr(speed, 'forward_profile', lambda model, x, dtype, rounds: groups)
    assert speed.attention_free_limit(32, torch.float32) == pytest.approx(1 / (1 - 2.0 / 10.0))


def test_paper_speed_times_softmax_through_sdpa_only(tmp_path, monkeypatch, capsys):
    """The speed command on tiny DeiTs (the real points are minutes each on a CPU): one row per point, dtype
    and device, cached; and a softmax that builds its N x N weights explicitly is refused."""
    tiny = dict(depth=1, embed_dim=32, num_heads=1, num_classes=10)
    monkeypatch.setattr(speed, 'SPEED',
                        {'F5b': ('window', (32,), {}), 'F5c': ('image size', (32, 64), {64: 2.0})})
    monkeypatch.setattr(speed, 'speed_models', lambda figure, point, device: [
        models.create_model('inline_deit_t', img_size=point, layout=c, **tiny).eval() for c in 'SI'])
    monkeypatch.setattr(speed, 'speed_point', lambda *a, real=speed.speed_point,
                        **k: calls.append(a) or real(*a, **k))
    calls = []
    rows = cli.lab(['speed', '--batch', '1', '--rounds', '2', '--out', str(tmp_path)])
    assert [(r['figure'], r['point'], r['dtype']) for r in rows] == [
        (f, p, d) for d in ('float32', 'bfloat16') for f, p in (('F5b', 32), ('F5c', 32), ('F5c', 64))]
    assert all(r['softmax_img_s'] > 0 and r['inline_img_s'] > 0 and r['speedup'] > 0 for r in rows)
    assert_png(tmp_path / 'speed.png', (800, 300))
    cli.lab(['speed', '--batch', '1', '--rounds', '2', '--out', str(tmp_path)])
    assert len(calls) == 6  # the second run read every point from the cache

    class Explicit(torch.nn.Module):
        def forward(self, x):
            return torch.softmax(x @ x.transpose(-2, -1), dim=-1) @ x
    with pytest.raises(SystemExit):
        speed.check_sdpa(Explicit(), torch.randn(1, 4, 8))
    assert 'only through F.scaled_dot_product_attention' in capsys.readouterr().err


def test_paper_speed_dense_rows_cache_and_picture(tmp_path, monkeypatch):
    """speed --dense on tiny backbones (the real points are minutes each on a CPU): one row per comparison and
    size, with both forward times and peaks, kept and reused by a rerun."""
    tiny = dict(SMALL_SIZES['inline_pvt_t'], layout='IIII')
    monkeypatch.setattr(speed, 'DENSE', {'PVT': ('soft', 'inl')})
    monkeypatch.setattr(speed, 'DENSE_SIZES', ((64, 64), (64, 96)))
    monkeypatch.setattr(speed, 'dense_forward', lambda name, size, device: dense.create_backbone(
        'inline_pvt_t', **dict(tiny, layout='SSSS' if name == 'soft' else 'IIII')).eval())
    monkeypatch.setattr(speed, 'dense_peak_mb', lambda name, size, device: calls.append(name) or size[1] / 8)
    calls = []
    rows = cli.lab(['speed', '--dense', '--rounds', '2', '--out', str(tmp_path)])
    assert [(r['comparison'], r['size']) for r in rows] == [('PVT', [64, 64]), ('PVT', [64, 96])]
    assert all(r['softmax_ms'] > 0 and r['inline_ms'] > 0 and r['speedup'] > 0 for r in rows)
    assert [(r['softmax_mb'], r['inline_mb']) for r in rows] == [(8, 8), (12, 12)]
    assert_png(tmp_path / 'dense.png', (800, 800))
    cli.lab(['speed', '--dense', '--rounds', '2', '--out', str(tmp_path)])
    assert len(calls) == 4  # the second run read every point from the cache


def test_paper_dense_peak_rss_sees_what_a_forward_allocates():
    """The CPU peak is the rise of a fresh process's peak RSS over one forward: 64 MiB held during a forward
    shows. (In a process that has run other things, freed pages are reused and the rise can read 0.)"""
    code = ('import torch; from paper import speed; speed.dense_forward = lambda name, size, device: lambda '
            'x: torch.ones(size[0], 2**20).sum(); speed.dense_peak_rss("any", 16, 1)')  # float32: 16 * 4 MiB
    run = subprocess.run([sys.executable, '-c', code], capture_output=True, text=True, timeout=120, cwd=ROOT)
    assert run.returncode == 0, run.stderr
    assert 56 <= float(run.stdout.split()[-1]) <= 90, run.stdout


def fake_run(path, accs, epochs):
    os.makedirs(path, exist_ok=True)
    with open(os.path.join(path, 'metrics.jsonl'), 'w') as f:
        f.writelines(json.dumps({'epoch': e + 1, 'val_acc1': acc}) + '\n'
                     for e, acc in enumerate(accs[:epochs]))


class FakeTrain:
    """train.py stand-in for subprocess.Popen: records the command line and writes a finished run into its
    folder, top-1 `acc(seed, argv)` at the last epoch."""
    def __init__(self, acc=lambda seed, argv: 60.0 + seed):
        self.launched, self.acc = [], acc

    def __call__(self, argv, **kwargs):
        self.launched.append(argv)
        seed, epochs = int(argv[argv.index('--seed') + 1]), int(argv[argv.index('--epochs') + 1])
        fake_run(argv[argv.index('--output-dir') + 1], [50.0] * (epochs - 1) + [self.acc(seed, argv)], epochs)
        return types.SimpleNamespace(returncode=0, poll=lambda: 0, terminate=lambda: None, wait=lambda: 0)


def fake_record(run, acc):
    """A finished run's record, as train_runs writes it."""
    return dict(run._asdict(), argv=['paper', 'train', *run.argv], state='done', cpu_min=1.0, wall_min=1.0,
                epochs=[{'epoch': run.recipe['epochs'], 'val_acc1': acc}], machine={'cpu': 'test'},
                finished='')


def test_paper_ablations_reuse_records_and_train_the_rest(tmp_path, monkeypatch, capsys):
    """Runs with a record are read, not retrained; the others go to train.py with the experiment's miniature,
    its data and its precision on the command line, and append their records; the tables compare seed by seed,
    with the MDE, Holm's verdict and the φ = 0 floor's gate; --no-train rebuilds the same tables from the
    records alone, and the learning curves are drawn."""
    os.makedirs(tmp_path / 'fm')
    write_fashion_mnist(str(tmp_path / 'fm'))
    chosen = {n: registry.EXPERIMENTS[n] for n in ('t1_softmax', 't1_softmax_normalised_q')}
    chosen['floor_deit'] = ablations.experiments()['floor_deit']  # --only adds the family's floor: the gate
    monkeypatch.setattr(ablations, 'experiments', lambda dataset=None: chosen)
    results = str(tmp_path / 'runs.jsonl')
    args = ['ablations', '--only', *list(chosen)[:2], '--seeds', 'T1=3', '--epochs', '2', '--train-images',
            '64', '--jobs', '1',
            '--data-path', str(tmp_path / 'fm'), '--out', str(tmp_path), '--results', results]
    fake = FakeTrain()
    monkeypatch.setattr(runs.subprocess, 'Popen', fake)
    ns = argparse.Namespace(epochs=2, train_images=64, dataset='fashion_mnist',
                            data_path=str(tmp_path / 'fm'), device='cpu',
                            precision=ablations.PRECISION['cpu'])
    for seed, acc in ((0, 70.0), (1, 72.0), (2, 71.0)):  # softmax and the floor: every seed has its record
        runs.append_record(results,
                           fake_record(ablations.make_run('t1_softmax', chosen['t1_softmax'], seed, ns), acc))
        runs.append_record(results,
                           fake_record(ablations.make_run('floor_deit', chosen['floor_deit'], seed, ns),
                                       50.0))
    configs, rows = cli.lab(args)
    assert len(fake.launched) == 3 and all('t1_softmax_normalised_q' in a for a in fake.launched)
    argv0 = ablations.make_run('t1_softmax', chosen['t1_softmax'], 0, ns).argv
    assert argv0[:1] == ['t1_softmax'] and 'num_heads=1' in argv0  # 3 heads x 1/3: head dim 64
    assert argv0[argv0.index('--dataset'):argv0.index('--dataset') + 6] == [
        '--dataset', 'fashion_mnist', '--data-path', str(tmp_path / 'fm'), '--train-subset', '64']
    assert argv0[argv0.index('--amp') + 1] == ablations.PRECISION['cpu']  # explicit, never train.py's default
    assert configs[0][3] == '71.0 ± 1.0 (3)'
    assert [c[5] for c in configs] == ['+21.0', '+11.0', '+0.0']  # over the floor's 50
    # Welch of 60, 61, 62 (the fake runs) against 70, 72, 71: the family is this one comparison, two tests;
    # the fake runs keep no per-image results, so the interval is the seeds' only, and says so
    mean, se, df = stats.welch([60.0, 61.0, 62.0], [70.0, 72.0, 71.0])
    half = stats.half_width(se, df)
    ps = stats.tests(mean, se, df, -1.6)
    assert rows == [['T1', 't1_softmax_normalised_q − t1_softmax', '70.6 / 69.9 vs 72.2',
                     f'{mean:+.1f} [{mean - half:+.1f}, {mean + half:+.1f}]', 'seeds only', '3 / 3',
                     rows[0][6],
                     *(f'{p:.3f} / {q:.3f}' for p, q in zip(ps, stats.holm(ps))), rows[0][9], 'reproduced',
                     verdicts.CONFIRMATORY]]  # its row trained now, after the rules
    records = runs.read_records(results)
    assert len(records) == 9
    assert all(r['cpu_min'] >= 0 and r['machine'] for r in records.values())
    assert 'estimate for the 3 runs without a record' in capsys.readouterr().out
    assert_png(tmp_path / 'ablations.png', (300, 200))
    assert_png(tmp_path / 'curves.png', (300, 200))
    fake.launched.clear()
    assert cli.lab(args + ['--no-train']) == (configs, rows)
    assert fake.launched == []


def test_paper_ablations_rerun_prints_both_budgets_side_by_side(tmp_path, monkeypatch, capsys):
    """--rerun takes MOSAIC_RERUN's budget, rows and seeds a row (at most --seeds N: 1 for the pilot); each
    budget is a family of its own, printed in full, then side by side from the records alone, a comparison
    whose rows have no records at a budget saying "not yet run"; it refuses --only, which would train other
    rows at the rerun's budget."""
    monkeypatch.setattr(ablations, 'MOSAIC_RERUN', dict(epochs=3, precision='bf16', seeds={
        'r_residual_none': 3, 'r_residual_local': 3, 's_swin_t': 4, 'inline_swin_t': 3}))
    results, every = str(tmp_path / 'runs.jsonl'), ablations.experiments('fashion_recall')
    budget = ablations.MOSAIC_BUDGET['cpu']
    for epochs, precision, seeds, local, none in (  # none − local: -10 + (0, 1, -1, 0.5, -0.5) - seed
            (budget['epochs'], ablations.PRECISION['cpu'], 5, 80.0, (70.0, 72.0, 71.0, 73.5, 73.5)),
            (3, 'bf16', 3, 84.0, (84.1, 84.9, 86.0))):  # +0.1, -0.1, 0: well inside ±0.5
        ns = argparse.Namespace(epochs=epochs, train_images=budget['train_images'], dataset='fashion_recall',
                                data_path=str(tmp_path), device='cpu', precision=precision)
        for seed in range(seeds):  # the reference local + seed
            for name, acc in (('r_residual_local', local + seed), ('r_residual_none', none[seed])):
                runs.append_record(results, fake_record(ablations.make_run(name, every[name], seed, ns), acc))
    base = ['ablations', '--dataset', 'fashion_recall', '--rerun', '--data-path', str(tmp_path), '--out',
            str(tmp_path), '--results', results]
    monkeypatch.setattr(runs.subprocess, 'Popen', FakeTrain())
    cli.lab(base + ['--no-train'])
    out = capsys.readouterr().out
    assert '10 runs of 3 epochs' in out and '6 of 10 runs have their record' in out  # s_swin_t: 4 seeds
    assert out.count('The family "fashion_recall, 4 epochs') == 1 and out.count('The family "fashion_recall, '
                                                                                '3 epochs') == 1
    row = next(line for line in out.splitlines() if line.startswith('| r_residual_none − r_residual_local'))
    welch = stats.welch([84.1, 84.9, 86.0], [84.0, 85.0, 86.0])
    assert row.split(' | ')[1:4] == ['80.2 vs 82.4', '-10.0 [-12.3, -7.7] (5 / 5)', '']
    assert row.split(' | ')[5:] == ['+0.0 [-2.2, +2.2] (3 / 3)', '',
                                    f'not resolved; {verdicts.EXPLORATORY} |']  # records with no time
    assert 'robustness read' not in out  # 3 epochs: no evaluation at epoch 12 to read
    s_row = next(line for line in out.splitlines() if line.startswith('| s_swin_t − inline_swin_t'))
    assert s_row.endswith('| — |  | not yet run |')
    assert stats.tost_p(*welch) > 0.05  # 3 seeds a side cannot show ±0.5 at this spread
    cli.lab(base + ['--no-train', '--seeds', '1'])
    assert '3 runs of 3 epochs' in capsys.readouterr().out  # the pilot: seed 0 of each configuration
    for bad in (['--only', 'r_residual_none'], ['--seeds', 'S=2']):
        with pytest.raises(SystemExit):
            cli.lab(base + bad)
        assert '--rerun' in capsys.readouterr().err


def test_learning_curves_draw_both_sides_of_every_comparison(monkeypatch):
    """A panel holds its table's rows and each side of the comparisons it makes, though a side belongs to
    another table (P's InLine-Swin-T is R-res's row), one series per distinct configuration, the seeds'
    mean at each epoch."""
    drawn = {}
    monkeypatch.setattr(charts, 'charts', lambda path, panels, **kw: drawn.update(panels=panels))
    run = lambda name, seed: types.SimpleNamespace(key=lambda: (name, seed))
    chosen = {'r_residual_local': types.SimpleNamespace(table='R-res'),
              'p_transnormer_swin': types.SimpleNamespace(table='P')}
    planned = {n: [run(n, 0), run(n, 1)] for n in chosen}
    done = {(n, s): {'state': 'done', 'epochs': [{'epoch': 1, 'val_acc1': acc + s}, {'epoch': 2}]}
            for n, acc in (('r_residual_local', 80.0), ('p_transnormer_swin', 70.0)) for s in (0, 1)}
    charts.learning_curves('unused.png', chosen, planned, done,
                           [(('P',), 'p_transnormer_swin', 'r_residual_local')])
    panels = {p['title'].split(':')[0]: [(label, ys) for label, _, ys, _ in p['series']]
              for p in drawn['panels']}
    assert panels == {'R-res': [('local', [80.5])], 'P': [('TransNormer', [70.5]), ('local', [80.5])]}


def test_paper_device_cuda_is_refused_without_a_gpu(tmp_path, capsys):
    """--device cuda says plainly that there is no GPU here, before any run; nothing trains."""
    if torch.cuda.is_available():
        pytest.skip('a GPU is here: test_paper_device_cuda_plans_the_converging_scale covers it')
    with pytest.raises(SystemExit):
        cli.lab(['ablations', '--quick', '--device', 'cuda', '--dataset', 'synthetic', '--out',
                  str(tmp_path),
                    '--results', str(tmp_path / 'runs.jsonl')])
    assert '--device cuda: torch sees no CUDA device' in capsys.readouterr().err


@pytest.mark.skipif(not torch.cuda.is_available(), reason='needs CUDA')
def test_paper_device_cuda_plans_the_converging_scale():
    """On a GPU the same experiments get BUDGET['cuda']: every training image, epochs until flat, bf16, a
    validation every epoch; a recipe of its own, so its records never mix with the CPU's."""
    ns = argparse.Namespace(epochs=None, train_images=None, device='cuda', dataset='fashion_mnist',
                            data_path='x')
    ablations.resolve_budget(ns)
    every = ablations.experiments()
    run = ablations.make_run('r_residual_local', every['r_residual_local'], 0, ns)
    assert (ns.train_images, ns.epochs) == (60_000, ablations.BUDGET['cuda']['epochs'])
    assert run.recipe['device'] == 'cuda' and run.recipe['val_every'] == 1 and '--amp' in run.argv
    cpu = ablations.make_run('r_residual_local', every['r_residual_local'], 0,
                             argparse.Namespace(**{**vars(ns), 'device': 'cpu'}))
    assert cpu.key() != run.key()


def test_paper_family_adjusts_both_tests_of_every_comparison_together(tmp_path, monkeypatch):
    """Two comparisons whose ordering tests reject at 5% on their own (Welch p 0.035 and 0.046) enter the
    family with their TOSTs, four tests, and Holm over the four leaves neither: not resolved. A configuration
    two tables share is one row of the first table; each comparison row carries both tests' p's beside their
    adjusted ones, and the gate's comparison, with no paper number, none."""
    os.makedirs(tmp_path / 'fm')
    write_fashion_mnist(str(tmp_path / 'fm'))
    chosen = {n: registry.EXPERIMENTS[n] for n in ('t1_softmax', 't1_softmax_normalised_q', 's_deit_t')}
    chosen['inline_deit_t'] = ablations.experiments()['inline_deit_t']
    chosen['floor_deit'] = ablations.experiments()['floor_deit']
    monkeypatch.setattr(ablations, 'experiments', lambda dataset=None: chosen)
    offset = {'t1_softmax_normalised_q': (-4.0, -3.0, -2.0), 'inline_deit_t': (4.5, 3.25, 2.0)}

    # softmax (t1_softmax = s_deit_t) 70 at every seed; the others offset from it; the floor 60
    def acc(seed, argv):
        name = argv[argv.index('train') + 1]  # python -m paper train NAME ...
        return 60.0 if "feature_map='zero'" in argv else 70.0 + offset.get(name, (0.0, 0.0, 0.0))[seed]
    monkeypatch.setattr(runs.subprocess, 'Popen', FakeTrain(acc))
    configs, rows = cli.lab(['ablations', '--only', *chosen, '--seeds', '3', '--epochs', '2',
                              '--train-images', '64', '--jobs', '1', '--data-path', str(tmp_path / 'fm'),
                              '--out', str(tmp_path), '--results', str(tmp_path / 'runs.jsonl')])
    assert [c[0] for c in configs] == ['t1_softmax = s_deit_t', 't1_softmax_normalised_q *', 'inline_deit_t',
                                       'floor_deit *']
    assert [c[1] for c in configs] == ['T1, S', 'T1', 'S', 'floor']
    assert [r[1] for r in rows] == ['t1_softmax_normalised_q − t1_softmax', 's_deit_t − inline_deit_t',
                                    'inline_deit_t − floor_deit']
    welch = [stats.welch([70.0 + x for x in offset[n]], [70.0] * 3) for n in offset]
    raw = [stats.ordering_p(*w) for w in welch]  # 70 - (70 + offset): the second's sign flips, p stays
    assert raw == pytest.approx([0.0351, 0.0459], abs=5e-4)
    adjusted = stats.holm([raw[0], stats.tost_p(*welch[0]), raw[1], stats.tost_p(*welch[1])])
    assert [r[7] for r in rows[:2]] == [f'{raw[0]:.3f} / {adjusted[0]:.3f}',
                                        f'{raw[1]:.3f} / {adjusted[2]:.3f}']
    assert [r[10] for r in rows] == ['not resolved', 'not resolved', '—'] and rows[2][7] == ''


def test_paper_sigterm_stops_the_runs_and_keeps_their_cpu_time(tmp_path):
    """The lab stopped by SIGTERM stops the train.py it runs (here a stand-in that sleeps) and adds their CPU
    and wall time to the run's cpu.json before it exits, so a resumed run's record counts every attempt."""
    out = str(tmp_path)
    code = ('import argparse, subprocess, sys\nfrom paper import runs\nreal = '
            'subprocess.Popen\nsubprocess.Popen = lambda argv, **kw: real([sys.executable, "-c", "import '
            'time\\nwhile True: sum(range(9999))"], pass_fds=kw["pass_fds"])\nrun = runs.LabRun("x", "config", '
            f'{{"epochs": 1}}, 0, ["--seed", "0"])\nopen({out!r} + "/started", '
            f'"w").close()\nruns.train_runs([run], argparse.Namespace(jobs=1, results={out!r} + '
            f'"/runs.jsonl", no_train=False, device="cpu", out={out!r}))\n')
    proc = subprocess.Popen([sys.executable, '-c', code], cwd=ROOT)
    deadline = time.time() + 60
    while not glob_one(os.path.join(out, 'runs', 'x-seed0-*', 'train.log')) and time.time() < deadline:
        time.sleep(0.1)
    time.sleep(1.0)  # the stand-in spends some CPU
    proc.send_signal(signal.SIGTERM)
    assert proc.wait(timeout=60) == 143
    spent = json.load(open(os.path.join(glob_one(os.path.join(out, 'runs', 'x-seed0-*')), 'cpu.json')))
    assert spent['cpu_s'] > 0.2 and spent['wall_s'] > 0.5
    assert not os.path.exists(os.path.join(out, 'runs.jsonl'))  # not finished: no record


def glob_one(pattern):
    found = glob.glob(pattern)
    return found[0] if found else None


def test_paper_records_keep_the_first_of_a_run_and_refuse_a_bad_line(tmp_path, capsys):
    """The record store: one JSON line per run, appended; the first record of a run counts (a second is
    ignored); a run of another recipe or seed is another record; a line that is not a record stops with its
    number."""
    path = str(tmp_path / 'r' / 'runs.jsonl')
    assert runs.read_records(path) == {}
    run = runs.LabRun('x', 'config', {'epochs': 2}, 0, ['--seed', '0'])
    runs.append_record(path, fake_record(run, 50.0))
    runs.append_record(path, fake_record(run, 99.0))
    runs.append_record(path, fake_record(run._replace(recipe={'epochs': 3}), 60.0))
    runs.append_record(path, fake_record(run._replace(seed=1), 70.0))
    found = runs.read_records(path)
    assert len(found) == 3 and found[run.key()]['epochs'][-1]['val_acc1'] == 50.0
    with open(path, 'a') as f:
        f.write('{"not": "a record"}\n')
    with pytest.raises(SystemExit):
        runs.read_records(path)
    assert 'line 5, is not a record' in capsys.readouterr().err


def test_paper_run_lock_keeps_a_second_command_off_a_run(tmp_path, monkeypatch):
    """A run's lock is exclusive, and the train.py process inherits it: it holds after the parent lets go. A
    command that finds a run locked trains the others, waits for it, and takes its record without training
    it."""
    folder = str(tmp_path / 'run')
    fd = runs.lock_run(folder)
    assert fd is not None and runs.lock_run(folder) is None
    child = subprocess.Popen([sys.executable, '-c', 'import time; time.sleep(1.5)'], pass_fds=(fd,))
    os.close(fd)
    assert runs.lock_run(folder) is None  # the child still holds it
    child.wait()
    again = runs.lock_run(folder)
    assert again is not None
    os.close(again)

    results = str(tmp_path / 'runs.jsonl')
    planned = [runs.LabRun(f'x{i}', 'config', {'epochs': 1}, i, ['--epochs', '1', '--seed', str(i)])
               for i in range(2)]
    # another command trains run 0: it holds the lock, then records it
    other = planned[0].folder(str(tmp_path))
    code = (f'import json, time, os; from paper import runs; fd = runs.lock_run({other!r}); open({other!r} + '
            f'"/held", "w").close(); time.sleep(2); runs.append_record({results!r}, '
            f'json.loads({json.dumps(json.dumps(fake_record(planned[0], 42.0)))}))')
    holder = subprocess.Popen([sys.executable, '-c', code], cwd=ROOT)
    while not os.path.exists(os.path.join(other, 'held')):
        time.sleep(0.05)
    fake = FakeTrain()
    monkeypatch.setattr(runs.subprocess, 'Popen', fake)
    done = runs.train_runs(planned, argparse.Namespace(jobs=1, results=results, no_train=False, device='cpu',
                                                     out=str(tmp_path)))
    holder.wait()
    assert [a[a.index('--seed') + 1] for a in fake.launched] == ['1']  # run 0 was left to its holder
    assert done[planned[0].key()]['epochs'][-1]['val_acc1'] == 42.0 and planned[1].key() in done


def test_paper_runs_on_any_image_folder_with_the_small_recipe(tmp_path):
    """--dataset imagefolder --data-path DIR: the same runs on an ImageFolder, with the small datasets' recipe
    in place of the released ImageNet one (no Mixup, RandAugment, erasing or EMA; one process, no
    accumulation)."""
    root = str(tmp_path / 'data')
    write_image_folder(root, {'train': 2, 'val': 1})
    ns = argparse.Namespace(out=str(tmp_path), epochs=2, train_images=3, dataset='imagefolder',
                            data_path=root, download=False, device='cpu', precision='bf16')
    ablations.resolve_data(ns)
    run = train.Run(runs.train_args(ablations.make_run('inline_deit_t',
                                                       ablations.experiments()['inline_deit_t'], 0, ns).argv),
                                                       world=1)
    with tempfile.TemporaryDirectory() as empty, contextlib.chdir(empty):
        # as train.main resolves it, in an empty folder (no runs/ of an earlier run resumed)
        train.resolve(run)
    a = run.args
    assert (a.dataset, a.train_subset, a.epochs, a.accum_steps, a.ema_decay) == ('imagefolder', 3, 2, 1, 0.0)
    assert {k: getattr(a, k) for k in train.SMALL if k not in ('epochs', 'warmup_epochs')} == {
        k: v for k, v in train.SMALL.items() if k not in ('epochs', 'warmup_epochs')}
    assert a.warmup_epochs == round(2 / 12, 3)  # the budget's: 1/12 of the epochs
    assert len(train.load_data(a)[0]) == 3


def test_paper_refuses_a_folder_without_train(tmp_path, capsys):
    """An ImageFolder root without train/ is refused before any run starts, naming the folder."""
    os.makedirs(tmp_path / 'data' / 'val' / 'a')
    ns = argparse.Namespace(dataset='imagefolder', data_path=str(tmp_path / 'data'), download=False)
    with pytest.raises(SystemExit):
        ablations.resolve_data(ns)
    assert 'has no train/ folder' in capsys.readouterr().err


def test_paper_distinct_configurations_never_share_a_run():
    """Two different models never get the same train.py command line, so never the same run folder: the
    experiments outside registry.EXPERIMENTS (the released InLine variants, F4's DeiTs) carry their
    overrides."""
    every = {**ablations.experiments(), **figures.F4_EXTRA}
    ns = argparse.Namespace(epochs=1, train_images=8, dataset='synthetic', device='cpu', precision='bf16')
    owner = {}
    for name, e in every.items():
        argv = json.dumps(ablations.make_run(name, e, 0, ns).argv)
        assert owner.setdefault(argv, ablations.config_key(e)) == ablations.config_key(e), name
    assert "layout='L'" in ablations.make_run('deit_linear_relu', every['deit_linear_relu'], 0, ns).argv


def test_paper_ablation_subsets_share_the_runs_of_one_configuration(tmp_path, monkeypatch):
    """r_residual_local and t4_window56_residual build the same model: whichever subset asks for it, the run
    is the one of the registry's first name, so --only (or --quick) and the full run never train it twice."""
    every = {n: registry.EXPERIMENTS[n] for n in ('t4_window56_residual', 'r_residual_local')}
    monkeypatch.setattr(ablations, 'experiments', lambda dataset=None: every)
    fake = FakeTrain()
    monkeypatch.setattr(runs.subprocess, 'Popen', fake)
    common = ['--seeds', '1', '--epochs', '1', '--train-images', '64', '--jobs', '1', '--dataset',
              'synthetic', '--out', str(tmp_path), '--results', str(tmp_path / 'runs.jsonl')]
    cli.lab(['ablations', '--only', 'r_residual_local', *common])
    assert len(fake.launched) == 1
    assert fake.launched[0][fake.launched[0].index('train') + 1] == 't4_window56_residual'
    cli.lab(['ablations', '--only', 't4_window56_residual', *common])
    assert len(fake.launched) == 1  # recorded


def test_paper_every_ablation_miniature_builds_and_runs():
    """Each experiment's miniature (its overrides and the family's sizes) is a valid model on 64 px images, so
    a full ablation run cannot fail hours in; and the experiments that are one model share one
    configuration."""
    torch.manual_seed(0)
    chosen = ablations.experiments()
    for name, e in chosen.items():
        size = ablations.MINI[ablations.family(e)][0]
        model = models.create_model(e.model, img_size=size, num_classes=10,
                                    **{**e.overrides, **ablations.mini_kwargs(e)})
        assert model(torch.randn(1, 3, size, size)).shape == (1, 10), name
    keys = {name: ablations.config_key(e) for name, e in chosen.items()}
    assert (keys['r_residual_local'] == keys['t10_kernel_identity'] == keys['inline_swin_t']
            == keys['r_dilation1'])
    assert keys['t4_window56_no_residual'] == keys['r_residual_none'] == keys['t3_inline_identity']
    assert keys['t4_window28_residual'] != keys['t4_window56_residual'] != keys['t4_window56_no_residual']
    assert ablations.mini_kwargs(chosen['t4_window7_residual'])['window'] == 2  # 7/56 of the 16x16 stage 1
    assert (ablations.untestable(chosen['t4_window7_residual'])
            and not ablations.untestable(chosen['t4_window14_residual']))
    assert keys['floor_swin'] != keys['r_residual_none_no_ape']  # phi = 0: the same shapes, another model
    assert ablations.MINI['deit'][0] // ablations.MINI['deit'][2]['patch_size'] == 8  # DeiT's 8x8 grid


def test_paper_matched_row_has_eq6s_parameter_count_and_runs_of_its_own():
    """R-res's matched row is r_residual_none (no Eq. 6, the APE) with every MLP widened until it has
    r_residual_local's parameters, counted here, within 0.1%; it is compared with r_residual_local against the
    paper's -2.2, and a different model from r_residual_none, so it never shares that row's runs."""
    every = ablations.experiments()
    matched, local, none = (every[n]
                            for n in ('r_residual_none_matched', 'r_residual_local', 'r_residual_none'))
    counts = {}
    for name, e in (('matched', matched), ('local', local), ('none', none)):
        model = ablations.miniature(e)
        counts[name] = sum(p.numel() for p in model.parameters())
        if name == 'matched':
            assert model.options['eq6'] == 'none' and matched.overrides['mlp_ratio'] > 4
            assert all(m.fc1.out_features == int(m.fc1.in_features * matched.overrides['mlp_ratio'])
                       for m in model.modules() if isinstance(m, models.Mlp))
    assert counts['local'] - counts['none'] > 100_000  # Eq. 6's MLPs: the gap the widening closes
    assert abs(counts['matched'] - counts['local']) < 1e-3 * counts['local']
    assert ablations.config_key(matched) != ablations.config_key(none)
    assert (('R-res',), 'r_residual_none_matched', 'r_residual_local') in ablations.comparisons(every)
    assert ablations.paper_claim('r_residual_none_matched', 'r_residual_local', every)[1] == -2.2


def test_paper_record_keeps_the_final_per_image_results(tmp_path):
    """make_record keeps what train.py's final evaluation wrote of each test image (val_images in
    metrics.jsonl, val_correct.pt: True where top-1 is right) beside the per-epoch metrics, packed into the
    last epoch as val_correct, and drops what a table never reads (the architecture, the speed)."""
    correct = runs.pack_correct(torch.tensor([1, 0, 1]))
    with open(tmp_path / 'metrics.jsonl', 'w') as f:
        f.write(json.dumps({'epoch': 1, 'train_loss': 2.0, 'images_per_s': 9.0, 'arch': {}}) + '\n')
        f.write(json.dumps({'epoch': 2, 'val_acc1': 66.67, 'val_images': 3, 'arch': {}}) + '\n')
    torch.save(torch.tensor([True, False, True]), tmp_path / 'val_correct.pt')
    record = runs.make_record(runs.LabRun('x', 'config', {'epochs': 2}, 0, []), str(tmp_path), 'done', 1)
    assert record['epochs'] == [{'epoch': 1, 'train_loss': 2.0},
                                {'epoch': 2, 'val_acc1': 66.67, 'val_images': 3, 'val_correct': correct}]
    assert stats.summarise([record]).correct[0].tolist() == [True, False, True]


def test_paper_seeds_per_table(capsys):
    default = {'T3': 5, 'T1': 3}
    assert ablations.seeds_option(None, default) == default
    assert ablations.seeds_option(['T1=8'], default) == {'T3': 5, 'T1': 8}
    assert ablations.seeds_option(['2'], default) == {'T3': 2, 'T1': 2}
    assert ablations.seeds_option(['2', 'T3=6'], default) == {'T3': 6, 'T1': 2}
    for bad in ('T3=x', 'T9=3', '0'):
        with pytest.raises(SystemExit):
            ablations.seeds_option([bad], default)
        assert '--seeds takes N or TABLE=N' in capsys.readouterr().err


def test_paper_mosaic_bed_is_injective_and_runs_its_own_recipe(tmp_path):
    """python -m paper ablations --dataset fashion_recall: MOSAIC_ROWS alone, each miniature with head dim 8
    in every stage and every InLine layer of stages 1-3 at least D + 1 tokens (injective); each run trains on
    task 'below' at MOSAIC_BUDGET, new training mosaics a seed, the same 10,000 test mosaics every seed; 5
    seeds of every row; its comparisons include T1 within softmax and within InLine."""
    every = ablations.experiments('fashion_recall')
    assert (set(every) == set(ablations.MOSAIC_ROWS)
            and not set(ablations.MOSAIC_ONLY) & set(ablations.experiments()))
    for name, e in every.items():
        model = ablations.miniature(e)
        for stage, grid in zip(model.layers, models.stage_grids(model.img_size)):
            for block in stage.blocks:
                heads = block.attn.num_heads
                assert block.attn.qkv.in_features // heads == 8, name
                if block.letter == 'I' and name != 'floor_swin':  # the floor (phi = 0) selects nothing
                    side = grid[0] if model.window is None else min(model.window, grid[0])
                    assert side * side >= 8 + 1, (name, grid)
    root = str(tmp_path / 'fm')
    os.makedirs(root)
    write_fashion_mnist(root, train=40, test=20)
    ns = argparse.Namespace(out=str(tmp_path), epochs=None, train_images=None, dataset='fashion_recall',
                            data_path=root, download=False, device='cpu', quick=False, claims=False,
                            only=None, seeds=None)
    ablations.resolve_budget(ns)
    ablations.resolve_data(ns)
    assert (ns.epochs, ns.train_images) == (4, 20_000)
    chosen, seeds = ablations.choose(ns, every)
    assert all(seeds(n) == 5 for n in chosen)
    pairs = {(name, ref) for _, name, ref in ablations.comparisons(every)}
    assert {('t1_swin_softmax_normalised_q', 's_swin_t'), ('t1_inline_normalised_q', 'inline_swin_t'),
            ('inline_swin_t', 'floor_swin'), ('t3_linear_relu', 't3_inline_relu')} <= pairs


def test_paper_a_comparison_with_one_seed_of_per_image_results_is_not_run_yet():
    """One seed a side, with per-image results: the row says 'not yet run' with the one difference and no
    interval, rather than dividing by zero, and enters the family at p = 1; the gate row beside it has its
    interval from two seeds."""
    every = ablations.experiments()
    chosen = {n: every[n] for n in ('s_deit_t', 'inline_deit_t', 'floor_deit')}
    right = lambda p, seed: torch.rand(200, generator=torch.Generator().manual_seed(seed)) < p  # noqa: E731
    result = {'s_deit_t': stats.Summary({0: 80.0}, {0: right(0.8, 0)}, [], None),
              'inline_deit_t': stats.Summary({0: 81.0, 1: 82.0}, {0: right(0.81, 1), 1: right(0.82, 2)}, [],
                                             None),
              'floor_deit': stats.Summary({0: 40.0, 1: 41.0}, {0: right(0.4, 3), 1: right(0.41, 4)}, [],
                                          None)}
    configs, rows, points, m = ablations.table_rows(chosen, {n: [] for n in chosen}, result, every)
    one = next(r for r in rows if r[1].startswith('s_deit_t'))
    assert one[3] == '-1.5' and one[5] == '1 / 2' and one[10] == 'not yet run' and m == 1
    assert one[7:9] == ['1.000 / 1.000'] * 2 and points[rows.index(one)] is None
    gate = next(r for r in rows if r[1].startswith('inline_deit_t'))
    assert gate[3].startswith('+41.0 [') and gate[4] == 'seeds and test images' and gate[10] == '—'


def test_paper_a_batch_reads_no_verdict_before_its_planned_seeds():
    """Where the family's batch fixed its seeds (the 16-epoch rerun), a side with fewer records is still
    running: its difference and interval are printed, it enters Holm at p = 1 and is not drawn; with every
    planned seed in, the same records get their verdict (here, far apart, reproduced)."""
    every = ablations.experiments()
    chosen = {n: every[n] for n in ('s_deit_t', 'inline_deit_t', 'floor_deit')}
    seeds = lambda *accs: stats.Summary(dict(enumerate(accs)), {s: None for s in range(len(accs))}, [],  # noqa
                                        None)
    result = {'s_deit_t': seeds(70.0, 70.2, 69.8), 'inline_deit_t': seeds(80.0, 80.1, 79.9),
              'floor_deit': seeds(40.0, 41.0, 40.5)}
    planned = {n: [] for n in chosen}
    for batch, want in (({'s_deit_t': 12, 'inline_deit_t': 3, 'floor_deit': 3}, 'running (12 / 3 seeds planned)'),
                        ({n: 3 for n in chosen}, 'reproduced')):
        configs, rows, points, m = ablations.table_rows(chosen, planned, result, every, batch=batch)
        row = next(r for r in rows if r[1].startswith('s_deit_t'))
        assert row[3].startswith('-10.0 [') and row[10] == want and m == 1
        if want.startswith('running'):
            assert row[7:9] == ['1.000 / 1.000'] * 2 and points[rows.index(row)] is None
        else:
            assert float(row[7].split(' / ')[1]) < 0.05 and points[rows.index(row)] is not None
    # without a batch plan (the 4-epoch family) the same three seeds get their verdict
    assert next(r for r in ablations.table_rows(chosen, planned, result, every)[1]
                if r[1].startswith('s_deit_t'))[10] == 'reproduced'


def test_paper_mosaic_runs_draw_new_training_mosaics_a_seed_and_the_same_test_ones(tmp_path):
    """The mosaics' runs, as `python -m paper train` reads their command lines: task below, 20,000 training
    and 10,000 test mosaics; two seeds share their test mosaics and not their training ones."""
    root = str(tmp_path / 'fm')
    os.makedirs(root)
    write_fashion_mnist(root, train=40, test=20)
    every = ablations.experiments('fashion_recall')
    ns = argparse.Namespace(out=str(tmp_path), epochs=None, train_images=None, dataset='fashion_recall',
                            data_path=root, download=False, device='cpu')
    ablations.resolve_budget(ns)
    ablations.resolve_data(ns)
    planned = [runs.train_args(ablations.make_run('inline_swin_t', every['inline_swin_t'], seed, ns).argv)
               for seed in (0, 1)]
    assert [(a.dataset, a.recall_task, a.synthetic_train, a.synthetic_val, a.seed) for a in planned] == [
        ('fashion_recall', 'below', 20_000, 10_000, s) for s in (0, 1)]
    sets = [mosaics.load(argparse.Namespace(**{**vars(a), 'synthetic_train': 4, 'synthetic_val': 4}))
            for a in planned]
    assert torch.equal(sets[0][1][3][0], sets[1][1][3][0])  # the same test mosaic for both seeds
    assert not torch.equal(sets[0][0][3][0], sets[1][0][3][0])  # another training mosaic


@pytest.mark.parametrize('task, pairs, query',
                         [('recall', 2, 'other'), ('recall', 4, 'same'), ('below', None, None)])
def test_mosaics_labels_follow_from_each_mosaics_layout(tmp_path, task, pairs, query):
    """Every label of a batch of mosaics, checked against the layout: recall's keys and values distinct in
    class, each key right above its value, the framed query of one key's class (the key's own image with
    query='same'), the label that key's value; below's cells all filled, its framed item in row 1, the label
    the class right below it and distinct from the two cells in the same slot of the other 2x2 blocks (what a
    network without attention cannot tell apart). The pixels are the layout's items (at 14 px, in their cells)
    with the framed cell's border lit; test mosaics hold test images."""
    write_fashion_mnist(str(tmp_path), train=30, test=20)
    args = argparse.Namespace(data_path=str(tmp_path), recall_task=task, recall_pairs=pairs,
                              recall_query=query, synthetic_train=40, synthetic_val=30, seed=0, img_size=64)
    train_set, val_set = mosaics.load(args)
    assert (len(train_set), len(val_set)) == (40, 30) and train_set.classes == datasets.FashionMNIST.classes
    test_images, test_labels, _ = data.read_small('fashion_mnist', str(tmp_path), train=False)
    for i in range(30):
        classes, roles, images, label = val_set.layout(i)
        cells = {(r, c): (classes[r][c], roles[r][c], images[r][c]) for r in range(4) for c in range(4)}
        framed = [cell for cell, (_, role, _) in cells.items() if role in ('query', 'framed')]
        assert len(framed) == 1
        (fr, fc), = framed
        if task == 'recall':
            keys = [cell for cell, (_, role, _) in cells.items() if role == 'key']
            assert len(keys) == pairs and all(cells[r + 1, c][1] == 'value' for r, c in keys)
            assert len({cells[k][0] for k in keys}) == pairs == len({cells[r + 1, c][0] for r, c in keys})
            (kr, kc), = [k for k in keys if cells[k][0] == cells[fr, fc][0]]
            assert label == cells[kr + 1, kc][0]
            assert (cells[fr, fc][2] == cells[kr, kc][2]) == (query == 'same') or query == 'other'
        else:
            assert fr == 1 and cells[2, fc][1] == 'below' and label == cells[2, fc][0]
            assert all(source >= 0 for _, _, source in cells.values())
            # row 0 of each block, fc's column
            same_slot = [(r, c) for r in (0, 2) for c in (fc % 2, fc % 2 + 2)]
            assert len({cells[cell][0] for cell in same_slot if cell != (0, fc)}) == 3
        # the test split's
        assert all(test_labels[source] == c for c, _, source in cells.values() if source >= 0)
        x, y = val_set[i]
        pixels = (x * torch.tensor(data.STD)[:, None, None]
                  + torch.tensor(data.MEAN)[:, None, None])[0] * 255
        assert y == label and x.shape == (3, 64, 64)
        for (r, c), (_, role, source) in cells.items():
            inner = pixels[16 * r + 1:16 * r + 15, 16 * c + 1:16 * c + 15]
            expected = val_set.items[source].float() if source >= 0 else torch.zeros(14, 14)
            torch.testing.assert_close(inner, expected, rtol=0, atol=1e-3)
            border = pixels[16 * r:16 * r + 16, 16 * c:16 * c + 16].clone()
            border[1:-1, 1:-1] = 255 if role in ('query', 'framed') else 0
            assert (border == 255).all() if role in ('query', 'framed') else (border.abs() < 1e-3).all()
    if task == 'below':  # pairs and a query are recall's
        with pytest.raises(SystemExit):
            mosaics.FashionRecall(test_images, test_labels, 1, 0, False, task='below', pairs=3)

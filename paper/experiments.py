"""The paper's experiments by name: each a released variant and its create_model overrides, with the top-1 the
paper reports, and the two tables that list them.

InLine attention: Han et al., "Bridging the Divide: Reconsidering Softmax and Linear Attention", NeurIPS 2024,
arXiv 2412.06590. Run as `python -m paper models`, `experiments`, `train NAME` (paper/__main__.py).
"""
from typing import NamedTuple

import torch

import inline
import models
from paper.charts import print_table

# ---------------------------------------------------------------------------------------------------
# The paper's experiments (tables and figures; paper/experiments.py), each a variant and its
# overrides, by name, with the ImageNet-1K top-1 the paper (or its rebuttal, for the R- rows) reports

class Experiment(NamedTuple):
    model: str  # a registered variant
    overrides: dict  # for create_model
    table: str  # the paper's table or figure: T3, T4, T10, R-res, R-dil, R-nonneg, T1, S
    reported: str | None  # ImageNet-1K top-1 as the paper reports it
    ours: bool  # our construction: reported by the paper or rebuttal, but no code was released
    what: str


EXPERIMENTS = {}


def experiment(name, model, overrides, table, reported, what, ours=False):
    EXPERIMENTS[name] = Experiment(model, overrides, table, reported, ours, what)


# T3: division (vanilla linear) against subtraction (InLine) with the same phi, in InLine-Swin-T with
# global InLine windows, no local residual and therefore the authors' APE (ape=None turns it on)
T3 = {'relu': ('77.3', '79.8'), 'relu_affine': ('70.2', '80.0'), 'leakyrelu': ('does not converge', None),
      'identity': ('does not converge', '80.2')}
for phi, (linear, inline_) in T3.items():
    signed = phi not in inline.NON_NEGATIVE_PHI
    experiment(f't3_linear_{phi}', 'inline_swin_t',
               dict(layout='LLLS', feature_map=phi, eq6='none',
                    **({'allow_divergent': True} if signed else {})),
               'T3', linear, f'vanilla linear attention (division), phi = {phi}, no Eq. 6, APE',
               ours=phi == 'relu_affine')
    experiment(f't3_inline_{phi}', 'inline_swin_t', dict(feature_map=phi, eq6='none'), 'T3', inline_,
               f'InLine attention (subtraction), phi = {phi}, no Eq. 6, APE', ours=phi == 'relu_affine')
# T4: InLine windows 7^2 .. 56^2 (56 covers stage 1 at 224 px: global), without and with Eq. 6
for window, without, with_ in ((7, '80.3', '81.6'), (14, '80.4', '82.1'), (28, '80.2', '82.3'),
                               (56, '80.2', '82.4')):
    experiment(f't4_window{window}_no_residual', 'inline_swin_t', dict(window=window, eq6='none'), 'T4',
               without, f'InLine windows {window}x{window}, shifted on odd blocks, no Eq. 6, APE')
    experiment(f't4_window{window}_residual', 'inline_swin_t', dict(window=window), 'T4', with_,
               f'InLine windows {window}x{window}, shifted on odd blocks, with Eq. 6')
for phi, reported in (('identity', '82.4'), ('relu', '82.5'), ('leakyrelu', None), ('exp', 'about relu')):
    experiment(f't10_kernel_{phi}', 'inline_swin_t', dict(feature_map=phi), 'T10', reported,
               f'InLine-Swin-T with phi = {phi}')
experiment('r_residual_none', 'inline_swin_t', dict(eq6='none'), 'R-res', '80.2', 'no residual (APE)')
experiment('r_residual_plain', 'inline_swin_t', dict(eq6='plain'), 'R-res', '80.2',
           'plain residual o_i += r * v_i, r per channel from the same MLP (C -> C -> C) (APE)', ours=True)
experiment('r_residual_local', 'inline_swin_t', {}, 'R-res', '82.4', "Eq. 6's local 3x3 residual (released)")
# R-res's pair changes two things at once: Eq. 6 and the APE (on without Eq. 6). The other two corners of the
# 2x2 separate them: Eq. 6 against none with the same position embedding, both ways (ours; the paper has no
# numbers)
experiment('r_residual_none_no_ape', 'inline_swin_t', dict(eq6='none', ape=False), 'R-res', None,
           'no residual and no APE', ours=True)
experiment('r_residual_local_ape', 'inline_swin_t', dict(ape=True), 'R-res', None, "Eq. 6 and the APE",
           ours=True)
for dilation, reported in ((1, '82.4'), (2, '81.7'), (3, '80.8'), (4, '80.6')):
    experiment(f'r_dilation{dilation}', 'inline_swin_t', dict(dilation=dilation), 'R-dil', reported,
               f"Eq. 6's 3x3 neighbourhood dilated by {dilation}", ours=dilation > 1)
experiment('r_nonneg', 'inline_swin_t', dict(nonneg=True), 'R-nonneg', '81.7',
           'every InLine weight >= 0: q, k L2-normalised per head, s = 1/2', ours=True)
# T1 and S: the softmax originals have their own head counts (DeiT-T 3, PVT 1-2-5-8) and CSwin its own depths
experiment('t1_softmax', 'inline_deit_t', dict(layout='S', num_heads=3), 'T1', '72.2',
           'DeiT-T, softmax (injective)')
experiment('t1_softmax_normalised_q', 'inline_deit_t', dict(layout='S', num_heads=3, normalise_q='S'), 'T1',
           '70.6 / 69.9',
           'DeiT-T, softmax over L2-normalised queries times a learned per-head gain: q and a*q get '
           'the same weights', ours=True)
# T1 in Swin, for the test bed whose every InLine layer is injective (the fashion_recall ablations): softmax
# and InLine each against itself over L2-normalised queries (ours; the paper has no numbers)
experiment('t1_swin_softmax_normalised_q', 'inline_swin_t', dict(layout='SSSS', normalise_q='S'), 'T1', None,
           "Swin-T's windowed softmax over L2-normalised queries times a learned per-head gain", ours=True)
experiment('t1_inline_normalised_q', 'inline_swin_t', dict(normalise_q='I'), 'T1', None,
           'InLine-Swin-T, InLine over L2-normalised queries times a learned per-head gain (stage 4 '
           'softmax as it is)', ours=True)
for size in 'tsml':
    experiment(f's_pvt_{size}', f'inline_pvt_{size}', dict(layout='SSSS', num_heads=(1, 2, 5, 8)), 'S', None,
               f'PVT-{size.upper()}: softmax with spatial reduction 8-4-2-1 in the InLine-PVT skeleton')
for size, reported in (('t', '81.3'), ('s', None), ('b', None)):
    experiment(f's_swin_{size}', f'inline_swin_{size}', dict(layout='SSSS'), 'S', reported,
               f"Swin-{size.upper()}: shifted-window softmax in every stage")
for size, depths, reported in (('t', (1, 2, 21, 1), '82.7'), ('s', (2, 4, 32, 2), None),
                               ('b', (2, 4, 32, 2), None)):
    experiment(f's_cswin_{size}', f'inline_cswin_{size}', dict(layout='SSSS', depths=depths), 'S', reported,
               f"CSwin-{size.upper()}: cross-shaped stripe softmax in every stage, CSwin's own depths")
experiment('s_deit_t', 'inline_deit_t', dict(layout='S', num_heads=3), 'S', '72.2',
           'DeiT-T: softmax over all tokens')
# P: the peers the rebuttal measures InLine against, in Swin-T's skeleton (on the mosaic bed alone):
# FLatten-Swin-T (its README's 82.1) and TransNormer-Swin-T (the rebuttal's 79.9; ours: no code was released)
experiment('p_flatten_swin', 'flatten_swin_t', dict(window=56), 'P', '82.1',
           "FLatten's focused linear attention over the whole stage in stages 1-2, Swin's softmax in 3-4")
experiment('p_flatten_swin_subtraction', 'flatten_swin_t',
           dict(window=56, focused_normalisation='subtraction'), 'P', None,
           "FLatten-Swin-T with InLine's subtraction (Eq. 5) in place of its division: the rebuttal's "
           '"FLatten without division" (0.2 points lower)', ours=True)
experiment('p_transnormer_swin', 'transnormer_swin_t', {}, 'P', '79.9',
           "window softmax (DiagAttention) in stages 1-2, NormAttention in 3-4", ours=True)


def create_experiment(name, **overrides):
    """Build a paper experiment by name; overrides win over the experiment's (e.g. a smaller img_size)."""
    if name not in EXPERIMENTS:
        raise ValueError(f"unknown experiment {name!r}; choose one of {', '.join(EXPERIMENTS)}")
    e = EXPERIMENTS[name]
    return models.create_model(e.model, **{**e.overrides, **overrides})


def describe(model):
    """One line: the attention a model was built with, every switch resolved."""
    o = model.options
    parts = [f"{model.family}", f"layout {model.layout}",
             f"phi {o['feature_map'] or 'identity (I) / relu (L)'}", f"eq6 {o['eq6']}"]
    parts += ([f"local_size {o['local_size']}"] * (o['local_size'] != 3)
              + [f"dilation {o['dilation']}"] * (o['dilation'] > 1))
    parts += ['nonneg'] * o['nonneg']
    parts += ([f"normalise_q {o['normalise_q']}"] * bool(o['normalise_q'])
              + ['allow_divergent'] * o['allow_divergent'])
    if model.family == 'swin':
        parts.append('InLine windows: whole stage' if model.window is None else
                     f'InLine windows {model.window} (shifted on odd blocks, no mask)')
        parts.append(f"APE {'on' if model.ape else 'off'}")
    return ', '.join(parts)


# ---------------------------------------------------------------------------------------------------
# The paper's claims: the difference it reports between two rows, which a comparison tests

# The paper's claim for rows it has no number for but whose comparison tests one of its claims: R-res's
# corners of the 2x2 test "Eq. 6 adds 2.2 points" (its r_residual_local 82.4 against r_residual_none 80.2)
# with the APE held, and the matched row tests it parameter for parameter
CLAIMS = {'r_residual_none_no_ape': ('R-res: -2.2', -2.2), 'r_residual_local_ape': ('R-res: +2.2', 2.2),
          'r_residual_none_matched': ('R-res: -2.2', -2.2),
          # T1's claim, that softmax loses by losing injectivity (DeiT-T 72.2 -> 70.6 / 69.9), in Swin and in
          # InLine
          't1_swin_softmax_normalised_q': ('T1 (DeiT-T): -1.6', -1.6),
          't1_inline_normalised_q': ('T1 (DeiT-T): -1.6', -1.6),
          # the rebuttal: FLatten "without division" loses 0.2 points
          'p_flatten_swin_subtraction': ('rebuttal: -0.2', -0.2)}
# else t1_softmax
T1_REFERENCE = {'t1_swin_softmax_normalised_q': 's_swin_t', 't1_inline_normalised_q': 'inline_swin_t'}


def reported_value(text):
    """The paper's number as a float: the first figure given; 'does not converge' as -inf; None when
    unreported."""
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
    print("GMACs = torch.utils.flop_counter FLOPs / 2 (matmuls and convolutions). Ours are lower by the "
          "released\ncode's q.k_mean product alone (N*D per head), which the centred form of Eq. 5 does not "
          "need.")


def cmd_experiments(args):
    """Every experiment of the paper by name (EXPERIMENTS) at full size, with the paper's top-1."""
    rows = []
    for name, e in EXPERIMENTS.items():
        with torch.device('meta'):
            model = create_experiment(name)
        rows.append([name, e.table, e.model, f'{sum(p.numel() for p in model.parameters()):,}',
                     f'{models.count_macs(model) / 1e9:.2f}', e.reported or '-', '(ours) ' * e.ours + e.what])
    print_table(['experiment', 'table', 'model', 'params', 'GMACs', 'paper top-1', 'what'], rows)
    print("paper top-1: ImageNet-1K as the paper reports it; (ours): our construction, no code was "
          "released.\nTrain one: torchrun --standalone --nproc_per_node=2 -m paper train NAME")

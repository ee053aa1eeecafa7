"""The lab's statistics: Student's t from its own continued fraction, the intervals of paired comparisons over
seeds and test images, the minimum detectable effect, the verdicts (with equivalence) and Holm's adjustment,
the exact tests (the sign-flip test of paired seeds; Fisher's and Clopper-Pearson's for shares of seeds), and
the summary of a configuration's run records.

InLine attention: Han et al., "Bridging the Divide: Reconsidering Softmax and Linear Attention", NeurIPS 2024,
arXiv 2412.06590. No command of its own: `python -m paper ablations` and `python -m paper recall` read their
verdicts through these (RESULTS.md, "Verdicts").
"""
import functools
import itertools
import math
import statistics
from typing import NamedTuple

import torch

from paper.runs import unpack_correct


# Verdicts, fixed before the runs (RESULTS.md, "Verdicts"): t-tests of the mean difference of runs paired by
# seed, its error over seeds and over the test set's images, computed here from the t distribution itself (no
# table, no scipy); Holm's adjustment over a table's family

MARGIN = 1.0  # top-1 points: TOST's tie margin, and the effect the claim rows' seeds are chosen to detect
# the paper's own ties: rows 0.2 or less apart, as it reads T10 (82.4, 82.5) and T4 (82.3, 82.4)
PAPER_TIE = 0.2
# every test's level (two-sided; TOST 2.5% a side) and the power seeds are chosen for
ALPHA, POWER = 0.05, 0.8


def incomplete_beta(x, a, b):
    """The regularized incomplete beta function I_x(a, b) = B(x; a, b) / B(a, b), from its continued fraction
    x^a (1-x)^b / (a B(a, b)) / (1 + d1 / (1 + d2 / ...)), d_2m = m (b - m) x / ((a + 2m - 1)(a + 2m)),
    d_2m+1 = -(a + m)(a + b + m) x / ((a + 2m)(a + 2m + 1)), evaluated by Lentz's method; where it converges
    slowly (x above the mean (a + 1) / (a + b + 2)) through I_x(a, b) = 1 - I_1-x(b, a)."""
    if x <= 0 or x >= 1:
        return float(x >= 1)
    if x > (a + 1) / (a + b + 2):
        return 1 - incomplete_beta(1 - x, b, a)
    log_front = a * math.log(x) + b * math.log1p(-x) + math.lgamma(a + b) - math.lgamma(a) - math.lgamma(b)
    tiny, f, c, d = 1e-300, 1e-300, 1e-300, 0.0  # f = c = tiny stands for the fraction's leading 0
    for j in range(1, 1000):
        m = (j - 1) // 2
        num = (1.0 if j == 1 else m * (b - m) * x / ((a + 2 * m - 1) * (a + 2 * m)) if j % 2 == 1 else
               -(a + m) * (a + b + m) * x / ((a + 2 * m) * (a + 2 * m + 1)))  # j = 1: 1; then d_1, d_2, ...
        d = 1 / (1 + num * d if abs(1 + num * d) > tiny else tiny)
        c = 1 + num / c if abs(1 + num / c) > tiny else tiny
        f *= c * d
        if abs(c * d - 1) < 1e-15:
            break
    return math.exp(log_front) / a * f


def t_cdf(t, df):
    """P(T <= t) for Student's t with df degrees of freedom: 1 - I_x(df/2, 1/2) / 2 at x = df / (df + t^2)."""
    if math.isinf(t):
        return float(t > 0)
    tail = incomplete_beta(df / (df + t * t), df / 2, 0.5) / 2  # P(T > |t|)
    return 1 - tail if t > 0 else tail


@functools.lru_cache(maxsize=None)
def t_quantile(p, df):
    """The t with P(T <= t) = p, by bisection on t_cdf (to 1e-12); infinite without degrees of freedom."""
    if df < 1:
        return math.inf if p > 0.5 else -math.inf if p < 0.5 else 0.0
    lo, hi = -1.0, 1.0
    while t_cdf(lo, df) > p:
        lo *= 2
    while t_cdf(hi, df) < p:
        hi *= 2
    while hi - lo > 1e-12 * max(1.0, abs(hi)):
        mid = (lo + hi) / 2
        lo, hi = (mid, hi) if t_cdf(mid, df) < p else (lo, mid)
    return (lo + hi) / 2


def image_term(images):
    """(variance, its Satterthwaite term): what the test set's sampling adds to the variance of a comparison's
    mean difference (points²), from `images`, the per-image differences (seeds, M): 1 where only the row's
    model is right,
    -1 where only the reference's is. The two-way random-effects model (seed + image + residual), one run per
    seed and model, read by its mean squares: the mean's variance is (MS_seed + MS_image - MS_residual) / (n
    M), of which MS_seed / (n M) is the seeds' term (sd² / n of the per-seed differences) and (MS_image -
    MS_residual) / (n M) the test set's, kept at 0 or more; the second number is that term's share of
    Satterthwaite's denominator, (MS_image² / (M - 1) + MS_residual² / ((n - 1)(M - 1))) / (n M)²."""
    d = 100 * images.double()  # (n, M), points
    n, M = d.shape
    by_image = d.mean(0)  # (M,)
    ms_image = n * by_image.var().item()
    ms_residual = (d - d.mean(1, keepdim=True) - by_image
                   + d.mean()).pow(2).sum().item() / ((n - 1) * (M - 1))
    return (max(0.0, ms_image - ms_residual) / (n * M),
            (ms_image ** 2 / (M - 1) + ms_residual ** 2 / ((n - 1) * (M - 1))) / (n * M) ** 2)


def paired(diffs, images=None):
    """(mean, standard error, degrees of freedom) of a comparison's mean difference, from its per-seed
    differences (points) and, where given, the per-image differences behind them (image_term; their rows in
    the seeds' order). Seeds only: sd / sqrt(n) on n - 1 degrees of freedom, which holds the test set's images
    fixed and so leaves out their sampling error (it shrinks with images, never with seeds). With images, the
    test set's term is added, on Satterthwaite's degrees of freedom for the sum. Infinite error with one
    seed."""
    n, mean = len(diffs), statistics.mean(diffs)
    if n < 2:
        return mean, math.inf, 0
    seeds = statistics.variance(diffs) / n
    image_var, term = image_term(images) if images is not None else (0.0, 0.0)
    if image_var == 0:
        return mean, math.sqrt(seeds), n - 1
    return mean, math.sqrt(seeds + image_var), (seeds + image_var) ** 2 / (seeds ** 2 / (n - 1) + term)


def upper(mean, delta, se, df):
    """P(T > (mean - delta) / se): the one-sided p of "the true mean is delta or less"; with no spread (se =
    0, every seed alike) 0 or 1."""
    if se == 0:
        return 0.0 if mean > delta else 1.0 if mean < delta else 0.5
    return 1 - t_cdf((mean - delta) / se, df)


def interval(diffs, images=None):
    """(mean, half-width) of the 95% interval of a comparison's mean difference, t(0.975, df) times paired's
    standard error: over seeds, and over the test set's images where they are given; infinite with one
    seed."""
    mean, se, df = paired(diffs, images)
    return mean, t_quantile(1 - ALPHA / 2, df) * se if df else math.inf


def mde(sd, seeds, image_var=0.0):
    """The minimum detectable effect at 80% power: the true mean difference that the two-sided 5% paired
    t-test on `seeds` seeds rejects 0 for with probability 0.8, (t_0.975,n-1 + t_0.8,n-1) sqrt(sd² / n +
    image_var), the usual approximation to the noncentral t (it counts only the side the effect is on); sd,
    the comparison's own per-seed differences'; image_var, the comparison's image_term, which more
    seeds do not shrink."""
    if seeds < 2:
        return math.inf
    t = t_quantile(1 - ALPHA / 2, seeds - 1) + t_quantile(POWER, seeds - 1)
    return t * math.sqrt(sd ** 2 / seeds + image_var)


def seeds_for(sd, image_var=0.0, effect=MARGIN):
    """The fewest seeds (2 to 1000) whose mde is `effect` or less; None where none is (the test set's term
    alone can keep it above)."""
    return next((n for n in range(2, 1001) if mde(sd, n, image_var) <= effect), None)


def tost(mean, se, df):
    """(p that the true difference lies within +-MARGIN, p that it lies beyond it on one side): the two
    one-sided tests of -MARGIN and +MARGIN at 2.5% each (the 95% interval inside +-MARGIN), the larger p
    doubled to the 5% scale; and the whole interval outside +-MARGIN, likewise."""
    inside = max(upper(mean, -MARGIN, se, df), 1 - upper(mean, MARGIN, se, df))  # H0: <= -M; H0: >= M
    outside = min(upper(mean, MARGIN, se, df), 1 - upper(mean, -MARGIN, se, df))  # H0: <= M; H0: >= -M
    return min(1.0, 2 * inside), min(1.0, 2 * outside)


def is_tie(paper_diff):
    """A paper tie: its rows PAPER_TIE or less apart, as printed (80.2 - 80.0 is 0.2000000000000028)."""
    return round(abs(paper_diff), 1) <= PAPER_TIE


def p_values(diffs, paper_diff, images=None):
    """(p that the paper's claim is reproduced, p that it is contradicted), each rejected at ALPHA. A paper
    ordering: the two-sided paired t-test of a zero mean, counted on the side the mean is on. A paper tie
    (is_tie): tost, reproduced within +-MARGIN, contradicted beyond it. On paired's error: over seeds, and
    over the test set where images (image_term) are given."""
    mean, se, df = paired(diffs, images)
    if df < 1:
        return 1.0, 1.0
    if is_tie(paper_diff):
        return tost(mean, se, df)
    p = min(1.0, 2 * min(upper(mean, 0, se, df), 1 - upper(mean, 0, se, df)))
    return (p, 1.0) if mean != 0 and (mean > 0) == (paper_diff > 0) else (1.0, p)


EQUIVALENT = f'equivalent within ±{MARGIN:g}'


def decide(diffs, paper_diff, images=None):
    """(verdict, its p): the paper's difference paper_diff against ours, the per-seed differences diffs (row
    minus reference, seed by seed); ('—', None) when the paper gives no difference. An ordering is reproduced
    when the 95% interval excludes 0 on the paper's side, contradicted on the other; else EQUIVALENT when
    tost puts the interval within +-MARGIN (a size of effect the data rule out, whatever the paper's); a tie
    is reproduced when the interval lies within +-MARGIN, contradicted when wholly outside. Else not resolved,
    with its t-test's (or the tie's TOST's) smaller p. images: as in paired."""
    if paper_diff is None:
        return '—', None
    reproduce, contradict = p_values(diffs, paper_diff, images)
    if reproduce < ALPHA or contradict < ALPHA:
        return ('reproduced', reproduce) if reproduce < contradict else ('contradicted', contradict)
    mean, se, df = paired(diffs, images)
    inside = tost(mean, se, df)[0] if df >= 1 and not is_tie(paper_diff) else 1.0
    if inside < ALPHA:
        return EQUIVALENT, inside
    return 'not resolved', min(reproduce, contradict)


def sign_flip_p(diffs):
    """The exact two-sided p of the paired sign-flip (randomisation) test of a zero mean: were the two models
    alike, each seed's difference would be as likely negative as positive, so p is the share of the 2^n sign
    patterns whose mean lies as far from 0 as the observed one or farther. No normality and no test-set term:
    with n seeds it cannot go below 2 / 2^n (0.0625 at 5 seeds)."""
    if not diffs:
        return 1.0
    observed = abs(sum(diffs)) * (1 - 1e-12)
    far = sum(abs(sum(s * d for s, d in zip(signs, diffs))) >= observed
              for signs in itertools.product((1, -1), repeat=len(diffs)))
    return far / 2 ** len(diffs)


def welch(a, b):
    """b's mean minus a's, ± the Welch 95% half-width (t on Welch-Satterthwaite's degrees of freedom); '-'
    without two values on each side."""
    if len(a) < 2 or len(b) < 2:
        return '-'
    va, vb = statistics.variance(a) / len(a), statistics.variance(b) / len(b)
    diff = statistics.mean(b) - statistics.mean(a)
    if va + vb == 0:
        return f'{diff:+.1f} ± 0.0'
    df = (va + vb) ** 2 / (va ** 2 / (len(a) - 1) + vb ** 2 / (len(b) - 1))
    return f'{diff:+.1f} ± {t_quantile(1 - ALPHA / 2, df) * math.sqrt(va + vb):.1f}'


def holm(ps):
    """Holm's step-down adjustment of p-values [p_1 .. p_m], in their order: the i-th smallest is multiplied
    by m - i + 1, each kept at least the one before it, at most 1. Rejecting where the adjusted p < ALPHA
    keeps the chance of any false rejection among the m at ALPHA."""
    order, adjusted, running = sorted(range(len(ps)), key=lambda i: ps[i]), [1.0] * len(ps), 0.0
    for rank, i in enumerate(order):
        running = max(running, min(1.0, (len(ps) - rank) * ps[i]))
        adjusted[i] = running
    return adjusted


def beta_quantile(p, a, b):
    """The x with I_x(a, b) = p, by bisection on incomplete_beta (to 1e-12)."""
    lo, hi = 0.0, 1.0
    while hi - lo > 1e-12:
        mid = (lo + hi) / 2
        lo, hi = (mid, hi) if incomplete_beta(mid, a, b) < p else (lo, mid)
    return (lo + hi) / 2


def clopper_pearson(k, n):
    """The exact 95% interval (lo, hi) of a share from k successes in n trials: the shares whose binomial
    tails make k just significant at 2.5% each side, Beta(k, n - k + 1)'s 2.5% point and Beta(k + 1, n -
    k)'s 97.5% point (0 and 1 at the edges). It holds its coverage at any n, the few seeds here included."""
    lo = 0.0 if k == 0 else beta_quantile(ALPHA / 2, k, n - k + 1)
    hi = 1.0 if k == n else beta_quantile(1 - ALPHA / 2, k + 1, n - k)
    return lo, hi


def fisher_exact(k1, n1, k2, n2):
    """The two-sided p of Fisher's exact test that two shares (k1 of n1, k2 of n2) are equal: with the
    margins fixed, the successes of the first group are hypergeometric, and p sums the probabilities of every
    table no more likely than the observed one."""
    total, hits = n1 + n2, k1 + k2

    def prob(x):  # P(the first group has x of the hits)
        return math.comb(n1, x) * math.comb(n2, hits - x) / math.comb(total, hits)
    observed = prob(k1)
    return min(1.0, sum(q for x in range(max(0, hits - n2), min(n1, hits) + 1)
                        if (q := prob(x)) <= observed * (1 + 1e-9)))


class Summary(NamedTuple):
    """A configuration's runs: final-epoch top-1 by seed and which test images it got right by seed (None
    where the record predates train.py's per-image results), the seeds that diverged (left out of every mean
    and comparison, and listed), and the mean gain in top-1 over the last quarter of the epochs (near 0 where
    the curve is flat)."""
    top1: dict
    correct: dict
    diverged: list
    gain: float | None


def summarise(records):
    """The Summary of a configuration's records. A diverged run has no final top-1: counting it at a guess
    (10%) would put one extreme outlier into a t-test of seeds 1 point apart, so it is left out and named
    instead."""
    done = [r for r in records if r['state'] == 'done']
    gains = []
    for r in done:
        curve = [(e['epoch'], e['val_acc1']) for e in r['epochs'] if 'val_acc1' in e]
        earlier = [acc for epoch, acc in curve if epoch <= r['recipe']['epochs'] * 3 / 4]
        if earlier:
            gains.append(curve[-1][1] - earlier[-1])
    last = {r['seed']: r['epochs'][-1] for r in done}
    return Summary({s: e['val_acc1'] for s, e in sorted(last.items())},
                   {s: unpack_correct(e['val_correct'], e['val_images']) if 'val_correct' in e else None
                    for s, e in last.items()},
                   sorted(r['seed'] for r in records if r['state'] == 'diverged'),
                   statistics.mean(gains) if gains else None)


def matched(a, b):
    """A comparison of two Summaries, paired by seed number (the runs of one seed share their initialisation
    stream and data order; a seed one side lacks drops that pair, never shifts the others): (the seeds, the
    per-seed differences a - b in points, the per-image differences (seeds, images) where every run of those
    seeds kept its per-image results, else None)."""
    seeds = sorted(a.top1.keys() & b.top1.keys())
    diffs = [a.top1[s] - b.top1[s] for s in seeds]
    if not seeds or any(a.correct[s] is None or b.correct[s] is None for s in seeds):
        return seeds, diffs, None
    return seeds, diffs, torch.stack([a.correct[s].to(torch.int8) - b.correct[s].to(torch.int8)
                                      for s in seeds])

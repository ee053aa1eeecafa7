"""The lab's statistics, on scipy.stats: Welch's comparison of two configurations over seeds and the test
set's images, its ordering test and TOST, their power, Holm's adjustment, the verdict words; Boschloo's test
and Clopper-Pearson's interval for shares of seeds; one-sample intervals; the summary of a configuration's
runs.

InLine attention: Han et al., "Bridging the Divide: Reconsidering Softmax and Linear Attention", NeurIPS 2024,
arXiv 2412.06590. No command of its own: `python -m paper ablations` and `python -m paper recall` read their
verdicts through these, by the rules of RESULTS.md ("Verdicts"; "Recall, by the seeds that learn"). Every
distribution (t, noncentral t, binomial, Boschloo's) is scipy's; what is written here is the arithmetic of
means and variances around them, and Holm's few lines.
"""
import math
import statistics
from typing import NamedTuple

import numpy as np
from scipy import stats

from paper.runs import unpack_correct

ALPHA = 0.05  # every family's level: the chance of any false rejection in it
MARGIN = 0.5  # top-1 points: a difference that does not matter on the mosaics (RESULTS.md, "Verdicts")
# the paper's ties: rows 0.2 or less apart, as it reads T10 (82.4, 82.5) and T4 (80.4, 80.2)
PAPER_TIE = 0.2
POWER = 0.8  # the power the seeds are planned for
EQUIVALENT = f'equivalent within ±{MARGIN:g}'


# ---------------------------------------------------------------------------------------------------
# A comparison's difference: Welch over seeds, plus the test set's term


def residual_ms(y):
    """The residual mean square of a two-way table y (seeds, M) of one configuration's per-image scores:
    what is left after each seed's and each image's mean, on (n - 1)(M - 1) degrees of freedom."""
    n, M = y.shape
    r = y - y.mean(1, keepdims=True) - y.mean(0) + y.mean()
    return float((r ** 2).sum()) / ((n - 1) * (M - 1))


def image_term(a, b=None):
    """(variance, its share of Satterthwaite's denominator): what the test set's sampling adds to the
    variance of a mean (b None) or of a difference of means (a's minus b's), points². a, b: per-image scores
    (seeds, M), 100 where a run got the image right. D_j, the per-image mean over seeds (a's minus b's); its
    variance over images less each side's residual_ms / seeds estimates the model x image variance, which over
    M images adds itself / M (kept at 0 or more). With b None this is the two-way random-effects model of one
    configuration (seed + image + residual)."""
    sides = [a] if b is None else [a, b]
    M = a.shape[1]
    d = a.mean(0) - (0 if b is None else b.mean(0))  # (M,)
    parts = [(float(d.var(ddof=1)) / M, M - 1)] + [
        (residual_ms(y) / (len(y) * M), (len(y) - 1) * (M - 1)) for y in sides]
    var = max(0.0, parts[0][0] - sum(v for v, _ in parts[1:]))
    return var, sum(v ** 2 / df for v, df in parts)


def scores(correct):
    """(seeds, M) per-image scores in points from a list of boolean tensors, or None where any is missing."""
    if not correct or any(c is None for c in correct):
        return None
    return 100 * np.stack([c.numpy() for c in correct]).astype(np.float64)


def welch(a, b, images_a=None, images_b=None):
    """(Δ, its standard error, degrees of freedom) of mean(a) - mean(b) over two rows' seeds, unpaired:
    variance sd_a² / n_a + sd_b² / n_b, plus the test set's term where both rows give per-image scores
    (images_*, (seeds, M)), on Welch-Satterthwaite's degrees of freedom. Without images this is
    scipy.stats.ttest_ind(a, b, equal_var=False)'s (tested). Infinite error with under two seeds a side."""
    mean = statistics.mean(a) - statistics.mean(b)
    if len(a) < 2 or len(b) < 2:
        return mean, math.inf, 0
    va, vb = statistics.variance(a) / len(a), statistics.variance(b) / len(b)
    vi, term = (0.0, 0.0) if images_a is None or images_b is None else image_term(images_a, images_b)
    denominator = va ** 2 / (len(a) - 1) + vb ** 2 / (len(b) - 1) + term
    se = math.sqrt(va + vb + vi)
    return mean, se, (se ** 4 / denominator if denominator else math.inf)


def one_sample(values, images=None):
    """(mean, standard error, degrees of freedom) of one set of values over seeds (a model's recall; the
    differences of genuinely paired measurements), with the test set's term where images (seeds, M) are
    given, on Satterthwaite's degrees of freedom."""
    mean = statistics.mean(values)
    if len(values) < 2:
        return mean, math.inf, 0
    seeds = statistics.variance(values) / len(values)
    vi, term = (0.0, 0.0) if images is None else image_term(images)
    se = math.sqrt(seeds + vi)
    if se == 0:
        return mean, 0.0, len(values) - 1
    return mean, se, se ** 4 / (seeds ** 2 / (len(values) - 1) + term)


def half_width(se, df, level=1 - ALPHA):
    """The half-width of a two-sided `level` interval, t(1 - (1 - level) / 2, df) · se; infinite without
    degrees of freedom."""
    if df < 1 or math.isinf(se):
        return math.inf
    return float(stats.t.ppf(1 - (1 - level) / 2, df)) * se


def interval(values, images=None):
    """(mean, half-width) of one_sample's 95% interval."""
    mean, se, df = one_sample(values, images)
    return mean, half_width(se, df)


def welch_text(a, b):
    """b's mean minus a's ± Welch's 95% half-width, '-' without two values on each side."""
    if len(a) < 2 or len(b) < 2:
        return '-'
    mean, se, df = welch(b, a)
    return f'{mean:+.1f} ± {half_width(se, df) if se else 0.0:.1f}'


# ---------------------------------------------------------------------------------------------------
# The two tests of a comparison, Holm, the verdict


def upper(mean, delta, se, df):
    """P(T >= (mean - delta) / se): the one-sided p of H0 "the true difference is delta or less"."""
    if se == 0:
        return 0.0 if mean > delta else 1.0 if mean < delta else 0.5
    return float(stats.t.sf((mean - delta) / se, df))


def ordering_p(mean, se, df, margin=0.0):
    """The two-sided p of H0 |Δ| <= margin: twice the smaller one-sided p, against +margin and -margin. At
    margin 0, the t-test of Δ = 0 (a paper's ordering); at MARGIN, "beyond the margin" (a paper's tie)."""
    return min(1.0, 2 * min(upper(mean, margin, se, df), 1 - upper(mean, -margin, se, df)))


def tost_p(mean, se, df, margin=MARGIN):
    """TOST's p of H0 |Δ| >= margin (Schuirmann): the larger of the one-sided p's of H0 Δ <= -margin and
    H0 Δ >= +margin."""
    return max(upper(mean, -margin, se, df), 1 - upper(mean, margin, se, df))


def is_tie(paper_diff):
    """A paper tie: its rows PAPER_TIE or less apart, as printed (80.2 - 80.0 is 0.2000000000000028)."""
    return round(abs(paper_diff), 1) <= PAPER_TIE


def tests(mean, se, df, paper_diff):
    """(ordering p, TOST p) of a comparison against the paper's difference: a tie's ordering test is "beyond
    ±MARGIN", an ordering's "Δ = 0"; (1, 1) without degrees of freedom."""
    if df < 1 or math.isinf(se):
        return 1.0, 1.0
    return ordering_p(mean, se, df, MARGIN if is_tie(paper_diff) else 0.0), tost_p(mean, se, df)


def holm(ps):
    """Holm's step-down adjustment of p's in their order: the i-th smallest times m - i + 1, each at least
    the one before, at most 1. Rejecting where the adjusted p < ALPHA keeps the chance of any false
    rejection among the m at ALPHA, whatever their dependence."""
    adjusted, running = [1.0] * len(ps), 0.0
    for rank, i in enumerate(sorted(range(len(ps)), key=lambda i: ps[i])):
        running = max(running, min(1.0, (len(ps) - rank) * ps[i]))
        adjusted[i] = running
    return adjusted


def verdict(paper_diff, mean, q_order, q_tost, half=0.0):
    """The verdict word from the Holm-adjusted p's (RESULTS.md, "Verdicts"). A paper tie: reproduced by TOST,
    contradicted by the test of "beyond ±MARGIN". A paper ordering: reproduced or contradicted by the side
    its t-test rejects on (noting where TOST also puts it within the margin), else EQUIVALENT by TOST. A
    contradiction of a paper gap under the margin, whose 95% interval (mean ± half) reaches inside the margin,
    reverses a difference that does not matter on either side, and says so."""
    if is_tie(paper_diff):
        return 'reproduced' if q_tost < ALPHA else 'contradicted' if q_order < ALPHA else 'not resolved'
    if q_order < ALPHA:
        same = (mean > 0) == (paper_diff > 0)
        if q_tost < ALPHA:
            return ('reproduced' if same else 'contradicted') + f' (within ±{MARGIN:g})'
        if not same and abs(paper_diff) < MARGIN and abs(mean) - half < MARGIN:
            return f'contradicted: the opposite sign, within ±{MARGIN:g}'
        return 'reproduced' if same else 'contradicted'
    return EQUIVALENT if q_tost < ALPHA else 'not resolved'


def planned(sd_a, n_a, sd_b, n_b):
    """(se, df) of a Welch comparison planned at these sds and seeds, without the test set's term: welch's
    variance on Welch-Satterthwaite's degrees of freedom."""
    va, vb = sd_a ** 2 / n_a, sd_b ** 2 / n_b
    return math.sqrt(va + vb), (va + vb) ** 2 / (va ** 2 / (n_a - 1) + vb ** 2 / (n_b - 1))


def power(se, df, level, margin=MARGIN):
    """(TOST's power at Δ = 0, the ordering test's at |Δ| = margin) of a comparison whose difference has
    standard error se on df degrees of freedom (welch's, the test set's term included where it has one, or
    planned's), at `level`, from the noncentral t with noncentrality margin / se. TOST's is the bound
    1 - 2 P(T' <= t(1 - level)): each one-sided test fails with that chance at most."""
    if df < 1 or math.isinf(se):
        return 0.0, 0.0
    nc = margin / se
    tost = 1 - 2 * stats.nct.cdf(stats.t.ppf(1 - level, df), df, nc)
    return max(0.0, float(tost)), float(stats.nct.sf(stats.t.ppf(1 - level / 2, df), df, nc))


def seeds_for(sd, n_ref, level, which=0, most=100):
    """The fewest seeds (2 to `most`) of a row that give power(...)[which] >= POWER against a reference of
    n_ref seeds (None: as many as the row), both at sd; None where none does."""
    return next((n for n in range(2, most + 1)
                 if power(*planned(sd, n, sd, n_ref or n), level)[which] >= POWER), None)


# ---------------------------------------------------------------------------------------------------
# Shares of seeds: Boschloo and Clopper-Pearson


def boschloo(k1, n1, k2, n2):
    """Boschloo's exact two-sided p that two shares (k1 of n1, k2 of n2) are equal: each group's size is
    fixed, the design this unconditional test is built for (scipy.stats.boschloo_exact)."""
    return float(stats.boschloo_exact([[k1, k2], [n1 - k1, n2 - k2]], alternative='two-sided').pvalue)


def clopper_pearson(k, n):
    """The exact 95% interval (lo, hi) of a share, k of n (scipy.stats.binomtest's Clopper-Pearson)."""
    ci = stats.binomtest(k, n).proportion_ci(confidence_level=1 - ALPHA, method='exact')
    return ci.low, ci.high


# ---------------------------------------------------------------------------------------------------
# A configuration's runs


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
                    for s, e in sorted(last.items())},
                   sorted(r['seed'] for r in records if r['state'] == 'diverged'),
                   statistics.mean(gains) if gains else None)


def compare(a, b):
    """Welch's (Δ, se, df) of Summary a minus Summary b on all their seeds, with the test set's term where
    every run of both kept its per-image results."""
    return welch(list(a.top1.values()), list(b.top1.values()),
                 scores(list(a.correct.values())), scores(list(b.correct.values())))


def seed_correlation(a, b):
    """The correlation of two Summaries' top-1 over the seed numbers they share (nan under 3): what pairing
    by seed would gain (positive) or cost (negative)."""
    seeds = sorted(a.top1.keys() & b.top1.keys())
    x, y = [a.top1[s] for s in seeds], [b.top1[s] for s in seeds]
    if len(seeds) < 3 or statistics.pstdev(x) == 0 or statistics.pstdev(y) == 0:
        return math.nan
    return float(stats.pearsonr(x, y).statistic)

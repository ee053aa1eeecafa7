"""Tests of the lab's statistics (paper/stats.py): Welch and its test-set term against scipy and a simulation,
the ordering test and TOST against their intervals, the verdict words, Holm, power against a simulation,
Boschloo and Clopper-Pearson against their definitions, and how a configuration's runs are summarised.

InLine attention, arXiv 2412.06590. Run as `python -m pytest -q paper`; skipped where scipy is absent (the
lab's own requirements, paper/requirements.txt).
"""
import math

import numpy as np
import pytest
import torch

pytest.importorskip('scipy.stats')
from scipy import stats as scipy_stats  # noqa: E402

from paper import ablations, runs, stats  # noqa: E402


def test_welch_without_images_is_scipys_ttest_ind():
    """Without the test set's term, welch's Δ, degrees of freedom and ordering p are scipy's Welch t-test's,
    and TOST's p is the larger of scipy's two one-sided tests against ±MARGIN."""
    g = np.random.default_rng(0)
    for n_a, n_b, shift in ((5, 10, 0.3), (3, 3, 0.0), (12, 5, -1.0)):
        a, b = list(84 + shift + 0.3 * g.standard_normal(n_a)), list(84 + 0.2 * g.standard_normal(n_b))
        mean, se, df = stats.welch(a, b)
        scipys = scipy_stats.ttest_ind(a, b, equal_var=False)
        assert mean == pytest.approx(np.mean(a) - np.mean(b)) and df == pytest.approx(scipys.df)
        assert stats.ordering_p(mean, se, df) == pytest.approx(scipys.pvalue)
        m = stats.MARGIN
        lower = scipy_stats.ttest_ind(np.add(a, m), b, equal_var=False, alternative='greater').pvalue
        upper = scipy_stats.ttest_ind(np.subtract(a, m), b, equal_var=False, alternative='less').pvalue
        assert stats.tost_p(mean, se, df) == pytest.approx(max(lower, upper))
    assert stats.welch([1.0], [2.0, 3.0])[1:] == (math.inf, 0)


def test_tost_p_is_the_larger_one_sided_p_not_the_p_of_beyond_the_margin():
    """A difference of +1.1 ± 0.1 lies beyond +0.5: TOST's p (the larger one-sided p, here that of H0
    Δ >= +0.5) is near 1, while the test of "beyond ±0.5" rejects; the two are different numbers (the p once
    printed for T4 at 16 epochs was the second)."""
    tost, beyond = stats.tost_p(1.1, 0.1, 12), stats.ordering_p(1.1, 0.1, 12, stats.MARGIN)
    assert tost > 0.99 and beyond < 0.001
    assert stats.tests(1.1, 0.1, 12, 0.2) == (beyond, tost)  # a paper tie: "beyond", then TOST
    assert stats.tests(1.1, 0.1, 12, -1.6) == (stats.ordering_p(1.1, 0.1, 12), tost)  # an ordering: Δ = 0


def test_the_tests_cross_five_percent_where_their_intervals_edges_do():
    """The ordering test rejects at 5% exactly when the 95% interval excludes 0; TOST exactly when the 90%
    interval lies inside ±MARGIN."""
    se, df = 0.1, 8
    for shift in (-0.002, 0.002):
        edge = stats.half_width(se, df)
        assert (stats.ordering_p(edge + shift, se, df) < 0.05) == (shift > 0)
        inside = stats.MARGIN - stats.half_width(se, df, level=0.9)
        assert (stats.tost_p(inside - shift, se, df) < 0.05) == (shift > 0)


@pytest.mark.parametrize('paper_diff,mean,q_order,q_tost,expected', [
    (-1.6, -2.0, 0.01, 1.0, 'reproduced'),  # the ordering test rejects on the paper's side
    (-1.6, +2.0, 0.01, 1.0, 'contradicted'),  # ... on the other
    (-1.1, -0.1, 0.30, 0.01, stats.EQUIVALENT),  # only TOST: no difference that matters
    (-2.2, -0.3, 0.01, 0.02, 'reproduced (within ±0.5)'),  # both: a real difference, smaller than 0.5
    (-2.5, +0.6, 0.01, 0.60, 'contradicted'),  # the paper's gap beyond the margin: a plain reversal
    (-0.3, +0.49, 0.01, 0.45, 'contradicted: the opposite sign, within ±0.5'),  # a gap under it, reversed
    (-1.6, -0.1, 0.30, 0.20, 'not resolved'),  # neither
    (0.2, 0.1, 1.0, 0.01, 'reproduced'),  # a paper tie: TOST
    (0.2000000000000028, 1.1, 0.01, 1.0, 'contradicted'),  # a tie as printed, "beyond ±0.5" rejects
    (0.0, 0.3, 0.30, 0.20, 'not resolved'),
    (float('-inf'), -60.0, 0.001, 1.0, 'reproduced')])  # 'does not converge' against a number
def test_verdict_words(paper_diff, mean, q_order, q_tost, expected):
    assert stats.verdict(paper_diff, mean, q_order, q_tost) == expected


def test_a_reversal_of_a_gap_under_the_margin_says_so_only_where_the_interval_reaches_inside_it():
    """The paper's -0.3 reversed: 'the opposite sign, within ±0.5' while the 95% interval reaches inside
    ±0.5 (+0.49 ± 0.25, FLatten's at 16 epochs); a plain 'contradicted' once it lies wholly beyond (+0.9 ±
    0.3)."""
    assert stats.verdict(-0.3, 0.49, 0.01, 0.45, half=0.25) == 'contradicted: the opposite sign, within ±0.5'
    assert stats.verdict(-0.3, 0.9, 0.01, 1.0, half=0.3) == 'contradicted'


def test_holm_adjusts_against_a_worked_example():
    """Holm: sorted 0.005, 0.01, 0.03, 0.04 times 4, 3, 2, 1 -> 0.02, 0.03, 0.06, 0.04, kept increasing ->
    0.06."""
    assert stats.holm([0.01, 0.04, 0.03, 0.005]) == pytest.approx([0.03, 0.06, 0.06, 0.02])
    assert stats.holm([0.5, 0.9]) == [1.0, 1.0] and stats.holm([]) == []


def test_power_against_a_simulation():
    """power's two figures against 20,000 simulated Welch comparisons at 6 and 8 seeds, sd 0.25, at 0.0025,
    each test on its own Welch-Satterthwaite degrees of freedom, as the family's: the ordering test at a true
    0.5 within 0.05 of the noncentral t on planned's degrees of freedom (about 10.9), and nearer it than on
    n_a + n_b - 2 = 12, the count the power column once used; TOST at a true 0 (a lower bound: the simulation
    reaches it or more); seeds_for finds the fewest seeds that reach 80%."""
    g = np.random.default_rng(0)
    level, sd, n_a, n_b = 0.0025, 0.25, 6, 8
    se, df = stats.planned(sd, n_a, sd, n_b)
    tost, order = stats.power(se, df, level)
    for truth, which in ((0.5, 0), (0.0, 1)):
        a = truth + sd * g.standard_normal((20_000, n_a))
        b = sd * g.standard_normal((20_000, n_b))
        va, vb = a.var(1, ddof=1) / n_a, b.var(1, ddof=1) / n_b
        mean, se_each = a.mean(1) - b.mean(1), np.sqrt(va + vb)
        df_each = (va + vb) ** 2 / (va ** 2 / (n_a - 1) + vb ** 2 / (n_b - 1))  # each comparison's own
        if which == 0:
            hits = np.abs(mean / se_each) > scipy_stats.t.ppf(1 - level / 2, df_each)
            assert abs(hits.mean() - order) < 0.05
            assert abs(hits.mean() - order) < abs(hits.mean() - stats.power(se, n_a + n_b - 2, level)[1])
        else:
            t = scipy_stats.t.ppf(1 - level, df_each)
            hits = ((mean + stats.MARGIN) / se_each > t) & ((stats.MARGIN - mean) / se_each > t)
            assert tost - 0.01 <= hits.mean() <= tost + 0.15
    n = stats.seeds_for(sd, None, level)
    assert stats.power(*stats.planned(sd, n, sd, n), level)[0] >= 0.8 > stats.power(
        *stats.planned(sd, n - 1, sd, n - 1), level)[0]


def test_power_counts_the_test_sets_term_and_welchs_degrees_of_freedom():
    """The power column is the test's own: at the se and degrees of freedom welch gives with the test set's
    term, lower than at the seeds' variance alone; and planned's degrees of freedom are Welch-Satterthwaite's,
    n_a + n_b - 2 only where the two rows have the same seeds and sd (5 against 10 at one sd: about 8.1, not
    13)."""
    g = np.random.default_rng(1)
    a, b = list(85 + 0.29 * g.standard_normal(10)), list(84.4 + 0.28 * g.standard_normal(10))
    kind = g.random(2000) < 0.5  # images one model gets right more often and the other less
    images = [100.0 * (g.random((10, 2000)) < np.where(kind, hi, lo))
              for hi, lo in ((0.95, 0.75), (0.74, 0.94))]
    seeds_only, with_images = stats.welch(a, b), stats.welch(a, b, *images)
    assert with_images[1] > seeds_only[1]
    assert stats.power(*with_images[1:], 0.0025)[0] < stats.power(*seeds_only[1:], 0.0025)[0]
    assert stats.planned(0.25, 6, 0.25, 6)[1] == pytest.approx(10)
    welch_df = 0.01875 ** 2 / (0.0125 ** 2 / 4 + 0.00625 ** 2 / 9)  # about 8.1
    assert stats.planned(0.25, 5, 0.25, 10)[1] == pytest.approx(welch_df)
    assert stats.power(math.inf, 0, 0.0025) == (0.0, 0.0)


def test_welch_with_the_test_sets_term_covers_a_known_difference():
    """600 simulated comparisons of two models on 500 test images drawn from four kinds (so the true
    difference, 1 point, is known exactly for the population of images), 5 runs of each model, each run
    shifted by its own seed: the Welch interval with the test set's term covers the truth in 92-98% of them;
    the seeds-only interval, which holds the test set fixed, covers it far less often."""
    g = np.random.default_rng(0)
    sims, seeds, images = 600, 5, 500
    share, pa, pb = np.array([(0.5, .98, .98), (0.2, .95, .45), (0.2, .5, .95), (0.1, .2, .2)]).T
    truth = 100 * (share * (pa - pb)).sum()  # 0.2 (0.5) + 0.2 (-0.45) = 0.01
    covered = {'images': 0, 'seeds': 0}
    for _ in range(sims):
        kind = g.choice(4, images, p=share)  # this test set
        runs_of = {}
        for side, p in (('a', pa), ('b', pb)):
            shift = 0.004 * g.standard_normal((seeds, 1))  # each run's own seed
            runs_of[side] = 100.0 * (g.random((seeds, images)) < p[kind] + shift)
        top1 = {side: list(y.mean(1)) for side, y in runs_of.items()}
        for over, given in (('images', (runs_of['a'], runs_of['b'])), ('seeds', (None, None))):
            mean, se, df = stats.welch(top1['a'], top1['b'], *given)
            covered[over] += abs(mean - truth) <= stats.half_width(se, df)
    assert 0.92 * sims <= covered['images'] <= 0.98 * sims and covered['seeds'] < 0.85 * sims, covered


def test_one_sample_interval_against_the_t_table():
    mean, half = stats.interval([1.0, 2.0, 3.0])  # sd 1, 3 seeds: t(0.975, 2) = 4.303
    assert mean == 2.0 and half == pytest.approx(4.303 / math.sqrt(3), abs=1e-3)
    assert stats.interval([1.0])[1] == math.inf
    # Welch at equal sizes and variances: df 2, se sqrt(1 + 1), b's mean minus a's
    assert stats.welch_text([1.0, 3.0], [4.0, 6.0]) == f'+3.0 ± {4.3027 * math.sqrt(2):.1f}'
    assert stats.welch_text([1.0], [4.0, 6.0]) == '-'


def test_boschloo_and_clopper_pearson_against_their_definitions():
    """Boschloo's p of 4 of 4 against 0 of 4: the observed table and its mirror are the most extreme, each
    1/2^8 at the nuisance share 1/2 that maximises them, so 2/256; never above Fisher's. Clopper-Pearson's
    interval: at 0 of n it is [0, 1 - 0.025^(1/n)], and its edges leave 2.5% of the binomial on each side."""
    assert stats.boschloo(4, 4, 0, 4) == pytest.approx(2 / 256)
    assert stats.boschloo(2, 4, 2, 4) == pytest.approx(1.0)
    for table in ((7, 9, 0, 9), (3, 5, 1, 5), (9, 9, 7, 9)):
        k1, n1, k2, n2 = table
        fisher = scipy_stats.fisher_exact([[k1, k2], [n1 - k1, n2 - k2]]).pvalue
        assert stats.boschloo(*table) <= fisher + 1e-12
    for n in (4, 9):
        assert stats.clopper_pearson(0, n) == (0.0, pytest.approx(1 - 0.025 ** (1 / n), abs=1e-9))
        lo, hi = stats.clopper_pearson(n, n)
        assert hi == 1.0 and lo == pytest.approx(0.025 ** (1 / n), abs=1e-9)
    lo, hi = stats.clopper_pearson(2, 4)
    assert sum(math.comb(4, x) * lo ** x * (1 - lo) ** (4 - x) for x in (2, 3, 4)) == pytest.approx(0.025)
    assert sum(math.comb(4, x) * hi ** x * (1 - hi) ** (4 - x) for x in (0, 1, 2)) == pytest.approx(0.025)


def summary_record(seed, acc, correct=None, state='done'):
    """A run's record as summarise reads it; correct: its per-image results (runs.pack_correct), None for a
    record from before train.py kept them."""
    last = {'epoch': 4, 'val_acc1': acc}
    if correct is not None:
        last.update(val_images=len(correct), val_correct=runs.pack_correct(torch.tensor(correct)))
    return dict(seed=seed, state=state, recipe={'epochs': 4},
                epochs=[{'epoch': 3, 'val_acc1': acc - 1}, last])


def test_a_comparison_uses_every_seed_of_each_row_and_leaves_diverged_runs_out():
    """Welch reads all the seeds of each row, unpaired: a seed one side lacks costs nothing. A diverged run is
    left out of every mean and test (never counted as a guess) and named; the test set's term comes only
    when every run of both rows kept its per-image results, else the interval is the seeds' only."""
    def right(*wrong):  # 10 test images, all right but these
        return [int(i not in wrong) for i in range(10)]
    a = stats.summarise([summary_record(0, 80.0, right(0, 1)), summary_record(1, 90.0, right(0)),
                         summary_record(2, 70.0, right(0, 1, 2))])
    b = stats.summarise([summary_record(0, 70.0, right(0, 1, 3)), summary_record(1, 0.0, state='diverged'),
                         summary_record(2, 80.0, right(0, 4))])
    assert b.top1 == {0: 70.0, 2: 80.0} and b.diverged == [1] and b.gain == 1.0
    mean, se, df = stats.compare(a, b)
    seeds_only = stats.welch([80.0, 90.0, 70.0], [70.0, 80.0])
    assert mean == 5.0 and se >= seeds_only[1] and stats.scores(list(a.correct.values())).shape == (3, 10)
    old = stats.summarise([summary_record(0, 78.0), summary_record(2, 71.0)])
    assert old.correct == {0: None, 2: None} and stats.compare(a, old) == stats.welch([80.0, 90.0, 70.0],
                                                                                       [78.0, 71.0])
    assert math.isnan(stats.seed_correlation(a, b))  # seeds 0 and 2: two points say nothing
    c = stats.summarise([summary_record(s, 70.0 + s) for s in range(3)])
    assert stats.seed_correlation(a, c) == pytest.approx(-0.5)  # 80, 90, 70 against 70, 71, 72
    every = ablations.experiments()
    chosen = {n: every[n] for n in ('t3_linear_relu', 't3_inline_relu')}
    configs, rows, _, m = ablations.table_rows(chosen, {n: [] for n in chosen}, {
        't3_linear_relu': a, 't3_inline_relu': b}, every)
    assert configs[1][3] == '75.0 ± 7.1 (2), seed 1 diverged'
    half = stats.half_width(se, df)
    assert rows[0][3:6] == [f'{mean:+.1f} [{mean - half:+.1f}, {mean + half:+.1f}]', 'seeds and test images',
                            '3 / 2; seed 1 of t3_inline_relu diverged']
    # no floor_swin among the results: no gate, so no test and no place in the family
    assert m == 0 and rows[0][10] == 'untestable (no floor run)'

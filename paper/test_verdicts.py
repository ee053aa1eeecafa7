"""Tests of the verdicts' labels and robustness read (paper/verdicts.py): confirmatory or exploratory by when
a comparison's records came, and the 16-epoch family read at epoch 12 and on the mean of the last 4 evaluations.
The committed records' labels and reads are held to RESULTS.md by paper/test_paper.py.

InLine attention, arXiv 2412.06590. Run as `python -m pytest -q paper`; skipped where scipy is absent (the
lab's own requirements, paper/requirements.txt).
"""
import pytest

pytest.importorskip('scipy.stats')
from paper import verdicts  # noqa: E402


def test_a_verdict_is_confirmatory_only_where_a_side_came_after_the_rules():
    """A comparison is exploratory where every side had a record before the rules (a record without a time
    predates them: recall's), confirmatory where a side had none; a row with no verdict gets no label."""
    before, after = dict(finished='2026-12-04 18:00:00'), dict(finished='2026-12-05 07:55:10')
    assert verdicts.rules_label([[before], [before, after]], 'reproduced') == verdicts.EXPLORATORY
    assert verdicts.rules_label([[after, after], [before]], 'not resolved') == 'confirmatory (92b2312)'
    assert verdicts.rules_label([[{}], [{}]], 'InLine s/i ahead') == verdicts.EXPLORATORY
    assert verdicts.rules_label([[after], [after]], 'running (12 / 10 seeds planned)') == ''
    assert verdicts.rules_label([[after], [after]], 'not yet run') == ''


def test_the_robustness_read_takes_epoch_12_and_the_mean_of_the_last_4_evaluations(capsys):
    """read_summary takes each finished run's top-1 at epoch 12, or its mean over its last 4 evaluations, with
    no per-image results (so over seeds only) and diverged runs named; robustness marks a comparison whose
    verdict either read changes, and prints the difference of the means at every evaluation."""
    def run(seed, *accs, state='done'):
        return dict(seed=seed, state=state, epochs=[dict(epoch=2 * i + 2, train_loss=1.0) for i in range(7)]
                    + [dict(epoch=4 * i + 4, val_acc1=a) for i, a in enumerate(accs)])
    records = [run(0, 70, 80, 84, 85), run(1, 60, 82, 86, 84), run(2, 10, state='diverged')]
    at, last = (verdicts.read_summary(records, read) for read in verdicts.READS)
    assert at.top1 == {0: 84, 1: 86} and last.top1 == {0: 79.75, 1: 78.0}
    assert at.correct == {0: None, 1: None} and at.diverged == last.diverged == [2]
    rows = [['S', 'a − b†', '1 vs 2', '+0.5', '', '', '', '', '', '', 'reproduced', 'exploratory'],
            ['S', 'a − c', '1 vs 2', '+0.5', '', '', '', '', '', '', 'reproduced', 'confirmatory (92b2312)'],
            ['floor', 'a − d', '—', '+9.0', '', '', '', '', '', '', '—', '']]
    read = [[''] * 3 + ['+0.4 [+0.1, +0.7]'] + [''] * 6 + [word]
            for word in ('reproduced', 'not resolved', '—')]
    reads = {verdicts.READS[0]: read, verdicts.READS[1]: [r[:10] + ['reproduced'] for r in read]}
    kept = {x: records for x in 'abcd'}
    verdicts.robustness(rows, reads, kept)
    out = capsys.readouterr().out
    assert ('| a − b† | exploratory | +0.00 / +0.00 / +0.00 / +0.00 | reproduced | +0.4 [+0.1, +0.7]: '
            'reproduced | +0.4 [+0.1, +0.7]: reproduced | the same |') in out
    assert f': not resolved | +0.4 [+0.1, +0.7]: reproduced | {verdicts.CHANGED} |' in out
    assert 'a − d' not in out

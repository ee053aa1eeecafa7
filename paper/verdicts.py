"""The verdicts' labels and their robustness: which verdicts were read under rules written before their
data, and how much the 16-epoch family's verdicts depend on the evaluation they are read at; with the tables
printed beside them (both budgets side by side, the 16-epoch power plan).

InLine attention: Han et al., "Bridging the Divide: Reconsidering Softmax and Linear Attention", NeurIPS 2024,
arXiv 2412.06590. No command of its own: `python -m paper ablations --dataset fashion_recall --no-train` and
`python -m paper recall --no-train` print what it computes (RESULTS.md, "Verdicts").

Confirmatory or exploratory. The verdict rules of both studies (the ablations' families and recall's seeds
that learn) were written at commit 92b2312. A verdict is confirmatory when a side of its comparison had no
record yet when they were written: its data came after its rules (the commit is named). It is exploratory when
every side had records then: its data came first, and the rules could have been shaped by them. A record's
time is its `finished`; a record without one predates the rules (recall's records carried none before them).

The robustness read of the 16-epoch family, fixed before it was computed. Beside every verdict of the family,
two more reads of the same records, no new training: each run's top-1 at epoch 12 (its third of four
evaluations), and the mean of each run's top-1 over its last 4 evaluations (at 16 epochs, validation every 4:
epochs 4, 8, 12 and 16, every evaluation a run has). Each read keeps the family's comparisons, seeds, gate,
two tests a comparison, verdict words and Holm's adjustment over its own 20 tests, with intervals over seeds
only (a run keeps its per-image results at its last evaluation alone). A comparison whose verdict in either
read differs from its epoch-16 verdict, as printed, qualifier included, is marked "depends on the epoch read".
The reads stand beside the epoch-16 verdict and never replace it. Beside them, each comparison's difference of
the two rows' means at epochs 4, 8, 12 and 16.
"""
import statistics

from paper.charts import print_table
from paper.stats import ALPHA, MARGIN, POWER, Summary, planned, power, seeds_for

# The commit that wrote the verdict rules of both studies, and its time (UTC, as the records write theirs)
RULES, RULES_TIME = '92b2312', '2026-12-05 06:07:21'
CONFIRMATORY, EXPLORATORY = f'confirmatory ({RULES})', 'exploratory'
# The robustness read: the evaluation at this epoch, and the mean of this many last evaluations
AT_EPOCH, LAST = 12, 4
READS = (f'epoch {AT_EPOCH}', f'mean of the last {LAST} evaluations')
CHANGED = 'depends on the epoch read'


# ---------------------------------------------------------------------------------------------------
# Confirmatory or exploratory


def before_rules(record):
    """Whether a record was in before the rules: finished before RULES_TIME, or carrying no time at all."""
    return 'finished' not in record or record['finished'] < RULES_TIME


def rules_label(sides, word):
    """CONFIRMATORY where a side of the comparison had no record before the rules, else EXPLORATORY; '' where
    its verdict word is no verdict (no paper number, not yet run, running). sides: each side's records."""
    if word in ('—', '', 'not yet run') or word.startswith('running'):
        return ''
    return EXPLORATORY if all(any(before_rules(r) for r in side) for side in sides) else CONFIRMATORY


# ---------------------------------------------------------------------------------------------------
# The robustness read of the 16-epoch family


def evaluations(record):
    """[(epoch, top-1)] of a run's evaluations, in order."""
    return [(e['epoch'], e['val_acc1']) for e in record['epochs'] if 'val_acc1' in e]


def read_summary(records, read):
    """A configuration's Summary at one of READS: each finished run's top-1 at epoch AT_EPOCH, or its mean
    over its LAST last evaluations; no per-image results (a run keeps them at its last evaluation alone), so a
    comparison of these is over seeds only; diverged runs named as summarise names them."""
    done = sorted((r for r in records if r['state'] == 'done'), key=lambda r: r['seed'])
    at = {r['seed']: (dict(evaluations(r))[AT_EPOCH] if read == READS[0] else
                      statistics.mean(acc for _, acc in evaluations(r)[-LAST:])) for r in done}
    diverged = sorted(r['seed'] for r in records if r['state'] == 'diverged')
    return Summary(at, {s: None for s in at}, diverged, None)


def readable(kept):
    """Whether every finished run of {name: records} has an evaluation at epoch AT_EPOCH, which both reads
    need (a run of a shorter recipe has none)."""
    return all(AT_EPOCH in dict(evaluations(r)) for rs in kept.values() for r in rs if r['state'] == 'done')


def mean_at(records, epoch):
    """The mean top-1 of a configuration's finished runs at one epoch's evaluation."""
    return statistics.mean(dict(evaluations(r))[epoch] for r in records if r['state'] == 'done')


def robustness(rows, reads, kept):
    """Print the 16-epoch family's verdicts beside their robustness reads (the module docstring): each
    comparison with a verdict, its rules label, the difference of its rows' means at each evaluation, its
    verdict, each read's difference [95% CI] and verdict, and whether the verdict depends on the epoch read.
    rows: the family's comparison rows (their last cell the rules label); reads: {read: the same comparisons'
    rows at that read}; kept: {name: its records}."""
    out, epochs = [], []
    for i, r in enumerate(rows):
        if not r[-1]:
            continue
        name, ref = r[1].rstrip('†').split(' − ')
        first = next(x for x in kept[name] if x['state'] == 'done')
        epochs = [epoch for epoch, _ in evaluations(first)]
        gaps = ' / '.join(f'{mean_at(kept[name], e) - mean_at(kept[ref], e):+.2f}' for e in epochs)
        words = [read[i][10] for read in reads.values()]
        cells = [f'{read[i][3]}: {w}' for read, w in zip(reads.values(), words)]
        moved = CHANGED if any(w != r[10] for w in words) else 'the same'
        out.append([r[1], r[-1], gaps, r[10]] + cells + [moved])
    if not out:
        return
    print(f'\nThe 16-epoch family\'s robustness read (RESULTS.md, "Verdicts"), fixed before it was computed: '
          f'each verdict beside the same comparison read at epoch {AT_EPOCH} and on the mean of each run\'s '
          f'last {LAST} evaluations (epochs {", ".join(map(str, epochs[-LAST:]))}), with the same tests, '
          'verdict words and Holm over each read\'s own 20 tests, over seeds only (per-image results exist '
          'at epoch 16 alone); the difference of the two rows\' means at each evaluation shows '
          f'where the gap still moves. "{CHANGED}": either read\'s verdict differs from epoch 16\'s. Rules: '
          f'{CONFIRMATORY}, the rules written before its data; {EXPLORATORY}, its data came first.\n')
    print_table(['row − reference', 'rules', 'difference at epochs ' + ' / '.join(map(str, epochs)),
                 'verdict (epoch 16)'] + [f'{read}: difference [95% CI]: verdict' for read in READS]
                + ['read'], out)


# ---------------------------------------------------------------------------------------------------
# Both budgets side by side, and the 16-epoch power plan


def side_by_side(tables, epochs):
    """The comparisons of both budgets side by side: each difference (seeds), the last-quarter gains of its
    row / its reference, the verdict of each budget's family and its rules label. epochs: each budget's."""
    columns, labels = [], {}
    for chosen, _, _, result, _, _, rows, gains in tables:
        cells = {}
        for r in rows:
            name, ref = r[1].rstrip('†').split(' − ')
            gain = '' if None in (gains[name], gains[ref]) else f'{gains[name]:+.1f} / {gains[ref]:+.1f}'
            verdict = '; '.join(filter(None, (r[10], r[-1])))  # and its rules label
            cells[r[1]] = [f'{r[3]} ({r[5]})' if r[3] else '—', gain, verdict]
            labels.setdefault(r[1], r[2])
        columns.append(cells)
    table = [[label, paper] + [x for cells in columns for x in cells.get(label, ['—', '', 'not planned'])]
             for label, paper in labels.items()]
    epochs = [f'{e} epochs' for e in epochs]
    print(f'\nBoth budgets side by side (`python -m paper ablations --dataset fashion_recall --rerun` trains '
          f'the {epochs[1]}): each comparison\'s difference [95% CI] (seeds row / reference), the '
          'last-quarter gain of its row / its reference (the cosine schedule, whose rate ends near 0, pulls '
          'it toward 0: small is not a plateau), and the verdict of that budget\'s family; its rules '
          'label.\n')
    print_table(['row − reference', 'paper (ImageNet)'] + [f'{e}: {c}' for e in epochs for c in (
        'difference', 'last quarter', 'verdict')], table)


def power_plan(table, rerun, sd):
    """The 16-epoch family's power plan, fixed before its batch: each comparison's planned seeds (rerun: its
    epochs and {name: seeds}) and power at the pooled sd `sd`, beside the seeds and sds its records have now
    and the power its row prints."""
    chosen, _, _, result, _, _, rows, _ = table
    level = ALPHA / (2 * sum(1 for r in rows if r[2] != '—'))
    out = []
    for r in rows:
        if r[2] == '—':
            continue
        name, ref = r[1].rstrip('†').split(' − ')
        n, n_ref = rerun['seeds'][name], rerun['seeds'][ref]
        plan = power(*planned(sd, n, sd, n_ref), level)
        tops = [list(result[x].top1.values()) for x in (name, ref)]
        now = '' if min(map(len, tops)) < 2 else ' / '.join(f'{statistics.stdev(t):.2f}' for t in tops)
        out.append([r[1], f'{n} / {n_ref}', f'{plan[0]:.2f} / {plan[1]:.2f}',
                    seeds_for(sd, n_ref, level) or '> 100', r[5], now or '—', r[9] or '—'])
    print(f'\nThe {rerun["epochs"]}-epoch power plan (RESULTS.md, "Verdicts"), fixed before its batch: seeds '
          f'planned (row / reference), the power at the pooled sd {sd:g} of the 16-epoch rows then recorded '
          f'(TOST at Δ = 0 / ordering at |Δ| = {MARGIN:g}, Welch on its Satterthwaite degrees of freedom, '
          f'noncentral t, at Holm\'s strictest step {level:.4f}), the seeds a row needs for {POWER:.0%} TOST '
          'power against its reference\'s planned seeds; then the seeds and sds (row / reference) its '
          'records have now, and the power at those, the test set\'s term included (the family\'s power column).\n')
    print_table(['row − reference', 'seeds planned', 'power planned', 'seeds for 80% (TOST)', 'seeds now',
                 'sd now', 'power now'], out)

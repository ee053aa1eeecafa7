"""The verdicts' labels and their robustness: which verdicts were read under rules written before their data,
and how much the 16-epoch family's verdicts depend on the evaluation they are read at.

InLine attention: Han et al., "Bridging the Divide: Reconsidering Softmax and Linear Attention", NeurIPS 2024,
arXiv 2412.06590. No command of its own: `python -m paper ablations --dataset fashion_recall --no-train` and
`python -m paper recall --no-train` print what it computes (RESULTS.md, "Verdicts").

Confirmatory or exploratory. The verdict rules of both studies (the ablations' families and recall's seeds that
learn) were written at commit 92b2312. A verdict is confirmatory when a side of its comparison had no record yet
when they were written: its data came after its rules (the commit is named). It is exploratory when every side
had records then: its data came first, and the rules could have been shaped by them. A record's time is its
`finished`; a record without one predates the rules (recall's records carried none before them).

The robustness read of the 16-epoch family, fixed before it was computed. Beside every verdict of the family, two
more reads of the same records, no new training: each run's top-1 at epoch 12 (its third of four evaluations),
and the mean of each run's top-1 over its last 4 evaluations (at 16 epochs, validation every 4: epochs 4, 8, 12
and 16, every evaluation a run has). Each read keeps the family's comparisons, seeds, gate, two tests a
comparison, verdict words and Holm's adjustment over its own 20 tests, with intervals over seeds only (a run keeps
its per-image results at its last evaluation alone). A comparison whose verdict in either read differs from its
epoch-16 verdict, as printed, qualifier included, is marked "depends on the epoch read". The reads stand beside
the epoch-16 verdict and never replace it. Beside them, each comparison's difference of the two rows' means at
epochs 4, 8, 12 and 16.
"""

"""InLine on sequences: multi-query associative recall (MQAR), small causal transformers trained in process.

InLine attention: Han et al., "Bridging the Divide: Reconsidering Softmax and Linear Attention", NeurIPS 2024,
arXiv 2412.06590. Run as `python -m paper recall [--no-train]` (paper/__main__.py).
"""
import contextlib
import hashlib
import itertools
import json
import math
import os
import re
import statistics
import time

import torch
import torch.nn.functional as F
from tqdm import tqdm

import inline
import kernels
import sequence
import train
from paper.charts import charts, print_table
from paper.runs import ROOT, append_record, lock_run, pack_correct, read_records, unpack_correct
from paper.stats import ALPHA, boschloo, clopper_pearson, holm, interval, welch_text
from paper.verdicts import CONFIRMATORY, EXPLORATORY, rules_label


# ---------------------------------------------------------------------------------------------------
# recall: multi-query associative recall (MQAR; Arora et al. 2023, "Zoology"), the test linear attentions are
# judged by: key-value pairs, filler, then queries for the keys, the loss on the answers only. Small causal
# transformers (2 layers, 2 heads) with softmax, vanilla linear attention (division) and causal InLine
# (subtraction), each with causal Eq. 6 in the study (the short causal convolution that binds a key to the
# value after it). InLine is injective in q_i only where the prefix's centred keys span D dimensions
# (inline.inline_weights), so every query sits at token D + 1 or later: what is compared is injective where it
# claims to be. The models have 20k-100k parameters and a run takes minutes on one core (2.5 at 20000 steps,
# compiled), so they train here, in process: train.py is the image loop (its data pipeline, DDP and
# checkpoints serve runs of hours to days). Finished runs are JSON lines in RECALL_RESULTS (committed), so the
# tables and the picture rebuild without training and a rerun trains only what is missing.

RECALL_RESULTS = os.path.join(ROOT, 'results', 'recall.jsonl')
RECALL_VOCAB = 64  # keys are tokens 0..63, values 64..127, filler 128..191
RECALL_HEADS = 2
# (C, key-value pairs, tokens); D = C / 2, queries from D + 1
RECALL_SIZES = ((32, 4, 20), (32, 6, 24), (32, 8, 24))
RECALL_MODELS = {  # name: how its attention is built (RecallLM); without Eq. 6 here, with it below
    'softmax': dict(attention='softmax'),
    # T1 on sequences: q/|q| times a learned gain
    'softmax q-norm': dict(attention='softmax', normalise_q=True),
    'floor phi=0': dict(feature_map='zero', eq6='none'),  # every weight 1/i: attention that cannot select
    # division, the other usual feature map
    'linear relu': dict(attention='linear', feature_map='relu', eq6='none'),
    'linear 1+elu': dict(attention='linear', feature_map='one_plus_elu', eq6='none'),  # division
    'InLine 1+elu s/i': dict(feature_map='one_plus_elu', eq6='none'),  # subtraction, Eq. 5 with s/i
    'InLine 1+elu s': dict(feature_map='one_plus_elu', eq6='none', scale_by_count=False),  # the printed Eq. 5
    'InLine s/i': dict(eq6='none'),  # phi = identity, the paper's
    'InLine s': dict(eq6='none', scale_by_count=False),
    'InLine s/i q-norm': dict(eq6='none', normalise_q=True),
}
# The study's models: each of the above with causal Eq. 6 (the token and the 2 before it), softmax too.
# Without a token shift a linear-state layer cannot bind a key to the value after it, and none of them left
# the guess (RESULTS.md)
RECALL_EQ6 = ' + Eq. 6'
RECALL_STUDY = [name + RECALL_EQ6 for name in RECALL_MODELS]
RECALL_MODELS.update({name + RECALL_EQ6: {**options, 'eq6': 'local'}
                      for name, options in list(RECALL_MODELS.items())})
RECALL_FLOOR = 'floor phi=0'
# (question, a, b, whether the paper claims b over a): read seed by seed, with and without Eq. 6. The paper
# claims injectivity (T1) and subtraction over division; it claims no order between its printed s and the
# released s/i, nor between kernels (T10 reads them as a tie)
RECALL_COMPARISONS = (
    ('injectivity within softmax', 'softmax q-norm', 'softmax', True),
    ('injectivity within InLine', 'InLine s/i q-norm', 'InLine s/i', True),
    ('subtraction over division, 1+elu', 'linear 1+elu', 'InLine 1+elu s/i', True),
    ('scale s over s/i, identity', 'InLine s/i', 'InLine s', False),
    ('scale s over s/i, 1+elu', 'InLine 1+elu s/i', 'InLine 1+elu s', False),
    ('kernel identity over 1+elu', 'InLine 1+elu s/i', 'InLine s/i', False),
)
# "learns": recall at least this share of the way from the guess to the best recall at the size, fixed before
# any added seed; the verdicts are printed at each of THRESHOLDS, and one that changes between them is not
# resolved (RESULTS.md, "Recall, by the seeds that learn")
LEARNED, THRESHOLDS = 0.5, (0.5, 0.6, 0.7)
RECALL_LRS = (1e-3, 3e-3, 1e-2)  # each model's learning rate: the best of these on held-out sequences, seed 0
# 20000 steps: every seed of InLine 1+elu left the guess
RECALL_SEEDS, RECALL_STEPS, RECALL_BATCH = 5, 20000, 64
RECALL_FIRST_STEPS = 2000  # the first study's budget, where no linear-state run left the guess reliably
# The seeds split where the models sit between learning and not (RESULTS.md, "Recall, by the seeds that
# learn"): at this size the models of the comparisons that split get this many seeds
RECALL_SPLIT = ((32, 8, 24), 10, ('linear 1+elu + Eq. 6', 'InLine 1+elu s/i + Eq. 6',
                                  'InLine 1+elu s + Eq. 6', 'InLine s/i + Eq. 6', 'InLine s + Eq. 6'))
RECALL_VALID, RECALL_TEST = 777, 12345  # the held-out sequences' generators: learning rates, then the test
RECALL_HELD_OUT = 1024  # sequences of each


def mqar_batch(batch, pairs, tokens, generator):
    """x, y (batch, tokens): `pairs` distinct keys, each followed by its value, filler tokens, then `pairs`
    queries (keys drawn again, with repeats) at the end; y holds the value at the queries and -100 (no loss)
    elsewhere."""
    # (batch, pairs), distinct
    keys = torch.rand(batch, RECALL_VOCAB, generator=generator).argsort(-1)[:, :pairs]
    values = RECALL_VOCAB + torch.randint(RECALL_VOCAB, (batch, pairs), generator=generator)  # (batch, pairs)
    filler = 2 * RECALL_VOCAB + torch.randint(RECALL_VOCAB, (batch, tokens - 3 * pairs), generator=generator)
    asked = torch.randint(pairs, (batch, pairs), generator=generator)  # (batch, pairs)
    # (batch, tokens)
    x = torch.cat([torch.stack([keys, values], -1).flatten(1), filler, keys.gather(1, asked)], 1)
    y = torch.full_like(x, -100)
    y[:, tokens - pairs:] = values.gather(1, asked)
    return x, y


def most_frequent_guess(x, y, pairs):
    """Recall (%) of a model that knows each sequence's values but not which key has which: it answers the
    value most frequent in the sequence (ties broken at random). What attention that cannot select (the floor)
    can reach."""
    values = x[:, 1:2 * pairs:2]  # (batch, pairs)
    # (batch, pairs): each value's count
    counts = (values.unsqueeze(-1) == values.unsqueeze(-2)).sum(-1).double()
    counts = counts + torch.rand(counts.shape, generator=torch.Generator().manual_seed(0),
                                 dtype=torch.float64)
    guess = values.gather(1, counts.argmax(-1, keepdim=True))  # (batch, 1)
    answers = y[y != -100].reshape(len(y), -1)  # (batch, pairs)
    return 100 * (answers == guess).double().mean().item()


class CausalSoftmax(torch.nn.Module):
    """Causal softmax attention between InLineAttention's projections: x (B, N, C) -> (B, N, C); with
    eq6='local', plus causal Eq. 6 as InLine has it (sequence.sequence_residual over the last 3
    tokens), so that softmax and InLine differ only in the attention."""

    def __init__(self, dim, num_heads, normalise_q=False, eq6='none'):
        super().__init__()
        self.num_heads = num_heads
        inline.add_projections(self, dim, qkv_bias=True, separate_q=False)
        self.normalise_q = inline.NormalisedQ(num_heads, dim // num_heads) if normalise_q else None  # T1
        self.local_size = inline.neighbourhood_size(eq6)
        self.residual = inline.residual_mlp(dim, num_heads, self.local_size) if self.local_size else None

    def forward(self, x):
        B, N, C = x.shape
        q, k, v = (t.reshape(B, N, self.num_heads, -1).transpose(1, 2) for t in self.qkv(x).chunk(3, -1))
        q = self.normalise_q(q) if self.normalise_q is not None else q  # (B, H, N, D)
        o = F.scaled_dot_product_attention(q, k, v, is_causal=True)  # (B, H, N, D)
        if self.residual is not None:
            r = inline.residual_weights(self.residual, sequence.prefix_means(x))  # (B, N, T*C), per prefix
            o = o + sequence.sequence_residual(v, r, self.local_size, causal=True)  # Eq. 6, (B, H, N, D)
        return self.proj(o.transpose(1, 2).reshape(B, N, C))


class CausalInLine(sequence.SequenceAttention):
    """sequence.SequenceAttention (causal), its forward and attend, with short_causal_core in place of
    sequence.causal_core (core); normalise_q: q of unit length times a learned gain (inline.NormalisedQ)."""

    def __init__(self, dim, num_heads, normalise_q=False, **options):
        super().__init__(dim, num_heads, causal=True, **options)
        self.normalise_q = inline.NormalisedQ(num_heads, dim // num_heads) if normalise_q else None

    def project(self, x):
        q, k, v = super().project(x)  # (B, H, N, D) each
        return q if self.normalise_q is None else self.normalise_q(q), k, v

    def core(self):
        return sequence.causal_linear_core if self.attention == 'linear' else short_causal_core


class RecallLM(torch.nn.Module):
    """Token and learned position embeddings, 2 decoder blocks, a norm and a head: (B, N) -> logits (B, N,
    3V)."""

    def __init__(self, name, width, tokens):
        super().__init__()
        options = dict(RECALL_MODELS[name])
        softmax = options.get('attention') == 'softmax'
        if softmax:
            del options['attention']
        self.embed = torch.nn.Embedding(3 * RECALL_VOCAB, width)
        self.pos = torch.nn.Parameter(0.02 * torch.randn(1, tokens, width))
        self.blocks = torch.nn.Sequential(*[sequence.DecoderBlock(
            width, RECALL_HEADS, mlp_ratio=2, attn=CausalSoftmax(width, RECALL_HEADS, **options) if softmax
            else CausalInLine(width, RECALL_HEADS, **options)) for _ in range(2)])
        self.norm, self.head = torch.nn.LayerNorm(width), torch.nn.Linear(width, 3 * RECALL_VOCAB)

    def forward(self, x, answers=None):
        """Logits at every token, or with `answers`, at the last `answers` tokens only (B, answers, 3V): where
        the queries sit, the only places a loss or a score reads (it saves about a tenth of a step)."""
        h = self.blocks(self.embed(x) + self.pos[:, :x.shape[1]])  # (B, N, C)
        return self.head(self.norm(h if answers is None else h[:, -answers:]))


def short_causal_core(q, k, v, r, grid=None, scale=None, size=3, dilation=1, scale_by_count=True):
    """sequence.causal_core through the explicit causal weights: at 64 tokens the N x N form costs a CPU the
    least (the prefix sums' (B, H, N, D, D) tensors made a step ten times slower); the two are the same
    function (test_causal_forms_equal_the_explicit_weights)."""
    w = sequence.causal_inline_weights(q, k, scale, scale_by_count)  # (B, H, N, N)
    o = w @ v  # Eq. 5 over each prefix, (B, H, N, D)
    return o if r is None else o + sequence.sequence_residual(v, r, size, dilation, causal=True)  # Eq. 6


def recall_answers(model, pairs, tokens, seed):
    """Which answers the model gets right, (RECALL_HELD_OUT, pairs) bool, on held-out sequences drawn from
    generator seed (RECALL_VALID or RECALL_TEST)."""
    x, y = mqar_batch(RECALL_HELD_OUT, pairs, tokens, torch.Generator().manual_seed(seed))
    with torch.no_grad():
        return model(x, pairs).argmax(-1) == y[:, -pairs:]


def recall_run(name, width, pairs, tokens, seed, lr, steps, compiled=False):
    """Train one model on fresh batches (AdamW, one-cycle schedule; no weight decay: every batch is new, so
    there is nothing to overfit, and decay would pull against the q length that s/i asks to grow) and count
    its right answers on the held-out sequences (for the learning rate) and the test ones, keeping which test
    answers it got right (pack_correct, sequence by sequence), for the intervals over the test set. compiled:
    the training forward through torch.compile (the same function, about 1.4x faster a step on a CPU after
    about 12 s of compiling; scoring stays eager). Returns the run's JSON line."""
    torch.manual_seed(seed)
    model = RecallLM(name, width, tokens)
    forward = torch.compile(model, dynamic=False) if compiled else model
    opt = torch.optim.AdamW(model.parameters(), lr=lr, weight_decay=0.0, betas=(0.9, 0.98))
    schedule = torch.optim.lr_scheduler.OneCycleLR(opt, lr, total_steps=steps, pct_start=0.1)
    data, start = torch.Generator().manual_seed(1000 + seed), time.process_time()

    def step():
        x, y = mqar_batch(RECALL_BATCH, pairs, tokens, data)
        loss = F.cross_entropy(forward(x, pairs).flatten(0, 1), y[:, -pairs:].flatten())  # the answers only
        opt.zero_grad(set_to_none=True)
        loss.backward()
        opt.step()
        schedule.step()
        return loss

    # compiled: a graph per model and size, none dropped to eager
    with torch._dynamo.config.patch(recompile_limit=64):
        # the first step compiles them: one process at a time, the others then load them from the inductor
        # cache
        with (kernels.compile_lock(('recall', name, width, pairs, tokens)) if compiled
              else contextlib.nullcontext()):
            loss = step()
        for _ in range(steps - 1):
            loss = step()
    valid, test = (recall_answers(model, pairs, tokens, s) for s in (RECALL_VALID, RECALL_TEST))
    return dict(model=name, width=width, pairs=pairs, tokens=tokens, seed=seed, steps=steps,
                batch=RECALL_BATCH, lr=lr, valid=round(100 * valid.double().mean().item(), 2),
                recall=round(100 * test.double().mean().item(), 2), correct=pack_correct(test.flatten()),
                final_loss=round(loss.item(), 4), params=sum(p.numel() for p in model.parameters()),
                cpu_s=round(time.process_time() - start, 1), threads=torch.get_num_threads(),
                compiled=compiled, finished=time.strftime('%Y-%m-%d %H:%M:%S'))


def recall_key(name, width, pairs, tokens, seed, lr, steps, batch=RECALL_BATCH):
    """What makes a run: a stored run made with another batch, length or learning rate is not this one."""
    return json.dumps([name, width, pairs, tokens, seed, lr, steps, batch])


def recall_row_key(row):
    """A stored run's recall_key, for read_records: the recall runs are records too, one JSON line each."""
    return recall_key(*(row[k]
                        for k in ('model', 'width', 'pairs', 'tokens', 'seed', 'lr', 'steps', 'batch')))


def held_out(runs, name, size, steps):
    """Seed 0's held-out recall at each of RECALL_LRS (None where it has no record): what chooses the rate."""
    return [runs[k]['valid'] if (k := recall_key(name, *size, 0, lr, steps)) in runs else None
            for lr in RECALL_LRS]


def best_lr(runs, name, size, steps):
    """The learning rate of RECALL_LRS whose seed-0 run recalls most on the held-out sequences (the smaller on
    a tie), or None until all of them have run."""
    valid = held_out(runs, name, size, steps)
    return None if None in valid else max(zip(valid, RECALL_LRS), key=lambda pair: (pair[0], -pair[1]))[1]


def seeds_of(name, size, seeds):
    """How many seeds a model gets at a size: `seeds`, or RECALL_SPLIT's where the seeds split."""
    split_size, split_seeds, split_models = RECALL_SPLIT
    return max(seeds, split_seeds) if size == split_size and name in split_models else seeds


def recall_plan(runs, models, sizes, seeds, steps):
    """The runs still to train, in the order that leaves a stopped study balanced: every model at every
    learning rate (seed 0), then seed 1 of every model at its best, then seed 2, ... (cmd_recall: one size at
    a time)."""
    first = [(n, *size, 0, lr) for size in sizes for n in models for lr in RECALL_LRS]
    chosen = {(n, size): best_lr(runs, n, size, steps) for size in sizes for n in models}
    most = max(seeds_of(n, size, seeds) for size in sizes for n in models)
    later = [(n, *size, s, chosen[n, size]) for s in range(1, most) for size in sizes for n in models
             if chosen[n, size] is not None and s < seeds_of(n, size, seeds)]
    return [run for run in first + later if recall_key(*run, steps) not in runs]


def cmd_recall(args):
    models = args.models or RECALL_STUDY
    unknown = sorted(set(models) - set(RECALL_MODELS))
    if unknown:
        train.fail(f"unknown recall models {unknown}; choose from {list(RECALL_MODELS)}")
    if args.seeds < 1 or args.steps < 1 or args.threads < 1:
        train.fail(f"--seeds, --steps and --threads must be at least 1, got {args.seeds}, {args.steps}, "
                   f"{args.threads}")
    sizes = [tuple(map(int, size.split('x'))) for size in args.sizes if re.fullmatch(r'\d+x\d+x\d+', size)]
    if len(sizes) != len(args.sizes) or any(not 2 <= p <= RECALL_VOCAB or w < 1 or w % RECALL_HEADS
                                            or n - p < w // RECALL_HEADS or n < 3 * p for w, p, n in sizes):
        train.fail(f"--sizes takes CxPAIRSxTOKENS: the width C a multiple of the {RECALL_HEADS} heads, 2 <= "
                   f"PAIRS <= {RECALL_VOCAB} (distinct keys of {RECALL_VOCAB}), TOKENS >= 3 PAIRS and TOKENS "
                   f"- PAIRS >= D = C/{RECALL_HEADS}, so that every query sits at token D + 1 or later; got "
                   f"{args.sizes}")
    runs = read_records(args.results, key=recall_row_key)
    if not args.no_train:
        threads = torch.get_num_threads()
        torch.set_num_threads(args.threads)
        try:
            # a size finished before the next, so a stopped study has verdicts where it went
            for size in sizes:
                # the second trains the seeds of learning rates the first chose
                for stage in ('first pass', 'second pass'):
                    train_recall(runs, recall_plan(runs, models, [size], args.seeds, args.steps),
                                 f"{'x'.join(map(str, size))}, {stage}", args)
        finally:  # a caller in this process (the tests) keeps its threads
            torch.set_num_threads(threads)
    return recall_report(runs, models, sizes, args)


def recall_claim(out, key, wait=False):
    """lock_run on OUT/recall-claims/<the run>: the descriptor, or None while another command trains that run
    (and not wait)."""
    return lock_run(os.path.join(out, 'recall-claims', hashlib.sha256(key.encode()).hexdigest()[:24]), wait)


def train_recall(runs, todo, stage, args):
    """Train the runs of todo, each added to args.results (and runs) the moment it finishes. Each run is
    claimed first (recall_claim), so several commands share one plan: a run another command is training is
    left to it and waited for at the end (trained here if it left no record), so that the next stage is
    planned from every run of this one; and one command compiles a model's graph while the others wait to load
    it from the cache."""
    # CPU seconds per token of a step: the model's own records (compiled or not), else every record's
    def rate(name):
        done = [r for r in runs.values() if r['batch'] == RECALL_BATCH and r['model'] == name
                and r.get('compiled', False) == args.compile] or list(runs.values())
        return sum(r['cpu_s'] for r in done) / max(sum(r['tokens'] * r['steps'] for r in done), 1)
    estimate = sum(rate(name) * tokens * args.steps for name, _, _, tokens, _, _ in todo) / 60
    print(f"recall (MQAR), {stage}: {len(todo)} runs to train at {args.threads} thread(s), {args.steps} "
          f"steps of {RECALL_BATCH}, about {estimate:.0f} CPU-min (from the records' CPU time "
          "per token)", flush=True)
    trained = []

    def attempt(run, wait):  # False: another command holds the run
        key = recall_key(*run, args.steps)
        claim = recall_claim(args.out, key, wait)
        if claim is None:
            return False
        try:
            runs.update(read_records(args.results, key=recall_row_key))
            if key not in runs:  # not recorded by another command meanwhile
                runs[key] = recall_run(*run, args.steps, args.compile)
                append_record(args.results, runs[key])
                trained.append(runs[key]['cpu_s'])
        finally:
            os.close(claim)
        return True
    others = [run for run in tqdm(todo, desc='recall', disable=not todo) if not attempt(run, wait=False)]
    for run in others:
        attempt(run, wait=True)
    if trained:
        print(f"trained {len(trained)} runs in {sum(trained) / 60:.1f} CPU-min (process CPU time)")


def chosen_runs(runs, name, size, steps, seeds):
    """(the model's best learning rate or None, its records at that rate in seed order, those of seeds
    0..seeds-1 that exist)."""
    lr = best_lr(runs, name, size, steps)
    return lr, [] if lr is None else [runs[k] for s in range(seeds)
                                      if (k := recall_key(name, *size, s, lr, steps)) in runs]


def first_study(runs, name, size, seeds):
    """The model's recall at the first study's budget, RECALL_FIRST_STEPS (its own best learning rate there,
    mean over its seeds), '-' without those records: what ten times the steps changed."""
    rows = chosen_runs(runs, name, size, RECALL_FIRST_STEPS, seeds)[1]
    return f"{statistics.mean(r['recall'] for r in rows):.1f} ({len(rows)})" if rows else '-'


def by_sequence(rows, pairs):
    """(seeds, RECALL_HELD_OUT) numpy: each run's recall (%) on each test sequence, from its record's
    `correct`, the test set's side of the intervals; None where a record predates them."""
    if not rows or any('correct' not in r for r in rows):
        return None
    return 100 * torch.stack([unpack_correct(r['correct'], RECALL_HELD_OUT * pairs)
                              .view(RECALL_HELD_OUT, pairs).double().mean(1) for r in rows]).numpy()


def recall_report(runs, models, sizes, args):
    """The tables and the picture from the records: the learning rates, recall by model against the floor and
    the guess, and each comparison's verdict, gated by both."""
    guesses = {(w, p, n): most_frequent_guess(*mqar_batch(RECALL_HELD_OUT, p, n,
                                                          torch.Generator().manual_seed(RECALL_TEST)), p)
               for w, p, n in sizes}
    recall, kept = recall_table(runs, models, sizes, guesses, args)
    recall_comparisons(recall, guesses, models, sizes, kept)
    panels = []
    for size in sizes:
        series = [(name, list(RECALL_LRS), held_out(runs, name, size, args.steps), None) for name in models]
        if all(y is None for _, _, ys, _ in series for y in ys):
            continue  # no runs at this size yet
        panels.append(dict(series=series,
                           title='MQAR, C {}, {} pairs, {} tokens: held-out recall, seed 0'.format(*size),
                           xlabel='learning rate', ylabel='recall (%)', xticks=list(RECALL_LRS), log_x=True,
                           lines=True, ylim=(0, 100), hlines=[('the guess', guesses[size])]))
    if panels:
        charts(args.png or os.path.join(args.out, 'recall.png'), panels, cols=len(panels), size=(560, 460))
    return runs


def recall_table(runs, models, sizes, guesses, args):
    """Print each model's learning rates, recall and seeds at each size; return {(model, C, pairs, tokens):
    recall per seed} and {the same: its records}."""
    print(f"\nMQAR: keys, values and filler from {RECALL_VOCAB} tokens each, 2 layers, {RECALL_HEADS} heads, "
          f"{args.steps} steps of {RECALL_BATCH} sequences; recall = right answers on {RECALL_HELD_OUT} test "
          "sequences, mean over the seeds with its 95% interval over the seeds and the test sequences (the "
          "ablations' two-way model), or over the seeds only (Student-t) where a record predates per-answer "
          f"results; each model at the learning rate of {', '.join(map(str, RECALL_LRS))} that recalled most "
          f"on {RECALL_HELD_OUT} held-out sequences (seed 0). Every query sits at token D + 1 or later.\n")
    first = args.steps != RECALL_FIRST_STEPS  # a column for the first study's recall
    recall, kept, table, missing = {}, {}, [], []
    for (w, p, n), name in itertools.product(sizes, models):
        lr, rows = chosen_runs(runs, name, (w, p, n), args.steps, seeds_of(name, (w, p, n), args.seeds))
        tried = held_out(runs, name, (w, p, n), args.steps)
        recall[name, w, p, n] = values = [r['recall'] for r in rows]
        kept[name, w, p, n] = rows
        if all(v is None for v in tried):
            missing.append(f"{name} at {w} / {p} / {n}")
            continue
        mean, half = interval(values, by_sequence(rows, p)) if values else (math.nan, math.nan)
        table.append([f"{w} / {p} / {n}", name, ' '.join('-' if v is None else f'{v:.1f}' for v in tried),
                      lr or '-', f"{mean:.1f} ± {half:.1f}" if values else '-',
                      ' '.join(f'{v:.1f}' for v in values),
                      len(values)] + ([first_study(runs, name, (w, p, n), args.seeds)] if first else []))
    cpu = sum(r['cpu_s'] for r in runs.values() if r['model'] in models
              and (r['width'], r['pairs'], r['tokens'])
              in sizes and r['steps'] == args.steps)
    print_table(['C / pairs / tokens', 'model', 'held-out % at each lr', 'lr', 'recall %', 'per seed',
                 'seeds']
                + ([f'at {RECALL_FIRST_STEPS} steps'] if first else []), table)
    print('\nthe guess: a model that knows the values of its sequence and answers the most frequent '
          '(simulated on the test sequences): '
          + ', '.join(f"{g:.1f}% at {w} / {p} / {n}" for (w, p, n), g in guesses.items()) +
          f'. CPU time of these runs: {cpu / 60:.1f} min.'
          + (f' No runs yet: {", ".join(missing)}.' if missing else ''))
    return recall, kept


def learned(value, guess, best, share=LEARNED):
    """Whether a seed learned the task: its recall at least `share` of the way from the guess to the best
    recall at its size. A seed recalls about the best or stays at the guess (RESULTS.md, "Recall, by the seeds
    that learn"); the few between are what the share decides."""
    return value >= guess + share * (best - guess)


def learners(values, guess, best, share=LEARNED):
    """(seeds that learned, seeds) among seeds 1, 2, ... of a model: seed 0 chose the learning rate, so its
    outcome is not independent of the choice and is left out of every share and test."""
    later = values[1:]
    return sum(learned(v, guess, best, share) for v in later), len(later)


def recall_comparisons(recall, guesses, models, sizes, kept):
    """Print each model's share of seeds that learn, with its Clopper-Pearson interval, then each
    comparison's: "b recalls more than a" read as "b learns in more seeds than a", by Boschloo's exact test
    on the seeds that did not choose the learning rate, Holm over the testable ones, at each of THRESHOLDS;
    and, apart, the recall among the seeds that learned. A size is testable when softmax learns in more seeds
    than the floor (phi = 0) by the same test: the study's gate, one per size. Each verdict with its rules
    label (paper/verdicts.py), from its models' records at that size (kept)."""
    best = {size: max((v for (_, *s), values in recall.items() if tuple(s) == size for v in values),
                      default=100.0) for size in sizes}
    shares = []
    for (w, p, n), name in itertools.product(sizes, models):
        values, at = recall[name, w, p, n], (guesses[w, p, n], best[w, p, n])
        if not values:
            continue
        k, m = learners(values, *at)
        lo, hi = clopper_pearson(k, m) if m else (math.nan, math.nan)
        among = [v for v in values if learned(v, *at)]
        shares.append([f"{w} / {p} / {n}", name, 'yes' if learned(values[0], *at) else 'no',
                       f'{k} of {m}', f'{k / m:.2f} [{lo:.2f}, {hi:.2f}]' if m else '-',
                       f'{statistics.mean(among):.1f} ({len(among)})' if among else '-'])
    print(f'\nSeeds that learn: recall at least {LEARNED:.0%} of the way from the guess to the best recall '
          'at the size (learned). Seed 0 chose the learning rate and is shown apart; the share and its '
          'exact 95% interval (Clopper-Pearson) are over seeds 1, 2, ...; recall among the learners: their '
          'mean, all seeds (how many).\n')
    print_table(['C / pairs / tokens', 'model', 'seed 0 learned', 'seeds 1.. learned', 'share [95% CI]',
                 'recall among learners'], shares)
    rows, tested = [], {share: [] for share in THRESHOLDS}
    for (question, a, b, claim), eq6 in itertools.product(RECALL_COMPARISONS, ('', RECALL_EQ6)):
        a, b, softmax, floor = a + eq6, b + eq6, 'softmax' + eq6, RECALL_FLOOR + eq6
        for w, p, n in sizes:
            if a not in models or b not in models or min(len(recall[x, w, p, n]) for x in (a, b)) < 2:
                continue
            row = [question + eq6, f"{w} / {p} / {n}"]
            for share in THRESHOLDS:
                at = (guesses[w, p, n], best[w, p, n], share)
                (ka, ma), (kb, mb) = (learners(recall[x, w, p, n], *at) for x in (a, b))
                gate = False
                if min(len(recall.get((x, w, p, n), [])) for x in (softmax, floor)) > 1:
                    (ks, ms), (kf, mf) = (learners(recall[x, w, p, n], *at) for x in (softmax, floor))
                    gate = ks / ms > kf / mf and boschloo(ks, ms, kf, mf) < ALPHA
                q = boschloo(ka, ma, kb, mb)
                side = None if ka / ma == kb / mb else b if kb / mb > ka / ma else a
                row += [f'{ka} / {kb}', f'{q:.3f}', '']
                if gate:
                    tested[share].append((len(rows), len(row) - 1, q, side, claim, b))
                else:
                    row[-1] = 'untestable'
            among_a, among_b = ([v for v in recall[x, w, p, n] if learned(v, guesses[w, p, n], best[w, p, n])]
                                for x in (a, b))
            rows.append(row + ['', welch_text(among_a, among_b), [kept[x, w, p, n] for x in (a, b)]])
    for share, found in tested.items():  # Holm over the testable comparisons at each line
        for (i, j, _, side, claim, b), q in zip(found, holm([q for _, _, q, _, _, _ in found])):
            word = ('not resolved' if q >= ALPHA or side is None else
                    ('reproduced' if side == b else 'contradicted') if claim else
                    f'{side.replace(RECALL_EQ6, "")} ahead')
            rows[i][j] = f'{q:.3f}: {word}'
    for row in rows:  # the verdict: the same at every line, else it rests on where the line is drawn
        words = {cell.split(': ')[-1] for cell in row[4:-3:3]}
        row[-3] = words.pop() if len(words) == 1 else 'not resolved (the line)'
        row[-1] = rules_label(row[-1], row[-3])
    if rows:
        print('\nComparisons, "b recalls more than a" read as "b learns in more seeds than a" (RESULTS.md, '
              '"Recall, by the seeds that learn"): at each line (the share of the way from the guess to the '
              'best recall that counts as learned), seeds 1, 2, ... that learned (a / b), Boschloo\'s exact '
              'two-sided p, then its Holm adjustment over the testable comparisons at that line and the '
              'verdict at 5%: reproduced where b\'s share is the larger and the paper claims b over a, '
              'contradicted where a\'s is; "X ahead" where the paper claims no order; untestable where '
              'softmax does not learn in more seeds than the floor (phi = 0) at that size. Verdict: the same '
              'at every line, else not resolved. Apart, recall among the seeds that learned at '
              f'{LEARNED:.0%} (all seeds): b − a with its Welch 95% interval, where each has two learners. '
              f'Rules: {CONFIRMATORY}, the commit that wrote these rules before its data; {EXPLORATORY}, its '
              'data came first.\n')
        print_table(['question', 'C / pairs / tokens'] + [f'{share:.0%}: {c}' for share in THRESHOLDS
                                                          for c in ('learned a / b', 'Boschloo p',
                                                                    'Holm p: verdict')]
                    + ['verdict', 'among learners: b − a', 'rules'], rows)


# ---------------------------------------------------------------------------------------------------


def add_recall_parser(sub, common):
    """`python -m paper recall`'s options."""
    p = sub.add_parser('recall', parents=[common],
                       help='associative recall (MQAR): softmax, linear and causal InLine')
    p.add_argument('--results', default=RECALL_RESULTS, help='finished runs, one JSON line each (default '
                   'results/recall.jsonl); a rerun trains only what is missing')
    p.add_argument('--models', nargs='+', metavar='NAME',
                   help='these models (default: the study\'s, every one with Eq. 6), of '
                   f'{", ".join(RECALL_MODELS)}')
    p.add_argument('--sizes', nargs='+', metavar='CxPAIRSxTOKENS',
                   default=[f'{w}x{p}x{n}' for w, p, n in RECALL_SIZES],
                   help=f'model width C ({RECALL_HEADS} heads), key-value pairs and tokens per sequence '
                        f'(default {" ".join(f"{w}x{p}x{n}" for w, p, n in RECALL_SIZES)})')
    p.add_argument('--seeds', type=int, default=RECALL_SEEDS, help='seeds per model and size (0, 1, ...)')
    p.add_argument('--steps', type=int, default=RECALL_STEPS,
                   help=f'training steps of {RECALL_BATCH} sequences')
    p.add_argument('--threads', type=int, default=1, help='CPU threads of this process')
    p.add_argument('--compile', action='store_true',
                   help='train through torch.compile (about 1.4x faster a step '
                   'on a CPU). Several commands at once share the study: each trains what no other '
                   'has claimed')
    p.add_argument('--no-train', action='store_true',
                   help='train nothing: the tables and picture from the records')

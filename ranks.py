"""How every process of a run speaks: rank 0 alone prints, and bad input stops every rank with one
message.

InLine attention: Han et al., "Bridging the Divide: Reconsidering Softmax and Linear Attention",
NeurIPS 2024, arXiv 2412.06590. train.py and the parts of its run in data.py and checkpoints.py
(and the lab's data in paper/mosaics.py) speak through these two, so that a run under torchrun
prints each line once. The rank is torchrun's RANK; a plain `python train.py` is rank 0.
"""
import os
import sys


def print0(*args, **kwargs):
    """print, on rank 0 alone, flushed at once (torchrun interleaves its processes' lines)."""
    if int(os.environ.get('RANK', 0)) == 0:
        print(*args, **kwargs, flush=True)


def fail(message):
    """Stop on bad input. Every rank checks the same arguments and files and meets the same error;
    rank 0 says it."""
    print0(f'error: {message}', file=sys.stderr)
    raise SystemExit(1)

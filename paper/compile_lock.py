"""The lab's lock for parallel runs on one machine: one process compiles a graph of the fast InLine core while the
others wait, then load it from the inductor cache (arXiv 2412.06590's experiments, rerun small by the lab).

    import kernels; from paper.compile_lock import node_lock; kernels.compile_lock = node_lock
"""
import contextlib
import fcntl
import hashlib
import os

from torch._inductor.runtime.cache_dir_utils import cache_dir


@contextlib.contextmanager
def node_lock(key):
    """Hold an exclusive lock on one file per graph in the inductor cache folder: the first process on a node
    to need the graph compiles it, the others wait and then load it from the cache, rather than all compiling
    the same graph at once (under torchrun every rank does, and the slowest paces them all). The lock goes
    with the file's descriptor, so a process that dies releases it."""
    name = hashlib.sha256(repr(key).encode()).hexdigest()[:24]
    path = os.path.join(cache_dir(), 'locks', f'inline-{name}.lock')
    os.makedirs(os.path.dirname(path), exist_ok=True)
    with open(path, 'a') as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)
        yield

"""The JIT backend's jobs: what one thread of an op runs, generated from their declarations
(abi.JOBS), each kernel called with its own parameters by name. kernels.aot compiles the same
jobs ahead of time; kernels.runner starts ``parts`` of them (one per ``me``) for an op.

A job runs the input projection of a (layer, direction) (tasks handed out by ticket, see _sync)
and then its share of the recurrence: a slice of every step's unit blocks, all samples (the
threads meet through atomics at each phase), or, for a batch of at least 4 register tiles of
rows per thread (_sync.share), every step of its own samples with no barrier. Should one thread
run two jobs one after the other, the later one finds its work claimed and done: correct
either way, only slower (on batch slices every job runs, each its own samples).
"""

from __future__ import annotations

import hashlib
import inspect
from pathlib import Path

from . import abi
from ._jit import kernel
from .backward import gru_back, lstm_back, rnn_back
from .gemm import input_projection, weight_gradient
from .recurrent import gru, lstm, rnn

# The kernels a job may call (abi.Job.calls), by name.
KERNELS = {"input_projection": input_projection, "lstm": lstm, "gru": gru, "rnn": rnn,
           "lstm_back": lstm_back, "gru_back": gru_back, "rnn_back": rnn_back,
           "weight_gradient": weight_gradient}  # fmt: skip


def signature(fn) -> list[str]:
    """A kernel's parameter names (of its Python function)."""
    return list(inspect.signature(getattr(fn, "py_func", fn)).parameters)


def _sources_digest() -> str:
    """A hash of the kernel sources: in the generated functions' names, so numba's cache, which
    does not notice when a callee changes, never serves a job compiled from older kernels."""
    h = hashlib.sha256()
    for f in sorted(Path(__file__).parent.glob("*.py")):
        h.update(f.read_bytes())
    return h.hexdigest()


def _define(name: str, source: str):
    # Defined in this module, as if written in this file: numba caches a function only if it
    # has a source file, and its cached code refers to its module by name.
    exec(compile(source, __file__, "exec"), globals())
    return globals()[name]


def _generate() -> dict:
    sigs = {k: signature(f) for k, f in KERNELS.items()}
    salt = _sources_digest()
    jobs = {}
    for job in abi.JOBS:
        name, src = abi.job_source(job, sigs, salt)
        jobs[job] = globals()[name] = kernel(_define(name, src))
    return jobs


JOBS = _generate()

"""One tolerance table, keyed by dtype: max abs error allowed against an oracle."""

import numpy as np

ATOL = {np.dtype(np.float32): 1e-5, np.dtype(np.float64): 1e-10}


def atol(dtype) -> float:
    return ATOL[np.dtype(dtype)]


# Issue 12: leanrnn.score's outputs against the same model run on each sequence alone (the
# batch and its padding may only change the order of float32 sums).
SCORE_ATOL = 1e-6

"""One tolerance table, keyed by dtype: max abs error allowed against an oracle."""

import numpy as np

ATOL = {np.dtype(np.float32): 1e-5, np.dtype(np.float64): 1e-10}


def atol(dtype) -> float:
    return ATOL[np.dtype(dtype)]

"""Training on leanrnn's kernels with numpy only: a training forward that keeps what backward
needs, backward through time, gradient clipping and optimizers updating the packed weights.

>>> import numpy as np, leanrnn
>>> from leanrnn.train import Trainer
>>> tr = Trainer(leanrnn.LSTM(8, 16, seed=0))
>>> tape = tr.forward(np.zeros((5, 3, 8), np.float32))       # tape.y, tape.h_n, tape.c_n
>>> dx, dh0, dc0 = tr.backward(tape, np.ones_like(tape.y))    # weight grads accumulate in tr.grad

The design (reserve, segments, recomputation, threads) is written in train/session.py.
"""

from .optim import SGD, Adam, AdamW, Parameter, clip_grad_norm, clip_grad_value
from .session import Tape, TapeError, Trainer, trainable

__all__ = [
    "SGD",
    "Adam",
    "AdamW",
    "Parameter",
    "Tape",
    "TapeError",
    "Trainer",
    "clip_grad_norm",
    "clip_grad_value",
    "trainable",
]

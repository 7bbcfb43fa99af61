"""Training on leanrnn's kernels with numpy only: a training forward that keeps what backward
needs, backward through time, gradient clipping and optimizers updating the packed weights.

(Work in progress this session: the design is written in train/session.py as it lands.)
"""

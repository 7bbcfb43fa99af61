"""Numba kernels, private to the engine (and later train/).

Kernels are handed every array they touch — outputs and scratch included — and allocate nothing,
validate nothing and read no config. ``reference.py`` is the slow float64 NumPy oracle.
"""

"""``leanrnn bench``: speed and memory of leanrnn next to the engines users would pick instead.

Modules: ``problem`` (configs, weights, the float64 reference, the ONNX file), ``engines`` (one
small class per engine), ``harness`` (child processes, timing, memory, the suite), ``report``
(tables, plots, summary), ``cli``. Nothing here is imported by the rest of leanrnn.
"""

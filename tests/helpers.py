"""Helpers shared by the test modules (test modules never import from each other)."""

from __future__ import annotations

import contextlib
import io
import tracemalloc
import warnings

import numpy as np

from leanrnn.formats.packing import LayerWeights


def random_layers(spec, rng, dtype=np.float32, scale=0.5) -> list[list[LayerWeights]]:
    """Canonical (PyTorch gate order) weights for ``spec``: normal draws times ``scale``."""
    out = []
    G, H, K, P = spec.gate_width, spec.hidden_size, spec.output_size, spec.proj_size
    for layer in range(spec.num_layers):
        C = spec.layer_input_size(layer)
        dirs = []
        for _ in range(spec.num_directions):

            def r(*shape):
                return (rng.standard_normal(shape) * scale).astype(dtype)

            dirs.append(
                LayerWeights(
                    r(G, C),
                    r(G, K),
                    r(G),
                    r(G),
                    r(3, H) if spec.peepholes else None,
                    r(P, H) if P else None,
                )
            )
        out.append(dirs)
    return out


def max_err(a, b) -> float:
    """Max abs difference in float64 (0 for empty arrays); the shapes must match."""
    a, b = np.asarray(a, np.float64), np.asarray(b, np.float64)
    assert a.shape == b.shape, (a.shape, b.shape)
    return float(np.max(np.abs(a - b))) if a.size else 0.0


def torch_tagger(vocab: int, emb: int, hidden: int, classes: int):
    """A torch ``embedding -> 2-layer LSTM -> linear`` in eval mode: the sequence model ONNX
    exporters are asked for most. Weights come from torch's current seed."""
    import torch  # only the torch tests call this; the others run without torch

    class Tagger(torch.nn.Module):
        def __init__(self):
            super().__init__()
            self.emb = torch.nn.Embedding(vocab, emb)
            self.lstm = torch.nn.LSTM(emb, hidden, num_layers=2)
            self.head = torch.nn.Linear(hidden, classes)

        def forward(self, tokens):
            return self.head(self.lstm(self.emb(tokens))[0])

    return Tagger().eval()


def torch_export(module, args, path, dynamo: bool, names=None, dynamic=None):
    """``torch.onnx.export`` to ``path`` with the weights inside the file, quietly (exporters
    warn and print). ``names``: (input names, output names); ``dynamic``: TorchScript's
    dynamic_axes (dynamo infers dynamic sizes itself)."""
    import torch

    kw = {"dynamo": dynamo}
    if names:
        kw["input_names"], kw["output_names"] = names
    if dynamo:
        kw["external_data"] = False
    elif dynamic:
        kw["dynamic_axes"] = dynamic
    with warnings.catch_warnings(), contextlib.redirect_stdout(io.StringIO()):
        warnings.simplefilter("ignore")
        torch.onnx.export(module, args, str(path), **kw)
    return path


class traced_peak:
    """``with traced_peak() as mem: ...`` then ``mem.peak``: the most bytes of Python
    allocations (tracemalloc) live at once inside the block, also when it raised."""

    peak = 0

    def __enter__(self):
        tracemalloc.start()
        return self

    def __exit__(self, *exc) -> None:
        self.peak = tracemalloc.get_traced_memory()[1]
        tracemalloc.stop()

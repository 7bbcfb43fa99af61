"""The one model protocol: what every model ``leanrnn.load`` returns answers (``leanrnn.Model`` and
its LSTM/GRU/RNN, ``leanrnn.GraphModel``), so loading, saving and the CLI never ask which kind
of model they hold; plus the spec-derived facts both kinds describe.
"""

from __future__ import annotations

from typing import Any, Protocol, runtime_checkable

# (imported to run, not only for type checkers: typing.get_type_hints reads these names)
import numpy as np

from ..memory.planner import Plan
from ..spec import RNNSpec


@runtime_checkable
class RunnableModel(Protocol):
    """A loaded model. Inputs and outputs are named; ``feeds`` is a dict name -> array or a list
    in ``input_names`` order (``Model`` also takes its optional ``h0``, ``c0``, ``lengths`` by
    name).

    - ``run(feeds)``: the outputs, in ``output_names`` order (fresh arrays the caller owns).
    - ``model(...)``: the kind's own call (``Model``: torch.nn's forward; ``GraphModel``: the
      inputs positionally or by name).
    - ``resize(shapes, dtypes=None, memory_limit=None)``: plan the arena for input ``shapes``
      (dict or list, like feeds) before the first run; returns the ``Plan``.
    - ``stream(batch=1)``: a ``Stream`` that carries the recurrent state from one chunk of steps
      to the next, where the model allows it (a clear error names why not).
    - ``describe(batch, steps)``: layers, parameters, weight bytes and the arena planned for
      ``batch`` sequences of ``steps`` steps, as a JSON-ready dict (what ``leanrnn inspect``
      prints).
    - ``save(path)``: write the native ``.lrnn`` file; returns the path.
    - ``lengths_input``: the input that takes per-sample lengths, or None.
    """

    @property
    def input_names(self) -> list[str]: ...

    @property
    def output_names(self) -> list[str]: ...

    @property
    def lengths_input(self) -> str | None: ...

    def run(self, feeds) -> list[np.ndarray]: ...

    def __call__(self, *args: Any, **kwargs: Any) -> Any: ...

    def resize(self, shapes, dtypes=None, memory_limit: int | None = None) -> Plan: ...

    def stream(self, batch: int = 1) -> Any: ...  # (unannotated, pyright read it as -> None)

    def describe(self, batch: int, steps: int) -> dict[str, Any]: ...

    def save(self, path) -> str: ...


def parameter_count(spec: RNNSpec) -> int:
    """Parameters of a recurrent stack as the source framework counts them (unpadded)."""
    n = 0
    H, K, P, G = spec.hidden_size, spec.output_size, spec.proj_size, spec.gate_width
    for layer in range(spec.num_layers):
        per = G * spec.layer_input_size(layer) + G * K
        per += 2 * G if spec.bias else 0
        per += 3 * H if spec.peepholes else 0
        per += P * H
        n += per * spec.num_directions
    return n


def spec_line(spec: RNNSpec) -> str:
    """One line naming what a spec runs, e.g. ``LSTM C=8 H=16 layers=2 forward``."""
    parts = [f"{spec.cell.upper()} C={spec.input_size} H={spec.hidden_size}"]
    if spec.proj_size:
        parts.append(f"P={spec.proj_size}")
    parts.append(f"layers={spec.num_layers} {spec.direction}")
    if spec.batch_first:
        parts.append("batch_first")
    if not spec.default_activations:
        acts = "/".join(a.name for a in spec.activations[0])
        parts.append(f"activations={acts}")
    if spec.clip is not None:
        parts.append(f"clip={spec.clip}")
    if spec.peepholes:
        parts.append("peepholes")
    if spec.input_forget:
        parts.append("input_forget")
    if spec.cell == "gru":
        parts.append(f"linear_before_reset={int(spec.linear_before_reset)}")
    return " ".join(parts)

"""Trainer: backpropagation through time for one model, with planned memory.

Design. The training forward *is* the inference forward: the same kernels (kernels.recurrent)
run every (layer, direction), with ``keep`` set: each step leaves its gates in its row of the
input projection ``xw`` — the LSTM's and GRU's activated (i, f, g, o; z, r, n), so that
backward needs no activation function but the LSTM's tanh(c), the RNN's pre-activation
``xW + hR + b`` (GRU: ``R_n h + bR_n`` in ``ghn`` as well), and xw and every layer output are
kept (the *reserve*) instead of being released.
Backward then works on segments of ``segment`` steps, newest first, each (layer, direction) in
reverse order:

1. h_prev of every row: the layer's own output one step earlier (nothing else was stored; in
   a forward stack a view of the layer's output buffer, which holds the segment's starting
   state one row block in front);
2. the step loop (kernels.backward: jobs lstm_back, gru_back, rnn_back on the kernels' thread
   team; train.steps is their NumPy twin): gate gradients computed in place over G, the cell
   state recomputed alongside, ``dh_prev = dG_t R`` — the only per-step GEMM;
3. the weight gradients as big GEMMs over the segment's rows — ``dW += X^T dG``,
   ``dR += H_prev^T dG`` — and the input gradient ``dX = dG W``, written in the packed
   layout of the gradient buffer (``grad``, a PackedWeights of the model's spec).

**Recomputation** (``recompute=True``, forward stacks only: Chen et al. 2016): the forward keeps
only every layer's state at segment boundaries, and backward re-runs the forward of one segment
(all layers, the same kernels from the same states, so the same bits) before going back through
it: memory O(T/S + S) per layer instead of O(T). The O(T/S) boundary states live in the rows
of dx that backward has not written yet (when they fit there: _boundaries_fit), so beyond its
outputs a step needs only the arena's O(S) (the memory bar's step: 7 MiB at segments of 8
steps, y and dx being 250 MiB). ``memory_limit=`` picks the largest segment
whose plan fits (Gruslys et al. 2016 pick segments for a memory budget the same way); both
modes walk the same segments, so their gradients are identical to the last bit.

Tapes. ``forward`` returns a Tape (the outputs and what backward needs); ``backward(tape, ...)``
accumulates gradients into ``grad`` (so k micro-batches are k backward calls) and returns the
gradients of the input and initial states. A tape lives in the trainer's arena unless made with
``own_memory=True``: a newer forward, or changed weights (any optimizer step), make it stale
and backward refuses it.

Threads: the recurrences run on the kernels' thread team; the GEMMs split their columns or
rows over the same number of Python threads (threads.matmul_pool), each a single-threaded
BLAS call. BLAS's own workers spin for a long while after every call (OpenBLAS: ~0.1 s), and a
backward alternates GEMMs with recurrences once per segment: spinning, they took the cores
the recurrence's threads wait on each other for (a recomputing step with segments of 8 spent
2.5x the CPU seconds on 2 threads).
"""

from __future__ import annotations

import functools
import math
import weakref
from collections import OrderedDict
from collections.abc import Callable
from typing import Any, Literal, Protocol, TypeVar, overload

import numpy as np
from numpy.typing import NDArray

from .. import config
from ..engine import _check, _fork
from ..engine._turn import Turn
from ..engine.products import (
    PANEL,
    PackedMatmul,
    gemm_choice,
    pack_columns,
    packed_product,
    transpose_into,
)
from ..engine.session import (
    kernel_constants,
    operand_scratch_bytes,
    recurrence_arguments,
)
from ..errors import DTypeError, LeanRNNError, PlanError, ShapeError, SpecError
from ..formats.packing import LayerWeights, PackedWeights, fold_biases, from_panels, same_panels
from ..formats.quantize import dequantize_panel, quantize_packed
from ..kernels import abi, runner
from ..memory.arena import Arena, reusable
from ..memory.planner import Buffer, plan
from ..spec import RNNSpec
from ..threads import (
    PACKED_MATMUL_PARALLEL_MACS,
    PARALLEL_MATMUL_MACS,
    PARALLEL_MIN_MACS,
    blas_alone,
    matmul_pool,
)
from .optim import Parameter, _bool, read_only

__all__ = ["Tape", "TapeError", "Trainer", "trainable"]

_Array = NDArray[Any]
_F = TypeVar("_F", bound=Callable[..., Any])
_CellState = _Array | Any  # c_n, dc0: None for GRU/RNN (as Session.run's c_n: see there)


class Matmul(Protocol):
    """``Trainer.matmul``'s type: ``f(a, b, out=out)`` writes ``a @ b`` into ``out`` (what it
    returns is not read)."""

    def __call__(self, a: _Array, b: _Array, /, out: _Array) -> object: ...


# memory plans kept per trainer, one per step shape, the least recently used going first: 16,
# all cleared when full, re-planned 49 of 60 steps whose lengths ran over 5..60 (~0.4 ms of a
# 1.4 ms step at H=64, N=8)
_PLANS_KEPT = 64
_MASK_BLOCK = 64 << 10  # bytes of uniforms drawn at a time for the dropout masks (_draw_masks)
_SPARE_KEPT = 2  # released own-memory arenas kept for reuse
# Trainer.autocast's modes: the weights rounded to bf16, and also the activations they multiply
AUTOCAST_MODES = ("bf16", "bf16-act")
# rows (segment steps x batch) of the default recomputed segment's GEMMs (_recompute_segment).
# Fewer segments cost less (each adds its weight gradients into the panels: 4 MiB of them per
# matrix at H=512), but not much: segments of 8 steps at N=64 (the memory bar's step) took
# 1.32x the CPU seconds of storing, of 32 steps 1.28x, for 7 MiB of arena instead of ~35.
_GEMM_ROWS = 512
# columns of G per weight-gradient GEMM: its output ([C or K, columns], then added into the
# gradient panels) stays in L2 instead of a [C, G] temporary of megabytes per segment. At least
# _GEMM_COLS, more while the output stays within _GEMM_OUT_BYTES (half a 512 KiB L2): at
# H=128 (float32) one GEMM of all 512 columns instead of two of 256 took 6% less CPU (each
# call packs its [X, rows] operand again); at H=512, 512 columns instead of 256 took 5% more.
_GEMM_COLS = 256
_GEMM_OUT_BYTES = 256 << 10
# On the engine's GEMM (engine.products.gemm_choice), the weight gradients go over chunks of
# the steps' rows: x^T (or h_prev^T) of a chunk transposed into at most this many bytes.
_GEMM_AT_BYTES = 4 << 20
_L1_WAY = 4096  # bytes of one way of an L1 data cache: 64 sets of 64-byte lines


# Trainer settings that were plain attributes in pickles of earlier versions: (name, its field)
_SETTINGS_BEFORE_PROPERTIES = (("threads", "_threads_asked"), ("segment", "_segment_steps"),
                               ("recompute", "_recompute"), ("memory_limit", "_memory_limit"),
                               ("dropout", "_dropout"))  # fmt: skip


def _one_at_a_time(method: _F) -> _F:
    """A Trainer method run under the trainer's Turn: another thread's forward overwrote the
    arena a backward was reading (gradients 5-87 off a scale of 272, and no error), and a
    signal handler's inside a run is refused."""

    @functools.wraps(method)
    def serialized(self, *args, **kwargs):
        with self._turn():
            return method(self, *args, **kwargs)

    return serialized  # type: ignore[return-value]  # (the method's own signature, wrapped)


class TapeError(LeanRNNError, RuntimeError):
    """A tape that cannot be used: backward already ran, or the weights changed since."""


def trainable(spec) -> None:
    """SpecError unless leanrnn can train ``spec``: PyTorch's cells (ONNX-only options refuse;
    a reverse-only direction trains, as a bidirectional stack's second direction does).
    ``spec``: an RNNSpec, or a model (its spec and its weights' precision)."""
    weights = getattr(spec, "weights", None)
    if weights is not None and getattr(weights, "precision", "float") != "float":
        raise SpecError(f"[trainable] the model has {weights.precision} weights; training "
                        "updates float weights (train the float model, then quantize)")  # fmt: skip
    spec = getattr(spec, "spec", spec)
    if not isinstance(spec, RNNSpec):  # (a raw AttributeError named a method of the spec)
        raise SpecError(f"[trainable] got {type(spec).__name__}; expected an RNNSpec or a "
                        "leanrnn.LSTM/GRU/RNN model")  # fmt: skip
    bad = spec.beyond_torch(reverse_ok=True)
    if bad:
        raise SpecError(
            f"[Trainer] this {spec.cell.upper()} uses {', '.join(bad)}: training covers PyTorch's "
            "cells (default activations, RNN tanh/relu, GRU with linear_before_reset); these "
            "ONNX-only options run for inference only"
        )


class Tape:
    """What one training forward produced: ``y``, ``h_n``, ``c_n`` (as ``Session.run`` returns
    them) and, privately, what backward needs. ``y`` reads as a read-only view: backward reads
    it again (the top layer's h_prev), and ``np.tanh(tape.y, out=tape.y)`` before it changed
    the gradients without a word (leanrnn.torch hands torch the array itself, ``_y``, whose
    version counter guards it there)."""

    def __init__(self, trainer: Trainer, y: _Array, h_n: _Array, c_n: _CellState,
                 saved: dict) -> None:  # fmt: skip
        self._y = y
        self.h_n: _Array = h_n
        self.c_n: _CellState = c_n
        self._trainer = trainer
        self._saved = saved
        self._version = trainer._version
        self._serial = saved["serial"]
        self.used = False

    @property
    def y(self) -> np.ndarray:
        return read_only(self._y)


class Trainer:
    """Backpropagation through time over one model's packed weights (updated in place).

    >>> m = leanrnn.LSTM(8, 16, seed=0); tr = Trainer(m)
    >>> tape = tr.forward(x)                      # x [T, N, 8]
    >>> dx, dh0, dc0 = tr.backward(tape, dy)      # dy like tape.y; grads accumulate in tr.grad

    ``matmul``: backward's big products (weight gradients over all steps, dx) are numpy's
    (single-threaded BLAS, split over threads.matmul_pool) unless a caller sets this, on the
    instance, to a multi-threaded ``f(a, b, out)`` of its own (leanrnn.torch: torch's, on the
    same OpenMP team its kernels then run on; a pool of Python threads beside that team would
    fight it for the cores). ``a``, ``b`` may be strided views; ``out`` is C-contiguous.
    """

    matmul: Matmul | None = None

    def __init__(self, model: Any, threads: int | np.integer | None = None,
                 segment: int | np.integer | None = None, recompute: bool = False,
                 memory_limit: int | float | None = None, dropout: float = 0.0,
                 seed: int | np.integer | None = None,
                 autocast: str | None = None) -> None:  # fmt: skip
        w = _check.packed_weights("Trainer", model)
        if w.precision != "float":  # reduced weights are for inference (leanrnn.quantize)
            raise DTypeError(f"[Trainer] the model has {w.precision} weights; training updates "
                             "float weights: train the float32 model, then quantize it")  # fmt: skip
        self.weights = w
        self.spec = w.spec
        self.dtype = w.dtype
        trainable(self.spec)
        self.autocast = autocast
        # (N, T, S, recompute, stage_x, autocast) -> (plan, shapes), least recently used first
        self._plans: OrderedDict = OrderedDict()
        self._limited: dict = {}  # (N, T, memory_limit, autocast) -> segment (_limited_segment)
        # settings: properties, checked here and whenever set later (Trainer.threads = -1 ran)
        self.threads = threads
        self.segment = segment
        self.recompute = recompute
        self.memory_limit = memory_limit
        self._dropout = 0.0
        self.dropout = dropout
        self.training = True
        if seed is not None and (not isinstance(seed, int | np.integer) or seed < 0
                                 or isinstance(seed, bool)):  # fmt: skip
            raise SpecError(f"[Trainer] seed={seed!r}; expected an int >= 0 or None")
        self._rng = np.random.default_rng(seed)
        self.grad = PackedWeights(self.spec, self.dtype)
        self._params = self._make_parameters()
        for prm in self._params:  # an optimizer's step refreshes this trainer (optim.step)
            prm._owner = weakref.ref(self)
            # no gradient before the first backward (torch's None): a step skips them, where
            # it applied weight decay and momentum to the zeros
            prm._stale = True
        self._version = -1
        self._seen = None
        self._dense: dict = {}  # (rounding, RT's groups) -> backward's dense weights (_dense_for)
        self._bf16: PackedWeights | None = None  # the master weights rounded (_forward_weights)
        self._bf16_version = -1
        self._serial = 0
        self._arena: Arena | None = None
        self._spare: list[Arena] = []  # arenas of released own-memory tapes (release())
        # arena -> {plan key: its views}: made once per arena and shape (_memory); weak, so
        # an arena's views (which hold its buffer) go with it
        self._views: weakref.WeakKeyDictionary = weakref.WeakKeyDictionary()
        self._constants = kernel_constants(self.spec, self.dtype)
        self._consts = self._constants[0]
        self._sync = np.zeros(abi.sync_size(config.max_threads()), np.int64)
        self._turn = Turn("Trainer")
        _fork.in_child(self, Trainer._after_fork)
        self._refresh()

    def _after_fork(self) -> None:
        self._turn = Turn("Trainer")  # a parent's thread may have held it

    def __getstate__(self) -> dict:
        # the views are of this trainer's arenas: a copy has its own arenas (and a weak
        # dictionary does not pickle)
        state = self.__dict__.copy()
        state.pop("_views", None)
        state.pop("_turn", None)
        # derived from the weights (remade when next needed): not worth their bytes
        state.update(_dense={}, _bf16=None, _bf16_version=-1)
        return state

    def __setstate__(self, state: dict) -> None:  # a copy or an unpickled trainer
        # (trainers pickled before autocast existed computed in float32)
        state = {"_autocast": None, "_bf16": None, "_bf16_version": -1, "_generation": -1,
                 **state}  # fmt: skip
        for old, now in _SETTINGS_BEFORE_PROPERTIES:  # (pickled before they were properties)
            if old in state:
                state[now] = state.pop(old)
        if isinstance(state.get("_dense"), list):
            state["_dense"] = {}
        self.__dict__.update(state)
        self._views = weakref.WeakKeyDictionary()
        self._turn = Turn("Trainer")
        _fork.in_child(self, Trainer._after_fork)
        # planned afresh: a plan pickled by another version may size its buffers otherwise
        # (dhn was [N, Kp] before RT's panels grew to 4 groups: the kernel would write past it)
        self._plans = OrderedDict()
        # A Parameter pickles its arrays by value, so the copy's came back detached from the
        # weights and gradients they viewed: backward would write gradients no optimizer
        # reads and the optimizer update arrays no forward reads (training silently stalls).
        # Re-point them, keeping the objects (an optimizer pickled along holds them).
        for prm, fresh in zip(self._params, self._make_parameters(), strict=True):
            prm._value, prm._grad = fresh._value, fresh._grad
            prm.logical_shape = fresh.logical_shape  # (a pickle of before it fell back to packed)
            prm._owner, prm._orphan = weakref.ref(self), False

    @property
    def autocast(self) -> str | None:
        """None (compute in the weights' dtype), ``"bf16"`` or ``"bf16-act"``: mixed
        precision, as under ``torch.autocast("cpu", torch.bfloat16)`` (leanrnn.torch sets the
        module's autocast_mode per forward). The forward then runs the bf16 kernels
        (kernels._bf16amx on AMX) on the master weights rounded to bfloat16 — remade after
        every change of them, like the folded biases — with float32 states and sums; backward computes in float32
        through the same rounded weights, and the gradients reach the float32 master weights
        as they are (the rounding passes gradients straight through, as torch's autocast
        casts do). A tape remembers its mode: a backward outside the autocast region goes
        back through the forward that was run.

        - ``"bf16"``: the activations the weights multiply stay float32 (split in two bf16
          terms where the CPU multiplies bf16: two products each), so the gradients are
          exactly those of the rounded model (up to float32 rounding and the split, <= 2**-16
          per product);
        - ``"bf16-act"``: those activations (x, h_prev) are rounded to bfloat16 before each
          product too, as torch's autocast rounds its matmuls' inputs (one product each on
          AMX and vdpbf16ps: the faster forward); backward's gradients are those of the
          rounded model's products taken at the unrounded activations (the rounding of the
          activations, like that of the weights, passes gradients straight through)."""
        return self._autocast

    @autocast.setter  # (right below its getter: mypy reads a setter apart from it as none)
    def autocast(self, value: str | None) -> None:
        if value is not None and value not in AUTOCAST_MODES:
            raise SpecError(f"[Trainer] autocast={value!r}; expected None or one of "
                            f"{', '.join(map(repr, AUTOCAST_MODES))}")  # fmt: skip
        if value is not None and self.dtype != np.float32:
            raise DTypeError(f"[Trainer] autocast={value!r} needs float32 (master) weights; these "
                             f"are {self.dtype}")  # fmt: skip
        self._autocast = value

    # Refused, not truncated or clamped, whenever set: segment=2.5 ran segments of 2, threads=-1
    # ran, and set after construction dropout=1.5 zeroed the layers' inputs.
    @property
    def threads(self) -> int | None:
        """Kernel threads (None: the process's, leanrnn.set_num_threads)."""
        return self._threads_asked

    @threads.setter
    def threads(self, value: int | np.integer | None) -> None:
        self._threads_asked = _check.count_or_none("Trainer", "threads", value)

    @property
    def segment(self) -> int | None:
        """Steps per segment of backward (None: chosen, _segment)."""
        return self._segment_steps

    @segment.setter
    def segment(self, value: int | np.integer | None) -> None:
        self._segment_steps = _check.count_or_none("Trainer", "segment", value, "steps >= 1")

    @property
    def recompute(self) -> bool:
        """Keep only segment boundaries and recompute each segment's forward in backward."""
        return self._recompute

    @recompute.setter
    def recompute(self, value) -> None:
        if value is None:  # (bool(None): the constructor took it as False)
            value = False
        ok = isinstance(value, bool | np.bool_) or (isinstance(value, int | np.integer)
                                                    and value in (0, 1))  # fmt: skip
        if not ok:  # "no" was True
            raise SpecError(f"[Trainer] recompute={value!r}; expected True or False")
        if value and self.spec.direction != "forward":
            raise SpecError(
                f"[Trainer] recompute=True needs a forward stack; this one is "
                f"{self.spec.direction} (a reverse direction starts at each sample's last step, "
                "so its segments cannot be replayed from the front)"
            )
        self._recompute = bool(value)

    @property
    def memory_limit(self) -> int | None:
        """Bytes a step's plan may take: picks the segments (None: no limit)."""
        return self._memory_limit

    @memory_limit.setter
    def memory_limit(self, value: int | float | None) -> None:
        self._memory_limit = _check.bytes_or_none("Trainer", "memory_limit", value)

    @property
    def rng(self) -> np.random.Generator:
        """The generator of the dropout masks (``seed=``). A checkpoint that should resume
        bit for bit saves ``tr.rng.bit_generator.state`` beside the weights and the optimizer's
        state dict, and sets it back the same way (pickling the trainer keeps it too)."""
        return self._rng

    @property
    def dropout(self) -> float:
        """Inter-layer dropout probability in training mode (torch.nn.LSTM's ``dropout``)."""
        return self._dropout

    @dropout.setter
    def dropout(self, value) -> None:
        if (not isinstance(value, int | float | np.integer | np.floating)
                or isinstance(value, bool) or not 0.0 <= value < 1.0):  # fmt: skip
            raise SpecError(f"[Trainer] dropout={value!r}; expected a float, 0 <= dropout < 1")
        if (value > 0) != (self._dropout > 0):
            # the plans hold the masks' buffers only with dropout on, and the segments picked
            # for a memory limit were picked without (or with) them
            self._plans.clear()
            self._limited.clear()
        self._dropout = float(value)

    # ------------------------------------------------------------------ parameters
    def _make_parameters(self) -> list[Parameter]:
        spec, out = self.spec, []
        for li, (wl, gl) in enumerate(zip(self.weights.layers, self.grad.layers, strict=True)):
            for d, (pw, pg) in enumerate(zip(wl, gl, strict=True)):
                names = ["Wt", "Rt"] + (["bW", "bR"] if spec.bias else []) + (
                    ["proj"] if spec.proj_size else [])  # fmt: skip
                for n in names:
                    out.append(Parameter(getattr(pw, n), getattr(pg, n), f"l{li}.d{d}.{n}",
                                         _logical_shape(spec, li, n)))  # fmt: skip
        return out

    def parameters(self) -> list[Parameter]:
        """The trainable tensors (views of the packed weights and of ``grad``), for an optimizer."""
        return self._params

    def zero_grad(self, set_to_none: bool = True) -> None:
        """Zero the gradients; until the next backward an optimizer's step skips these
        parameters, as torch's does after zero_grad (with ``set_to_none=False`` it steps on
        the zeros, as torch's: Parameter.zero_grad)."""
        _bool("Trainer.zero_grad", "set_to_none", set_to_none)  # (before any gradient goes)
        self.grad.buffer[:] = 0
        for p in self._params:
            p.zero_grad(set_to_none)

    def release(self, tape: Tape) -> None:
        """Done with an own-memory tape (``forward(own_memory=True)``) and everything read from
        it (its ``y``, ``h_n``, ``c_n`` stay valid): the next own-memory forward may reuse its
        arena. The tape cannot take a backward afterwards."""
        mem = tape._saved.get("mem")
        if tape._trainer is not self or mem is None:
            return
        tape.used = True
        tape._saved = {"serial": tape._serial, "released": True}
        arena = mem["_arena"]
        if arena is not self._arena and len(self._spare) < _SPARE_KEPT:
            self._spare.append(arena)

    def _refresh(self) -> None:
        """After the weights changed: refold the biases the kernels add (b = bW + bR, GRU's rb);
        the dense copies backward's GEMMs read and the bf16 rounding are remade when next
        needed (_dense_for, _forward_weights). Cheap next to a training step."""
        for dirs in self.weights.layers:
            for pl in dirs:
                fold_biases(self.spec, pl)
        self._dense = {}
        self._seen = [p.version for p in self._params]
        self._generation = self.weights.generation
        self._version += 1

    def _forward_weights(self, autocast: str | None) -> PackedWeights:
        """The packed weights a forward in ``autocast`` mode runs on: the master weights, or
        their bf16 rounding (one buffer, refilled after each change of the master weights)
        read in the mode's precision ("bf16-act": the same panels, formats.packing
        .same_panels), which says to the kernels' calls what it says in inference."""
        if autocast is None:
            return self.weights
        if self._bf16_version != self._version:
            self._bf16 = quantize_packed(self.weights, "bf16", out=self._bf16,
                                         op="Trainer (autocast)")  # fmt: skip
            self._bf16_version = self._version
        return self._bf16 if autocast == "bf16" else same_panels(self._bf16, autocast)

    def _dense_for(self, autocast: str | None) -> list:
        """Per layer and direction, (Wd, Rd, proj, RT, projd, Wp): dense copies of the weights
        the forward in ``autocast`` mode multiplied by (rounded to bf16 under autocast), for
        backward's GEMMs (Wp: Wd packed for the engine's GEMM, or None on BLAS); made once per
        change of the weights."""
        groups = self._dh_groups()  # (RT's panel width: it follows the thread count)
        key = (None if autocast is None else "bf16", groups)  # both modes: the same rounding
        made = self._dense.get(key)
        if made is not None:
            return made
        # (a change of threads: the other width's copies go, as _dense_bytes counts one width)
        self._dense = {k: v for k, v in self._dense.items() if k[1] == groups}
        spec, w = self.spec, self.weights
        fw = self._forward_weights(autocast)

        def seen(pl, name):  # the values the forward multiplied by
            panels = getattr(pl, name)
            return panels if autocast is None else dequantize_panel(panels, fw.precision)

        made = []
        for li, (dirs, fdirs) in enumerate(zip(w.layers, fw.layers, strict=True)):
            Cin = spec.layer_input_size(li)
            row = []
            for pl, fl in zip(dirs, fdirs, strict=True):
                Wd = np.ascontiguousarray(from_panels(seen(fl, "Wt"))[:, :Cin])
                Rd = np.ascontiguousarray(from_panels(seen(fl, "Rt")))
                RT = _column_panels(Rd, groups)
                P, H = spec.proj_size, spec.hidden_size
                projd = np.zeros((P, w.Hp), self.dtype)  # [P, Hp] (P = 0: none)
                proj = None
                if P:  # float32 in every mode (as in the bf16 model: formats.quantize)
                    proj = np.ascontiguousarray(from_panels(pl.proj)[:P, :H])
                    projd[:, :H] = proj
                # dx = dG Wd on the engine's GEMM: Wd's columns packed once per weights change
                Wp = PackedMatmul.of(Wd) if self._native_gemm() else None
                row.append((Wd, Rd, proj, RT, projd, Wp))
            made.append(row)
        self._dense[key] = made  # (only whole: a failure half-way caches nothing)
        return made

    def _dh_groups(self) -> int:
        """Groups of B columns per panel of RT (_column_panels): 4, the widest tile, while every
        thread still gets a panel of each step's dh_prev GEMM, else fewer."""
        groups, threads = self.weights.Kp // self.weights.B, self._threads()
        return next((g for g in (4, 2) if -(-groups // g) >= threads), 1)

    def _check_weights(self) -> None:
        """Refresh what is derived from the weights if they changed: through this trainer's
        parameters (then every other trainer over the same model is told, through the
        weights' generation: its dense copies and bf16 rounding were silently stale) or
        through another trainer's."""
        if [p.version for p in self._params] != self._seen:
            self.weights.generation += 1
        if self._weights_changed():
            self._refresh()

    def _weights_changed(self) -> bool:
        mine = [p.version for p in self._params] != self._seen
        return mine or self.weights.generation != self._generation

    # ------------------------------------------------------------------ forward
    @_one_at_a_time
    def forward(self, x, hx=None, lengths=None, own_memory: bool = False, masks=None) -> Tape:
        """The training forward: outputs as ``Model.forward`` computes them, and a Tape.

        x: [T, N, C] ([N, T, C] with batch_first); hx: h0 [L*D, N, K] or (h0, c0) for LSTM;
        lengths: [N] (PyTorch's packed-sequence semantics). ``own_memory``: the tape gets its
        own buffers instead of the trainer's arena (several live tapes at once). ``masks``:
        L-1 dropout masks [T*N, D*K] (time-major rows, already scaled by 1/(1-p)) to use
        instead of drawing them (leanrnn.torch draws them with torch's generator, as
        torch.nn.LSTM does); needs a Trainer made with dropout > 0 (which plans their buffers).

        A time-major C-contiguous ``x`` is read in place, by this forward and again by the
        backward of its tape (the weight gradients), and so are ``masks``: keep them unchanged
        until then (a loader that refills one buffer: copy, or run backward first).
        leanrnn.torch's autograd guards them with torch's version counter.
        """
        own_memory = _bool("Trainer.forward", "own_memory", own_memory)  # "yes" was true
        self._check_weights()
        spec, dt, op = self.spec, self.dtype, "Trainer.forward"
        L, D = spec.num_layers, spec.num_directions
        K, H, C = spec.output_size, spec.hidden_size, spec.input_size
        names = ("N", "T", "C") if spec.batch_first else ("T", "N", "C")
        x = _check.array(op, "x", x, dt, (None, None, C), names)
        if spec.batch_first:
            N, T = x.shape[:2]
        else:
            T, N = x.shape[:2]
        if N == 0 or T == 0:
            raise ShapeError(f"[{op}] x has shape {x.shape}; T and N must be >= 1")
        h0 = c0 = None
        if hx is not None:
            if spec.cell == "lstm":
                if not isinstance(hx, tuple | list) or len(hx) != 2:
                    raise ShapeError(f"[{op}] hx must be a tuple (h0, c0) for an LSTM")
                h0, c0 = hx
            else:
                h0 = hx
        if h0 is not None:
            h0 = _check.array(op, "h0", h0, dt, (L * D, N, K), ("L*D", "N", "K"))
        if c0 is not None:
            c0 = _check.array(op, "c0", c0, dt, (L * D, N, H), ("L*D", "N", "H"))
        lens = np.full(N, T, np.int64) if lengths is None else _check.lengths(op, lengths, N, T)
        # time-major input: the kernels and the weight GEMMs read rows t*N + n; the caller's x
        # is read in place when it is already laid out so (the tape keeps a reference); else a
        # copy in the arena, counted by the segment a memory limit picks (an unaligned one
        # too: the kernels take aligned arrays only, as Session.run's copies them)
        stage = spec.batch_first or not x.flags.c_contiguous or not x.flags.aligned
        # Padding (steps past a sample's length) is never read forward, but the input weights'
        # gradient sums x's rows times gate gradients over every row: NaN there (np.empty, a
        # loader's fill) made all of dW_ih NaN as NaN * 0, where torch's packed sequence
        # never reads it. Such padding is zeroed in the staged copy (the caller's x as it was).
        pad = None if lengths is None else _padding(lens, T, spec.batch_first)
        if pad is not None and not np.isfinite(x[pad]).all():
            stage = True
        else:
            pad = None
        # the trainer's own dropout masks, planned in the arena only when it draws them
        draw = bool(masks is None and self._draws())
        S = self._segment(T, N, stage, draw)
        recompute = (self.recompute or self.memory_limit is not None) and S < T
        if masks is not None:
            if not self.dropout or len(masks) != L - 1:
                raise ShapeError(f"[{op}] got {len(masks)} dropout masks for {L} layers; expected "
                                 "L-1 of them, and a Trainer made with dropout > 0")  # fmt: skip
            DK = D * K
            masks = [(_check.array(op, "masks", m, dt, (T * N, DK), ("T*N", "D*K")), None)
                     for m in masks]  # fmt: skip
        # Every check is above this line: from here the shared arena is overwritten, so the
        # live tape in it (if any) is stale from now on, and only then.
        mode = self.autocast
        mem = self._memory(N, T, S, recompute, own_memory, stage, mode, draw)
        if mem["_arena"] is self._arena:
            self._serial += 1
        if draw:
            masks = self._draw_masks(mem, T * N)
        if stage:
            xt = mem["x"]
            xt[:] = (
                x.transpose(1, 0, 2).reshape(T * N, C) if spec.batch_first else x.reshape(T * N, C)
            )
            if pad is not None:
                xt.reshape(T, N, C)[pad.T if spec.batch_first else pad] = 0
        else:
            xt = x.reshape(T * N, C)
        # a forward stack's output has one row block in front: backward writes the initial
        # state there, and then h_prev of the top layer is a view (no copy of y per backward)
        pre = _front_rows(spec, N)
        yfull = np.empty((pre + T * N, D * K), dt)
        y = yfull[pre:]
        h_n = np.empty((L * D, N, K), dt)
        c_n = np.empty((L * D, N, H), dt) if spec.cell == "lstm" else None
        hs = np.zeros((L * D, N, K), dt) if h0 is None else h0.copy()
        cs = (np.zeros((L * D, N, H), dt) if c0 is None else c0.copy()) if c_n is not None else None
        # dx is made here, not in backward: until backward writes them, its rows hold the
        # boundary states (untouched pages of it cost nothing)
        dx = np.empty((T * N, C), dt)
        saved = dict(T=T, N=N, S=S, recompute=recompute, lens=lens, mem=mem, own=own_memory,
                     masks=masks, x=xt, h0=hs.copy(), c0=None if cs is None else cs.copy(), y=y,
                     yfull=yfull, dx=dx, autocast=mode)  # fmt: skip
        # Segment by segment, keeping every layer's state at each boundary: backward starts
        # each segment from them (and, recomputing, replays the segment's forward from them).
        ckh, ckc = self._boundaries(dx, T, N, S, saved["h0"], saved["c0"])
        for j, s0 in enumerate(range(0, T, S)):
            ckh[j][:] = hs  # (segment 0's may be the tape's copy itself: the same values)
            if ckc is not None:
                ckc[j][:] = cs
            s1 = min(T, s0 + S)
            self._forward_segment(mem, xt, y[s0 * N : s1 * N], hs, cs, lens, s0, s1, N, masks,
                                  0 if recompute else s0 * N, mode)  # fmt: skip
        saved.update(ckh=ckh, ckc=ckc)
        h_n[:] = hs
        if c_n is not None:
            c_n[:] = cs
        saved["serial"] = self._serial
        yv = y.reshape(T, N, D * K)
        yout = np.ascontiguousarray(yv.transpose(1, 0, 2)) if spec.batch_first else yv
        return Tape(self, yout, h_n, c_n, saved)

    def _draws(self) -> bool:
        """Whether a forward without ``masks=`` draws dropout masks (training mode, dropout on,
        two layers or more)."""
        return bool(self.training and self.dropout and self.spec.num_layers > 1)

    def _segment(self, T: int, N: int, stage: bool | None = None, draw: bool = False) -> int:
        """``stage``: x is copied into the arena (batch-first or non-contiguous input; default:
        batch-first); ``draw``: the dropout masks are drawn into it. A memory limit counts
        both."""
        stage = self.spec.batch_first if stage is None else stage
        if self.memory_limit is not None:
            # the search plans a few dozen segment lengths (~20 ms): once per step shape
            # (threads: the plan's per-thread rows, _buffers' gw, and _dense_bytes' panels)
            key = (N, T, self.memory_limit, self.autocast, stage, draw, self._threads())
            S = self._limited.get(key)
            if S is None:
                S = self._limited_segment(T, N, stage, draw)
                if len(self._limited) >= _PLANS_KEPT:
                    self._limited.clear()
                self._limited[key] = S
            return S
        if self.spec.direction != "forward":
            return T  # a reverse direction's segments would start mid-sample (see __init__)
        if self.segment is not None:
            return max(1, min(T, int(self.segment)))
        if self.recompute:
            return self._recompute_segment(T, N)
        return T

    def _recompute_segment(self, T: int, N: int) -> int:
        """The default recomputed segment. The arena grows with S (every layer's gates of a
        segment are live at once) and, while the boundary states fit in dx's rows (below),
        nothing else does: so the shortest segment whose weight-gradient GEMMs still get
        _GEMM_ROWS rows, at most sqrt(T) (Chen et al.'s balance, which still applies when the
        boundary states need memory of their own)."""
        root = max(1, round(np.sqrt(T)))
        S = min(root, max(1, -(-_GEMM_ROWS // N)))
        return S if self._boundaries_fit(N, T, S) else root

    def _draw_masks(self, mem: dict, rows: int) -> list[tuple[np.ndarray, object]]:
        """The step's dropout masks, drawn into the arena: per layer below the top, a byte per
        value (1: kept), with the scale 1/(1-p) applied where a mask is (x * kept * scale is
        x * (kept / (1-p)) to the bit, the float mask it replaces). The uniforms come in blocks
        through a small planned buffer, in the order one [rows, D*K] draw per layer gives them
        (the same masks from the same generator state), instead of a float64 array of T*N*D*K
        and a float mask of the step's size per layer outside every plan and limit."""
        p, u = self.dropout, mem["u"]
        scale = self.dtype.type(1.0 / (1.0 - p))
        out = []
        for layer in range(self.spec.num_layers - 1):
            kept = mem[f"mask.{layer}"]
            for r0 in range(0, rows, u.shape[0]):
                block = u[: min(u.shape[0], rows - r0)]
                self._rng.random(out=block)
                np.greater_equal(block, p, out=kept[r0 : r0 + block.shape[0]])
            out.append((kept, scale))
        return out

    def plan(self, batch: int, steps: int, staged: bool | None = None,
             masks: bool = False) -> dict:  # fmt: skip
        """What a training step of ``batch`` x ``steps`` will use: its segment length, whether it
        recomputes, the arena (reserve + scratch; ``plan``: the planner's placements, their op
        indices named by ``ops``, ``lifetimes`` in words) and the boundary states, in bytes
        (``checkpoint_bytes``: 0 when they live in dx's not yet written rows). ``staged``:
        whether x is copied into the arena — batch-first input, or time-major input that is
        not C-contiguous (a view such as x.transpose(1, 0, 2)); default: batch-first.
        ``masks``: the step is given its dropout masks (``forward(masks=)``, as leanrnn.torch
        does); by default the trainer draws them (in training mode with dropout) into the
        arena."""
        batch = _check.count("Trainer.plan", "batch", batch, ShapeError)
        steps = _check.count("Trainer.plan", "steps", steps, ShapeError)
        stage = self.spec.batch_first if staged is None else bool(staged)
        draw = not masks and self._draws()
        S = self._segment(steps, batch, stage, draw)
        recompute = (self.recompute or self.memory_limit is not None) and S < steps
        p = plan(self._buffers(batch, steps, S, recompute, stage, self.autocast, draw)[0])
        arena = p.total
        ops = self._ops()

        def life(b) -> str:
            if b.first == 0 and b.last >= 2:
                return f"reserve, to {ops[b.last]}"
            return ops[b.first] if b.first == b.last else f"{ops[b.first]} .. {ops[b.last]}"

        ck = self._checkpoint_bytes(batch, steps, S)
        dense = self._dense_bytes()
        copies = self._layout_copies(batch, steps)
        return dict(segment=S, segments=-(-steps // S), recompute=recompute, arena_bytes=arena,
                    plan=p, ops=ops,
                    lifetimes={pl.buffer.name: life(pl.buffer) for pl in p.placements},
                    boundaries_in_dx=self._boundaries_fit(batch, steps, S),
                    checkpoint_bytes=ck, dense_weight_bytes=dense, layout_copy_bytes=copies,
                    total_bytes=arena + ck + dense + copies)  # fmt: skip

    def _boundary_floats(self, N: int) -> int:
        """Values of every layer's state at one segment boundary (h, and c for an LSTM)."""
        spec = self.spec
        per = spec.output_size + (spec.hidden_size if spec.cell == "lstm" else 0)
        return spec.num_layers * spec.num_directions * N * per

    def _boundaries_fit(self, N: int, T: int, S: int) -> bool:
        """Whether the boundary states can live in dx. Backward writes dx segment by segment,
        the newest first, and reads segment j's boundary states before it writes segment j's
        rows: so boundary j, at values [j*per, (j+1)*per) of dx, is intact when read if it
        ends within the rows of segments 0..j: per <= S*N*C (and the same for the last, maybe
        shorter, segment)."""
        per, C = self._boundary_floats(N), self.spec.input_size
        return per <= S * N * C and -(-T // S) * per <= T * N * C

    def _boundaries(self, dx: np.ndarray, T: int, N: int, S: int, h0, c0):
        """Every segment's boundary states: lists of views h [L*D, N, K] and (LSTM) c
        [L*D, N, H], in dx's rows when they fit there (_boundaries_fit), else their own but
        the first: segment 0 starts from the tape's copy of the initial states, ``h0`` and
        ``c0`` (a second copy of them, counted against memory_limit, tipped a small step's
        plan under its limit by a few KiB: the arena was dropped and made again every step
        two shapes alternated)."""
        spec = self.spec
        LD, K, H = spec.num_layers * spec.num_directions, spec.output_size, spec.hidden_size
        nseg, per = -(-T // S), self._boundary_floats(N)
        hsz = LD * N * K
        lstm = spec.cell == "lstm"
        if self._boundaries_fit(N, T, S):
            flat = dx.reshape(-1)
            blocks = [flat[j * per : (j + 1) * per] for j in range(nseg)]
            ckh = [b[:hsz].reshape(LD, N, K) for b in blocks]
            return ckh, ([b[hsz:].reshape(LD, N, H) for b in blocks] if lstm else None)
        blocks = list(np.empty((nseg - 1, per), self.dtype))
        ckh = [h0, *(b[:hsz].reshape(LD, N, K) for b in blocks)]
        return ckh, ([c0, *(b[hsz:].reshape(LD, N, H) for b in blocks)] if lstm else None)

    def _dense_bytes(self) -> int:
        """Bytes of what backward keeps derived from the weights (_dense_for: dense W and R, R's
        column panels, the projection, W packed for the engine's GEMM; under autocast also the
        bf16 rounding, _forward_weights): ~1.5-2.5x the weights, made at the first step and
        after each change of the weights. Counted with every step's plan (``plan``,
        ``memory_limit``), which left them out (35.9 MiB beyond a 4 MiB figure at H=512)."""
        spec, w, isz = self.spec, self.weights, self.dtype.itemsize
        W = self._dh_groups() * abi.B
        native = self._native_gemm()
        P, H = spec.proj_size, spec.hidden_size
        values = 0
        for li, dirs in enumerate(w.layers):
            cin = spec.layer_input_size(li)
            for pl in dirs:
                gp = pl.Wt.shape[0] * pl.Wt.shape[2]  # dense rows of from_panels
                kp = pl.Rt.shape[1]
                values += gp * cin + gp * kp + gp * -(-kp // W) * W  # Wd, Rd, RT
                values += P * w.Hp + P * H  # projd, proj
                if native:  # Wp: PackedMatmul.of(Wd), its panels and bias slot
                    panels = -(-cin // PANEL)
                    values += panels * PANEL * (gp + 1)
        extra = 0
        if self.autocast is not None:
            extra = PackedWeights.size(spec, self.dtype, "bf16")
        return values * isz + extra

    def _layout_copies(self, N: int, T: int) -> int:
        """Bytes a batch-first step holds beyond its arena and outputs: it computes time-major,
        so y (kept for backward: the tape's reserve), dy and dx are copies beside the
        batch-first arrays handed in and out (a memory limit went 2.2x past without them)."""
        spec = self.spec
        if not spec.batch_first:
            return 0
        yk = spec.num_directions * spec.output_size
        return T * N * (2 * yk + spec.input_size) * self.dtype.itemsize

    def _checkpoint_bytes(self, N: int, T: int, S: int) -> int:
        """Bytes of the boundary states beyond the step's outputs: none when they live in dx,
        and never the first segment's (the tape's copy of the initial states, _boundaries)."""
        if self._boundaries_fit(N, T, S):
            return 0
        return (-(-T // S) - 1) * self._boundary_floats(N) * self.dtype.itemsize

    def _need(self, N: int, T: int, S: int, recompute: bool, stage: bool | None = None,
              draw: bool = False) -> int:  # fmt: skip
        """Bytes of a step of N x T in segments of S: arena + boundary states (the same count
        that ``memory_limit`` is held to and that its errors report). ``stage``, ``draw``: as
        _segment."""
        stage = self.spec.batch_first if stage is None else stage
        need = plan(self._buffers(N, T, S, recompute, stage, self.autocast, draw)[0]).total
        return need + self._beside_arena(N, T, S)

    def _beside_arena(self, N: int, T: int, S: int) -> int:
        """Bytes a step of N x T in segments of S holds beyond its arena and outputs, counted
        with it in ``memory_limit``: the boundary states, backward's dense copies of the
        weights, a batch-first step's time-major copies."""
        return self._checkpoint_bytes(N, T, S) + self._dense_bytes() + self._layout_copies(N, T)

    def _limited_segment(self, T: int, N: int, stage: bool, draw: bool = False) -> int:
        """The segment ``memory_limit`` allows: the whole sequence stored if it fits, else the
        longest recomputed segment that fits (arena + boundary states; PlanError if none)."""
        limit = int(self.memory_limit)
        if self._need(N, T, T, False, stage, draw) <= limit:
            return T
        if self.spec.direction != "forward":
            raise PlanError(
                f"[Trainer] a {self.spec.direction} stack stores the whole sequence: "
                f"{self._need(N, T, T, False, stage, draw)} bytes for N={N}, T={T}; "
                f"memory_limit={limit}"
            )

        def longest(lo: int, hi: int) -> int:  # need(lo) fits and need grows over [lo, hi]
            while lo < hi:
                mid = (lo + hi + 1) // 2
                if self._need(N, T, mid, True, stage, draw) <= limit:
                    lo = mid
                else:
                    hi = mid - 1
            return lo

        # From the shortest segment whose boundary states fit in dx (the fit only gets easier
        # with S) the boundary states cost nothing and bytes grow with S: if that segment fits,
        # the answer is above it.
        fit = next((S for S in _doubling(T - 1) if self._boundaries_fit(N, T, S)), None)
        needs = {}
        if fit is not None:
            lo = 1 if fit == 1 else fit // 2 + 1
            while lo < fit:  # the exact shortest one, between the last miss and fit
                mid = (lo + fit) // 2
                lo, fit = (lo, mid) if self._boundaries_fit(N, T, mid) else (mid + 1, fit)
            # too big, it stays a candidate for the least (often it: the error named more)
            needs[fit] = self._need(N, T, fit, True, stage, draw)
            if needs[fit] <= limit:
                return longest(fit, T - 1)
        # Below it, bytes ~ a*S + b*T/S + c: the segments that fit are an interval around the
        # minimum. Where the minimum lies depends on how the per-step buffers (a) weigh against
        # the boundary states (b), so look for it on a geometric grid of S (a few dozen plans,
        # not T), then take the longest fitting segment above it (fewest segments, biggest
        # GEMMs).
        top = T - 1 if fit is None else fit - 1
        grid = sorted({int(s) for s in np.unique(np.geomspace(1, max(top, 1), 48).round())})
        needs.update({S: self._need(N, T, S, True, stage, draw) for S in grid})
        best = min(needs, key=needs.get)
        if needs[best] > limit:
            raise PlanError(
                f"[Trainer] even recomputing segments of {best} steps (the least memory) needs "
                f"{needs[best]} bytes for N={N}, T={T}; memory_limit={limit}: lower the batch "
                "or raise the limit" + self._staged_hint(stage, T, N)
            )
        return longest(best, top)

    def _staged_hint(self, stage: bool, T: int, N: int) -> str:
        """What a memory limit's error adds where the caller's x is copied for no layout's
        sake (time-major but not C-contiguous): the copy's bytes, and how to avoid it."""
        if not stage or self.spec.batch_first:
            return ""
        nbytes = T * N * self.spec.input_size * self.dtype.itemsize
        return (f" (x is not C-contiguous: its copy takes {nbytes} of them; a C-contiguous "
                "time-major x is read in place)")  # fmt: skip

    def _ops(self) -> list[str]:
        """Names of the plan's op indices: the forward, backward's replay of a segment, then
        per layer, top first: its step loop, then its GEMMs (weight gradients and the input
        gradient, at the same time on a team of threads)."""
        ops = ["forward", "replay"]
        for layer in reversed(range(self.spec.num_layers)):
            ops += [f"l{layer} step loop", f"l{layer} GEMMs"]
        return ops

    def _buffers(self, N: int, T: int, S: int, recompute: bool, stage_x: bool = True,
                 autocast: str | None = None, draw: bool = False):  # fmt: skip
        """The reserve and the scratch of a step of N x T (segments of S) as planner Buffers
        with lifetimes (op indices as ``_ops`` names them), and their shapes. ``stage_x``: a
        time-major copy of x (batch-first or non-contiguous input); ``autocast``: the forward's
        mode (bf16 where the CPU multiplies bf16: the threads' split activation rows; bf16-act on
        every CPU: their rounded ones; kernels.gemm.operand).

        Each backward buffer lives only while its layer needs it, so the planner stacks a
        lower layer's scratch on the upper layer's spent gates. In a forward stack a layer's
        h_prev is its own output one row block up: the layer buffers hold one extra block of
        N rows in front (the segment's starting state), and h_prev is a view, not a copy."""
        spec, w = self.spec, self.weights
        L, D, K = spec.num_layers, spec.num_directions, spec.output_size
        R = S if recompute else T  # rows of steps the per-layer buffers hold
        RN = R * N
        pre = _front_rows(spec, N)
        lstm, gru, P = spec.cell == "lstm", spec.cell == "gru", spec.proj_size
        end = len(self._ops()) - 1
        bufs: list[Buffer] = []
        shapes: dict = {}

        def add(name, shape, first, last, dtype=None):
            dtype = np.dtype(dtype or self.dtype)
            # math.prod: Python ints (np.prod wrapped around to a negative size at N=10**12)
            bufs.append(Buffer(name, math.prod(shape) * dtype.itemsize, first, last))
            shapes[name] = (shape, dtype)

        def ops(layer):
            """(step loop, weight GEMMs, dx) op of a layer: the GEMMs run together. Two
            directions run loop, GEMMs, loop, GEMMs: the layer's buffers then span both."""
            b = 2 + 2 * (L - 1 - layer)
            return b, b + 1, b + 1

        def first(layer):  # the first op of a layer's backward
            return 2 + 2 * (L - 1 - layer)

        # Backward runs these ops once per segment. Recomputing, the replay rewrites a
        # segment's layer buffers before each pass; storing, they hold every segment, and
        # with several segments they stay live to the end.
        held = not recompute and -(-T // S) > 1
        if stage_x:
            add("x", (T * N, spec.input_size), 0, end)
        for layer in range(L):
            loop, gemm, dx = ops(layer)
            for d in range(D):
                k = layer * D + d
                add(f"xw.{k}", (RN, w.Gp), 0, end if held else dx)
                if gru:
                    add(f"ghn.{k}", (RN, w.Hp), 0, end if held else gemm)
            if layer < L - 1:
                # read by the layer above (its input) and by this layer's backward (h_prev)
                add(f"y.{layer}", (pre + RN, D * K), 0, end if held else gemm)
                if self.dropout:
                    add(f"xd.{layer}", (RN, D * K), 0, end if held else ops(layer + 1)[1])
                if draw:  # the step's drawn mask (a byte per value: _draw_masks), to the end
                    add(f"mask.{layer}", (T * N, D * K), 0, end, np.uint8)
                # written by the dx GEMM of the layer above, read by this layer's step loop
                add(f"dy.{layer}", (RN, D * K), ops(layer + 1)[2] if D == 1 else first(layer + 1),
                    loop if D == 1 else dx)  # fmt: skip
            if pre and layer == L - 1:
                if recompute:  # the top layer's h_prev in a replay: its output, one block down
                    add("ytop", (pre + RN, K), 1, gemm)
            elif not pre:
                add(f"hprev.{layer}", (RN, K), loop, gemm)
            if lstm:
                add(f"cs.{layer}", (RN, w.Hp), loop, loop if D == 1 else dx)
            if P:
                add(f"hf.{layer}", (RN, w.Hp), loop, gemm)
                add(f"dhs.{layer}", (RN, P), loop, gemm)
            if D == 2:  # direction 1's part of the input gradient
                add(f"dxd.{layer}", (RN, spec.layer_input_size(layer)), loop, dx)
        # forward scratch (one op at a time; recomputing, backward replays the forward too)
        fl = 1 if recompute else 0
        if draw:  # uniforms for the masks, a block at a time (_draw_masks)
            add("u", (max(1, _MASK_BLOCK // (8 * D * K)), D * K), 0, 0, np.float64)
        add("h.a", (N, w.Kp), 0, fl)
        add("h.b", (N, w.Kp), 0, fl)
        add("gates", (N, w.Gp), 0, fl)
        add("c", (N, w.Hp), 0, fl)
        if P:
            add("aux", (N, w.Hp), 0, fl)
        if autocast is not None:  # the bf16 job's operand scratch, as inference sizes it
            q = max(operand_scratch_bytes(spec, autocast, layer, R * N, N) for layer in range(L))
            if q:
                add("q", (config.max_threads(), q), 0, fl, np.uint8)
        # backward scratch
        add("dh", (N, w.Kp), 2, end)
        add("dgs", (N, w.Gp), 2, end)
        # as wide as RT's widest panels make it (_dh_groups: the width may change with the
        # threads when the weights change, and a cached plan must still hold it)
        add("dhn", (N, -(-w.Kp // (4 * w.B)) * 4 * w.B), 2, end)
        if lstm:
            add("dc", (N, w.Hp), 2, end)
            add("cb", (N, w.Hp), 2, end)
        # the weight GEMMs' output, a few panels at a time, before it is added into the panels
        if not self._native_gemm():
            # one per thread
            add("gw", (self._threads(), self._gemm_rows() * self._gemm_cols()), 2, end)
            return bufs, shapes
        if not self._in_place_gradients():
            # packed (_packed_gradients): one output of whole 64-column panels, the packed
            # columns of G and the transposed rows of a chunk of steps
            cols = -(-self._gemm_cols() // PANEL) * PANEL
            kc = self._gemm_chunk(RN)
            add("gw", (1, self._gemm_rows() * cols), 2, end)
            add("gpk", (cols * kc,), 2, end)
            # both transposes at once (G packed once for dW and dR) but in a recomputing
            # step's small plan, where one at a time keeps its scratch at 1 MB instead of 3
            add("gat", ((self._gemm_rows() + (0 if recompute else K)) * kc,), 2, end)
        # dx's last panel
        if any(spec.layer_input_size(layer) % PANEL for layer in range(L)):
            add("dxt", (RN, PANEL), 2, end)
        return bufs, shapes

    def _native_gemm(self) -> bool:
        """Whether backward's big products run on the engine's GEMM (engine.products:
        measured per machine) rather than numpy's BLAS; never with a caller's ``matmul``."""
        return self.matmul is None and gemm_choice(self.dtype) == "native"

    def _gemm_chunk(self, rows: int) -> int:
        """Rows of steps per weight-gradient product on the engine's GEMM: all of them while
        their transposed x (or h_prev) fits in _GEMM_AT_BYTES."""
        width = self._gemm_rows() * self.dtype.itemsize
        return max(1, min(rows, _GEMM_AT_BYTES // width))

    def _gemm_rows(self) -> int:
        """The most rows of a weight-gradient GEMM's output: a layer's input width X (C, or
        D*K above the first layer) or K, for dR."""
        spec = self.spec
        return max(spec.input_size, spec.num_directions * spec.output_size)

    def _gemm_cols(self) -> int:
        """Columns of G per weight-gradient GEMM: whole panels, at least about _GEMM_COLS of
        them, more while the [X, columns] output fits in _GEMM_OUT_BYTES."""
        w = self.weights
        Wd = self.grad.layers[0][0].Wt.shape[2]
        cols = max(_GEMM_COLS, _GEMM_OUT_BYTES // (self._gemm_rows() * self.dtype.itemsize))
        return min(w.Gp, max(1, cols // Wd) * Wd)

    def _memory(self, N: int, T: int, S: int, recompute: bool, own: bool, stage_x: bool,
                autocast: str | None = None, draw: bool = False) -> dict:  # fmt: skip
        """Views of one planned arena for a step of N x T (segments of S): the reserve and the
        scratch of forward and backward, placed by lifetime (memory.planner). Plans are kept
        per shape (planning costs ~1.5 ms, a step of a small model ~10 ms)."""
        key = (N, T, S, recompute, stage_x, autocast, draw, self._native_gemm(), self._threads())
        made = self._plans.get(key)
        if made is None:
            bufs, shapes = self._buffers(N, T, S, recompute, stage_x, autocast, draw)
            made = self._plans[key] = (plan(bufs), shapes)
            if len(self._plans) > _PLANS_KEPT:
                self._plans.popitem(last=False)
        self._plans.move_to_end(key)  # (now the most recently used)
        p, shapes = made
        spec = self.spec
        cap = None
        if self.memory_limit is not None:
            # the limit holds the arena and what the step keeps beside it (_need): an arena
            # kept from an earlier, larger step fitted the limit alone, and held 1.4x it
            # beside a new shape's boundary states, dense copies and layout copies
            cap = int(self.memory_limit) - self._beside_arena(N, T, S)
        if own:
            # a released tape's arena when one is big enough: fresh pages cost a page fault
            # each, ~1 ms per 4 MiB
            arena = next((a for a in self._spare if reusable(a, p.total, cap)), None)
            if arena is not None:
                self._spare.remove(arena)
            else:
                arena = Arena(p.total, name="tape")
        else:
            if not reusable(self._arena, p.total, cap):
                self._arena = None
                self._arena = Arena(p.total, name=f"train[{spec.cell} N={N} T={T}]")
            arena = self._arena
        # the views of this arena for this plan: made once (a dozen or more arena.view calls
        # were ~0.1 ms of every forward, a tenth of a small model's training step)
        cache = self._views.get(arena)
        if cache is None:
            cache = self._views[arena] = OrderedDict()
        views = cache.get(key)
        if views is None or views["_plan"] is not p:
            if len(cache) >= _PLANS_KEPT:
                cache.popitem(last=False)
            views = {"_plan": p}
            for pl in p.placements:
                shape, dtype = shapes[pl.buffer.name]
                views[pl.buffer.name] = arena.view(pl.offset, shape, dtype)
            # cached once whole: cached first, an exception (Ctrl-C) part way left a half-made
            # entry that passed the check above, and every later forward of this shape failed
            cache[key] = views
        # (the arena itself only in the caller's copy: in the cache it would keep itself alive)
        return {**views, "_arena": arena}

    def _job(self, layer: int, d: int, mem: dict, xin, xw, yout, lens, T: int, N: int, ghn,
             autocast: str | None = None) -> abi.Call:  # fmt: skip
        """The inference job of op (layer, d) with its arguments by name (abi.JOBS), keeping
        each step's gates in xw (activated; the RNN's pre-activations) and GRU's R_n h + bR_n
        in ghn for backward; under
        autocast the bf16 job on the rounded weights."""
        spec = self.spec
        aux = mem["aux"] if spec.proj_size else np.zeros((N, 0), self.dtype)
        w = self._forward_weights(autocast)
        named = recurrence_arguments(
            spec, w.layers[layer][d], d, self._constants, self._sync, h_a=mem["h.a"],
            h_b=mem["h.b"], gates=mem["gates"], aux=aux, c=mem["c"], lengths=lens, keep=True,
            ghn=ghn, bf16_act=w.precision == "bf16-act", **({"q": mem["q"]} if "q" in mem else {}),
        )  # fmt: skip
        return abi.Call(abi.job_for(spec.cell, w.precision), ("parts",), x=xin, C=xin.shape[1],
                        xw=xw, xw_bf_T=0, T=T, y=yout, y_bf_T=0, **named)  # fmt: skip

    def _parts(self, N: int) -> int:
        w = self.weights
        threads = config.threads_for(self.threads)
        return threads if N * w.Gp * w.Kp >= PARALLEL_MIN_MACS else 1

    def _forward_segment(self, mem, xt, ytop, hs, cs, lens, s0, s1, N, masks, off,
                         autocast) -> None:  # fmt: skip
        """Every layer over steps s0..s1 (in ``autocast`` mode) from the states in hs/cs,
        which are left holding the states after s1. The layer buffers' rows for the segment
        start at ``off`` (s0*N when they hold every step, 0 when they hold one segment) after
        their leading block of N rows (forward stacks: the block holds the state the layer's
        rows start from, so its h_prev is a view, see _buffers); the top layer writes
        ``ytop``."""
        spec = self.spec
        L, D, K = spec.num_layers, spec.num_directions, spec.output_size
        T = s1 - s0
        TN = T * N
        pre = _front_rows(spec, N)
        seg_lens = np.clip(lens - s0, 0, T).astype(np.int64)
        parts = self._parts(N)
        for layer in range(L):
            if layer == 0:
                xin = xt[s0 * N : s1 * N]
            elif masks is not None:
                xin = mem[f"xd.{layer - 1}"][off : off + TN]
            else:
                xin = mem[f"y.{layer - 1}"][pre + off : pre + off + TN]
            if layer == L - 1:
                yout = ytop
            else:
                ybuf = mem[f"y.{layer}"]
                yout = ybuf[pre + off : pre + off + TN]
                if pre and off == 0:  # (further on, the block holds the step before: the same)
                    ybuf[:N] = hs[layer]
            for d in range(D):
                k = layer * D + d
                ha = mem["h.a"]
                ha[:] = 0
                ha[:, :K] = hs[k]
                if spec.cell == "lstm":
                    c = mem["c"]
                    c[:] = 0
                    c[:, : spec.hidden_size] = cs[k]
                xw = mem[f"xw.{k}"][off : off + TN]
                ghn = mem[f"ghn.{k}"][off : off + TN] if spec.cell == "gru" else None
                call = self._job(layer, d, mem, xin, xw, yout, seg_lens, T, N, ghn, autocast)
                self._sync[:] = 0
                runner.run(call.job, call.bind(parts=parts), parts)
                hs[k] = (mem["h.b"] if T % 2 else ha)[:, :K]
                if spec.cell == "lstm":
                    cs[k] = mem["c"][:, : spec.hidden_size]
            if masks is not None and layer < L - 1:
                _masked(yout, masks[layer], s0 * N, s1 * N, mem[f"xd.{layer}"][off : off + TN])

    # ------------------------------------------------------------------ backward
    # (dx is None only with input_grad=False)
    # fmt: off
    @overload
    def backward(self, tape: Tape, dy: _Array | None = None, dh_n: _Array | None = None,
                 dc_n: _Array | None = None, input_grad: Literal[True] = True,
                 ) -> tuple[_Array, _Array, _CellState]: ...
    @overload
    def backward(self, tape: Tape, dy: _Array | None = None, dh_n: _Array | None = None,
                 dc_n: _Array | None = None, input_grad: bool = True,
                 ) -> tuple[_Array | None, _Array, _CellState]: ...
    # fmt: on
    @_one_at_a_time
    def backward(self, tape: Tape, dy: _Array | None = None, dh_n: _Array | None = None,
                 dc_n: _Array | None = None, input_grad: bool = True,
                 ) -> tuple[_Array | None, _Array, _CellState]:  # fmt: skip
        """Gradients of a loss through the tape's forward, given the loss's gradients ``dy``
        (like tape.y, or None = 0), ``dh_n`` and ``dc_n`` (like h_n/c_n, or None = 0).
        Accumulates the weight gradients into ``grad`` and returns ``(dx, dh0, dc0)`` (dc0 None
        for GRU/RNN). ``input_grad=False``: dx is not computed (None; saves a GEMM, as torch
        does for an input that does not require grad). A tape takes one backward."""
        input_grad = _bool("Trainer.backward", "input_grad", input_grad)  # "no" was true
        op = "Trainer.backward"
        if not isinstance(tape, Tape) or tape._trainer is not self:
            raise TapeError(f"[{op}] tape is not a Tape of this trainer")
        if tape._saved.get("released"):
            raise TapeError(f"[{op}] this tape was released (Trainer.release); run forward again")
        if tape.used:
            raise TapeError(f"[{op}] backward already ran on this tape; run forward again")
        if tape._version != self._version or self._weights_changed():
            raise TapeError(f"[{op}] the weights changed since this tape's forward (an optimizer "
                            "step?); run forward again")  # fmt: skip
        sv = tape._saved
        mem = sv["mem"]
        if mem["_arena"] is self._arena and sv["serial"] != self._serial:
            raise TapeError(f"[{op}] a newer forward reused this tape's memory; pass "
                            "own_memory=True to forward to keep several tapes alive")  # fmt: skip
        spec, dt = self.spec, self.dtype
        L, D, K, H, C = (spec.num_layers, spec.num_directions, spec.output_size,
                         spec.hidden_size, spec.input_size)  # fmt: skip
        T, N = sv["T"], sv["N"]
        LD = L * D
        yshape = (N, T, D * K) if spec.batch_first else (T, N, D * K)
        if dy is None:
            dyt = np.zeros((T * N, D * K), dt)
        else:
            dy = _check.array(op, "dy", dy, dt, yshape, ("N", "T", "D*K") if spec.batch_first
                              else ("T", "N", "D*K"))  # fmt: skip
            if spec.batch_first or not (dy.flags.c_contiguous and dy.flags.aligned):
                dyt = np.empty((T * N, D * K), dt)
                dyt[:] = (
                    dy.transpose(1, 0, 2).reshape(T * N, D * K)
                    if spec.batch_first
                    else dy.reshape(T * N, D * K)
                )
            else:
                dyt = dy.reshape(T * N, D * K)  # read only
        dh = np.zeros((LD, N, K), dt)
        dc = np.zeros((LD, N, H), dt)
        if dh_n is not None:
            dh[:] = _check.array(op, "dh_n", dh_n, dt, (LD, N, K), ("L*D", "N", "K"))
        if dc_n is not None:
            if spec.cell != "lstm":
                raise ShapeError(
                    f"[{op}] dc_n was given but a {spec.cell.upper()} has no cell state"
                )
            dc[:] = _check.array(op, "dc_n", dc_n, dt, (LD, N, H), ("L*D", "N", "H"))
        tape.used = True
        for p in self._params:  # gradients written: the next step takes them (zero_grad)
            p._stale = False
        # every row is written (direction 0 of layer 0); until then dx's rows may hold the
        # boundary states (_boundaries)
        dx = sv["dx"] if input_grad else None
        with blas_alone():
            self._backward_segments(sv, mem, dyt, dx, dh, dc)
        if not sv["own"]:
            # used, the tape takes no second backward: it lets go of the trainer's arena (this
            # one or an earlier shape's), which it kept alive beside the next shape's (the
            # next forward drops self._arena): twice the memory in a loop that keeps `tape`
            tape._saved = {"serial": tape._serial}
        if dx is None:
            return None, dh, (dc if spec.cell == "lstm" else None)
        dx = dx.reshape(T, N, C)
        if spec.batch_first:
            dx = np.ascontiguousarray(dx.transpose(1, 0, 2))
        return dx, dh, (dc if spec.cell == "lstm" else None)

    def _backward_segments(self, sv, mem, dyt, dx, dh, dc) -> None:
        spec, dt = self.spec, self.dtype
        L, D, K, H = spec.num_layers, spec.num_directions, spec.output_size, spec.hidden_size
        T, N, S = sv["T"], sv["N"], sv["S"]
        LD = L * D
        lstm = spec.cell == "lstm"
        # the segment's starting states, copied out before its dx rows are written
        h0s = np.empty((LD, N, K), dt)
        c0s = np.empty((LD, N, H), dt) if lstm else None
        hs, cs = np.empty_like(h0s), (np.empty_like(c0s) if lstm else None)
        nseg = len(sv["ckh"])
        for j in reversed(range(nseg)):
            s0 = j * S
            s1 = min(T, s0 + S)
            h0s[:] = sv["ckh"][j]
            if lstm:
                c0s[:] = sv["ckc"][j]
            # recomputing, the forward left the last segment's reserve in the segment buffers:
            # only the earlier segments are replayed
            replay = sv["recompute"] and j != nseg - 1
            if replay:
                hs[:] = h0s
                if lstm:
                    cs[:] = c0s
                ytop = mem["ytop"]
                ytop[:N] = h0s[L - 1]  # the top layer's h_prev is ytop, one block up
                self._forward_segment(mem, sv["x"], ytop[N : N + (s1 - s0) * N], hs, cs,
                                      sv["lens"], s0, s1, N, sv["masks"], 0,
                                      sv["autocast"])  # fmt: skip
            self._backward_segment(sv, mem, dyt, dx, dh, dc, h0s, c0s, s0, s1, replay)

    def _backward_segment(self, sv, mem, dyt, dx, dh, dc, h0s, c0s, s0, s1, replayed) -> None:
        spec = self.spec
        L, D = spec.num_layers, spec.num_directions
        N, recompute = sv["N"], sv["recompute"]
        T = s1 - s0
        TN = T * N
        lens = np.clip(sv["lens"] - s0, 0, T).astype(np.int64)
        # rows of this segment in buffers that hold every step (not recomputing) or only it
        off = 0 if recompute else s0 * N
        pre = _front_rows(spec, N)
        masks = sv["masks"]
        for layer in reversed(range(L)):
            top = layer == L - 1
            dylay = dyt[s0 * N : s1 * N] if top else mem[f"dy.{layer}"][:TN]
            # h_prev of every row: the layer's own output one step earlier, or the segment's h0
            ylay = hprev = None
            if not pre:
                ylay = sv["y"][s0 * N : s1 * N] if top else mem[f"y.{layer}"][off : off + TN]
            elif not top:
                hprev = mem[f"y.{layer}"][off : off + TN]  # one block up: see _buffers
            elif replayed:
                hprev = mem["ytop"][:TN]  # the replay's output, one block up
            else:
                # the forward's y, one block up: the row block in front of a segment is the
                # state it started from (the step before it; y's block in front of step 0,
                # written here). A sample past its length there has y's zeros where its
                # state stayed: its rows of G are zero.
                yfull = sv["yfull"]
                if s0 == 0:
                    yfull[:N] = h0s[layer]
                hprev = yfull[s0 * N : s1 * N]
            if layer == 0:
                xin = sv["x"][s0 * N : s1 * N]
                dxin = dx[s0 * N : s1 * N] if dx is not None else None
            else:
                xin = (mem[f"xd.{layer - 1}"][off : off + TN] if masks is not None
                       else mem[f"y.{layer - 1}"][pre + off : pre + off + TN])  # fmt: skip
                dxin = mem[f"dy.{layer - 1}"][:TN]
            for d in range(D):
                k = layer * D + d
                self._backward_op(sv, mem, layer, d, k, xin, dxin, ylay, hprev, dylay, dh, dc,
                                  h0s, c0s, lens, T, N, off)  # fmt: skip
            if layer > 0 and masks is not None:
                _masked(dxin, masks[layer - 1], s0 * N, s1 * N, dxin)

    def _backward_op(self, sv, mem, layer, d, k, xin, dxin, ylay, hprev, dylay, dh, dc, h0s,
                     c0s, lens, T, N, off) -> None:  # fmt: skip
        spec = self.spec
        K, H = spec.output_size, spec.hidden_size
        TN = T * N
        Wd, _, proj, RT, projd, Wp = self._dense_for(sv["autocast"])[layer][d]
        gl = self.grad.layers[layer][d]
        reverse = spec.reversed_direction(d)
        G = mem[f"xw.{k}"][off : off + TN]
        if hprev is None:  # h_prev of every row, copied: the output one step before
            yk = ylay[:, d * K : (d + 1) * K]
            h_start = h0s[k]
            hprev = mem[f"hprev.{layer}"][:TN]
            if not reverse:
                hprev[N:] = yk[: TN - N]
                hprev[:N] = h_start
            else:
                # a reverse sample starts at its last valid step t = L-1 (rows past it: zero)
                hprev[: TN - N] = yk[N:]
                hprev[TN - N :] = 0
                ok = lens > 0
                hprev[(lens[ok] - 1) * N + np.nonzero(ok)[0]] = h_start[ok]
        # G: the forward kernels left each step's activated gates in xw (keep; the RNN's
        # pre-activations); GRU's R_n h + bR_n is in ghn.
        gru = spec.cell == "gru"
        ghn = mem[f"ghn.{k}"][off : off + TN] if gru else None
        pad = self._pad_columns()
        if pad.size:
            # The padding units' gates: an infinite input made them NaN (inf times the zero
            # weights padding holds), harmless forward (no output reads them), but backward's
            # dh_prev GEMM sums over every gate column, zero weights included: NaN reached every
            # earlier step's gradients, where torch's stay finite. Zero gates give zero
            # gradients through every cell (and zero c, h: the forward's padding values).
            G[:, pad] = 0
        dhk = mem["dh"]
        dhk[:, K:] = 0
        dhk[:, :K] = dh[k]
        parts = self._parts(N)
        named = dict(G=G, dy=dylay, y_off=d * K, dh=dhk, RT=RT, K=K, dgs=mem["dgs"],
                     dhn=mem["dhn"], lengths=lens, T=T, reverse=reverse, consts=self._consts,
                     sync=self._sync, parts=parts)  # fmt: skip
        P = spec.proj_size
        if spec.cell == "lstm":
            c_start = mem["cb"]
            c_start[:, H:] = 0
            c_start[:, :H] = c0s[k]
            dck = mem["dc"]
            dck[:, H:] = 0
            dck[:, :H] = dc[k]
            empty = mem["dgs"][:0]
            job = "lstm_back"
            named.update(c0=c_start, cs=mem[f"cs.{layer}"][:TN], dc=dck, projd=projd, P=P,
                         hf=mem[f"hf.{layer}"][:TN] if P else empty,
                         dhs=mem[f"dhs.{layer}"][:TN] if P else empty[:, :0])  # fmt: skip
        elif gru:
            job = "gru_back"
            named.update(ghn=ghn, hprev=hprev)
        else:
            job = "rnn_back"
            named.update(relu=spec.activations[d][0].name == "relu")
        self._sync[:] = 0
        runner.run(job, tuple(abi.Call(job, (), **named).args), parts)
        if spec.cell == "lstm":
            dc[k] = dck[:, :H]
            if P:
                dproj = mem[f"dhs.{layer}"][:TN].T @ mem[f"hf.{layer}"][:TN, :H]  # [P, H]
                _add_proj(gl.proj, dproj)
        dh[k] = dhk[:, :K]
        native = self._native_gemm()
        in_place = native and self._in_place_gradients()
        if spec.bias and not in_place:  # (in place: the weight_gradient job sums them)
            B = self.weights.B
            gsum = G.sum(axis=0)
            gl.bW += gsum
            if gru:
                gsum.reshape(-1, 3, B)[:, 2] = ghn.sum(axis=0).reshape(-1, B)
            gl.bR += gsum
        # the weight gradients and dx: one team of threads for both (each wake-up of a thread
        # costs a scheduler slice on a loaded machine, and this runs once per segment);
        # direction 0 writes dx, direction 1 adds its part through a planned scratch
        part = mem[f"dxd.{layer}"][:TN] if dxin is not None and d == 1 else None
        if native:
            self._native_products(gl, xin, hprev, G, ghn, mem, Wp or PackedMatmul.of(Wd), dxin,
                                  part, in_place)  # fmt: skip
            return
        gw = mem["gw"]
        matmul = self.matmul or np.matmul
        wgrad = self._weight_gradients(gl, xin, hprev, G, ghn, matmul)

        def job(i: int, threads: int) -> None:
            wgrad(gw[i], i, threads)
            if dxin is None:
                return  # input_grad=False: the layer below is the caller's input
            lo, hi = TN * i // threads, TN * (i + 1) // threads
            if part is None:
                matmul(G[lo:hi], Wd, out=dxin[lo:hi])
            else:
                matmul(G[lo:hi], Wd, out=part[lo:hi])
                dxin[lo:hi] += part[lo:hi]

        # at most the threads planned: a later set_num_threads may ask for more than this
        # step's plan has rows of gw for; and one thread for GEMMs too small to split (the
        # forecast example's GRU(64), 24 steps x 32: ~10 M multiply-adds, a third of a ms,
        # where handing work to a pool thread and waiting for it cost more than it saved)
        macs = (
            TN * G.shape[1] * (xin.shape[1] + hprev.shape[1] + (0 if dxin is None else Wd.shape[1]))
        )
        # (a caller's matmul is threaded itself: one call at a time)
        one_call = self.matmul is not None or macs < PARALLEL_MATMUL_MACS
        threads = 1 if one_call else min(self._threads(), gw.shape[0], TN)
        self._team(job, threads)

    def _native_products(self, gl, xin, hprev, G, ghn, mem, Wp, dxin, part, in_place) -> None:
        """The weight gradients and dx of ``_backward_op`` on the engine's GEMM tile, on the
        kernel team: dW += x^T G and dR += h_prev^T G (GRU: R_n's columns from ghn), on small
        layers (``in_place``: _in_place_gradients) by the weight_gradient job, which reads
        x, h_prev and G where they lie and adds into the gradient panels (and G's column sums
        into the bias gradients: one serial numpy pass less), else by _packed_gradients; then
        dx = G Wd on Wd's packed columns (engine.products)."""
        threads, sync = self._threads(), self._sync
        TN = G.shape[0]
        if in_place:
            X, K = xin.shape[1], hprev.shape[1]
            macs = TN * G.shape[1] * (X + K)
            parts = threads if macs >= PACKED_MATMUL_PARALLEL_MACS else 1
            sync[:] = 0
            nob = G[:1, :0]
            bW, bR = (gl.bW[None], gl.bR[None]) if self.spec.bias else (nob, nob)
            call = abi.Call("weight_gradient", ("parts",), x=xin, X=X, h=hprev, Kh=K, G=G,
                            ghn=G[:0] if ghn is None else ghn, dW=gl.Wt, dR=gl.Rt, bW=bW,
                            bR=bR, sync=sync)  # fmt: skip
            runner.run("weight_gradient", call.bind(parts=parts), parts)
            pad = self._pad_columns()
            if pad.size:  # an inf in x or h_prev made the padding units' columns NaN: keep 0
                Wd = gl.Wt.shape[2]
                for panels in (gl.Wt, gl.Rt):
                    panels[-1][:, pad - (panels.shape[0] - 1) * Wd] = 0
        else:
            self._packed_gradients(gl, xin, hprev, G, ghn, mem)
        if dxin is None:
            return  # input_grad=False: the layer below is the caller's input
        tail = mem["dxt"][:TN] if "dxt" in mem else None  # (dx's rows: whole rows of its plan)
        packed_product(Wp, G, dxin if part is None else part, tail, threads, sync)
        if part is not None:
            dxin += part

    def _in_place_gradients(self) -> bool:
        """Whether the weight gradients read G in place (kernels.gemm.weight_gradient): while
        a row of G is at most one way of L1 (64 sets of 64 bytes on every x86 core), so that
        the rows of a panel slice fall in different sets. Wider (LSTM H=512, 8 KiB rows) every
        row of the slice took the same 4 sets and the products ran 25% slower than packing
        them (Zen 5); narrower (H=128) the in-place products cut the backward by 10-25%, the
        transposes, packing and adds in numpy being serial."""
        return self.weights.Gp * self.dtype.itemsize <= _L1_WAY

    def _packed_gradients(self, gl, xin, hprev, G, ghn, mem) -> None:
        """dW += x^T G and dR += h_prev^T G (GRU: R_n's columns from ghn) on wide layers
        (_in_place_gradients), the kernel team splitting each product
        (engine.products.packed_product) over chunks of the steps' rows: x^T and h_prev^T of
        a chunk transposed into "gat", G's columns a few panels at a time packed into "gpk"
        once for both products; or, where "gat" has room for one (a recomputing step's plan:
        both took its scratch from 1 to 3 MB at H=512), one transpose at a time, G packed for
        each."""
        U, _, Wd = gl.Wt.shape
        B = self.weights.B
        TN = G.shape[0]
        threads, sync = self._threads(), self._sync
        per = max(1, self._gemm_cols() // Wd)  # weight panels per product
        pad = self._pad_columns()  # all in the last panel
        gat, gpk, gw = mem["gat"], mem["gpk"], mem["gw"][0]
        # chunks of the same rows in every plan: a recomputing step's products are then those
        # of a storing one with the same segments, bit for bit (which passes run is no matter)
        kc = self._gemm_chunk(TN)
        zeros = np.zeros(-(-per * Wd // PANEL) * PANEL, G.dtype)
        X, K = xin.shape[1], hprev.shape[1]
        if gat.size >= (X + K) * kc:  # both transposes at once: G packed once for dW and dR
            passes = [((gl.Wt, xin), (gl.Rt, hprev))]
        else:  # one at a time (a recomputing step's small plan), G packed for each
            passes = [((gl.Wt, xin),), ((gl.Rt, hprev),)]
        for k0 in range(0, TN, kc):
            k1 = min(TN, k0 + kc)
            for products in passes:
                ats, r0 = [], 0
                for _, src in products:
                    at = gat[r0 : r0 + src.shape[1] * (k1 - k0)].reshape(-1, k1 - k0)
                    transpose_into(src[k0:k1], at)
                    ats.append(at)
                    r0 += at.size
                for u0 in range(0, U, per):
                    u1 = min(U, u0 + per)
                    ncols = (u1 - u0) * Wd
                    npan = -(-ncols // PANEL)
                    bp = gpk[: npan * (k1 - k0) * PANEL].reshape(npan, k1 - k0, PANEL)
                    pack_columns(G[k0:k1, u0 * Wd : u1 * Wd], bp)
                    pm = PackedMatmul(bp, zeros[: npan * PANEL], npan * PANEL)
                    for (panels, _), at in zip(products, ats, strict=True):
                        if ghn is not None and panels is gl.Rt:
                            # d(R_n h)'s columns from ghn: B-wide runs, each inside one panel
                            for u in range(u0, u1):
                                c = (u - u0) * Wd + 2 * B
                                bp[c // PANEL, :, c % PANEL : c % PANEL + B] = (
                                    ghn[k0:k1, u * B : (u + 1) * B])  # fmt: skip
                        rows = at.shape[0]
                        out = gw[: rows * npan * PANEL].reshape(rows, npan * PANEL)
                        packed_product(pm, at, out, None, threads, sync)
                        _add_to_panels(panels, u0, u1, out[:, :ncols], pad)

    def _threads(self) -> int:
        return config.threads_for(self.threads)

    def _pad_columns(self) -> np.ndarray:
        """Indices of G's columns that belong to padding units (unit u*B + j >= H of gate g
        is column u*Wd + g*B + j, formats.packing), all in the last panel; empty when B
        divides H."""
        pad = getattr(self, "_pad", None)
        if pad is None:
            H, Hp, B = self.spec.hidden_size, self.weights.Hp, self.weights.B
            ng = self.spec.gate_width // H
            unit = np.arange(Hp).reshape(Hp // B, 1, B).repeat(ng, axis=1).reshape(-1)
            pad = self._pad = np.flatnonzero(unit >= H)
        return pad

    @staticmethod
    def _team(job, threads: int) -> None:
        """job(i, threads) for i < threads: 0 on this thread, the others on threads.matmul_pool
        (its idle workers sleep, BLAS's spin: module doc)."""
        if threads < 2:
            job(0, 1)
            return
        pool = matmul_pool(threads - 1)
        futures = [pool.submit(job, i, threads) for i in range(1, threads)]
        try:
            job(0, threads)
        finally:
            for f in futures:
                f.result()

    def _weight_gradients(self, gl, xin, hprev, G, ghn, matmul):
        """dW += X^T dG and dR += H_prev^T dG (GRU: R_n's columns from ghn, which holds
        d(R_n h + bR_n)), a few panels' columns per GEMM (_GEMM_COLS), each into a planned
        scratch and added from there into the panels. Returns f(out, i, threads): thread i's
        share of the panels, through its own scratch ``out``."""
        U, _, Wd = gl.Wt.shape
        B = self.weights.B
        most = max(1, self._gemm_cols() // Wd)  # panels per GEMM, at most
        pad = self._pad_columns()  # all in the last panel

        def share(gw, i: int, threads: int) -> None:
            # at least one GEMM per thread (each thread has its own rows of gw)
            per = min(most, -(-U // threads))
            chunks = [(u0, min(U, u0 + per)) for u0 in range(0, U, per)]
            n = len(chunks)
            for u0, u1 in chunks[n * i // threads : n * (i + 1) // threads]:
                cols = slice(u0 * Wd, u1 * Wd)
                for panels, rows in ((gl.Wt, xin), (gl.Rt, hprev)):
                    X = rows.shape[1]
                    out = gw[: X * (u1 - u0) * Wd].reshape(X, (u1 - u0) * Wd)
                    matmul(rows.T, G[:, cols], out=out)
                    if ghn is not None and panels is gl.Rt:
                        out.reshape(X, u1 - u0, 3, B)[:, :, 2] = (
                            rows.T @ ghn[:, u0 * B : u1 * B]).reshape(X, u1 - u0, B)  # fmt: skip
                    _add_to_panels(panels, u0, u1, out, pad)

        return share

    # ------------------------------------------------------------------ views
    def gradients(self) -> list[list[LayerWeights]]:
        """The accumulated gradients as canonical weights (LayerWeights, internal gate order),
        the layout ``pack`` takes; ``torch_format.to_state_dict`` names them like PyTorch."""
        return self.grad.unpack()


def _logical_shape(spec, layer: int, name: str) -> tuple[int, ...]:
    """The shape of torch's tensor that packed parameter ``name`` of ``layer`` holds."""
    G, K = spec.gate_width, spec.output_size
    return {"Wt": (G, spec.layer_input_size(layer)), "Rt": (G, K), "bW": (G,), "bR": (G,),
            "proj": (spec.proj_size, spec.hidden_size)}[name]  # fmt: skip


def _masked(a: np.ndarray, mask: tuple, r0: int, r1: int, out: np.ndarray) -> None:
    """out = a * the dropout mask's rows r0..r1: ``mask`` is (rows, scale), a caller's float
    mask with scale None, or a drawn one of kept bytes with its 1/(1-p) (Trainer._draw_masks:
    a * kept * scale is a * (kept / (1-p)) to the bit)."""
    rows, scale = mask
    np.multiply(a, rows[r0:r1], out=out)
    if scale is not None:
        out *= scale


def _padding(lens: np.ndarray, T: int, batch_first: bool) -> np.ndarray | None:
    """The steps past each sample's length, as a boolean mask over x's [T, N] ([N, T] batch
    first) axes; None when every sample runs all T."""
    if (lens >= T).all():
        return None
    past = np.arange(T)[:, None] >= lens[None, :]
    return past.T if batch_first else past


def _front_rows(spec, N: int) -> int:
    """Rows in front of a layer's outputs in a forward stack (the row block of the state it
    started from, so that h_prev of every row is a view one block up); 0 with a reverse
    direction. Forward, the plan and backward lay their buffers out by it."""
    return N if spec.direction == "forward" else 0


def _add_to_panels(panels: np.ndarray, u0: int, u1: int, out: np.ndarray, pad) -> None:
    """panels[u0:u1] ([U, X', Wd]) += a weight-gradient product ``out`` [X, (u1-u0)*Wd] of
    their columns. The padding units' columns (``pad``, all in the last panel) stay 0: an inf
    in the rows makes them NaN (inf times the padding's zero gates)."""
    U, _, Wd = panels.shape
    X = out.shape[0]
    if u1 == U and pad.size:
        out[:, pad - u0 * Wd] = 0
    panels[u0:u1, :X, :] += out.reshape(X, u1 - u0, Wd).transpose(1, 0, 2)


def _column_panels(Rd: np.ndarray, groups: int) -> np.ndarray:
    """R's columns in panels for the backward step's dh_prev = dG_t R (kernels.backward
    ._dh_gemm): RT[v, g, j] = Rd[g, v*W + j], W = groups*B columns per panel, zero past R's
    columns (the last panel's padding: its products land in dhn's spare columns)."""
    Gp, Kp = Rd.shape
    W = groups * abi.B
    V = -(-Kp // W)
    padded = np.zeros((Gp, V * W), Rd.dtype)
    padded[:, :Kp] = Rd
    return np.ascontiguousarray(padded.reshape(Gp, V, W).transpose(1, 0, 2))


def _doubling(n: int):
    """1, 2, 4, ... below n, then n (n >= 1)."""
    v = 1
    while v < n:
        yield v
        v *= 2
    yield max(n, 1)


def _add_proj(panels: np.ndarray, dproj: np.ndarray) -> None:
    """proj panels [Pp/B, Hp, B] += dproj [P, H] (panel u column j is row u*B + j)."""
    NP, _, B = panels.shape
    P, H = dproj.shape
    full = np.zeros((NP * B, H), dproj.dtype)
    full[:P] = dproj
    panels[:, :H, :] += full.reshape(NP, B, H).transpose(0, 2, 1)

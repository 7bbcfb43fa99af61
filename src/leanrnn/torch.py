"""``leanrnn.torch``: torch.nn.LSTM / GRU / RNN drop-ins whose forward and backward run on
leanrnn's kernels (train.Trainer). Importing this module imports torch; ``import leanrnn``
does not.

>>> import torch, leanrnn.torch as lt
>>> lstm = lt.LSTM(8, 16, num_layers=2)          # torch.nn.LSTM's constructor, names, init
>>> y, (h, c) = lstm(torch.randn(5, 3, 8))        # torch's outputs, PackedSequence too
>>> y.sum().backward()                            # gradients through leanrnn's BPTT

Design.

- **Parameters** are ordinary torch Parameters with torch's names, shapes, gate order and
  initialisation (``weight_ih_l0``, ``bias_hh_l1_reverse``, ``weight_hr_l0``), so
  ``state_dict``, optimizers, DDP and ``clip_grad_norm_`` see exactly what torch's module has.
  leanrnn's kernels read a packed copy (formats.packing), kept by one Trainer per module and
  dtype. Before each forward the op compares every parameter with the copy it was packed from:
  a changed ``param._version`` or storage (any torch.optim step, ``.to()``, ``load_state_dict``)
  repacks that tensor at once; otherwise its values are compared with that copy (one read of
  the weights per forward: 1.7 ms of CPU for a 2-layer H=512 LSTM on a 2-core Zen 3, against
  hundreds of ms for its training step at T=100, N=32), because writes through ``param.data``
  -- the PyTorch word-language-model's SGD, gradcheck's perturbations -- bump no version
  counter. Only the tensors that changed are repacked.
- **Operators.** ``torch.ops.leanrnn.rnn_forward`` and ``torch.ops.leanrnn.rnn_backward`` are
  ``torch.library.custom_op``s with fake (meta) implementations, and the forward's autograd
  formula calls the backward op (``register_autograd``), so torch.compile traces a model
  containing these modules into one graph (PackedSequence input graph-breaks on its
  data-dependent indexing) and torch.export keeps the op in the exported program. The ops take
  time-major input; batch_first, unbatched input and PackedSequence are torch ops around them.
  An eager call (nothing tracing, no dispatch or function mode, no functorch transform, plain
  tensors: ``_eager``) skips the dispatcher: an autograd.Function (``_EagerRNN``) runs the ops'
  bodies with the same saved tensors and checks, so both ways give the same bits; the custom
  op's wrapper cost ~1.3 ms of Python per forward and backward. Backward computes dx only
  when the input needs it, as torch's modules do.
- **Tapes.** A tape (what backward needs) is numpy memory, not a tensor, so the forward op
  returns an int64 *handle* tensor into a registry of live tapes, and autograd saves the
  handle. The handle's storage is a numpy array with a finalizer: when the last tensor sharing
  it dies -- the graph ran backward without retain_graph, or was dropped without one -- the
  tape is freed. Each forward has its own tape (``own_memory=True``), so several graphs may be
  alive at once (gradient accumulation, truncated BPTT). A second backward through a retained
  graph (``retain_graph=True``, gradcheck) replays the forward from the tape's saved inputs.
  A tape refuses backward once the weights changed after its forward (like torch's "modified
  by an inplace operation"). The handle's key is only meaningful in the process that made it.
- **Modes.** When no gradient is needed (``torch.no_grad``, ``inference_mode``, or nothing
  requires grad) the op runs the inference engine (engine.Session on the same packed weights;
  under autocast on the trainer's bf16 rounding of them, read in the module's autocast_mode),
  keeping no tape. ``.eval()`` only turns dropout off, as in torch: with gradients enabled a
  module in eval mode still backpropagates. Inter-layer dropout in training mode draws its
  masks with torch's generator in the order and shapes torch.nn.LSTM draws them (bernoulli over
  each non-last layer's output; over the packed rows for PackedSequence input), so a module
  seeded like torch's drops the same units, and passes them to Trainer.forward(masks=).
- **Autocast** (``torch.autocast("cpu", torch.bfloat16)``): mixed precision as
  Trainer.autocast does it — the forward (training or not) runs leanrnn's bf16 kernels (AMX
  where the CPU has it, kernels._bf16amx) on the float32 parameters rounded to bfloat16, with
  float32 activations, states and sums; backward computes in float32 through the same rounded
  weights (a backward outside the autocast region still goes through the forward that ran),
  and the gradients reach the float32 parameters, as in torch. Outputs have the dtypes torch's
  modules return under CPU autocast (_autocast_dtypes): the autocast dtype for the RNN (torch
  builds its cell from autocast matmuls) and for an LSTM that oneDNN runs (its default on
  CPUs with bf16 support, unpacked input, no projection); elsewhere the dtype the states meet
  (a float32 state or input gives float32; y and h_n of a projection the autocast dtype).
  float64 modules and float16 autocast compute in the parameters' dtype. A module's
  ``autocast_mode`` picks the Trainer.autocast mode: "bf16" (the default, above) or
  "bf16-act", which rounds the activations the weights multiply to bfloat16 too, as torch's
  autocast does (on AMX and vdpbf16ps one bf16 product each where "bf16" takes two: the
  faster forward).
- **Threads.** Where torch runs on GNU OpenMP (its CPU wheels), the kernels run on torch's
  own team (threads.openmp_team: ``GOMP_parallel``), and backward's big GEMMs on the engine's
  GEMM where it is this machine's faster (engine.products; a kernel job, on that team too),
  else on torch's matmul (Trainer.matmul): torch's idle workers spin for milliseconds after
  each op, so a second team of leanrnn's own got no core while they did (a 2-thread LSTM step
  ran as slow as on 1 thread). On a Zen 5, where torch's matmul ran ~80 GFLOP/s a core and
  the engine's ~190, the char_lm example's leanrnn.torch run took 3.28 s instead of 3.95.
- CPU only; float32 and float64 parameters.
"""

import contextlib
import copy
import itertools
import json
import math
import numbers
import os
import secrets
import threading
import warnings
import weakref
from functools import lru_cache
from typing import Self

import numpy as np

try:
    import torch
except ImportError as e:  # a bare "No module named 'torch'" named neither leanrnn nor the extra
    raise ImportError(
        "leanrnn.torch needs torch: pip install 'leanrnn[torch]' (in a clone: pip install -e "
        "'.[torch]'; torch==2.13.0, whose CPU wheel pip takes from PyTorch's index: see README)",
        name=e.name,
    ) from e
from torch.autograd import forward_ad as _forward_ad
from torch.autograd.function import once_differentiable
from torch.nn.utils.rnn import PackedSequence

from .engine import _fork
from .engine.products import gemm_choice
from .errors import DTypeError, ShapeError, SpecError, WeightsError
from .formats import torch_format
from .formats.packing import TORCH_ORDER, PackedWeights
from .spec import Activation, RNNSpec
from .threads import openmp_team, use_openmp_of
from .train.session import AUTOCAST_MODES, TapeError, Trainer

__all__ = ["GRU", "LSTM", "RNN", "from_module"]


# ---------------------------------------------------------------------------- spec strings
# The ops' autograd formula's version, carried in every op call's spec string. torch.compile's
# caches (AOTAutograd's, inductor's) key a compiled graph on the forward graph, in which a
# custom op is its name and arguments: a changed backward formula (session 37: rnn_backward
# takes x, y and the masks) was not seen, and the stale compiled backward kept running, with
# wrong gradients, until the cache was cleared. Bump it whenever _backward's graph changes.
# (Programs exported before the version existed carry none; a compile cache an older leanrnn
# left for them is not told apart: clear it, TORCHINDUCTOR_CACHE_DIR, after upgrading.)
_OPS_VERSION = 2


def _spec_string(cell: str, C: int, H: int, L: int, bidir: bool, P: int, bias: bool,
                 nonlinearity: str) -> str:  # fmt: skip
    return json.dumps([cell, C, H, L, bidir, P, bias, nonlinearity, _OPS_VERSION])


@lru_cache(maxsize=256)
def _spec(s: str) -> RNNSpec:
    """The spec (always time-major: the ops take [T, N, C]) an op's spec string names (with
    or without the version: programs exported before it carry none)."""
    cell, C, H, L, bidir, P, bias, nonlin = json.loads(s)[:8]
    acts = None
    if cell == "rnn":
        acts = ((Activation.make(nonlin),),) * (2 if bidir else 1)
    return RNNSpec(cell, C, H, num_layers=L, direction="bidirectional" if bidir else "forward",
                   proj_size=P, bias=bias, batch_first=False,
                   activations=acts)  # type: ignore[arg-type]  # (None: the defaults)  # fmt: skip


# ---------------------------------------------------------------------------- engines
class _Engine:
    """One module's Trainer (per dtype) over packed weights, the inference Model on the same
    weights, and the numpy copies of the torch parameters they were packed from."""

    def __init__(self, spec: RNNSpec) -> None:
        self.spec = spec
        self.tr: Trainer | None = None
        self.model = None
        # inference under autocast, per Trainer.autocast mode: on the trainer's bf16 rounding
        self.bf16_models: dict = {}
        self.copies: list[np.ndarray] = []
        self.seen: list[tuple] = []
        # One forward or backward at a time per module: they share the trainer's arena, sync
        # array and gradient buffer (torch lets two Python threads run one module at once).
        # Renewed in a forked child: held by a parent's thread at the fork, it hung the
        # child's first call for ever (a DataLoader or a process pool forked mid-step).
        self.lock = threading.RLock()
        _fork.renew_lock(self, "lock", threading.RLock)

    def sync(self, weights, dropout: bool) -> Trainer:
        """The trainer, its packed weights equal to ``weights`` (torch order and names)."""
        dt = np.dtype(_numpy_dtype(weights[0].dtype))
        if self.tr is None or self.tr.dtype != dt or (dropout and not self.tr.dropout):
            from .nn import Model

            # zeroed: the padding of the panels and biases stays zero, _write never touches it
            pw = PackedWeights(self.spec, dt)
            # dropout > 0 only plans the buffers of the masked layer inputs: the masks
            # themselves come from torch (Trainer.forward(masks=)), never from the trainer
            self.tr = Trainer(pw, dropout=0.5 if dropout else 0.0)
            self.tr.training = False
            if gemm_choice(dt) == "blas":  # else the engine's GEMM, a kernel on torch's team
                self.tr.matmul = _matmul
            self.model = Model._from_packed(pw)
            self.bf16_models = {}
            self.copies = [np.empty(tuple(w.shape), dt) for w in weights]
            self.seen = [None] * len(weights)
        params = self.tr.parameters()
        for i, w in enumerate(weights):
            a = w.detach().numpy()
            sig = (w.data_ptr(), w._version)
            if sig == self.seen[i] and np.array_equal(a, self.copies[i]):
                continue
            self.copies[i][...] = a
            self._write(i, self.copies[i])
            params[i].version += 1  # the trainer refolds biases and remakes its dense copies
            self.seen[i] = sig
        # The inference path reads the folded biases too. Asked every time (a comparison of
        # versions when nothing changed): asked only after a change was seen, a Ctrl-C between
        # the two left parameters marked seen and the biases unfolded, and no later sync
        # refolded them (no_grad forwards 0.3-1.3 off until the next step)
        self.tr._check_weights()
        return self.tr

    def _slot(self, pw: PackedWeights, i: int):
        """Where torch parameter ``i`` lives in ``pw`` (the packed weights or the gradient
        buffer): (its PackedLayer, kind). Torch's order, per layer and direction: w_ih, w_hh,
        [b_ih, b_hh], [w_hr] -- the order of Trainer.parameters()."""
        spec = self.spec
        per = 2 + 2 * spec.bias + (1 if spec.proj_size else 0)
        k, j = divmod(i, per)
        layer, d = divmod(k, spec.num_directions)
        kind = (["Wt", "Rt"] + (["bW", "bR"] if spec.bias else []) + ["proj"])[j]
        return pw.layers[layer][d], kind

    def _write(self, i: int, a: np.ndarray) -> None:
        """Pack torch parameter ``i`` into the packed weights, one strided copy per gate
        (formats.packing's reorder, gather and transpose took three passes: 0.3 ms a step
        for char_lm's [512, 128] w_hh, whose values change at every optimizer step)."""
        pw = self.tr.weights
        pl, kind = self._slot(pw, i)
        order, H = TORCH_ORDER[self.spec.cell], self.spec.hidden_size
        if kind == "proj":
            _rows_to_panels(a, pl.proj, (0,), self.spec.proj_size, pw.B)
        elif kind in ("Wt", "Rt"):
            _rows_to_panels(a, getattr(pl, kind), order, H, pw.B)
        else:
            _rows_to_bias(a, getattr(pl, kind), order, H, pw.B)

    def _read(self, pw: PackedWeights, i: int, out: np.ndarray) -> None:
        """The inverse of _write, from ``pw`` (a trainer's gradient buffer): the gradient of
        torch parameter ``i`` into ``out`` (its torch shape)."""
        pl, kind = self._slot(pw, i)
        order, H = TORCH_ORDER[self.spec.cell], self.spec.hidden_size
        if kind == "proj":
            _panels_to_rows(pl.proj, (0,), self.spec.proj_size, pw.B, out)
        elif kind in ("Wt", "Rt"):
            _panels_to_rows(getattr(pl, kind), order, H, pw.B, out)
        else:
            _bias_to_rows(getattr(pl, kind), order, H, pw.B, out)


# The packed layout (formats.packing): panel u, column g*B + j holds unit u*B + j of internal
# gate g (B = PackedWeights.B); torch's rows hold gate blocks of H in its order
# (TORCH_ORDER[cell][g] = torch's block of internal gate g). Both directions copy gate by
# gate, the whole unit blocks as one strided copy and the last, partial block (H not a
# multiple of B) apart; the padding is never touched.
def _gate_parts(order: tuple[int, ...], H: int, B: int):
    """(internal gate g, torch's rows of its whole blocks, of its partial block, Uf, r)."""
    Uf, r = divmod(H, B)
    for g, src in enumerate(order):
        lo = src * H
        yield g, slice(lo, lo + Uf * B), slice(lo + Uf * B, lo + H), Uf, r


def _rows_to_panels(
    a: np.ndarray, panels: np.ndarray, order: tuple[int, ...], H: int, B: int
) -> None:
    """panels [U, Xp, ng*B] <- a [ng*H, X] (torch's rows; X <= Xp)."""
    X = a.shape[1]
    for g, full, part, Uf, r in _gate_parts(order, H, B):
        c = g * B
        if Uf:
            panels[:Uf, :X, c : c + B] = a[full].reshape(Uf, B, X).transpose(0, 2, 1)
        if r:
            panels[Uf, :X, c : c + r] = a[part].T


def _panels_to_rows(
    panels: np.ndarray, order: tuple[int, ...], H: int, B: int, out: np.ndarray
) -> None:
    """out [ng*H, X] (torch's rows) <- panels [U, Xp, ng*B]."""
    X = out.shape[1]
    for g, full, part, Uf, r in _gate_parts(order, H, B):
        c = g * B
        if Uf:
            out[full].reshape(Uf, B, X)[...] = panels[:Uf, :X, c : c + B].transpose(0, 2, 1)
        if r:
            out[part] = panels[Uf, :X, c : c + r].T


def _rows_to_bias(
    a: np.ndarray, packed: np.ndarray, order: tuple[int, ...], H: int, B: int
) -> None:
    """packed [Gp] (row (u*ng + g)*B + j) <- a [ng*H] (torch's rows)."""
    blocks = packed.reshape(-1, len(order), B)
    for g, full, part, Uf, r in _gate_parts(order, H, B):
        blocks[:Uf, g] = a[full].reshape(Uf, B)
        blocks[Uf:, g, :r] = a[part]  # (an empty slice when r == 0)


def _bias_to_rows(
    packed: np.ndarray, order: tuple[int, ...], H: int, B: int, out: np.ndarray
) -> None:
    """out [ng*H] (torch's rows) <- packed [Gp]."""
    blocks = packed.reshape(-1, len(order), B)
    for g, full, part, Uf, r in _gate_parts(order, H, B):
        out[full].reshape(Uf, B)[...] = blocks[:Uf, g]
        out[part] = blocks[Uf:, g, :r].reshape(-1)


def _frozen_as(new: torch.nn.Module, old: torch.nn.Module) -> None:
    """``new``'s weights as trainable as ``old``'s (a frozen weight was trained after a
    from_module/to_module swap). A parametrized weight of ``old`` (weight_norm) is copied as
    the weight it computes: trainable if any of its originals is."""
    from torch.nn.utils import parametrize

    for name, p in new.named_parameters(recurse=False):
        if parametrize.is_parametrized(old, name):
            originals = old.parametrizations[name].parameters()
            p.requires_grad_(any(q.requires_grad for q in originals))
        elif isinstance(getattr(old, name, None), torch.nn.Parameter):
            p.requires_grad_(getattr(old, name).requires_grad)


_ENGINES: dict[int, _Engine] = {}
# Engine keys from a random start: a program traced or exported in one process carries its
# module's key, and counted from 1 in the next process it named that process's first module
# (the two then repacked each other's weights at every step)
_KEYS = itertools.count(secrets.randbits(40) << 20)


def _engine(key: int, spec: str) -> _Engine:
    eng = _ENGINES.get(key)
    if eng is None or eng.spec != _spec(spec):
        # a program exported or compiled from a module that is gone: a fresh engine
        eng = _ENGINES[key] = _Engine(_spec(spec))
    return eng


def _numpy_dtype(dt: torch.dtype):
    if dt == torch.float32:
        return np.float32
    if dt == torch.float64:
        return np.float64
    raise DTypeError(f"[leanrnn.torch] tensors of {dt}; expected float32 or float64")


# ---------------------------------------------------------------------------- tapes
_TAPES: dict[int, list] = {}
_TAPE_IDS = itertools.count(1)


def _handle(eng: _Engine | None, tape, weights) -> torch.Tensor:
    """An int64 [1] tensor naming a live tape; the tape is freed with the handle's storage."""
    hid = next(_TAPE_IDS) if tape is not None else 0
    arr = np.array([hid], np.int64)
    if tape is not None:
        _TAPES[hid] = [eng, tape, [w._version for w in weights]]
        weakref.finalize(arr, _free, hid)
    return torch.from_numpy(arr)


def _free(hid: int) -> None:
    """The handle's storage died: drop the tape and give its arena back to its trainer (the
    next forward reuses the memory instead of faulting in fresh pages)."""
    entry = _TAPES.pop(hid, None)
    if entry is not None:
        tape = entry[1]
        tape._trainer.release(tape)


def _replay(tr: Trainer, tape):
    """A fresh tape of the same forward (the same autocast mode), for a second backward
    through a retained graph."""
    sv = tape._saved
    tr.autocast = sv["autocast"]
    T, N = sv["T"], sv["N"]
    x = sv["x"].reshape(T, N, -1)  # time-major rows, whatever the spec's layout
    if tr.spec.batch_first:
        x = np.ascontiguousarray(x.transpose(1, 0, 2))
    hx = (sv["h0"], sv["c0"]) if sv["c0"] is not None else sv["h0"]
    masks = sv["masks"]  # (mask, scale): a scale where the trainer drew it (Trainer._draw_masks)
    if masks is not None:
        masks = [m if scale is None else m * scale for m, scale in masks]
    return tr.forward(x, hx, lengths=sv["lens"], own_memory=True, masks=masks)


# ---------------------------------------------------------------------------- operators
def _np(t):
    return None if t is None else t.detach().contiguous().numpy()


def _forward_locked(eng, x, h0, c0, weights, lengths, masks, tape, autocast):
    """The body of rnn_forward, run under the engine's lock."""
    s = eng.spec
    tr = eng.sync(weights, masks is not None)
    tr.autocast = autocast or None
    xn = _np(x)
    hx = None
    if h0 is not None or c0 is not None:
        LD, N = s.num_layers * s.num_directions, xn.shape[1]
        dt = tr.dtype
        hn = _np(h0) if h0 is not None else np.zeros((LD, N, s.output_size), dt)
        if s.cell == "lstm":
            cn = _np(c0) if c0 is not None else np.zeros((LD, N, s.hidden_size), dt)
            hx = (hn, cn)
        else:
            hx = hn
    lens = None if lengths is None else _np(lengths).astype(np.int64)
    mk = None
    if masks is not None:
        T, N = xn.shape[:2]
        mk = [m.reshape(T * N, -1) for m in _np(masks)]
    if tape or mk is not None:
        # own memory for a tape that autograd keeps; the trainer's arena for a forward that
        # only needs the dropout masks (training mode without gradients)
        tp = tr.forward(xn, hx, lengths=lens, own_memory=bool(tape), masks=mk)
        # y is the tape's top-layer output, which backward reads (h_prev of dR): handed to
        # torch as it is (no copy), the op saves it for backward, so torch's version check
        # refuses a backward after an in-place change (_save), as for torch.nn.LSTM's y
        y, h_n, c_n = tp._y, tp.h_n, tp.c_n
        handle = _handle(eng, tp if tape else None, weights)
    else:
        model = eng.model
        if autocast:
            # the trainer's rounding of the current weights, refilled in place when they
            # change: one model on it per mode serves every later step (bf16-act: the same
            # panels read as bf16-act's, whose kernels round the activations too)
            pw = tr._forward_weights(autocast)
            model = eng.bf16_models.get(autocast)
            if model is None or model.session.weights.buffer is not pw.buffer:
                from .nn import Model

                model = eng.bf16_models[autocast] = Model._from_packed(pw)
        y, h_n, c_n = model.session.run(
            np.ascontiguousarray(xn), *(hx if isinstance(hx, tuple) else (hx, None)), lens
        )
        handle = _handle(None, None, weights)
    return y, h_n, c_n, handle


def _matmul(a: np.ndarray, b: np.ndarray, out: np.ndarray) -> None:
    """out = a @ b by torch (Trainer.matmul): threaded on torch's own team, as _team's kernels."""
    torch.matmul(torch.from_numpy(a), torch.from_numpy(b), out=torch.from_numpy(out))


@lru_cache(maxsize=1)
def _torch_on_openmp() -> bool:
    """Whether torch runs its intra-op work on OpenMP (its CPU wheels do); if so, the kernels
    will find torch's runtime through torch's own library: a process may map several libgomp
    copies (MNN's, scikit-learn's), and the first one in /proc/self/maps was MNN's."""
    if "parallel backend: OpenMP" not in torch.__config__.parallel_info():
        return False
    lib = os.path.join(os.path.dirname(torch.__file__), "lib", "libtorch_cpu.so")
    use_openmp_of(lib if os.path.exists(lib) else None)
    return True


def _team():
    """Where the kernels run: on torch's own OpenMP team where torch has one (threads.
    openmp_team: its workers, spinning after each torch op, starved leanrnn's threads of the
    cores), else on leanrnn's threads."""
    return openmp_team() if _torch_on_openmp() else contextlib.nullcontext()


def _forward(x, h0, c0, weights, lengths, masks, key, spec, tape, bf16=False, mode="bf16"):
    """rnn_forward's body, for the op and for the eager path (_EagerRNN). ``bf16``: under
    torch.autocast(bfloat16), on the weights rounded to bf16 in Trainer.autocast's ``mode``
    (the module's autocast_mode)."""
    autocast = mode if bf16 else ""
    eng = _engine(key, spec)
    with eng.lock, _team():
        y, h_n, c_n, handle = _forward_locked(eng, x, h0, c0, weights, lengths, masks, tape,
                                              autocast)  # fmt: skip
    c_out = torch.from_numpy(c_n) if c_n is not None else x.new_empty(0)
    return torch.from_numpy(y), torch.from_numpy(h_n), c_out, handle


def _backward_grads(handle, dy, dh_n, dc_n, weights, input_grad):
    """rnn_backward's body: [dx (an empty tensor unless ``input_grad``), dh0, dc0 (LSTM; else
    empty), *weight gradients in torch's names, shapes and order]. dy, dh_n, dc_n may be None
    (zero, as Trainer.backward takes them)."""
    op = "leanrnn.torch backward"
    entry = _TAPES.get(int(handle[0]))
    if entry is None:
        raise TapeError(
            f"[{op}] the tape of this forward is gone (its graph was freed, it was made in "
            "another process, or none was kept: a forward traced by torch.jit.trace under "
            "torch.no_grad keeps none); run the forward again (trace with gradients on)"
        )
    eng, tape, versions = entry
    with eng.lock, _team():
        if [w._version for w in weights] != versions:
            raise TapeError(
                f"[{op}] a parameter was modified in place after this forward (an optimizer step "
                "between forward and backward?); as torch would, refuse: run the forward again"
            )
        tr = tape._trainer  # the engine may have made another since (dtype, dropout buffers)
        if tape._version != tr._version:
            # the packed weights were repacked since (another forward saw other values, e.g.
            # gradcheck's perturbations through .data): pack the current values, replay
            if eng.tr is not tr or eng.sync(weights, bool(tr.dropout)) is not tr:
                raise TapeError(
                    f"[{op}] the module's weights changed and its engine was rebuilt (dtype or "
                    "dropout changed) since this forward; run the forward again"
                )
            tape = entry[1] = _replay(tr, tape)
        elif tape.used:
            tape = entry[1] = _replay(tr, tape)
        tr.zero_grad()
        dx, dh0, dc0 = tr.backward(tape, _np(dy), _np(dh_n), _np(dc_n), input_grad=input_grad)
        w0 = weights[0]  # (two placeholders, not one: a custom op's outputs may not alias)
        out = [torch.from_numpy(dx) if dx is not None else w0.new_empty(0), torch.from_numpy(dh0)]
        out.append(torch.from_numpy(dc0) if dc0 is not None else w0.new_empty(0))
        for i, w in enumerate(weights):  # each read out of the packed layout in one pass
            g = torch.empty(w.shape, dtype=w.dtype)
            eng._read(tr.grad, i, g.numpy())
            out.append(g)
    return out


@torch.library.custom_op(
    "leanrnn::rnn_forward",
    mutates_args=(),
    device_types="cpu",
    schema="(Tensor x, Tensor? h0, Tensor? c0, Tensor[] weights, Tensor? lengths, "
    "Tensor? masks, int key, str spec, bool tape, bool bf16=False, str mode='bf16') -> "
    "(Tensor, Tensor, Tensor, Tensor)",
)
def _rnn_forward(x, h0, c0, weights, lengths, masks, key, spec, tape, bf16=False, mode="bf16"):
    """y [T, N, D*K], h_n [L*D, N, K], c_n [L*D, N, H] (LSTM; else [0]) and a tape handle
    [1] (0 when ``tape`` is False). x [T, N, C] time-major; masks [L-1, T, N, D*K] or None;
    ``bf16``: mixed precision in Trainer.autocast's ``mode`` (a later argument than bf16,
    with a default: programs traced or exported before it call the op without it)."""
    return _forward(x, h0, c0, weights, lengths, masks, key, spec, tape, bf16, mode)


@_rnn_forward.register_fake
def _rnn_forward_fake(x, h0, c0, weights, lengths, masks, key, spec, tape, bf16=False,
                      mode="bf16"):  # fmt: skip
    s = _spec(spec)
    T, N = x.shape[0], x.shape[1]
    LD, K, H = s.num_layers * s.num_directions, s.output_size, s.hidden_size
    y = x.new_empty((T, N, s.num_directions * K))
    c_n = x.new_empty((LD, N, H)) if s.cell == "lstm" else x.new_empty((0,))
    return y, x.new_empty((LD, N, K)), c_n, x.new_empty((1,), dtype=torch.int64)


@torch.library.custom_op(
    "leanrnn::rnn_backward",
    mutates_args=(),
    device_types="cpu",
    schema="(Tensor handle, Tensor dy, Tensor dh_n, Tensor? dc_n, Tensor[] weights, str spec, "
    "bool input_grad=True, Tensor? x=None, Tensor? y=None, Tensor? masks=None) -> Tensor[]",
)
def _rnn_backward(handle, dy, dh_n, dc_n, weights, spec, input_grad=True, x=None, y=None,
                  masks=None):  # fmt: skip
    """[dx ([0] unless ``input_grad``), dh0, dc0 (LSTM; else [0]), *weight gradients in
    torch's names, shapes and order]. ``x``, ``y`` and ``masks`` are not read here but by the
    tape, in place: passing them makes a compiled graph keep their memory until backward
    (inductor freed x and y after the forward and reused their buffers, e.g. for 2*y in the
    loss's backward: silently wrong weight gradients). Defaults: programs traced before
    these arguments existed call the op without them."""
    return _backward_grads(handle, dy, dh_n, dc_n, weights, input_grad)


@_rnn_backward.register_fake
def _rnn_backward_fake(handle, dy, dh_n, dc_n, weights, spec, input_grad=True, x=None, y=None,
                       masks=None):  # fmt: skip
    s = _spec(spec)
    T, N = dy.shape[0], dy.shape[1]
    LD, K, H = s.num_layers * s.num_directions, s.output_size, s.hidden_size
    out = [dy.new_empty((T, N, s.input_size) if input_grad else (0,)), dy.new_empty((LD, N, K))]
    out.append(dy.new_empty((LD, N, H)) if s.cell == "lstm" else dy.new_empty((0,)))
    out += [w.new_empty(w.shape) for w in weights]
    return out


def _save(ctx, x, h0, c0, spec, output, weights, masks) -> None:
    """What backward keeps, for both paths: the handle, and x, y and the dropout masks too: the
    tape reads x and the masks, and y is the last layer's reserve (its h_{t-1} for dR), in
    place, so torch's version check must refuse a backward after one was modified in place
    (as it does for torch.nn.LSTM; y modified in place gave wrong gradients silently), and a
    compiled graph must not free them before backward (rnn_backward takes them)."""
    ctx.save_for_backward(output[3], x, output[0], masks, *weights)
    ctx.spec = spec
    ctx.lstm = _spec(spec).cell == "lstm"
    ctx.has = (h0 is not None, c0 is not None)


def _setup_context(ctx, inputs, output):
    x, h0, c0, weights, lengths, masks, key, spec, tape = inputs[:9]
    _save(ctx, x, h0, c0, spec, output, weights, masks)


def _not_batched(*grads) -> None:
    """Refuse a backward under vmap (jacobian(vectorize=True), autograd.grad(is_grads_batched=
    True): torch's legacy vmap batches the incoming gradients): it failed inside torch,
    "Batching rule not implemented for aten::detach"."""
    fc = torch._C._functorch
    legacy = getattr(fc, "is_legacy_batchedtensor", lambda t: False)
    if _functorch_transform() or any(
        isinstance(g, torch.Tensor) and (legacy(g) or fc.is_batchedtensor(g)) for g in grads
    ):
        raise NotImplementedError(
            "[leanrnn.torch] a vectorized backward (torch.autograd.functional.jacobian("
            "vectorize=True), torch.autograd.grad(is_grads_batched=True)) is not supported by "
            "leanrnn.torch's modules; use vectorize=False (one backward per output), or torch.nn's "
            "module (to_module() converts)"
        )


def _backward(ctx, dy, dh_n, dc_n, _dhandle):
    _not_batched(dy, dh_n, dc_n)
    handle, x, y, masks, *weights = ctx.saved_tensors
    # dx only when x needs it (the input GEMM skipped, as torch's modules skip it)
    grads = torch.ops.leanrnn.rnn_backward(
        handle,
        dy,
        dh_n,
        dc_n if ctx.lstm else None,
        weights,
        ctx.spec,
        ctx.needs_input_grad[0],
        x,
        y,
        masks,
    )
    dx, dh0, dc0, dw = grads[0], grads[1], grads[2], list(grads[3:])
    return (dx if ctx.needs_input_grad[0] else None, dh0 if ctx.has[0] else None,
            dc0 if ctx.has[1] else None, dw,
            # one None per other input: bf16 and mode are not ones where a call left them at
            # their defaults
            # (then torch's autograd wrapper expects one gradient fewer)
            *[None] * (len(ctx.needs_input_grad) - 4))  # fmt: skip


_rnn_forward.register_autograd(_backward, setup_context=_setup_context)


_TWICE = (b"[leanrnn.torch] a double backward (create_graph=True, then differentiating the "
          b"gradients: gradient penalties, Hessian-vector products) is not supported by "
          b"leanrnn.torch's modules; use torch.nn.LSTM/GRU/RNN for higher-order gradients "
          b"(to_module() converts)")  # fmt: skip


def _differentiated_twice(ctx, *grads):
    raise RuntimeError(_TWICE.decode())


# The op path's double backward (a function mode, such as `with torch.device("cpu"):`, sends
# eager calls through the ops) differentiates rnn_backward itself: without a formula torch
# said "no autograd formula was registered ... use register_autograd", advice for the op's
# author, where the eager path says what to do
_rnn_backward.register_autograd(_differentiated_twice,
                                setup_context=lambda ctx, inputs, output: None)  # fmt: skip


_FORWARD_AD = ("[{}] forward-mode AD (torch.autograd.forward_ad, torch.func.jvp) is not "
               "supported by leanrnn.torch's modules; use torch.nn.LSTM/GRU/RNN for it "
               "(to_module() converts)")  # fmt: skip


class _EagerRNN(torch.autograd.Function):
    """The ops' autograd formula without the ops, for eager calls (_eager): the same bodies
    (_forward, _backward_grads), the same saved tensors and version checks, without the
    dispatcher, the custom op's autograd wrapper and its argument flattening (char_lm's step:
    ~1.3 ms of Python per forward and backward, against ~21 ms for the whole step).
    Weights come last, one argument each: autograd.Function sees tensors in lists as
    constants."""

    @staticmethod
    def forward(ctx, x, h0, c0, lengths, masks, key, spec, bf16, mode, *weights):
        out = _forward(x, h0, c0, weights, lengths, masks, key, spec, True, bf16, mode)
        ctx.mark_non_differentiable(out[3])
        # unused outputs' gradients stay None: Trainer.backward takes None as zeros
        ctx.set_materialize_grads(False)
        copying = _copying_hooks()
        # (under such hooks, y itself is not saved: save_on_cpu "packs" a CPU tensor as
        # itself, so the node held its own output, y -> grad_fn -> node -> y, a cycle no
        # collection frees: a forward under the hooks never backpropagated kept its y and
        # tape for good. The version check it was saved for is _check_unchanged's there.)
        _save(ctx, x, h0, c0, spec, (out[0].new_empty(0), *out[1:]) if copying else out,
              weights, masks)  # fmt: skip
        if copying:
            # Saved-tensor hooks (activation offload, compression) may save a copy of the
            # handle, and the tape goes with the original's storage (_handle): it was freed
            # when the forward returned, and backward found no tape. The node holds the
            # original then, until its backward (_first_order lets go of it), and the
            # weights, whose versions (not their copies') say whether one changed since.
            ctx.originals = (out[3], weights)
            # The hooks' copies of x and y also carry no version check: the tape reads y (the
            # last layer's reserve) and an unstaged x where they lie, so y.mul_(2) after the
            # forward gave wrong gradients, silently (torch's own GRU saves neither). Their
            # versions now, checked by the backward (_check_unchanged).
            ctx.in_place = _read_in_place(out[3], x, out[0])
        return out

    @staticmethod
    def backward(ctx, dy, dh_n, dc_n, _dhandle):
        _not_batched(dy, dh_n, dc_n)
        grads = _EagerRNN._first_order(ctx, dy, dh_n, dc_n, _dhandle)
        # A double backward is refused, as the ops' is, not silently 0. once_differentiable
        # alone marks the gradients only where the incoming ones require grad: for a loss
        # linear in y (sum(y * w)) create_graph=True got gradients with no graph, and a penalty
        # on them (a gradient penalty, a Hessian-vector product) silently counted 0. Grad mode
        # is on here exactly when create_graph is (once_differentiable's body runs under
        # no_grad): the gradients then lead to a node that raises if differentiated, so code
        # that passes create_graph=True and never differentiates twice still runs.
        if not torch.is_grad_enabled():
            return grads
        # The error node must lie on the paths to what a second differentiation asks for:
        # fed fresh leaves, autograd.grad(penalty, x) found no path through it, never ran it,
        # and answered None (torch.autograd.functional's jvp, hvp and hessian: zeros). An
        # empty slice's sum of x, y (its node leads to h0, c0), the weights and the incoming
        # gradients puts it there, adding exactly 0 whatever they hold (inf, NaN).
        _handle_, x, y, _masks, *weights = ctx.saved_tensors
        anchor = sum(t.narrow(0, 0, 0).sum() for t in (x, y, *weights, dy, dh_n, dc_n)
                     if isinstance(t, torch.Tensor) and t.requires_grad)  # fmt: skip
        live = [i for i, g in enumerate(grads) if isinstance(g, torch.Tensor)]
        err = torch._C._functions.DelayedError(_TWICE, len(live))
        ins = [grads[i].detach() + anchor for i in live]
        marked = err(*[g if g.requires_grad else g.requires_grad_() for g in ins])
        out = list(grads)
        for i, g in zip(live, marked if isinstance(marked, tuple) else (marked,), strict=True):
            out[i] = g
        return tuple(out)

    @staticmethod
    def jvp(ctx, *tangents):
        # (torch's own answer, "You must implement the jvp function", named no way out)
        raise NotImplementedError(_FORWARD_AD.format("leanrnn.torch"))

    @staticmethod
    @once_differentiable
    def _first_order(ctx, dy, dh_n, dc_n, _dhandle):
        handle, _x, _y, _masks, *weights = ctx.saved_tensors
        if hasattr(ctx, "originals"):  # (saved-tensor hooks: ctx.saved_tensors may be copies)
            handle, weights = ctx.originals
            _check_unchanged(ctx.in_place)
        need_x = ctx.needs_input_grad[0]
        grads = _backward_grads(handle, dy, dh_n, dc_n if ctx.lstm else None, weights, need_x)
        if (
            hasattr(ctx, "originals")
            and not torch._C._autograd._get_current_graph_task_keep_graph()
        ):
            # torch frees a node's saved tensors after its backward unless the graph is
            # retained; the original handle, held outside them, kept its tape (the whole
            # forward's activations) for as long as the graph lived: a loop keeping each
            # step's loss grew by a tape a step
            del ctx.originals, ctx.in_place
        # (no gradients for lengths, masks, key, spec, bf16, mode)
        return (grads[0] if need_x else None, grads[1] if ctx.has[0] else None,
                grads[2] if ctx.has[1] else None, None, None, None, None, None, None,
                *grads[3:])  # fmt: skip


def _read_in_place(handle: torch.Tensor, x: torch.Tensor, y: torch.Tensor) -> list:
    """[(name, tensor, its version)] for x and y where the tape of ``handle`` reads them in
    their own memory (not a staged copy): what a backward must find unchanged."""
    entry = _TAPES.get(int(handle[0]))
    if entry is None:
        return []
    tape = entry[1]
    kept = [tape._saved.get("x"), tape._y]
    out = []
    for name, t in (("input x", x), ("output y", y)):
        a = t.detach().numpy()
        if any(k is not None and np.may_share_memory(a, k) for k in kept):
            # a detached alias: it shares t's version counter (a slice x whose Python object
            # died still counts its base's in-place changes) without t's grad_fn (the node
            # holding y itself was a cycle, y -> grad_fn -> ctx -> y)
            out.append((name, t.detach(), t._version))
    return out


def _check_unchanged(in_place: list) -> None:
    """The error torch's version check gives, where saved-tensor hooks keep it from checking
    (_read_in_place)."""
    for name, t, version in in_place:
        if t._version != version:
            raise RuntimeError(
                "one of the variables needed for gradient computation has been modified by an "
                f"inplace operation: [leanrnn.torch] the RNN's {name} was changed in place "
                "after its forward, under saved-tensor hooks (save_on_cpu, offloading), which "
                "copy it without torch's version check; the backward reads it where it lies. "
                "Change it out of place (y = y * 2, not y.mul_(2)), or run the module with "
                "batch_first=True (its y is a copy)"
            )


def _own_nodes(y, h_n, c_n):
    """The final states each behind an autograd node of its own (a copy: [L*D, N, K], small):
    as outputs of the one RNN node, a hook on one the loss does not use (h_n when only y is)
    was called with None, where torch.nn's modules never call it (a usual hook, g * 0.5,
    raised a TypeError). Copies, not views: h.detach_() between truncated-backprop chunks
    raises on a view ("Can't detach views in-place"). y stays the node's own output."""
    return (y, *(t.clone() if t is not None and t.requires_grad else t for t in (h_n, c_n)))


def _copying_hooks() -> bool:
    """Whether saved-tensor hooks that may save a copy of a tensor (save_on_cpu, offloading,
    compressing ones) are in force. torch.utils.checkpoint's are not such: its forward saves
    nothing and its recomputation saves the recomputed tensors themselves, so the recomputed
    handle brings its own tape (the forward's, held until backward, made checkpointing save
    nothing)."""
    top = getattr(torch._C._autograd, "_top_saved_tensors_default_hooks", None)
    if top is None:  # (a torch that does not say: they may copy)
        return True
    hooks = top(False)
    return hooks is not None and getattr(hooks[0], "__module__", None) != "torch.utils.checkpoint"


_PLAIN = (torch.Tensor, torch.nn.Parameter)


def _eager(tensors) -> bool:
    """Whether a forward may skip the custom ops (_EagerRNN): nothing is tracing it
    (torch.compile, torch.export, jit.trace), no dispatch or function mode or functorch
    transform would see the op, and the tensors are plain (no subclass dispatching on it).
    Everything else calls the registered ops, which those understand."""
    if torch.compiler.is_compiling() or torch.jit.is_tracing():
        return False  # (first: dynamo folds it, and traces nothing else here)
    if torch._C._len_torch_dispatch_stack() or torch._C._is_torch_function_mode_enabled():
        return False
    if _functorch_transform():
        return False
    return all(t is None or type(t) in _PLAIN for t in tensors)


# ---------------------------------------------------------------------------- modules
@lru_cache(maxsize=256)
def _param_shapes(spec: str, names: tuple[str, ...]) -> tuple[tuple[int, ...], ...]:
    sp = _spec(spec)
    return tuple(torch_format.param_shape(sp, n) for n in names)


_FLOATS = (torch.float32, torch.float64)


def _check_call(name: str, module, input, weights, packed: bool) -> None:
    """Entry checks of forward: a tensor or PackedSequence comes in, and the parameters still
    have the shapes of the module's spec (one replaced by another shape raised an IndexError
    deep in packing). Skipped while torch.compile traces: the cached lookup broke the graph,
    and the fake kernels check shapes there."""
    if torch.compiler.is_compiling():
        return
    if not packed and not isinstance(input, torch.Tensor):
        raise DTypeError(
            f"[{name}] input is a {type(input).__name__}; expected a torch.Tensor [T, N, C] "
            "or a PackedSequence (convert arrays with torch.from_numpy)"
        )
    if weights and isinstance(weights[0], torch.Tensor) and weights[0].dtype not in _FLOATS:
        # (module.half() / .bfloat16(): the error named neither the module nor the way)
        raise DTypeError(
            f"[{name}] parameters are {weights[0].dtype}; leanrnn.torch's modules compute in "
            "float32 or float64 (module.float() converts back): for 16-bit compute keep float32 "
            "parameters and run under torch.autocast('cpu', torch.bfloat16)"
        )
    want = _param_shapes(module._spec_str, tuple(module._flat_weights_names))
    for n, w, s in zip(module._flat_weights_names, weights, want, strict=True):
        if not isinstance(w, torch.Tensor) or tuple(w.shape) != s:
            got = tuple(w.shape) if isinstance(w, torch.Tensor) else type(w).__name__
            raise ShapeError(
                f"[{name}] parameter {n} has shape {got}; expected {s} for this module "
                "(to change sizes, make a new module)"
            )
        if w.dtype != weights[0].dtype:  # (a float64 one was packed as float32 in silence)
            raise DTypeError(
                f"[{name}] parameter {n} is {w.dtype} but {module._flat_weights_names[0]} is "
                f"{weights[0].dtype}; expected one dtype for all (module.to(dtype) converts)"
            )


def _autocast_dtypes(cell: str, proj_size: int, packed: bool, xdt, sdt, adt) -> tuple:
    """The dtypes torch's own float32 module returns under CPU autocast to ``adt``: (y and h_n,
    c_n). Read off torch 2.13 over every cell, projection, packed input, input dtype and
    state dtype (tests/test_hardening13_torch.py compares them all). torch builds the cells
    from autocast matmuls (their results in ``adt``) and sums them with the states, so what
    a state meets decides: ``sdt`` is the dtype of the state given (h_0 for a GRU, c_0 for
    an LSTM) or else of the input (``xdt``; torch's zero states take it).
    - RNN: tanh/relu of two matmuls, ``adt``;
    - GRU: h' = n + z*(h - n), the state's dtype met with ``adt``;
    - LSTM that oneDNN runs (bf16 autocast on a CPU with bf16 support, oneDNN on, no
      projection, not packed, input not float16): ``adt`` for all three;
    - any other LSTM: c' = f*c + i*g in c's dtype met with ``adt``, and h, y with it, unless
      a projection (a matmul again) gives y and h_n in ``adt``."""
    if cell != "lstm":
        return (adt if cell == "rnn" else torch.promote_types(adt, sdt or xdt)), None
    onednn = (adt == torch.bfloat16 and not proj_size and not packed and xdt != torch.float16
              and torch.backends.mkldnn.is_available() and torch._C._get_mkldnn_enabled()
              and torch.ops.mkldnn._is_mkldnn_bf16_supported())  # fmt: skip
    if onednn:
        return adt, adt
    c = torch.promote_types(adt, sdt or xdt)
    return (adt if proj_size else c), c


def _no_tangents(name: str, tensors) -> None:
    """Refuse forward-mode AD: _EagerRNN.jvp refuses it, but only where the forward runs the
    autograd Function (some input requires grad); without, a dual input's tangent was dropped
    (no_grad, frozen parameters: the output had none, and nothing said so)."""
    if getattr(_forward_ad, "_current_level", -1) < 0:  # no dual level open: nothing to carry
        return
    if any(t is not None and _forward_ad.unpack_dual(t).tangent is not None for t in tensors):
        raise NotImplementedError(_FORWARD_AD.format(name))


def _functorch_transform() -> bool:
    return torch._C._functorch.peek_interpreter_stack() is not None


def _check_device(name: str, input, hx, weights) -> None:
    """The kernels run on the CPU: a tensor elsewhere (cuda, meta, ...) is refused here, as
    torch's modules refuse mixed devices, not by numpy's "can't convert ... to numpy" later."""
    states = hx if isinstance(hx, (tuple, list)) else (hx,)
    for what, t in (("input", input), *(("hx", h) for h in states), ("parameters", weights[0])):
        if isinstance(t, torch.Tensor) and t.device.type != "cpu":
            raise DTypeError(
                f"[{name}] {what} is on device {t.device}; leanrnn.torch runs on the CPU: "
                "move it with .cpu() (or use torch.nn's module on other devices)"
            )


def _check_packed(name: str, ps) -> None:
    """A PackedSequence as torch's pack_* functions make them: batch_sizes positive and
    non-increasing, summing to the rows of data, indices covering the batch. A hand-made
    one that breaks this raised an IndexError from index_copy_."""
    if torch.compiler.is_compiling():
        return
    data, bs, si, ui = ps
    ok = isinstance(bs, torch.Tensor) and bs.dim() == 1 and bs.numel() > 0
    if ok:
        b = bs.to(torch.int64)
        N = int(b[0])
        ok = (int(b[-1]) >= 1 and not bool((b[1:] > b[:-1]).any())
              and int(b.sum()) == data.shape[0]
              and all(i is None or (i.dim() == 1 and i.numel() == N) for i in (si, ui)))  # fmt: skip
    if not ok:
        raise ShapeError(
            f"[{name}] PackedSequence with data {tuple(data.shape)} and batch_sizes "
            f"{bs.tolist() if isinstance(bs, torch.Tensor) and bs.numel() <= 16 else '...'} is "
            "malformed: expected batch_sizes positive, non-increasing and summing to the rows "
            "of data; make it with torch.nn.utils.rnn.pack_padded_sequence or pack_sequence"
        )


def _packed_rows(batch_sizes, sorted_indices, unsorted_indices):
    """For PackedSequence data: the time-major row t*N + n of each packed row, and each
    sample's length in the original batch order."""
    bs = batch_sizes.to(torch.int64)
    T, N = bs.shape[0], int(bs[0])
    j = torch.arange(N)
    valid = j[None, :] < bs[:, None]  # [T, N] over sorted positions
    t_idx, j_idx = valid.nonzero(as_tuple=True)  # row-major: the packed order
    si = sorted_indices if sorted_indices is not None else j
    rows = t_idx * N + si[j_idx]
    lens_sorted = valid.sum(0)
    lengths = lens_sorted[unsorted_indices] if unsorted_indices is not None else lens_sorted
    return rows, lengths, T, N


class _RNNBase(torch.nn.Module):
    """What LSTM, GRU and RNN share: torch.nn.RNNBase's constructor, parameters and init."""

    _cell = "lstm"

    def __init__(self, mode: str, input_size: int, hidden_size: int, num_layers: int = 1,
                 bias: bool = True, batch_first: bool = False, dropout: float = 0.0,
                 bidirectional: bool = False, proj_size: int = 0, device=None,
                 dtype=None) -> None:  # fmt: skip
        super().__init__()
        # torch.nn.RNNBase's checks and messages, so code that relies on them behaves the same
        if (not isinstance(dropout, numbers.Number) or not 0 <= dropout <= 1
                or isinstance(dropout, bool)):  # fmt: skip
            raise ValueError(
                "dropout should be a number in range [0, 1] representing the probability of "
                "an element being zeroed"
            )
        if dropout > 0 and num_layers == 1:
            warnings.warn(
                "dropout option adds dropout after all but last recurrent layer, so non-zero "
                f"dropout expects num_layers greater than 1, but got dropout={dropout} and "
                f"num_layers={num_layers}",
                stacklevel=3,
            )
        for name, v, kind in (("bias", bias, bool), ("batch_first", batch_first, bool),
                              ("input_size", input_size, int),
                              ("hidden_size", hidden_size, int)):  # fmt: skip
            if not isinstance(v, kind):
                raise TypeError(
                    f"{name} should be of type {kind.__name__}, got: {type(v).__name__}"
                )
        if input_size <= 0:
            raise ValueError("input_size must be greater than zero")
        if hidden_size <= 0:
            raise ValueError("hidden_size must be greater than zero")
        if num_layers <= 0:
            raise ValueError("num_layers must be greater than zero")
        if proj_size < 0:
            raise ValueError(
                "proj_size should be a positive integer or zero to disable projections"
            )
        if proj_size >= hidden_size:
            raise ValueError("proj_size has to be smaller than hidden_size")
        dev = torch.device("cpu") if device is None else torch.device(device)
        if dev.type != "cpu":
            raise SpecError(
                f"[leanrnn.torch.{type(self).__name__}] device={device}; leanrnn runs on the "
                "CPU: use torch.nn's module on other devices"
            )
        pdt = torch.get_default_dtype() if dtype is None else dtype
        if pdt not in (torch.float32, torch.float64):
            raise DTypeError(
                f"[leanrnn.torch.{type(self).__name__}] dtype={pdt}; expected torch.float32 or "
                "torch.float64 (bfloat16: keep float32 parameters and use torch.autocast)"
            )
        self.mode = mode
        self.input_size = input_size
        self.hidden_size = hidden_size
        self.num_layers = num_layers
        self.bias = bias
        self.batch_first = batch_first
        self.dropout = float(dropout)
        self.bidirectional = bidirectional
        self.proj_size = proj_size
        # under torch.autocast(bfloat16): "bf16" rounds the weights only, "bf16-act" also the
        # vectors they multiply, as torch's autocast does (faster; Trainer.autocast)
        self._autocast_mode = "bf16"
        D = 2 if bidirectional else 1
        G = {"LSTM": 4, "GRU": 3}.get(mode, 1) * hidden_size
        K = proj_size or hidden_size
        fk = {"device": dev, "dtype": pdt}
        self._flat_weights_names: list[str] = []
        self._all_weights: list[list[str]] = []
        for layer in range(num_layers):
            for d in range(D):
                Cin = input_size if layer == 0 else K * D
                sfx = f"_l{layer}{'_reverse' if d else ''}"
                shapes = [("weight_ih", (G, Cin)), ("weight_hh", (G, K))]
                if bias:
                    shapes += [("bias_ih", (G,)), ("bias_hh", (G,))]
                if proj_size:
                    shapes.append(("weight_hr", (proj_size, hidden_size)))
                names = []
                for n, shape in shapes:
                    setattr(self, n + sfx, torch.nn.Parameter(torch.empty(shape, **fk)))
                    names.append(n + sfx)
                self._flat_weights_names += names
                self._all_weights.append(names)
        self._key = next(_KEYS)
        self._finalizer = weakref.finalize(self, _ENGINES.pop, self._key, None)
        # the ops' spec argument, made once (the forward stays free of untraceable calls)
        self._spec_str = _spec_string(self._mode_cell(mode), input_size, hidden_size, num_layers,
                                      bidirectional, proj_size, bias,
                                      "relu" if mode == "RNN_RELU" else "tanh")  # fmt: skip
        self.reset_parameters()

    # -- torch.nn.RNNBase's surface

    @property
    def autocast_mode(self) -> str:
        """Under ``torch.autocast("cpu", torch.bfloat16)``: "bf16" rounds the weights only,
        "bf16-act" also the vectors they multiply, as torch's autocast does (faster; see
        Trainer.autocast). Checked when set (a typo ran every forward outside bf16 autocast
        and failed at the first one inside, long after)."""
        d = self.__dict__  # (modules pickled before the check kept it as a plain attribute)
        return d.get("_autocast_mode", d.get("autocast_mode", "bf16"))

    @autocast_mode.setter
    def autocast_mode(self, mode: str) -> None:
        if not isinstance(mode, str) or mode not in AUTOCAST_MODES:
            raise SpecError(f"[{type(self).__name__}] autocast_mode={mode!r}; expected one of "
                            f"{', '.join(map(repr, AUTOCAST_MODES))}")  # fmt: skip
        self._autocast_mode = mode

    def reset_parameters(self) -> None:
        """torch's init: every parameter ~ U(-1/sqrt(H), 1/sqrt(H)), in registration order (so
        a seeded module equals a seeded torch module)."""
        stdv = 1.0 / math.sqrt(self.hidden_size) if self.hidden_size > 0 else 0
        for w in self.parameters():
            torch.nn.init.uniform_(w, -stdv, stdv)

    def flatten_parameters(self) -> None:
        """A no-op, as on the CPU in torch: changed parameters are repacked by the next forward."""

    @property
    def all_weights(self) -> list[list[torch.nn.Parameter]]:
        return [[getattr(self, n) for n in names] for names in self._all_weights]

    @property
    def _flat_weights(self) -> list[torch.nn.Parameter]:
        """The parameters in ``_flat_weights_names``' order, as torch's modules keep them (code
        that reads a module's weights through it, a weight-dropout wrapper's, found none). A
        fresh list each time: the module's weights are its named parameters."""
        return [getattr(self, n) for n in self._flat_weights_names]

    @_flat_weights.setter
    def _flat_weights(self, value) -> None:
        # torch's forward reads this list, so weight-dropout wrappers assign it; this forward
        # reads the named parameters, and an assignment taken silently would be ignored
        raise AttributeError(
            f"[leanrnn.torch.{type(self).__name__}] _flat_weights cannot be assigned: the "
            "forward reads the named parameters (weight_hh_l0, ...); set those (as "
            "torch.nn.utils.parametrize or a tensor attribute), or convert with to_module() "
            "for torch.nn's module"
        )

    def __prepare_scriptable__(self):
        # torch.jit.script calls this on every module it scripts, this one inside a model too:
        # TorchScript compiles Python source it cannot read here (it failed on an f-string
        # deep in forward); say which ways do work
        raise NotImplementedError(
            f"[leanrnn.torch.{type(self).__name__}] torch.jit.script cannot compile leanrnn's "
            "modules; use torch.jit.trace, torch.export or torch.compile, which run leanrnn's "
            "kernels, or convert with to_module() for torch.nn's scriptable module"
        )

    def extra_repr(self) -> str:
        s = "{input_size}, {hidden_size}"
        if self.proj_size != 0:
            s += ", proj_size={proj_size}"
        if self.num_layers != 1:
            s += ", num_layers={num_layers}"
        if self.bias is not True:
            s += ", bias={bias}"
        if self.batch_first is not False:
            s += ", batch_first={batch_first}"
        if self.dropout != 0:
            s += ", dropout={dropout}"
        if self.bidirectional is not False:
            s += ", bidirectional={bidirectional}"
        return s.format(**self.__dict__)

    def __deepcopy__(self, memo):
        # Defined here, a parametrized module (weight_norm, orthogonal, AveragedModel of one)
        # copies through it too: torch's parametrize gives the class a deepcopy of its own
        # otherwise, which copied the engine key along (two modules on one engine)
        done = memo.get(id(self))
        if done is not None:
            return done
        replica = type(self).__new__(type(self))
        memo[id(self)] = replica
        _RNNBase.__setstate__(replica, copy.deepcopy(_RNNBase.__getstate__(self), memo))
        return replica

    def __getstate__(self):
        # a copy (deepcopy, pickle) gets its own engine: two modules sharing one would repack
        # each other's weights and invalidate each other's tapes
        state = self.__dict__.copy()
        state.pop("_key", None)
        state.pop("_finalizer", None)
        return state

    def __setstate__(self, state) -> None:
        super().__setstate__(state)
        spec = json.loads(self._spec_str)  # pickled by an older leanrnn: this one's version
        self._spec_str = json.dumps([*spec[:8], _OPS_VERSION])
        self._key = next(_KEYS)
        self._finalizer = weakref.finalize(self, _ENGINES.pop, self._key, None)

    # -- conversions
    @property
    def _nonlinearity(self) -> str:
        return "relu" if self.mode == "RNN_RELU" else "tanh"

    @staticmethod
    def _mode_cell(mode: str) -> str:
        return {"LSTM": "lstm", "GRU": "gru"}.get(mode, "rnn")

    def to_module(self) -> torch.nn.Module:
        """The torch.nn module with these weights (and options)."""
        w = getattr(self, self._flat_weights_names[0])
        kw = dict(num_layers=self.num_layers, bias=self.bias, batch_first=self.batch_first,
                  dropout=self.dropout, bidirectional=self.bidirectional, dtype=w.dtype)  # fmt: skip
        # built under a fork of torch's generator: its initialisation, overwritten at once,
        # drew from the caller's stream (the next nn.Linear came out otherwise)
        with torch.random.fork_rng(devices=[]):
            if self._cell == "lstm":
                m = torch.nn.LSTM(self.input_size, self.hidden_size, proj_size=self.proj_size,
                                  **kw)  # fmt: skip
            elif self._cell == "gru":
                m = torch.nn.GRU(self.input_size, self.hidden_size, **kw)
            else:
                m = torch.nn.RNN(self.input_size, self.hidden_size,
                                 nonlinearity=self._nonlinearity, **kw)  # fmt: skip
        with torch.no_grad():  # (a parametrized or subclassed module's too)
            weights = torch_format.module_weights(
                self, f"leanrnn.torch.{type(self).__name__}.to_module"
            )
            m.load_state_dict({k: v.detach() for k, v in weights.items()})
        _frozen_as(m, self)
        m.train(self.training)
        return m

    @classmethod
    def from_module(cls, module: torch.nn.Module) -> Self:
        """This class's twin of a torch.nn.LSTM/GRU/RNN: its options and the weights it
        computes with, copied (frozen ones stay frozen). New parameters: an optimizer made
        for ``module`` does not step them (make it after the swap), and a parametrization
        (weight_norm) is not carried: register it on the twin to train through it."""
        want = {"lstm": torch.nn.LSTM, "gru": torch.nn.GRU, "rnn": torch.nn.RNN}[cls._cell]
        ours = isinstance(module, _RNNBase) and module._cell == cls._cell
        if not (ours or isinstance(module, want)):
            raise WeightsError(
                f"[leanrnn.torch.{cls.__name__}.from_module] got {type(module).__name__}; "
                f"expected torch.nn.{cls.__name__}"
            )
        w = module.weight_ih_l0
        kw = dict(num_layers=module.num_layers, bias=module.bias, batch_first=module.batch_first,
                  dropout=module.dropout, bidirectional=module.bidirectional,
                  dtype=w.dtype)  # fmt: skip
        if cls._cell == "lstm":
            kw["proj_size"] = module.proj_size
        if cls._cell == "rnn":
            kw["nonlinearity"] = module.nonlinearity
        with warnings.catch_warnings(), torch.random.fork_rng(devices=[]):
            warnings.simplefilter("ignore")  # the dropout/num_layers warning: torch's said it
            m = cls(module.input_size, module.hidden_size, **kw)  # (to_module: the generator)
        with torch.no_grad():  # the weights it computes with (torch_format.module_weights)
            weights = torch_format.module_weights(
                module, f"leanrnn.torch.{cls.__name__}.from_module"
            )
            m.load_state_dict({k: v.detach() for k, v in weights.items()})
        _frozen_as(m, module)
        m.train(module.training)
        if ours:
            m.autocast_mode = getattr(module, "autocast_mode", "bf16")
        return m

    # -- forward
    def forward(self, input, hx=None):
        name = f"leanrnn.torch.{type(self).__name__}"
        lstm = self._cell == "lstm"
        weights = [getattr(self, n) for n in self._flat_weights_names]
        wdt = weights[0].dtype
        D = 2 if self.bidirectional else 1
        LD = self.num_layers * D
        K = self.proj_size or self.hidden_size
        packed = isinstance(input, PackedSequence)
        batched = True
        _check_call(name, self, input, weights, packed)
        _check_device(name, input.data if packed else input, hx, weights)
        if not torch.compiler.is_compiling() and _functorch_transform():
            # torch.func.grad/vmap/jacrev/jvp: the ops' autograd formula (register_autograd)
            # has no functorch rules in torch 2.13, and failed inside torch with advice about
            # setup_context meant for the author of an autograd.Function
            raise NotImplementedError(
                f"[{name}] torch.func transforms (grad, vmap, jacrev, jvp, ...) are not "
                "supported by leanrnn.torch's modules; use torch.autograd (loss.backward(), "
                "torch.autograd.grad) or torch.nn's module (to_module() converts)"
            )
        if packed:
            data, batch_sizes, sorted_indices, unsorted_indices = input
            _check_packed(name, input)
            rows, lengths, T, N = _packed_rows(batch_sizes, sorted_indices, unsorted_indices)
            if data.dim() != 2 or data.shape[1] != self.input_size:
                raise ShapeError(
                    f"[{name}] PackedSequence data has shape {tuple(data.shape)}; expected "
                    f"[sum of lengths, {self.input_size}]"
                )
            # (outside autocast: its type promotion for index_copy refuses bfloat16 data under
            # float16 autocast, "Unexpected floating ScalarType", where torch's module runs)
            with torch.autocast("cpu", enabled=False):
                x = data.new_zeros((T * N, self.input_size)).index_copy(0, rows, data)
            x = x.view(T, N, self.input_size)
        else:
            if input.dim() not in (2, 3):
                raise ShapeError(
                    f"[{name}] input has {input.dim()} dims (shape {tuple(input.shape)}); "
                    "expected 3-D [T, N, C] ([N, T, C] with batch_first) or 2-D unbatched [T, C]"
                )
            batched = input.dim() == 3
            lengths = None
            x = input if batched else input.unsqueeze(1)
            if batched and self.batch_first:
                x = x.transpose(0, 1)
            T, N = x.shape[0], x.shape[1]
            if T < 1:  # else the trainer refused it, naming itself (Trainer.forward); N = 0
                # is torch's empty batch (below)
                layout = ("[N, T, C] (batch_first)" if batched and self.batch_first
                          else "[T, N, C]" if batched else "unbatched [T, C]")  # fmt: skip
                raise ShapeError(
                    f"[{name}] input has shape {tuple(input.shape)}: T={T} steps; expected "
                    f"{layout} with T >= 1, as torch.nn's modules do"
                )
            if x.shape[2] != self.input_size:
                raise ShapeError(
                    f"[{name}] input has shape {tuple(input.shape)}; expected input size "
                    f"C={self.input_size} in the last dimension"
                )
        h0 = c0 = None
        if hx is not None:
            if lstm:
                if not isinstance(hx, tuple | list) or len(hx) != 2:
                    raise ShapeError(f"[{name}] hx must be a tuple (h_0, c_0) for an LSTM")
                h0, c0 = hx
            else:
                h0 = hx
            want = 2 if not batched else 3
            for nm, t, last in (("h_0", h0, K), ("c_0", c0, self.hidden_size)):
                if t is None:
                    continue
                if not isinstance(t, torch.Tensor):  # a GRU given (h, c) raised AttributeError
                    raise ShapeError(
                        f"[{name}] {nm} is a {type(t).__name__}; expected a tensor "
                        f"[L*D={LD}, N, {last}]"
                        + ("" if lstm else f" (a {self._cell.upper()} takes hx = h_0 alone)")
                    )
                if t.dim() != want:
                    raise ShapeError(
                        f"[{name}] {nm} has shape {tuple(t.shape)}; for "
                        f"{'unbatched 2-D' if not batched else '3-D'} input it must be "
                        f"{want}-D [L*D={LD}{', N=' + str(N) if batched else ''}, {last}]"
                    )
                shape = tuple(t.shape) if batched else (t.shape[0], 1, t.shape[1])
                if shape != (LD, N, last):
                    raise ShapeError(
                        f"[{name}] {nm} has shape {tuple(t.shape)}; expected "
                        f"[L*D={LD}, N={N}, {last}]" if batched else
                        f"[{name}] {nm} has shape {tuple(t.shape)}; expected [L*D={LD}, {last}]"
                    )  # fmt: skip
            if not batched:
                h0 = h0.unsqueeze(1)
                c0 = c0.unsqueeze(1) if c0 is not None else None
        # dtypes: torch's rule (input and states in the parameters' dtype), except under CPU
        # autocast, where torch's modules take any float input and compute as documented above
        autocast = torch.is_autocast_enabled("cpu")
        given = tuple(None if t is None else t.dtype for t in (x, h0, c0))  # (autocast's outputs)
        if autocast:
            x = x.to(wdt)
            h0 = h0.to(wdt) if h0 is not None else None
            c0 = c0.to(wdt) if c0 is not None else None
        for nm, t in (("input", x), ("h_0", h0), ("c_0", c0)):
            if t is not None and t.dtype != wdt:
                # the module can follow only to the dtypes leanrnn computes in (it suggested
                # .to(torch.int64) and .to(torch.float16), which fail next)
                alt = (f", or the module with .to({t.dtype})"
                       if t.dtype in (torch.float32, torch.float64) else "")  # fmt: skip
                raise DTypeError(
                    f"[{name}] {nm} has dtype {t.dtype}; expected {wdt} (the parameters' dtype): "
                    f"convert it with .to({wdt}){alt}"
                )
        _no_tangents(name, (x, h0, c0, *weights))
        need_grad = torch.is_grad_enabled() and any(
            t is not None and t.requires_grad for t in (x, h0, c0, *weights)
        )
        masks = None
        if N and self.training and self.dropout > 0 and self.num_layers > 1:
            masks = self._dropout_masks(T, N, D * K, wdt, rows if packed else None)
        args = (x, h0, c0, weights, lengths, masks, self._key, self._spec_str)
        # mixed precision: bf16 kernels on the weights rounded to bf16 (float32 parameters,
        # states and outputs; float64 modules and float16 autocast compute as they are)
        bf16 = (autocast and wdt == torch.float32
                and torch.get_autocast_dtype("cpu") == torch.bfloat16)  # fmt: skip
        mode = self.autocast_mode
        if N == 0:  # an empty batch: torch.nn's modules return empty outputs whose graph
            # reaches the parameters (and x, h_0, c_0) with zero gradients; so do these
            zero = sum(t.sum() for t in (x, h0, c0, *weights) if t is not None) * 0
            y = x.new_zeros((T, 0, D * K)) + zero
            h_n = x.new_zeros((LD, 0, K)) + zero
            c_n = x.new_zeros((LD, 0, self.hidden_size)) + zero if lstm else None
        elif not _eager((x, h0, c0, lengths, masks, *weights)):
            y, h_n, c_n, _ = torch.ops.leanrnn.rnn_forward(*args, need_grad, bf16, mode)
            y, h_n, c_n = _own_nodes(y, h_n, c_n)
        elif need_grad:
            y, h_n, c_n, _ = _EagerRNN.apply(x, h0, c0, lengths, masks, self._key,
                                             self._spec_str, bf16, mode, *weights)  # fmt: skip
            y, h_n, c_n = _own_nodes(y, h_n, c_n)
        else:
            y, h_n, c_n, _ = _forward(*args, False, bf16, mode)
        adt = torch.get_autocast_dtype("cpu") if autocast else None
        if adt is not None and wdt == torch.float32:
            hdt, cdt = _autocast_dtypes(self._cell, self.proj_size, packed, given[0],
                                        given[2] if lstm else given[1], adt)  # fmt: skip
            y, h_n = y.to(hdt), h_n.to(hdt)
            c_n = c_n.to(cdt) if lstm else c_n
        if packed:
            out = PackedSequence(y.reshape(T * N, D * K)[rows], batch_sizes, sorted_indices,
                                 unsorted_indices)  # fmt: skip
        elif not batched:
            out = y.squeeze(1)
            h_n = h_n.squeeze(1)
            c_n = c_n.squeeze(1) if lstm else c_n
        else:
            out = y.transpose(0, 1).contiguous() if self.batch_first else y
        return (out, (h_n, c_n)) if lstm else (out, h_n)

    def _dropout_masks(self, T, N, DK, dtype, rows):
        """torch's inter-layer dropout masks, drawn as torch.nn.LSTM draws them: bernoulli(1-p)
        / (1-p) over each non-last layer's output ([T, N, D*K], or the packed rows)."""
        p = self.dropout
        L = self.num_layers
        masks = torch.zeros((L - 1, T * N, DK), dtype=dtype) if rows is not None else None
        out = []
        for layer in range(L - 1):
            shape = (rows.shape[0], DK) if rows is not None else (T, N, DK)
            if p == 1:
                m = torch.zeros(shape, dtype=dtype)
            else:
                m = torch.empty(shape, dtype=dtype).bernoulli_(1 - p).div_(1 - p)
            if rows is not None:
                masks[layer].index_copy_(0, rows, m)
            else:
                out.append(m)
        return masks.view(L - 1, T, N, DK) if rows is not None else torch.stack(out)


class LSTM(_RNNBase):
    """torch.nn.LSTM on leanrnn's kernels: the same constructor, parameters, ``state_dict``
    and forward (``(y, (h_n, c_n))``), trained through torch.autograd."""

    _cell = "lstm"

    def __init__(self, *args, **kwargs) -> None:
        super().__init__("LSTM", *args, **kwargs)


class GRU(_RNNBase):
    """torch.nn.GRU on leanrnn's kernels (torch's gate order r, z, n in its parameters)."""

    _cell = "gru"

    def __init__(self, *args, **kwargs) -> None:
        if "proj_size" in kwargs:
            raise ValueError("proj_size argument is only supported for LSTM, not RNN or GRU")
        super().__init__("GRU", *args, **kwargs)


class RNN(_RNNBase):
    """torch.nn.RNN on leanrnn's kernels (``nonlinearity='tanh'`` or ``'relu'``)."""

    _cell = "rnn"

    def __init__(self, *args, **kwargs) -> None:
        if "proj_size" in kwargs:
            raise ValueError("proj_size argument is only supported for LSTM, not RNN or GRU")
        if len(args) > 3:
            self_nonlinearity = args[3]
            args = args[:3] + args[4:]
        else:
            self_nonlinearity = kwargs.pop("nonlinearity", "tanh")
        if self_nonlinearity not in ("tanh", "relu"):
            raise ValueError(
                f"Unknown nonlinearity '{self_nonlinearity}'. Select from 'tanh' or 'relu'."
            )
        mode = "RNN_TANH" if self_nonlinearity == "tanh" else "RNN_RELU"
        super().__init__(mode, *args, **kwargs)
        self.nonlinearity = self_nonlinearity


def from_module(module: torch.nn.Module) -> LSTM | GRU | RNN:
    """leanrnn.torch's twin of a torch.nn.LSTM, GRU or RNN, or a copy of one of leanrnn.torch's
    own (options and weights copied)."""
    for twin, cls in ((LSTM, torch.nn.LSTM), (GRU, torch.nn.GRU), (RNN, torch.nn.RNN)):
        if isinstance(module, cls | twin):
            return twin.from_module(module)
    t = type(module)
    raise WeightsError(
        f"[leanrnn.torch.from_module] got {t.__module__}.{t.__qualname__}; expected "
        "torch.nn.LSTM, GRU or RNN (a model holding one: pass that submodule)"
    )

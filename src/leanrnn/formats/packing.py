"""Canonical weights <-> the packed layout the kernels read (prepared once, at load).

Canonical (``LayerWeights``): one per (layer, direction), internal gate order (see ``spec``),
gate-major rows, no padding: ``W`` [G, C], ``R`` [G, K], ``bW``/``bR`` [G], ``peep`` [3, H] for
(i, f, o) or None, ``proj`` [P, H] or None. K = P if projected else H.

Packed (``PackedLayer``), MNN's ``copyWeightAlignUp4x4`` idea at register-tile granularity:

- Units are grouped in blocks of ``B`` = 16; H is padded to Hp = multiple of B with zero rows.
- Gates are *fused per unit block*: block u is one panel [K, ng*B] whose row k holds, for input
  k, the weights of gate rows (i_u, f_u, g_u, o_u) of its 16 units — column ``gate*B + j`` is
  canonical row ``gate*H + u*B + j``. A GEMM tile broadcasts one input and reads one contiguous
  panel row per k (kernels/_simd.py), and the thread owning block u has every gate of its units
  and finishes the cell update without waiting for other blocks.
- Panel rows are ng*B elements (a multiple of 64 bytes), and all tensors of a model live in
  one 64-byte-aligned buffer.
- Biases are folded where the math allows: ``b = bW + bR`` is added once in the input projection;
  only GRU with linear_before_reset keeps ``bR`` of the n gate apart (``rb``), because there the
  reset gate multiplies it. The original ``bW``/``bR`` are kept too, so unpack is exact.
"""

from __future__ import annotations

import copy
from dataclasses import dataclass

import numpy as np

from ..errors import DTypeError, WeightsError
from ..kernels.abi import DOT_TAIL_ROWS, B  # the kernels' layout, defined with them
from ..memory.arena import aligned_empty, round_up
from ..spec import RNNSpec

ROW_ALIGN = 16  # elements: row strides are multiples of this
SUPPORTED_DTYPES = (np.dtype(np.float32), np.dtype(np.float64))
# Weight precisions of the W and R panels (formats.quantize): "float" is the working dtype;
# the reduced ones need a float32 working dtype (activations, states and sums stay float32).
# "bf16-act" holds bf16's panels; the kernels round the activations to bfloat16 too, on every
# path (one AMX tile product instead of two; kernels.abi._SCRATCH's bf16_act).
PRECISIONS = ("float", "bf16", "int8", "int8-dynamic", "bf16-act")
# bf16: its bits; int8-dynamic: int8 codes tagged uint8 (the kernels pick its tile by it)
PANEL_DTYPES = {"bf16": np.dtype(np.uint16), "int8": np.dtype(np.int8),
                "int8-dynamic": np.dtype(np.uint8), "bf16-act": np.dtype(np.uint16)}  # fmt: skip
_SAME_PANELS = {"bf16-act": "bf16"}


def panel_format(precision: str) -> str:
    """The format of ``precision``'s W and R panels: itself, or the one it shares ("bf16-act"
    has bf16's panels)."""
    return _SAME_PANELS.get(precision, precision)


def same_panels(pw: PackedWeights, precision: str) -> PackedWeights:
    """``pw`` under ``precision``, a precision of the same panels (bf16 and bf16-act): a shallow
    copy on the same buffer, so it follows refills of it in place (mixed-precision training
    rounds its master weights again after every optimizer step); no bytes copied."""
    if panel_format(precision) != panel_format(pw.precision):
        raise DTypeError(f"[same_panels] {pw.precision} weights cannot be read as {precision}: "
                         "their panels differ; quantize the float32 model")  # fmt: skip
    view = copy.copy(pw)
    view.precision = precision
    return view


SCALE_ROWS = 4  # an int8 panel's extra rows: its columns' float32 scales (kernels._qsimd)
_PANELS = ("Wt", "Rt")  # the packed tensors a reduced precision applies to


@dataclass
class LayerWeights:
    """Canonical weights of one (layer, direction), internal gate order, unpadded."""

    W: np.ndarray  # [G, C]
    R: np.ndarray  # [G, K]
    bW: np.ndarray  # [G]
    bR: np.ndarray  # [G]
    peep: np.ndarray | None = None  # [3, H] peepholes for (i, f, o)
    proj: np.ndarray | None = None  # [P, H]


@dataclass
class PackedLayer:
    """Views into the packed buffer for one (layer, direction). Shapes use padded sizes."""

    Wt: np.ndarray  # [U, Cp, ng*B] input weights, one gate-fused panel per unit block
    Rt: np.ndarray  # [U, Kp, ng*B] recurrent weights, same panels
    b: np.ndarray  # [Gp] folded bias, added in the input projection
    rb: np.ndarray  # [Gp] recurrent bias kept apart (GRU n gate with linear_before_reset), else 0
    bW: np.ndarray  # [Gp] original input bias (for unpack)
    bR: np.ndarray  # [Gp] original recurrent bias (for unpack)
    peep: np.ndarray  # [3, Hp] (zeros and unused without peepholes)
    proj: np.ndarray  # [Pp/B, Hp, B] projection panels (shape [0, Hp, B] without projection)


def gate_permutation(num_gates: int, H: int) -> np.ndarray:
    """perm[packed_row] = canonical row, or -1 for a padding row. Length ng*Hp."""
    Hp = round_up(H, B)
    # packed row (u*ng + g)*B + j  <->  unit u*B + j of gate g
    u, g, j = np.meshgrid(np.arange(Hp // B), np.arange(num_gates), np.arange(B), indexing="ij")
    unit = (u * B + j).reshape(-1)
    return np.where(unit < H, g.reshape(-1) * H + unit, -1).astype(np.int64)


class PackedWeights:
    """All packed tensors of a model in one 64-byte-aligned buffer.

    ``layers[l][d]`` is the ``PackedLayer`` of layer ``l``, direction ``d``.
    """

    def __init__(self, spec: RNNSpec, dtype, zero: bool = True, precision: str = "float") -> None:
        """Allocate (and, unless ``zero=False``, clear) the buffer for ``spec``'s tensors.
        ``zero=False`` is for loaders that fill every byte of ``buffer`` themselves.
        ``precision``: of the W and R panels (PRECISIONS; see formats.quantize)."""
        self.spec = spec
        self.dtype = np.dtype(dtype)
        if self.dtype not in SUPPORTED_DTYPES:
            raise DTypeError(f"[pack] dtype {self.dtype}; expected float32 or float64")
        check_precision(precision, self.dtype, "pack")
        self.precision = precision
        # Bumped by a writer of the values (a Trainer whose parameters an optimizer stepped),
        # so every other holder of state derived from them (a second Trainer over the same
        # model: its dense copies and bf16 rounding) knows to remake it
        self.generation = 0
        H, P = spec.hidden_size, spec.proj_size
        K = spec.output_size
        self.B = B
        self.Hp = round_up(H, B)
        self.Kp = round_up(K, ROW_ALIGN)
        self.Pp = round_up(P, B) if P else 0
        self.U = self.Hp // B
        self.W = spec.num_gates * B  # panel width
        self.Gp = spec.num_gates * self.Hp
        self.perm = gate_permutation(spec.num_gates, H)
        shapes = [dict(d) for d in _chunks(self.layout(spec, precision),
                                           len(PackedLayer.__dataclass_fields__))]  # fmt: skip
        dts = {name: tensor_dtype(name, self.dtype, precision) for name in shapes[0]}
        self.nbytes = self.size(spec, self.dtype, precision)
        self.buffer = aligned_empty(self.nbytes)
        if zero:
            self.buffer[:] = 0
        off = 0
        flat = []
        for d in shapes:
            views = {}
            for name, shape in d.items():
                n = int(np.prod(shape)) * dts[name].itemsize
                views[name] = self.buffer[off : off + n].view(dts[name]).reshape(shape)
                off += round_up(n, 64)
            flat.append(PackedLayer(**views))
        nd = spec.num_directions
        self.layers = [flat[i * nd : (i + 1) * nd] for i in range(spec.num_layers)]

    def __reduce__(self):
        # deepcopy and pickle: a new aligned buffer holding the same bytes, its views made
        # again. Copied one attribute at a time, each view became an unaligned array of its
        # own, outside the buffer the engine and the native writer read.
        # The generation goes along as state (a dict update, as older pickles load): a
        # Trainer's copy keeps the generation it last saw, and against a copy's 0 it took its
        # own weights for another writer's and refused its tapes after the first step.
        return (_packed_from_bytes, (self.spec, self.dtype, self.precision, self.buffer, "pairs"),
                {"generation": self.generation})  # fmt: skip

    def __deepcopy__(self, memo) -> PackedWeights:
        new = _packed_from_bytes(self.spec, self.dtype, self.precision, self.buffer, "pairs")
        new.generation = self.generation
        return new

    def __copy__(self) -> PackedWeights:
        # shallow, as before: the same buffer and views (serve swaps the spec of such a copy)
        new = object.__new__(type(self))
        new.__dict__.update(self.__dict__)
        return new

    @classmethod
    def size(cls, spec: RNNSpec, dtype=np.float32, precision: str = "float") -> int:
        """Bytes of the packed buffer, known before it is allocated (each tensor 64-aligned)."""
        dtype = np.dtype(dtype)
        return sum(round_up(int(np.prod(shape)) * tensor_dtype(k, dtype, precision).itemsize, 64)
                   for k, shape in cls.layout(spec, precision))  # fmt: skip

    @staticmethod
    def layout(spec: RNNSpec, precision: str = "float") -> list[tuple[str, tuple[int, ...]]]:
        """(short name, shape) of every packed tensor, per (layer, direction) in buffer order —
        what a file must declare, computable before anything is allocated (int8 panels have
        SCALE_ROWS more rows: their scales; int8-dynamic panels are laid out for integer dot
        products, panel_shape; tensor_dtype gives each tensor's dtype)."""
        Hp = round_up(spec.hidden_size, B)
        Kp = round_up(spec.output_size, ROW_ALIGN)
        Pp = round_up(spec.proj_size, B) if spec.proj_size else 0
        U, Wd, Gp = Hp // B, spec.num_gates * B, spec.num_gates * Hp
        out = []
        for layer in range(spec.num_layers):
            Cp = round_up(spec.layer_input_size(layer), ROW_ALIGN)
            shapes = {
                "Wt": (U, *panel_shape(Cp, Wd, precision)),
                "Rt": (U, *panel_shape(Kp, Wd, precision)),
                "b": (Gp,),
                "rb": (Gp,),
                "bW": (Gp,),
                "bR": (Gp,),
                "peep": (3, Hp),
                "proj": (Pp // B, Hp, B),
            }
            assert list(shapes) == list(PackedLayer.__dataclass_fields__)
            for _ in range(spec.num_directions):
                out += list(shapes.items())
        return out

    def tensors(self) -> dict[str, np.ndarray]:
        """Every packed tensor by a stable name, e.g. ``l0.d1.Rt`` (for the native format)."""
        out = {}
        for li, dirs in enumerate(self.layers):
            for di, pl in enumerate(dirs):
                for name in PackedLayer.__dataclass_fields__:
                    out[f"l{li}.d{di}.{name}"] = getattr(pl, name)
        return out

    @property
    def weight_bytes(self) -> int:
        """Bytes of the W and R panels (scales included): what the precision shrinks."""
        return sum(getattr(pl, n).nbytes for d in self.layers for pl in d for n in _PANELS)

    def panel(self, pl: PackedLayer, name: str) -> np.ndarray:
        """Panel ``name`` ("Wt"/"Rt") of ``pl`` as numbers of the working dtype (dequantized
        if reduced): [U, X, Wd], X without the scale rows."""
        from .quantize import dequantize_panel

        a = getattr(pl, name)
        return a if self.precision == "float" else dequantize_panel(a, self.precision, self.dtype)

    def unpack(self) -> list[list[LayerWeights]]:
        """The canonical weights back, bit for bit (reduced precision: dequantized, exactly)."""
        spec = self.spec
        H, K, P = spec.hidden_size, spec.output_size, spec.proj_size
        valid = self.perm >= 0
        rows = self.perm[valid]
        out = []
        for li, dirs in enumerate(self.layers):
            C = spec.layer_input_size(li)
            layer = []
            for pl in dirs:
                G = spec.gate_width
                W = np.empty((G, C), self.dtype)
                R = np.empty((G, K), self.dtype)
                bW = np.empty(G, self.dtype)
                bR = np.empty(G, self.dtype)
                W[rows] = from_panels(self.panel(pl, "Wt"))[valid, :C]
                R[rows] = from_panels(self.panel(pl, "Rt"))[valid, :K]
                bW[rows] = pl.bW[valid]
                bR[rows] = pl.bR[valid]
                peep = pl.peep[:, :H].copy() if spec.peepholes else None
                proj = from_panels(pl.proj)[:P, :H].copy() if P else None
                layer.append(LayerWeights(W, R, bW, bR, peep, proj))
            out.append(layer)
        return out


# What .lrnn files and pickles of bf16 weights record as "bf16_layout" (panels in input pairs,
# formats.quantize.bf16_panel). Those without it were written before 2026-12-01 18:32 UTC in one
# of two column orders (one from 2026-11-30 19:01, one from 19:34 on) that the bytes cannot tell
# apart: refused, since reading them as the later one computed garbage for the earlier one's
# (0.5-7.7 off), and re-quantizing the float32 model gives the same model again.
def unmarked_bf16(precision: str) -> str:
    """Why a file or pickle of ``precision`` ("bf16" or "bf16-act") weights without a
    bf16_layout is refused, and what to do."""
    return (
        f"{precision} weights without a bf16_layout, as leanrnn wrote them before 2026-12-01 in "
        "one of two column orders that cannot be told apart; quantize the float32 model again "
        f"(leanrnn.quantize(model, {precision!r}), or leanrnn convert --precision {precision}): "
        "bf16 rounding is exact, so it is the same model"
    )


def _packed_from_bytes(spec: RNNSpec, dtype, precision: str, buffer,
                       bf16_layout: str | None = None) -> PackedWeights:  # fmt: skip
    """``PackedWeights.__reduce__``'s inverse: the weights laid out anew, ``buffer`` copied in.
    Pickles of bf16 weights from before their panels held input pairs (no ``bf16_layout``) are
    refused (unmarked_bf16); int8-dynamic panels get their DOT_NARROW flags from their codes
    (formats.quantize.set_narrow_flags)."""
    if panel_format(precision) == "bf16" and bf16_layout != "pairs":
        raise WeightsError(f"[PackedWeights] a pickle of {unmarked_bf16(precision)}")
    pw = PackedWeights(spec, dtype, zero=False, precision=precision)
    src = np.frombuffer(memoryview(buffer).cast("B"), np.uint8)
    if src.size != pw.nbytes:
        raise WeightsError(f"[PackedWeights] {src.size} bytes for a layout of {pw.nbytes}; "
                           "expected the bytes of PackedWeights.buffer for this spec")  # fmt: skip
    pw.buffer[:] = src
    if precision == "int8-dynamic":  # pickles from before the flag, or edited ones
        from .quantize import set_narrow_flags

        set_narrow_flags(pw)
    return pw


def panel_shape(X: int, Wd: int, precision: str) -> tuple[int, int]:
    """One panel's [rows, columns] for X (padded) inputs and Wd outputs: float [X, Wd]; bf16 2
    inputs per row (formats.quantize.bf16_panel); int8 SCALE_ROWS more rows (the column
    scales); int8-dynamic 4 inputs per row, 4 bytes per column, then DOT_TAIL_ROWS rows of
    scales and corrections (kernels._qdot)."""
    precision = panel_format(precision)
    if precision == "bf16":
        return X // 2, 2 * Wd
    if precision == "int8":
        return X + SCALE_ROWS, Wd
    if precision == "int8-dynamic":
        return X // 4 + DOT_TAIL_ROWS, 4 * Wd
    return X, Wd


def check_precision(precision, dtype: np.dtype, op: str) -> None:
    """A known precision, and float32 working dtype for the reduced ones."""
    if precision not in PRECISIONS:
        raise DTypeError(f"[{op}] precision {precision!r}; expected one of "
                         f"{', '.join(map(repr, PRECISIONS))}")  # fmt: skip
    if precision != "float" and dtype != np.float32:
        raise DTypeError(f"[{op}] {precision} weights with {dtype} activations; reduced "
                         "precision runs float32 activations: convert the model to float32 "
                         "first (model.astype(np.float32))")  # fmt: skip


def tensor_dtype(name: str, dtype: np.dtype, precision: str) -> np.dtype:
    """The dtype of packed tensor ``name`` (short name, e.g. "Rt") for ``precision``."""
    return PANEL_DTYPES[precision] if precision != "float" and name in _PANELS else dtype


def _chunks(seq: list, n: int) -> list[list]:
    return [seq[i : i + n] for i in range(0, len(seq), n)]


def rows_to_panels(src: np.ndarray, perm: np.ndarray, panels: np.ndarray) -> None:
    """panels [U, X, Wd] <- the rows of src [R, C] (C <= X) in packed order: row j of block u
    is src[perm[u*Wd + j]] (zeros where perm < 0 and in columns C..X-1). One block at a time:
    a [U*Wd, X] dense staging copy made a load's peak 1.5x its weights."""
    U, X, Wd = panels.shape
    C = src.shape[1]
    for u in range(U):
        p = perm[u * Wd : (u + 1) * Wd]
        dst = panels[u]  # [X, Wd]
        if (p >= 0).all():
            dst[:C] = src[p].T
        else:
            ok = p >= 0
            dst[:C] = 0
            dst[:C, ok] = src[p[ok]].T
        dst[C:] = 0


def from_panels(panels: np.ndarray) -> np.ndarray:
    """Panels [U, X, Wd] -> dense rows [U*Wd, X] in packed row order (a copy)."""
    U, X, Wd = panels.shape
    return panels.transpose(0, 2, 1).reshape(U * Wd, X)


def _check(name: str, a, shape: tuple[int, ...]) -> np.ndarray:
    arr = np.asarray(a)
    if arr.shape != shape:
        raise WeightsError(f"[pack] {name} has shape {arr.shape}; expected {shape}")
    if not np.issubdtype(arr.dtype, np.floating):
        raise DTypeError(f"[pack] {name} has dtype {arr.dtype}; expected a float array")
    return arr


def fold_biases(spec: RNNSpec, pl: PackedLayer) -> None:
    """b and rb from bW and bR (at packing, and again whenever training changed them), in the
    working precision, so b == bW + bR exactly as the kernels would add them. GRU with
    linear_before_reset keeps bR of its n gate apart in rb (the reset gate multiplies it)."""
    pl.b[:] = pl.bW + pl.bR
    pl.rb[:] = 0
    if spec.cell == "gru" and spec.linear_before_reset:
        n_rows = (np.arange(pl.b.shape[0]) // B) % 3 == 2  # packed rows of the n gate
        pl.rb[n_rows] = pl.bR[n_rows]
        pl.b[n_rows] = pl.bW[n_rows]


def pack(spec: RNNSpec, layers: list[list[LayerWeights]], dtype=np.float32) -> PackedWeights:
    """Pack canonical weights (validated against ``spec``) into the kernel layout."""
    if not isinstance(spec, RNNSpec):
        raise WeightsError(f"[pack] spec is a {type(spec).__name__}; expected an RNNSpec "
                           "(RNNSpec.from_dict reads a dict)")  # fmt: skip
    if not isinstance(layers, list | tuple) or not all(
        isinstance(d, list | tuple) and all(isinstance(lw, LayerWeights) for lw in d)
        for d in layers
    ):
        raise WeightsError("[pack] layers must be a list (per layer) of lists (per direction) "
                           "of LayerWeights")  # fmt: skip
    if len(layers) != spec.num_layers or any(len(d) != spec.num_directions for d in layers):
        raise WeightsError(
            f"[pack] got {[len(d) for d in layers]} (layers x directions); expected "
            f"{spec.num_layers} layer(s) of {spec.num_directions} direction(s)"
        )
    pw = PackedWeights(spec, dtype)
    H, K, P, G = spec.hidden_size, spec.output_size, spec.proj_size, spec.gate_width
    valid = pw.perm >= 0
    rows = pw.perm[valid]
    for li, dirs in enumerate(layers):
        C = spec.layer_input_size(li)
        for di, lw in enumerate(dirs):
            tag = f"layer {li} direction {di}"
            W = _check(f"{tag} W", lw.W, (G, C))
            R = _check(f"{tag} R", lw.R, (G, K))
            bW = _check(f"{tag} bW", lw.bW, (G,))
            bR = _check(f"{tag} bR", lw.bR, (G,))
            # weights the spec says are not there: packed, they ran (nonzero biases of a
            # bias=False spec) or were dropped (peepholes, a projection), either way unseen
            if not spec.bias and (bW.any() or bR.any()):
                raise WeightsError(f"[pack] {tag}: the spec has bias=False but the biases are "
                                   "not zero; pass zeros, or a spec with bias=True")  # fmt: skip
            if lw.peep is not None and not spec.peepholes:
                raise WeightsError(f"[pack] {tag}: peepholes given for a spec without them "
                                   "(peepholes=False)")  # fmt: skip
            if lw.proj is not None and not P:
                raise WeightsError(f"[pack] {tag}: a projection given for a spec without one "
                                   "(proj_size=0)")  # fmt: skip
            pl = pw.layers[li][di]
            rows_to_panels(W, pw.perm, pl.Wt)
            rows_to_panels(R, pw.perm, pl.Rt)
            pl.bW[valid] = bW[rows]
            pl.bR[valid] = bR[rows]
            fold_biases(spec, pl)
            if spec.peepholes:
                if lw.peep is None:
                    raise WeightsError(f"[pack] {tag}: spec has peepholes but peep is None")
                pl.peep[:, :H] = _check(f"{tag} peep", lw.peep, (3, H))
            if P:
                if lw.proj is None:
                    raise WeightsError(f"[pack] {tag}: spec has proj_size={P} but proj is None")
                prow = np.arange(pw.Pp)
                rows_to_panels(_check(f"{tag} proj", lw.proj, (P, H)),
                               np.where(prow < P, prow, -1), pl.proj)  # fmt: skip
    return pw


# ---- gate-order conversions: every importer names its source order explicitly ----

# Row blocks of the source order, listed in internal order (see spec.GATES).
TORCH_ORDER = {"lstm": (0, 1, 2, 3), "gru": (1, 0, 2), "rnn": (0,)}  # torch GRU is (r, z, n)
ONNX_ORDER = {"lstm": (0, 2, 3, 1), "gru": (0, 1, 2), "rnn": (0,)}  # ONNX LSTM is (i, o, f, c)
ONNX_PEEP_ORDER = (0, 2, 1)  # ONNX P is (i, o, f); internal (i, f, o)


def reorder_gates(a: np.ndarray, order: tuple[int, ...], H: int) -> np.ndarray:
    """Rows grouped in gate blocks of H, source order -> internal order (``order[k]`` = source
    block holding internal gate k). Works for [G, X] matrices and [G] vectors."""
    return np.concatenate([a[k * H : (k + 1) * H] for k in order], axis=0)

"""The fused default-activation cell updates for one unit block (B = 16 units of one sample).

float32 is emitted as explicit 16-lane vector IR (one AVX-512 register per gate, two AVX2 or four
NEON ones): LLVM's loop vectorizer turned out to be fragile on these 16-iteration loops — a change
in the loop nest around them, or compiling them as functions of their own, and it left them
scalar (5 scalar divides per unit; 1.5x slower per step at H=128, N=1). float64 is plain loops
over libm (tanh, exp), so it stays within 1e-10 of PyTorch's double path.

Each update reads and writes B consecutive elements of a row: ``(array, row, col)`` names the
first one. The math (PyTorch's, ONNX's default activations; flush() as in _math):

    lstm_update:  i, f, g, o = sig(gates + xw)[0:B], sig(..)[B:2B], tanh(..)[2B:3B], sig(..)[3B:4B]
                  c = flush(f*c + i*g);  h = flush(o * tanh(c))           (c in place)
    gru_update:   z, r = sig(gates + xw)[0:B], sig(..)[B:2B]
                  n = tanh(xw[2B:3B] + r * (gates[2B:3B] + rb[2B:3B]))    (linear_before_reset)
                  h_new = flush((1 - z)*n + z*h_prev)
    (lstm_update_keep / gru_update_keep also leave the activated gates in xw's row, for
    training's backward)
    rnn_update:   h_new = flush(tanh(gates + xw))

No argument may alias another, except that the rows read may be anywhere (they are loaded before
anything is stored).
"""

from __future__ import annotations

from llvmlite import ir
from numba import types
from numba.core import cgutils
from numba.extending import intrinsic, overload

from ._math import TANH_CLAMP, TANH_P, TANH_Q, flush, sigmoid_, tanh_
from .abi import B

_F32 = types.float32


class _Vec:
    """Builds 16-lane float32 vector math at one IR builder."""

    def __init__(self, context, builder, sig, args):
        self.b = builder
        self.context, self.sig, self.args = context, sig, args
        self.vt = ir.VectorType(ir.FloatType(), B)
        mod = builder.module
        self._fma = cgutils.get_or_insert_function(
            mod, ir.FunctionType(self.vt, [self.vt] * 3), "llvm.fma.v16f32"
        )
        self._fabs = cgutils.get_or_insert_function(
            mod, ir.FunctionType(self.vt, [self.vt]), "llvm.fabs.v16f32"
        )

    def const(self, v: float):
        return ir.Constant(self.vt, [float(v)] * B)

    def splat(self, x):
        i32 = ir.IntType(32)
        undef = ir.Constant(self.vt, ir.Undefined)
        xv = self.b.insert_element(undef, x, ir.Constant(i32, 0))
        return self.b.shuffle_vector(xv, undef, ir.Constant(ir.VectorType(i32, B), [0] * B))

    def ptr(self, a: int):
        """Pointer to (array a, row a+1, col a+2) of the intrinsic's arguments."""
        arr_t = self.sig.args[a]
        arr = cgutils.create_struct_proxy(arr_t)(self.context, self.b, value=self.args[a])
        stride0 = self.b.extract_value(arr.strides, 0)  # bytes
        byte = self.b.add(
            self.b.mul(self.args[a + 1], stride0),
            self.b.mul(self.args[a + 2], ir.Constant(stride0.type, 4)),
        )
        base = self.b.ptrtoint(arr.data, byte.type)
        return self.b.inttoptr(self.b.add(base, byte), self.vt.as_pointer())

    def load(self, a: int, k: int = 0):
        """The k-th group of B elements from (array, row, col) argument a."""
        p = self.ptr(a)
        if k:
            p = self.b.gep(p, [ir.Constant(ir.IntType(64), k)])
        return self.b.load(p, align=4)

    def store(self, v, a: int, k: int = 0) -> None:
        """Store v as the k-th group of B elements at (array, row, col) argument a."""
        p = self.ptr(a)
        if k:
            p = self.b.gep(p, [ir.Constant(ir.IntType(64), k)])
        self.b.store(v, p, align=4)

    def add(self, x, y):
        return self.b.fadd(x, y)

    def mul(self, x, y):
        return self.b.fmul(x, y)

    def fma(self, x, y, z):
        return self.b.call(self._fma, [x, y, z])

    def fence(self, x):
        """x behind llvm.arithmetic.fence: the kernels compile with reassoc/contract, and LLVM
        rewrites an expression by how many uses its parts have; a gate the training forward
        also stores has one use more than in inference, and without the fence the two got
        different bits (the fence costs no instruction)."""
        fence = cgutils.get_or_insert_function(
            self.b.module, ir.FunctionType(self.vt, [self.vt]), "llvm.arithmetic.fence.v16f32"
        )
        return self.b.call(fence, [x])

    def tanh(self, x):
        """The rational tanh of _math, lane-wise, its input and result clamped by compares (NaN
        passes through)."""
        hi, lo = self.const(TANH_CLAMP), self.const(-TANH_CLAMP)
        a = self.b.select(self.b.fcmp_ordered(">", x, hi), hi, x)
        v = self.b.select(self.b.fcmp_ordered("<", a, lo), lo, a)
        x2 = self.mul(v, v)
        p = self.const(TANH_P[0])
        for c in TANH_P[1:]:
            p = self.fma(p, x2, self.const(c))
        q = self.const(TANH_Q[0])
        for c in TANH_Q[1:]:
            q = self.fma(q, x2, self.const(c))
        r = self.b.fdiv(self.mul(p, v), q)
        one, minus_one = self.const(1.0), self.const(-1.0)
        r = self.b.select(self.b.fcmp_ordered(">", r, one), one, r)
        return self.b.select(self.b.fcmp_ordered("<", r, minus_one), minus_one, r)

    def sigmoid(self, x):
        half = self.const(0.5)
        return self.fma(half, self.tanh(self.mul(half, x)), half)

    def flush(self, v, tiny):
        small = self.b.fcmp_ordered("<", self.b.call(self._fabs, [v]), tiny)
        return self.b.select(small, self.const(0.0), v)


@intrinsic
def fence_(typingctx, x):
    """The scalar x behind llvm.arithmetic.fence (see _Vec.fence), for the float64 loops."""
    if not isinstance(x, types.Float):
        return None

    def gen(context, builder, sig, args):
        t = context.get_value_type(sig.args[0])
        name = f"llvm.arithmetic.fence.f{sig.args[0].bitwidth}"
        fence = cgutils.get_or_insert_function(builder.module, ir.FunctionType(t, [t]), name)
        return builder.call(fence, args)

    return x(x), gen


def _f32_arrays(*arrays) -> bool:
    return all(isinstance(a, types.Array) and a.dtype == _F32 and a.ndim == 2 for a in arrays)


# ----------------------------------------------------------------------------------- LSTM
def lstm_update(gates, gr, gc, xw, xr, xc, c, cr, cc, h, hr, hc, tiny):  # pragma: no cover
    raise NotImplementedError("numba-only")


def lstm_update_keep(gates, gr, gc, xw, xr, xc, c, cr, cc, h, hr, hc, tiny):  # pragma: no cover
    """lstm_update that also leaves the activated gates i, f, g, o in xw's row (training keeps
    them for backward, which then needs no activation function but tanh(c): it recomputed
    eight per unit and step from the pre-activations, over half of its time at H=128): the
    same bits as lstm_update, one vector store per gate more."""
    raise NotImplementedError("numba-only")


def _lstm_gen(keep: bool):
    def gen(context, builder, sig, args):
        v = _Vec(context, builder, sig, args)
        pre = [v.add(v.load(0, k), v.load(3, k)) for k in range(4)]
        acts = (v.sigmoid(pre[0]), v.sigmoid(pre[1]), v.tanh(pre[2]), v.sigmoid(pre[3]))
        ig, fg, gg, og = (v.fence(a) for a in acts)  # the same bits with keep and without
        if keep:
            for k, act in enumerate((ig, fg, gg, og)):
                v.store(act, 3, k)
        tiny_v = v.splat(args[12])
        cnew = v.flush(v.fma(fg, v.load(6), v.mul(ig, gg)), tiny_v)
        v.store(cnew, 6)
        v.store(v.flush(v.mul(og, v.tanh(cnew)), tiny_v), 9)
        return context.get_dummy_value()

    return gen


def _lstm_sig(gates, xw, c, h, tiny):
    i = types.intp
    return types.void(gates, i, i, xw, i, i, c, i, i, h, i, i, tiny)


@intrinsic
def _lstm_f32(typingctx, gates, gr, gc, xw, xr, xc, c, cr, cc, h, hr, hc, tiny):
    if not _f32_arrays(gates, xw, c, h):
        return None
    return _lstm_sig(gates, xw, c, h, tiny), _lstm_gen(False)


@intrinsic
def _lstm_keep_f32(typingctx, gates, gr, gc, xw, xr, xc, c, cr, cc, h, hr, hc, tiny):
    if not _f32_arrays(gates, xw, c, h):
        return None
    return _lstm_sig(gates, xw, c, h, tiny), _lstm_gen(True)


def _lstm_loop(keep: bool):
    def loop(gates, gr, gc, xw, xr, xc, c, cr, cc, h, hr, hc, tiny):
        zero = tiny - tiny
        for j in range(B):
            pi = gates[gr, gc + j] + xw[xr, xc + j]
            pf = gates[gr, gc + B + j] + xw[xr, xc + B + j]
            pg = gates[gr, gc + 2 * B + j] + xw[xr, xc + 2 * B + j]
            po = gates[gr, gc + 3 * B + j] + xw[xr, xc + 3 * B + j]
            i_, f_ = fence_(sigmoid_(pi)), fence_(sigmoid_(pf))  # see _Vec.fence
            g_, o_ = fence_(tanh_(pg)), fence_(sigmoid_(po))
            if keep:
                xw[xr, xc + j] = i_
                xw[xr, xc + B + j] = f_
                xw[xr, xc + 2 * B + j] = g_
                xw[xr, xc + 3 * B + j] = o_
            cv = flush(f_ * c[cr, cc + j] + i_ * g_, tiny, zero)
            c[cr, cc + j] = cv
            h[hr, hc + j] = flush(o_ * tanh_(cv), tiny, zero)

    return loop


def _lstm_ov(keep: bool):
    """lstm_update's (keep: lstm_update_keep's) overload: the vector IR for float32, else the
    loop."""
    vector = _lstm_keep_f32 if keep else _lstm_f32

    def ov(gates, gr, gc, xw, xr, xc, c, cr, cc, h, hr, hc, tiny):
        if _f32_arrays(gates, xw, c, h):
            return lambda gates, gr, gc, xw, xr, xc, c, cr, cc, h, hr, hc, tiny: vector(
                gates, gr, gc, xw, xr, xc, c, cr, cc, h, hr, hc, tiny
            )
        return _lstm_loop(keep)

    return ov


overload(lstm_update, inline="always")(_lstm_ov(False))
overload(lstm_update_keep, inline="always")(_lstm_ov(True))


# ------------------------------------------------------------------------------------ GRU
def gru_update(gates, gr, gc, xw, xr, xc, rb, hp, pr, pc, hn, nr, nc, tiny):  # pragma: no cover
    raise NotImplementedError("numba-only")


def gru_update_keep(
    gates, gr, gc, xw, xr, xc, rb, hp, pr, pc, hn, nr, nc, tiny
):  # pragma: no cover
    """gru_update that also leaves z, r and n in xw's row (training keeps them for backward,
    which then needs no activation function at all): the same bits as gru_update."""
    raise NotImplementedError("numba-only")


def _gru_gen(keep: bool):
    def gen(context, builder, sig, args):
        v = _Vec(context, builder, sig, args)
        z = v.fence(v.sigmoid(v.add(v.load(0, 0), v.load(3, 0))))  # fenced: see _Vec.fence
        r = v.fence(v.sigmoid(v.add(v.load(0, 1), v.load(3, 1))))
        # rb is 1-D: its block starts at gate column gc (the same columns as the gates row)
        rb_t = sig.args[6]
        rba = cgutils.create_struct_proxy(rb_t)(context, builder, value=args[6])
        rbp = builder.gep(rba.data, [builder.add(args[2], ir.Constant(args[2].type, 2 * B))])
        rbv = builder.load(builder.bitcast(rbp, v.vt.as_pointer()), align=4)
        n = v.fence(v.tanh(v.fma(r, v.add(v.load(0, 2), rbv), v.load(3, 2))))
        hprev = v.load(7)
        # (1 - z)*n + z*h = n + z*(h - n)
        hnew = v.fma(z, v.b.fsub(hprev, n), n)
        v.store(v.flush(hnew, v.splat(args[13])), 10)
        if keep:  # after n: the row's n slot is n's input
            for k, act in enumerate((z, r, n)):
                v.store(act, 3, k)
        return context.get_dummy_value()

    return gen


def _gru_types(gates, xw, hp, hn, rb):
    return _f32_arrays(gates, xw, hp, hn) and (
        isinstance(rb, types.Array) and rb.dtype == _F32 and rb.ndim == 1
    )


def _gru_sig(gates, xw, rb, hp, hn, tiny):
    i = types.intp
    return types.void(gates, i, i, xw, i, i, rb, hp, i, i, hn, i, i, tiny)


@intrinsic
def _gru_f32(typingctx, gates, gr, gc, xw, xr, xc, rb, hp, pr, pc, hn, nr, nc, tiny):
    if not _gru_types(gates, xw, hp, hn, rb):
        return None
    return _gru_sig(gates, xw, rb, hp, hn, tiny), _gru_gen(False)


@intrinsic
def _gru_keep_f32(typingctx, gates, gr, gc, xw, xr, xc, rb, hp, pr, pc, hn, nr, nc, tiny):
    if not _gru_types(gates, xw, hp, hn, rb):
        return None
    return _gru_sig(gates, xw, rb, hp, hn, tiny), _gru_gen(True)


def _gru_loop(keep: bool):
    def loop(gates, gr, gc, xw, xr, xc, rb, hp, pr, pc, hn, nr, nc, tiny):
        zero = tiny - tiny
        one = zero + 1
        for j in range(B):
            z = fence_(sigmoid_(gates[gr, gc + j] + xw[xr, xc + j]))  # see _Vec.fence
            r = fence_(sigmoid_(gates[gr, gc + B + j] + xw[xr, xc + B + j]))
            m = 2 * B + j
            n = fence_(tanh_(xw[xr, xc + m] + r * (gates[gr, gc + m] + rb[gc + m])))
            hn[nr, nc + j] = flush((one - z) * n + z * hp[pr, pc + j], tiny, zero)
            if keep:
                xw[xr, xc + j] = z
                xw[xr, xc + B + j] = r
                xw[xr, xc + m] = n

    return loop


def _gru_ov(keep: bool):
    """gru_update's (keep: gru_update_keep's) overload, as _lstm_ov."""
    vector = _gru_keep_f32 if keep else _gru_f32

    def ov(gates, gr, gc, xw, xr, xc, rb, hp, pr, pc, hn, nr, nc, tiny):
        if _f32_arrays(gates, xw, hp, hn):
            return lambda gates, gr, gc, xw, xr, xc, rb, hp, pr, pc, hn, nr, nc, tiny: vector(
                gates, gr, gc, xw, xr, xc, rb, hp, pr, pc, hn, nr, nc, tiny
            )
        return _gru_loop(keep)

    return ov


overload(gru_update, inline="always")(_gru_ov(False))
overload(gru_update_keep, inline="always")(_gru_ov(True))


# ------------------------------------------------------------------------------------ RNN
def rnn_update(gates, gr, gc, xw, xr, xc, hn, nr, nc, tiny):  # pragma: no cover
    raise NotImplementedError("numba-only")


@intrinsic
def _rnn_f32(typingctx, gates, gr, gc, xw, xr, xc, hn, nr, nc, tiny):
    if not _f32_arrays(gates, xw, hn):
        return None
    i = types.intp

    def gen(context, builder, sig, args):
        v = _Vec(context, builder, sig, args)
        hnew = v.tanh(v.add(v.load(0), v.load(3)))
        v.store(v.flush(hnew, v.splat(args[9])), 6)
        return context.get_dummy_value()

    return types.void(gates, i, i, xw, i, i, hn, i, i, tiny), gen


@overload(rnn_update, inline="always")
def _rnn_ov(gates, gr, gc, xw, xr, xc, hn, nr, nc, tiny):
    if _f32_arrays(gates, xw, hn):
        return lambda gates, gr, gc, xw, xr, xc, hn, nr, nc, tiny: _rnn_f32(
            gates, gr, gc, xw, xr, xc, hn, nr, nc, tiny
        )

    def loop(gates, gr, gc, xw, xr, xc, hn, nr, nc, tiny):
        zero = tiny - tiny
        for j in range(B):
            hn[nr, nc + j] = flush(tanh_(gates[gr, gc + j] + xw[xr, xc + j]), tiny, zero)

    return loop


# ------------------------------------------------------------------ copies of a block
# float32 as one vector op: as 16-iteration loops LLVM left them 16 scalar loads and stores,
# each reloading the arrays' strides from the stack (it cannot tell the arrays apart): 9% of
# the LSTM's backward step loop at H=128 (dh + dy), 3% of a bf16-act forward step (h into y).


def block_add(out, orow, ocol, a, ar, ac, b, br, bc):  # pragma: no cover
    """out[orow, ocol:+B] = a[ar, ac:+B] + b[br, bc:+B]."""
    raise NotImplementedError("numba-only")


def block_copy(out, orow, ocol, a, ar, ac):  # pragma: no cover
    """out[orow, ocol:+B] = a[ar, ac:+B]."""
    raise NotImplementedError("numba-only")


@intrinsic
def _block_add_f32(typingctx, out, orow, ocol, a, ar, ac, b, br, bc):
    if not _f32_arrays(out, a, b):
        return None
    i = types.intp

    def gen(context, builder, sig, args):
        v = _Vec(context, builder, sig, args)
        v.store(v.add(v.load(3), v.load(6)), 0)
        return context.get_dummy_value()

    return types.void(out, i, i, a, i, i, b, i, i), gen


@intrinsic
def _block_copy_f32(typingctx, out, orow, ocol, a, ar, ac):
    if not _f32_arrays(out, a):
        return None
    i = types.intp

    def gen(context, builder, sig, args):
        v = _Vec(context, builder, sig, args)
        v.store(v.load(3), 0)
        return context.get_dummy_value()

    return types.void(out, i, i, a, i, i), gen


@overload(block_add, inline="always")
def _block_add_ov(out, orow, ocol, a, ar, ac, b, br, bc):
    if _f32_arrays(out, a, b):
        return lambda out, orow, ocol, a, ar, ac, b, br, bc: _block_add_f32(
            out, orow, ocol, a, ar, ac, b, br, bc)  # fmt: skip

    def loop(out, orow, ocol, a, ar, ac, b, br, bc):
        for j in range(B):
            out[orow, ocol + j] = a[ar, ac + j] + b[br, bc + j]

    return loop


@overload(block_copy, inline="always")
def _block_copy_ov(out, orow, ocol, a, ar, ac):
    if _f32_arrays(out, a):
        return lambda out, orow, ocol, a, ar, ac: _block_copy_f32(out, orow, ocol, a, ar, ac)

    def loop(out, orow, ocol, a, ar, ac):
        for j in range(B):
            out[orow, ocol + j] = a[ar, ac + j]

    return loop

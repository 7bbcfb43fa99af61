"""Optimizers and gradient clipping for numpy-only training: torch.optim's SGD, Adam and AdamW and
torch.nn.utils' clip_grad_norm_/clip_grad_value_, with torch's defaults and update order, updating
each parameter's array in place.

Why in place, on flat arrays: the training session hands out its packed weight buffer as views
(`Parameter.value`) and a gradient buffer of the same layout (`Parameter.grad`), so an optimizer
step must write into those very arrays; nothing is repacked. The packed layout has padding
entries, whose weight and gradient are zero; every update below maps (value 0, grad 0) to 0 with
all-zero state (SGD: 0 - lr*0; Adam: m = v = 0, so 0/(0 + eps) = 0, and with eps = 0 an entry
whose denominator is 0 is not moved; AdamW's decay 0*(1 - lr*wd) = 0), so padding stays zero
under every optimizer. `Parameter.version` counts the steps that
wrote a value (torch's `_version`), so the session knows to refresh what it derived from them.

The math, written once (theta value, g gradient, lr, wd weight decay, t step count from 1):

SGD(lr, momentum mu, dampening tau, wd, nesterov, maximize)::

    g <- (-g if maximize else g) + wd * theta
    if mu != 0:
        b <- g on the first step, else b <- mu * b + (1 - tau) * g
        g <- g + mu * b if nesterov else b
    theta <- theta - lr * g

Adam / AdamW(lr, betas (b1, b2), eps, wd, amsgrad, maximize)::

    g <- -g if maximize else g
    AdamW: theta <- theta * (1 - lr * wd)         Adam: g <- g + wd * theta
    m <- m + (1 - b1) * (g - m)                    (torch's lerp; m, v start at 0)
    v <- b2 * v + (1 - b2) * g * g
    vmax <- max(vmax, v) if amsgrad                (then used in place of v below)
    theta <- theta - lr / (1 - b1**t) * m / (sqrt(v) / sqrt(1 - b2**t) + eps)

Each operation runs in the parameter's own dtype with the scalars cast to it, in torch's order
(so float64 matches torch to ~1e-15 and float32 to a few ulps; torch's vectorised kernels fuse
some multiply-adds, numpy cannot). Every buffer (momentum, m, v, vmax and two scratch arrays
shared by all parameters of one dtype) is allocated on the first step; later steps run numpy
ufuncs with ``out=`` only and allocate nothing but Python scalars. Memory beyond the weights
and gradients: SGD one momentum buffer per parameter, Adam two (three with amsgrad), plus the
scratch, two arrays the size of the largest parameter. numpy rather than numba: leanrnn's numba
kernels are compiled ahead of time in kernels/ and the running process never loads numba; a
fused elementwise kernel there would make one pass instead of ~12 and need no scratch (torch's
fused CPU Adam is ~10x faster than this one and than its own single-tensor path).

Example::

    import numpy as np
    from leanrnn.train.optim import Adam, Parameter, clip_grad_norm

    w = Parameter(np.zeros(4, np.float32), name="w")
    opt = Adam([w], lr=1e-2)
    w.grad[...] = [1, -2, 3, -4]     # backward accumulates into w.grad
    clip_grad_norm([w], max_norm=1.0)
    opt.step()                      # w.value updated in place
    opt.zero_grad()
"""

from __future__ import annotations

import contextlib
import itertools
import math
from collections.abc import Iterable, MutableMapping
from typing import Any, ClassVar

import numpy as np

from leanrnn.engine import _check
from leanrnn.errors import (
    DTypeError,
    LayoutError,
    LeanRNNError,
    NonFiniteError,
    ShapeError,
    SpecError,
)

_FLOATS = (np.dtype(np.float32), np.dtype(np.float64))


def _check_array(where: str, what: str, a: Any) -> np.ndarray:
    if not isinstance(a, np.ndarray) or isinstance(a, np.ma.MaskedArray):
        raise DTypeError(
            f"[{where}] {what} is a {type(a).__name__}; expected a numpy array of "
            "float32 or float64"
        )
    if a.dtype not in _FLOATS:
        raise DTypeError(
            f"[{where}] {what} has dtype {a.dtype}; expected float32 or float64; "
            "convert it with .astype(np.float32)"
        )
    if not a.flags.c_contiguous:
        raise LayoutError(
            f"[{where}] {what} with shape {a.shape} is not C-contiguous; expected "
            "a contiguous array (the optimizer updates it in place); pass "
            "np.ascontiguousarray(...) and keep a reference to it"
        )
    if not a.flags.writeable:
        raise LayoutError(
            f"[{where}] {what} is read-only; expected a writeable array (it is updated in place)"
        )
    return a


def read_only(a: np.ndarray) -> np.ndarray:
    """A read-only view of ``a``: what a caller may read but must not write, because it is
    state leanrnn derives from (numpy has no version counter to notice a write)."""
    v = a.view()
    v.flags.writeable = False
    return v


def _span(a: np.ndarray) -> tuple[int, int]:
    start = a.__array_interface__["data"][0]
    return start, start + a.nbytes


class Parameter:
    """One trainable array and the gradient that backward accumulates into.

    value: [any shape] float32/float64, C-contiguous; read here as a read-only view. Optimizers
        update it in place, and so may a caller, through ``edit()`` (rebinding it is not
        allowed: the owner holds views of it).
    grad: [value.shape] value.dtype; gradients accumulate into it (zeros when not given); may
        be replaced by another array of the same shape and dtype, never aliasing value. A
        Trainer's parameter's grad is a view of the trainer's own buffer (backward writes
        there): assigning ``p.grad = g`` copies g into it, and the next step uses it.
    name: a label used in error messages.
    logical_shape: the shape the array stands for (a Trainer's packed panels: torch's
        ``weight_ih_l0`` shape, etc.; default ``value.shape``): an optimizer's state dict
        carries them, so that one of another model whose panels pack to the same array shape
        (LSTM H=6 and H=7 both fill 16-unit panels) is refused rather than loaded.
    version: incremented by every optimizer step and ``edit()`` that writes value, so the owner
        can tell the weights changed and refresh what it derived from them (torch's
        ``_version``, which torch bumps on any in-place write; numpy cannot see one, hence the
        read-only view: ``p.value -= lr * p.grad`` left a Trainer on the old folded biases
        and dense copies, its outputs and gradients those of a mix of old and new weights).
    """

    __slots__ = ("_grad", "_orphan", "_owner", "_stale", "_value", "logical_shape", "name",
                 "version")  # fmt: skip

    def __init__(self, value: np.ndarray, grad: np.ndarray | None = None, name: str = "",
                 logical_shape: tuple[int, ...] | None = None) -> None:  # fmt: skip
        self.name = str(name)
        self._value = _check_array("Parameter", f"value of {self._label()}", value)
        self.logical_shape = tuple(value.shape if logical_shape is None else logical_shape)
        self.version = 0
        self._owner = None  # weakref.ref to what derives state from value (a Trainer), or None
        self._orphan = False  # a copy of an owned parameter that no owner has adopted
        # An owned parameter zeroed with no backward since: torch's gradient would be None
        # (zero_grad sets it so), and its optimizers skip such a parameter; a step on the
        # zeros would still apply momentum and weight decay (SGD moved a weight by 0.59)
        self._stale = False
        self._grad = np.zeros_like(value) if grad is None else self._checked_grad(grad)

    def __getstate__(self) -> dict:
        # a copy or a pickle has no owner until one adopts it (Trainer.__setstate__)
        state = {k: getattr(self, k) for k in ("_grad", "_value", "name", "version",
                                               "logical_shape")}  # fmt: skip
        state["owned"] = self._owner is not None or self._orphan
        return state

    def __setstate__(self, state: dict) -> None:
        state = dict(state)
        self._orphan = bool(state.pop("owned", False))
        for k, v in state.items():
            object.__setattr__(self, k, v)
        self._owner = None
        self._stale = False
        if "logical_shape" not in state:  # pickled before it existed
            self.logical_shape = tuple(self._value.shape)

    def _label(self) -> str:
        return f"parameter {self.name!r}" if self.name else "parameter"

    def _checked_grad(self, grad: Any) -> np.ndarray:
        v = self._value
        if isinstance(grad, np.ndarray) and grad.shape != v.shape:
            raise ShapeError(
                f"[Parameter] grad of {self._label()} has shape {grad.shape}; "
                f"expected {v.shape}, the shape of its value"
            )
        if isinstance(grad, np.ndarray) and grad.dtype != v.dtype:
            raise DTypeError(
                f"[Parameter] grad of {self._label()} has dtype {grad.dtype}; "
                f"expected {v.dtype}, the dtype of its value"
            )
        _check_array("Parameter", f"grad of {self._label()}", grad)
        if v.size and np.may_share_memory(grad, v):  # exact: both contiguous
            raise LayoutError(
                f"[Parameter] grad of {self._label()} shares memory with its "
                "value; expected a separate gradient buffer"
            )
        return grad

    @property
    def value(self) -> np.ndarray:
        """The array, read-only (write it with ``edit()``)."""
        return read_only(self._value)

    @contextlib.contextmanager
    def edit(self):
        """The array, writeable, for an update by hand; on leaving, ``version`` is bumped and
        the owner (a Trainer) refreshes what it derived from the weights, as after an
        optimizer step::

            with p.edit() as v:
                v -= lr * p.grad
        """
        try:
            yield self._value
        finally:  # (an exception may come after some of the writes)
            self.version += 1
            owner = self._owner() if self._owner is not None else None
            if owner is not None:
                owner._check_weights()

    @property
    def grad(self) -> np.ndarray:
        return self._grad

    @grad.setter
    def grad(self, grad: np.ndarray) -> None:
        if self._owner is None:
            self._grad = self._checked_grad(grad)
            return
        # A trainer's parameter: backward accumulates into the trainer's gradient buffer, of
        # which _grad is a view, so a new array would never see a gradient (every step was
        # 0). The values are copied in, and the next step uses them, as after torch's
        # p.grad = g (also after zero_grad, which torch's None stands for).
        if grad is not self._grad:
            mine = self._grad
            fits = isinstance(grad, np.ndarray) and grad.shape == mine.shape
            if not fits or grad.dtype != mine.dtype:
                self._checked_grad(grad)  # (raises, naming what is wrong)
            mine[...] = grad
        self._stale = False

    @property
    def shape(self) -> tuple[int, ...]:
        return self._value.shape

    @property
    def dtype(self) -> np.dtype:
        return self._value.dtype

    def zero_grad(self, set_to_none: bool = True) -> None:
        """Set the gradient to zero in place (the buffer is caller-owned, never set to None).
        With ``set_to_none`` (torch's default), a trainer's parameter is then skipped by
        optimizer steps until a backward writes its gradient again, as torch skips a
        parameter whose grad zero_grad set to None; without it the next step applies to the
        zeros (momentum, weight decay), as torch's does. A parameter of your own keeps
        stepping on what you write into its gradient."""
        _bool("Parameter.zero_grad", "set_to_none", set_to_none)
        self._grad.fill(0)
        # (a gradient that is "None" already stays so: torch's zero_grad(set_to_none=False)
        # leaves a None grad None)
        self._stale = (set_to_none or self._stale) and self._owner is not None

    def __repr__(self) -> str:
        return (
            f"Parameter(name={self.name!r}, shape={self.shape}, dtype={self.dtype}, "
            f"version={self.version})"
        )


def _as_params(where: str, params: Any, *, allow_empty: bool) -> list[Parameter]:
    """The parameters as a list, checked: all Parameters, none overlapping in memory."""
    if isinstance(params, Parameter):
        params = [params]
    elif isinstance(params, (np.ndarray, str, bytes)) or not isinstance(params, Iterable):
        raise LeanRNNError(
            f"[{where}] params is a {type(params).__name__}; expected a "
            "Parameter or an iterable of Parameters (wrap arrays with "
            "leanrnn.train.Parameter(value, grad))"
        )
    params = list(params)
    for i, p in enumerate(params):
        if isinstance(p, dict) and "params" in p:  # torch's parameter groups
            raise LeanRNNError(
                f"[{where}] params[{i}] is a parameter group (a dict with 'params'); leanrnn "
                "optimizers have one group: make one optimizer per group, e.g. "
                "AdamW(weights, weight_decay=0.01) and AdamW(biases, weight_decay=0), and "
                "step both"
            )
        if not isinstance(p, Parameter):
            raise LeanRNNError(
                f"[{where}] params[{i}] is a {type(p).__name__}; expected a "
                "leanrnn.train.Parameter (wrap the array: Parameter(value, grad))"
            )
    if not params and not allow_empty:
        raise LeanRNNError(
            f"[{where}] got an empty parameter list; expected at least one Parameter"
        )
    # Two parameters over the same memory would be updated twice per step; one sorted sweep
    # over the byte ranges of every value and grad finds any overlap.
    spans = []
    for i, p in enumerate(params):
        for what, a in (("value", p.value), ("grad", p.grad)):
            if a.size:
                spans.append((*_span(a), f"params[{i}].{what} ({p.name or 'unnamed'})"))
    spans.sort()
    for (_, end, first), (start, _, second) in itertools.pairwise(spans):
        if start < end:
            raise LayoutError(
                f"[{where}] {second} overlaps {first} in memory; expected every "
                "parameter value and gradient in its own memory (pass each "
                "parameter once)"
            )
    return params


def _shape_lists(shapes: Any, n: int) -> list[list[int]] | None:
    """A state dict's ``shapes`` as n lists of ints, or None if it is not that."""
    if not isinstance(shapes, list | tuple) or len(shapes) != n:
        return None
    out = []
    for sh in shapes:
        if not isinstance(sh, list | tuple) or not all(
            isinstance(d, int | np.integer) and not isinstance(d, bool) for d in sh
        ):
            return None
        out.append([int(d) for d in sh])
    return out


# --- gradient clipping -------------------------------------------------------------------------


def _norm(g: np.ndarray, p: float) -> np.generic:
    """The p-norm of one gradient in its own dtype, as torch.linalg.vector_norm computes it.

    p = 2 and inf allocate nothing (a BLAS dot, two reductions); other p take a temporary the
    size of the gradient.
    """
    if g.size == 0:
        return g.dtype.type(0)
    if p == 2.0:
        flat = g.reshape(-1)
        return np.sqrt(np.dot(flat, flat))
    if p == math.inf:
        return np.maximum(g.max(), -g.min())  # NaN propagates, as in torch
    if p == 1.0:
        return np.abs(g).sum()
    return np.power(np.power(np.abs(g), p).sum(), 1.0 / p)


def _total_norm(norms: list[np.generic], p: float, dtype: np.dtype) -> np.generic:
    """The norm of the per-parameter norms (torch stacks them, then takes vector_norm)."""
    n = np.array(norms, dtype=dtype)
    if p == 2.0:
        return np.sqrt(np.dot(n, n))
    if p == math.inf:
        return n.max()
    if p == 1.0:
        return n.sum()
    return np.power(np.power(n, p).sum(), 1.0 / p)


def clip_grad_norm(
    params: Parameter | Iterable[Parameter],
    max_norm: float,
    norm_type: float = 2.0,
    error_if_nonfinite: bool = False,
) -> float:
    """Scale all gradients together so that their joint norm is at most ``max_norm``; return the
    joint norm before clipping. torch.nn.utils.clip_grad_norm_'s semantics:

        total = || (||g_1||_p, ..., ||g_k||_p) ||_p      (= the p-norm of all gradients as one)
        g_i  <- g_i * min(max_norm / (total + 1e-6), 1)  for every i, always multiplied in

    norms are taken in the gradients' dtype (the promoted one across dtypes). A NaN/inf
    total makes the factor NaN/0, so gradients become NaN, as torch's do; with
    ``error_if_nonfinite=True`` that raises instead and leaves the gradients unchanged.

    params: a Parameter or an iterable of them (their ``grad`` arrays are scaled in place).
    norm_type: p > 0, or ``inf`` for the max-abs norm. p = 2 and inf allocate nothing; other
        p take a temporary the size of the largest gradient.
    """
    where = "clip_grad_norm"
    params = _as_params(where, params, allow_empty=True)
    max_norm = _float(where, "max_norm", max_norm, lo=0.0, allow_inf=True)
    p = _float(
        where,
        "norm_type",
        norm_type,
        lo=0.0,
        lo_open=True,
        allow_inf=True,
        hint="a float > 0, or inf for the max-abs norm (torch's 0 and -inf are not supported)",
    )
    if not params:
        return 0.0
    grads = [q.grad for q in params]
    dtype = np.result_type(*grads)
    norms = [_norm(g, p) for g in grads]
    total = _total_norm(norms, p, dtype)
    if error_if_nonfinite and not np.isfinite(total):
        bad = [
            q.name or f"params[{i}]"
            for i, (q, n) in enumerate(zip(params, norms, strict=True))
            if not np.isfinite(n)
        ]
        raise NonFiniteError(
            f"[{where}] the total {p:g}-norm of the gradients is {total}; "
            f"expected a finite norm (non-finite in: {', '.join(bad)}); the "
            "gradients were left unchanged: look for NaN/inf in the loss or the "
            "inputs, lower the learning rate, or pass error_if_nonfinite=False "
            "to scale by the non-finite norm anyway (as torch does)"
        )
    coef = np.minimum(max_norm / (total + dtype.type(1e-6)), dtype.type(1.0))
    with np.errstate(invalid="ignore"):  # inf * 0 = NaN, silently as in torch
        for g in grads:
            # torch multiplies a float32 gradient by the coefficient cast to float32.
            np.multiply(g, g.dtype.type(coef), out=g)
    return float(total)


def clip_grad_value(params: Parameter | Iterable[Parameter], clip_value: float) -> None:
    """Clamp every gradient entry into [-clip_value, clip_value] in place
    (torch.nn.utils.clip_grad_value_; NaN entries stay NaN)."""
    where = "clip_grad_value"
    params = _as_params(where, params, allow_empty=True)
    c = _float(where, "clip_value", clip_value, lo=0.0, allow_inf=True)
    for q in params:
        np.clip(q.grad, -c, c, out=q.grad)


# --- hyperparameters ---------------------------------------------------------------------------


def _float(
    where: str,
    name: str,
    x: Any,
    *,
    lo: float | None = None,
    lo_open: bool = False,
    hi: float | None = None,
    allow_inf: bool = False,
    hint: str = "",
) -> float:
    bound = []
    if lo is not None:
        bound.append(f"{'>' if lo_open else '>='} {lo:g}")
    if hi is not None:
        bound.append(f"< {hi:g}")
    expected = hint or (f"a float {' and '.join(bound)}" if bound else "a float")
    if isinstance(x, (bool, np.bool_)) or not isinstance(x, (int, float, np.integer, np.floating)):
        raise SpecError(f"[{where}] {name}={x!r}; expected {expected}")
    v = float(x)
    if (
        math.isnan(v)
        or (math.isinf(v) and not allow_inf)
        or (lo is not None and (v <= lo if lo_open else v < lo))
        or (hi is not None and v >= hi)
    ):
        raise SpecError(f"[{where}] {name}={x!r}; expected {expected}")
    return v


def _bool(where: str, name: str, x: Any) -> bool:
    return _check.flag(where, name, x)


class _Hyper:
    """A hyperparameter attribute (``opt.lr = 0.01`` between steps), checked when set."""

    def __set_name__(self, owner: type, name: str) -> None:
        self.name = name

    def __get__(self, obj: Any, owner: type | None = None) -> Any:
        return self if obj is None else obj._hyper[self.name]

    def __set__(self, obj: Any, value: Any) -> None:
        obj._hyper = obj._checked({**obj._hyper, self.name: value})


class _Group(MutableMapping):
    """``opt.param_groups[0]``: torch's parameter-group dict, live. Reading a key reads the
    optimizer's hyperparameter; writing one checks it and takes effect at the next step, so
    torch's idioms work unchanged (``for g in opt.param_groups: g["lr"] = lr`` in a
    hand-written schedule). ``update(...)`` checks all the new values together (SGD's nesterov
    and dampening depend on each other); ``"params"`` is the parameter list, read-only; keys
    cannot be added or removed."""

    __slots__ = ("_opt",)

    def __init__(self, opt: _Optimizer) -> None:
        self._opt = opt

    def __getitem__(self, key: str) -> Any:
        if key == "params":
            return self._opt.params
        return self._opt._hyper[key]

    def __setitem__(self, key: str, value: Any) -> None:
        self.update({key: value})

    def update(self, other: Any = (), /, **kw: Any) -> None:
        new = {**dict(other), **kw}
        w = f"{type(self._opt).__name__}.param_groups"
        bad = sorted(str(k) for k in new if k not in self._opt._hyper)
        if bad:
            raise SpecError(
                f"[{w}] cannot set {bad}; expected hyperparameters of "
                f"{sorted(self._opt._hyper)} (a leanrnn optimizer has one group, its "
                "parameters fixed at construction)"
            )
        self._opt._hyper = self._opt._checked({**self._opt._hyper, **new})

    def __delitem__(self, key: str) -> None:
        raise SpecError(
            f"[{type(self._opt).__name__}.param_groups] cannot delete {key!r}: every "
            "hyperparameter has a value"
        )

    def __iter__(self):
        return iter([*self._opt._hyper, "params"])

    def __len__(self) -> int:
        return len(self._opt._hyper) + 1

    def __repr__(self) -> str:
        return repr({**self._opt._hyper, "params": f"<{len(self._opt._params)} parameters>"})


class _Optimizer:
    """What SGD and Adam share: the parameter list, checked hyperparameters, per-parameter
    state, the shared scratch buffers, zero_grad and state_dict/load_state_dict."""

    # The entries a parameter's state may hold (in state_dict's order), and those a state
    # that holds any must hold; the rest are made by the step that first needs them.
    _STATE_KEYS: ClassVar[tuple[str, ...]] = ()
    _CORE: ClassVar[tuple[str, ...]] = ()
    # Keys torch's param_groups carry that mean nothing here; a torch state dict converted to
    # numpy loads with them present.
    _TORCH_ONLY: ClassVar[frozenset[str]] = frozenset(
        {
            "foreach",
            "fused",
            "capturable",
            "differentiable",
            "param_names",
            "initial_lr",
            "decoupled_weight_decay",
        }
    )

    def __init__(self, params: Any, **hyper: Any):
        where = type(self).__name__
        self._params = _as_params(where, params, allow_empty=False)
        self._hyper = self._checked(hyper)
        self._state: list[dict[str, Any]] = [{} for _ in self._params]
        # Scratch: k flat buffers per dtype, sized for the largest parameter of that dtype and
        # shared by all of them (step handles one parameter at a time); views cached per
        # parameter so a step creates no array objects.
        self._flat: dict[tuple[np.dtype, int], np.ndarray] = {}
        self._views: list[list[np.ndarray | None]] = [[None] * len(self._params) for _ in range(2)]

    # subclasses: _checked(hyper) -> hyper, _update(i, p, g, state)
    def _checked(self, hyper: dict[str, Any]) -> dict[str, Any]:
        raise NotImplementedError

    @property
    def params(self) -> list[Parameter]:
        return list(self._params)

    def _scratch(self, i: int, k: int) -> np.ndarray:
        v = self._views[k][i]
        if v is None:
            value = self._params[i].value
            flat = self._flat.get((value.dtype, k))
            if flat is None:
                size = max(q.value.size for q in self._params if q.dtype == value.dtype)
                flat = self._flat[(value.dtype, k)] = np.empty(size, value.dtype)
            v = self._views[k][i] = flat[: value.size].reshape(value.shape)
        return v

    @property
    def param_groups(self) -> list[_Group]:
        """torch.optim's ``param_groups``: one group, whose hyperparameters read and write this
        optimizer's (see ``_Group``)."""
        return [_Group(self)]

    def zero_grad(self, set_to_none: bool = True) -> None:
        """Zero every parameter's gradient in place. The buffers belong to the caller, so they
        are never replaced by None; what torch's ``set_to_none`` means for the next step
        holds for a trainer's parameters: with True (the default) one with no backward since
        is skipped, with False it steps on the zeros (``Parameter.zero_grad``)."""
        _bool(f"{type(self).__name__}.zero_grad", "set_to_none", set_to_none)
        for p in self._params:
            p.zero_grad(set_to_none)

    def step(self, closure: Any = None) -> Any:
        """One update of every parameter from its current gradient; bumps ``version``.
        closure: as torch's, an optional callable that recomputes the loss (forward and
        backward) and returns it; it is called first and its return value returned."""
        if closure is not None and not callable(closure):
            raise SpecError(
                f"[{type(self).__name__}.step] closure is a {type(closure).__name__}; "
                "expected a callable that runs forward and backward and returns the loss"
            )
        loss = closure() if closure is not None else None
        orphans = [p.name or f"params[{i}]" for i, p in enumerate(self._params) if p._orphan]
        if orphans:  # it would update copies that no forward reads: training stalls silently
            raise LeanRNNError(
                f"[{type(self).__name__}.step] parameters {orphans[:3]} are copies of a "
                "trainer's, unpickled (or copied) without it: their updates would reach no "
                "model. Pickle the trainer and the optimizer together (pickle.dumps((tr, opt))), "
                "or save opt.state_dict() and load it into an optimizer over tr.parameters()"
            )
        # An exception (Ctrl-C) may land part way: what was written is counted and the owners
        # refresh all the same, as Parameter.edit does (the model's inference and a checkpoint
        # saved in the handler read biases folded before the step, 0.07-0.41 off)
        try:
            for i, p in enumerate(self._params):
                if p._stale:  # no backward since zero_grad: torch's grad is None; skipped
                    continue
                try:
                    self._update(i, p._value, p.grad, self._state[i])
                finally:
                    p.version += 1
        finally:
            # the owners refresh now, not at their next forward: the model's own inference and
            # save() read the folded biases, which were one step stale (0.33 off after a step)
            owners = {id(o): o for p in self._params if p._owner is not None
                      for o in [p._owner()] if o is not None}  # fmt: skip
            for o in owners.values():
                o._check_weights()
        return loss

    def _update(self, i: int, theta: np.ndarray, g: np.ndarray, state: dict[str, Any]) -> None:
        raise NotImplementedError

    # --- state dicts: torch.optim's layout, numpy arrays instead of tensors ---

    def state_dict(self) -> dict[str, Any]:
        """``{"state": {i: {"step": int, <buffer>: array copy, ...}}, "param_groups": [{
        <hyperparameters>, "params": [0, 1, ...]}]}``: torch.optim's layout with numpy arrays
        (copies) and plain ints; a parameter without state yet (no step taken) is absent."""
        # Every buffer a parameter holds, needed by the current settings or not (torch's
        # layout): one kept while momentum is 0, or an Adam state before amsgrad was switched
        # on, was left out, and a resumed run diverged from the one that went on
        state = {}
        for i, s in enumerate(self._state):
            if s:
                state[i] = {
                    k: (s[k].copy() if isinstance(s[k], np.ndarray) else s[k])
                    for k in self._STATE_KEYS
                    if k in s
                }
        group = {k: (tuple(v) if isinstance(v, tuple) else v) for k, v in self._hyper.items()}
        group["params"] = list(range(len(self._params)))
        group["shapes"] = [list(p.logical_shape) for p in self._params]  # (torch keeps it too)
        return {"state": state, "param_groups": [group]}

    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        """Load hyperparameters and state saved by :meth:`state_dict` (or torch's state_dict
        converted to numpy). Everything is checked before anything changes: after an error the
        optimizer is as it was."""
        where = f"{type(self).__name__}.load_state_dict"
        n = len(self._params)
        if not isinstance(state_dict, dict) or set(state_dict) != {"state", "param_groups"}:
            got = (
                sorted(map(str, state_dict))
                if isinstance(state_dict, dict)
                else type(state_dict).__name__
            )
            raise LeanRNNError(
                f"[{where}] got {got}; expected a dict with keys 'param_groups' "
                "and 'state', as state_dict() returns"
            )
        groups = state_dict["param_groups"]
        if (
            not isinstance(groups, (list, tuple))
            or len(groups) != 1
            or not isinstance(groups[0], dict)
        ):
            raise LeanRNNError(
                f"[{where}] param_groups is {groups!r:.200}; expected a list of "
                "one dict (leanrnn optimizers have one parameter group)"
            )
        group = dict(groups[0])
        ids = group.pop("params", None)
        if not isinstance(ids, (list, tuple)) or list(ids) != list(range(n)):
            raise LeanRNNError(
                f"[{where}] param_groups[0]['params'] is {ids!r:.200}; expected "
                f"{list(range(n))!r:.200} (the state dict must be of an "
                f"optimizer over the same {n} parameters)"
            )
        shapes = group.pop("shapes", None)  # absent from torch's own state dicts
        ours = [list(p.logical_shape) for p in self._params]
        if shapes is not None:
            theirs = _shape_lists(shapes, n)
            if theirs is None:
                raise LeanRNNError(
                    f"[{where}] param_groups[0]['shapes'] is {shapes!r:.200}; expected {n} "
                    "lists of ints, one per parameter, as state_dict() writes them"
                )
            bad = next((i for i, (a, b) in enumerate(zip(theirs, ours, strict=True)) if a != b),
                       None)  # fmt: skip
            if bad is not None:
                raise LeanRNNError(
                    f"[{where}] the state dict is of parameters shaped otherwise (parameter "
                    f"{bad}: {theirs[bad]} there, {ours[bad]} here): another model's "
                    "optimizer state; load the one saved by an optimizer over these parameters"
                )
        group = {k: v for k, v in group.items() if k not in self._TORCH_ONLY or k in self._hyper}
        unexpected = sorted(set(group) - set(self._hyper))
        missing = sorted(set(self._hyper) - set(group))
        if unexpected or missing:
            raise LeanRNNError(
                f"[{where}] param_groups[0] has unexpected keys {unexpected} and "
                f"misses {missing}; expected the hyperparameters "
                f"{sorted(self._hyper)} and 'params'"
            )
        hyper = self._checked(group)
        states = state_dict["state"]
        if not isinstance(states, dict):
            raise LeanRNNError(
                f"[{where}] state is a {type(states).__name__}; expected a dict "
                "{parameter index: {name: array}}"
            )
        new_state: list[dict[str, Any]] = [{} for _ in range(n)]
        for key, s in states.items():
            i = (
                key
                if isinstance(key, (int, np.integer))
                else (int(key) if isinstance(key, str) and key.isdigit() else None)
            )
            if i is None or not 0 <= i < n:
                raise LeanRNNError(
                    f"[{where}] state has an entry for parameter {key!r}; "
                    f"expected indices 0..{n - 1}"
                )
            new_state[int(i)] = self._checked_state(where, int(i), s, hyper)
        # Commit: hyperparameters, then state copied into the existing buffers (so a step after
        # loading allocates only what a first step would).
        self._hyper = hyper
        for i, (old, new) in enumerate(zip(self._state, new_state, strict=True)):
            for k, v in new.items():
                if isinstance(v, np.ndarray):
                    buf = old.get(k)
                    if buf is None:
                        buf = np.empty_like(self._params[i].value)
                    np.copyto(buf, v, casting="unsafe")
                    new[k] = buf
            self._state[i] = new

    def _checked_state(self, where: str, i: int, s: Any, hyper: dict[str, Any]) -> dict:
        p = self._params[i]
        label = f"state[{i}] ({p.name or 'unnamed'})"
        if not isinstance(s, dict):
            raise LeanRNNError(f"[{where}] {label} is a {type(s).__name__}; expected a dict")
        present = {k for k, v in s.items() if v is not None}
        if not present:  # torch's entry for a parameter that has not been stepped yet
            return {}
        if not present <= set(self._STATE_KEYS) or not set(self._CORE) <= present:
            raise LeanRNNError(
                f"[{where}] {label} has keys {sorted(present)}; expected "
                f"{sorted(self._CORE)}, and of {sorted(set(self._STATE_KEYS) - set(self._CORE))} "
                "any"
            )
        out: dict[str, Any] = {}
        for k in (k for k in self._STATE_KEYS if k in present):
            v = s[k]
            if k == "step":
                step = np.asarray(v)
                if (
                    step.shape != ()
                    or step.dtype.kind not in "iuf"
                    or not np.isfinite(step)
                    or step < 0
                    or step != np.floor(step)
                ):
                    raise LeanRNNError(
                        f"[{where}] {label}['step'] is {v!r:.100}; expected a whole number >= 0"
                    )
                out[k] = int(step)
                continue
            a = np.asarray(v)  # torch tensors convert too
            if a.shape != p.shape and a.shape == p.logical_shape:
                raise ShapeError(
                    f"[{where}] {label}[{k!r}] has shape {a.shape}, torch's layout of the "
                    f"weight; a trainer's optimizer state is laid out as its packed parameters "
                    f"{p.shape}: optimizer state does not move between torch.optim and "
                    "leanrnn.train (start the optimizer afresh, or resume where it was saved)"
                )
            if a.shape != p.shape:
                raise ShapeError(
                    f"[{where}] {label}[{k!r}] has shape {a.shape}; expected "
                    f"{p.shape}, the shape of the parameter"
                )
            if a.dtype.kind != "f":
                raise DTypeError(
                    f"[{where}] {label}[{k!r}] has dtype {a.dtype}; expected a "
                    f"float array (it is stored as {p.dtype})"
                )
            out[k] = a
        return out


class SGD(_Optimizer):
    """Stochastic gradient descent with momentum, as torch.optim.SGD (defaults included); the
    update is in the module docstring. Buffers: one momentum buffer per parameter (when
    momentum != 0), seeded with the first step's gradient as torch does.

    params: Parameters (or one); lr, momentum, dampening, weight_decay, nesterov and maximize
    are attributes that may be changed between steps.

    Example: ``SGD([w], lr=0.1, momentum=0.9, nesterov=True)``.
    """

    lr = _Hyper()
    momentum = _Hyper()
    dampening = _Hyper()
    weight_decay = _Hyper()
    nesterov = _Hyper()
    maximize = _Hyper()

    def __init__(
        self,
        params: Any,
        lr: float = 1e-3,
        momentum: float = 0.0,
        dampening: float = 0.0,
        weight_decay: float = 0.0,
        nesterov: bool = False,
        *,
        maximize: bool = False,
    ):
        super().__init__(
            params,
            lr=lr,
            momentum=momentum,
            dampening=dampening,
            weight_decay=weight_decay,
            nesterov=nesterov,
            maximize=maximize,
        )

    def _checked(self, h: dict[str, Any]) -> dict[str, Any]:
        w = type(self).__name__
        out = {
            "lr": _float(w, "lr", h["lr"], lo=0.0),
            "momentum": _float(w, "momentum", h["momentum"], lo=0.0),
            "dampening": _float(w, "dampening", h["dampening"]),
            "weight_decay": _float(w, "weight_decay", h["weight_decay"], lo=0.0),
            "nesterov": _bool(w, "nesterov", h["nesterov"]),
            "maximize": _bool(w, "maximize", h["maximize"]),
        }
        if out["nesterov"] and (out["momentum"] <= 0 or out["dampening"] != 0):
            raise SpecError(
                f"[{w}] nesterov=True with momentum={out['momentum']:g} and "
                f"dampening={out['dampening']:g}; expected momentum > 0 and "
                "dampening = 0 (Nesterov momentum needs both)"
            )
        return out

    _STATE_KEYS = ("momentum_buffer",)

    def _update(self, i: int, theta: np.ndarray, g: np.ndarray, state: dict[str, Any]) -> None:
        h = self._hyper
        lr, mu, wd, maximize = h["lr"], h["momentum"], h["weight_decay"], h["maximize"]
        if maximize or wd != 0:
            d = self._scratch(i, 0)  # the effective gradient; the user's grad stays as it is
            if wd != 0:
                np.multiply(theta, wd, out=d)
                (np.subtract if maximize else np.add)(d, g, out=d)
            else:
                np.negative(g, out=d)
            g = d
        tmp = self._scratch(i, 1)
        if mu != 0:
            buf = state.get("momentum_buffer")
            if buf is None:
                state["momentum_buffer"] = buf = g.copy()
            else:
                np.multiply(buf, mu, out=buf)
                alpha = 1.0 - h["dampening"]
                if alpha == 1.0:
                    np.add(buf, g, out=buf)
                else:
                    np.multiply(g, alpha, out=tmp)
                    np.add(buf, tmp, out=buf)
            if h["nesterov"]:
                np.multiply(buf, mu, out=tmp)
                np.add(g, tmp, out=tmp)
                g = tmp
            else:
                g = buf
        np.multiply(g, -lr, out=tmp)
        np.add(theta, tmp, out=theta)


class Adam(_Optimizer):
    """Adam (Kingma & Ba), as torch.optim.Adam (defaults included); with
    ``decoupled_weight_decay=True`` it is AdamW. The update is in the module docstring.
    Buffers per parameter: exp_avg, exp_avg_sq (and max_exp_avg_sq with amsgrad), allocated on
    its first step, plus its step count.

    params: Parameters (or one); lr, betas, eps, weight_decay, amsgrad and maximize are
    attributes that may be changed between steps.

    Example: ``Adam([w], lr=1e-3, amsgrad=True)``.
    """

    lr = _Hyper()
    betas = _Hyper()
    eps = _Hyper()
    weight_decay = _Hyper()
    amsgrad = _Hyper()
    maximize = _Hyper()

    def __init__(
        self,
        params: Any,
        lr: float = 1e-3,
        betas: tuple[float, float] | list[float] = (0.9, 0.999),  # (a list, as torch takes)
        eps: float = 1e-8,
        weight_decay: float = 0.0,
        amsgrad: bool = False,
        *,
        maximize: bool = False,
        decoupled_weight_decay: bool = False,
    ):
        self._decoupled = _bool(
            type(self).__name__, "decoupled_weight_decay", decoupled_weight_decay
        )
        super().__init__(
            params,
            lr=lr,
            betas=betas,
            eps=eps,
            weight_decay=weight_decay,
            amsgrad=amsgrad,
            maximize=maximize,
        )

    @property
    def decoupled_weight_decay(self) -> bool:
        return self._decoupled

    def _checked(self, h: dict[str, Any]) -> dict[str, Any]:
        w = type(self).__name__
        betas = h["betas"]
        if not isinstance(betas, (tuple, list)) or len(betas) != 2:
            raise SpecError(
                f"[{w}] betas={betas!r}; expected a pair (beta1, beta2) of floats in [0, 1)"
            )
        return {
            "lr": _float(w, "lr", h["lr"], lo=0.0),
            "betas": (
                _float(w, "betas[0]", betas[0], lo=0.0, hi=1.0),
                _float(w, "betas[1]", betas[1], lo=0.0, hi=1.0),
            ),
            "eps": _float(w, "eps", h["eps"], lo=0.0),
            "weight_decay": _float(w, "weight_decay", h["weight_decay"], lo=0.0),
            "amsgrad": _bool(w, "amsgrad", h["amsgrad"]),
            "maximize": _bool(w, "maximize", h["maximize"]),
        }

    _STATE_KEYS = ("step", "exp_avg", "exp_avg_sq", "max_exp_avg_sq")
    _CORE = ("step", "exp_avg", "exp_avg_sq")

    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        if isinstance(state_dict, dict) and isinstance(state_dict.get("param_groups"), list):
            for g in state_dict["param_groups"]:
                flag = g.get("decoupled_weight_decay") if isinstance(g, dict) else None
                if flag is not None and bool(flag) != self._decoupled:
                    raise SpecError(
                        f"[{type(self).__name__}.load_state_dict] the state dict has "
                        f"decoupled_weight_decay={flag}; this optimizer has "
                        f"{self._decoupled}; load it into "
                        f"{'AdamW' if flag else 'Adam'} instead"
                    )
        super().load_state_dict(state_dict)

    def state_dict(self) -> dict[str, Any]:
        sd = super().state_dict()
        sd["param_groups"][0]["decoupled_weight_decay"] = self._decoupled
        return sd

    def _update(self, i: int, theta: np.ndarray, g: np.ndarray, state: dict[str, Any]) -> None:
        h = self._hyper
        lr, (beta1, beta2), eps, wd = h["lr"], h["betas"], h["eps"], h["weight_decay"]
        amsgrad, maximize = h["amsgrad"], h["maximize"]
        if "exp_avg" not in state or (amsgrad and "max_exp_avg_sq" not in state):
            # the first step (or amsgrad just switched on): moments start at zero
            for k in (self._STATE_KEYS if amsgrad else self._CORE)[1:]:
                if k not in state:
                    state[k] = np.zeros_like(theta)
            state.setdefault("step", 0)
        m, v = state["exp_avg"], state["exp_avg_sq"]
        state["step"] += 1
        step = state["step"]
        # d: the effective gradient when it differs from grad, later the denominator.
        d, tmp = self._scratch(i, 0), self._scratch(i, 1)
        if wd != 0 and self._decoupled:
            np.multiply(theta, 1.0 - lr * wd, out=theta)
        if wd != 0 and not self._decoupled:
            np.multiply(theta, wd, out=d)
            (np.subtract if maximize else np.add)(d, g, out=d)
            g = d
        elif maximize:
            np.negative(g, out=d)
            g = d
        # m.lerp_(g, 1 - beta1), torch's two-sided formula: m + w*(g - m) for w < 0.5, else
        # g - (g - m)*(1 - w), with w and 1 - w rounded to the dtype.
        w = theta.dtype.type(1.0 - beta1)
        np.subtract(g, m, out=tmp)
        if abs(w) < 0.5:
            np.multiply(tmp, w, out=tmp)
            np.add(m, tmp, out=m)
        else:
            np.multiply(tmp, w - theta.dtype.type(1.0), out=tmp)
            np.add(g, tmp, out=m)
        # v.mul_(beta2).addcmul_(g, g, value=1 - beta2): torch evaluates (value*g)*g.
        np.multiply(v, beta2, out=v)
        np.multiply(g, 1.0 - beta2, out=tmp)
        np.multiply(tmp, g, out=tmp)
        np.add(v, tmp, out=v)
        if amsgrad:
            vmax = state["max_exp_avg_sq"]
            np.maximum(vmax, v, out=vmax)
            v = vmax
        bias_correction1 = 1 - beta1**step
        bias_correction2_sqrt = (1 - beta2**step) ** 0.5
        step_size = lr / bias_correction1
        # denom = sqrt(v) / sqrt(bc2) + eps; theta.addcdiv_(m, denom, value=-step_size), which
        # torch evaluates as theta + (value*m)/denom.
        np.sqrt(v, out=d)
        np.divide(d, bias_correction2_sqrt, out=d)
        np.add(d, eps, out=d)
        np.multiply(m, -step_size, out=tmp)
        if theta.dtype.type(eps) == 0:  # (1e-50 is 0 in float32: 0/0 as below, NaN everywhere)
            # 0/0 where every gradient so far was 0 (m = v = 0): torch writes NaN there and the
            # next forward spreads it to every weight. A trainer's padding is such an entry on
            # every step: it is left unmoved (tmp holds -step_size * 0), as any eps > 0 leaves
            # it. A gradient so small that v underflowed to 0 still divides (+-inf, as torch).
            with np.errstate(divide="ignore"):
                np.divide(tmp, d, out=tmp, where=(d != 0) | (tmp != 0))
        else:
            np.divide(tmp, d, out=tmp)
        np.add(theta, tmp, out=theta)


class AdamW(Adam):
    """Adam with decoupled weight decay (Loshchilov & Hutter), as torch.optim.AdamW: the
    weights shrink by (1 - lr*weight_decay) before the Adam update instead of weight_decay*theta
    joining the gradient; default weight_decay=1e-2.

    Example: ``AdamW([w], lr=1e-3, weight_decay=1e-2)``.
    """

    def __init__(
        self,
        params: Any,
        lr: float = 1e-3,
        betas: tuple[float, float] | list[float] = (0.9, 0.999),  # (a list, as torch takes)
        eps: float = 1e-8,
        weight_decay: float = 1e-2,
        amsgrad: bool = False,
        *,
        maximize: bool = False,
    ):
        super().__init__(
            params,
            lr=lr,
            betas=betas,
            eps=eps,
            weight_decay=weight_decay,
            amsgrad=amsgrad,
            maximize=maximize,
            decoupled_weight_decay=True,
        )


__all__ = ["SGD", "Adam", "AdamW", "Parameter", "clip_grad_norm", "clip_grad_value"]

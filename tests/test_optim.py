"""leanrnn.train.optim against torch.optim and torch.nn.utils step by step, plus what torch
cannot check: accumulation, allocation-free steps, zero padding, bad input."""

import itertools
import tracemalloc

import numpy as np
import pytest

from leanrnn.errors import DTypeError, LayoutError, LeanRNNError, ShapeError, SpecError
from leanrnn.train.optim import SGD, Adam, AdamW, Parameter, clip_grad_norm, clip_grad_value
from tolerances import ATOL_OPTIM, RTOL_OPTIM

try:
    import torch
except ImportError:  # the numpy-only tests still run
    torch = None

needs_torch = pytest.mark.skipif(torch is None, reason="torch is not installed")

DTYPES = [np.float32, np.float64]
SHAPES = [(7,), (3, 5), (2, 3, 4), ()]
STEPS = 20

SGD_CONFIGS = [
    dict(momentum=mu, dampening=tau, nesterov=nest, weight_decay=wd, maximize=mx)
    for mu, tau, nest, wd, mx in itertools.product(
        [0.0, 0.9], [0.0, 0.3], [False, True], [0.0, 0.1], [False, True]
    )
    if not (nest and (mu == 0 or tau != 0))
]
# betas (0.3, 0.5): 1 - beta1 >= 0.5 takes the other side of torch's two-sided lerp.
ADAM_CONFIGS = [
    dict(betas=b, weight_decay=wd, amsgrad=ams, maximize=mx)
    for b, wd, ams, mx in itertools.product(
        [(0.9, 0.999), (0.3, 0.5)], [0.0, 0.1], [False, True], [False, True]
    )
]
# AdamW shares Adam's code but for the decay; its betas stay torch's defaults.
ADAMW_CONFIGS = [
    dict(weight_decay=wd, amsgrad=ams, maximize=mx)
    for wd, ams, mx in itertools.product([0.01, 0.5], [False, True], [False, True])
]
OPTIMIZERS = (
    [("SGD", c) for c in SGD_CONFIGS]
    + [("Adam", c) for c in ADAM_CONFIGS]
    + [("AdamW", c) for c in ADAMW_CONFIGS]
)
OURS = {"SGD": SGD, "Adam": Adam, "AdamW": AdamW}
LR = {"SGD": 0.05, "Adam": 0.01, "AdamW": 0.01}


def _id(case):
    name, cfg = case
    return name + "-" + "-".join(f"{k}={v}" for k, v in cfg.items())


def _close(actual, expected, dtype):
    np.testing.assert_allclose(
        actual, expected, rtol=RTOL_OPTIM[dtype], atol=ATOL_OPTIM[dtype], strict=True
    )


def _flat(arrays):
    return np.concatenate([a.ravel() for a in arrays])


def _params(rng, dtype, shapes=SHAPES):
    return [
        Parameter(rng.standard_normal(s).astype(dtype), name=f"p{i}") for i, s in enumerate(shapes)
    ]


def _torch_twin(name, cfg, params):
    tp = [torch.nn.Parameter(torch.from_numpy(p.value.copy())) for p in params]
    return tp, getattr(torch.optim, name)(tp, lr=LR[name], foreach=False, **cfg)


def _feed(rng, params, tp=None):
    for i, p in enumerate(params):
        g = rng.standard_normal(p.shape).astype(p.dtype)
        p.grad[...] = g
        if tp is not None:
            tp[i].grad = torch.from_numpy(g.copy())


# --- against torch.optim -----------------------------------------------------------------------


@pytest.mark.torch
@needs_torch
@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("case", OPTIMIZERS, ids=_id)
def test_optimizer_matches_torch_step_by_step(case, dtype, rng):
    name, cfg = case
    params = _params(rng, dtype)
    opt = OURS[name](params, lr=LR[name], **cfg)
    tp, topt = _torch_twin(name, cfg, params)
    for step in range(STEPS):
        if step == STEPS // 2:  # the learning rate may change between steps
            opt.lr = topt.param_groups[0]["lr"] = LR[name] / 3
        _feed(rng, params, tp)
        opt.step()
        topt.step()
        _close(_flat(p.value for p in params), _flat(t.detach().numpy() for t in tp), dtype)
        assert [p.version for p in params] == [step + 1] * len(params)
    # the state buffers too (momentum, moments, step counts)
    state = opt.state_dict()["state"]
    for i, t in enumerate(tp):
        ts, ours = topt.state[t], state.get(i, {})
        assert set(ours) == set(ts) - ({"step"} if name == "SGD" else set())
        for k, v in ours.items():
            if k == "step":
                assert v == int(ts[k]) == STEPS
            else:
                _close(v, ts[k].numpy(), dtype)


@pytest.mark.torch
@needs_torch
@pytest.mark.parametrize("name", ["SGD", "Adam", "AdamW"])
def test_defaults_are_torchs(name):
    w = torch.nn.Parameter(torch.zeros(2))
    theirs = getattr(torch.optim, name)([w]).defaults
    ours = OURS[name]([Parameter(np.zeros(2, np.float32))]).state_dict()["param_groups"][0]
    for k, v in ours.items():
        if k not in ("params", "shapes"):  # (shapes: leanrnn's check of a loaded state)
            assert theirs[k] == v, k


@pytest.mark.torch
@needs_torch
@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize(
    "case",
    [
        ("SGD", dict(momentum=0.9, nesterov=True, weight_decay=0.1)),
        ("Adam", dict(amsgrad=True, weight_decay=0.1)),
        ("AdamW", dict(maximize=True)),
    ],
    ids=_id,
)
def test_load_torch_state_dict_and_continue(case, dtype, rng):
    """torch's state_dict converted to numpy loads, and the run continues as torch's does."""
    name, cfg = case
    params = _params(rng, dtype)
    tp, topt = _torch_twin(name, cfg, params)
    for _ in range(5):
        _feed(rng, params, tp)
        topt.step()
    sd = topt.state_dict()
    sd = {
        "state": {i: {k: np.asarray(v) for k, v in s.items()} for i, s in sd["state"].items()},
        "param_groups": sd["param_groups"],
    }
    for p, t in zip(params, tp, strict=True):
        with p.edit() as v:
            v[...] = t.detach().numpy()
    opt = OURS[name](params, lr=1.0)
    opt.load_state_dict(sd)
    assert opt.lr == LR[name]
    for _ in range(5):
        _feed(rng, params, tp)
        opt.step()
        topt.step()
    for p, t in zip(params, tp, strict=True):
        _close(p.value, t.detach().numpy(), dtype)


# --- clipping against torch.nn.utils -----------------------------------------------------------


def _grads(rng, dtypes, shapes=((70,), (30, 50), (2, 3, 4), ())):
    return [rng.standard_normal(s).astype(dt) for s, dt in zip(shapes, dtypes, strict=False)]


def _clip_both(grads, fn_ours, fn_torch):
    ours = [Parameter(np.zeros_like(g), g.copy()) for g in grads]
    tp = [torch.nn.Parameter(torch.zeros(g.shape, dtype=torch.from_numpy(g).dtype)) for g in grads]
    for t, g in zip(tp, grads, strict=True):
        t.grad = torch.from_numpy(g.copy())
    return ours, tp, fn_ours(ours), fn_torch(tp)


@pytest.mark.torch
@needs_torch
@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("norm_type", [2.0, 1.0, float("inf"), 3.0])
@pytest.mark.parametrize("max_norm", [0.5, 1e6], ids=["clips", "below"])
def test_clip_grad_norm_matches_torch(norm_type, max_norm, dtype, rng):
    grads = _grads(rng, [dtype] * 4)
    grads[1][2, 3] = -9.0  # the largest magnitude is negative: the inf-norm takes abs
    ours, tp, n, tn = _clip_both(
        grads,
        lambda ps: clip_grad_norm(ps, max_norm, norm_type),
        lambda ps: torch.nn.utils.clip_grad_norm_(ps, max_norm, norm_type, foreach=False),
    )
    assert isinstance(n, float)
    _close(np.asarray(n, dtype), tn.numpy(), dtype)
    for p, t in zip(ours, tp, strict=True):
        _close(p.grad, t.grad.numpy(), dtype)
    if max_norm > n:  # not clipped: the factor is 1 and the gradients as they were
        for p, g in zip(ours, grads, strict=True):
            np.testing.assert_array_equal(p.grad, g)
    else:
        assert clip_grad_norm(ours, np.inf, norm_type) == pytest.approx(max_norm, rel=1e-5)


@pytest.mark.torch
@needs_torch
def test_clip_grad_norm_mixed_dtypes_matches_torch(rng):
    """torch stacks the per-gradient norms in the promoted dtype and casts the factor back."""
    grads = _grads(rng, [np.float32, np.float64, np.float32, np.float64])
    ours, tp, n, tn = _clip_both(
        grads,
        lambda ps: clip_grad_norm(ps, 1.0),
        lambda ps: torch.nn.utils.clip_grad_norm_(ps, 1.0, foreach=False),
    )
    assert tn.dtype == torch.float64
    _close(np.float32(n), np.float32(tn.item()), np.float32)
    for p, t in zip(ours, tp, strict=True):
        _close(p.grad, t.grad.numpy(), p.dtype)


@pytest.mark.torch
@needs_torch
@pytest.mark.parametrize("bad", [np.nan, np.inf], ids=["nan", "inf"])
@pytest.mark.parametrize("norm_type", [2.0, float("inf")])
def test_clip_grad_norm_nonfinite_like_torch(bad, norm_type, rng):
    grads = _grads(rng, [np.float32] * 3)
    grads[1][2, 3] = bad
    ours = [Parameter(np.zeros_like(g), g.copy(), name=f"g{i}") for i, g in enumerate(grads)]
    with pytest.raises(LeanRNNError, match=r"\[clip_grad_norm\].*non-finite in: g1\)") as e:
        clip_grad_norm(ours, 1.0, norm_type, error_if_nonfinite=True)
    assert "error_if_nonfinite=False" in str(e.value)
    for p, g in zip(ours, grads, strict=True):  # left unchanged
        np.testing.assert_array_equal(p.grad, g)
    with pytest.raises(RuntimeError):
        _clip_both(grads, lambda ps: None, lambda ps: torch.nn.utils.clip_grad_norm_(ps, 1.0, norm_type, error_if_nonfinite=True, foreach=False))  # fmt: skip
    # without the flag, NaN/inf scale every gradient (NaN everywhere, or 0 and NaN), as in torch
    ours, tp, n, tn = _clip_both(
        grads,
        lambda ps: clip_grad_norm(ps, 1.0, norm_type),
        lambda ps: torch.nn.utils.clip_grad_norm_(ps, 1.0, norm_type, foreach=False),
    )
    np.testing.assert_array_equal(n, tn.item())
    for p, t in zip(ours, tp, strict=True):
        np.testing.assert_array_equal(p.grad, t.grad.numpy())
    assert np.isnan(ours[1].grad[2, 3])
    assert np.isnan(ours[0].grad).all() if np.isnan(bad) else not ours[0].grad.any()


@pytest.mark.torch
@needs_torch
def test_clip_grad_value_matches_torch(rng):
    grads = _grads(rng, [np.float32, np.float64, np.float32])
    grads[0][5] = np.nan
    ours, tp, _, _ = _clip_both(
        grads,
        lambda ps: clip_grad_value(ps, 0.5),
        lambda ps: torch.nn.utils.clip_grad_value_(ps, 0.5, foreach=False),
    )
    for p, t in zip(ours, tp, strict=True):
        np.testing.assert_array_equal(p.grad, t.grad.numpy())
    assert np.abs(ours[1].grad).max() == 0.5


# --- numpy-only properties ---------------------------------------------------------------------


@pytest.mark.parametrize("case", OPTIMIZERS[:: len(OPTIMIZERS) // 7], ids=_id)
def test_accumulating_k_micro_batches_equals_one_step_on_the_sum(case, rng):
    name, cfg = case
    a, b = _params(rng, np.float32), None
    b = [Parameter(p.value.copy()) for p in a]
    opt_a, opt_b = OURS[name](a, **cfg), OURS[name](b, **cfg)
    for _ in range(3):
        micro = [[rng.standard_normal(p.shape).astype(p.dtype) for p in a] for _ in range(4)]
        opt_a.zero_grad()
        for gs in micro:  # k backward calls accumulate into the same buffers
            for p, g in zip(a, gs, strict=True):
                p.grad += g
        for i, p in enumerate(b):
            p.grad[...] = ((micro[0][i] + micro[1][i]) + micro[2][i]) + micro[3][i]
        opt_a.step()
        opt_b.step()
        for p, q in zip(a, b, strict=True):
            np.testing.assert_array_equal(p.value, q.value)


@pytest.mark.parametrize("case", OPTIMIZERS, ids=_id)
def test_zero_padding_stays_zero(case, rng):
    """Padding of the packed layout has value 0 and gradient 0 and must stay exactly 0."""
    name, cfg = case
    (p,) = _params(rng, np.float32, [(6, 8)])
    pad = (slice(None), slice(5, None))
    with p.edit() as v:
        v[pad] = 0
    opt = OURS[name]([p], lr=0.1, **cfg)
    for _ in range(5):
        _feed(rng, [p])
        p.grad[pad] = 0
        opt.step()
    assert np.count_nonzero(p.value[pad]) == 0
    assert np.count_nonzero(p.value[:, :5]) == 30  # and the rest did train


# Python scalars and a few small lists per call, measured at ~350 bytes for a step and ~1.5 KB
# for clipping; one temporary of the 1e5-element arrays below would be 400 KB or more.
STEP_BYTES = 1024
CLIP_BYTES = 4096


@pytest.mark.parametrize(
    "case",
    [
        ("SGD", dict(momentum=0.9, nesterov=True, weight_decay=0.1, maximize=True)),
        ("SGD", dict(momentum=0.9, dampening=0.5)),
        ("SGD", dict()),
        ("Adam", dict(amsgrad=True, weight_decay=0.1, maximize=True)),
        ("Adam", dict(betas=(0.3, 0.5))),
        ("AdamW", dict()),
    ],
    ids=_id,
)
def test_steady_state_step_allocates_nothing(case, rng):
    name, cfg = case
    n = 100_000
    params = [
        Parameter(rng.standard_normal(n).astype(np.float32)),
        Parameter(rng.standard_normal((10, n // 10))),
    ]
    _feed(rng, params)
    opt = OURS[name](params, **cfg)
    opt.step()  # the first step allocates the state
    tracemalloc.start()
    try:
        before, _ = tracemalloc.get_traced_memory()
        tracemalloc.reset_peak()
        opt.step()
        _, step_peak = tracemalloc.get_traced_memory()
        tracemalloc.reset_peak()
        clip_grad_norm(params, 1.0)
        clip_grad_norm(params, 1.0, float("inf"))
        clip_grad_value(params, 0.1)
        opt.zero_grad()
        _, clip_peak = tracemalloc.get_traced_memory()
    finally:
        tracemalloc.stop()
    assert step_peak - before < STEP_BYTES
    assert clip_peak - before < CLIP_BYTES


def test_state_dict_round_trip_continues_bit_for_bit(rng):
    for name, cfg in [("SGD", dict(momentum=0.9)), ("Adam", dict(amsgrad=True))]:
        a = _params(rng, np.float64)
        b = [Parameter(p.value.copy()) for p in a]
        opt_a = OURS[name](a, lr=0.05, **cfg)
        for _ in range(3):
            _feed(rng, a)
            opt_a.step()
        for p, q in zip(a, b, strict=True):
            with q.edit() as v:
                v[...] = p.value
        opt_b = OURS[name](b)  # other hyperparameters: the state dict brings them
        opt_b.load_state_dict(opt_a.state_dict())
        assert opt_b.state_dict()["param_groups"] == opt_a.state_dict()["param_groups"]
        for _ in range(3):
            _feed(rng, a)
            for p, q in zip(a, b, strict=True):
                q.grad[...] = p.grad
            opt_a.step()
            opt_b.step()
        for p, q in zip(a, b, strict=True):
            np.testing.assert_array_equal(p.value, q.value)


def test_parameter_basics():
    v = np.arange(6, dtype=np.float32).reshape(2, 3)
    p = Parameter(v, name="W")
    assert np.shares_memory(p.value, v) and not p.value.flags.writeable  # a read-only view
    assert p.grad.shape == v.shape and p.grad.dtype == v.dtype
    with p.edit() as w:
        assert w is v
        w[0, 0] = 9
    assert p.version == 1 and p.value[0, 0] == 9
    g = p.grad
    g += 1
    p.zero_grad()
    assert p.grad is g and not g.any()
    assert "W" in repr(p) and p.version == 1


# --- bad input ---------------------------------------------------------------------------------


def test_parameter_rejects_bad_arrays():
    v = np.zeros((3, 4), np.float32)
    with pytest.raises(ShapeError, match=r"\[Parameter\] grad of parameter 'W' has shape \(4, 3\); expected \(3, 4\)"):  # fmt: skip
        Parameter(v, np.zeros((4, 3), np.float32), name="W")
    with pytest.raises(DTypeError, match=r"dtype float64; expected float32"):
        Parameter(v, np.zeros((3, 4)))
    with pytest.raises(DTypeError, match=r"dtype int64; expected float32 or float64"):
        Parameter(np.zeros(3, np.int64))
    with pytest.raises(DTypeError, match=r"is a list"):
        Parameter([1.0, 2.0])
    with pytest.raises(LayoutError, match=r"not C-contiguous"):
        Parameter(np.zeros((4, 3), np.float32).T)
    ro = np.zeros(3, np.float32)
    ro.flags.writeable = False
    with pytest.raises(LayoutError, match=r"read-only"):
        Parameter(ro)
    with pytest.raises(LayoutError, match=r"shares memory with its value"):
        Parameter(v, v)
    p = Parameter(v)
    with pytest.raises(ShapeError):
        p.grad = np.zeros(12, np.float32)
    assert p.grad.shape == (3, 4)
    with pytest.raises(AttributeError):
        p.value = np.zeros((3, 4), np.float32)


def test_optimizers_reject_bad_params_and_hyperparameters():
    buf = np.zeros(10, np.float32)
    a, b = Parameter(buf[:6]), Parameter(buf[4:])
    with pytest.raises(LayoutError, match=r"\[SGD\] params\[1\]\.value .* overlaps params\[0\]\.value"):  # fmt: skip
        SGD([a, b])
    with pytest.raises(LayoutError, match="overlaps"):
        Adam([a, a])
    with pytest.raises(LeanRNNError, match=r"\[Adam\] params\[0\] is a ndarray; expected a leanrnn"):  # fmt: skip
        Adam([buf])
    with pytest.raises(LeanRNNError, match=r"empty parameter list"):
        AdamW([])
    p = Parameter(np.zeros(3, np.float32))
    for make, match in [
        (lambda: SGD([p], lr=-1), r"\[SGD\] lr=-1; expected a float >= 0"),
        (lambda: SGD([p], momentum=-0.1), r"momentum=-0.1"),
        (lambda: SGD([p], nesterov=True), r"\[SGD\] nesterov=True with momentum=0"),
        (lambda: SGD([p], momentum=0.9, dampening=0.1, nesterov=True), r"dampening=0.1"),
        (lambda: SGD([p], lr=float("nan")), r"lr=nan"),
        (
            lambda: Adam([p], betas=(0.9, 1.0)),
            r"\[Adam\] betas\[1\]=1.0; expected a float >= 0 and < 1",
        ),
        (lambda: Adam([p], betas=0.9), r"betas=0.9; expected a pair"),
        (lambda: Adam([p], eps=-1e-8), r"eps=-1e-08"),
        (lambda: AdamW([p], weight_decay=-1), r"\[AdamW\] weight_decay=-1"),
        (lambda: Adam([p], amsgrad=1), r"amsgrad=1; expected True or False"),
    ]:
        with pytest.raises(SpecError, match=match):
            make()
    opt = SGD([p], lr=0.1)
    with pytest.raises(SpecError, match=r"\[SGD\] lr=-0.5"):
        opt.lr = -0.5
    assert opt.lr == 0.1
    with pytest.raises(SpecError, match=r"nesterov"):
        opt.nesterov = True
    assert opt.nesterov is False


def test_clip_rejects_bad_arguments():
    p = Parameter(np.zeros(3, np.float32), np.ones(3, np.float32))
    with pytest.raises(SpecError, match=r"\[clip_grad_norm\] max_norm=-1.0; expected a float >= 0"):  # fmt: skip
        clip_grad_norm([p], -1.0)
    with pytest.raises(SpecError, match=r"norm_type=0; expected a float > 0, or inf"):
        clip_grad_norm([p], 1.0, norm_type=0)
    with pytest.raises(SpecError, match=r"\[clip_grad_value\] clip_value=-1"):
        clip_grad_value([p], -1)
    with pytest.raises(LeanRNNError, match=r"params\[0\] is a ndarray"):
        clip_grad_norm([p.grad], 1.0)
    np.testing.assert_array_equal(p.grad, 1.0)
    assert clip_grad_norm([], 1.0) == 0.0
    assert clip_grad_norm(p, 1.0) == pytest.approx(np.sqrt(3))


def test_load_state_dict_rejects_bad_input_and_leaves_optimizer_unharmed(rng):
    a = _params(rng, np.float32)
    b = [Parameter(p.value.copy()) for p in a]
    opt_a, opt_b = Adam(a, lr=0.05, amsgrad=True), Adam(b, lr=0.05, amsgrad=True)
    for _ in range(2):
        _feed(rng, a)
        for p, q in zip(a, b, strict=True):
            q.grad[...] = p.grad
        opt_a.step()
        opt_b.step()
    good = opt_a.state_dict()

    def bad(edit):
        sd = opt_a.state_dict()
        edit(sd)
        return sd

    cases = [
        (bad(lambda sd: sd["state"][1].update(exp_avg=np.zeros((5, 3)))), ShapeError,
         r"\[Adam.load_state_dict\] state\[1\] \(p1\)\['exp_avg'\] has shape \(5, 3\); expected \(3, 5\)"),
        (bad(lambda sd: sd["state"][0].update(exp_avg_sq=np.zeros(7, np.int32))), DTypeError, r"dtype int32"),
        (bad(lambda sd: sd["state"][0].pop("exp_avg")), LeanRNNError, r"has keys \['exp_avg_sq', 'max_exp_avg_sq', 'step'\]; expected \['exp_avg', 'exp_avg_sq', 'step'\]"),
        (bad(lambda sd: sd["state"][0].update(momentum_buffer=np.zeros(7))), LeanRNNError, r"and of \['max_exp_avg_sq'\] any"),
        (bad(lambda sd: sd["state"][2].update(step=-1)), LeanRNNError, r"\['step'\] is -1; expected a whole number >= 0"),
        (bad(lambda sd: sd["state"].update({9: {}})), LeanRNNError, r"parameter 9; expected indices 0..3"),
        (bad(lambda sd: sd["param_groups"][0].update(params=[0, 1])), LeanRNNError, r"same 4 parameters"),
        (bad(lambda sd: sd["param_groups"][0].update(lr=-1.0)), SpecError, r"lr=-1.0"),
        (bad(lambda sd: sd["param_groups"][0].update(momentum=0.9)), LeanRNNError, r"unexpected keys \['momentum'\]"),
        (bad(lambda sd: sd["param_groups"][0].update(decoupled_weight_decay=True)), SpecError, r"load it into AdamW"),
        (bad(lambda sd: sd.pop("state")), LeanRNNError, r"expected a dict with keys"),
        (bad(lambda sd: sd["state"][0].update(exp_avg=np.zeros((5, 3)))) | {"param_groups": [dict(good["param_groups"][0], lr=9.0)]}, ShapeError, r"expected \(7,\)"),
    ]  # fmt: skip
    for sd, err, match in cases:
        with pytest.raises(err, match=match):
            opt_a.load_state_dict(sd)
    assert opt_a.lr == 0.05  # the last case's lr was not taken either
    with pytest.raises(SpecError, match=r"load it into Adam"):
        AdamW(b).load_state_dict(good)
    for _ in range(2):
        _feed(rng, a)
        for p, q in zip(a, b, strict=True):
            q.grad[...] = p.grad
        opt_a.step()
        opt_b.step()
    for p, q in zip(a, b, strict=True):
        np.testing.assert_array_equal(p.value, q.value)


def test_state_of_another_models_optimizer_is_refused_though_its_panels_match():
    """A red team's finding (session 34): LSTM H=6 and H=7 pack to the same panel shapes, and
    Adam loaded the H=7 state, its next step writing into the H=6 model's padding."""
    import leanrnn
    from leanrnn.train import Adam, Trainer

    x = np.ones((5, 2, 4), np.float32)
    opts = {}
    for H in (6, 7):
        tr = Trainer(leanrnn.LSTM(4, H, seed=0))
        opts[H] = Adam(tr.parameters(), lr=0.1)
        tr.backward(tr.forward(x), np.ones((5, 2, H), np.float32))
        opts[H].step()
    assert [p.shape for p in opts[6]._params] == [p.shape for p in opts[7]._params]
    before = opts[6].state_dict()
    with pytest.raises(LeanRNNError, match=r"parameter 0: \[28, 4\] there, \[24, 4\] here"):
        opts[6].load_state_dict(opts[7].state_dict())
    after = opts[6].state_dict()
    for i, s in before["state"].items():  # nothing changed
        for k, v in s.items():
            np.testing.assert_array_equal(v, after["state"][i][k])
    opts[6].load_state_dict(before)  # its own: taken
    sd = opts[6].state_dict()
    del sd["param_groups"][0]["shapes"]  # a state dict as torch's own carry none: taken
    opts[6].load_state_dict(sd)


@pytest.mark.parametrize("shapes", [[[2, 3]], 5, [[2, "3"], [4]], [[2, 3], [4], [5]]])
def test_malformed_shapes_in_a_state_dict_are_a_clear_error(shapes):
    """(a review's finding: a short list raised a bare StopIteration, a non-list a TypeError)"""
    ps = [Parameter(np.zeros((2, 3), np.float32)), Parameter(np.zeros(4, np.float32))]
    opt = OURS["Adam"](ps)
    sd = opt.state_dict()
    assert sd["param_groups"][0]["shapes"] == [[2, 3], [4]]
    sd["param_groups"][0]["shapes"] = shapes
    with pytest.raises(LeanRNNError, match="shapes"):
        opt.load_state_dict(sd)

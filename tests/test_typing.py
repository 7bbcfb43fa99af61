"""leanrnn ships py.typed: its annotations are API. They resolve at run time
(typing.get_type_hints; names imported for type checkers only raised NameError), and user code
written from the README type-checks under mypy --strict (where mypy is installed): the model's
session, the calls' tuples per cell, memory limits such as 4e6, numpy ints, Trainer.autocast
set, Trainer.matmul, any Mapping as a state dict, and typos in leanrnn.X flagged."""

from __future__ import annotations

import inspect
import os
import textwrap
import typing
from pathlib import Path

import numpy as np
import pytest

import leanrnn
import leanrnn.ir
from leanrnn import GraphModel, Model, RNNSpec, Session
from leanrnn.engine.model import RunnableModel
from leanrnn.memory.planner import Plan
from leanrnn.train import Adam, AdamW, Trainer
from leanrnn.train.session import Tape

SRC = Path(leanrnn.__file__).parent.parent


def _hinted():
    return [
        RunnableModel.run,
        RunnableModel.resize,
        RunnableModel.describe,
        RunnableModel,
        leanrnn.ir.Graph,
        leanrnn.ir.Node,
        Model,
        Model.forward,
        Model.__call__,
        Model.resize,
        Model.stream,
        Model.describe,
        Model.astype,
        Model.from_state_dict,
        leanrnn.LSTM.__init__,
        leanrnn.RNN.__init__,
        Session.__init__,
        Session.run,
        Session.resize,
        Session.planned,
        Session.stream,
        Trainer,
        Trainer.__init__,
        Trainer.forward,
        Trainer.backward,
        Trainer.gradients,
        Tape.__init__,
        Adam.__init__,
        AdamW.__init__,
        RNNSpec,
        leanrnn.load,
        leanrnn.save,
        leanrnn.quantize,
        leanrnn.from_state_dict,
        leanrnn.score,
    ]


@pytest.mark.parametrize("obj", _hinted(), ids=lambda o: getattr(o, "__qualname__", repr(o)))
def test_type_hints_resolve(obj):
    typing.get_type_hints(obj)


def test_resolved_types():
    hints = typing.get_type_hints
    assert hints(leanrnn.load)["return"] == Model | GraphModel  # (RunnableModel has no .spec)
    assert hints(RunnableModel.resize)["return"] is Plan
    assert hints(Model.resize)["return"] is Plan
    assert hints(Model)["session"] is Session
    assert float in typing.get_args(hints(Session.resize)["memory_limit"])
    assert float in typing.get_args(hints(Trainer.__init__)["memory_limit"])
    assert np.integer in typing.get_args(hints(Session.resize)["steps"])
    assert hints(leanrnn.ir.Graph)["packed"] == dict[str, leanrnn.PackedWeights]
    sig = inspect.signature(RunnableModel.resize, eval_str=True)
    assert sig.return_annotation is Plan


@pytest.mark.parametrize(
    "name, kind",
    [("input_size", int), ("hidden_size", int), ("num_layers", int), ("bias", bool),
     ("batch_first", bool), ("bidirectional", bool), ("proj_size", int), ("dropout", float)],
)  # fmt: skip
def test_torch_attributes_are_typed_properties(name, kind):
    prop = inspect.getattr_static(Model, name)
    assert isinstance(prop, property) and prop.fset is None
    assert typing.get_type_hints(prop.fget)["return"] is kind
    m = leanrnn.LSTM(3, 4, num_layers=2, bidirectional=True, batch_first=True, seed=0)
    value = getattr(m, name)
    assert isinstance(value, kind)
    assert value == {"input_size": 3, "hidden_size": 4, "num_layers": 2, "bias": True,
                     "batch_first": True, "bidirectional": True, "proj_size": 0,
                     "dropout": 0.0}[name]  # fmt: skip
    with pytest.raises(AttributeError, match="cannot set"):
        setattr(m, name, value)


def test_lazy_names_still_resolve_and_typos_raise():
    assert leanrnn.quantize is leanrnn.reduced.quantize
    assert leanrnn.load.__module__ == "leanrnn.loading"
    with pytest.raises(AttributeError, match="has no attribute 'LSMT'"):
        leanrnn.LSMT  # noqa: B018


def test_spec_activations_filled_and_none_still_taken():
    for spec in (RNNSpec("gru", 2, 3), RNNSpec("gru", 2, 3, activations=None)):
        assert [a.name for a in spec.activations[0]] == ["sigmoid", "tanh"]


def test_quantize_gives_the_class_back():
    for cls in (leanrnn.LSTM, leanrnn.GRU, leanrnn.RNN):
        assert type(leanrnn.quantize(cls(4, 8, seed=0), "bf16")) is cls


def test_numpy_ints_and_whole_float_limits_run():
    # what the annotations now admit is what runs
    m = leanrnn.LSTM(4, 8, seed=np.uint32(3), threads=np.int64(1))
    m.session.resize(np.int64(2), np.int64(5), memory_limit=4e6)
    assert m.describe(np.int64(2), np.int64(5))["batch"] == 2
    tr = Trainer(m, threads=np.int64(1), segment=np.int64(4), seed=np.int64(0), memory_limit=5e8)
    assert tr.memory_limit == 500_000_000 and tr.segment == 4
    tr.autocast = None
    opt = Adam(tr.parameters(), betas=[0.9, 0.99])
    assert opt.param_groups[0]["betas"] == (0.9, 0.99)


# A user program from the README (and what the typing review found refused): mypy --strict
# must pass it. Each line runs; the test type-checks it only.
USER_PROGRAM = """
from __future__ import annotations

import types
import typing

import numpy as np
import numpy.typing as npt

import leanrnn
from leanrnn import GraphModel, Model, Session, Stream
from leanrnn.train import Adam, Tape, Trainer

F32 = npt.NDArray[np.float32]


def models() -> tuple[F32, F32, F32]:
    lstm = leanrnn.LSTM(64, 128, num_layers=2, bidirectional=True, seed=np.uint32(0),
                        threads=np.int64(1))
    x = np.zeros((100, 8, 64), np.float32)
    y, (h_n, c_n) = lstm(x, lengths=np.full(8, 100))
    assert y.shape == (100, 8, 256) and h_n.shape == (4, 8, 128)
    _, (h_f, c_f) = lstm(x, return_sequences=False)
    hs: int = lstm.hidden_size
    bd: bool = lstm.bidirectional
    print(hs, bd, h_f.shape, c_f.shape)
    gru = leanrnn.GRU(4, 8, seed=0)
    yg, hg = gru(np.zeros((3, 2, 4), np.float32))
    print(yg.shape, hg.shape)
    s: Session = lstm.session
    s.resize(batch=8, steps=np.int64(100), memory_limit=4e6)
    y, h_n, c_n = s.run(x, out=(y, h_n, c_n))
    st: Stream = lstm.stream(batch=1)
    d: dict[str, typing.Any] = lstm.describe(np.int64(8), 100)
    print(st, d)
    return y, h_n, c_n


def loaded(path: str) -> None:
    m = leanrnn.load(path)
    if isinstance(m, Model):
        print(m.spec, m.session, m.state_dict().keys(), m.dtype, m.hidden_size)
    else:
        g: GraphModel = leanrnn.quantize(m, "int8")
        print(g.graph.name)
    q = leanrnn.quantize(leanrnn.LSTM(8, 16, seed=0), "int8")
    print(q.weights.precision, q.hidden_size)
    q.session.resize(2, 3)
    sd = types.MappingProxyType(q.state_dict())
    m2: leanrnn.LSTM = leanrnn.LSTM.from_state_dict(sd)
    print(m2.spec.activations[0][0].name, leanrnn.from_state_dict(sd))


def my_matmul(a: np.ndarray, b: np.ndarray, out: np.ndarray) -> None:
    np.matmul(a, b, out=out)


def train() -> None:
    model = leanrnn.LSTM(8, 16, seed=0)
    tr = Trainer(model, memory_limit=5e8, threads=np.int64(1), seed=np.int64(0))
    tr.autocast = None
    tr.matmul = my_matmul
    opt = Adam(tr.parameters(), betas=[0.9, 0.99])
    tape: Tape = tr.forward(np.zeros((5, 2, 8), np.float32))
    print(tape.h_n.shape, tape.c_n.shape)
    dx, dh0, dc0 = tr.backward(tape, np.ones_like(tape.y))
    print(dx.shape, dh0.shape, tr.gradients()[0][0].W.shape, opt)
"""


@pytest.fixture(scope="module")
def mypy_on_source():
    """mypy --strict over a program, leanrnn read from this source tree (its own errors
    silenced, as an installed package's are): (exit status, report)."""
    api = pytest.importorskip("mypy.api")

    def check(tmp: Path, program: str) -> tuple[int, str]:
        path = tmp / "user_program.py"
        path.write_text(textwrap.dedent(program))
        old = os.environ.get("MYPYPATH")
        os.environ["MYPYPATH"] = str(SRC)
        try:
            out, err, status = api.run(["--strict", "--follow-imports=silent", "--no-incremental",
                                        "--cache-dir", os.devnull, str(path)])  # fmt: skip
        finally:
            if old is None:
                del os.environ["MYPYPATH"]
            else:
                os.environ["MYPYPATH"] = old
        return status, out + err

    return check


def test_user_program_type_checks(mypy_on_source, tmp_path):
    status, report = mypy_on_source(tmp_path, USER_PROGRAM)
    assert status == 0, report


def test_typos_and_wrong_types_are_flagged(mypy_on_source, tmp_path):
    status, report = mypy_on_source(tmp_path, """
        import leanrnn

        def make() -> None:
            leanrnn.LSMT(8, 16)
            lstm = leanrnn.LSTM(8, 16)
            y, h_n = lstm(lstm.session)
    """)  # fmt: skip
    assert status == 1, report
    assert 'Module has no attribute "LSMT"' in report, report
    assert "[arg-type]" in report or "[call-overload]" in report, report

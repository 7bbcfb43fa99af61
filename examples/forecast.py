"""A recurrent forecaster of a real series, trained three ways on the same windows from the same
initial weights: torch.nn.GRU (or LSTM), leanrnn.torch's (the same script with the module
swapped), and numpy-only leanrnn (leanrnn.train: head and loss written in numpy).

The series ships with statsmodels (``pip install leanrnn[examples]``): the yearly sunspot
numbers 1700-2008 (default) or the weekly Mauna Loa CO2 record (``--series co2``). It is
normalised by the training part's mean and deviation and cut into sliding windows of
``--window`` steps; the model reads a window and predicts, at every step, the next value (mean
squared error). The first 80% of the series trains, windows wholly inside the last 20% validate.

    python examples/forecast.py --engine numpy --plot sunspots.png
    python examples/forecast.py --compare --plot sunspots_compare.png     # all three
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parent))
import _common as common


def parse(argv: list[str] | None) -> argparse.Namespace:
    # no abbreviations: --compare's children get argv without --compare, and "--compar" kept
    # in it made each child compare again (processes without end)
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0], allow_abbrev=False,
                                formatter_class=argparse.RawDescriptionHelpFormatter)  # fmt: skip
    common.add_common_args(p, steps=300)
    p.add_argument("--series", choices=("sunspots", "co2"), default="sunspots")
    p.add_argument("--cell", choices=("gru", "lstm"), default="gru")
    p.add_argument("--hidden", type=common.count, default=64)
    p.add_argument("--layers", type=common.count, default=1)
    p.add_argument("--window", type=common.count, default=24, help="steps per window")
    p.add_argument("--batch", type=common.count, default=32, help="windows per step")
    p.add_argument("--clip", type=common.rate, default=1.0, help="max gradient norm")
    p.add_argument("--dump-init", metavar="NPZ", help=argparse.SUPPRESS)
    args = p.parse_args(argv)
    args.lr = 5e-3 if args.lr is None else args.lr
    args.eval_every = args.eval_every or max(1, args.steps // 20)
    return args


# ---------------------------------------------------------------------------------- data


def load_series(name: str) -> tuple[np.ndarray, str]:
    try:
        from statsmodels import datasets
    except ImportError:
        raise SystemExit(
            "[forecast] the series ship with statsmodels, which is not installed; "
            "pip install 'leanrnn[examples]' (or statsmodels)"
        ) from None
    if name == "sunspots":
        df = datasets.sunspots.load_pandas().data
        return df["SUNACTIVITY"].to_numpy(np.float64), "yearly sunspot numbers 1700-2008"
    s = datasets.co2.load_pandas().data["co2"].interpolate()  # a few missing weeks
    return s.to_numpy(np.float64), "weekly CO2 at Mauna Loa 1958-2001"


def load_data(args) -> dict:
    """Train windows x, y [M, W] (y is x one step ahead), the validation windows, the scale."""
    series, what = load_series(args.series)
    cut = int(len(series) * 0.8)
    mean, std = series[:cut].mean(), series[:cut].std()
    z = ((series - mean) / std).astype(np.float32)
    W = args.window

    def cut_windows(part: np.ndarray):
        idx = np.arange(len(part) - W)[:, None] + np.arange(W + 1)[None, :]
        w = part[idx]
        return w[:, :-1], w[:, 1:]

    train, val = cut_windows(z[:cut]), cut_windows(z[cut:])
    if len(train[0]) < args.batch or len(val[0]) < 1:
        raise SystemExit(f"[forecast] {len(series)} values give {len(train[0])} training and "
                         f"{len(val[0])} validation windows of {W}; expected at least "
                         f"--batch {args.batch} and 1: lower --window or --batch")  # fmt: skip
    return dict(train=train, val=val, std=std, what=what, n=len(series))


def batches(data: dict, N: int, seed: int):
    """Endless [W, N] batches (time-major) of shuffled windows, epoch by epoch, from a numpy
    generator: the same order for every engine."""
    x, y = data["train"]
    rng = np.random.default_rng(seed)
    while True:
        order = rng.permutation(len(x))
        for i in range(0, len(order) - N + 1, N):
            j = order[i : i + N]
            yield x[j].T.copy(), y[j].T.copy()


# --------------------------------------------------------------------------------- weights


def torch_init(args) -> dict:
    import torch

    torch.manual_seed(args.seed)
    rnn = {"gru": torch.nn.GRU, "lstm": torch.nn.LSTM}[args.cell](1, args.hidden, args.layers)
    mods = dict(rnn=rnn, head=torch.nn.Linear(args.hidden, 1))
    return {f"{m}.{k}": v.detach().numpy().copy()
            for m, mod in mods.items() for k, v in mod.state_dict().items()}  # fmt: skip


def numpy_init(args) -> dict:
    """torch's default distributions (other draws), when torch is not installed."""
    rng = np.random.default_rng(args.seed)
    H, G = args.hidden, {"gru": 3, "lstm": 4}[args.cell] * args.hidden
    u = lambda shape: rng.uniform(-(H**-0.5), H**-0.5, shape).astype(np.float32)  # noqa: E731
    sd = {"head.weight": u((1, H)), "head.bias": u((1,))}
    for layer in range(args.layers):
        sd[f"rnn.weight_ih_l{layer}"] = u((G, 1 if layer == 0 else H))
        sd[f"rnn.weight_hh_l{layer}"] = u((G, H))
        sd[f"rnn.bias_ih_l{layer}"] = u((G,))
        sd[f"rnn.bias_hh_l{layer}"] = u((G,))
    return sd


# ---------------------------------------------------------------------------------- engines


def train_torch(args, data: dict, init: dict, swap: bool) -> dict:
    """torch GRU/LSTM -> Linear; ``swap``: the recurrent module is leanrnn.torch's."""
    import torch

    if swap:
        lt = common.import_leanrnn_torch()

        cls = {"gru": lt.GRU, "lstm": lt.LSTM}[args.cell]
    else:
        cls = {"gru": torch.nn.GRU, "lstm": torch.nn.LSTM}[args.cell]

    class Forecaster(torch.nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.rnn = cls(1, args.hidden, args.layers)
            self.head = torch.nn.Linear(args.hidden, 1)

        def forward(self, x):  # x [W, N] -> next values [W, N]
            y, _ = self.rnn(x.unsqueeze(-1))
            return self.head(y).squeeze(-1)

    model = Forecaster()
    model.load_state_dict({k: torch.from_numpy(v) for k, v in init.items()})
    opt = torch.optim.Adam(model.parameters(), lr=args.lr)
    mse = torch.nn.functional.mse_loss
    vx, vy = (torch.from_numpy(a.T.copy()) for a in data["val"])

    def evaluate() -> float:
        model.eval()
        with torch.no_grad():
            loss = mse(model(vx), vy).item()
        model.train()
        return loss

    stream = batches(data, args.batch, args.seed)

    def step() -> float:
        x, y = next(stream)
        loss = mse(model(torch.from_numpy(x)), torch.from_numpy(y))
        loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), args.clip)
        opt.step()
        opt.zero_grad()
        return loss.item()

    return common.loop(args, step, evaluate)


def train_numpy(args, data: dict, init: dict) -> dict:
    """The same model with numpy only: the recurrence on leanrnn's kernels (Trainer), the
    linear head and the squared error written here, Adam and clipping from leanrnn.train.optim."""
    import leanrnn
    from leanrnn.train import Trainer, optim

    H = args.hidden
    rnn = leanrnn.from_state_dict({k[4:]: v for k, v in init.items() if k.startswith("rnn.")},
                                  cell=args.cell)  # fmt: skip
    tr = Trainer(rnn, threads=args.threads)
    Wo = optim.Parameter(init["head.weight"].copy(), name="head.weight")  # [1, H]
    bo = optim.Parameter(init["head.bias"].copy(), name="head.bias")  # [1]
    rnn_params = tr.parameters()
    params = [*rnn_params, Wo, bo]
    opt = optim.Adam(params, lr=args.lr)
    vx, vy = (a.T.copy() for a in data["val"])

    def forward(x):
        tape = tr.forward(x[:, :, None])
        y = tape.y.reshape(-1, H)
        return tape, y, (y @ Wo.value.T + bo.value)[:, 0]

    def evaluate() -> float:
        _, _, pred = forward(vx)
        return float(np.mean((pred - vy.reshape(-1)) ** 2))

    stream = batches(data, args.batch, args.seed)

    def step() -> float:
        x, y = next(stream)
        tape, yflat, pred = forward(x)
        err = pred - y.reshape(-1)
        loss = float(np.mean(err * err))
        dpred = (2.0 / err.size) * err  # d mean(err^2) / d pred
        Wo.grad += dpred @ yflat
        bo.grad += dpred.sum()
        dy = np.multiply.outer(dpred, Wo.value[0]).reshape(tape.y.shape)
        tr.backward(tape, dy, input_grad=False)
        optim.clip_grad_norm(params, args.clip)
        opt.step()
        opt.zero_grad()
        return loss

    return common.loop(args, step, evaluate)


def main(argv: list[str] | None = None):
    """Run as the command line says; returns the run's record (a list with ``--compare``)."""
    argv = sys.argv[1:] if argv is None else list(argv)
    args = parse(argv)
    if args.dump_init:
        np.savez(args.dump_init, **torch_init(args))
        return None
    data = load_data(args)
    if args.compare:
        return common.compare(__file__, argv, args,
                              lambda path: np.savez(path, **(torch_init(args) if common.have("torch")
                                                             else numpy_init(args))))  # fmt: skip
    restore_threads = common.set_threads(args.threads, args.engine)
    try:
        return _run(args, argv, data)
    finally:
        restore_threads()


def _run(args, argv: list[str], data: dict) -> dict:
    init = common.init_arrays(args.init, lambda: torch_init(args), lambda: numpy_init(args),
                              args.engine, __file__, argv)  # fmt: skip
    if args.engine == "numpy":
        record = train_numpy(args, data, init)
    else:
        record = train_torch(args, data, init, swap=args.engine == "leanrnn-torch")
    record.update(engine=args.engine, loss_name="mean squared error (normalised units)",
                  title=f"{args.cell.upper()} forecaster, {data['what']} (H={args.hidden}, "
                        f"window {args.window}, batch {args.batch})",
                  val_rmse=float(np.sqrt(record["val_loss"][-1]) * data["std"]))  # fmt: skip
    return common.finish(args, record)


if __name__ == "__main__":
    main()

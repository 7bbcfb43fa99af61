"""A character-level LSTM language model, trained three ways on the same data from the same
initial weights: torch.nn.LSTM, leanrnn.torch.LSTM (the same script with the module swapped),
and numpy-only leanrnn (leanrnn.train: embedding, head and cross-entropy written in numpy).

The corpus is the Python standard library's own source (a fixed list of modules, present on
every machine), or any text file (``--text FILE``); its last tenth is held out for validation.
The loop is PyTorch's word-language-model one: the text cut into ``--batch`` columns, truncated
BPTT over windows of ``--bptt`` characters with the state carried across windows (detached),
gradient clipping, and ``--accum`` windows accumulated per optimizer step.

    python examples/char_lm.py --engine numpy --plot lm.png
    python examples/char_lm.py --compare --plot lm_compare.png     # all three, side by side
"""

from __future__ import annotations

import argparse
import sys
import sysconfig
from pathlib import Path

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parent))
import _common as common

# Modules present in every CPython from 3.11 on; read in this order (reproducible data order).
STDLIB_FILES = (
    "argparse.py", "inspect.py", "typing.py", "dataclasses.py", "functools.py",
    "collections/__init__.py", "textwrap.py", "subprocess.py", "tarfile.py", "difflib.py",
    "enum.py", "shutil.py", "logging/__init__.py", "heapq.py", "random.py", "statistics.py",
    "fractions.py", "calendar.py", "csv.py", "configparser.py", "pprint.py", "contextlib.py",
    "ast.py", "tokenize.py", "threading.py", "queue.py",
)  # fmt: skip


def parse(argv: list[str] | None) -> argparse.Namespace:
    # no abbreviations: --compare's children get argv without --compare, and "--compar" kept
    # in it made each child compare again (processes without end)
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0], allow_abbrev=False,
                                formatter_class=argparse.RawDescriptionHelpFormatter)  # fmt: skip
    common.add_common_args(p, steps=300)
    p.add_argument("--text", metavar="FILE", help="train on this text file instead of the stdlib")
    p.add_argument("--hidden", type=common.count, default=128)
    p.add_argument("--layers", type=common.count, default=1)
    p.add_argument("--embed", type=common.count, default=32)
    p.add_argument("--batch", type=common.count, default=32, help="columns the text is cut into")
    p.add_argument(
        "--bptt", type=common.count, default=64, help="characters per truncated-BPTT window"
    )
    p.add_argument("--accum", type=common.count, default=1, help="windows accumulated per step")
    p.add_argument("--clip", type=common.rate, default=1.0, help="max gradient norm")
    p.add_argument(
        "--val-windows", type=common.count, default=8, help="validation windows per eval"
    )
    p.add_argument("--dump-init", metavar="NPZ", help=argparse.SUPPRESS)
    args = p.parse_args(argv)
    args.lr = 3e-3 if args.lr is None else args.lr
    args.eval_every = args.eval_every or max(1, args.steps // 10)
    return args


# ---------------------------------------------------------------------------------- data


def read_corpus(text_file: str | None) -> str:
    if text_file:
        try:
            return Path(text_file).read_text(encoding="utf-8")
        except OSError as e:
            raise SystemExit(f"[char_lm] --text {text_file}: {e.strerror}; expected a readable "
                             "text file") from None  # fmt: skip
        except UnicodeDecodeError as e:  # (replaced, Latin-1's letters became one character)
            raise SystemExit(f"[char_lm] --text {text_file}: not UTF-8 text (byte {e.start}: "
                             f"{e.object[e.start:e.start + 1]!r}); convert it first, e.g. iconv "
                             "-f latin1 -t utf-8") from None  # fmt: skip
    root = Path(sysconfig.get_paths()["stdlib"])
    parts = [(root / f).read_text(encoding="utf-8") for f in STDLIB_FILES if (root / f).exists()]
    if not parts:
        raise SystemExit(f"[char_lm] none of the stdlib sources were found under {root}; "
                         "pass --text FILE")  # fmt: skip
    return "\n".join(parts)


def load_data(args) -> dict:
    """Token ids of the train and validation text cut into ``batch`` columns ([L, N], as
    PyTorch's word-language-model ``batchify``), and the vocabulary (sorted characters)."""
    text = read_corpus(args.text)
    codes = np.frombuffer(text.encode("utf-32-le"), np.uint32)  # one code point per char
    points, ids = np.unique(codes, return_inverse=True)  # vocab: the sorted characters
    vocab = [chr(c) for c in points]
    ids = ids.astype(np.int64)
    cut = int(len(ids) * 0.9)
    train, val = ids[:cut], ids[cut:]
    N = args.batch
    need = args.bptt + 1
    if len(train) // N < need or len(val) // N < need:
        raise SystemExit(f"[char_lm] the text has {len(text)} characters; expected at least "
                         f"{need * N * 10} for --batch {N} --bptt {args.bptt}")  # fmt: skip
    col = lambda a: a[: len(a) // N * N].reshape(N, -1).T.copy()  # noqa: E731
    val = col(val)[: args.val_windows * args.bptt + 1]
    return dict(train=col(train), val=val, vocab=vocab, chars=len(text))


def windows(data: np.ndarray, bptt: int):
    """Endless (x [T, N], y [T, N], fresh) over the columns; ``fresh`` at the start and after
    wrapping around, where the carried state must start from zero again."""
    while True:
        for i in range(0, len(data) - 1 - bptt + 1, bptt):
            yield data[i : i + bptt], data[i + 1 : i + 1 + bptt], i == 0


# --------------------------------------------------------------------------------- weights


def torch_init(args, V: int) -> dict:
    """torch's default initialisation under the seed, as torch-named numpy arrays."""
    import torch

    torch.manual_seed(args.seed)
    mods = dict(embed=torch.nn.Embedding(V, args.embed),
                rnn=torch.nn.LSTM(args.embed, args.hidden, args.layers),
                head=torch.nn.Linear(args.hidden, V))  # fmt: skip
    return {f"{m}.{k}": v.detach().numpy().copy()
            for m, mod in mods.items() for k, v in mod.state_dict().items()}  # fmt: skip


def numpy_init(args, V: int) -> dict:
    """The same distributions as torch's defaults (other draws), when torch is not installed."""
    rng = np.random.default_rng(args.seed)
    E, H = args.embed, args.hidden
    u = lambda shape, fan: rng.uniform(-(fan**-0.5), fan**-0.5, shape).astype(np.float32)  # noqa: E731
    sd = {"embed.weight": rng.standard_normal((V, E)).astype(np.float32),
          "head.weight": u((V, H), H), "head.bias": u((V,), H)}  # fmt: skip
    for layer in range(args.layers):
        cin = E if layer == 0 else H
        sd[f"rnn.weight_ih_l{layer}"] = u((4 * H, cin), H)
        sd[f"rnn.weight_hh_l{layer}"] = u((4 * H, H), H)
        sd[f"rnn.bias_ih_l{layer}"] = u((4 * H,), H)
        sd[f"rnn.bias_hh_l{layer}"] = u((4 * H,), H)
    return sd


# ---------------------------------------------------------------------------------- engines


def train_torch(args, data: dict, init: dict, swap: bool) -> dict:
    """torch.nn.Embedding -> LSTM -> Linear; ``swap``: the LSTM is leanrnn.torch.LSTM."""
    import torch

    V = len(data["vocab"])
    if swap:
        lt = common.import_leanrnn_torch()

        lstm_cls = lt.LSTM
    else:
        lstm_cls = torch.nn.LSTM

    class CharLM(torch.nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.embed = torch.nn.Embedding(V, args.embed)
            self.rnn = lstm_cls(args.embed, args.hidden, args.layers)
            self.head = torch.nn.Linear(args.hidden, V)

        def forward(self, x, state):
            y, state = self.rnn(self.embed(x), state)
            return self.head(y), state

    model = CharLM()
    model.load_state_dict({k: torch.from_numpy(v) for k, v in init.items()})
    opt = torch.optim.Adam(model.parameters(), lr=args.lr)
    ce = torch.nn.functional.cross_entropy
    zeros = lambda N: tuple(torch.zeros(args.layers, N, args.hidden) for _ in range(2))  # noqa: E731

    def evaluate() -> float:
        model.eval()
        total, state = 0.0, zeros(args.batch)
        with torch.no_grad():
            val = torch.from_numpy(data["val"])
            for i in range(0, len(val) - 1, args.bptt):
                x, y = val[i : i + args.bptt], val[i + 1 : i + 1 + args.bptt]
                logits, state = model(x[: len(y)], state)
                total += ce(logits.reshape(-1, V), y.reshape(-1), reduction="sum").item()
        model.train()
        return total / (len(val) - 1) / args.batch

    batches = windows(data["train"], args.bptt)
    state = zeros(args.batch)

    def step() -> float:
        nonlocal state
        total = 0.0
        for _ in range(args.accum):
            x, y, fresh = next(batches)
            if fresh:
                state = zeros(args.batch)
            state = tuple(s.detach() for s in state)  # repackage_hidden: truncated BPTT
            logits, state = model(torch.from_numpy(x), state)
            loss = ce(logits.reshape(-1, V), torch.from_numpy(y).reshape(-1))
            (loss / args.accum).backward()
            total += loss.item()
        torch.nn.utils.clip_grad_norm_(model.parameters(), args.clip)
        opt.step()
        opt.zero_grad()
        return total / args.accum

    return common.loop(args, step, evaluate)


def cross_entropy(logits: np.ndarray, target: np.ndarray, scale: float):
    """Mean softmax cross-entropy over rows and its gradient times ``scale``, in place of
    ``logits`` (no second [M, V] array)."""
    M = len(target)
    rows = np.arange(M)
    logits -= logits.max(axis=1, keepdims=True)
    picked = logits[rows, target].copy()
    np.exp(logits, out=logits)
    sums = logits.sum(axis=1, keepdims=True)
    loss = float(np.mean(np.log(sums[:, 0]) - picked))
    logits /= sums  # softmax
    logits[rows, target] -= 1
    logits *= scale / M
    return loss, logits


def embedding_grad(grad: np.ndarray, ids: np.ndarray, d: np.ndarray) -> None:
    """grad[ids[i]] += d[i] for every row i, repeated ids summed: the rows sorted by id and
    each run of one id reduced at once (np.add.at, unbuffered, took ~1 ms a step here)."""
    order = np.argsort(ids, kind="stable")
    sorted_ids = ids[order]
    starts = np.flatnonzero(np.r_[True, sorted_ids[1:] != sorted_ids[:-1]])
    grad[sorted_ids[starts]] += np.add.reduceat(d[order], starts, axis=0)


def train_numpy(args, data: dict, init: dict) -> dict:
    """The same model with numpy only: the LSTM on leanrnn's kernels (leanrnn.train.Trainer),
    the embedding, head and loss written here, Adam and clipping from leanrnn.train.optim."""
    import leanrnn
    from leanrnn.train import Trainer, optim

    H, L = args.hidden, args.layers
    rnn = leanrnn.from_state_dict({k[4:]: v for k, v in init.items() if k.startswith("rnn.")},
                                  cell="lstm")  # fmt: skip
    tr = Trainer(rnn, threads=args.threads)
    emb = optim.Parameter(init["embed.weight"].copy(), name="embed.weight")
    Wo = optim.Parameter(init["head.weight"].copy(), name="head.weight")
    bo = optim.Parameter(init["head.bias"].copy(), name="head.bias")
    lstm_params = tr.parameters()
    params = [emb, *lstm_params, Wo, bo]
    opt = optim.Adam(params, lr=args.lr)
    zeros = lambda N: (np.zeros((L, N, H), np.float32), np.zeros((L, N, H), np.float32))  # noqa: E731

    def forward(x, state):
        tape = tr.forward(emb.value[x], state)
        y = tape.y.reshape(-1, H)
        return tape, y, y @ Wo.value.T + bo.value

    def evaluate() -> float:
        total, state, val = 0.0, zeros(args.batch), data["val"]
        for i in range(0, len(val) - 1, args.bptt):
            x, y = val[i : i + args.bptt], val[i + 1 : i + 1 + args.bptt]
            tape, _, logits = forward(x[: len(y)], state)
            state = (tape.h_n, tape.c_n)
            total += cross_entropy(logits, y.reshape(-1), 0.0)[0] * y.size
        return total / (len(val) - 1) / args.batch

    batches = windows(data["train"], args.bptt)
    state = zeros(args.batch)

    def step() -> float:
        nonlocal state
        total = 0.0
        for _ in range(args.accum):
            x, y, fresh = next(batches)
            if fresh:
                state = zeros(args.batch)
            # the state is carried as plain arrays: backward stops at the window's start
            tape, yflat, logits = forward(x, state)
            state = (tape.h_n, tape.c_n)
            loss, dlogits = cross_entropy(logits, y.reshape(-1), 1.0 / args.accum)
            Wo.grad += dlogits.T @ yflat
            bo.grad += dlogits.sum(axis=0)
            dy = (dlogits @ Wo.value).reshape(tape.y.shape)
            dx, _, _ = tr.backward(tape, dy)
            embedding_grad(emb.grad, x.reshape(-1), dx.reshape(-1, args.embed))
            total += loss
        optim.clip_grad_norm(params, args.clip)
        opt.step()
        opt.zero_grad()
        return total / args.accum

    return common.loop(args, step, evaluate)


def main(argv: list[str] | None = None):
    """Run as the command line says; returns the run's record (a list of them with
    ``--compare``)."""
    argv = sys.argv[1:] if argv is None else list(argv)
    args = parse(argv)
    data = load_data(args)
    V = len(data["vocab"])
    if args.dump_init:
        np.savez(args.dump_init, **torch_init(args, V))
        return None
    if args.compare:
        return common.compare(__file__, argv, args,
                              lambda path: np.savez(path, **(torch_init(args, V) if common.have("torch")
                                                             else numpy_init(args, V))))  # fmt: skip
    restore_threads = common.set_threads(args.threads, args.engine)
    try:
        return _run(args, argv, data)
    finally:
        restore_threads()


def _run(args, argv: list[str], data: dict) -> dict:
    V = len(data["vocab"])
    init = common.init_arrays(args.init, lambda: torch_init(args, V), lambda: numpy_init(args, V),
                              args.engine, __file__, argv)  # fmt: skip
    if args.engine == "numpy":
        record = train_numpy(args, data, init)
    else:
        record = train_torch(args, data, init, swap=args.engine == "leanrnn-torch")
    record.update(engine=args.engine, loss_name="cross-entropy (nats per character)",
                  title=f"char LSTM on {args.text or 'the stdlib sources'} ({data['chars']} "
                        f"chars, vocab {V}, H={args.hidden}, bptt {args.bptt}, batch "
                        f"{args.batch}x{args.accum})")  # fmt: skip
    return common.finish(args, record)


if __name__ == "__main__":
    main()

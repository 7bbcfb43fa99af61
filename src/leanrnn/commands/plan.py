"""``leanrnn plan``: every arena buffer of a model's plan (name, bytes, offset, first/last op),
the totals, and optionally the arena drawn as a timeline (matplotlib)."""

from __future__ import annotations

import argparse
import os
import re


def register(sub: argparse._SubParsersAction) -> None:
    from ..cli import positive_int, size

    p = sub.add_parser(
        "plan",
        help="show the memory plan of a model for a batch and length",
        description="MODEL is a model file (.lrnn, .onnx, state dict) or a shorthand such as "
        f"lstm:512 or gru:256x2 (cell:hidden[xlayers], input = hidden, hidden <= {MAX_HIDDEN}, "
        f"layers <= {MAX_LAYERS}). Sizes that cannot fit this machine's memory are refused "
        "before anything is built.",
    )
    p.add_argument(
        "model", help="model file (.lrnn, .onnx, state dict) or cell:hidden[xlayers], e.g. lstm:512"
    )
    p.add_argument("--batch", type=positive_int, default=1, help="N, sequences (default 1)")
    p.add_argument("--steps", type=positive_int, default=100, help="T, timesteps (default 100)")
    p.add_argument(
        "--chunk", type=positive_int, default=None, help="timesteps per chunk (default: auto)"
    )
    p.add_argument(
        "--memory-limit", type=size, default=None, help="arena bytes, e.g. 4M; picks the chunk"
    )
    p.add_argument("--png", default=None, metavar="FILE.png",
                   help="draw the arena timeline to this PNG file (a graph with several RNN "
                   "nodes: one file per node, FILE.png, FILE-1.png, FILE-2.png, ...)")  # fmt: skip
    p.add_argument(
        "--train",
        action="store_true",
        help="plan a training step (forward + backward) instead: the reserve backward needs, "
        "its scratch, the segments and the boundary states; --memory-limit picks the segments",
    )
    p.add_argument(
        "--recompute",
        action="store_true",
        help="with --train: keep only the states at segment boundaries and recompute each "
        "segment's forward during backward (O(sqrt(T)) memory; --chunk sets the segment)",
    )
    p.add_argument(
        "--autocast",
        action="store_true",
        help="with --train: mixed precision (Trainer(autocast=--autocast-mode)): the bf16 "
        "forward's scratch (q: split activation rows where the CPU multiplies bf16, or "
        "bf16-act's rounded ones) in the plan",
    )
    p.add_argument(
        "--autocast-mode",
        choices=("bf16", "bf16-act"),
        default=None,
        help="with --autocast: the weights rounded to bf16 (bf16, the default), or the "
        "activations they multiply too, as torch's autocast (bf16-act)",
    )
    from .model import add_state_dict_options

    add_state_dict_options(p)
    p.set_defaults(func=run)


# The shorthand builds random weights: bounded so that a typo is an error, not a build that
# runs out of memory (the memory check below refuses what the bounds let through but the
# machine cannot hold). The planner is O(layers^2): 256 layers plan in ~0.3 s.
MAX_HIDDEN = 1 << 20
MAX_LAYERS = 256
_SHORT = re.compile(r"^(lstm|gru|rnn):(\d+)(?:x(\d+))?$", re.IGNORECASE)
_SHORT_LIKE = re.compile(r"^(lstm|gru|rnn):", re.IGNORECASE)  # meant as one, maybe mistyped


def _bounded(op: str, name: str, text: str, hi: int) -> int:
    from leanrnn.errors import SpecError

    v = int(text) if len(text) <= 20 else hi + 1  # no int() of a 10,000-digit string
    if not 1 <= v <= hi:
        shown = text if len(text) <= 20 else f"{text[:8]}...({len(text)} digits)"
        raise SpecError(f"[{op}] {name}={shown}; expected 1..{hi:,}")
    return v


def random_model(op: str, cell: str, hidden: int, layers: int):
    """``cell`` with input = ``hidden`` and random weights, after checking by arithmetic that
    the weights fit this machine's memory (building them takes about 3x the packed bytes:
    float64 draws, the float32 state dict, the packed copy)."""
    import math

    import leanrnn
    from leanrnn.formats.packing import PackedWeights
    from leanrnn.memory.arena import check_fits, round_up
    from leanrnn.spec import RNNSpec

    hidden = _bounded(op, "hidden", str(hidden), MAX_HIDDEN)
    layers = _bounded(op, "layers", str(layers), MAX_LAYERS)
    spec = RNNSpec(cell, hidden, hidden, num_layers=layers)
    weight_bytes = sum(round_up(math.prod(s) * 4, 64) for _, s in PackedWeights.layout(spec))
    check_fits(3 * weight_bytes, f"building {cell.upper()} H={hidden} layers={layers} "
               f"({weight_bytes:,} bytes of packed weights, about 3x that while built)", op)  # fmt: skip
    cls = {"lstm": leanrnn.LSTM, "gru": leanrnn.GRU, "rnn": leanrnn.RNN}[cell]
    return cls(hidden, hidden, num_layers=layers, seed=0)


def load_model(ref: str, args=None, op: str = "plan"):
    """A model from a file (``args``: the state-dict flags, add_state_dict_options), or from the
    ``cell:hidden[xlayers]`` shorthand (random weights)."""
    from leanrnn.errors import ModelFormatError

    from .model import load_model as load_file
    from .model import load_options

    m = _SHORT.match(ref)
    if not m and _SHORT_LIKE.match(ref) and not os.path.exists(ref):  # lstm:16x-1, gru:abc
        raise ModelFormatError(f"[{op}] {ref!r} is neither a file nor a shorthand "
                               "cell:hidden[xlayers] (e.g. lstm:512x2, hidden and layers "
                               "positive integers)")  # fmt: skip
    if m and not os.path.exists(ref):
        given = sorted(load_options(args))  # (none for args None)
        if given:  # they would be ignored: the shorthand builds its own model
            flags = ", ".join("--" + k.replace("_", "-") for k in given)
            raise ModelFormatError(f"[{op}] {flags} given with the shorthand {ref!r}; these "
                                   "options are for state-dict files: drop them")  # fmt: skip
        H = _bounded(op, "hidden", m.group(2), MAX_HIDDEN)
        L = _bounded(op, "layers", m.group(3) or "1", MAX_LAYERS)
        return random_model(op, m.group(1).lower(), H, L)
    return load_file(ref, args)


def _sessions(model):
    """(name, Session) pairs: a graph model has one session per recurrent node (its packed
    weights; a GraphModel's own ``session`` is the whole graph's, which has no ``weights``)."""
    from leanrnn.engine import Session
    from leanrnn.graph_model import GraphModel

    if isinstance(model, GraphModel):
        owners = model.graph.weight_owners()  # nodes sharing weights (a decoder) say so
        return [(name if owners[name] == name else f"{name} (the weights of {owners[name]})",
                 Session(pw)) for name, pw in model.graph.packed.items()]  # fmt: skip
    return [("model", model.session)]


def run(args) -> int:
    from leanrnn.cli import not_an_input, output_file
    from leanrnn.engine import Session
    from leanrnn.memory.arena import machine_memory

    if args.png:
        output_file(args.png, "plan --png", ".png")
        if os.path.exists(args.model):  # (a spec such as lstm:512 names no file)
            not_an_input(args.png, "plan --png", model=args.model)  # it became a PNG
        if not args.png.lower().endswith(".png"):  # matplotlib failed after the whole plan
            from leanrnn.errors import LeanRNNError

            raise LeanRNNError(f"[plan --png] {args.png!r}: expected a file name ending in "
                               ".png (the timeline is a PNG image)")  # fmt: skip
    if args.autocast_mode is not None and not args.autocast:  # it was ignored in silence
        from leanrnn.errors import LeanRNNError

        raise LeanRNNError("[plan] --autocast-mode chooses --autocast's mode: add --autocast "
                           "(and --train)")  # fmt: skip
    if args.chunk is not None and args.memory_limit is not None:  # two answers to one question
        from leanrnn.errors import LeanRNNError

        what = "segment" if args.train else "chunk"
        raise LeanRNNError(f"[plan] --chunk {args.chunk} and --memory-limit: --memory-limit picks "
                           f"the {what} that fits it; pass one of the two")  # fmt: skip
    model = load_model(args.model, args)
    pairs = _sessions(model)
    if not pairs:
        print("this model has no recurrent sessions to plan")
        return 1
    pngs = _png_paths(args.png, len(pairs)) if args.png else [None] * len(pairs)
    if args.train:
        return _run_train(args, pairs, pngs)
    flag = next((f for f in ("recompute", "autocast") if getattr(args, f)), None)
    if flag:
        from leanrnn.errors import LeanRNNError

        raise LeanRNNError(f"[plan] --{flag} plans a training step: add --train")
    for (name, base), png in zip(pairs, pngs, strict=True):
        s = Session(base.weights, chunk=args.chunk)
        p = s.resize(args.batch, args.steps, memory_limit=args.memory_limit)
        spec = s.spec
        D, K = spec.num_directions, spec.output_size
        it = s.dtype.itemsize
        out_bytes = args.batch * args.steps * D * K * it
        state_bytes = (
            spec.num_layers
            * D
            * args.batch
            * (K + (spec.hidden_size if spec.cell == "lstm" else 0))
            * it
        )
        print(f"{name}: {spec.cell.upper()} C={spec.input_size} H={spec.hidden_size} "
              f"layers={spec.num_layers} directions={D}  N={args.batch} T={args.steps} "
              f"chunk={s.chunk or 'auto'} (planned steps {s._T})")  # fmt: skip
        print(f"{'buffer':<12}{'bytes':>12}{'offset':>12}{'first':>7}{'last':>6}")
        for row in p.table():
            print(f"{row['name']:<12}{row['bytes']:>12,}{row['offset']:>12,}"
                  f"{row['first']:>7}{row['last']:>6}")  # fmt: skip
        print(f"weights   {s.weights.nbytes:>12,} B (packed, aligned)")
        print(f"arena     {p.total:>12,} B (without reuse {p.naive_total:,} B, "
              f"{p.naive_total / max(p.total, 1):.2f}x)")  # fmt: skip
        print(f"outputs   {out_bytes:>12,} B y + {state_bytes:,} B final states (returned arrays)")
        if out_bytes > machine_memory():
            print("          (y is more than this machine's memory: such a run must keep only "
                  "final states, return_sequences=False)")  # fmt: skip
        if png:
            draw(p, png, f"{name}: {spec.cell.upper()} H={spec.hidden_size} N={args.batch} "
                 f"T={args.steps}")  # fmt: skip
            print(f"timeline  {png}")
    return 0


def _png_paths(path: str, n: int) -> list[str]:
    """One timeline file per recurrent session: ``path``, then ``stem-1.png``, ``stem-2.png``...
    (one file for all drew each over the last), each checked before any work."""
    from leanrnn.cli import output_file

    stem, ext = os.path.splitext(path)
    paths = [path] + [f"{stem}-{i}{ext}" for i in range(1, n)]
    for p in paths[1:]:
        output_file(p, "plan --png", ".png")
    return paths


def _run_train(args, pairs, pngs) -> int:
    from leanrnn.memory.arena import check_fits
    from leanrnn.train import Trainer

    for (name, base), png in zip(pairs, pngs, strict=True):
        tr = Trainer(base.weights, segment=args.chunk, recompute=args.recompute,
                     memory_limit=args.memory_limit,
                     autocast=(args.autocast_mode or "bf16") if args.autocast else None)  # fmt: skip
        info = tr.plan(args.batch, args.steps)
        p, spec = info["plan"], tr.spec
        # as the inference plan does at resize: a step that cannot fit is refused, not drawn
        check_fits(info["total_bytes"], f"a training step of {spec.cell.upper()} "
                   f"H={spec.hidden_size} layers={spec.num_layers} N={args.batch} "
                   f"T={args.steps}", "plan --train")  # fmt: skip
        mode = ("recompute" if info["recompute"] else "store") + (
            f", autocast {args.autocast_mode or 'bf16'}" if args.autocast else "")  # fmt: skip
        print(f"{name}: training step, {spec.cell.upper()} C={spec.input_size} "
              f"H={spec.hidden_size} layers={spec.num_layers} "
              f"directions={spec.num_directions}  N={args.batch} T={args.steps}  "
              f"{mode}, segments of {info['segment']} steps ({info['segments']})")  # fmt: skip
        print(f"{'buffer':<12}{'bytes':>14}{'offset':>14}  lifetime")
        for row in p.table():
            life = info["lifetimes"][row["name"]]
            print(f"{row['name']:<12}{row['bytes']:>14,}{row['offset']:>14,}  {life}")
        print(f"weights     {tr.weights.nbytes:>14,} B (+ the same again for the gradients)")
        print(f"arena       {p.total:>14,} B (without reuse {p.naive_total:,} B)")
        print(f"boundaries  {info['checkpoint_bytes']:>14,} B (every layer's state at each "
              "segment start" + (", in dx's rows" if info["boundaries_in_dx"] else "") + ")")  # fmt: skip
        print(f"dense copies{info['dense_weight_bytes']:>14,} B (of the weights, for backward's "
              "products" + (", and their bf16 rounding" if args.autocast else "") + ")")  # fmt: skip
        if info["layout_copy_bytes"]:
            print(f"time-major  {info['layout_copy_bytes']:>14,} B (batch_first: y, dy and dx "
                  "copied time-major)")  # fmt: skip
        print(f"total       {info['total_bytes']:>14,} B beyond weights, gradients, inputs and "
              "outputs")  # fmt: skip
        if png:
            draw(p, png, f"{name}: training {spec.cell.upper()} H={spec.hidden_size} "
                 f"N={args.batch} T={args.steps}")  # fmt: skip
            print(f"timeline    {png}")
    return 0


def draw(plan, path: str, title: str) -> None:
    """Arena timeline: x = op index (lifetime), y = byte offset, one rectangle per buffer."""
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        from leanrnn.errors import LeanRNNError

        raise LeanRNNError("[plan] --png needs matplotlib: pip install 'leanrnn[plot]'") from None
    fig, ax = plt.subplots(figsize=(9, 5))
    cmap = plt.get_cmap("tab20")
    kinds = sorted({p.buffer.name.split(".")[0] for p in plan.placements})
    for pl in plan.placements:
        b = pl.buffer
        if b.nbytes == 0:  # nothing to draw: a stub would read like a real (small) buffer
            continue
        color = cmap(kinds.index(b.name.split(".")[0]) % 20)
        ax.add_patch(plt.Rectangle((b.first - 0.45, pl.offset / 1024), b.last - b.first + 0.9,
                                   b.nbytes / 1024, color=color, alpha=0.8, ec="k",
                                   lw=0.5))  # fmt: skip
        if b.nbytes > plan.total * 0.04:
            ax.text(b.first, (pl.offset + b.nbytes / 2) / 1024, b.name, fontsize=7, va="center")
    last = max(p.buffer.last for p in plan.placements)
    ax.set_xlim(-0.6, last + 0.6)
    ax.set_ylim(0, plan.total / 1024 * 1.02)
    ax.set_xlabel("op (layer x direction)")
    ax.set_ylabel("arena offset (KiB)")
    ax.set_title(f"{title}: arena {plan.total / 1024:.0f} KiB, without reuse "
                 f"{plan.naive_total / 1024:.0f} KiB")  # fmt: skip
    fig.tight_layout()
    from leanrnn._files import replacing

    with replacing(path, ".png") as tmp:  # whole or not at all, the old file kept till then
        fig.savefig(tmp, dpi=110)
    plt.close(fig)

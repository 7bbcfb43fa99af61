"""``leanrnn run``, ``leanrnn inspect`` and ``leanrnn convert``: models from files, on the
command line. Heavy imports (the engine, onnx) happen inside the handlers."""

from __future__ import annotations

import argparse
import json
import re
import sys


def register(sub: argparse._SubParsersAction) -> None:
    from ..cli import positive_int

    p = sub.add_parser("run", help="run a model file on inputs from .npy/.npz files")
    p.add_argument("model", help="model file: .lrnn, .onnx, PyTorch checkpoint, .safetensors, .npz")
    p.add_argument(
        "--input", required=True, help="x.npy (the first input) or inputs.npz (inputs by name)"
    )
    p.add_argument("--lengths", help="l.npy: per-sample lengths [N] (integers)")
    p.add_argument(
        "--output",
        help="write every output to this .npz file (.npz is added if missing; default: print "
        "a summary)",
    )
    p.add_argument("--threads", type=positive_int, help="kernel threads, >= 1 (default: all)")
    p.set_defaults(func=run_cmd)

    p = sub.add_parser("inspect", help="describe a model file: layers, parameters, planned memory")
    p.add_argument("model", help="model file: .lrnn, .onnx, PyTorch checkpoint, .safetensors, .npz")
    p.add_argument(
        "--batch", type=positive_int, default=1, help="N for the planned arena (default 1)"
    )
    p.add_argument(
        "--steps", type=positive_int, default=100, help="T for the planned arena (default 100)"
    )
    p.add_argument("--json", action="store_true", help="print JSON instead of text")
    p.set_defaults(func=inspect_cmd)

    p = sub.add_parser("convert", help="convert any supported model file to the native .lrnn")
    p.add_argument(
        "src", help="model file to read: .onnx, PyTorch checkpoint, .safetensors, .npz, .lrnn"
    )
    p.add_argument("dst", help="output path, ending in .lrnn (its directory must exist)")
    p.set_defaults(func=convert_cmd)


# ------------------------------------------------------------------------------------ helpers
def _load_array(path: str, what: str):
    import numpy as np

    from ..errors import ModelFormatError

    try:
        return np.load(path, allow_pickle=False)
    except (OSError, ValueError, EOFError) as e:  # EOFError: an empty file
        raise ModelFormatError(f"[run] cannot read {what} {path!r}: {e}") from None


def _rnn_params(spec) -> int:
    """Parameters of a recurrent stack as the source framework counts them (unpadded)."""
    n = 0
    H, K, P, G = spec.hidden_size, spec.output_size, spec.proj_size, spec.gate_width
    for layer in range(spec.num_layers):
        per = G * spec.layer_input_size(layer) + G * K
        per += 2 * G if spec.bias else 0
        per += 3 * H if spec.peepholes else 0
        per += P * H
        n += per * spec.num_directions
    return n


def _spec_line(spec) -> str:
    parts = [f"{spec.cell.upper()} C={spec.input_size} H={spec.hidden_size}"]
    if spec.proj_size:
        parts.append(f"P={spec.proj_size}")
    parts.append(f"layers={spec.num_layers} {spec.direction}")
    if spec.batch_first:
        parts.append("batch_first")
    if not spec.default_activations:
        acts = "/".join(a.name for a in spec.activations[0])
        parts.append(f"activations={acts}")
    if spec.clip is not None:
        parts.append(f"clip={spec.clip}")
    if spec.peepholes:
        parts.append("peepholes")
    if spec.input_forget:
        parts.append("input_forget")
    if spec.cell == "gru":
        parts.append(f"linear_before_reset={int(spec.linear_before_reset)}")
    return " ".join(parts)


_T_NAMES = re.compile(r"^(t|time|steps?|seq(uence)?(_?len(gth)?)?|sequence_length|len)$", re.I)
_N_NAMES = re.compile(r"^(n|b|batch(_?size)?|num_seq)$", re.I)


def graph_input_shapes(model, batch: int, steps: int) -> dict[str, tuple[int, ...]]:
    """Concrete shapes for a graph's inputs for N=batch, T=steps: declared ints are kept;
    symbolic dims named like batch/time take N/T; the rest follow the first RNN node's layout
    ([T, N, ...] for layout 0, [N, T, ...] for layout 1)."""
    from ..errors import ShapeError

    layout = next((n.attrs.get("layout", 0) for n in model.rnn_nodes), 0)
    order = (steps, batch) if layout == 0 else (batch, steps)
    shapes = {}
    for t in model.graph.inputs:
        if t.shape is None:
            raise ShapeError(f"[inspect] input {t.name!r} has no declared shape; cannot plan it")
        dims = []
        free = 0
        for d in t.shape:
            if isinstance(d, int):
                dims.append(d)
            elif isinstance(d, str) and _T_NAMES.match(d):
                dims.append(steps)
            elif isinstance(d, str) and _N_NAMES.match(d):
                dims.append(batch)
            else:
                dims.append(order[free] if free < 2 else 1)
                free += 1
        shapes[t.name] = tuple(dims)
    return shapes


def describe(model, batch: int, steps: int) -> dict:
    """Everything ``inspect`` prints, as a dict."""
    from ..engine.graph import GraphModel
    from ..formats.onnx_import import RNN_OPS

    if isinstance(model, GraphModel):
        g = model.graph
        layers, params, wbytes = [], 0, 0
        for node in g.nodes:
            pw = g.packed.get(node.name)
            if node.op in RNN_OPS and pw is not None:
                layers.append(
                    {
                        "node": node.name,
                        "op": node.op,
                        "spec": _spec_line(pw.spec),
                        "weight_bytes": pw.nbytes,
                    }
                )
                params += _rnn_params(pw.spec)
                wbytes += pw.nbytes
            else:
                layers.append({"node": node.name, "op": node.op})
        for c in g.constants.values():
            if c.dtype.kind == "f":
                params += c.size
            wbytes += c.nbytes
        shapes = graph_input_shapes(model, batch, steps)
        p = model.resize(shapes)
        sess = model.session
        arena = {
            "input_shapes": {k: list(v) for k, v in shapes.items()},
            "graph_arena_bytes": sess.arena_bytes,
            "graph_arena_naive_bytes": p.naive_total,
            "rnn_arena_bytes": sess.rnn_arena_bytes,
            "shape_constant_bytes": sess.resize_constant_bytes,
        }
        arena["total_bytes"] = (
            sess.arena_bytes + sess.rnn_arena_bytes + (sess.resize_constant_bytes)
        )
        return {
            "kind": "graph",
            "inputs": [t.to_dict() for t in g.inputs],
            "outputs": [t.to_dict() for t in g.outputs],
            "layers": layers,
            "parameters": int(params),
            "weight_bytes": int(wbytes),
            "batch": batch,
            "steps": steps,
            "arena": arena,
        }
    spec = model.spec
    p = model.session.resize(batch, steps)
    return {
        "kind": "rnn",
        "layers": [
            {
                "layer": layer,
                "spec": _spec_line(
                    spec.with_(num_layers=1, input_size=(spec.layer_input_size(layer)))
                ),
            }
            for layer in range(spec.num_layers)
        ],
        "spec": spec.to_dict(),
        "dtype": model.dtype.name,
        "parameters": _rnn_params(spec),
        "weight_bytes": model.weights.nbytes,
        "batch": batch,
        "steps": steps,
        "arena": {"total_bytes": p.total, "naive_bytes": p.naive_total},
    }


def _mib(n: int) -> str:
    return f"{n / (1 << 20):.2f} MiB" if n >= 1 << 20 else f"{n / 1024:.1f} KiB"


# ----------------------------------------------------------------------------------- handlers
def run_cmd(args) -> int:
    import numpy as np

    from ..cli import output_file
    from ..engine.graph import GraphModel
    from ..errors import ShapeError
    from ..loading import load

    output = None
    if args.output:  # np.savez adds .npz to any other name; say (and check) the real one
        output = args.output if args.output.endswith(".npz") else args.output + ".npz"
        for path in {args.output, output}:
            output_file(path, "run --output", ".npz")
    model = load(args.model, threads=args.threads)
    lengths = None if args.lengths is None else _load_array(args.lengths, "--lengths")
    inp = _load_array(args.input, "--input")
    if isinstance(model, GraphModel):
        feeds = {}
        if lengths is not None:
            feeds[_lengths_input(model)] = lengths
        if isinstance(inp, np.lib.npyio.NpzFile):
            feeds.update({k: inp[k] for k in inp.files})
        else:
            rest = [n for n in model.input_names if n not in feeds]
            if len(rest) != 1:
                raise ShapeError(
                    f"[run] the model takes inputs {model.input_names}; pass them by name in "
                    "an .npz"
                )
            feeds[rest[0]] = inp
        outs = dict(zip(model.output_names, model.run(feeds), strict=True))
    else:
        if isinstance(inp, np.lib.npyio.NpzFile):
            raise ShapeError("[run] a recurrent stack takes one input x; pass an .npy")
        y, h_n, c_n = model.session.run(inp, lengths=lengths)
        outs = {"y": y, "h_n": h_n}
        if c_n is not None:
            outs["c_n"] = c_n
    if output:
        np.savez(output, **outs)
        print(f"wrote {', '.join(outs)} to {output}")
    else:
        for k, v in outs.items():
            print(
                f"{k}: {v.dtype}{list(v.shape)} mean={float(np.mean(v)):.6g} "
                f"absmax={float(np.max(np.abs(v))) if v.size else 0.0:.6g}"
            )
    return 0


def _lengths_input(model) -> str:
    """The graph input that feeds an RNN node's sequence_lens."""
    from ..errors import ShapeError

    names = set(model.input_names)
    for node in model.rnn_nodes:
        if len(node.inputs) > 4 and node.inputs[4] in names:
            return node.inputs[4]
    raise ShapeError(
        f"[run] --lengths given, but no graph input feeds an RNN node's "
        f"sequence_lens (inputs: {model.input_names})"
    )


def inspect_cmd(args) -> int:
    from ..loading import load

    model = load(args.model)
    info = describe(model, args.batch, args.steps)
    if args.json:
        json.dump(info, sys.stdout, indent=2)
        print()
        return 0
    print(f"{args.model}: {info['kind']} model")
    if info["kind"] == "graph":
        ins = ", ".join(f"{t['name']} {t['dtype']}{t['shape']}" for t in info["inputs"])
        outs = ", ".join(f"{t['name']} {t['dtype']}{t['shape']}" for t in info["outputs"])
        print(f"  inputs:  {ins}\n  outputs: {outs}")
        print("  nodes:")
        for layer in info["layers"]:
            extra = f"  {layer['spec']}  ({_mib(layer['weight_bytes'])})" if "spec" in layer else ""
            print(f"    {layer['op']:<16} {layer['node']}{extra}")
    else:
        print(f"  dtype: {info['dtype']}")
        for layer in info["layers"]:
            print(f"    layer {layer['layer']}: {layer['spec']}")
    print(f"  parameters:   {info['parameters']:,}")
    print(f"  weight bytes: {info['weight_bytes']:,} ({_mib(info['weight_bytes'])})")
    a = info["arena"]
    print(
        f"  planned arena for N={info['batch']}, T={info['steps']}: {a['total_bytes']:,} B "
        f"({_mib(a['total_bytes'])})"
    )
    if info["kind"] == "graph":
        print(
            f"    graph intermediates: {_mib(a['graph_arena_bytes'])} (without reuse: "
            f"{_mib(a['graph_arena_naive_bytes'])}); RNN scratch: {_mib(a['rnn_arena_bytes'])};"
            f" shape-derived constants: {_mib(a['shape_constant_bytes'])}"
        )
        print(f"    input shapes: {a['input_shapes']}")
    else:
        print(f"    without reuse: {_mib(a['naive_bytes'])}")
    return 0


def convert_cmd(args) -> int:
    import os

    from ..cli import output_file
    from ..loading import convert

    convert(args.src, output_file(args.dst, "convert", ".lrnn"))
    print(f"wrote {args.dst} ({os.path.getsize(args.dst):,} bytes)")
    return 0

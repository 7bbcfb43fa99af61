"""``leanrnn run``, ``leanrnn inspect`` and ``leanrnn convert``: models from files, on the
command line. Heavy imports (the engine, onnx) happen inside the handlers."""

from __future__ import annotations

import argparse
import contextlib
import io
import json
import os
import re
import stat
import sys
import tokenize


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
        help="write every output to this .npz file (.npz is added to a bare name; '-': the "
        ".npz to standard output; default: print a summary)",
    )
    p.add_argument("--threads", type=positive_int, help="kernel threads, >= 1 (default: all)")
    add_state_dict_options(p)
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
    add_state_dict_options(p)
    p.set_defaults(func=inspect_cmd)

    p = sub.add_parser("convert", help="convert any supported model file to the native .lrnn")
    p.add_argument(
        "src", help="model file to read: .onnx, PyTorch checkpoint, .safetensors, .npz, .lrnn"
    )
    p.add_argument("dst", help="output path, ending in .lrnn (its directory must exist)")
    p.add_argument(
        "--precision", choices=("bf16", "bf16-act", "int8", "int8-dynamic"),
        help="store the recurrent weights in reduced precision (leanrnn.quantize): bf16 halves "
        "them, int8 quarters them (activations stay float32); int8-dynamic also quantizes the "
        "activations as it runs, like torch's and onnxruntime's dynamic quantization; bf16-act "
        "rounds them to bfloat16, like torch's autocast (faster batches on AMX) "
        "(default: as loaded)",
    )  # fmt: skip
    p.add_argument(
        "--reduce-range", action="store_true",
        help="with --precision int8-dynamic: 7-bit weight codes (twice the weight error), "
        "1.3-1.9x faster runs on CPUs without AVX-512 VNNI (AVX2 only; "
        "`leanrnn info` names this CPU's int8 path), as onnxruntime's reduce_range",
    )  # fmt: skip
    add_state_dict_options(p)
    p.set_defaults(func=convert_cmd)


def add_state_dict_options(p: argparse.ArgumentParser) -> None:
    """What leanrnn.load takes for a state dict and a state dict cannot record (a .lrnn or
    ONNX file records its own: given for one, they are refused unless they agree)."""
    g = p.add_argument_group("state dicts (.pt/.pth, .safetensors, .npz)")
    g.add_argument("--prefix", help="the RNN module's key prefix in a larger state dict, e.g. "
                   "encoder.lstm. (the load error names the prefixes present)")  # fmt: skip
    g.add_argument("--cell", choices=("lstm", "gru", "rnn"),
                   help="the cell (default: read off the weight shapes)")  # fmt: skip
    g.add_argument("--nonlinearity", choices=("tanh", "relu"), help="an RNN's (default tanh)")
    g.add_argument("--batch-first", action="store_const", const=True, default=None,
                   help="the module was built with batch_first=True: inputs are [N, T, C]")  # fmt: skip
    g.add_argument("--dtype", choices=("float32", "float64"),
                   help="convert the weights to this dtype (needed for float16 state dicts; "
                   "bfloat16 ones load as float32, exactly; default: as stored)")  # fmt: skip


def load_options(args) -> dict:
    """leanrnn.load's keyword arguments from add_state_dict_options' flags (those given)."""
    keys = ("prefix", "cell", "nonlinearity", "batch_first", "dtype")
    return {k: getattr(args, k) for k in keys if getattr(args, k, None) is not None}


@contextlib.contextmanager
def cli_advice():
    """The library's advice in CLI words: 'pass dtype=np.float32 or np.float64' (a float16
    state dict) and 'model.astype(np.float32)' (a float64 model given a reduced precision) are
    --dtype on the command line."""
    from ..errors import DTypeError

    try:
        yield
    except DTypeError as e:
        for advice, flags in (("pass dtype=np.float32 or np.float64",
                               "--dtype float32 or --dtype float64"),
                              ("(model.astype(np.float32))", "--dtype float32")):  # fmt: skip
            if advice in str(e):
                raise DTypeError(f"{e} (on the command line: {flags})") from None
        raise


def load_model(path: str, args, **kw):
    """leanrnn.load(path) with the state-dict flags of ``args``, errors in CLI words."""
    from ..loading import load

    with cli_advice():
        return load(path, **kw, **load_options(args))


# ------------------------------------------------------------------------------------ helpers
def _strict(v):
    """``v`` (dicts, lists, numbers) with non-finite floats as None and numpy scalars as
    Python ones, for strict JSON."""
    import math

    if isinstance(v, dict):
        return {k: _strict(x) for k, x in v.items()}
    if isinstance(v, list | tuple):
        return [_strict(x) for x in v]
    if hasattr(v, "item") and not isinstance(v, str | bytes):  # a numpy scalar
        v = v.item()
    if isinstance(v, float) and not math.isfinite(v):
        return None
    return v


def _npy_header(f, where: str) -> int:
    """Read a .npy header from ``f``; the bytes its array declares. Refuses what np.load would
    turn into a pickle attempt or an object array."""
    import numpy as np

    from ..errors import ModelFormatError

    try:
        version = np.lib.format.read_magic(f)
        read = (np.lib.format.read_array_header_1_0 if version == (1, 0)
                else np.lib.format.read_array_header_2_0)  # fmt: skip
        shape, _, dtype = read(f)
    except (ValueError, OSError, SyntaxError, EOFError, tokenize.TokenError) as e:
        # TokenError: header text that never closes its dict or tuple (np's literal_eval)
        raise ModelFormatError(f"[run] {where} is not a readable .npy array: {e}") from None
    if dtype.hasobject:
        raise ModelFormatError(f"[run] {where} holds Python objects; expected a numeric array")
    return int(np.prod(shape, dtype=object)) * dtype.itemsize


def _load_array(path: str, what: str):
    """np.load of a .npy or .npz, after checking that every array's header declares no more
    bytes than the file holds (np.load allocated the declared size first: a 100-byte file
    declaring 2 TiB was 'out of memory', a few GiB were allocated before the read failed) and
    that the file is one (np.load took other bytes for a pickle and said to load it unsafely)."""
    import zipfile

    import numpy as np

    from ..errors import ModelFormatError
    from ..formats.checkpoint import check_zip_sizes

    where = f"{what} {path!r}"
    try:
        # a device or pipe has no size to check against (zipfile's probe for an end record
        # read /dev/zero until memory ran out), and opening a pipe waits for a writer
        if not stat.S_ISREG(os.stat(path).st_mode):
            raise ModelFormatError(f"[run] {where} is not a regular file; expected a .npy or .npz")
        with open(path, "rb") as f:
            head = f.read(6)
        if head.startswith((b"PK\x03\x04", b"PK\x05\x06")):  # np.load's test for an .npz
            with zipfile.ZipFile(path) as z:
                check_zip_sizes(z, path, "run")  # before np.load inflates a bomb
                for info in z.infolist():
                    if not info.filename.endswith(".npy"):
                        continue
                    with z.open(info) as m:
                        declared = _npy_header(m, f"{where} member {info.filename!r}")
                        held = info.file_size - m.tell()
                    if declared > held:
                        raise ModelFormatError(
                            f"[run] {where} member {info.filename!r} declares {declared:,} "
                            f"bytes of data but holds {max(held, 0):,}: truncated or corrupt; "
                            "save it again with np.savez"
                        )
        else:
            if head != b"\x93NUMPY":
                raise ModelFormatError(
                    f"[run] {where} is not a .npy or .npz file; save arrays with np.save "
                    "(one array) or np.savez (arrays by name)"
                )
            with open(path, "rb") as f:
                declared = _npy_header(f, where)
                held = os.fstat(f.fileno()).st_size - f.tell()
            if declared > held:
                raise ModelFormatError(
                    f"[run] {where} declares {declared:,} bytes of data but holds {held:,}: "
                    "truncated or corrupt; save it again with np.save"
                )
        return np.load(path, allow_pickle=False)
    except zipfile.BadZipFile as e:
        raise ModelFormatError(
            f"[run] {where} is not a readable .npz ({e}): truncated or corrupt; save it again "
            "with np.savez"
        ) from None
    except (OSError, ValueError, EOFError) as e:  # EOFError: an empty file
        if isinstance(e, ModelFormatError):
            raise
        raise ModelFormatError(f"[run] cannot read {where}: {e}") from None


def _mib(n: int) -> str:
    return f"{n / (1 << 20):.2f} MiB" if n >= 1 << 20 else f"{n / 1024:.1f} KiB"


# Suffixes of other formats: `run --output` refuses them rather than write y.npy.npz (".NPZ":
# np.savez would write y.NPZ.npz). Another suffix (out.v2) gets .npz, as np.savez gives it.
_OTHER_FORMATS = frozenset((".npy", ".npz", ".txt", ".csv", ".json", ".parquet", ".pq", ".lrnn",
                            ".onnx", ".pt", ".pth", ".safetensors", ".pkl", ".pickle", ".h5"))  # fmt: skip


# ----------------------------------------------------------------------------------- handlers
def run_cmd(args) -> int:
    import numpy as np

    from ..cli import not_an_input, output_file
    from ..errors import LeanRNNError, ShapeError

    output = None
    # `--output - | python -c 'np.load(...)'`; /dev/stdout redirected to a file wrote
    # /dev/stdout.npz
    if args.output == "-" or (args.output and _is_stdout(args.output)):
        if sys.stdout.isatty():  # a zip archive is no text for a terminal
            raise LeanRNNError("[run --output] standard output is a terminal; redirect it to a "
                               "file or pipe (--output - > y.npz), or name the file")  # fmt: skip
        output = "-"
    elif args.output:  # np.savez adds .npz to any other name; say (and check) the real one
        ext = os.path.splitext(args.output)[1]
        if ext != ".npz" and ext.lower() in _OTHER_FORMATS:  # out.txt was out.txt.npz, silently
            raise LeanRNNError(f"[run --output] {args.output!r} names a {ext} file; expected a "
                               "name ending in .npz (the outputs are written by name, as "
                               "np.savez writes them), or one without, which gets .npz")  # fmt: skip
        output = args.output if ext == ".npz" else args.output + ".npz"
        for path in {args.output, output}:  # (--output /dev/null wrote /dev/null.npz)
            output_file(path, "run --output", ".npz", stdout="-")
        not_an_input(output, "run --output", model=args.model, input=args.input,
                     lengths=args.lengths)  # fmt: skip
    model = load_model(args.model, args, threads=args.threads)
    lengths = None if args.lengths is None else _load_array(args.lengths, "--lengths")
    if isinstance(lengths, np.lib.npyio.NpzFile):  # it became an array of member names
        raise ShapeError(
            f"[run] --lengths {args.lengths!r} is an .npz; expected one .npy of integer lengths "
            "[N] (or put lengths inside the --input .npz)"
        )
    inp = _load_array(args.input, "--input")
    feeds = {}
    if lengths is not None:
        if model.lengths_input is None:
            raise ShapeError(
                f"[run] --lengths given, but no graph input feeds an RNN node's "
                f"sequence_lens (inputs: {model.input_names})"
            )
        feeds[model.lengths_input] = lengths
    if isinstance(inp, np.lib.npyio.NpzFile):
        both = sorted(set(feeds) & set(inp.files))
        if both:  # (the file's lengths replaced the flag's without a word)
            raise ShapeError(f"[run] --lengths and the --input .npz both give {both}; drop one")
        feeds.update({k: inp[k] for k in inp.files})
    else:
        rest = [n for n in model.input_names if n not in feeds]
        if len(rest) != 1:
            raise ShapeError(
                f"[run] the model takes inputs {model.input_names}; pass them by name in an .npz"
            )
        feeds[rest[0]] = inp
    # A file's arrays as the library takes them: C order and this machine's byte order (a
    # Fortran-order or big-endian .npy was refused with advice to call np.ascontiguousarray)
    feeds = {k: np.ascontiguousarray(v, v.dtype.newbyteorder("=")) for k, v in feeds.items()}
    feeds = {k: _integers_as_declared(model, k, v) for k, v in feeds.items()}
    outs = dict(zip(model.output_names, model.run(feeds), strict=True))
    if output == "-":
        buf = io.BytesIO()  # np.savez seeks as it writes a zip; a pipe cannot
        np.savez(buf, **outs)
        sys.stdout.buffer.write(buf.getbuffer())
        sys.stdout.flush()
    elif output:
        from .._files import replacing

        with replacing(output, ".npz") as tmp:  # whole or not at all, the old file kept till then
            np.savez(tmp, **outs)
        print(f"wrote {', '.join(outs)} to {output}")
    else:
        for k, v in outs.items():
            print(
                f"{k}: {v.dtype}{list(v.shape)} mean={float(np.mean(v)):.6g} "
                f"absmax={float(np.max(np.abs(v))) if v.size else 0.0:.6g}"
            )
    return 0


def _is_stdout(path: str) -> bool:
    """Whether ``path`` (/dev/stdout, /proc/self/fd/1) is this process's standard output."""
    try:
        a, b = os.stat(path), os.fstat(sys.stdout.fileno())
    except (OSError, ValueError, AttributeError):  # no such path; stdout closed or replaced
        return False
    return (a.st_dev, a.st_ino) == (b.st_dev, b.st_ino)


def _integers_as_declared(model, name: str, a):
    """Integers ``a`` for input ``name`` in the integer dtype its graph declares, when every
    value fits: np.save of a Python list writes int64, and exporters declare int32 or int64
    lengths and token ids as they please (the library, as onnxruntime, takes the declared
    dtype only; a file from another tool should not need a conversion script)."""
    import numpy as np

    declared = {t.name: t.dtype for t in getattr(getattr(model, "graph", None), "inputs", ())}
    want = declared.get(name)
    if not want or a.dtype.kind not in "iu" or np.dtype(want).kind not in "iu":
        return a
    want = np.dtype(want)
    info = np.iinfo(want)
    if a.size and (a.min() < info.min or a.max() > info.max):
        return a  # left for the model's own dtype check to refuse, naming both
    return a.astype(want)


def inspect_cmd(args) -> int:
    from ..errors import PlanError

    model = load_model(args.model, args)
    try:
        info = model.describe(args.batch, args.steps)
    except PlanError as e:  # the engine names its arena by the chunk it plans, not the T asked
        m = re.match(r"\[allocate\] arena\[(\w+) N=\d+ T=(\d+)\] ", str(e))
        if not m:
            raise
        raise PlanError(
            f"[inspect] the arena of {m.group(1)} for N={args.batch}, T={args.steps} (run in "
            f"chunks of {m.group(2)} steps) {str(e)[m.end() :]}"
        ) from None
    if args.json:
        # strict JSON: a non-finite float as null (json's default wrote NaN / Infinity, which
        # jq and JSON.parse refuse), a numpy scalar as its Python value
        json.dump(_strict(info), sys.stdout, indent=2, allow_nan=False)
        print()
        return 0
    print(f"{_shown(args.model)}: {info['kind']} model")
    if info["kind"] == "graph":
        ins = ", ".join(_tensor(t) for t in info["inputs"])
        outs = ", ".join(_tensor(t) for t in info["outputs"])
        print(f"  inputs:  {ins}\n  outputs: {outs}")
        packed = [layer for layer in info["layers"] if "weight_bytes" in layer]  # not shares
        if packed:  # the same line as a stack's: what `convert --precision` made of the file
            kinds = sorted({layer.get("precision", "float") + _codes(layer) for layer in packed})
            panels = sum(layer.get("panel_bytes", 0) for layer in packed)
            print(f"  weight precision: {', '.join(kinds)} (W and R panels: {panels:,} B, "
                  f"{_mib(panels)})")  # fmt: skip
        print("  nodes:")
        for layer in info["layers"]:
            if "shares" in layer:  # one copy of weights several nodes run on
                extra = f"  {layer['spec']}  (the weights of {_shown(layer['shares'])})"
            else:
                extra = (f"  {layer['spec']}  ({_mib(layer['weight_bytes'])}"
                         f"{_precision(layer)})" if "spec" in layer else "")  # fmt: skip
            if layer.get("when"):  # an If's branch: runs only when these hold
                when = layer["when"]
                extra += "  when " + ", ".join(f"{_shown(c)}={t}" for c, t in when[:4])
                extra += ", ..." if len(when) > 4 else ""
            print(f"    {_shown(layer['op']):<16} {_shown(layer['node'])}{extra}")
    else:
        print(f"  dtype: {info['dtype']}")
        print(f"  weight precision: {info['precision']}{_codes(info)} (W and R panels: "
              f"{info['panel_bytes']:,} B, {_mib(info['panel_bytes'])})")  # fmt: skip
        for layer in info["layers"]:
            print(f"    layer {layer['layer']}: {layer['spec']}")
    print(f"  parameters:   {info['parameters']:,}")
    print(f"  weight bytes: {info['weight_bytes']:,} ({_mib(info['weight_bytes'])})")
    a = info["arena"]
    if a is None:  # an input of unknown shape: the rest described, the arena not planned
        print(f"  arena not planned: {info['unplanned'].removeprefix('[inspect] ')}")
        return 0
    planned = f"N={info['batch']}, T={info['steps']}"
    # describe (and so --json) names what was planned: None for a size a graph's file fixes
    ignored = [f"--{k} {getattr(args, k)}" for k in ("batch", "steps") if info[k] is None]
    if ignored:
        verb, what = ("do", "those sizes") if len(ignored) > 1 else ("does", "that size")
        planned = (f"the file's input shapes {a['input_shapes']} ({' and '.join(ignored)} "
                   f"{verb} not apply: the file fixes {what})")  # fmt: skip
    print(f"  planned arena for {planned}: {a['total_bytes']:,} B ({_mib(a['total_bytes'])})")
    if info["kind"] == "graph":
        print(
            f"    graph intermediates: {_mib(a['graph_arena_bytes'])} (without reuse: "
            f"{_mib(a['graph_arena_naive_bytes'])}); RNN scratch: {_mib(a['rnn_arena_bytes'])};"
            f" shape-derived constants: {_mib(a['shape_constant_bytes'])}"
            + (f"; ops' own working memory: {_mib(a['working_bytes'])}"
               if a.get("working_bytes") else "")
        )  # fmt: skip
        print(f"    input shapes: {a['input_shapes']}")
    else:
        print(f"    without reuse: {_mib(a['naive_bytes'])}")
    return 0


def _tensor(t: dict) -> str:
    shape = "[shape unknown]" if t["shape"] is None else t["shape"]
    return f"{_shown(t['name'])} {t['dtype']}{shape}"


def _shown(name) -> str:
    """A name from a model file as it may be printed: quoted and escaped unless printable (a
    newline in one forged a line of the report; escape sequences reached the terminal)."""
    name = str(name)
    return name if name.isprintable() else repr(name)


def _codes(layer: dict) -> str:
    """The ", 7-bit codes" of int8-dynamic weights made with reduce_range, else nothing."""
    return ", 7-bit codes" if layer.get("weight_bits") == 7 else ""


def _precision(layer: dict) -> str:
    p = layer.get("precision", "float")
    return "" if p == "float" else f", {p}{_codes(layer)} weights: {_mib(layer['panel_bytes'])}"


def convert_cmd(args) -> int:
    from ..cli import output_file
    from ..loading import convert

    output_file(args.dst, "convert", ".lrnn")  # convert refuses dst being src itself
    with cli_advice():
        convert(
            args.src,
            args.dst,
            precision=args.precision,
            reduce_range=args.reduce_range,
            **load_options(args),
        )
    print(f"wrote {args.dst} ({os.path.getsize(args.dst):,} bytes)")
    if args.precision == "int8-dynamic" and not args.reduce_range:
        from ..kernels import _cpu

        if _cpu.int8_dot(_cpu.isa()) == "avx2":  # the one path where 7-bit codes run faster
            print("note: this CPU multiplies int8 without VNNI (AVX2); --reduce-range (7-bit "
                  "weight codes, twice the weight error) runs 1.3-1.9x faster here",
                  file=sys.stderr)  # fmt: skip
    return 0

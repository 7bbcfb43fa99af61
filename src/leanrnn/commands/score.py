"""``leanrnn score MODEL INPUT OUTPUT``: a dataset of sequences through a model, to a file of
final states and/or per-step outputs in input order (leanrnn.score), locally or on Ray."""

from __future__ import annotations

import argparse

from ..cli import positive_int, size


def register(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser(
        "score",
        help="score a dataset of sequences (Parquet, .npy/.npz, a directory) to Parquet/.npz",
        description="Reads sequences from INPUT (Parquet with a list column of feature vectors "
        "and an optional length column; .npy [N, T, C] padded; .npz with x and lengths; or a "
        "directory of such files), runs MODEL on them in length-sorted batches and writes one "
        "row per sequence, in input order, to OUTPUT (.parquet or .npz).",
    )
    p.add_argument("model", help="model file (.lrnn, .pt, .safetensors, .npz state dict)")
    p.add_argument("input", help="dataset file or directory")
    p.add_argument("output", help="output .parquet or .npz")
    p.add_argument("--outputs", choices=("final", "steps", "both"), default="final",
                   help="final states (h_n, c_n), per-step outputs (y), or both")  # fmt: skip
    p.add_argument("--memory-limit", type=size, default=None,
                   help="bytes for buffers, e.g. 512M (default: 1/4 of available, <= 256M)")  # fmt: skip
    p.add_argument("--batch-size", type=positive_int, default=None,
                   help="fixed sequences per batch (default: chosen from the hardware)")  # fmt: skip
    p.add_argument("--threads", type=positive_int, default=None,
                   help="kernel threads (default: leanrnn.get_num_threads())")  # fmt: skip
    p.add_argument("--no-bucket", action="store_true",
                   help="batch in input order (padding each batch to its longest)")  # fmt: skip
    p.add_argument("--column", default=None, help="Parquet feature column")
    p.add_argument("--length-column", default=None, help="Parquet length column")
    p.add_argument("--x-key", default=None, help=".npz array of padded sequences")
    p.add_argument("--lengths-key", default=None, help=".npz array of lengths")
    p.add_argument("--lengths", default=None, help=".npy of lengths for a .npy INPUT")
    p.add_argument("--allow-nonfinite", action="store_true",
                   help="let NaN/Inf inputs propagate instead of refusing them")  # fmt: skip
    p.add_argument("--ray", default=None, metavar="auto|ADDRESS",
                   help="run as a Ray Data pipeline (needs leanrnn[ray])")  # fmt: skip
    p.add_argument("--ray-actors", type=positive_int, default=None,
                   help="Ray actors, >= 1 (default: cores)")  # fmt: skip
    p.add_argument("--quiet", action="store_true", help="no progress bar")
    from .model import add_state_dict_options

    add_state_dict_options(p)
    p.set_defaults(func=run)


def run(args) -> int:
    from leanrnn.score import score

    from ..cli import not_an_input
    from .model import cli_advice, load_model, load_options

    model = args.model
    with cli_advice():
        if load_options(args):  # loaded here with them; score() checks the output against the path
            not_an_input(args.output, "score", model=args.model)
            model = load_model(args.model, args, threads=args.threads)
        summary = score(
            model, args.input, args.output, outputs=args.outputs,
            memory_limit=args.memory_limit, threads=args.threads, batch_size=args.batch_size,
            bucket=not args.no_bucket, column=args.column, length_column=args.length_column,
            x_key=args.x_key, lengths_key=args.lengths_key, lengths=args.lengths,
            allow_nonfinite=args.allow_nonfinite, progress=not args.quiet, ray=args.ray,
            ray_actors=args.ray_actors,
        )  # fmt: skip
    print(summary)
    return 0

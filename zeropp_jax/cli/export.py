"""``zeropp-export``: write a checkpoint's parameters as one plain msgpack file.

The layout comes from the checkpoint's metadata: no model code, mesh or
training flags are needed, and any process count / mesh may have written
the checkpoint. Example::

  zeropp-export ckpt/ params.msgpack            # the newest readable step
  zeropp-export ckpt/ params.msgpack --step 300

Load the file without zeropp_jax::

  import flax.serialization
  params = flax.serialization.msgpack_restore(open("params.msgpack", "rb").read())
"""

from __future__ import annotations

import argparse
import os
import sys

from zeropp_jax.cli import common
from zeropp_jax.files import is_stream, output_problem

PROG = "zeropp-export"  # the name in --help and in error lines


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog=PROG,
        description="Write the full, unpadded parameters of a zeropp_jax checkpoint "
        "as a msgpack file that flax.serialization.msgpack_restore reads "
        "(a nested dict of numpy arrays in the parameters' original dtypes).",
    )
    parser.add_argument(
        "directory", metavar="DIR", help="checkpoint directory (--checkpoint-dir of zeropp-train)"
    )
    parser.add_argument("out", metavar="OUT", help="output file, e.g. params.msgpack")
    parser.add_argument(
        "--step", type=common.non_negative_int, default=None,
        help="checkpoint step (default: the newest readable one)",
    )
    parser.add_argument(
        "--allow-nonfinite", action="store_true",
        help="write parameters that hold inf or nan (refused by default)",
    )
    return parser


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    if not os.path.isdir(args.directory):
        common.fail(PROG, f"checkpoint directory {args.directory} does not exist")
    if os.path.isdir(args.out):
        common.fail(PROG, f"{args.out} is a directory; give the output file's name, e.g. "
                          f"{os.path.join(args.out, 'params.msgpack')}")
    problem = output_problem("output file", args.out)
    if problem:
        common.fail(PROG, problem)
    # Reading a checkpoint needs no accelerator: keep JAX off the GPUs.
    os.environ.setdefault("JAX_PLATFORMS", "cpu")
    from zeropp_jax.checkpoint import CheckpointError, export_params

    try:
        info = export_params(
            args.directory, args.out, step=args.step, allow_nonfinite=args.allow_nonfinite
        )
    except (CheckpointError, FileNotFoundError, ValueError) as e:
        common.fail(PROG, str(e))
    print(
        f"zeropp-export: step {info['step']} of {os.path.abspath(args.directory)} -> "
        f"{info['path']} ({info['params']:,} parameters, {info['bytes']:,} bytes)",
        file=sys.stderr if is_stream(args.out) else sys.stdout,  # not into the data
        flush=True,
    )
    return 0


if __name__ == "__main__":
    sys.exit(main())

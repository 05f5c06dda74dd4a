"""Flag values and flag checks shared by the commands.

argparse value types that say what they expected (:func:`positive_int`,
...), and the training flags that the commands which only compile a step
(``zeropp-comm``, ``zeropp-simulate``) refuse. Imports nothing from JAX.
"""

from __future__ import annotations

import argparse


def positive_int(text: str) -> int:
    try:
        value = int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected a positive integer, got {text!r}")
    if value < 1:
        raise argparse.ArgumentTypeError(f"expected a positive integer, got {value}")
    return value


def non_negative_int(text: str) -> int:
    try:
        value = int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected an integer >= 0, got {text!r}")
    if value < 0:
        raise argparse.ArgumentTypeError(f"expected an integer >= 0, got {value}")
    return value


def non_negative_float(text: str) -> float:
    """A finite number >= 0 (``inf`` and ``nan`` are refused)."""
    try:
        value = float(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected a number >= 0, got {text!r}")
    if not 0 <= value < float("inf"):
        raise argparse.ArgumentTypeError(f"expected a finite number >= 0, got {text!r}")
    return value


def positive_float(text: str) -> float:
    """A finite number > 0 (``inf`` and ``nan`` are refused)."""
    try:
        value = float(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected a positive number, got {text!r}")
    if not (value > 0 and value != float("inf")):
        raise argparse.ArgumentTypeError(f"expected a finite positive number, got {text!r}")
    return value


# Training flags: they change no byte of a step's communication (zeropp-comm
# and zeropp-simulate refuse them).
TRAINING_FLAGS = ("lr", "lr_schedule", "lr_warmup", "seed")


def given_flags(parser: argparse.ArgumentParser, args: argparse.Namespace, names) -> list[str]:
    """The flags among ``names`` (dests) that the command sets to a non-default value."""
    out = []
    for name in names:
        value = getattr(args, name)
        if value != parser.get_default(name):
            out.append(("--no-" if value is False else "--") + name.replace("_", "-"))
    return out


def hide_training_flags(parser: argparse.ArgumentParser) -> None:
    """Leaves :data:`TRAINING_FLAGS` out of ``--help`` (a command that refuses them)."""
    for action in parser._actions:
        if action.dest in TRAINING_FLAGS:
            action.help = argparse.SUPPRESS


def refuse_training_flags(parser: argparse.ArgumentParser, args: argparse.Namespace) -> None:
    """A usage error naming the :data:`TRAINING_FLAGS` given (a command that only compiles)."""
    given = given_flags(parser, args, TRAINING_FLAGS)
    if given:
        one = len(given) == 1
        parser.error(f"{', '.join(given)} {'sets' if one else 'set'} the training run, which "
                     f"changes no byte of a step's communication; leave {'it' if one else 'them'} "
                     "out (zeropp-train takes them)")

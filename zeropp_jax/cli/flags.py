"""Flag values and flag checks shared by the commands.

argparse value types that say what they expected (:func:`positive_int`,
...), and the training flags that the commands which only compile a step
(``zeropp-comm``, ``zeropp-simulate``) refuse. Imports nothing from JAX.
"""

from __future__ import annotations

import argparse
import json
from typing import Any, Callable

from zeropp_jax.data import MAX_SEED

_INF = float("inf")


def number_type(
    parse: Callable[[str], float], ok: Callable[[float], bool], name: str, *,
    unparsed: str, rejected: str,
) -> Callable[[str], float]:
    """An argparse ``type=``: ``parse(text)``, refused unless ``ok(value)``.

    ``unparsed`` and ``rejected`` are the usage errors for text ``parse``
    cannot read and for a value ``ok`` refuses; ``{text!r}`` and ``{value}``
    in them are filled in.
    """

    def convert(text: str):
        try:
            value = parse(text)
        except ValueError:
            raise argparse.ArgumentTypeError(unparsed.format(text=text)) from None
        if not ok(value):
            raise argparse.ArgumentTypeError(rejected.format(text=text, value=value))
        return value

    convert.__name__ = convert.__qualname__ = name
    return convert


positive_int = number_type(
    int, lambda v: v >= 1, "positive_int",
    unparsed="expected a positive integer, got {text!r}",
    rejected="expected a positive integer, got {value}")
non_negative_int = number_type(
    int, lambda v: v >= 0, "non_negative_int",
    unparsed="expected an integer >= 0, got {text!r}",
    rejected="expected an integer >= 0, got {value}")
# A seed of the data order and the model (zeropp_jax.data.MAX_SEED: larger
# ones would alias smaller ones).
seed_int = number_type(
    int, lambda v: 0 <= v <= MAX_SEED, "seed_int",
    unparsed=f"expected an integer from 0 to {MAX_SEED}, got {{text!r}}",
    rejected=f"expected an integer from 0 to {MAX_SEED} (2**32 - 1), got {{value}}")
# Finite numbers: ``inf`` and ``nan`` are refused.
non_negative_float = number_type(
    float, lambda v: 0 <= v < _INF, "non_negative_float",
    unparsed="expected a number >= 0, got {text!r}",
    rejected="expected a finite number >= 0, got {text!r}")
positive_float = number_type(
    float, lambda v: 0 < v < _INF, "positive_float",
    unparsed="expected a positive number, got {text!r}",
    rejected="expected a finite positive number, got {text!r}")


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
                     f"out (zeropp-train takes {'it' if one else 'them'})")


def json_file(path: str) -> Any:
    """A flag's JSON file, read (an argparse type: a file that cannot be read,
    or is not JSON, is a usage error naming it)."""
    try:
        with open(path) as f:
            return json.load(f)
    except (OSError, ValueError) as e:
        raise argparse.ArgumentTypeError(f"cannot read {path} as JSON: {e}") from None

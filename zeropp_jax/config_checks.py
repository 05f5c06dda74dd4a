"""Checks of :class:`~zeropp_jax.config.ZeroConfig`: single values, and those that span several fields.

Run once by ``ZeroConfig.__post_init__``; each raises a ``ValueError`` that
names the fields, the values given and a combination that works.
"""

from __future__ import annotations

import contextlib
import contextvars
import dataclasses
import warnings
from typing import Any

import jax.numpy as jnp
import numpy as np

QGZ_CODES = ("sign", "hadamard", "dither")
QGZ_SHARES = ("two-hop", "gather", "auto")
HPZ_SECONDARIES = ("decoded", "quantized")
QGZ_TARGETS = ("gradient", "momentum")
QWZ_BITS = (0, 8, 4)
FLOAT_DTYPES = ("float32", "bfloat16", "float16")
SCALE_DTYPES = ("float32", "bfloat16")

_DTYPES = {
    "float32": jnp.float32, "fp32": jnp.float32,
    "bfloat16": jnp.bfloat16, "bf16": jnp.bfloat16,
    "float16": jnp.float16, "fp16": jnp.float16,
}


def parse_dtype(name: Any) -> Any:
    """The jnp dtype type for a name such as ``"bf16"`` or ``"float32"``, or for a
    dtype (``jnp.bfloat16``, ``np.dtype("float32")``: the same ``jnp.bfloat16``
    or ``jnp.float32`` as its name); raises ``ValueError`` for anything else."""
    try:
        if isinstance(name, str):
            return _DTYPES[name.lower()]
        dtype = jnp.dtype(name)
        return _DTYPES.get(dtype.name, dtype.type)
    except (KeyError, TypeError):
        raise ValueError(
            f"unknown dtype {name!r}; use one of {sorted(_DTYPES)} or a jnp float dtype"
        ) from None


def is_int(value: Any) -> bool:
    """Whether ``value`` is an integer (a Python or NumPy integer; not ``bool``
    nor ``8.0``)."""
    return isinstance(value, (int, np.integer)) and not isinstance(value, (bool, np.bool_))


def is_real(value: Any) -> bool:
    """Whether ``value`` is a real number (a Python or NumPy integer or float;
    not ``bool``, a complex number nor a string)."""
    return (isinstance(value, (int, float, np.integer, np.floating))
            and not isinstance(value, (bool, np.bool_)))


def check_field_names(cls, names) -> None:
    """Raises ``ValueError`` for names in ``names`` that are not fields of ``cls``."""
    fields = {f.name for f in dataclasses.fields(cls)}
    unknown = sorted(set(names) - fields)
    if unknown:
        raise ValueError(f"unknown config field(s) {unknown}; valid fields are {sorted(fields)}")


def check_values(config) -> None:
    """Single fields: dtypes (stored as jnp types), qwZ bits, block sizes, ``grad_accum``,
    and the switches (``bool`` fields)."""
    for name, allowed in (("compute_dtype", FLOAT_DTYPES), ("reduce_dtype", FLOAT_DTYPES),
                          ("scale_dtype", SCALE_DTYPES)):
        value = getattr(config, name)
        if name != "scale_dtype" and (value is None or (isinstance(value, str)
                                                         and value == "auto")):
            object.__setattr__(config, name, None)  # "auto", as the command line spells it
            continue
        try:
            dtype = parse_dtype(value)
        except ValueError:
            dtype = None
        if dtype is None or jnp.dtype(dtype).name not in allowed:
            names = [n for n in _DTYPES if jnp.dtype(_DTYPES[n]).name in allowed]
            auto = "" if name == "scale_dtype" else ", or None / 'auto' (the default)"
            raise ValueError(
                f"{name} must be one of {names} (a name or the jnp dtype){auto}, got {value!r}"
            )
        object.__setattr__(config, name, dtype)
    if not is_int(config.qwz_bits) or config.qwz_bits not in QWZ_BITS:
        raise ValueError(
            f"qwz_bits must be the integer 0 (off), 8 or 4, got {config.qwz_bits!r}"
        )
    for name in ("qwz_block", "qgz_block"):
        value = getattr(config, name)
        if not is_int(value) or value < 8 or value % 8:
            raise ValueError(f"{name} must be a positive multiple of 8, got {value!r}")
    if not is_int(config.grad_accum) or config.grad_accum < 1:
        raise ValueError(f"grad_accum must be an integer >= 1, got {config.grad_accum!r}")
    for field in dataclasses.fields(config):  # switches: True or False, not any truthy value
        value = getattr(config, field.name)
        if field.metadata.get("parse") is bool and not isinstance(value, (bool, np.bool_)):
            raise ValueError(f"{field.name} must be True or False, got {value!r}")


def check_qgz_schedule(config) -> None:
    """qgZ's seed, warm-up, gradient-RMS gate and target: values of the right kind."""
    if not is_int(config.qgz_seed):
        raise ValueError(f"qgz_seed must be an integer, got {config.qgz_seed!r}")
    if not is_int(config.qgz_warmup_steps) or config.qgz_warmup_steps < 0:
        raise ValueError(
            f"qgz_warmup_steps must be an integer >= 0, got {config.qgz_warmup_steps!r}"
        )
    rms = config.qgz_min_grad_rms
    if not is_real(rms) or not 0 <= rms < float("inf"):
        raise ValueError(
            "qgz_min_grad_rms must be a finite number >= 0 (0 disables the gate; an infinite "
            f"one would never compress), got {config.qgz_min_grad_rms!r}"
        )
    if config.qgz_target not in QGZ_TARGETS:
        raise ValueError(f"qgz_target must be one of {QGZ_TARGETS}, got {config.qgz_target!r}")


def check_qgz_code(config) -> None:
    """qgZ's code and 1-bit Adam's share: known values, and what the dithered code needs."""
    if config.qgz_code not in QGZ_CODES:
        raise ValueError(f"qgz_code must be one of {QGZ_CODES}, got {config.qgz_code!r}")
    if config.qgz_share not in QGZ_SHARES:
        raise ValueError(f"qgz_share must be one of {QGZ_SHARES}, got {config.qgz_share!r}")
    if config.qgz_code == "dither":
        if config.qgz != "1bit":
            raise ValueError(
                f"qgz_code='dither' is a 1-bit code; it needs qgz='1bit', got qgz={config.qgz!r}"
            )
        if config.qgz_error_feedback and config.qgz_target != "momentum":  # that: below
            raise ValueError(
                "qgz_code='dither' runs without error feedback: its error is as large as "
                "the block scale and feeding it back makes the carry grow (10x the "
                "gradient in benchmarks/RESULTS.md); set qgz_error_feedback=False "
                "(--no-qgz-error-feedback), or use qgz_code='sign' with error feedback"
            )
    block = config.qgz_block
    if config.qgz_code == "hadamard" and (config.qgz == "off" or block & (block - 1)):
        raise ValueError(
            "qgz_code='hadamard' rotates each qgZ block, so it needs qgZ on and a "
            f"power-of-two qgz_block (e.g. 128); got qgz={config.qgz!r}, qgz_block={block!r}"
        )
    if config.qgz_share != "two-hop" and config.qgz_target != "momentum":
        raise ValueError(
            f"qgz_share={config.qgz_share!r} chooses how 1-bit Adam's momentum codes reach "
            "every node; it needs qgz_target='momentum' (gradient qgZ sums each chunk on "
            f"one node and never shares it back), got qgz_target={config.qgz_target!r}"
        )


def check_node_replicated(config) -> None:
    """Node-replicated parameters need every node to compute the same update."""
    if not config.node_replicated:
        return
    if config.qgz_target != "momentum":
        raise ValueError(
            "node_replicated=True needs 1-bit Adam (qgz_target='momentum', as in the "
            "zeropp and zeropp-max presets): then every node holds the same momentum and "
            f"applies the same update; got qgz_target={config.qgz_target!r}"
        )
    if config.hpz:
        raise ValueError(
            "node_replicated=True keeps the parameters on every node already, so hpZ's "
            "secondary partition has nothing to add: set hpz=False (--no-hpz; the "
            "zeropp-max preset leaves hpZ off)"
        )


def check_hpz_secondary(config) -> None:
    """hpZ's secondary partition: a known form, and ``"quantized"`` only where there are codes."""
    if config.hpz_secondary not in HPZ_SECONDARIES:
        raise ValueError(
            f"hpz_secondary must be one of {HPZ_SECONDARIES}, got {config.hpz_secondary!r}"
        )
    if config.hpz_secondary == "quantized" and not (config.hpz and config.qwz_bits):
        raise ValueError(
            "hpz_secondary='quantized' keeps hpZ's secondary partition as qwZ codes; it "
            f"needs hpz=True and qwz_bits 8 or 4, got hpz={config.hpz!r}, "
            f"qwz_bits={config.qwz_bits!r} (e.g. the zeropp preset)"
        )


def check_onebit_adam(config) -> None:
    """The fields 1-bit Adam (``qgz_target="momentum"``) needs, and its refresh period."""
    if config.qgz_target == "momentum":
        if config.qgz == "off":
            raise ValueError(
                "qgz_target='momentum' compresses Adam's momentum across nodes; it needs "
                "qgz='1bit' (or 'int8' / 'int4'), got qgz='off'"
            )
        if config.qgz_code == "dither":
            raise ValueError(
                "qgz_target='momentum' runs error feedback on the momentum, which the "
                "dithered code cannot: use qgz_code='sign' or 'hadamard', or "
                "qgz_target='gradient' to compress gradients with it (--qgz-target gradient)"
            )
        if config.qgz_warmup_steps < 1:
            raise ValueError(
                "qgz_target='momentum' freezes Adam's second moment when compression "
                "starts, so it needs full-precision warm-up steps to estimate it: "
                f"qgz_warmup_steps must be >= 1, got {config.qgz_warmup_steps!r} "
                "(1-bit Adam warms up for 15-25% of training)"
            )
        if config.qgz_min_grad_rms:
            raise ValueError(
                "qgz_min_grad_rms (the compression gate) applies to qgz_target='gradient'; "
                "with qgz_target='momentum' the global gradient is not formed on "
                f"compressed steps, so set qgz_min_grad_rms=0 (got {config.qgz_min_grad_rms!r})"
            )
    if not is_int(config.qgz_refresh_every) or config.qgz_refresh_every < 0:
        raise ValueError(
            f"qgz_refresh_every must be an integer >= 0 (0: never), got {config.qgz_refresh_every!r}"
        )
    if config.qgz_refresh_every == 1:
        raise ValueError(
            "qgz_refresh_every=1 makes every step after the warm-up a full-precision refresh, "
            "so no step would be compressed; use 2 or more, or 0 to never refresh")
    if config.qgz_refresh_every and config.qgz_target != "momentum":
        raise ValueError(
            "qgz_refresh_every refreshes 1-bit Adam's frozen second moment; it needs "
            f"qgz_target='momentum' (got qgz_target={config.qgz_target!r})"
        )


def idle_fields(config) -> dict[str, str]:
    """The fields whose value ``config`` never uses, each with why (the switch that is off).

    Not an error: a preset keeps its fields when a feature is switched off
    (``from_preset("zeropp", qwz_bits=0)`` keeps its ``qwz_block``). The
    command line warns of the flags given for such fields.
    """
    out = {}
    if not config.qwz_bits:
        out["qwz_block"] = "qwZ is off (qwz_bits=0)"
    if not (config.hpz and config.qwz_bits):
        out["hpz_secondary"] = "it is how hpZ holds qwZ's codes, and hpZ or qwZ is off"
    if config.qgz == "off":
        for name in ("qgz_block", "qgz_code", "qgz_share", "qgz_target", "qgz_error_feedback",
                     "qgz_warmup_steps", "qgz_min_grad_rms", "qgz_refresh_every"):
            out[name] = "qgZ is off (qgz='off')"
        if not config.qwz_bits:
            out["scale_dtype"] = "nothing is quantized (qwZ and qgZ are off)"
    return out


_PRESET_APPLIED = contextvars.ContextVar("zeropp_jax_preset_applied", default=False)


@contextlib.contextmanager
def preset_applied():
    """While ``ZeroConfig.from_preset`` builds a config: its preset is applied,
    so :func:`check_preset_label` has nothing to warn of."""
    token = _PRESET_APPLIED.set(True)
    try:
        yield
    finally:
        _PRESET_APPLIED.reset(token)


def check_preset_label(cfg: Any, presets: dict) -> None:
    """Warns of a config named after a preset it has nothing of, built
    directly: ``ZeroConfig(preset="zeropp")`` only labels a plain zero3
    config (the preset's fields come from ``from_preset``, whose overrides
    may take them all away: ``from_preset("hpz", hpz=False)``, asked for)."""
    if _PRESET_APPLIED.get():
        return
    plain = {f.name: f.default for f in dataclasses.fields(cfg)} | presets["zero3"]
    own = {k: v for k, v in presets[cfg.preset].items() if plain[k] != v}
    if own and all(getattr(cfg, k) == plain[k] for k in own):
        warnings.warn(
            f"this ZeroConfig is labelled preset={cfg.preset!r} but has none of that "
            f"preset's settings ({', '.join(f'{k}={v!r}' for k, v in own.items())}): the "
            "preset field only names where the fields started, and "
            f"ZeroConfig(preset={cfg.preset!r}) alone is plain zero3; "
            f"ZeroConfig.from_preset({cfg.preset!r}, ...) applies the preset", stacklevel=4)

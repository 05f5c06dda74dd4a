"""One frozen, validated configuration for a ZeRO-3 / ZeRO++ train step.

A config is data: build it from a preset with :func:`ZeroConfig.from_preset`,
override single fields with keyword arguments, and every check runs once in
``__post_init__`` with an error that names the bad value and what would be
valid. Each field carries its own documentation and command-line spelling
(see :func:`_field`); ``zeropp_jax.cli.common`` builds the flags of
``zeropp-train`` and ``zeropp-comm`` from them.

Presets:

==============  ======  =====  ==============================================
preset          qwZ     hpZ    qgZ
==============  ======  =====  ==============================================
``zero3``       off     off    off (full-precision reduce-scatter)
``qwz``         int8    off    off
``hpz``         off     on     off
``qgz``         off     off    1-bit, error feedback on Adam's momentum
``zeropp``      int8    on     1-bit Adam on the compact wire (below)
``zeropp-max``  off     --     the same, parameters replicated over nodes
==============  ======  =====  ==============================================

The 1-bit presets run 1-bit Adam (``qgz_target="momentum"``, optimizer
:func:`zeropp_jax.onebit_adam`): error feedback on the gradient in front of
Adam loses much more loss than error feedback on the momentum, because Adam's
per-coordinate normalization turns the carry's late, bursty delivery into
wrong-sized steps (measured: benchmarks/RESULTS.md). ``qgz_target="gradient"``
keeps gradient compression for any optax optimizer.
"""

from __future__ import annotations

import dataclasses
import math
import types
from typing import Any, ClassVar

import jax.numpy as jnp
import numpy as np

# parse_dtype lived here: re-exported for ``from zeropp_jax.config import parse_dtype``.
from zeropp_jax.config_checks import (  # noqa: F401
    HPZ_SECONDARIES, QGZ_CODES, QGZ_SHARES, QGZ_TARGETS, QWZ_BITS, SCALE_DTYPES,
    check_field_names, check_hpz_secondary, check_node_replicated, check_onebit_adam,
    check_qgz_code, check_preset_label, check_qgz_schedule, check_values, parse_dtype,
    preset_applied,
)

# 1-bit Adam estimates Adam's second moment in the warm-up and freezes it
# afterwards; 100 steps is 25% of the 400-step convergence runs, as the
# 1-bit Adam paper's 15-25% (benchmarks/RESULTS.md).
DEFAULT_QGZ_WARMUP = 100
# Every this many steps after the warm-up one full-precision step refreshes
# 1-bit Adam's frozen second moment: without refreshes the loss gap grows late
# in training (benchmarks/RESULTS.md).
DEFAULT_QGZ_REFRESH_EVERY = 10

# The compact wire of the zeropp and zeropp-max presets: 1-bit codes with one
# bf16 scale per this many, and a refresh this rarely (measured: no loss cost
# over 5 seeds; benchmarks/RESULTS.md, "compact wire").
COMPACT_QGZ_BLOCK = 128
COMPACT_REFRESH_EVERY = 40

_ONEBIT_ADAM = dict(
    qgz="1bit", qgz_error_feedback=True, qgz_target="momentum",
    qgz_warmup_steps=DEFAULT_QGZ_WARMUP, qgz_refresh_every=DEFAULT_QGZ_REFRESH_EVERY,
)
# 1-bit Adam on the compact wire: one bf16 scale per 128 signs, a refresh
# every 40 steps; the codes are of each block's Hadamard rotation (each node
# with random signs of its own, so the nodes' code errors average out), and
# with two nodes every node gathers every node's codes instead of a second,
# re-quantized hop (same bytes, half the code error). Over ten seeds zeropp's
# loss gap fell from +0.76% to +0.08% on it (benchmarks/RESULTS.md).
_COMPACT_ONEBIT_ADAM = dict(
    _ONEBIT_ADAM, qgz_refresh_every=COMPACT_REFRESH_EVERY, qgz_block=COMPACT_QGZ_BLOCK,
    scale_dtype="bfloat16", qgz_code="hadamard", qgz_share="auto",
)

PRESETS = types.MappingProxyType({name: types.MappingProxyType(fields) for name, fields in {
    "zero3": dict(qwz_bits=0, hpz=False, qgz="off"),
    "qwz": dict(qwz_bits=8, hpz=False, qgz="off"),
    "hpz": dict(qwz_bits=0, hpz=True, qgz="off"),
    "qgz": dict(qwz_bits=0, hpz=False, **_ONEBIT_ADAM),
    "zeropp": dict(qwz_bits=8, hpz=True, **_COMPACT_ONEBIT_ADAM),
    # 1-bit Adam with the parameters replicated over nodes: no parameter
    # traffic crosses nodes, only the momentum codes (and refresh steps); no
    # qwZ (its gathers stay inside the node, where it only added loss noise).
    "zeropp-max": dict(qwz_bits=0, hpz=False, node_replicated=True, **_COMPACT_ONEBIT_ADAM),
}.items()})  # read-only, each preset's fields too: no caller can change a preset for the others

# Every shard is a multiple of this many elements, whatever is quantized: the
# base every block is a multiple of (eight 1-bit codes fill one byte).
SHARD_ALIGNMENT = 8
# A shard that qwZ or qgZ quantizes is also a multiple of this many elements
# (the padding every quantizing preset had before stop 48): the Pallas
# kernels' programs take the largest power of two of blocks that divides a
# shard's block count (pallas_kernels/_common.py tile_blocks), so 1-bit blocks
# of 32 go at least 8 to a program, not 1 or 2.
QUANTIZED_SHARD_ALIGNMENT = 256

QGZ_MODES = ("off", "1bit", "int8", "int4")
QGZ_BITS = {"off": 0, "1bit": 1, "int8": 8, "int4": 4}
IMPLEMENTATIONS = ("auto", "xla", "pallas")

# Default block sizes (elements per scale). int8 / int4: 256 is the smallest
# block whose float32 scales cost under 2% of an int8 payload, and stays
# inside one weight row for d_model >= 256 (benchmarks/quantization_blocks.py,
# benchmarks/RESULTS.md).
DEFAULT_QWZ_BLOCK = 256
DEFAULT_QGZ_BLOCK = 256
# A sign carries no magnitude, so 1-bit blocks need finer scales: at 32 the
# scale adds one bit per value and the loss gap shrinks (benchmarks/RESULTS.md).
DEFAULT_QGZ_BLOCK_1BIT = 32
# The dithered code's noise is uniform on +-max|x| of its block, so smaller
# blocks cut it; 16 costs 3 bits per value with float32 scales, 2 with
# bfloat16 ones (benchmarks/RESULTS.md).
DEFAULT_QGZ_BLOCK_DITHER = 16

def _field(
    default: Any,
    help: str,
    *,
    flag: str | None = "",
    parse: type = str,
    choices: tuple | None = None,
    at_least: int | None = None,
    cli_default: Any = None,
    none_name: str | None = None,
) -> Any:
    """A config field with its documentation and its command-line flag, in one place.

    Args:
      default: the field's default.
      help: what the field means, in plain text (also the flag's ``--help``).
      flag: the flag; ``""``: ``--`` and the field name with dashes; ``None``:
        no flag.
      parse: ``str``, ``int``, ``float`` or ``bool`` (``--x`` / ``--no-x``).
      choices: the valid values, if a fixed few.
      at_least: the smallest valid number, checked while parsing the flag.
      cli_default: the flag's default; ``None`` keeps the preset's value.
      none_name: the flag's word for ``None`` (and then its default).

    ``zeropp_jax.cli.common.add_config_args`` reads these.
    """
    return dataclasses.field(default=default, metadata=dict(
        help=help, flag=flag, parse=parse, choices=choices, at_least=at_least,
        cli_default=none_name if none_name is not None else cli_default,
        none_name=none_name,
    ))


def _preset_fields(preset: str, given: dict) -> dict:
    """A preset's fields with ``given`` on top, less the preset's qgZ fields
    that ``given`` makes meaningless (see :meth:`ZeroConfig.from_preset`)."""
    # An unknown preset adds nothing here; __post_init__ rejects it.
    wire = PRESETS.get(preset, {})
    kwargs = {**wire, **given}
    # A preset's 1-bit Adam fields describe its compression: with qgZ
    # switched off there is nothing to compress, its code and block are its
    # own mode's (the block also its own code's), and with the gradient target
    # there is no frozen second moment to refresh. Fields given explicitly are
    # kept (and validated as given).
    def drop(*names):
        for name in names:
            if name not in given:
                kwargs.pop(name, None)

    if kwargs.get("qgz") == "off":
        drop("qgz_target")
    if kwargs.get("qgz") != wire.get("qgz"):
        drop("qgz_code", "qgz_block")
    if kwargs.get("qgz_code") != wire.get("qgz_code"):
        drop("qgz_block")
    if kwargs.get("qgz_target", "gradient") != "momentum":
        drop("qgz_refresh_every", "qgz_share")
    return kwargs


@dataclasses.dataclass(frozen=True)
class ZeroConfig:
    """How parameters and gradients are partitioned and communicated.

    Each field's ``help`` (listed under Attributes, below) says what it
    means; it is also the ``--help`` text of the field's flag in ``zeropp-train`` and
    ``zeropp-comm``. Master weights and optimizer state are always float32
    shards, whatever the dtypes here.
    """

    preset: str = _field(
        "zero3", f"the preset the other fields start from: one of {', '.join(PRESETS)}",
        cli_default="zero3",
    )
    compute_dtype: Any = _field(
        None, "compute dtype of the gathered parameters: auto (bf16 on GPU, fp32 elsewhere), "
        "bf16, fp32 or fp16", flag="--dtype", none_name="auto",
    )
    reduce_dtype: Any = _field(
        None, "dtype of full-precision gradient reduce-scatters (default: the compute dtype)",
        flag=None,
    )
    qwz_bits: int = _field(
        0, "qwZ: bits per value of the parameter all-gathers, 0 (off), 8 or 4",
        parse=int, choices=QWZ_BITS,
    )
    qwz_block: int = _field(
        DEFAULT_QWZ_BLOCK, "qwZ: parameter elements per quantization scale (a multiple of 8)",
        parse=int, at_least=1,
    )
    hpz: bool = _field(
        False, "hpZ: keep a secondary parameter partition inside each node, so per-layer "
        "gathers run over the local axis only", parse=bool,
    )
    hpz_secondary: str = _field(
        "decoded", "with hpZ and qwZ, how each node holds its secondary partition: decoded "
        "(qwZ's codes cross nodes once per step and are decoded once, so the per-layer "
        "gathers inside the node carry the compute dtype, as DeepSpeed's hpZ) or quantized "
        "(the codes themselves: the secondary's memory and in-node gather bytes of int8 or "
        "int4, a dequantize after every gather); the parameters are the same either way",
        choices=HPZ_SECONDARIES,
    )
    qgz: str = _field(
        "off", "qgZ: compression of the cross-node gradient reduction: off, 1bit, int8 or int4",
        choices=QGZ_MODES,
    )
    qgz_error_feedback: bool = _field(
        True, "qgZ: carry what compression loses into the next step", parse=bool,
    )
    qgz_code: str = _field(
        "sign", "qgZ code: sign (scaled sign per block, or absmax integers), hadamard (the "
        "same code of each block's randomized Hadamard rotation, which spreads the error "
        "evenly over the block, with random signs of each node's own; a power-of-two block) or dither (1-bit, unbiased, "
        "zeropp_jax.wire.dither; it needs --no-qgz-error-feedback and --qgz-target gradient); "
        "hadamard in the zeropp and zeropp-max presets",
        choices=QGZ_CODES,
    )
    qgz_share: str = _field(
        "two-hop", "how 1-bit Adam's compressed momentum reaches every node: two-hop (sum "
        "each chunk over nodes, then gather it quantized again: 2(nodes-1)/nodes codes into "
        "each node), gather (gather every node's codes and sum them on each node: nothing "
        "quantized twice, nodes-1 codes into each node) or auto (gather where it moves no "
        "more bytes: two nodes; the zeropp and zeropp-max presets)",
        choices=QGZ_SHARES,
    )
    qgz_target: str = _field(
        "gradient", "what qgZ compresses across nodes: the gradient (error feedback on the "
        "gradient; any optax optimizer) or Adam's momentum (1-bit Adam, "
        "zeropp_jax.onebit_adam: error feedback on the momentum, Adam's second moment "
        "frozen after --qgz-warmup; needs qgZ on, the sign or hadamard code (not dither) "
        "and a warm-up of at least 1 step); momentum in the qgz, zeropp and zeropp-max presets",
        choices=QGZ_TARGETS,
    )
    qgz_seed: int = _field(
        0, "seed of the dithered code's noise: runs with different seeds draw unrelated "
        "noise streams (the CLI passes --seed)", flag=None,
    )
    qgz_block: int | None = _field(
        None, "qgZ: gradient elements per scale, a multiple of 8 (default: 32 for 1bit, 16 "
        "for 1bit with the dither code, 256 for int8 and int4; the zeropp and zeropp-max "
        "presets: 128)", parse=int, at_least=1,
    )
    qgz_warmup_steps: int = _field(
        0, "optimizer steps at full precision before qgZ compresses (the presets: 100; "
        "1-bit Adam freezes Adam's second moment at its end, so a short one gives large "
        "steps where gradients were rarely seen)",
        flag="--qgz-warmup", parse=int, at_least=0,
    )
    qgz_min_grad_rms: float = _field(
        0.0, "compress only while the gradient RMS (measured on the previous step) is at "
        "least this (0: always; gradient target only)", parse=float, at_least=0,
    )
    qgz_refresh_every: int = _field(
        0, "with --qgz-target momentum: every N-th step after the warm-up runs at full "
        "precision and refreshes Adam's second moment (0: never)", parse=int, at_least=0,
    )
    hierarchical_collectives: bool = _field(
        False, "run the per-layer all-gathers and gradient reduce-scatters over node and "
        "local in two steps (one device per node crosses nodes), as a two-level ZeRO-3 "
        "would; same values", flag="--hierarchical", parse=bool,
    )
    prefetch: bool = _field(
        True, "gather the next stacked layer while the current one computes, forward and "
        "backward (depth 1, zeropp_jax.scan_layers; with hpZ and one micro-batch the forward "
        "also forms each layer's secondary partition, over node, one layer ahead); same "
        "bytes and values; off on a one-device mesh, which gathers nothing", parse=bool,
    )
    keep_activations: bool = _field(
        False, "save each layer's activations (outputs of its matrix products) in the "
        "forward, so the backward gathers the layer's parameters again but does not "
        "recompute its matrix products; more activation memory, less compute; the same or "
        "fewer bytes (a layer whose input needs no gradient is not gathered again)",
        parse=bool,
    )
    node_replicated: bool = _field(
        False, "with 1-bit Adam: parameters split over local, one copy per node, each node "
        "applying the same update, so no parameter crosses nodes", parse=bool)
    grad_accum: int = _field(
        1, "micro-batches per optimizer step", parse=int, at_least=1, cli_default=1,
    )
    scale_dtype: Any = _field(
        jnp.float32, "dtype of the per-block quantization scales on the wire (qwZ and qgZ)",
        choices=SCALE_DTYPES,
    )
    implementation: str = _field(
        "auto", "quantization kernels: auto (Pallas on GPU, XLA elsewhere), xla or pallas",
        choices=IMPLEMENTATIONS,
    )

    # Fields __post_init__ filled in with a default of the other fields (given
    # as None): replace() derives them again.
    _derived: ClassVar[frozenset] = frozenset()

    def __post_init__(self):
        if self.preset not in PRESETS:
            raise ValueError(f"unknown preset {self.preset!r}; choose one of {list(PRESETS)}")
        check_preset_label(self, PRESETS)
        if self.qgz not in QGZ_MODES:
            raise ValueError(f"qgz must be one of {QGZ_MODES}, got {self.qgz!r}")
        if self.qgz_block is None:
            if self.qgz == "1bit":
                dithered = self.qgz_code == "dither"
                block = DEFAULT_QGZ_BLOCK_DITHER if dithered else DEFAULT_QGZ_BLOCK_1BIT
            else:
                block = DEFAULT_QGZ_BLOCK
            object.__setattr__(self, "qgz_block", block)
            object.__setattr__(self, "_derived", frozenset({"qgz_block"}))
        check_values(self)
        check_qgz_schedule(self)
        check_qgz_code(self)
        check_onebit_adam(self)
        check_node_replicated(self)
        check_hpz_secondary(self)
        if self.implementation not in IMPLEMENTATIONS:
            raise ValueError(
                f"implementation must be one of {IMPLEMENTATIONS}, got {self.implementation!r}"
            )

    @classmethod
    def from_preset(cls, preset: str = "zero3", **overrides: Any) -> "ZeroConfig":
        """Builds the config of a preset, with some fields overridden.

        Overrides of ``None`` are ignored (the preset's value stays). The
        1-bit presets' momentum target is dropped when ``qgz="off"`` is
        given, their code and block when another ``qgz`` mode is (the block
        also with another code), and their refresh period and share when the
        target is ``"gradient"`` (given or implied), unless those fields are
        given too.

        Example::

          cfg = ZeroConfig.from_preset("zeropp", qwz_bits=4, grad_accum=4)
          sgd = ZeroConfig.from_preset("zeropp", qgz_target="gradient")  # any optax optimizer
        """
        check_field_names(cls, overrides)
        given = {k: v for k, v in overrides.items() if v is not None}
        with preset_applied():  # what it leaves of the preset is asked for: no warning
            return cls(preset=preset, **_preset_fields(preset, given))

    def replace(self, **changes: Any) -> "ZeroConfig":
        """A copy with ``changes``, validated again. A field left to its derived
        default (``qgz_block``: 32 for 1bit, 16 with the dither code, else 256)
        is derived again from the new values unless given: as if built anew."""
        check_field_names(type(self), changes)
        derived = {name: None for name in self._derived if name not in changes}
        return dataclasses.replace(self, **derived, **changes)

    @property
    def qgz_bits(self) -> int:
        return QGZ_BITS[self.qgz]

    @property
    def hierarchical_grads(self) -> bool:
        """Whether per-layer gradients are reduced over ``local`` only.

        Then the cross-node reduction runs once per optimizer step (in full
        precision or compressed by qgZ) instead of once per layer and
        micro-batch; with hpZ alone, except in stacks under one micro-batch
        (:func:`~zeropp_jax.step.geometry.node_level_once`).
        """
        return self.hpz or self.qgz != "off"

    def alignment(self) -> int:
        """Elements each device's shard must be a multiple of.

        8 when nothing is quantized; with qwZ or qgZ on,
        :data:`QUANTIZED_SHARD_ALIGNMENT` and the block of every feature that
        is on (``qwz_block`` with ``qwz_bits``, ``qgz_block`` with ``qgz``). A
        block of a feature that is off pads nothing (before, a large
        ``qwz_block`` padded every shard of a zero3 run to it).
        """
        blocks = list(self.quantization_blocks().values())
        align = SHARD_ALIGNMENT
        for block in [QUANTIZED_SHARD_ALIGNMENT] * bool(blocks) + blocks:
            align = math.lcm(align, block)
        return align

    def quantization_blocks(self) -> dict[str, int]:
        """Field name -> block of each feature that is on: ``qwz_block`` with
        ``qwz_bits``, ``qgz_block`` with ``qgz`` (a block of a feature that is
        off is never used)."""
        on = {"qwz_block": bool(self.qwz_bits), "qgz_block": self.qgz != "off"}
        return {name: getattr(self, name) for name, used in on.items() if used}

    def leaf_alignment(self) -> int:
        """Elements every parameter leaf starts at a multiple of.

        With qwZ on, the qwZ block: then no int8 / int4 block mixes two
        tensors (a LayerNorm bias sharing a block with its scale of ~1 is
        quantized far too coarsely; benchmarks/RESULTS.md).
        """
        return self.qwz_block if self.qwz_bits else 1

    def resolved_compute_dtype(self, backend: str) -> Any:
        if self.compute_dtype is not None:
            return self.compute_dtype
        return jnp.bfloat16 if backend == "gpu" else jnp.float32

    def describe(self) -> dict:
        """Plain-data summary for reports and metrics files."""
        out = {}
        for f in dataclasses.fields(self):
            value = getattr(self, f.name)
            value = value.item() if isinstance(value, np.generic) else value  # a NumPy number
            if value is not None and not isinstance(value, (str, int, float, bool)):
                value = jnp.dtype(value).name
            out[f.name] = value
        return out


ZeroConfig.__doc__ += "\n    Attributes:\n" + "".join(  # each field's help, for help(ZeroConfig)
    f"      {f.name}: {f.metadata['help']}\n" for f in dataclasses.fields(ZeroConfig))

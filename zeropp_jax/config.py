"""One frozen, validated configuration for a ZeRO-3 / ZeRO++ train step.

A config is data: build it from a preset with :func:`ZeroConfig.from_preset`,
override single fields with keyword arguments, and every check runs once in
``__post_init__`` with an error that names the bad value and what would be
valid.

Presets:

=========  ======  =====  ==============================================
preset     qwZ     hpZ    qgZ
=========  ======  =====  ==============================================
``zero3``  off     off    off (full-precision reduce-scatter)
``qwz``    int8    off    off
``hpz``    off     on     off
``qgz``    off     off    1-bit, error feedback on Adam's momentum
``zeropp`` int8    on     1-bit, error feedback on Adam's momentum
=========  ======  =====  ==============================================

The 1-bit presets run 1-bit Adam (``qgz_target="momentum"``, optimizer
:func:`zeropp_jax.onebit_adam`): error feedback on the gradient in front of
Adam costs the example GPT +8% loss over zero3 (Adam's per-coordinate
normalization turns the carry's late, bursty delivery into wrong-sized
steps; benchmarks/RESULTS.md), error feedback on the momentum about +1%.
``qgz_target="gradient"`` keeps gradient compression for any optax
optimizer.
"""

from __future__ import annotations

import dataclasses
from typing import Any

import jax.numpy as jnp

# Full-precision optimizer steps before 1-bit qgZ starts compressing in the
# presets that use it. 1-bit Adam estimates Adam's second moment in this
# warm-up and freezes it afterwards (the 1-bit Adam paper warms up for 15-25%
# of training); 100 is 25% of the 400-step convergence runs in
# benchmarks/RESULTS.md.
DEFAULT_QGZ_WARMUP = 100
# 1-bit Adam's refresh period in the presets: every this many steps after
# the warm-up one step runs at full precision and updates the frozen second
# moment. Without refreshes the loss gap on the example GPT grew from +0.7%
# to +3.5% late in training (seed 2, benchmarks/RESULTS.md); each refresh
# costs one full-precision cross-node reduction.
DEFAULT_QGZ_REFRESH_EVERY = 10

_ONEBIT_ADAM = dict(
    qgz="1bit", qgz_error_feedback=True, qgz_target="momentum",
    qgz_warmup_steps=DEFAULT_QGZ_WARMUP, qgz_refresh_every=DEFAULT_QGZ_REFRESH_EVERY,
)

PRESETS: dict[str, dict[str, Any]] = {
    "zero3": dict(qwz_bits=0, hpz=False, qgz="off"),
    "qwz": dict(qwz_bits=8, hpz=False, qgz="off"),
    "hpz": dict(qwz_bits=0, hpz=True, qgz="off"),
    "qgz": dict(qwz_bits=0, hpz=False, **_ONEBIT_ADAM),
    "zeropp": dict(qwz_bits=8, hpz=True, **_ONEBIT_ADAM),
}

QGZ_MODES = ("off", "1bit", "int8", "int4")
# 1-bit codes: "sign" = mean|x| * sign(x) per block (biased; meant for error
# feedback); "dither" = unbiased subtractive-dither code (zeropp_jax.wire.dither;
# without error feedback).
QGZ_CODES = ("sign", "dither")
# What qgZ compresses across nodes: the gradient (error feedback on the
# gradient, any optax optimizer) or Adam's momentum (1-bit Adam: the trainer
# runs zeropp_jax.onebit_adam, error feedback on the momentum).
QGZ_TARGETS = ("gradient", "momentum")
QGZ_BITS = {"off": 0, "1bit": 1, "int8": 8, "int4": 4}
IMPLEMENTATIONS = ("auto", "xla", "pallas")

# Default block sizes (elements per scale), from
# benchmarks/quantization_blocks.py: 256 is the smallest block whose fp32
# scales cost under 2% of an int8 payload (1.56%). The error grows 5-11% per
# doubling of the block (block 256 is 1.2-1.5x the error at 32), while int8's
# relative L2 error stays at 0.3-0.7%; for d_model >= 256 a block of 256 stays
# inside one weight row.
DEFAULT_QWZ_BLOCK = 256
DEFAULT_QGZ_BLOCK = 256
# 1-bit gradients need finer scales: a sign carries no magnitude, so the
# block's mean |g| is the only magnitude information.  At 32 the scale costs
# one extra bit per value (2 bits in all, 1/16 of fp32); on the example GPT
# the loss gap to full precision at step 150 dropped from 6.3% (block 256) to
# 2.7% (no warm-up). Block 128 gives nearly the same per-step error (1.01x)
# for 1.25 bits per value; its effect on the loss is not measured yet.
DEFAULT_QGZ_BLOCK_1BIT = 32
# The dithered (unbiased) 1-bit code's noise is uniform on +-max|x| of its
# block, so smaller blocks cut it: on the example GPT (zeropp, no error
# feedback, 400 steps, benchmarks/RESULTS.md) the loss gap to zero3 is +1.15%
# at block 32 and +0.27% to +0.91% (four noise streams, mean +0.54%) at 16
# (+0.37% with the seed-0 stream since the seed is part of the dither key;
# seeds 1 and 2: +1.15% and +3.67%).
# Block 16 costs 3 bits per value with float32 scales; bfloat16 scales
# (2 bits per value) measured +1.5% and +1.9%.
DEFAULT_QGZ_BLOCK_DITHER = 16

_DTYPES = {
    "float32": jnp.float32,
    "fp32": jnp.float32,
    "bfloat16": jnp.bfloat16,
    "bf16": jnp.bfloat16,
    "float16": jnp.float16,
    "fp16": jnp.float16,
}


def parse_dtype(name: Any) -> Any:
    """Returns the jnp dtype for a name such as ``"bf16"`` or ``"float32"``."""
    if not isinstance(name, str):
        return jnp.dtype(name).type
    try:
        return _DTYPES[name.lower()]
    except KeyError:
        raise ValueError(
            f"unknown dtype {name!r}; use one of {sorted(_DTYPES)}"
        ) from None


@dataclasses.dataclass(frozen=True)
class ZeroConfig:
    """How parameters and gradients are partitioned and communicated.

    Attributes:
      preset: name of the preset the fields started from (for reports).
      compute_dtype: dtype of the gathered parameters the model computes with
        (master weights and optimizer state are always float32 shards).
        ``None`` picks bfloat16 on GPU and float32 elsewhere.
      reduce_dtype: dtype of full-precision gradient reduce-scatters
        (``None``: the compute dtype).
      qwz_bits: 0 (off), 8 or 4: bits per value of parameter all-gathers.
      qwz_block: elements per quantization scale for parameters.
      hpz: keep a secondary parameter partition inside each node so per-layer
        gathers run over ``local`` only.
      qgz: ``"off"``, ``"1bit"``, ``"int8"`` or ``"int4"``: compression of the
        cross-node gradient reduction.
      qgz_error_feedback: carry what compression loses into the next step.
      qgz_code: the 1-bit code, ``"sign"`` (scaled sign; the default) or
        ``"dither"`` (unbiased, no error feedback; see
        :mod:`zeropp_jax.wire.dither`).
      qgz_target: ``"gradient"`` (compress the gradient; any optax
        optimizer; the default) or ``"momentum"`` (1-bit Adam, the ``qgz``
        and ``zeropp`` presets: compress Adam's momentum,
        with ``v`` frozen after the warm-up; needs
        :func:`zeropp_jax.onebit_adam` as the optimizer, ``qgz`` on, the
        ``sign`` code and ``qgz_warmup_steps >= 1``; see
        :mod:`zeropp_jax.step.onebit_adam`).
      qgz_seed: seed of the dithered code's noise (``qgz_code="dither"``):
        runs with different seeds draw unrelated noise streams; the CLI
        passes ``--seed``.
      qgz_block: elements per gradient scale (``None``: 32 for ``1bit``,
        16 for ``1bit`` with ``qgz_code="dither"``, 256 for ``int8`` /
        ``int4``).
      qgz_warmup_steps: optimizer steps reduced at full precision before qgZ
        starts compressing.
      qgz_min_grad_rms: compress only while the root-mean-square of the
        gradient (measured on the previous step) is at least this; ``0``
        disables the gate.
      qgz_refresh_every: with ``qgz_target="momentum"``, every this many
        steps after the warm-up one step runs at full precision and updates
        Adam's second moment (``0``: ``v`` stays frozen after the warm-up).
      grad_accum: micro-batches per optimizer step.
      scale_dtype: dtype of the per-block scales on the wire.
      implementation: ``"auto"`` (Pallas on GPU, XLA elsewhere), ``"xla"`` or
        ``"pallas"`` for the quantization kernels.
    """

    preset: str = "zero3"
    compute_dtype: Any = None
    reduce_dtype: Any = None
    qwz_bits: int = 0
    qwz_block: int = DEFAULT_QWZ_BLOCK
    hpz: bool = False
    qgz: str = "off"
    qgz_error_feedback: bool = True
    qgz_code: str = "sign"
    qgz_target: str = "gradient"
    qgz_seed: int = 0
    qgz_block: int | None = None
    qgz_warmup_steps: int = 0
    qgz_min_grad_rms: float = 0.0
    qgz_refresh_every: int = 0
    grad_accum: int = 1
    scale_dtype: Any = jnp.float32
    implementation: str = "auto"

    def __post_init__(self):
        if self.preset not in PRESETS:
            raise ValueError(
                f"unknown preset {self.preset!r}; choose one of {list(PRESETS)}"
            )
        for name in ("compute_dtype", "reduce_dtype"):
            value = getattr(self, name)
            if value is not None:
                dtype = parse_dtype(value)
                if not jnp.issubdtype(dtype, jnp.floating):
                    raise ValueError(f"{name} must be a float dtype, got {value!r}")
                object.__setattr__(self, name, dtype)
        scale_dtype = parse_dtype(self.scale_dtype)
        if jnp.dtype(scale_dtype) not in (jnp.dtype(jnp.float32), jnp.dtype(jnp.bfloat16)):
            raise ValueError(
                f"scale_dtype must be float32 or bfloat16, got {self.scale_dtype!r}"
            )
        object.__setattr__(self, "scale_dtype", scale_dtype)
        if self.qwz_bits not in (0, 4, 8):
            raise ValueError(f"qwz_bits must be 0 (off), 8 or 4, got {self.qwz_bits!r}")
        if self.qgz not in QGZ_MODES:
            raise ValueError(f"qgz must be one of {QGZ_MODES}, got {self.qgz!r}")
        if self.qgz_code not in QGZ_CODES:
            raise ValueError(f"qgz_code must be one of {QGZ_CODES}, got {self.qgz_code!r}")
        if self.qgz_code == "dither":
            if self.qgz != "1bit":
                raise ValueError(
                    f"qgz_code='dither' is a 1-bit code; it needs qgz='1bit', got qgz={self.qgz!r}"
                )
            if self.qgz_error_feedback:
                raise ValueError(
                    "qgz_code='dither' runs without error feedback: its error is as large as "
                    "the block scale and feeding it back makes the carry grow (10x the "
                    "gradient in benchmarks/RESULTS.md); set qgz_error_feedback=False "
                    "(--no-qgz-error-feedback), "
                    "or use qgz_code='sign' with error feedback"
                )
        if self.qgz_block is None:
            if self.qgz == "1bit":
                dithered = self.qgz_code == "dither"
                block = DEFAULT_QGZ_BLOCK_DITHER if dithered else DEFAULT_QGZ_BLOCK_1BIT
            else:
                block = DEFAULT_QGZ_BLOCK
            object.__setattr__(self, "qgz_block", block)
        for name in ("qwz_block", "qgz_block"):
            value = getattr(self, name)
            if not isinstance(value, int) or value < 8 or value % 8:
                raise ValueError(
                    f"{name} must be a positive multiple of 8, got {value!r}"
                )
        if not isinstance(self.grad_accum, int) or self.grad_accum < 1:
            raise ValueError(f"grad_accum must be an integer >= 1, got {self.grad_accum!r}")
        if isinstance(self.qgz_seed, bool) or not isinstance(self.qgz_seed, int):
            raise ValueError(f"qgz_seed must be an integer, got {self.qgz_seed!r}")
        if not isinstance(self.qgz_warmup_steps, int) or self.qgz_warmup_steps < 0:
            raise ValueError(
                f"qgz_warmup_steps must be an integer >= 0, got {self.qgz_warmup_steps!r}"
            )
        if not self.qgz_min_grad_rms >= 0:
            raise ValueError(
                f"qgz_min_grad_rms must be >= 0 (0 disables the gate), got {self.qgz_min_grad_rms!r}"
            )
        if self.qgz_target not in QGZ_TARGETS:
            raise ValueError(f"qgz_target must be one of {QGZ_TARGETS}, got {self.qgz_target!r}")
        if self.qgz_target == "momentum":
            if self.qgz == "off":
                raise ValueError(
                    "qgz_target='momentum' compresses Adam's momentum across nodes; it needs "
                    "qgz='1bit' (or 'int8' / 'int4'), got qgz='off'"
                )
            if self.qgz_code != "sign":
                raise ValueError(
                    "qgz_target='momentum' uses the sign code with error feedback on the "
                    f"momentum; got qgz_code={self.qgz_code!r} (use qgz_code='sign', or "
                    "qgz_target='gradient' to compress gradients with it: --qgz-target gradient)"
                )
            if self.qgz_warmup_steps < 1:
                raise ValueError(
                    "qgz_target='momentum' freezes Adam's second moment when compression "
                    "starts, so it needs full-precision warm-up steps to estimate it: "
                    f"qgz_warmup_steps must be >= 1, got {self.qgz_warmup_steps!r} "
                    "(1-bit Adam warms up for 15-25% of training)"
                )
            if self.qgz_min_grad_rms:
                raise ValueError(
                    "qgz_min_grad_rms (the compression gate) applies to qgz_target='gradient'; "
                    "with qgz_target='momentum' the global gradient is not formed on "
                    f"compressed steps, so set qgz_min_grad_rms=0 (got {self.qgz_min_grad_rms!r})"
                )
        if (isinstance(self.qgz_refresh_every, bool) or not isinstance(self.qgz_refresh_every, int)
                or self.qgz_refresh_every < 0):
            raise ValueError(
                f"qgz_refresh_every must be an integer >= 0 (0: never), got {self.qgz_refresh_every!r}"
            )
        if self.qgz_refresh_every and self.qgz_target != "momentum":
            raise ValueError(
                "qgz_refresh_every refreshes 1-bit Adam's frozen second moment; it needs "
                f"qgz_target='momentum' (got qgz_target={self.qgz_target!r})"
            )
        if self.implementation not in IMPLEMENTATIONS:
            raise ValueError(
                f"implementation must be one of {IMPLEMENTATIONS}, got {self.implementation!r}"
            )

    @classmethod
    def from_preset(cls, preset: str = "zero3", **overrides: Any) -> "ZeroConfig":
        """Builds the config of a preset, with some fields overridden.

        Overrides of ``None`` are ignored (the preset's value stays). The
        1-bit presets' momentum target is dropped when ``qgz="off"`` is
        given, and their refresh period when the target is ``"gradient"``
        (given or implied), unless those fields are given too.

        Example::

          cfg = ZeroConfig.from_preset("zeropp", qwz_bits=4, grad_accum=4)
          sgd = ZeroConfig.from_preset("zeropp", qgz_target="gradient")  # any optax optimizer
        """
        if preset not in PRESETS:
            raise ValueError(
                f"unknown preset {preset!r}; choose one of {list(PRESETS)}"
            )
        fields = {f.name for f in dataclasses.fields(cls)}
        unknown = sorted(set(overrides) - fields)
        if unknown:
            raise ValueError(
                f"unknown config field(s) {unknown}; valid fields are {sorted(fields)}"
            )
        given = {k: v for k, v in overrides.items() if v is not None}
        kwargs = {**PRESETS[preset], **given}
        # A preset's 1-bit Adam fields describe its compression: with qgZ
        # switched off there is nothing to compress, and with the gradient
        # target there is no frozen second moment to refresh. Fields given
        # explicitly are kept (and validated as given).
        if kwargs.get("qgz") == "off" and "qgz_target" not in given:
            kwargs.pop("qgz_target", None)
        if kwargs.get("qgz_target", "gradient") != "momentum" and "qgz_refresh_every" not in given:
            kwargs.pop("qgz_refresh_every", None)
        return cls(preset=preset, **kwargs)

    def replace(self, **changes: Any) -> "ZeroConfig":
        return dataclasses.replace(self, **changes)

    @property
    def qgz_bits(self) -> int:
        return QGZ_BITS[self.qgz]

    @property
    def hierarchical_grads(self) -> bool:
        """Whether per-layer gradients are reduced over ``local`` only.

        Then the cross-node reduction runs once per optimizer step (in full
        precision or compressed by qgZ) instead of once per layer and
        micro-batch.
        """
        return self.hpz or self.qgz != "off"

    def alignment(self) -> int:
        """Elements each device's shard must be a multiple of."""
        align = 8
        for block in (self.qwz_block, self.qgz_block):
            align = _lcm(align, block)
        return align

    def leaf_alignment(self) -> int:
        """Elements every parameter leaf starts at a multiple of.

        With qwZ on, the qwZ block: then no int8 / int4 block mixes two
        tensors (a LayerNorm bias sharing a block with its scale of ~1 was
        quantized in steps of ~1/127, 3-14% of its size; benchmarks/RESULTS.md).
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
            if value is not None and not isinstance(value, (str, int, float, bool)):
                value = jnp.dtype(value).name
            out[f.name] = value
        return out


def _lcm(a: int, b: int) -> int:
    import math

    return a * b // math.gcd(a, b)

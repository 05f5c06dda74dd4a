"""ZeroConfig: defaults derived again by ``replace``; values of the wrong kind rejected."""

from __future__ import annotations

import dataclasses
import warnings

import jax.numpy as jnp
import numpy as np
import pytest

from zeropp_jax.config import PRESETS, ZeroConfig


def test_replace_derives_a_defaulted_qgz_block_again():
    onebit = ZeroConfig(qgz="1bit")
    assert onebit.qgz_block == 32
    assert onebit.replace(qgz="int8").qgz_block == ZeroConfig(qgz="int8").qgz_block == 256
    dither = dict(qgz_code="dither", qgz_error_feedback=False)
    assert onebit.replace(**dither).qgz_block == ZeroConfig(qgz="1bit", **dither).qgz_block == 16
    assert ZeroConfig(qgz="int4").replace(qgz="1bit").qgz_block == 32
    # a block that was given stays, as does one given to replace
    assert ZeroConfig(qgz="1bit", qgz_block=64).replace(qgz="int8").qgz_block == 64
    assert onebit.replace(qgz="int8", qgz_block=128).qgz_block == 128
    assert onebit.replace(qgz="int8", qgz_block=128).replace(qgz="int4").qgz_block == 128
    # a preset's block is its own (given), so it stays too
    assert ZeroConfig.from_preset("zeropp").replace(qwz_bits=4).qgz_block == 128
    # the field values and equality are those of a config built anew
    assert onebit.replace(qgz="int8") == ZeroConfig(qgz="int8")
    assert dataclasses.asdict(onebit)["qgz_block"] == 32


@pytest.mark.parametrize("field,value,match", [
    ("qwz_bits", 8.0, r"qwz_bits must be the integer 0 \(off\), 8 or 4, got 8.0"),
    ("qwz_bits", False, "qwz_bits must be the integer .* got False"),
    ("qgz_block", 32.0, "qgz_block must be a positive multiple of 8, got 32.0"),
    ("grad_accum", True, "grad_accum must be an integer >= 1, got True"),
    ("qgz_warmup_steps", 2.0, "qgz_warmup_steps must be an integer >= 0"),
    ("qgz_min_grad_rms", "x", "qgz_min_grad_rms must be a finite number >= 0"),
    ("qgz_min_grad_rms", float("inf"), "an infinite one would never compress"),
    ("compute_dtype", np.float64, r"compute_dtype must be one of \['float32', 'fp32', "
                                  r"'bfloat16', 'bf16', 'float16', 'fp16'\].*float64"),
    ("compute_dtype", "float64", "compute_dtype must be one of .*got 'float64'"),
    ("compute_dtype", jnp.int32, "compute_dtype must be one of .*int32"),
    ("reduce_dtype", "fp64", "reduce_dtype must be one of .*got 'fp64'"),
    ("scale_dtype", jnp.float16, r"scale_dtype must be one of \['float32', 'fp32', "
                                 r"'bfloat16', 'bf16'\]"),
    ("hpz", "no", "hpz must be True or False, got 'no'"),
    ("prefetch", 1, "prefetch must be True or False, got 1"),
])
def test_values_of_the_wrong_kind_are_rejected(field, value, match):
    with pytest.raises(ValueError, match=match):
        ZeroConfig(**{field: value})


def test_numpy_numbers_count_as_numbers():
    config = ZeroConfig(qwz_bits=np.int64(8), qgz="int8", qgz_min_grad_rms=np.float32(0.1))
    assert config.qwz_bits == 8 and config.qgz_min_grad_rms == np.float32(0.1)
    described = config.describe()  # the values, not their types' names
    assert described["qwz_bits"] == 8 and described["qgz_min_grad_rms"] == pytest.approx(0.1)
    with pytest.raises(ValueError, match="qwz_bits must be the integer"):
        ZeroConfig(qwz_bits=np.bool_(True))


def test_auto_is_the_default_dtype_by_name_and_unknown_fields_are_named():
    assert ZeroConfig(compute_dtype="auto", reduce_dtype="auto") == ZeroConfig()
    with pytest.raises(ValueError, match=r"or None / 'auto' \(the default\), got 'f8'"):
        ZeroConfig(compute_dtype="f8")
    with pytest.raises(ValueError, match=r"unknown config field\(s\) \['foo'\]; valid fields"):
        ZeroConfig.from_preset("qgz").replace(foo=1)


def test_the_dithered_code_under_1bit_adam_is_refused_for_what_it_cannot_do():
    # Not first "turn error feedback off", which the momentum target cannot.
    for extra in ({}, {"qgz_error_feedback": False}):
        with pytest.raises(ValueError, match="qgz_target='momentum' runs error feedback"):
            ZeroConfig.from_preset("zeropp", qgz_code="dither", **extra)


def test_dtypes_are_accepted_as_names_or_dtypes_alike():
    for value in ("bf16", "bfloat16", jnp.bfloat16, np.dtype(jnp.bfloat16)):
        assert ZeroConfig(compute_dtype=value).compute_dtype is jnp.bfloat16
    assert ZeroConfig(reduce_dtype=np.float32).reduce_dtype is jnp.float32
    assert ZeroConfig(scale_dtype="bf16").scale_dtype is jnp.bfloat16


def test_every_preset_still_builds_and_replaces():
    from zeropp_jax.config import PRESETS

    for preset in PRESETS:
        config = ZeroConfig.from_preset(preset)
        assert config.replace() == config
        assert config.replace(grad_accum=2).grad_accum == 2


def test_presets_are_read_only():
    """``zp.PRESETS["zeropp"]["qwz_bits"] = 4`` would have changed every later
    ``from_preset("zeropp")`` in the process."""
    import zeropp_jax as zp

    with pytest.raises(TypeError):
        zp.PRESETS["zeropp"]["qwz_bits"] = 4
    with pytest.raises(TypeError):
        zp.PRESETS["mine"] = dict(PRESETS["zeropp"], qwz_bits=4)
    assert ZeroConfig.from_preset("zeropp").qwz_bits == 8
    assert ZeroConfig.from_preset("zeropp", qwz_bits=4).qwz_bits == 4


def test_a_config_named_after_a_preset_it_has_nothing_of_is_warned_of():
    with pytest.warns(UserWarning, match=r"from_preset\('zeropp'"):
        ZeroConfig(preset="zeropp")
    with pytest.warns(UserWarning, match="qwz_bits=8"):
        ZeroConfig(preset="qwz")
    with warnings.catch_warnings():
        warnings.simplefilter("error", UserWarning)
        assert ZeroConfig(preset="qwz", qwz_bits=4).qwz_bits == 4  # something of it: a variant
        for name in PRESETS:
            assert ZeroConfig.from_preset(name).preset == name
        assert not ZeroConfig.from_preset("hpz", hpz=False).hpz  # asked for: no warning

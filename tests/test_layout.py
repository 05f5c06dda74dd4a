"""Unit layout: leaves aligned to the qwZ block, gaps, padding mask, round trip."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import zeropp_jax as zp
from zeropp_jax.wire import quantization
from zeropp_jax.layout import build_layout, flatten_unit, unflatten_unit
from zeropp_jax.step.geometry import padding_mask


def _tree(seed=0):
    rng = np.random.default_rng(seed)
    return {
        "layer": {
            "bias": rng.normal(size=(5,)).astype(np.float32) * 0.01,
            "kernel": rng.normal(size=(3, 7)).astype(np.float32),
            "scale": np.float32(1.5),
            "w": rng.normal(size=(9,)).astype(np.float32),
        }
    }


@pytest.mark.parametrize("leaf_align", [1, 8, 16])
def test_leaves_start_at_multiples_and_round_trip(leaf_align):
    tree = _tree()
    layout = build_layout(tree, n_devices=2, align=8, leaf_align=leaf_align)
    (unit,) = layout.units
    offsets = [s.offset for s in unit.leaves]
    assert all(o % leaf_align == 0 for o in offsets)
    if leaf_align == 1:
        assert offsets == [0, 5, 26, 27]  # packed back to back, as before
    assert unit.numel == 5 + 21 + 1 + 9 and unit.padded % 16 == 0
    flat = np.asarray(flatten_unit(tree["layer"], unit))
    back = unflatten_unit(jnp.asarray(flat), unit)
    for a, b in zip(jax.tree.leaves(back), jax.tree.leaves(tree["layer"])):
        np.testing.assert_array_equal(np.asarray(a), np.reshape(b, np.shape(a)))
    # the padding mask marks exactly the leaves' elements, shard by shard
    shard = unit.padded // 2
    mask = np.concatenate([np.asarray(padding_mask(unit, jnp.int32(i), shard)) for i in range(2)])
    expected = np.zeros(unit.padded, bool)
    for s in unit.leaves:
        expected[s.offset:s.offset + s.size] = True
    np.testing.assert_array_equal(mask, expected)
    assert mask.sum() == unit.numel and np.all(flat[~expected] == 0)


def test_shards_pad_only_to_the_blocks_of_features_that_are_on():
    """A zero3 run with a large qwZ block pads to 8, not to the block it never uses."""
    assert zp.ZeroConfig.from_preset("zero3", qwz_block=65536, qgz_block=1024).alignment() == 8
    assert zp.ZeroConfig.from_preset("hpz", qwz_block=512).alignment() == 8
    # a quantized shard: 256 (whole Pallas tiles of small blocks) and the blocks that are on
    assert zp.ZeroConfig.from_preset("qwz", qwz_block=64, qgz_block=1024).alignment() == 256
    assert zp.ZeroConfig.from_preset("qgz", qwz_block=65536, qgz_block=48).alignment() == 768
    assert zp.ZeroConfig.from_preset("zeropp", qwz_block=512).alignment() == 512
    for preset in ("qwz", "qgz", "zeropp", "zeropp-max"):  # as before stop 48
        assert zp.ZeroConfig.from_preset(preset).alignment() == 256


def test_qwz_blocks_never_mix_two_leaves():
    """With qwZ on, a small bias is quantized with its own scale, not its neighbour's."""
    bias = np.full((5,), 0.013, np.float32)
    tree = {"ln": {"bias": bias, "scale": np.ones((27,), np.float32)}}
    config = zp.ZeroConfig.from_preset("qwz", qwz_block=16)
    assert config.leaf_alignment() == 16 and zp.ZeroConfig().leaf_alignment() == 1
    errors = {}
    for leaf_align in (1, config.leaf_alignment()):
        (unit,) = build_layout(tree, n_devices=1, align=16, leaf_align=leaf_align).units
        flat = flatten_unit(tree["ln"], unit)
        q = quantization.quantize(flat, bits=8, block=16)
        deq = quantization.dequantize(q, bits=8, block=16, dtype=jnp.float32)
        got = np.asarray(unflatten_unit(deq, unit)["bias"])
        errors[leaf_align] = np.abs(got - bias).max() / 0.013
    assert errors[1] > 0.1  # one step of 1/127 in a block whose absmax is 1
    assert errors[16] < 1e-6  # its own block: the bias is the block's absmax


def test_nested_units_without_remainder_round_trip_an_emptied_parent():
    """Units that take every leaf leave no ``rest`` unit; the dicts they
    emptied (``enc`` here) come back with them."""
    from zeropp_jax.layout import join_units, split_units

    tree = {"enc": {"a": np.ones((3,), np.float32), "b": np.zeros((2, 2), np.float32)}}
    layout = build_layout(tree, n_devices=2, align=8, units=[("enc", "a"), ("enc", "b")])
    assert layout.names == ("enc/a", "enc/b") and not layout.has_remainder
    trees = split_units(tree, layout)
    assert set(trees) == {"enc/a", "enc/b"}
    back = join_units(trees, layout)
    assert jax.tree.structure(back) == jax.tree.structure(tree)


def test_per_layer_needs_string_top_level_keys():
    params = {0: np.ones((4, 4), np.float32), 1: np.ones((4,), np.float32)}
    with pytest.raises(ValueError, match=r"must be a string; got the key\(s\) \[0, 1\] of types "
                                         r"\['int'\]: use string keys \(e.g. \{'0': ...\}\)"):
        build_layout(params, n_devices=8, align=8, per_layer=True)
    # the whole model as one unit takes any pytree
    assert build_layout(params, n_devices=8, align=8, per_layer=False).names == ("params",)


@pytest.mark.parametrize("leaf, shown", [(np.float32(1.0), r"\(\)"), (np.zeros((0, 4)), r"\(0, 4\)")])
def test_a_stacked_unit_needs_at_least_one_layer(leaf, shown):
    with pytest.raises(ValueError, match=r"stacked unit 'blocks': leaf \['w'\] has shape "
                                         + shown + r", but every leaf .* at least one layer"):
        build_layout({"blocks": {"w": leaf}}, n_devices=8, align=8, stacked=("blocks",))


def test_split_and_join_keep_the_mapping_types():
    """A ``FrozenDict`` tree (or a dict holding one) comes back with the same
    mapping types: nested units with and without a remainder, and top-level units."""
    from flax.core import freeze

    from zeropp_jax.layout import join_units, split_units

    def leaf(n):
        return np.arange(n, dtype=np.float32)

    enc = {"b0": {"k": leaf(3)}, "b1": {"k": leaf(5)}}
    trees = [freeze({"embed": {"w": leaf(4)}, "enc": enc}),
             {"embed": {"w": leaf(4)}, "enc": freeze(enc)}]
    for tree in trees:
        for kw in (dict(units=[("enc", "b0"), ("enc", "b1")]),
                   dict(units=[("enc", "b0"), ("enc", "b1"), ("embed",)]),
                   dict(per_layer=True)):
            layout = build_layout(tree, n_devices=2, align=8, **kw)
            back = join_units(split_units(tree, layout), layout)
            assert jax.tree.structure(back) == jax.tree.structure(tree), (type(tree), kw)
            assert type(back) is type(tree) and type(back["enc"]) is type(tree["enc"])


def test_a_non_float_parameter_is_refused_naming_its_path_in_its_unit():
    tree = {"q": {"w": np.zeros((4,), np.int8)}, "b": np.zeros((3,), np.float32)}
    for per_layer, path, unit in ((False, r"\['q'\]\['w'\]", "params"), (True, r"\['w'\]", "q")):
        with pytest.raises(ValueError, match=rf"parameter {path} \(of unit '{unit}'\) has "
                                             r"dtype int8; ZeRO shards only floating-point"):
            build_layout(tree, n_devices=2, align=8, per_layer=per_layer)


def test_the_padding_mask_holds_past_2_to_the_31_elements():
    """A unit of 2**31 elements or more (one unit of a 2.2B-parameter model,
    per_layer=False) overflowed the mask's int32 flat index at the first
    step; shards are compared by (quotient, remainder) now."""
    from types import SimpleNamespace

    shard = 16
    unit = SimpleNamespace(ranges=((2**31 - 3, 2**31 + 20), (2**32 + 1, 2**32 + 2)),
                           padded=2**32 + 16)
    for i in (2**27 - 1, 2**27, 2**27 + 1, 2**27 + 2, 2**28):
        got = np.asarray(jax.jit(lambda k: padding_mask(unit, k, shard))(jnp.int32(i)))
        index = np.arange(shard, dtype=np.int64) + i * shard
        want = np.zeros(shard, bool)
        for start, end in unit.ranges:
            want |= (index >= start) & (index < end)
        np.testing.assert_array_equal(got, want, err_msg=f"shard {i}")

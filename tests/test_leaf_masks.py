"""Per-leaf masks and labels (zp.masked, zp.multi_transform, zp.adamw): optax's
results in a loop of one's own, the same per leaf inside the trainer's flat units."""

import functools
import operator

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest

import zeropp_jax as zp
from zeropp_jax.models import gpt

from _util import MESH, TINY, assert_trees_close, gpt_loss, tiny_batches

PARAMS = gpt.init_params(TINY, jax.random.key(0))
LR = 1e-3  # small enough that Adam's sign-like steps agree to rounding over a few steps


def no_decay_for_biases_and_norms(params):
    """Hugging Face's examples' rule, by path: no decay for biases and LayerNorms."""
    return jax.tree_util.tree_map_with_path(
        lambda path, _: not any(getattr(k, "key", "") in ("bias", "scale") for k in path), params)


def by_rank(tree):  # a stacked model's blocks have a leading layer axis
    return {name: jax.tree.map(lambda x: ("adam" if x.ndim >= (3 if name == "blocks" else 2)
                                          else "frozen"), sub) for name, sub in tree.items()}


def _plain(optimizer, steps=3, params=PARAMS, opt_state=None, start=0):
    loss, data = gpt_loss(TINY, per_layer=False), tiny_batches(batch_size=16)
    state = optimizer.init(params) if opt_state is None else opt_state
    for i in range(start, start + steps):
        updates, state = optimizer.update(jax.grad(loss)(params, data.batch_at(i)), state, params)
        params = optax.apply_updates(params, updates)
    return params, state


def _trainer(optimizer, preset="zero3", **kwargs):
    return zp.make_trainer(gpt_loss(TINY, per_layer=True), optimizer, PARAMS,
                           mesh=zp.make_mesh(*MESH), config=zp.ZeroConfig.from_preset(preset),
                           per_layer=True, stacked=("blocks",), **kwargs)


def _trained(trainer, steps=3, state=None, start=0):
    data = tiny_batches(batch_size=16)
    state = trainer.init(PARAMS) if state is None else state
    for i in range(start, start + steps):
        state, _ = trainer.step(state, data.batch_at(i))
    return trainer.gather_params(state)


MASK_CASES = {
    "adamw": (lambda m: zp.adamw(LR, weight_decay=0.5, mask=m),
              lambda m: optax.adamw(LR, weight_decay=0.5, mask=m)),
    "masked": (lambda m: optax.chain(optax.scale_by_adam(), zp.masked(optax.add_decayed_weights(0.5), m),
                                     optax.scale(-LR)),
               lambda m: optax.chain(optax.scale_by_adam(), optax.masked(optax.add_decayed_weights(0.5), m),
                                     optax.scale(-LR))),
}


@pytest.mark.parametrize("case", sorted(MASK_CASES))
def test_a_plain_loop_gives_optax_results_bit_for_bit(case):
    ours, theirs = MASK_CASES[case]
    for mask in (no_decay_for_biases_and_norms, no_decay_for_biases_and_norms(PARAMS)):
        jax.tree.map(np.testing.assert_array_equal, _plain(ours(mask))[0], _plain(theirs(mask))[0])
    labels = {"adam": optax.adam(LR), "frozen": optax.set_to_zero()}
    jax.tree.map(np.testing.assert_array_equal, _plain(zp.multi_transform(labels, by_rank))[0],
                 _plain(optax.multi_transform(labels, by_rank))[0])


def test_a_mask_prefix_covers_its_subtrees():
    mask = {"blocks": True, "embed": False, "ln_f": False}
    ours = _plain(zp.adamw(LR, weight_decay=0.5, mask=mask))[0]
    jax.tree.map(np.testing.assert_array_equal, ours,
                 _plain(optax.adamw(LR, weight_decay=0.5, mask=mask))[0])


@pytest.mark.parametrize("case", sorted(MASK_CASES))
def test_the_trainer_decays_per_leaf_within_a_unit(case):
    ours, theirs = MASK_CASES[case]
    got = _trained(_trainer(ours(no_decay_for_biases_and_norms)))
    want = _plain(theirs(no_decay_for_biases_and_norms))[0]
    assert_trees_close(got, want, rtol=1e-4, atol=1e-5)
    decayed_everywhere = _plain(theirs(lambda p: jax.tree.map(lambda _: True, p)))[0]  # the mask matters: not what the unit-wide choice gives
    scale = lambda p: p["blocks"]["ln_1"]["scale"]  # noqa: E731 (ones: decay shows)
    assert np.max(np.abs(scale(got) - scale(decayed_everywhere))) > LR / 2


def test_the_trainer_freezes_leaves_by_label_within_a_unit():
    labels = {"adam": optax.adam(LR), "frozen": optax.set_to_zero()}
    got = _trained(_trainer(zp.multi_transform(labels, by_rank)))
    assert_trees_close(got, _plain(optax.multi_transform(labels, by_rank))[0], rtol=1e-4, atol=1e-5)
    for path in (("blocks", "ln_1", "scale"), ("blocks", "attn", "qkv", "bias"), ("ln_f", "bias")):
        leaf = lambda p: functools.reduce(operator.getitem, path, p)  # noqa: E731
        np.testing.assert_array_equal(np.asarray(leaf(got)), np.asarray(leaf(PARAMS)))  # frozen
    assert np.max(np.abs(got["blocks"]["attn"]["qkv"]["kernel"]
                         - PARAMS["blocks"]["attn"]["qkv"]["kernel"])) > LR


@pytest.mark.parametrize("wrap", ["inject_hyperparams", "MultiSteps"])
def test_the_units_reach_a_mask_inside_optax_wrappers(wrap):
    def build(adamw):
        if wrap == "MultiSteps":
            return optax.MultiSteps(adamw(LR, weight_decay=0.5, mask=no_decay_for_biases_and_norms), 2)
        return optax.inject_hyperparams(adamw, static_args=("mask",))(
            learning_rate=optax.linear_schedule(LR, LR / 10, 10), weight_decay=0.5,
            mask=no_decay_for_biases_and_norms)

    assert_trees_close(_trained(_trainer(build(zp.adamw)), steps=4),
                       _plain(build(optax.adamw), steps=4)[0], rtol=1e-4, atol=1e-5)


def test_optax_adamw_with_a_mask_is_refused_naming_the_drop_in():
    with pytest.raises(ValueError, match=r"moves \['blocks'\].*zeropp_jax.adamw"):
        _trainer(optax.adamw(LR, mask=no_decay_for_biases_and_norms))


def test_a_label_without_a_transform_and_a_mask_of_values_are_refused():
    with pytest.raises(ValueError, match="labels 'other' have no transform"):
        _trainer(zp.multi_transform({"adam": optax.adam(LR)},
                                    lambda p: jax.tree.map(lambda x: "adam" if x.ndim > 1 else "other", p)))
    with pytest.raises(ValueError, match="paths, shapes and dtypes"):
        _plain(zp.adamw(LR, mask=lambda p: jax.tree.map(lambda x: jnp.all(x > 0), p)), steps=1)
    with pytest.raises(ValueError, match="a bool per leaf"):
        _plain(zp.adamw(LR, mask=lambda p: p), steps=1)


def test_a_loops_optax_adamw_state_carries_over_into_zp_adamw():
    params, opt_state = _plain(optax.adamw(LR, weight_decay=0.5,
                                           mask=no_decay_for_biases_and_norms), steps=2)
    trainer = _trainer(zp.adamw(LR, weight_decay=0.5, mask=no_decay_for_biases_and_norms))
    state = trainer.init(params, opt_state=opt_state, step=2)
    got = _trained(trainer, steps=2, state=state, start=2)
    want = _plain(optax.adamw(LR, weight_decay=0.5, mask=no_decay_for_biases_and_norms),
                  steps=4)[0]
    assert_trees_close(got, want, rtol=1e-4, atol=1e-5)


def test_the_masks_hold_under_wrappers_that_pass_no_extra_arguments():
    """Under a hand-written wrapper that calls update(updates, state, params)
    and an optax one that forwards its extra arguments to a function of its own."""
    def plain_wrapper(inner):
        return optax.GradientTransformation(inner.init, lambda u, s, p=None: inner.update(u, s, p))

    def conditional(inner):
        return optax.conditionally_transform(inner, lambda count: count >= 0,
                                             forward_extra_args=True)

    for wrap in (plain_wrapper, conditional):
        def build(adamw):
            return wrap(adamw(LR, weight_decay=0.5, mask=no_decay_for_biases_and_norms))

        assert_trees_close(_trained(_trainer(build(zp.adamw))), _plain(build(optax.adamw))[0],
                           rtol=1e-4, atol=1e-5)


def test_a_trace_made_in_one_trainers_view_is_not_reused_in_anothers():
    """A wrapper that jits the inner update once (its cache keyed on shapes)
    shared by two trainers whose units have the same shapes and other leaves:
    each trainer's masks are its own (the view is part of JAX's cache keys)."""
    def loss(params, batch):
        vec = jnp.concatenate([v for _, v in sorted(params.items()) if v.ndim == 1])
        return jnp.mean((batch["x"] @ params["kernel"] + vec[None] - batch["y"]) ** 2)

    rng = np.random.default_rng(0)
    batch = {"x": rng.normal(size=(16, 8)).astype(np.float32),
             "y": rng.normal(size=(16, 8)).astype(np.float32)}
    model_a = {"bias": rng.normal(size=(8,)).astype(np.float32),
               "kernel": rng.normal(size=(8, 8)).astype(np.float32)}
    model_b = {"a": model_a["bias"][:4], "b": model_a["bias"][4:], "kernel": model_a["kernel"]}
    inner = zp.adamw(LR, weight_decay=0.5, mask=no_decay_for_biases_and_norms)
    shared = optax.GradientTransformation(inner.init, jax.jit(inner.update))

    def trained(params):
        trainer = zp.make_trainer(loss, shared, params, mesh=zp.make_mesh(*MESH))
        state = trainer.init(params)
        for _ in range(3):
            state, _ = trainer.step(state, batch)
        return trainer.gather_params(state)

    def plain(params):
        state = inner.init(params)
        for _ in range(3):
            updates, state = inner.update(jax.grad(loss)(params, batch), state, params)
            params = optax.apply_updates(params, updates)
        return params

    trained(model_a)  # traced in a's view: "bias" not decayed
    assert_trees_close(trained(model_b), plain(model_b), rtol=1e-4, atol=1e-5)  # "a", "b" decayed


def test_a_drop_in_inside_optax_labels_by_unit():
    """optax.multi_transform labelling whole units (the embedding frozen), a
    drop-in for the rest: optax hands it the units' dict with MaskedNode gaps."""
    def optimizer(adamw):
        return optax.multi_transform(
            {"train": adamw(LR, weight_decay=0.5, mask=no_decay_for_biases_and_norms),
             "frozen": optax.set_to_zero()},
            lambda p: {k: "frozen" if k == "embed" else "train" for k in p})

    got = _trained(_trainer(optimizer(zp.adamw)))
    assert_trees_close(got, _plain(optimizer(optax.adamw))[0], rtol=1e-4, atol=1e-5)
    np.testing.assert_array_equal(np.asarray(got["embed"]["tokens"]),
                                  np.asarray(PARAMS["embed"]["tokens"]))

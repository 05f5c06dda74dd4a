"""The wrap policy on an NNX model trained through ``zp.nnx_loss``.

``make_trainer(..., wrap=(Block,), example_batch=...)`` with an NNX class:
each ``Block`` in an ``nnx.List`` is its own unit, gathered when called and
again in the backward, with its dropout stream advanced as without the
trainer.
"""

from __future__ import annotations

from flax import nnx
import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest

import zeropp_jax as zp
from zeropp_jax.analysis.comm_report import comm_report
from zeropp_jax.step import wrap_nnx

from _util import mesh_of

WIDTH = 32


class Block(nnx.Module):
    def __init__(self, rngs):
        self.norm = nnx.LayerNorm(WIDTH, rngs=rngs)
        self.lin = nnx.Linear(WIDTH, WIDTH, rngs=rngs)
        self.drop = nnx.Dropout(0.2, rngs=rngs)

    def __call__(self, h):
        return h + self.drop(jnp.tanh(self.lin(self.norm(h))))


class Model(nnx.Module):
    def __init__(self, n_layers, rngs):
        self.embed = nnx.Linear(8, WIDTH, rngs=rngs)
        self.blocks = nnx.List([Block(rngs) for _ in range(n_layers)])
        self.head = nnx.Linear(WIDTH, 1, rngs=rngs)

    def __call__(self, x):
        h = self.embed(x)
        for block in self.blocks:
            h = block(h)
        # block 0 again: its dropout stream must have advanced (a new mask)
        return self.head(self.blocks[0](h))[:, 0]


X = np.random.default_rng(0).normal(size=(16, 8)).astype(np.float32)
BATCH = {"x": X, "y": np.sin(X.sum(axis=1))}


def criterion(model, batch):
    return jnp.mean((model(batch["x"]) - batch["y"]) ** 2)


def nnx_trainer(n_layers=2, **kwargs):
    params, loss_fn = zp.nnx_loss(Model(n_layers, nnx.Rngs(0, dropout=1)), criterion)
    trainer = zp.make_trainer(loss_fn, optax.adam(1e-2), params, mesh=mesh_of(2, 4), rng=3,
                              config=zp.ZeroConfig(compute_dtype="float32"), **kwargs)
    return trainer, params, loss_fn


@pytest.mark.slow
def test_nnx_blocks_train_like_the_whole_model_with_the_same_dropout_masks():
    wrapped, params, _ = nnx_trainer(wrap=(Block,), example_batch=BATCH)
    assert wrapped.layout.names == ("rest", "blocks/0", "blocks/1")
    whole, _, _ = nnx_trainer()
    runs = []
    for trainer in (wrapped, whole):
        state, losses = trainer.init(params), []
        for _ in range(4):
            state, metrics = trainer.step(state, BATCH)
            losses.append(float(metrics["loss"]))
        runs.append((losses, trainer.gather_params(state)))
    (losses, full), (whole_losses, whole_full) = runs
    assert len(set(losses)) == 4 and losses[-1] < losses[0], losses
    np.testing.assert_allclose(losses, whole_losses, rtol=1e-5)
    assert jax.tree.structure(full) == jax.tree.structure(params)
    for a, b in zip(jax.tree.leaves(full), jax.tree.leaves(whole_full)):
        np.testing.assert_allclose(a, b, rtol=1e-4, atol=1e-5)
    model = Model(2, nnx.Rngs(0, dropout=1))
    nnx.update(model, full)  # trained weights back in the module
    assert np.array_equal(model.blocks[1].lin.kernel[...], full["blocks"][1]["lin"]["kernel"])

    compiled = wrapped.compile_from_shapes(jax.eval_shape(lambda: params), BATCH)
    gathers = sum(c.count for c in comm_report(compiled, mesh_shape=(2, 4)).collectives
                  if c.kind == "all-gather")
    assert gathers == 2 * 3 + 1  # each call forward and backward, the rest once


def test_discovery_finds_outermost_blocks_and_restores_the_classes():
    block_call, linear_call = Block.__call__, nnx.Linear.__call__
    _, params, loss_fn = nnx_trainer()
    # the Linears inside a Block belong to the Block's unit
    paths = wrap_nnx.discover(loss_fn, params, BATCH, (Block, nnx.Linear))
    assert paths == [("embed",), ("blocks", 0), ("blocks", 1), ("head",)]
    assert Block.__call__ is block_call and nnx.Linear.__call__ is linear_call
    assert "__call__" in Block.__dict__  # put back, not deleted
    wrapped = wrap_nnx.wrap_loss(loss_fn, (Block,), paths[1:3])
    key = jax.random.key(5)
    assert float(wrapped(params, BATCH, key)) == float(loss_fn(params, BATCH, key))


class Scanned(nnx.Module):
    """Blocks stacked by ``nnx.vmap`` and applied by ``nnx.scan``."""

    def __init__(self, rngs):
        self.blocks = nnx.vmap(Block, in_axes=0)(rngs.split(2))

    def __call__(self, h):
        def one(block, h):
            return block(h)

        return nnx.scan(one, in_axes=(0, nnx.Carry), out_axes=nnx.Carry)(self.blocks, h)


def test_nnx_wrap_refuses_blocks_it_cannot_find_or_classes_it_does_not_know():
    params, loss_fn = zp.nnx_loss(Scanned(nnx.Rngs(0, dropout=1)),
                                  lambda m, b: jnp.mean(m(b) ** 2))
    h = np.ones((4, WIDTH), np.float32)
    with pytest.raises(ValueError, match="not the loss's params inputs.*zp.gather/zp.layer"):
        wrap_nnx.discover(loss_fn, params, h, (Block,))
    _, plain_params, plain_loss = nnx_trainer()
    with pytest.raises(ValueError, match="never called a module of class Conv"):
        wrap_nnx.discover(plain_loss, plain_params, BATCH, (nnx.Conv,))
    with pytest.raises(TypeError, match="not mixed"):
        import flax.linen as nn

        zp.make_trainer(loss_fn, optax.sgd(0.1), params, mesh=mesh_of(2, 4),
                        wrap=(Block, nn.Dense), example_batch=h)

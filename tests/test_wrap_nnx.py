"""The wrap policy on an NNX model trained through ``zp.nnx_loss``.

``make_trainer(..., wrap=(Block,), example_batch=...)`` with an NNX class:
each ``Block`` in an ``nnx.List`` is its own unit, gathered when called and
again in the backward, with its dropout stream advanced as without the
trainer; blocks stacked by ``nnx.vmap`` and applied by ``nnx.scan`` are one
stacked unit, gathered layer by layer. What the trainer could not keep or
gather is refused: state written in the loss (``nnx.sow``, ``BatchNorm``'s
running statistics, counters), a wrapped block's parameters read outside its
``__call__`` (``Embed.attend``), parameters shared with another module.
"""

from __future__ import annotations

import functools
import warnings

from flax import nnx
import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest

import zeropp_jax as zp
from zeropp_jax.analysis.comm_report import comm_report
from zeropp_jax.step import wrap_nnx
from zeropp_jax.prng_keys import keys_from_data

from _util import mesh_of

WIDTH = 32


class Block(nnx.Module):
    def __init__(self, rngs, rate=0.2):
        self.norm = nnx.LayerNorm(WIDTH, rngs=rngs)
        self.lin = nnx.Linear(WIDTH, WIDTH, rngs=rngs)
        self.drop = nnx.Dropout(rate, rngs=rngs)

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


def trainer_of(model, criterion=criterion, **kwargs):
    params, loss_fn = zp.nnx_loss(model, criterion)
    trainer = zp.make_trainer(loss_fn, optax.adam(1e-2), params, mesh=mesh_of(2, 4), rng=3,
                              config=zp.ZeroConfig(compute_dtype="float32"), **kwargs)
    return trainer, params, loss_fn


def nnx_trainer(n_layers=2, **kwargs):
    return trainer_of(Model(n_layers, nnx.Rngs(0, dropout=1)), **kwargs)


def train(trainer, params, steps):
    """``(losses, trained parameters)`` after ``steps`` steps on ``BATCH``."""
    state, losses = trainer.init(params), []
    for _ in range(steps):
        state, metrics = trainer.step(state, BATCH)
        losses.append(float(metrics["loss"]))
    return losses, trainer.gather_params(state)


def plain_optax(loss_fn, params, steps):
    """``(losses, trained parameters)`` of plain optax on one device on ``BATCH``."""
    opt = optax.adam(1e-2)

    @jax.jit
    def plain_step(p, opt_state):
        value, g = jax.value_and_grad(loss_fn)(p, BATCH)
        updates, opt_state = opt.update(g, opt_state, p)
        return optax.apply_updates(p, updates), opt_state, value

    opt_state, losses = opt.init(params), []
    for _ in range(steps):
        params, opt_state, value = plain_step(params, opt_state)
        losses.append(float(value))
    return losses, params


def trace_step(trainer, params, batch=BATCH):
    """Traces the trainer's step (``lower``), running nothing."""
    trainer.lower(trainer.abstract_state(jax.eval_shape(lambda: params)),
                  trainer.shard_batch(batch))


def all_gathers(trainer, params):
    compiled = trainer.compile_from_shapes(jax.eval_shape(lambda: params), BATCH)
    return sum(c.count for c in comm_report(compiled, mesh_shape=(2, 4)).collectives
               if c.kind == "all-gather")


@pytest.mark.slow
def test_nnx_blocks_train_like_the_whole_model_with_the_same_dropout_masks():
    wrapped, params, _ = nnx_trainer(wrap=(Block,), example_batch=BATCH)
    assert wrapped.layout.names == ("rest", "blocks/0", "blocks/1")
    whole, _, _ = nnx_trainer()
    (losses, full), (whole_losses, whole_full) = (train(t, params, 4) for t in (wrapped, whole))
    assert len(set(losses)) == 4 and losses[-1] < losses[0], losses
    np.testing.assert_allclose(losses, whole_losses, rtol=1e-5)
    assert jax.tree.structure(full) == jax.tree.structure(params)
    for a, b in zip(jax.tree.leaves(full), jax.tree.leaves(whole_full)):
        np.testing.assert_allclose(a, b, rtol=1e-4, atol=1e-5)
    model = Model(2, nnx.Rngs(0, dropout=1))
    nnx.update(model, full)  # trained weights back in the module
    assert np.array_equal(model.blocks[1].lin.kernel[...], full["blocks"][1]["lin"]["kernel"])

    # each call forward and backward, the rest once
    assert all_gathers(wrapped, params) == 2 * 3 + 1


class CallRngsBlock(nnx.Module):
    """A block given the ``nnx.Rngs`` at call time (NNX's ``Dropout(rate)``
    style): the stream it draws from is the caller's."""

    def __init__(self, rngs):
        self.lin = nnx.Linear(WIDTH, WIDTH, rngs=rngs)
        self.drop = nnx.Dropout(0.5)

    def __call__(self, h, rngs):
        dropped = self.drop(jnp.tanh(self.lin(h)) + 2.0, rngs=rngs)  # 0 only where dropped
        return h + dropped, dropped == 0


class CallRngsModel(nnx.Module):
    def __init__(self, rngs):
        self.embed = nnx.Linear(8, WIDTH, rngs=rngs)
        self.blocks = nnx.List([CallRngsBlock(rngs) for _ in range(2)])
        self.rngs = nnx.Rngs(dropout=1)

    def __call__(self, x):
        h, masks = self.embed(x), []
        for block in self.blocks:
            h, mask = block(h, rngs=self.rngs)
            masks.append(mask)
        # 1.0 if the stream did not advance between the blocks (one mask)
        return h.sum(axis=1), jnp.mean(masks[0] == masks[1])


def test_an_rngs_passed_to_wrapped_blocks_advances_as_without_the_trainer():
    def criterion_rngs(model, batch):
        out, same = model(batch["x"])
        return jnp.mean((out - batch["y"]) ** 2), {"same": same}

    wrapped, params, _ = trainer_of(CallRngsModel(nnx.Rngs(0)), criterion_rngs,
                                    wrap=(CallRngsBlock,), example_batch=BATCH)
    assert wrapped.layout.names == ("rest", "blocks/0", "blocks/1")
    whole, _, _ = trainer_of(CallRngsModel(nnx.Rngs(0)), criterion_rngs)
    runs = []
    for trainer in (wrapped, whole):
        state, losses = trainer.init(params), []
        for _ in range(2):
            state, metrics = trainer.step(state, BATCH)
            losses.append(float(metrics["loss"]))
        runs.append(losses)
        assert float(metrics["aux"]["same"]) < 0.95  # each block its own mask
    np.testing.assert_allclose(runs[0], runs[1], rtol=1e-5)

    # a block that also holds the Rngs it is passed: two copies in the layer,
    # drawing the same keys, refused (it drew one mask for every block)
    model = CallRngsModel(nnx.Rngs(0))
    for block in model.blocks:
        block.held = model.rngs
    held, params, _ = trainer_of(model, criterion_rngs, wrap=(CallRngsBlock,),
                                 example_batch=BATCH)
    with pytest.raises(ValueError, match=r"CallRngsBlock at blocks/0 is called with an Rngs "
                                         r"whose random streams it also reaches"):
        held.step(held.init(params), BATCH)


def test_nnx_state_parameters_come_back_in_their_own_structure():
    """NNX's own idiom without ``nnx_loss``: ``nnx.split`` gives an
    ``nnx.State`` of plain dicts, which ``gather_params`` gives back as such
    (it gave nested ``State`` s, which ``jax.tree.map`` with the original refused)."""
    model = Net(functools.partial(NormBlock, rate=0.0), nnx.Rngs(0))  # no stream drawn
    graphdef, params, rest = nnx.split(model, nnx.Param, ...)

    def loss_fn(p, batch):
        return criterion(nnx.merge(graphdef, p, rest), batch)

    trainer = zp.make_trainer(loss_fn, optax.sgd(0.1), params, mesh=mesh_of(2, 4),
                              wrap=(NormBlock,), example_batch=BATCH)
    gathered = trainer.gather_params(trainer.init(params))
    assert jax.tree.structure(gathered) == jax.tree.structure(params)
    jax.tree.map(np.testing.assert_array_equal, gathered, params)


def test_discovery_finds_outermost_blocks_and_restores_the_classes():
    block_call, linear_call = Block.__call__, nnx.Linear.__call__
    _, params, loss_fn = nnx_trainer()
    # the Linears inside a Block belong to the Block's unit
    paths, stacked = wrap_nnx.discover(loss_fn, params, BATCH, (Block, nnx.Linear))
    assert paths == [("embed",), ("blocks", 0), ("blocks", 1), ("head",)] and stacked == []
    assert Block.__call__ is block_call and nnx.Linear.__call__ is linear_call
    assert "__call__" in Block.__dict__  # put back, not deleted
    wrapped = wrap_nnx.wrap_loss(loss_fn, (Block,), paths[1:3])
    key = jax.random.key(5)
    assert float(wrapped(params, BATCH, key)) == float(loss_fn(params, BATCH, key))


def test_an_evaluate_beside_a_background_precompile_waits_and_restores_the_classes():
    """An evaluate called while the worker traces and compiles the NNX-wrapped
    steps waits for it (one compile at a time: ``CompileAhead.wait``); the
    classes come back as they were, and both results stand."""
    block_call = Block.__call__
    trainer, params, _ = nnx_trainer(wrap=(Block,), example_batch=BATCH)
    state = trainer.init(params)
    futures = trainer.precompile(state, BATCH, background=True)
    evaluated = trainer.evaluate(state, BATCH)
    assert all(f.done() and f.result() > 0 for f in futures.values())
    assert Block.__call__ is block_call and "__call__" in Block.__dict__
    _, metrics = trainer.step(state, BATCH)
    assert float(metrics["loss"]) == pytest.approx(float(evaluated["loss"]), rel=1e-6)


def stack(n_layers, rngs, rate, block=Block):
    """``n_layers`` ``block`` s with their parameters stacked along axis 0
    (Flax's "scan over layers": one dropout key per layer)."""

    @nnx.split_rngs(splits=n_layers)
    @nnx.vmap(in_axes=(0,), out_axes=0)
    def make(rngs):
        return block(rngs, rate)

    return make(rngs)


def scan_blocks(blocks, h):
    """``h`` through each layer of ``blocks`` in turn (``nnx.scan``)."""

    @nnx.scan(in_axes=(nnx.Carry, 0), out_axes=nnx.Carry)
    def one(h, block):
        return block(h)

    return one(h, blocks)


class Scanned(nnx.Module):
    """Blocks stacked by ``nnx.vmap`` and applied by ``nnx.scan``."""

    def __init__(self, rngs, n_layers=3, rate=0.2, stacks=1, block=Block):
        self.embed = nnx.Linear(8, WIDTH, rngs=rngs)
        self.stacks = nnx.List([stack(n_layers, rngs, rate, block) for _ in range(stacks)])
        self.head = nnx.Linear(WIDTH, 1, rngs=rngs)

    def __call__(self, x):
        h = self.embed(x)
        for blocks in self.stacks:
            h = scan_blocks(blocks, h)
        return self.head(h)[:, 0]


def scanned_trainer(rate, **kwargs):
    return trainer_of(Scanned(nnx.Rngs(0, dropout=1), rate=rate), **kwargs)


@pytest.mark.slow
def test_blocks_under_nnx_scan_train_like_plain_optax_on_one_device():
    trainer, params, loss_fn = scanned_trainer(0.0, wrap=(Block,), example_batch=BATCH)
    assert [(u.name, u.stack) for u in trainer.layout.units] == [
        ("rest", None), ("stacks/0", 3)]
    (losses, full), (ref_losses, ref) = train(trainer, params, 4), plain_optax(loss_fn, params, 4)
    np.testing.assert_allclose(losses, ref_losses, rtol=1e-5)
    assert jax.tree.structure(full) == jax.tree.structure(params)
    for a, b in zip(jax.tree.leaves(full), jax.tree.leaves(ref)):
        np.testing.assert_allclose(a, b, rtol=1e-4, atol=1e-5)
    # each of the 3 layers forward and backward, the rest once
    assert all_gathers(trainer, params) == 2 * 3 + 1


@pytest.mark.slow
def test_scanned_blocks_draw_the_whole_models_dropout_masks_anew_each_step():
    wrapped, params, _ = scanned_trainer(0.2, wrap=(Block,), example_batch=BATCH)
    whole, _, _ = scanned_trainer(0.2)
    (losses, _), (whole_losses, _) = (train(t, params, 3) for t in (wrapped, whole))
    assert len(set(losses)) == 3, losses  # a new key (new masks) each step
    np.testing.assert_allclose(losses, whole_losses, rtol=1e-5)


def test_nnx_loss_gives_each_stacked_layer_its_own_dropout_key_each_step():
    keys = []

    def criterion_keys(model, _):
        keys.append(jax.random.key_data(model.stacks[0].drop.rngs.key[...]))
        return jnp.zeros(())

    params, loss_fn = zp.nnx_loss(Scanned(nnx.Rngs(0, dropout=1)), criterion_keys)
    loss_fn(params, BATCH, jax.random.key(1))
    loss_fn(params, BATCH, jax.random.key(2))
    rows = np.concatenate(keys)  # 2 steps x 3 layers
    assert rows.shape[0] == 6 and len({tuple(r) for r in rows}) == 6


def test_discovery_finds_stacked_blocks_under_nnx_scan():
    params, loss_fn = zp.nnx_loss(Scanned(nnx.Rngs(0, dropout=1)), criterion)
    key = (jax.random.key(1),)
    assert wrap_nnx.discover(loss_fn, params, BATCH, (Block,), key) == (
        [("stacks", 0)], [("stacks", 0)])
    wrapped = wrap_nnx.wrap_loss(loss_fn, (Block,), [("stacks", 0)])
    assert float(wrapped(params, BATCH, *key)) == float(loss_fn(params, BATCH, *key))
    # two stacks of the same shapes: which one a scanned layer belongs to is unknown
    params, loss_fn = zp.nnx_loss(Scanned(nnx.Rngs(0, dropout=1), stacks=2), criterion)
    with pytest.raises(ValueError, match=r"2 sub-trees \[\('stacks', 0\), \('stacks', 1\)\]"):
        wrap_nnx.discover(loss_fn, params, BATCH, (Block,))


def test_nnx_wrap_refuses_blocks_it_cannot_find_or_classes_it_does_not_know():
    _, params, loss_fn = nnx_trainer()

    def scaled(p, b):  # the blocks see new arrays of the inputs' shapes
        return loss_fn(jax.tree.map(lambda x: 2 * x, p), b)

    with pytest.raises(ValueError, match="not the loss's params inputs, and no sub-tree.*"
                                         "nnx.scan.*zp.gather/zp.layer"):
        wrap_nnx.discover(scaled, params, BATCH, (Block,))
    with pytest.raises(ValueError, match="never called a module of class Conv"):
        wrap_nnx.discover(loss_fn, params, BATCH, (nnx.Conv,))
    with pytest.raises(TypeError, match="not mixed"):
        import flax.linen as nn

        zp.make_trainer(loss_fn, optax.sgd(0.1), params, mesh=mesh_of(2, 4),
                        wrap=(Block, nn.Dense), example_batch=BATCH)
    # per_layer=True would hand the NNX module Unit handles (NNX: "Incorrect
    # number of leaves"): refused at make_trainer, naming wrap=
    with pytest.raises(ValueError, match="nnx_loss's module cannot hold.*wrap=\\(Block,\\)"):
        zp.make_trainer(loss_fn, optax.sgd(0.1), params, mesh=mesh_of(2, 4), per_layer=True)
    with pytest.raises(ValueError, match="nnx_loss's module cannot hold"):  # through a partial
        zp.make_trainer(functools.partial(loss_fn), optax.sgd(0.1), params, mesh=mesh_of(2, 4),
                        per_layer=True)


class _DropoutLinear(nnx.Module):
    def __init__(self, rngs):
        self.lin = nnx.Linear(WIDTH, WIDTH, rngs=rngs)
        self.drop = nnx.Dropout(0.5, rngs=rngs)

    def __call__(self, x):
        return self.drop(self.lin(x))


def test_nnx_loss_reseeds_the_streams_the_module_holds():
    def total(m, b):
        return jnp.sum(m(b["x"]))

    x = {"x": np.ones((2, WIDTH), np.float32)}
    # nnx.Rngs(0) names Dropout's stream "default", not "dropout": a new mask per key anyway
    for rngs in (nnx.Rngs(0), nnx.Rngs(params=0, dropout=1)):
        params, loss_fn = zp.nnx_loss(_DropoutLinear(rngs), total)
        losses = {float(loss_fn(params, x, jax.random.key(k))) for k in (1, 2, 3)}
        assert len(losses) == 3, losses
    with pytest.raises(ValueError, match=r"stream\(s\) \['dropout'\].*holds the streams "
                                         r"\['default'\]"):
        zp.nnx_loss(_DropoutLinear(nnx.Rngs(0)), total, streams=("dropout",))
    params, loss_fn = zp.nnx_loss(_DropoutLinear(nnx.Rngs(0)), total, streams=())
    assert len({float(loss_fn(params, x, jax.random.key(k))) for k in (1, 2)}) == 1


def test_export_keeps_the_int_keys_of_nnx_list_items(tmp_path):
    """``nnx_loss`` keys ``nnx.List`` items by ``int``; the export keeps them
    (whole model and wrap, from memory and from a checkpoint, the same
    bytes), so ``nnx.update`` takes the exported tree back."""
    import flax.serialization

    from zeropp_jax.checkpoint import Checkpointer, CheckpointMismatchError, export_params

    model = Model(2, nnx.Rngs(0, dropout=1))
    for name, kwargs in [("whole", {}), ("wrap", dict(wrap=(Block,), example_batch=BATCH))]:
        trainer, params, _ = trainer_of(model, **kwargs)
        assert list(params["blocks"]) == [0, 1]
        state = trainer.init(params)
        with Checkpointer(tmp_path / name, async_save=False) as ckpt:
            ckpt.save(0, state, trainer)
        export_params(state, tmp_path / f"{name}.msgpack", trainer=trainer)
        export_params(tmp_path / name, tmp_path / f"{name}_dir.msgpack")
        data = (tmp_path / f"{name}.msgpack").read_bytes()
        assert (tmp_path / f"{name}_dir.msgpack").read_bytes() == data, name
        tree = flax.serialization.msgpack_restore(data)
        assert jax.tree.structure(tree) == jax.tree.structure(params), name
        nnx.update(model, tree)
    # the same checkpoint restored into three layers: a mismatch naming the
    # parameter by its int-keyed path (it raised TypeError building the message)
    three, _, _ = trainer_of(Model(3, nnx.Rngs(0, dropout=1)), wrap=(Block,),
                             example_batch=BATCH)
    with Checkpointer(tmp_path / "wrap") as ckpt:
        with pytest.raises(CheckpointMismatchError, match="the parameter blocks/2/lin/bias"):
            ckpt.restore(three)



class Net(nnx.Module):
    """``embed``, then each of ``n_layers`` blocks ``make_block(rngs)``, then ``head``."""

    def __init__(self, make_block, rngs, n_layers=2):
        self.embed = nnx.Linear(8, WIDTH, rngs=rngs)
        self.blocks = nnx.List([make_block(rngs) for _ in range(n_layers)])
        self.head = nnx.Linear(WIDTH, 1, rngs=rngs)

    def __call__(self, x):
        h = self.embed(x)
        for block in self.blocks:
            h = block(h)
        return self.head(h)[:, 0]


class SowingBlock(nnx.Module):
    """Records its activation with ``sow`` (e.g. for an auxiliary loss)."""

    def __init__(self, rngs, rate=0.0):
        self.lin = nnx.Linear(WIDTH, WIDTH, rngs=rngs)
        self.drop = nnx.Dropout(rate, rngs=rngs)

    def __call__(self, h):
        y = jnp.tanh(self.lin(h))
        self.sow(nnx.Intermediate, "act", y)
        return h + self.drop(y)


# nnx.sow outside nnx.capture is deprecated; the wrap policy refuses both
SOW_DEPRECATED = pytest.mark.filterwarnings("ignore:Using 'Module.sow\\(\\)':DeprecationWarning")


def criterion_with_aux(model, batch):
    """``criterion`` plus the mean square of the activations the blocks sowed."""
    loss = criterion(model, batch)
    return loss + sum(jnp.mean(a ** 2) for a in jax.tree.leaves(nnx.pop(model, nnx.Intermediate)))


@SOW_DEPRECATED
def test_a_wrapped_block_that_sows_is_refused():
    for rate in (0.0, 0.2):  # with a dropout stream, the sown value shifted the stream's keys
        model = Net(functools.partial(SowingBlock, rate=rate), nnx.Rngs(0, dropout=1))
        trainer, params, loss_fn = trainer_of(model, criterion_with_aux, wrap=(SowingBlock,),
                                              example_batch=BATCH)
        loss_fn(params, BATCH, jax.random.key(0))  # unwrapped, an auxiliary loss
        with pytest.raises(ValueError, match=r"SowingBlock at blocks/0 created state "
                                             r"\['act'\].*Return such a value from __call__"):
            trace_step(trainer, params)
    with pytest.raises(ValueError, match="shorter"):  # as many keys as implementations
        keys_from_data([np.zeros(2, np.uint32)], [])


class NormBlock(nnx.Module):
    """A block with a ``BatchNorm`` (``train``: it updates its running
    statistics), a dropout, and (``count``) a counter of its calls."""

    def __init__(self, rngs, rate=0.2, train=False, count=False):
        self.lin = nnx.Linear(WIDTH, WIDTH, rngs=rngs)
        self.norm = nnx.BatchNorm(WIDTH, use_running_average=not train, rngs=rngs)
        self.drop = nnx.Dropout(rate, rngs=rngs)
        self.calls = nnx.Variable(jnp.zeros((), jnp.int32)) if count else None

    def __call__(self, h):
        if self.calls is not None:
            self.calls[...] += 1
        return h + self.drop(jnp.tanh(self.norm(self.lin(h))))


@SOW_DEPRECATED
def test_nnx_loss_refuses_or_warns_of_state_the_trainer_would_drop():
    def loss_of(model, crit=criterion):
        params, loss_fn = zp.nnx_loss(model, crit)
        return loss_fn(params, BATCH, jax.random.key(0))

    rngs = functools.partial(nnx.Rngs, 0, dropout=1)
    train_mode = functools.partial(NormBlock, train=True)
    # BatchNorm updating its statistics: refused when the loss is built
    for model in (Net(train_mode, rngs()), Scanned(rngs(), block=train_mode)):
        with pytest.raises(ValueError, match=r"BatchNorm \[.*norm.*\] update their running "
                                             r"statistics.*use_running_average=True"):
            zp.nnx_loss(model, criterion)
    # a sown value left in the module: created state, refused when traced
    with pytest.raises(ValueError, match=r"created state \['blocks/0/act', 'blocks/1/act'\]"
                                         r".*nnx.pop"):
        loss_of(Net(SowingBlock, rngs()))
    # a BatchNorm whose mode is given per call (None): not refused when built;
    # called in training mode, its statistics are named in the warning
    class CallMode(NormBlock):
        def __init__(self, rngs, train):
            super().__init__(rngs)
            self.norm = nnx.BatchNorm(WIDTH, use_running_average=None, rngs=rngs)
            self.train = train

        def __call__(self, h):
            return h + jnp.tanh(self.norm(self.lin(h), use_running_average=not self.train))

    with warnings.catch_warnings():
        warnings.simplefilter("error", UserWarning)
        loss_of(Net(functools.partial(CallMode, train=False), rngs()))
    with pytest.warns(UserWarning, match=r"\['blocks/0/norm/mean', .*\] are batch statistics: a "
                                         r"BatchNorm called with use_running_average=False"):
        loss_of(Net(functools.partial(CallMode, train=True), rngs()))
    # a counter written: a new value tracing cannot tell from a transform's copy
    with pytest.warns(UserWarning, match=r"\['blocks/0/calls', 'blocks/1/calls'\] has new "
                                         r"values.*drops what it writes"):
        loss_of(Net(functools.partial(NormBlock, count=True), rngs()))
    # reads (BatchNorm in eval mode), random streams advancing, sown values
    # taken out: neither an error nor a warning
    with warnings.catch_warnings():
        warnings.simplefilter("error", UserWarning)
        loss_of(Net(NormBlock, rngs()))
        loss_of(Scanned(rngs(), block=NormBlock))
        loss_of(Net(SowingBlock, rngs()), criterion_with_aux)
        for model in (Net(NormBlock, rngs()), Scanned(rngs(), block=NormBlock)):
            trainer, params, _ = trainer_of(model, wrap=(NormBlock,), example_batch=BATCH)
            trace_step(trainer, params)


def test_a_model_built_on_the_mesh_trains_like_one_built_on_the_host():
    """A model built under ``jax.set_mesh`` (JAX's explicit sharding) holds
    its batch statistics and stream keys on the mesh, which a loss cannot
    close over inside the step's ``shard_map``: ``nnx_loss`` takes host copies."""
    mesh = mesh_of(2, 4)
    with jax.set_mesh(mesh):
        on_mesh = Net(NormBlock, nnx.Rngs(0, dropout=1))
    assert len(on_mesh.blocks[0].norm.mean[...].sharding.device_set) == 8
    losses = []
    for model in (on_mesh, Net(NormBlock, nnx.Rngs(0, dropout=1))):
        trainer, params, _ = trainer_of(model)
        state, metrics = trainer.step(trainer.init(params), BATCH)
        losses.append(float(metrics["loss"]))
    assert losses[0] == losses[1]


class Rematted(Net):
    """``Net`` with each block called through ``nnx.remat``, which puts every
    variable back (BatchNorm's statistics unchanged) after the call."""

    def __call__(self, x):
        h = self.embed(x)
        for block in self.blocks:
            h = nnx.remat(lambda b, h: b(h))(block, h)
        return self.head(h)[:, 0]


def test_state_only_copied_back_by_nnx_remat_is_no_error():
    params, loss_fn = zp.nnx_loss(Rematted(functools.partial(NormBlock, rate=0.0),
                                           nnx.Rngs(0)), criterion)
    _, plain = zp.nnx_loss(Net(functools.partial(NormBlock, rate=0.0), nnx.Rngs(0)), criterion)
    with pytest.warns(UserWarning, match="nnx.remat"):  # said, not refused
        value = jax.jit(loss_fn)(params, BATCH)
    assert float(value) == pytest.approx(float(plain(params, BATCH)), rel=1e-6)


class SubBlock(Block):
    """A ``Block`` after a projection of its own, in its own ``__call__``."""

    def __init__(self, rngs, rate=0.0):
        super().__init__(rngs, rate)
        self.pre = nnx.Linear(WIDTH, WIDTH, rngs=rngs)

    def __call__(self, h):
        return super().__call__(jnp.tanh(self.pre(h)))


def test_a_subclass_with_its_own_call_is_a_wrapped_block_that_trains_like_plain_optax():
    call = SubBlock.__call__
    trainer, params, loss_fn = trainer_of(Net(SubBlock, nnx.Rngs(0)), wrap=(Block,),
                                          example_batch=BATCH)
    assert trainer.layout.names == ("rest", "blocks/0", "blocks/1")
    assert SubBlock.__dict__["__call__"] is call  # put back
    (losses, full), (ref_losses, ref) = train(trainer, params, 2), plain_optax(loss_fn, params, 2)
    np.testing.assert_allclose(losses, ref_losses, rtol=1e-5)
    for a, b in zip(jax.tree.leaves(full), jax.tree.leaves(ref)):
        np.testing.assert_allclose(a, b, rtol=1e-4, atol=1e-5)


class TiedNet(nnx.Module):
    """Token embeddings, blocks, and the embeddings again as the head (``Embed.attend``)."""

    def __init__(self, rngs, vocab=16):
        self.embed = nnx.Embed(vocab, WIDTH, rngs=rngs)
        self.blocks = nnx.List([Block(rngs, 0.0) for _ in range(2)])

    def __call__(self, tokens):
        h = self.embed(tokens)
        for block in self.blocks:
            h = block(h)
        return self.embed.attend(h)


def test_wrapped_parameters_read_outside_the_blocks_call_are_refused():
    tokens = np.random.default_rng(0).integers(0, 16, size=(16, 5)).astype(np.int32)
    batch = {"x": tokens[:, :-1], "y": tokens[:, 1:]}

    def next_token(model, b):
        return optax.softmax_cross_entropy_with_integer_labels(model(b["x"]), b["y"]).mean()

    trainer, params, _ = trainer_of(TiedNet(nnx.Rngs(0)), next_token, wrap=(nnx.Embed, Block),
                                    example_batch=batch)
    with pytest.raises(ValueError, match=r"parameter embed/embedding of a wrapped block is read "
                                         r"outside the block's __call__.*out of wrap="):
        trace_step(trainer, params, batch)


class RematNet(Net):
    def __call__(self, x):
        h = self.embed(x)
        for block in self.blocks:
            h = nnx.remat(lambda b, h: b(h))(block, h)
        return self.head(h)[:, 0]


def test_a_block_under_nnx_remat_is_refused_naming_the_likely_cause():
    params, loss_fn = zp.nnx_loss(RematNet(Block, nnx.Rngs(0, dropout=1)), criterion)
    with pytest.raises(ValueError, match="inside nnx.remat, nnx.jit .*already recomputes each "
                                         "wrapped block in the backward"):
        wrap_nnx.discover(loss_fn, params, BATCH, (Block,))


class HeadBlock(nnx.Module):
    """A head holding the model's input layer (tied weights)."""

    def __init__(self, embed, rngs):
        self.embed = embed
        self.norm = nnx.LayerNorm(WIDTH, rngs=rngs)

    def __call__(self, h):
        return self.norm(h) @ self.embed.kernel[...].T


def test_blocks_sharing_parameters_with_another_module_are_refused_naming_them():
    rngs = nnx.Rngs(0, dropout=1)
    tied = Net(Block, rngs)
    tied.head = HeadBlock(tied.embed, rngs)
    shared = Net(Block, rngs)
    shared.blocks[1].lin = shared.blocks[0].lin
    for model, classes, match in [
        (tied, (HeadBlock,), r"HeadBlock's parameters lie in 2 sub-trees of params \(under "
                             r"head: .*; under the root: embed/bias, embed/kernel\)"),
        (shared, (Block,), r"Block's parameters lie in 2 sub-trees of params \(under "
                           r"blocks/0: blocks/0/lin/bias, blocks/0/lin/kernel; under blocks/1"),
    ]:
        params, loss_fn = zp.nnx_loss(model, criterion)
        with pytest.raises(ValueError, match=match + ".*shares parameters with another module"):
            wrap_nnx.discover(loss_fn, params, BATCH, classes)


class TwoWayBlock(Block):
    def fwd(self, h):
        """The block's function, not through its ``__call__``."""
        return Block.__call__(self, h)


class BypassNet(Net):
    def __call__(self, x):
        h = self.blocks[0](self.embed(x))
        return self.head(self.blocks[1].fwd(h))[:, 0]


def test_a_block_applied_only_by_another_method_is_named_in_a_warning():
    fwd = TwoWayBlock.fwd
    params, loss_fn = zp.nnx_loss(BypassNet(TwoWayBlock, nnx.Rngs(0, dropout=1)), criterion)
    with pytest.warns(UserWarning, match="the TwoWayBlock at blocks/1 is applied only by its "
                                         "method fwd.*only __call__"):
        paths, _ = wrap_nnx.discover(loss_fn, params, BATCH, (TwoWayBlock,))
    assert paths == [("blocks", 0)] and TwoWayBlock.__dict__["fwd"] is fwd


def test_a_block_applied_only_by_another_method_is_warned_of_where_it_has_no_path():
    """Its parameters lie in two sub-trees (one layer shared with block 0),
    so it has no path to name; the warning that it stays in the rest unit
    is still given, by class and method."""
    model = BypassNet(TwoWayBlock, nnx.Rngs(0, dropout=1))
    model.blocks[1].lin = model.blocks[0].lin
    params, loss_fn = zp.nnx_loss(model, criterion)
    with pytest.warns(UserWarning, match=r"a TwoWayBlock \(at a path not known\) is applied only "
                                         r"by its method fwd.*stay in the rest unit"):
        paths, _ = wrap_nnx.discover(loss_fn, params, BATCH, (TwoWayBlock,))
    assert paths == [("blocks", 0)]

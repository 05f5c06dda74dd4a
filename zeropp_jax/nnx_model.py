"""Training a Flax NNX module through the trainer: params, the rest, and keys.

The trainer shards and trains a pytree of parameters with a pure
``loss_fn(params, batch[, key])``. An NNX module holds more than its
parameters (``Rngs`` streams, dropout keys, batch statistics), and
``nnx.split(model, nnx.Param)`` alone refuses such a module ("Non-exhaustive
filters"). :func:`nnx_loss` splits it into the parameters (trained) and the
rest (read by every step, unchanged), and builds the loss, reseeding the
module's random streams from the trainer's per-step key. The loss returns
the loss (or ``(loss, aux)`` with scalar aux), so state the criterion writes
cannot leave it: refused where that is certain, warned about where a
transform's copy looks the same (:func:`written_state`).
"""

from __future__ import annotations

import warnings
from typing import TYPE_CHECKING, Any, Callable, Sequence

import jax
import jax.numpy as jnp
import numpy as np

from zeropp_jax.prng_keys import is_key, keys_as_data, keys_from_data

# flax.nnx is imported where it is used, so that `import zeropp_jax` works
# where it does not import (flax <= 0.12.9 with jax 0.11.2: google/flax#5596).
if TYPE_CHECKING:
    from flax import nnx

# A loss carrying this attribute set to its maker's name (nnx_loss) takes
# per-layer units only through make_trainer's wrap=: it merges the parameters
# into a module, which cannot hold the Unit handles per_layer=True passes
# (zeropp_jax.step.wrap.check_per_layer).
UNITS_BY_WRAP_ONLY = "zeropp_units_by_wrap_only"
# A loss carrying this attribute reseeds these random streams from the key
# the step passes it, so make_trainer warns without rng=
# (zeropp_jax.step.accumulate.check_loss_arguments).
RESEEDED_STREAMS = "zeropp_reseeded_streams"
# How many functools.partial / functools.wraps layers loss_mark looks through.
_MAX_WRAPPERS = 8


def loss_mark(loss_fn: Callable, mark: str) -> Any:
    """The attribute ``mark`` its maker set on ``loss_fn`` (looked for through
    ``functools.partial`` and ``functools.wraps`` wrappers too), or ``None``."""
    fn = loss_fn
    for _ in range(_MAX_WRAPPERS):
        value = getattr(fn, mark, None)
        fn = getattr(fn, "func", None) or getattr(fn, "__wrapped__", None)
        if value is not None or fn is None:
            return value
    return None


def nnx_loss(
    model: nnx.Module,
    criterion: Callable[[nnx.Module, Any], jax.Array],
    *,
    streams: Sequence[str] | None = None,
) -> tuple[Any, Callable[..., jax.Array]]:
    """The parameters of an NNX ``model`` and a loss for :func:`zeropp_jax.make_trainer`.

    Args:
      model: any NNX module (with ``Rngs``, ``Dropout``, ... ).
      criterion: ``criterion(module, batch) -> scalar``, the mean loss of the
        module on a micro-batch (e.g. ``lambda m, b: mse(m(b["x"]), b["y"])``),
        or ``-> (scalar, aux)`` (see :func:`zeropp_jax.make_trainer`).
      streams: the names of the module's random streams to reseed from the
        trainer's key each step; ``None`` (default): every stream the module
        holds except ``"params"`` (only read at initialization). The name is
        the ``nnx.Rngs`` stream a layer drew its own from: ``Dropout`` under
        ``nnx.Rngs(0, dropout=1)`` holds ``"dropout"``, under ``nnx.Rngs(0)``
        ``"default"``. A name the module does not hold raises
        ``ValueError`` (it would never be reseeded: the same mask every
        step); ``()`` reseeds nothing. Pass ``rng=`` to
        :func:`~zeropp_jax.make_trainer` so the loss gets a key. A stream
        of layers stacked by ``nnx.vmap`` (one key per layer) gets the
        step's key split into one per layer.

    Returns:
      ``(params, loss_fn)``: the ``nnx.Param`` values as a nested dict of
      arrays (``nnx.to_pure_dict``: attribute names, and integers for
      ``nnx.List`` items), to pass to ``make_trainer`` and ``trainer.init``
      (and ``nnx.update`` takes it back), and
      ``loss_fn(params, batch, key=None)``. Without a key the streams keep
      the values they had when the model was split, so every step would draw
      the same dropout mask: give the trainer ``rng=`` (``make_trainer`` warns
      without it while the module has streams to reseed). The other state
      (batch statistics, counters) is read, never written back:
      ``nnx_loss`` raises ``ValueError`` for a ``BatchNorm`` with
      ``use_running_average=False``, the loss (when traced) for a variable
      the criterion creates (``nnx.sow`` values it does not take out with
      ``nnx.pop``), and it warns when a variable holds a new value after the
      criterion (a counter written, or a copy put back by ``nnx.remat``).

    ``make_trainer(..., wrap=(Block,), example_batch=batch)`` makes each
    ``Block`` instance the loss calls its own unit, and blocks stacked by
    ``nnx.vmap`` and applied by ``nnx.scan`` one stacked unit gathered layer
    by layer (:mod:`zeropp_jax.step.wrap_nnx`).

    Example::

      params, loss_fn = zp.nnx_loss(model, lambda m, b: jnp.mean((m(b["x"]) - b["y"]) ** 2))
      trainer = zp.make_trainer(loss_fn, optax.adam(1e-3), params, mesh=mesh, rng=0)
      state = trainer.init(params)
      ...
      nnx.update(model, trainer.gather_params(state))  # trained weights back in the module
    """
    from flax import nnx
    check_no_training_batch_norm(model)
    streams = _streams_to_reseed(model, streams)
    graphdef, params, rest = nnx.split(model, nnx.Param, ...)
    params = nnx.to_pure_dict(params)
    if any(isinstance(x, jax.ShapeDtypeStruct) for x in jax.tree.leaves(rest)):
        raise ValueError(
            "nnx_loss: the module's state other than its parameters (random keys, counts, "
            "batch statistics) is abstract, as nnx.eval_shape leaves it; the loss reads it, so "
            "it must hold values. For a model never whole on a device (Trainer.init_from), "
            "keep only the parameters abstract: graphdef, params, _ = nnx.split("
            "nnx.eval_shape(make), nnx.Param, ...); rest = jax.jit(lambda: nnx.split(make(), "
            "nnx.Param, ...)[2])() (XLA drops the parameters it does not return); "
            "nnx_loss(nnx.merge(graphdef, params, rest), criterion)")
    rest = jax.tree.map(_off_mesh, rest)  # the loss closes over it

    def loss_fn(params: Any, batch: Any, key: jax.Array | None = None) -> jax.Array:
        # The rest enters as this trace's values: NNX refuses to reseed
        # variables that belong to another trace.
        module = nnx.merge(graphdef, params, jax.tree.map(jnp.asarray, rest))
        if key is not None and streams:
            keys = {s: jax.random.fold_in(key, i) for i, s in enumerate(streams)}
            # A stream of layers stacked by nnx.vmap holds one key per layer:
            # "match_shape" splits the step's key into as many.
            nnx.reseed(module, policy="match_shape", **keys)
        before = state_leaves(module)
        loss = criterion(module, batch)
        check_state_writes(
            module, before, who="nnx_loss: the criterion",
            drops="each step reads the module's state as nnx_loss split it",
            fix="Take values recorded with sow out in the criterion (nnx.pop(module, "
                "nnx.Intermediate), or nnx.capture) and keep caches out of the loss")
        return loss

    setattr(loss_fn, UNITS_BY_WRAP_ONLY, "nnx_loss")  # per-layer units: wrap= only
    # make_trainer warns without rng=, unless no stream is drawn from
    setattr(loss_fn, RESEEDED_STREAMS, tuple(streams) if _draws(model) else ())
    return params, loss_fn


def state_leaves(module: nnx.Module) -> dict[tuple, Any]:
    """``key path -> leaf`` of an NNX ``module``'s state other than its
    ``nnx.Param`` s and random-stream state (``nnx.RngState``: keys and
    counts): batch statistics, counters, ``sow`` values."""
    from flax import nnx
    state = nnx.state(module, nnx.Not(nnx.Any(nnx.Param, nnx.RngState)))
    return dict(jax.tree_util.tree_flatten_with_path(state)[0])


def written_state(module: nnx.Module, before: dict[tuple, Any]) -> tuple[list[str], list[str]]:
    """``(created, replaced)``: the variables of ``module`` (``/``-joined
    paths, sorted) created or changed in shape or dtype since ``before`` (its
    :func:`state_leaves` then), and those holding another array of the same
    shape and dtype. A variable only read keeps the same array; a replaced
    one was either written or copied unchanged by an NNX transform
    (``nnx.remat`` and ``nnx.jit`` put back every variable), which tracing
    cannot tell apart."""
    created, replaced = set(), set()
    for path, leaf in state_leaves(module).items():
        old = before.get(path)
        if old is leaf:
            continue
        name = _path_name(path)
        same = old is not None and (jnp.shape(old), jnp.result_type(old)) == (
            jnp.shape(leaf), jnp.result_type(leaf))
        (replaced if same else created).add(name)
    return sorted(created), sorted(replaced)


def _draws(model: nnx.Module) -> bool:
    """Whether ``model`` may draw from a random stream: one not held by a
    layer whose dropout rate is 0 (``Dropout(0.0)``, ``MultiHeadAttention``'s
    default). A layer made deterministic (``model.eval()``) still counts: a
    call may override it (``deterministic=False``)."""
    from flax import nnx

    nodes = dict(nnx.iter_graph(model))

    def off(owner):
        return getattr(owner, "rate", getattr(owner, "dropout_rate", None)) == 0

    return any(isinstance(n, nnx.RngStream) and not off(nodes.get(p[:-1]))
               for p, n in nodes.items())


def graph_nodes(tree: Any) -> list:
    """The NNX objects (modules, ``nnx.Rngs``) in a pytree of call arguments."""
    from flax import nnx
    found = jax.tree.leaves(tree, is_leaf=lambda x: isinstance(x, nnx.Pytree))
    return [x for x in found if isinstance(x, nnx.Pytree)]


def streams_once(holders: list, who: str) -> list:
    """``holders`` (a wrapped block and the NNX objects passed to its call),
    or ``ValueError`` if two of them reach the same random stream (the block
    holds the ``nnx.Rngs`` it is also passed, or one is passed twice): the
    layer copies each holder, so both copies would draw the same keys and
    only one could be written back."""
    from flax import nnx
    seen: dict[int, int] = {}  # id of a stream variable -> the holder reaching it
    for i, holder in enumerate(holders):
        for _, v in nnx.iter_graph(holder):
            if isinstance(v, nnx.RngState) and seen.setdefault(id(v), i) != i:
                raise ValueError(
                    f"{who} is called with an {type(holder).__name__} whose random streams "
                    "it also reaches through another argument or its own attributes; inside "
                    "the trainer each is a copy, so they would draw the same keys. Give the "
                    "block its Rngs one way only (hold it, or take it as an argument)")
    return holders


def check_state_writes(module: nnx.Module, before: dict[tuple, Any], *, who: str, drops: str,
                       fix: str) -> None:
    """After ``who`` (e.g. ``"nnx_loss: the criterion"``) ran on ``module``:
    raises ``ValueError`` for state it created (:func:`written_state`), which
    the trainer drops (``drops`` says why; ``fix`` what to do instead), and
    warns of state holding new values, which tracing cannot tell apart from
    a transform's unchanged copies."""
    created, replaced = written_state(module, before)
    if created:
        raise ValueError(f"{who} created state {created} (or changed its shape), which the "
                         f"trainer drops ({drops}). {fix}")
    if replaced:
        stats = sorted(set(replaced) & set(_batch_stat_names(module)))
        warnings.warn(
            f"{who} ran, and the state {replaced} has new values: either written (a "
            f"counter, a statistic), and the trainer drops what it writes ({drops}), or put "
            "back unchanged by an NNX transform (nnx.remat, nnx.jit), which is harmless"
            + (f". {stats} are batch statistics: a BatchNorm called with "
               "use_running_average=False writes them and normalizes over each device's "
               "micro-batch; call it with use_running_average=True" if stats else ""),
            stacklevel=3)


def _batch_stat_names(module: nnx.Module) -> list[str]:
    """The ``/``-joined paths of ``module``'s ``nnx.BatchStat`` variables."""
    from flax import nnx
    state = nnx.state(module, nnx.BatchStat)
    return [_path_name(path) for path, _ in jax.tree_util.tree_flatten_with_path(state)[0]]


def _path_name(path: tuple) -> str:
    """A state leaf's key path as the ``/``-joined variable path, e.g. ``bn/mean``."""
    return "/".join(str(e.key) for e in path if isinstance(e, jax.tree_util.DictKey))


def _off_mesh(x: Any) -> Any:
    """A ``jax.Array`` spread over several devices (a module built under
    ``jax.set_mesh``) as a host copy, which a loss can close over inside the
    trainer's ``shard_map`` (a copy moved to one device still cannot be);
    any other leaf as it is."""
    if not (isinstance(x, jax.Array) and len(x.sharding.device_set) > 1):
        return x
    if is_key(x):  # a typed key: a host copy of its data, wrapped again
        (data,), impls = keys_as_data([x])
        return keys_from_data([np.asarray(data)], impls)[0]
    return np.asarray(x)


def check_no_training_batch_norm(model: nnx.Module) -> None:
    """Raises ``ValueError`` naming each ``nnx.BatchNorm`` of ``model`` set to
    update its running statistics (``use_running_average=False``): the
    trainer would drop them, and normalize over each device's micro-batch.
    One built with ``None`` takes its mode at each call: a call in training
    mode is warned of when the loss is traced (:func:`check_state_writes`)."""
    from flax import nnx
    found = ["/".join(map(str, path)) for path, node in nnx.iter_graph(model)
             if isinstance(node, nnx.BatchNorm) and node.use_running_average is False]
    if found:
        raise ValueError(
            f"nnx_loss: BatchNorm {found} update their running statistics in training "
            "(use_running_average=False), which the trainer would drop (each step reads the "
            "module's state as nnx_loss split it), and would normalize over each device's "
            "micro-batch. Use BatchNorm(use_running_average=True) with fixed statistics, "
            "or nnx.LayerNorm"
        )


def _streams_to_reseed(model: nnx.Module, streams: Sequence[str] | None) -> tuple[str, ...]:
    """The stream names :func:`nnx_loss` reseeds: ``streams``, checked against
    the names of the ``nnx.RngStream`` s ``model`` holds, or (``None``) all of
    those but ``"params"``, sorted."""
    from flax import nnx
    held = sorted({
        node.key.tag for _, node in nnx.iter_graph(model) if isinstance(node, nnx.RngStream)
    })
    if streams is None:
        return tuple(tag for tag in held if tag != "params")
    if isinstance(streams, str):
        raise TypeError(
            f"streams must be a sequence of stream names, got the string {streams!r}; "
            f"pass streams=({streams!r},)"
        )
    missing = [s for s in streams if s not in held]
    if missing:
        raise ValueError(
            f"nnx_loss cannot reseed random stream(s) {missing}: the module holds the "
            f"streams {held} (a layer's stream is named after the nnx.Rngs stream it "
            f"drew from: nnx.Rngs(0) names it 'default', nnx.Rngs(0, dropout=1) "
            f"'dropout'); pass streams from {held}, or leave streams out to reseed "
            f"every stream but 'params'"
        )
    return tuple(streams)

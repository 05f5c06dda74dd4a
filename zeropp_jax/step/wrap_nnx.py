"""The wrap policy for Flax NNX modules (see :mod:`zeropp_jax.step.wrap`).

For ``flax.nnx.Module`` classes and a loss that builds its module from its
``params`` argument with ``nnx.merge`` (as :func:`zeropp_jax.nnx_loss` does).
NNX modules are plain Python objects, so the listed classes' ``__call__`` is
swapped for a dispatcher while the loss is traced (and restored after).

1. :func:`discover` finds each called block's parameters among the
   loss's inputs by identity (``nnx.merge`` puts the traced input arrays
   into the module's ``Param`` variables unchanged); the block's path is the
   input path of its parameters less their path inside the block. A block
   applied by ``nnx.scan`` (layers stacked by ``nnx.vmap``, Flax's "scan
   over layers") sees one layer's slice of its parameters, new arrays: its
   path is the one sub-tree of the inputs with the block's parameter names,
   shapes and dtypes under one leading layer axis, and it becomes a stacked
   unit.
2. :func:`wrap_loss` hands the loss a parameter tree in which each wrapped
   block's first parameter holds its :class:`~zeropp_jax.step.gather.Unit`
   and the others hold empty ``(..., 0)`` arrays; ``nnx.scan`` slices these
   like parameters, so a scanned block sees one layer's ``Unit``. A call of
   a block holding a ``Unit`` splits the block (``nnx.split``), merges it
   again inside ``layer`` with ``gather(unit)`` (one gather per layer,
   forward and backward), and writes its random-stream counters (and an
   ``nnx.Rngs`` argument's) back with ``nnx.update``; ``nnx.scan`` stacks
   them. (Applied by ``nnx.vmap``, the stack's per-layer gathers are batched
   into one gather of the whole stack.) Refused: a block holding a stacked
   ``Unit`` called whole, not by a scan; a block creating state
   (``nnx.sow``), which could not leave ``layer`` (other state given new
   values is warned about); and a read of a wrapped block's parameters
   outside its ``__call__`` (``Embed.attend``; a read of the whole tree,
   ``nnx.state(model, nnx.Param)`` in the criterion, is not caught and sees
   placeholders).

A subclass of a listed class with its own ``__call__`` is dispatched too.
Two stacks whose parameters have the same names, shapes and dtypes cannot be
told apart by :func:`discover` and are refused. PRNG keys in the block's
state (its random streams) cross ``layer`` as raw key data
(``jax.random.key_data``) and are wrapped again inside.
"""

from __future__ import annotations

import contextlib
import inspect
import itertools
import threading
import warnings
from typing import Any, Callable, Sequence

import jax
import jax.numpy as jnp

from zeropp_jax.prng_keys import state_as_data, state_from_data
from zeropp_jax.step.blocks import as_layer, depth, inside_block, leaf_paths, trace_calls
from zeropp_jax.step.gather import Unit
from zeropp_jax.tree_paths import cut_paths, paste_paths


@jax.tree_util.register_pytree_node_class
class _Held:
    """A wrapped block's parameter as the loss receives it (see
    :func:`_holder`): its unit's :class:`Unit` or an empty array, which only
    the block's ``__call__`` may hold. Read as an array anywhere else (by
    another method, another module), it raises a ``ValueError`` naming the
    parameter; a read of the leaves of a whole tree holding it
    (``jax.tree.leaves``) is not caught. Child: ``value``; aux: its path."""

    def __init__(self, value: Any, name: str):
        self.value = value
        self.name = name

    def tree_flatten(self):
        return (self.value,), self.name

    @classmethod
    def tree_unflatten(cls, name, children):
        return cls(children[0], name)

    def _refuse(self, *_):
        raise ValueError(
            f"wrap: the parameter {self.name} of a wrapped block is read outside the "
            "block's __call__ (by another method, e.g. Embed.attend for tied "
            "embeddings, or by another module); only a call of the block gathers its "
            "parameters. Leave the block's class out of wrap= (its parameters then "
            "join the rest unit, gathered before the loss), or read them only in its "
            "__call__"
        )

    __getitem__ = __jax_array__ = __array__ = _refuse


def _with_subclasses(classes: Sequence[type]) -> tuple[type, ...]:
    """``classes`` and, recursively, their subclasses that define their own
    ``__call__`` (an instance of one is an instance of a listed class), each
    once, parents first."""
    found = list(classes)
    for c in found:  # breadth first: the loop sees what it appends
        found += [sub for sub in c.__subclasses__() if sub not in found]
    return tuple(c for c in found if c in classes or "__call__" in c.__dict__)


def _public_methods(cls: type) -> list[str]:
    """The names of the plain public methods an NNX ``cls`` defines or
    inherits from classes below ``nnx.Module`` (``Embed.attend``, ...), but
    ``set_view`` (which ``Module.train``/``eval`` call: it applies nothing)."""
    from flax import nnx

    return sorted({
        name for base in cls.__mro__ if issubclass(base, nnx.Module) and base is not nnx.Module
        for name, f in vars(base).items()
        if not name.startswith("_") and name != "set_view" and inspect.isfunction(f)
    })


_PATCHING = threading.RLock()  # held while classes are patched: another thread's trace waits


@contextlib.contextmanager
def _patched(classes: Sequence[type], name: str, handler: Callable):
    """While active, calling the method ``name`` of an instance of ``classes``
    runs ``handler(method, module, args, kwargs)``, ``method`` being the
    class's own; outside, the classes are as they were. One thread at a time."""
    def dispatcher(method):
        def patched(self, *args, **kwargs):
            return handler(method, self, args, kwargs)

        return patched

    with _PATCHING:
        saved = [(c, c.__dict__.get(name)) for c in classes]
        try:
            for c in classes:
                setattr(c, name, dispatcher(getattr(c, name)))
            yield
        finally:
            for c, own in saved:
                if own is None:
                    delattr(c, name)  # it was inherited
                else:
                    setattr(c, name, own)


def _nnx_calls(classes: Sequence[type], handler: Callable):
    """While active, calling an instance of ``classes`` (or of a subclass with
    its own ``__call__``) runs ``handler(call, module, args, kwargs)``,
    ``call`` being the class's own ``__call__``; outside, the classes are as
    they were."""
    return _patched(_with_subclasses(classes), "__call__", handler)


def _keys(path: tuple) -> tuple:
    """A JAX key path as plain keys, up to the first non-dict entry (a
    ``Variable``'s ``value``)."""
    dicts = itertools.takewhile(lambda entry: isinstance(entry, jax.tree_util.DictKey), path)
    return tuple(entry.key for entry in dicts)


def _params_of(module: Any) -> list[tuple[tuple, Any]]:
    """``(path inside the module, value)`` of an NNX ``module``'s ``Param``s,
    a :class:`_Held` being one value."""
    from flax import nnx

    own = jax.tree_util.tree_flatten_with_path(
        nnx.state(module, nnx.Param), is_leaf=lambda x: isinstance(x, _Held))[0]
    return [(_keys(path), leaf) for path, leaf in own]


_BUILT = (
    "wrapped NNX blocks must be built by nnx.merge from params unchanged "
    "(zeropp_jax.nnx_loss does) and called directly or by nnx.scan over a "
    "leading layer axis (layers stacked with nnx.vmap). A block called inside "
    "nnx.remat, nnx.jit or another NNX transform sees that transform's copies: "
    "call it directly (the wrap policy already recomputes each wrapped block in "
    "the backward, gathering it again, so an nnx.remat around it can be "
    "dropped). Otherwise mark layers with zp.gather/zp.layer, or use "
    "per_layer=False"
)


def _show(path: tuple) -> str:
    """A key path as ``a/0/b``; the root as ``the root``."""
    return "/".join(map(str, path)) if path else "the root"


def _block_path(module: Any, where: dict, inputs: dict) -> tuple[tuple, bool] | None:
    """``(path, stacked)``: where an NNX ``module``'s ``Param``s lie in the
    loss's parameters, and whether they are one layer's slice of a stack;
    ``None`` if the module has none.

    Args:
      module: the block being called.
      where: ``id(input leaf) -> its key path``.
      inputs: ``key path -> input leaf`` (shapes and dtypes).
    """
    own = _params_of(module)
    if not own:
        return None
    if not any(id(leaf) in where for _, leaf in own):
        return _stack_path(module, own, inputs), True
    name, prefixes = type(module).__name__, {}
    for rel, leaf in own:
        outer = where.get(id(leaf))
        if outer is None or outer[len(outer) - len(rel):] != rel:
            raise ValueError(
                f"wrap: the parameters of a {name} are not the loss's params inputs; {_BUILT}"
            )
        prefixes.setdefault(outer[: len(outer) - len(rel)], []).append(outer)
    if len(prefixes) != 1:
        held = "; ".join(
            f"under {_show(prefix)}: {', '.join(_show(p) for p in sorted(paths, key=str))}"
            for prefix, paths in sorted(prefixes.items(), key=str)
        )
        raise ValueError(
            f"wrap: a {name}'s parameters lie in {len(prefixes)} sub-trees of params "
            f"({held}): it shares parameters with another module (NNX stores a shared "
            "variable once, at the first path reaching it), and a wrapped block must own "
            f"one sub-tree. Keep shared parameters out of it, or leave {name} out of wrap="
        )
    return next(iter(prefixes)), False


def _stack_path(module: Any, own: list, inputs: dict) -> tuple:
    """The one sub-tree of the inputs holding ``own`` (a block's sliced
    parameters) stacked: the same names, and each leaf's shape and dtype
    under one common leading layer axis."""

    def signature(pairs, lead):
        return {rel: (lead + tuple(x.shape), x.dtype) for rel, x in pairs}

    under: dict[tuple, list] = {}
    for path, leaf in inputs.items():
        for cut in range(len(path)):
            under.setdefault(path[:cut], []).append((path[cut:], leaf))
    matches = [
        prefix for prefix, pairs in under.items()
        if pairs[0][1].ndim and signature(pairs, ()) == signature(own, pairs[0][1].shape[:1])
    ]
    if len(matches) != 1:
        found = f"{len(matches)} sub-trees {matches}" if matches else "no sub-tree"
        raise ValueError(
            f"wrap: the parameters of a {type(module).__name__} are not the loss's params "
            f"inputs, and {found} of the inputs holds them stacked along a leading layer "
            f"axis (a block applied by nnx.scan); {_BUILT}"
        )
    return matches[0]


def discover(
    loss_fn: Callable, params: Any, example_batch: Any, classes: Sequence[type],
    extra_args: tuple = (),
) -> tuple[list[tuple], list[tuple]]:
    """The parameter paths of the outermost calls of NNX ``classes`` in ``loss_fn``.

    Args:
      loss_fn: ``loss_fn(params, batch, *extra_args)``, building its module
        with ``nnx.merge`` from ``params`` unchanged (as the loss of
        :func:`zeropp_jax.nnx_loss` does).
      params: the parameters (a nested dict, e.g. from ``nnx_loss``), or
        their shapes.
      example_batch: a batch (or its shapes) ``loss_fn`` accepts; nothing
        runs (``jax.eval_shape``).
      classes: ``flax.nnx.Module`` classes.
      extra_args: more arguments of ``loss_fn`` (a PRNG key).

    Returns:
      ``(paths, stacked)``: distinct key paths into ``params`` (tuples of
      dict keys: strings, and integers for ``nnx.List`` items), in call
      order; and those of blocks applied by ``nnx.scan`` (parameters with a
      leading layer axis: one stacked unit, gathered layer by layer).

    Raises:
      ValueError: if no instance of ``classes`` is called with parameters,
        or a block's parameters are not the loss's inputs, whole or stacked
        (see :func:`_block_path`).
    """
    found: list[tuple] = []
    stacked: list[tuple] = []

    def intercepting(p):
        inputs, where = leaf_paths(p, _keys)

        def record(call, module, args, kwargs):
            if depth():
                return call(module, *args, **kwargs)
            block = _block_path(module, where, inputs)
            if block is not None and block[0] not in found:
                found.append(block[0])
                if block[1]:
                    stacked.append(block[0])
            with inside_block():
                return call(module, *args, **kwargs)

        def record_method(method, module, args, kwargs):
            if not depth():
                called = (type(module).__name__, method.__name__)
                try:  # a path for the warning only
                    block = _block_path(module, where, inputs)
                except ValueError:  # not placeable: __call__ would have been refused
                    unplaced.setdefault(called)
                else:
                    if block is not None:
                        other.setdefault(block[0], called)
            return method(module, *args, **kwargs)

        with contextlib.ExitStack() as stack:  # a patch that fails undoes the others
            stack.enter_context(_nnx_calls(tuple(classes), record))
            for name, c in ((n, c) for c in classes for n in _public_methods(c)):
                stack.enter_context(_patched((c,), name, record_method))
            return stack.pop_all()

    other: dict[tuple, tuple[str, str]] = {}  # path -> (class, method) of other calls
    unplaced: dict[tuple[str, str], None] = {}  # (class, method) of those with no path
    trace_calls(loss_fn, params, example_batch, extra_args, intercepting, classes, found)
    applied = [(f"the {name} at {_show(path)}", method)
               for path, (name, method) in other.items() if path not in found]
    applied += [(f"a {name} (at a path not known)", method) for name, method in unplaced]
    for block, method in applied:
        warnings.warn(
            f"wrap: {block} is applied only by its method {method}, which the wrap policy "
            "does not wrap (only __call__): its parameters stay in the rest unit, gathered "
            "whole before the loss. Call the block itself to make it its own unit",
            stacklevel=2)
    return found, stacked


def _holder(unit: Unit) -> Any:
    """The block's parameter tree as the loss receives it, each leaf a
    :class:`_Held`: ``unit`` as the first, empty ``(..., 0)`` arrays (with a
    stacked unit's layer axis, so ``nnx.scan`` slices them) as the others."""
    layout = unit.layout
    lead = () if layout.stack is None else (layout.stack,)
    values = [unit] + [jnp.zeros(lead + (0,), s.dtype) for s in layout.leaves[1:]]
    paths = jax.tree_util.tree_flatten_with_path(
        jax.tree.unflatten(layout.treedef, layout.leaves))[0]
    names = [f"{layout.name}/{_show(_keys(p))}" for p, _ in paths]
    held = [_Held(x, name) for x, name in zip(values, names, strict=True)]
    return jax.tree.unflatten(layout.treedef, held)


def _unit_of(module: Any) -> Unit | None:
    """The :class:`Unit` an NNX block holds among its ``Param``s (see
    :func:`_holder`), one layer's under ``nnx.scan``; ``None`` if none."""
    held = [x.value for _, x in _params_of(module) if isinstance(x, _Held)]
    units = [x for x in held if isinstance(x, Unit)]
    if not units:
        return None
    unit = units[0]
    if unit.layout.stack is not None and unit.sink.ndim != 1:
        raise ValueError(
            f"wrap: a {type(module).__name__} at {unit.layout.name} holds "
            f"{unit.layout.stack} stacked layers and was called whole; apply it with "
            "nnx.scan over its leading layer axis (in_axes=0), which calls it once per layer"
        )
    return unit


def wrap_loss(loss_fn: Callable, classes: Sequence[type], paths: Sequence[tuple]) -> Callable:
    """``loss_fn`` with every call of the NNX blocks at ``paths`` applied to
    its gathered unit.

    Args:
      loss_fn: as for :func:`discover`.
      classes: the ``flax.nnx.Module`` classes.
      paths: the blocks' key paths in the parameters (from :func:`discover`).

    Returns:
      ``wrapped(params, batch, *rest)``. With plain parameters at ``paths``
      (outside a ZeRO step) it is ``loss_fn``; with a ``Unit`` at each path,
      each block is gathered when called and again in the backward (a
      stacked unit under ``nnx.scan``: one layer per iteration). The listed
      classes' ``__call__`` is swapped while it is traced, one thread at a
      time (a trace on another thread waits).

    Raises:
      ValueError: (when traced) if a block holding a stacked unit is called
        whole rather than by ``nnx.scan``, if a block creates state
        (``nnx.sow``), or if a wrapped block's parameters are read as arrays
        outside its ``__call__`` (:class:`_Held`).
    """
    from flax import nnx

    from zeropp_jax.nnx_model import check_state_writes, graph_nodes, state_leaves, streams_once

    classes, paths = tuple(classes), [tuple(p) for p in paths]

    def apply(call, module, unit, args, kwargs):
        graphdef, _, other = nnx.split(module, nnx.Param, ...)
        data, treedef, impls = state_as_data(other)
        # the random streams advance as without the trainer: the block's own
        # and those of NNX objects passed to it (an nnx.Rngs given to the call)
        holders = streams_once([module, *graph_nodes((args, kwargs))],
                               f"wrap: a {type(module).__name__} at {unit.layout.name}")
        stream_defs = [state_as_data(nnx.state(n, nnx.RngState))[1:] for n in holders]

        def run(params, data, *a, **kw):
            block = nnx.merge(graphdef, params, state_from_data(data, treedef, impls))
            copies = [block, *graph_nodes((a, kw))]  # the layer's copies of ``holders``
            before = [state_leaves(n) for n in copies]
            out = call(block, *a, **kw)
            name = type(module).__name__
            for n, b in zip(copies, before):
                check_state_writes(
                    n, b, who=f"wrap: a {name} at {unit.layout.name}"
                    + ("" if n is block else f" (its argument {type(n).__name__})"),
                    drops="state cannot leave a wrapped block, gathered for its call only",
                    fix=f"Return such a value from __call__ instead (e.g. an auxiliary loss), "
                        f"or leave {name} out of wrap=")
            return out, [state_as_data(nnx.state(n, nnx.RngState))[0] for n in copies]

        out, streams = as_layer(run, unit, args, kwargs, state=data)
        for n, s, (d, i) in zip(holders, streams, stream_defs, strict=True):
            nnx.update(n, state_from_data(s, d, i))
        return out

    def dispatch(call, module, args, kwargs):
        unit = None if depth() else _unit_of(module)
        if unit is None:
            return call(module, *args, **kwargs)
        return apply(call, module, unit, args, kwargs)

    def wrapped(params, batch, *rest):
        rest_params, subtrees = cut_paths(params, paths)
        if not any(isinstance(t, Unit) for t in subtrees):
            return loss_fn(params, batch, *rest)
        with _nnx_calls(classes, dispatch):
            holders = [_holder(unit) for unit in subtrees]
            return loss_fn(paste_paths(rest_params, paths, holders), batch, *rest)

    return wrapped

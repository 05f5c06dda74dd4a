"""Between pytrees shaped like the model's parameters and the trainer's flat unit shards.

A trainer holds every unit as one float32 vector ``([L,] U)`` split over the
devices (:class:`~zeropp_jax.step.state.TrainState`). These functions move a
tree in the model's own structure (its parameters, or an optimizer's moments
over them) in and out of that form:

- :func:`shard_init` runs an init function so that each device only ever
  holds its own shards plus a unit's worth of work (or a group of small units',
  256 MiB at most), never the whole model
  (what :meth:`zeropp_jax.Trainer.init_from` starts from);
- :func:`scatter_tree` cuts a full tree into unit shards (what
  :meth:`~zeropp_jax.Trainer.init` does with parameters);
- :func:`scatter_opt_state` does the same with an optimizer's state over
  the parameters (what ``init(params, opt_state=...)`` carries over from a
  loop of the user's own);
- :func:`gather_tree` puts unit shards back together on the host.
"""

from __future__ import annotations

import functools
import warnings
from typing import Any, Callable

import jax
import jax.extend
import jax.numpy as jnp
import numpy as np
from jax.sharding import AxisType, Mesh, NamedSharding
from jax.sharding import PartitionSpec as P

from zeropp_jax.layout import flatten_unit, join_units, split_units, unflatten_unit
from zeropp_jax.mesh import LOCAL, NODE, SHARD_AXES, replicated_on
from zeropp_jax.step.geometry import StepGeometry, padding_mask
from zeropp_jax.step.state import compiled_here
from zeropp_jax.step.traced import traced_once
from zeropp_jax.tree_paths import check_unit_trees, leaf_indices


def shard_init(geometry: StepGeometry, init_fn: Callable[..., Any], args: tuple, *,
               progress: bool = False) -> dict:
    """Master parameter shards of ``init_fn(*args)``, a few units at a time.

    Each group of units (:func:`init_groups`: a stacked unit alone, small
    ones together) is its own jitted program over ``init_fn`` (XLA drops the
    other units' work), compiled for a copy of the mesh whose axes are ``Auto``, so
    that XLA's partitioner splits the unit's random draws over the devices
    (JAX's default ``jax_threefry_partitionable`` draws the same values
    however they are split). Every leaf is drawn split along its first axis
    (a stacked unit's: its layers), so a device forms only ``ceil(L /
    devices)`` layers of a stacked unit at a time (``ceil(L / local)`` with
    ``node_replicated``; about two to three times that in work space, a few
    layers more under ``nn.scan``), and an unstacked unit (one block, the
    embeddings, or the whole model with ``per_layer=False``) is put together
    whole for a moment (one to two times its float32 size). A stack built by
    a Python loop and ``jnp.stack`` cannot be split so (each device forms
    all of it, several times over): it is warned of, from the program's
    compiled memory; draw stacks with ``jax.vmap`` over per-layer keys or
    ``nn.scan``. The values equal :func:`scatter_tree` of
    ``jax.jit(init_fn)(*args)`` bit for bit (an eager ``init_fn(*args)`` may
    differ in the last bit, where XLA fuses the draws' arithmetic otherwise;
    and one that reduces along a leaf's first axis, e.g. normalizes columns,
    sums the devices' partial results, equal to rounding).

    ``init_fn`` is traced once (:func:`traced_once`: its Python runs once,
    so a NumPy draw inside it gives every unit the same values), and each
    group's program replays the part of that trace its units need
    (:func:`~zeropp_jax.step.traced.traced_once`'s ``keep``) and is compiled
    (about a second each on a 2-core CPU); bind static arguments with
    ``functools.partial``.

    Args:
      geometry: the trainer's geometry (mesh, layout, config).
      init_fn: ``init_fn(*args) -> params``, the tree the trainer was built
        for (a pure function of its arguments, e.g. a Flax ``init`` from a key).
      args: its arguments (arrays, keys; anywhere: a committed one is
        replicated on the mesh first).
      progress: show a progress bar over the units (``tqdm``, on stderr).

    Returns:
      Unit name -> float32 ``([L,] U)`` (``(nodes, [L,] U)`` with
      ``node_replicated``), placed with ``geometry.param_shardings``.

    Raises:
      ValueError: if ``init_fn``'s tree does not fit the trainer's layout
        (checked from its shapes before anything runs).
    """
    from tqdm import tqdm

    compiled_here("trainer.init_from")
    auto = _auto_mesh(geometry.mesh)
    args = jax.tree.map(  # a committed argument elsewhere: replicated on the mesh, as init's
        lambda x: jax.device_put(x, NamedSharding(auto, P()))
        if isinstance(x, jax.Array) and x.committed else x, args)
    with jax.set_mesh(auto):  # whatever mesh the caller has set (an explicit one would
        replay, shapes = traced_once(init_fn, args)  # make the constraints asserts)
    check_unit_trees(shapes, geometry.layout)
    leaf_ids = leaf_indices(shapes, geometry.layout)  # each unit's leaves' places in the output
    flat = {}
    with tqdm(total=len(geometry.layout.units), desc="init_from", unit="unit",
              disable=not progress or len(geometry.layout.units) < 2) as bar:
        for group in init_groups(geometry.layout):
            keep = frozenset(i for u in group for i in leaf_ids[u.name])
            with jax.set_mesh(auto):  # the trace cut to the group's leaves' work
                compiled = init_program(geometry, functools.partial(replay, keep=keep),
                                        group).lower(*args).compile()
            if len(group) == 1:
                _warn_if_formed_whole(compiled, group[0])
            for name, x in compiled(*args).items():
                # The same buffers, labelled with the trainer's (explicit-axes) mesh.
                flat[name] = jax.make_array_from_single_device_arrays(
                    x.shape, geometry.param_shardings[name],
                    [shard.data for shard in x.addressable_shards])
            bar.update(len(group))
    return flat


def init_groups(layout: Any) -> list[tuple[Any, ...]]:
    """The units :func:`shard_init` draws together, one program a group.

    A stacked unit is drawn alone (split over the devices); consecutive
    unstacked units (blocks, embeddings: each formed whole for a moment) are
    drawn together while their float32 sizes sum to at most the largest
    unstacked unit's or ``_GROUP_BYTES``, whichever is more: a group forms
    no more at once than that unit alone does (a stacked unit, split over
    the devices, does not count), and a model of many small blocks compiles
    a few programs, not one a block.
    """
    budget = max([_GROUP_BYTES] + [4 * int(np.prod(u.global_shape))
                                   for u in layout.units if u.stack is None])
    groups, size = [], 0
    for unit in layout.units:
        n = 4 * int(np.prod(unit.global_shape))
        if unit.stack is None and groups and groups[-1][-1].stack is None and size + n <= budget:
            groups[-1] += (unit,)
            size += n
        else:
            groups.append((unit,))
            size = n
    return groups


# Unstacked units drawn by one init program may sum to this many float32 bytes
# (or the largest unstacked unit's, if more): small next to an accelerator's memory, and
# a program a group instead of one a block (each compile about a second).
_GROUP_BYTES = 2**28


def init_program(geometry: StepGeometry, init_fn: Callable[..., Any],
                 units: tuple[Any, ...]) -> Callable:
    """The jitted program of :func:`shard_init` for ``units`` (one group of
    :func:`init_groups`; ``.lower`` it to read its memory): ``(*args) ->
    {name: ([L,] U)}``, on an ``Auto`` copy of the mesh."""
    auto = _auto_mesh(geometry.mesh)
    # Each leaf drawn split along its first axis (a stacked unit's layers): with
    # node_replicated every node forms the whole unit, split over local only.
    first_axis = NamedSharding(auto, P(LOCAL if geometry.config.node_replicated else SHARD_AXES))

    def split(x):  # the whole model (per_layer=False) is formed whole anyway
        if np.ndim(x) == 0 or geometry.layout.whole_model:
            return x
        return jax.lax.with_sharding_constraint(x, first_axis)

    def program(*args):
        trees = split_units(init_fn(*args), geometry.layout)
        out = {}
        for unit in units:
            x = flatten_unit(jax.tree.map(split, trees[unit.name]), unit)
            if geometry.config.node_replicated:
                x = jnp.broadcast_to(x, (geometry.nodes,) + x.shape)
            out[unit.name] = x
        return out

    specs = geometry.param_specs()
    return jax.jit(program, out_shardings={u.name: NamedSharding(auto, specs[u.name]) for u in units})


def _auto_mesh(mesh: Mesh) -> Mesh:
    """``mesh``'s devices and axis names, every axis ``Auto`` (XLA places values)."""
    return Mesh(mesh.devices, mesh.axis_names, axis_types=(AxisType.Auto,) * len(mesh.axis_names))


# A stacked unit's init program whose work space passes this many times the
# whole unit forms it whole on every device, several times over (a stack built by
# a Python loop and jnp.stack; one drawn by jax.vmap over 8 layers stays near 0.3),
# for units of at least _WARN_FROM bytes (a tiny one's work space is mostly fixed).
_FORMED_WHOLE = 2.5
_WARN_FROM = 2**20


def _warn_if_formed_whole(compiled: Any, unit: Any) -> None:
    """Warns where a stacked unit's init program needs more work space per device
    than ``_FORMED_WHOLE`` times the whole unit (from its compiled memory)."""
    memory = compiled.memory_analysis()
    whole = 4 * int(np.prod(unit.global_shape))
    if (unit.stack is None or memory is None or whole < _WARN_FROM
            or memory.temp_size_in_bytes <= _FORMED_WHOLE * whole):
        return
    warnings.warn(
        f"init_from: the program that draws stacked unit {unit.name!r} needs "
        f"{memory.temp_size_in_bytes / 2**20:.1f} MiB of work space per device, "
        f"{memory.temp_size_in_bytes / whole:.1f}x the whole unit in float32: its layers are "
        "not drawn split over the devices, as they are when the stack is drawn by jax.vmap "
        "over per-layer keys (or nn.scan), not a Python loop and jnp.stack", stacklevel=4)


def scatter_tree(geometry: StepGeometry, tree: Any) -> dict:
    """A full tree in the parameters' structure, cut into master-parameter shards.

    Args:
      geometry: the trainer's geometry.
      tree: the parameters' structure and shapes (any float dtypes; host
        arrays or ``jax.Array``s anywhere: each is replicated on the mesh
        first, so it must fit on one device).

    Returns:
      Unit name -> float32 ``([L,] U)`` placed like the master parameters.

    Raises:
      ValueError: naming the leaf, if ``tree`` does not fit the layout.
    """
    check_unit_trees(tree, geometry.layout)
    with jax.set_mesh(geometry.mesh):  # a committed or sharded leaf: replicated first
        return jax.jit(lambda t: placed_units(geometry, t))(replicated_on(tree, geometry.mesh))


def scatter_opt_state(geometry: StepGeometry, tree: Any, params: Any, reference: Any) -> Any:
    """An optimizer's state over the model's parameters, in the trainer's form.

    Every sub-tree of ``tree`` shaped like ``params`` (Adam's ``mu``,
    ``nu``) is cut into unit shards (:func:`scatter_tree`: each is whole on
    every device for a moment, as the parameters are in ``init``); the
    other leaves (counters) are kept. Each leaf then takes its
    ``reference`` leaf's dtype and placement (a unit broadcast to one copy
    per node where the reference has one) and, in the padding between and
    after the leaves, the reference's values.

    Args:
      geometry: the trainer's geometry.
      tree: the state, in the structure of ``reference`` but with trees
        shaped like ``params`` where ``reference`` has unit dicts.
      params: the parameters (or their shapes), in the trainer's structure.
      reference: the trainer's own state of that part (placed arrays).

    Returns:
      ``tree`` in ``reference``'s structure, shapes, dtypes and shardings.

    Raises:
      ValueError: naming the first entry whose form differs from ``reference``'s.
    """
    over_params, treedef = shaped_like(params), jax.tree.structure(params)

    def like(x):  # the parameters' structure (a bare leaf would match every counter)
        return jax.tree.structure(x) == treedef and not jax.tree_util.treedef_is_leaf(treedef)

    for path, x in jax.tree_util.tree_flatten_with_path(tree, is_leaf=like)[0]:
        if like(x) and not over_params(x):
            (got, _), (want, _) = (jax.tree_util.tree_flatten_with_path(t) for t in (x, params))
            key, a, b = next((jax.tree_util.keystr(p), np.shape(a), np.shape(b))
                             for (p, a), (_, b) in zip(got, want) if np.shape(a) != np.shape(b))
            raise ValueError(
                f"optimizer state entry {jax.tree_util.keystr(path)}{key} has shape {a}, where "
                f"the parameter has {b}: only entries shaped like the parameters (Adam's mu, "
                "nu) are cut into shards; a state factored or with a history (Adafactor, "
                "L-BFGS) cannot be carried over: start it afresh (init(params, step=...))")

    def cut(x):  # a leaf already on the trainer's mesh (the reference's own) stays
        if over_params(x):
            return scatter_tree(geometry, x)
        on_mesh = getattr(getattr(x, "sharding", None), "mesh", None) == geometry.mesh
        return x if on_mesh else replicated_on(x, geometry.mesh)

    tree = jax.tree.map(cut, tree, is_leaf=over_params)
    if jax.tree.structure(tree) != jax.tree.structure(reference):
        names = {u.name for u in geometry.layout.units}

        def is_units(x):
            return (isinstance(x, dict) and set(x) == names
                    and all(isinstance(v, jax.Array) for v in x.values()))

        raise ValueError(
            f"the optimizer state has the form {outline(tree, is_units, 'units')} where the "
            f"trainer's optimizer has {outline(reference, is_units, 'units')} (units: a tree "
            "shaped like the parameters): pass the state of the trainer's own optimizer "
            "over these parameters")
    (got, _), (want, _) = jax.tree.flatten_with_path(tree), jax.tree.flatten_with_path(reference)
    for (path, x), (_, ref) in zip(got, want):
        per_node = ref.ndim and ref.sharding.spec and ref.sharding.spec[0] == NODE
        if np.shape(x) != ref.shape and not (per_node and np.shape(x) == ref.shape[1:]):
            raise ValueError(f"optimizer state entry {jax.tree_util.keystr(path)} has shape "
                             f"{np.shape(x)}; the trainer's optimizer over these parameters "
                             f"has {ref.shape}")
    units = {u.name: u for u in geometry.layout.units}

    def fit(path, x, ref):
        spec = jax.typeof(ref).sharding.spec
        x = jnp.broadcast_to(jnp.asarray(x).astype(ref.dtype), ref.shape)  # per node
        x = jax.sharding.reshard(x, spec)
        name = getattr(path[-1], "key", None) if path else None
        unit = units.get(name) if isinstance(name, str) else None
        if unit is not None and ref.ndim and ref.shape[-1] == unit.padded:
            real = padding_mask(unit, jnp.zeros((), jnp.int32), unit.padded)
            x = jnp.where(jax.sharding.reshard(jnp.broadcast_to(real, ref.shape), spec), x, ref)
        return x

    with jax.set_mesh(geometry.mesh):
        return jax.jit(lambda t, r: jax.tree_util.tree_map_with_path(fit, t, r))(tree, reference)


def shaped_like(params: Any) -> Callable[[Any], bool]:
    """A test of whether a (sub-)tree has ``params``' structure and leaf shapes."""
    treedef = jax.tree.structure(params)
    shapes = [np.shape(x) for x in jax.tree.leaves(params)]
    return lambda x: (jax.tree.structure(x) == treedef
                      and [np.shape(v) for v in jax.tree.leaves(x)] == shapes)


class _Named(str):
    def __repr__(self):
        return str(self)


def outline(tree: Any, is_part: Callable[[Any], bool], name: str) -> str:
    """``tree`` written out for an error: each sub-tree ``is_part`` accepts
    as ``name``, every other leaf as its shape (optax's states by their names)."""
    return repr(jax.tree.map(lambda x: _Named(name if is_part(x) else str(np.shape(x))),
                             tree, is_leaf=is_part))


def unsharded(shapes: Any) -> Any:
    """``shapes`` (anything with ``.shape`` and ``.dtype``) as ``jax.ShapeDtypeStruct``s
    without shardings (those a caller's mesh gave would pin them to that mesh)."""
    return jax.tree.map(lambda s: jax.ShapeDtypeStruct(s.shape, s.dtype), shapes)


def placed_units(geometry: StepGeometry, tree: Any) -> dict:
    """``tree`` (the parameters' structure) as master-parameter units, under
    ``jit`` on the trainer's mesh: each unit flattened, then placed
    (:meth:`~zeropp_jax.step.geometry.StepGeometry.place_params`); ``ValueError``
    if ``tree`` does not fit the layout (:func:`check_unit_trees`)."""
    check_unit_trees(tree, geometry.layout)
    trees = split_units(tree, geometry.layout)
    return geometry.place_params(
        {u.name: flatten_unit(trees[u.name], u) for u in geometry.layout.units})


def gather_tree(geometry: StepGeometry, flat: dict, dtype: Any = "original") -> Any:
    """Unit shards put back together as one host (numpy) tree in the parameters' structure.

    A collective: on several processes, every one calls it, and every one
    gets the whole tree. One unit at a time is whole on each device (with
    ``node_replicated``, one node's copy), then copied to the host.

    Args:
      geometry: the trainer's geometry.
      flat: unit name -> ``([L,] U)`` (``(nodes, [L,] U)`` with
        ``node_replicated``), placed like the master parameters: the state's
        ``params``, or an optimizer state's entry over them (Adam's ``mu``).
      dtype: ``"original"`` gives each leaf its parameter's dtype; ``None``
        keeps ``flat``'s (float32: a bf16 model's Adam ``nu`` unrounded);
        a dtype casts every leaf to it.

    Returns:
      The tree, unpadded, in the structure the trainer was built for.

    Raises:
      ValueError: if ``flat`` is not placed like the master parameters, or
        ``dtype`` is none of those.
    """
    compiled_here("trainer.gather_params")
    if dtype is not None and not (isinstance(dtype, str) and dtype == "original"):
        try:
            dtype = jnp.dtype(dtype)
        except TypeError:
            raise ValueError(f"dtype must be 'original', None (float32 as held) or a dtype "
                             f"every leaf is cast to; got {dtype!r}") from None
    lead = (geometry.nodes,) if geometry.config.node_replicated else ()
    want = {u.name: lead + u.global_shape for u in geometry.layout.units}
    got = {k: np.shape(v) for k, v in flat.items()} if isinstance(flat, dict) else flat
    if got != want:
        raise ValueError("expected the units' arrays placed like the master parameters "
                         "(state.params, or an optimizer state's entry over them), shaped "
                         f"{want}; got {got if isinstance(got, dict) else type(got).__name__}")
    whole = _whole_program(geometry.sharding(P()), geometry.config.node_replicated)
    trees = {}
    with jax.set_mesh(geometry.mesh):
        for u in geometry.layout.units:
            host = np.asarray(whole(flat[u.name]).addressable_data(0))
            trees[u.name] = unflatten_unit(host, u, dtype)
    return join_units(trees, geometry.layout)


@functools.lru_cache(maxsize=None)  # one program per mesh and form: no compile per call
def _whole_program(replicated: NamedSharding, node_rows: bool) -> Callable:
    """A unit whole on every device (``replicated``): node 0's row where
    ``node_rows`` (``node_replicated``: every node's is the same)."""
    if node_rows:
        return jax.jit(jax.sharding.auto_axes(lambda x: x[0], out_sharding=P()))
    return jax.jit(lambda x: x, out_shardings=replicated)

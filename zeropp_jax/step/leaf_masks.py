"""Per-leaf masks and labels for an optimizer that the trainer runs on flat units.

The trainer runs an optax optimizer on a dict of flat float32 units (a
block's leaves concatenated, :mod:`zeropp_jax.layout`), so optax's own
``masked``, ``multi_transform`` and ``adamw(mask=...)`` would see units, not
the model's leaves (``make_trainer`` refuses them). The drop-ins here decide
per leaf, from the model's tree, and apply the choice element by element:

- in a loop of the user's own they give optax's results, leaf by leaf (the
  inner transform sees zeros where it is not chosen);
- in the trainer, the optimizer's update is traced inside
  :func:`units_in_view` (a :class:`UnitLeaves`: where each leaf lies in the
  units), so under any wrapper (``optax.chain``, ``MultiSteps``,
  ``inject_hyperparams``, ...) a leaf's choice becomes a bool mask over the
  elements of its unit. The view is read while ``update`` is traced, so it
  is a constant of the compiled step.

A mask or labels function is called on the parameters' shapes
(``jax.ShapeDtypeStruct``\\ s in the model's structure): it may read paths,
ranks, shapes and dtypes, not values. Unlike ``optax.masked``, the inner
transform's state covers every parameter (zeros where it is not chosen):
free for weight decay, one more copy of Adam's moments for each further
stateful transform of ``multi_transform``.
"""

from __future__ import annotations

import contextlib
import contextvars
import dataclasses
from typing import Any, Callable, Hashable, Iterator, Mapping

import jax
import jax.numpy as jnp
import optax

from zeropp_jax.layout import ParamLayout
from zeropp_jax.tree_paths import join_units, split_units


class _Scoped:
    """``jax.make_user_context``'s interface over a ``ContextVar``, for a JAX
    without it (where a jitted function traced in one view may be reused in
    another: a wrapper that jits an inner update of its own)."""

    def __init__(self, default: Any) -> None:
        self._var = contextvars.ContextVar("zeropp_units", default=default)

    @property
    def value(self) -> Any:
        return self._var.get()

    @contextlib.contextmanager
    def __call__(self, value: Any) -> Iterator[None]:
        token = self._var.set(value)
        try:
            yield
        finally:
            self._var.reset(token)


# The units' view while the trainer traces its optimizer's update (None elsewhere),
# part of the keys of JAX's trace and compile caches: a trace made in one view is
# not reused in another (equal views, equal layouts, share them).
_UNITS = (jax.make_user_context(None) if hasattr(jax, "make_user_context")
          else _Scoped(None))


@dataclasses.dataclass(frozen=True, eq=False)
class UnitLeaves:
    """Where the model's leaves lie in the trainer's units (what
    :func:`units_in_view` shows the per-leaf transforms).

    Attributes:
      tree: the model's parameters as ``jax.ShapeDtypeStruct`` (each leaf's
        full shape, a stacked unit's layers first): what a mask or labels
        function is called on.
      layout: the trainer's units (each leaf's offset and size in its unit).
    """

    tree: Any
    layout: ParamLayout

    def __eq__(self, other: Any) -> bool:  # a key of JAX's caches: the tree follows the layout
        return isinstance(other, UnitLeaves) and other.layout == self.layout

    def __hash__(self) -> int:
        return hash(self.layout)

    @classmethod
    def of(cls, layout: ParamLayout) -> "UnitLeaves":
        """The view of ``layout``, its tree rebuilt from the leaves' specs."""
        trees = {u.name: jax.tree.unflatten(u.treedef, [
            jax.ShapeDtypeStruct(((u.stack,) if u.stack else ()) + s.shape, s.dtype)
            for s in u.leaves]) for u in layout.units}
        return cls(join_units(trees, layout), layout)

    def per_element(self, flags: Any) -> dict[str, jax.Array]:
        """bool ``(U,)`` per unit name (``U``: the unit's padded length, to
        broadcast over a stack's layers): ``True`` on the elements of the
        leaves whose flag is ``True``. ``flags``: Python bools in
        ``tree``'s structure. Global values (under ``jit``, any mesh)."""
        chosen = split_units(flags, self.layout)
        out = {}
        for unit in self.layout.units:
            where = jax.lax.iota(jnp.int32, unit.padded)
            mask = jnp.zeros((unit.padded,), bool)
            for spec, flag in zip(unit.leaves, jax.tree.leaves(chosen[unit.name])):
                if flag:
                    mask |= (where >= spec.offset) & (where < spec.offset + spec.size)
            out[unit.name] = mask
        return out


@contextlib.contextmanager
def units_in_view(units: UnitLeaves) -> Iterator[None]:
    """While the trainer traces its optimizer's ``update`` on ``units``' flat
    dict: :func:`masked`, :func:`multi_transform` and :func:`adamw` apply
    their per-leaf choices to each unit's elements."""
    with _UNITS(units):
        yield


def masked(inner: optax.GradientTransformation, mask: Any) -> optax.GradientTransformationExtraArgs:
    """``optax.masked`` that also holds inside the trainer (per leaf, not per unit).

    Args:
      inner: the transform for the chosen leaves (e.g.
        ``optax.add_decayed_weights(1e-2)``); it sees zeros in the others.
      mask: a pytree of bools in the parameters' structure (or a prefix of
        it), or a function of the parameters' shapes returning one, e.g.
        ``lambda p: jax.tree.map(lambda x: x.ndim >= 2, p)``.

    Returns:
      A transform whose update is ``inner``'s on the chosen leaves and the
      incoming update elsewhere. State: ``optax.MaskedState(inner_state)``,
      ``inner``'s state over all the parameters.
    """
    inner = optax.with_extra_args_support(inner)

    def init(params):
        return optax.MaskedState(inner_state=inner.init(params))

    def update(updates, state, params=None, **extra_args):
        flags_of = lambda tree: _flags(mask, tree, "mask")  # noqa: E731
        new, inner_state = _update_chosen(inner, flags_of, updates, state.inner_state,
                                          params, extra_args)
        return new, optax.MaskedState(inner_state=inner_state)

    return optax.GradientTransformationExtraArgs(init, update)


def multi_transform(transforms: Mapping[Hashable, optax.GradientTransformation],
                    param_labels: Any) -> optax.GradientTransformationExtraArgs:
    """``optax.multi_transform`` that also holds inside the trainer.

    Args:
      transforms: label -> transform.
      param_labels: a pytree of labels in the parameters' structure (or a
        prefix of it), or a function of the parameters' shapes returning one.

    Returns:
      A transform applying each label's transform to its leaves. State:
      ``optax.MultiTransformState`` of ``optax.MaskedState``\\ s, each
      transform's over all the parameters.

    Raises:
      ValueError: at the first update, for a label with no transform.
    """
    inners = {label: optax.with_extra_args_support(t) for label, t in transforms.items()}

    def init(params):
        return optax.MultiTransformState(
            {label: optax.MaskedState(inner_state=t.init(params)) for label, t in inners.items()})

    def update(updates, state, params=None, **extra_args):
        labels_of = _labels_checker(param_labels, inners)
        new_states = {}
        for label, t in inners.items():
            flags_of = lambda tree, label=label: jax.tree.map(  # noqa: E731
                lambda x: x == label, labels_of(tree))
            updates, new_states[label] = _update_chosen(
                t, flags_of, updates, state.inner_states[label].inner_state, params, extra_args)
            new_states[label] = optax.MaskedState(inner_state=new_states[label])
        return updates, optax.MultiTransformState(new_states)

    return optax.GradientTransformationExtraArgs(init, update)


def adamw(learning_rate: Any, b1: float = 0.9, b2: float = 0.999, eps: float = 1e-8,
          eps_root: float = 0.0, mu_dtype: Any = None, weight_decay: Any = 1e-4,
          mask: Any = None, *, nesterov: bool = False) -> optax.GradientTransformationExtraArgs:
    """``optax.adamw`` (same arguments, same results, same state) whose
    ``mask`` also holds inside the trainer: weight decay off for biases and
    norms, as Hugging Face's examples set it, e.g.
    ``mask=lambda p: jax.tree.map(lambda x: x.ndim >= 2, p)``."""
    decay = optax.add_decayed_weights(weight_decay)
    return optax.chain(
        optax.scale_by_adam(b1=b1, b2=b2, eps=eps, eps_root=eps_root, mu_dtype=mu_dtype,
                            nesterov=nesterov),
        decay if mask is None else masked(decay, mask),
        optax.scale_by_learning_rate(learning_rate),
    )


def _update_chosen(inner: optax.GradientTransformationExtraArgs, flags_of: Callable,
                   updates: Any, inner_state: Any, params: Any, extra_args: dict):
    """``inner``'s update on the chosen leaves (elements, in the trainer), the
    incoming ``updates`` elsewhere; ``inner`` sees zeros where not chosen."""
    units = _UNITS.value
    if units is None:  # the model's own tree: a static choice per leaf
        flags = flags_of(_shapes(updates))
        keep = lambda f, x: x if f else jnp.zeros_like(x)  # noqa: E731
        pick = lambda f, new, old: new if f else old  # noqa: E731
    else:  # the trainer's units: a mask over each unit's elements
        flags = per_unit = units.per_element(flags_of(units.tree))
        if not isinstance(updates, Mapping) or set(updates) != set(per_unit):
            raise ValueError(
                f"a per-leaf mask in the trainer expects the units' dict ({sorted(per_unit)}) "
                f"as updates, got {jax.tree.structure(updates)}: a transform in front of it "
                "changed the updates' structure")
        hole = lambda x: isinstance(x, optax.MaskedNode)  # noqa: E731 (an optax mask's gap)
        keep = lambda m, x: x if hole(x) else jnp.where(m, x, jnp.zeros((), x.dtype))  # noqa: E731
        pick = lambda m, new, old: old if hole(old) else jnp.where(m, new, old)  # noqa: E731
    chosen = jax.tree.map(keep, flags, updates)
    chosen_params = None if params is None else jax.tree.map(keep, flags, params)
    new, inner_state = inner.update(chosen, inner_state, chosen_params, **extra_args)
    return jax.tree.map(pick, flags, new, updates), inner_state


def _shapes(tree: Any) -> Any:
    return jax.tree.map(lambda x: jax.ShapeDtypeStruct(jnp.shape(x), jnp.result_type(x)), tree)


def _flags(mask: Any, tree: Any, what: str) -> Any:
    """``mask`` (a tree or a function of ``tree``) as a Python bool per leaf of ``tree``."""
    return jax.tree.map(lambda value: _concrete(value, bool, what),
                        _broadcast(_called(mask, tree, what), tree, what))


def _labels_checker(param_labels: Any, inners: Mapping) -> Callable:
    """``tree -> labels per leaf``, refusing a label with no transform."""
    def labels_of(tree):
        given = _called(param_labels, tree, "param_labels")
        labels = jax.tree.map(lambda value: _concrete(value, None, "param_labels"),
                              _broadcast(given, tree, "param_labels"))
        missing = sorted({repr(x) for x in jax.tree.leaves(labels)} - {repr(k) for k in inners})
        if missing:
            raise ValueError(f"multi_transform: labels {', '.join(missing)} have no transform "
                             f"(transforms: {sorted(map(repr, inners))})")
        return labels

    return labels_of


def _called(given: Any, tree: Any, what: str) -> Any:
    """``given(tree)`` for a function (``tree``: ``jax.ShapeDtypeStruct``\\ s), else ``given``."""
    if not callable(given):
        return given
    try:
        return given(tree)
    except (TypeError, AttributeError) as e:
        raise ValueError(
            f"the {what} function failed on the parameters' shapes ({type(e).__name__}: {e}): "
            f"it must be decided from the parameters' paths, shapes and dtypes (it is called "
            "on jax.ShapeDtypeStructs), not from their values") from e


def _broadcast(prefix: Any, tree: Any, what: str) -> Any:
    """``prefix``'s leaves copied over ``tree``'s sub-trees (a prefix mask)."""
    try:
        return jax.tree.map(lambda value, sub: jax.tree.map(lambda _: value, sub), prefix, tree)
    except (ValueError, TypeError) as e:
        raise ValueError(f"the {what} does not fit the parameters' structure "
                         f"({jax.tree.structure(tree)}): {e}") from e


def _concrete(value: Any, kind: type | None, what: str) -> Any:
    """A mask's (``kind=bool``) or labels' leaf as a host value."""
    try:
        host = value.item() if hasattr(value, "item") else value
    except (jax.errors.ConcretizationTypeError, jax.errors.TracerArrayConversionError) as e:
        raise ValueError(
            f"the {what} must be decided from the parameters' paths, shapes and dtypes "
            "(it is called on jax.ShapeDtypeStructs), not from their values") from e
    if kind is bool and not isinstance(host, bool):
        raise ValueError(f"the {what} must give a bool per leaf, got {value!r}")
    return host

"""Variables a Flax Linen model writes inside the loss, which the step drops.

The trainer carries parameters only (and the optimizer's state): what a
loss's ``model.apply(..., mutable=[...])`` writes (``BatchNorm``'s running
``batch_stats``, a decoding ``cache``) is returned to the loss, which can
return only scalars beside its loss, so it never leaves the step and the
next step reads the variables as they were. :func:`warn_of_writes` says so
once, when the step is traced; the NNX counterpart refuses such a module in
:func:`zeropp_jax.nnx_model.nnx_loss`. ``"intermediates"`` (``sow``) is not
named: the loss takes those out itself (e.g. an auxiliary loss).
"""

from __future__ import annotations

import contextlib
import warnings
from typing import Any, Iterator

# Collections a loss commonly takes out of a mutable apply itself.
_TAKEN_OUT = ("intermediates",)


@contextlib.contextmanager
def warn_of_writes() -> Iterator[None]:
    """Within the block, records each outermost Linen module call (the model
    an ``apply`` runs; lifted transforms such as ``nn.scan`` run their body
    with every collection mutable, inside it) with mutable collections other
    than ``"intermediates"``; after it, warns naming the modules and
    collections (once per traced step)."""
    import flax.linen as nn

    written: dict[str, str] = {}  # module class -> the collections it may write
    depth = [0]  # module calls in progress

    def watch(next_fun, args, kwargs, context):
        scope = context.module.scope
        if depth[0] == 0 and scope is not None and context.method_name != "setup":
            names = _written(scope.mutable)
            if names:
                written.setdefault(type(context.module).__name__, names)
        depth[0] += 1
        try:
            return next_fun(*args, **kwargs)
        finally:
            depth[0] -= 1

    with nn.intercept_methods(watch):
        yield
    if written:
        applied = "; ".join(f"{cls}: {names}" for cls, names in written.items())
        warnings.warn(
            f"the loss applies a Linen model with mutable collections ({applied}): what it "
            "writes cannot leave the train step, which carries only the parameters, so the "
            "next step reads those variables as they were (BatchNorm's running averages never "
            "move). Normalize with use_running_average=True (train=False), or keep such "
            "state out of the model", stacklevel=2)


def _written(mutable: Any) -> str:
    """The collections a scope's ``mutable`` lets it write, less those a loss
    takes out itself (``""``: none)."""
    if mutable is True:
        return "every collection"
    if not mutable:
        return ""
    names = [mutable] if isinstance(mutable, str) else mutable
    if not isinstance(names, (list, tuple)):  # a filter object (flax's DenyList)
        return str(names)
    return ", ".join(str(n) for n in names if n not in _TAKEN_OUT)

"""Variables a Flax Linen model writes inside the loss, which the step drops.

The trainer carries parameters only (and the optimizer's state): what a
loss's ``model.apply(variables, ..., mutable=[...])`` writes into a
collection it was given (``BatchNorm``'s running ``batch_stats``, a decoding
``cache``) is returned to the loss, which can return only scalars beside its
loss, so it never leaves the step and the next step reads those variables as
they were. :func:`warn_of_writes` says so once, when the step is traced; the
NNX counterpart refuses such a module in :func:`zeropp_jax.nnx_model.nnx_loss`.
A collection the apply creates (values recorded with ``sow``, an auxiliary
loss the loss takes out itself) is not named, nor is ``params``.
"""

from __future__ import annotations

import contextlib
import warnings
from typing import Iterator


@contextlib.contextmanager
def warn_of_writes() -> Iterator[None]:
    """Within the block, records each outermost Linen module call (the model
    an ``apply`` runs; lifted transforms such as ``nn.scan`` run their body
    with every collection mutable, inside it) that may write a collection it
    was given, other than ``params``; after it, warns naming the modules and
    collections (once per traced step)."""
    import flax.linen as nn

    written: dict[str, str] = {}  # module class -> the collections it may write
    depth = [0]  # module calls in progress

    def watch(next_fun, args, kwargs, context):
        scope = context.module.scope
        if depth[0] == 0 and scope is not None and context.method_name != "setup":
            given = [c for c in context.module.variables if c != "params"]
            names = [c for c in given if scope.is_mutable_collection(c)]
            if names:
                written.setdefault(type(context.module).__name__, ", ".join(names))
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

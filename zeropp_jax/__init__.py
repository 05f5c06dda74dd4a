"""zeropp_jax: ZeRO-3 and ZeRO++ (qwZ, hpZ, qgZ) data-parallel training in JAX.

Public API (everything else is an implementation module)::

  mesh = zeropp_jax.make_mesh(2, 4)                    # (node, local)
  config = zeropp_jax.ZeroConfig.from_preset("hpz")    # or zero3 / qwz
  trainer = zeropp_jax.make_trainer(loss_fn, optax.adam(1e-3), params,
                                    mesh=mesh, config=config,
                                    per_layer=True, stacked=("blocks",))
  state = trainer.init(params)
  state, metrics = trainer.step(state, batch)
  params = trainer.gather_params(state)

The 1-bit presets ``qgz`` and ``zeropp`` run 1-bit Adam (qgZ's error
feedback on Adam's momentum), so the trainer runs the optimizer::

  config = zeropp_jax.ZeroConfig.from_preset("zeropp")
  trainer = zeropp_jax.make_trainer(loss_fn, zeropp_jax.onebit_adam(1e-3, clip_norm=1.0),
                                    params, mesh=mesh, config=config, ...)

``from_preset("zeropp", qgz_target="gradient")`` compresses gradients
instead, in front of any optax optimizer.
"""

from zeropp_jax.config import PRESETS as PRESETS
from zeropp_jax.config import ZeroConfig as ZeroConfig
from zeropp_jax.step.gather import Unit as Unit
from zeropp_jax.step.gather import gather as gather
from zeropp_jax.step.gather import layer as layer
from zeropp_jax.step.prefetch import scan_layers as scan_layers
from zeropp_jax.mesh import make_mesh as make_mesh
from zeropp_jax.step.adam import OneBitAdam as OneBitAdam
from zeropp_jax.step.adam import onebit_adam as onebit_adam
from zeropp_jax.step.leaf_masks import adamw as adamw
from zeropp_jax.step.leaf_masks import masked as masked
from zeropp_jax.step.leaf_masks import multi_transform as multi_transform
from zeropp_jax.mesh import parse_mesh_shape as parse_mesh_shape
from zeropp_jax.nnx_model import nnx_loss as nnx_loss
from zeropp_jax.wire.quantization import Quantized as Quantized
from zeropp_jax.step.state import TrainState as TrainState
from zeropp_jax.step.state import ZeroOptState as ZeroOptState
from zeropp_jax.step.trainer import Trainer as Trainer
from zeropp_jax.step.trainer import make_trainer as make_trainer

__version__ = "0.1.0"

"""Models trained by zeropp_jax."""

from zeropp_jax.models.gpt import Block as Block
from zeropp_jax.models.gpt import GPTConfig as GPTConfig
from zeropp_jax.models.gpt import count_params as count_params
from zeropp_jax.models.gpt import flops_per_token as flops_per_token
from zeropp_jax.models.gpt import init_params as init_params
from zeropp_jax.models.gpt import layer_norm as layer_norm
from zeropp_jax.models.gpt import logits_fn as logits_fn
from zeropp_jax.models.gpt import loss_fn as loss_fn

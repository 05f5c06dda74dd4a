"""A small GPT-style decoder (Flax Linen) with ZeRO-3 gathering hooks.

Architecture: learned token and position embeddings, ``n_layers`` pre-LN
blocks (``x + Attn(LN(x))``, then ``x + MLP(LN(x))``; causal multi-head
self-attention and a GELU MLP, all with biases), a final LayerNorm and an
output head tied to the token embedding.

Parameters are stored as a plain pytree with three top-level subtrees,
``embed``, ``blocks`` (every leaf stacked along a leading ``n_layers`` axis)
and ``ln_f``. The forward pass never touches a stored subtree except through
the ``gather`` hook, and gathers the blocks one layer at a time inside a
``jax.lax.scan`` (:func:`zeropp_jax.scan_layers`). A ZeRO-3 trainer can thus
store each subtree sharded (or as an opaque pytree node) and all-gather only
the layer being computed; the ``layer`` hook lets it wrap each per-layer
function, e.g. in ``jax.checkpoint``, so gathered weights are not kept alive
for the backward pass. Inside a ZeRO step with prefetch on, ``scan_layers``
runs the blocks itself, gathering the next block while the current one
computes (rematerialized like ``zeropp_jax.layer``).

Dtypes: compute follows the parameters' dtype (float32 or bfloat16). LayerNorm
statistics, attention softmax, logits and the loss are float32.
"""

from __future__ import annotations

import dataclasses
import functools
import math
from typing import Any, Callable

import flax.linen as nn
import jax
import jax.numpy as jnp

from zeropp_jax.step.prefetch import scan_layers

PyTree = Any

_LN_EPS = 1e-5
_EMBED_INIT_STD = 0.02


def _identity(x):
    return x


ATTENTION_IMPLEMENTATIONS = ("auto", "cudnn", "xla")


@dataclasses.dataclass(frozen=True)
class GPTConfig:
    """Model shape.

    Attributes:
      vocab_size: number of token ids ``V``.
      seq_len: maximum sequence length ``S`` (size of the position table).
      n_layers: number of transformer blocks ``L``.
      d_model: residual width ``d``; must be divisible by ``n_heads``.
      n_heads: attention heads ``H``.
      mlp_ratio: MLP hidden width is ``mlp_ratio * d_model``.
      attention: ``jax.nn.dot_product_attention``'s implementation for
        16-bit compute: ``"auto"`` (cuDNN's fused kernel where the default
        backend is a GPU, XLA's elsewhere), ``"cudnn"`` (on any backend: to
        compile for a GPU from a machine without one; the head dimension must
        suit cuDNN) or ``"xla"``. Float32 attention is always XLA's
        (:func:`attention_implementation`).
    """

    vocab_size: int = 256
    seq_len: int = 128
    n_layers: int = 4
    d_model: int = 128
    n_heads: int = 4
    mlp_ratio: int = 4
    attention: str = "auto"

    def __post_init__(self):
        if self.attention not in ATTENTION_IMPLEMENTATIONS:
            raise ValueError(
                f"GPTConfig.attention must be one of {ATTENTION_IMPLEMENTATIONS}, got "
                f"{self.attention!r}."
            )
        for field in dataclasses.fields(self):
            if field.name == "attention":
                continue
            value = getattr(self, field.name)
            if isinstance(value, bool) or not isinstance(value, int) or value <= 0:
                raise ValueError(
                    f"GPTConfig.{field.name} must be a positive int, got {value!r}."
                )
        if self.d_model % self.n_heads:
            raise ValueError(
                f"GPTConfig.d_model={self.d_model} must be divisible by n_heads={self.n_heads}; "
                f"e.g. use d_model={self.n_heads * max(1, self.d_model // self.n_heads)}."
            )
        if self.attention == "cudnn":  # raises for a head dimension cuDNN does not take
            attention_implementation(jnp.bfloat16, self.head_dim, "cudnn")

    @property
    def head_dim(self) -> int:
        return self.d_model // self.n_heads


def layer_norm(x: jax.Array, scale: jax.Array, bias: jax.Array) -> jax.Array:
    """LayerNorm over the last axis with float32 statistics.

    Args:
      x: ``(..., d)`` float array of any float dtype.
      scale: ``(d,)``.
      bias: ``(d,)``.

    Returns:
      ``(..., d)`` array in ``x.dtype``.
    """
    xf = x.astype(jnp.float32)
    mean = jnp.mean(xf, axis=-1, keepdims=True)
    var = jnp.mean(jnp.square(xf - mean), axis=-1, keepdims=True)
    y = (xf - mean) * jax.lax.rsqrt(var + _LN_EPS)
    bshape = (1,) * (x.ndim - 1) + (-1,)
    y = y * scale.astype(jnp.float32).reshape(bshape) + bias.astype(jnp.float32).reshape(bshape)
    return y.astype(x.dtype)


class LayerNorm(nn.Module):
    """LayerNorm with float32 statistics; output in the input's dtype."""

    @nn.compact
    def __call__(self, x: jax.Array) -> jax.Array:
        d = x.shape[-1]
        scale = self.param("scale", nn.initializers.ones, (d,), jnp.float32)
        bias = self.param("bias", nn.initializers.zeros, (d,), jnp.float32)
        return layer_norm(x, scale, bias)


# cuDNN's fused attention takes 16-bit inputs and head dims that are
# multiples of 8 up to 128 (jax.nn.dot_product_attention's cudnn checks).
_CUDNN_DTYPES = (jnp.dtype(jnp.bfloat16), jnp.dtype(jnp.float16))
_CUDNN_MAX_HEAD_DIM = 128
_CUDNN_MIN_COMPUTE_CAPABILITY = 8  # cuDNN's fused attention: Ampere (8.0) and newer


def _default_gpu_runs_cudnn_attention() -> bool:
    """Whether the default backend is a GPU of CUDA compute capability 8.0 or
    newer (not a V100's 7.0, nor a GPU without one, e.g. ROCm's)."""
    if jax.default_backend() != "gpu":
        return False
    capability = getattr(jax.devices()[0], "compute_capability", None)
    try:
        return int(str(capability).split(".")[0]) >= _CUDNN_MIN_COMPUTE_CAPABILITY
    except ValueError:
        return False


def attention_implementation(dtype, head_dim: int, choice: str = "auto") -> str | None:
    """The ``implementation`` passed to ``jax.nn.dot_product_attention``.

    ``"cudnn"`` (a fused flash-attention kernel) for 16-bit compute when
    ``choice`` is ``"cudnn"``, or ``"auto"`` on a default backend of NVIDIA
    GPUs of compute capability 8.0 or newer, and cuDNN takes the head
    dimension (a multiple of 8 up to 128). Otherwise
    ``None``: JAX's XLA implementation (two einsums and a float32 softmax),
    which every backend runs; so float32 attention (the parameters' init, a
    float32 run) is XLA's under every choice. Both compute the softmax in
    float32.

    Raises:
      ValueError: ``choice="cudnn"`` with a head dimension cuDNN does not take.
    """
    head_fits = head_dim % 8 == 0 and head_dim <= _CUDNN_MAX_HEAD_DIM
    if choice == "cudnn" and not head_fits:
        raise ValueError(
            f"attention='cudnn' needs a head dimension that is a multiple of 8 up to "
            f"{_CUDNN_MAX_HEAD_DIM}, got {head_dim}; use attention='auto' or 'xla'."
        )
    wanted = choice == "cudnn" or (choice == "auto" and _default_gpu_runs_cudnn_attention())
    if wanted and head_fits and jnp.dtype(dtype) in _CUDNN_DTYPES:
        return "cudnn"
    return None


class CausalSelfAttention(nn.Module):
    """Causal multi-head self-attention (``jax.nn.dot_product_attention``).

    Fused cuDNN attention on a GPU where it applies, JAX's XLA attention
    elsewhere, or as ``attention`` says (:func:`attention_implementation`);
    softmax in float32.
    """

    n_heads: int
    out_init_std: float
    attention: str = "auto"

    @nn.compact
    def __call__(self, x: jax.Array) -> jax.Array:
        b, s, d = x.shape
        hd = d // self.n_heads
        qkv = nn.Dense(
            3 * d, dtype=x.dtype, kernel_init=nn.initializers.normal(_EMBED_INIT_STD), name="qkv"
        )(x)
        q, k, v = jnp.split(qkv.reshape(b, s, 3, self.n_heads, hd), 3, axis=2)
        q, k, v = q[:, :, 0], k[:, :, 0], v[:, :, 0]  # each (B, S, H, hd)
        implementation = attention_implementation(x.dtype, hd, self.attention)
        out = jax.nn.dot_product_attention(
            q, k, v, is_causal=True, implementation=implementation
        ).reshape(b, s, d)
        return nn.Dense(
            d, dtype=x.dtype, kernel_init=nn.initializers.normal(self.out_init_std), name="proj"
        )(out)


class MLP(nn.Module):
    """Two-layer GELU MLP."""

    hidden: int
    out_init_std: float

    @nn.compact
    def __call__(self, x: jax.Array) -> jax.Array:
        d = x.shape[-1]
        h = nn.Dense(
            self.hidden, dtype=x.dtype, kernel_init=nn.initializers.normal(_EMBED_INIT_STD), name="fc"
        )(x)
        h = jax.nn.gelu(h)
        return nn.Dense(
            d, dtype=x.dtype, kernel_init=nn.initializers.normal(self.out_init_std), name="proj"
        )(h)


class Block(nn.Module):
    """Pre-LN transformer block.

    Input and output are ``(B, S, d)`` in the same dtype; the dense layers
    compute in the input's dtype (callers cast the input to the parameters'
    dtype, see :func:`logits_fn`).
    """

    n_heads: int
    mlp_ratio: int
    n_layers: int
    attention: str = "auto"

    @nn.compact
    def __call__(self, x: jax.Array) -> jax.Array:
        d = x.shape[-1]
        # GPT-2 style: shrink residual-branch outputs with depth.
        out_std = _EMBED_INIT_STD / math.sqrt(2 * self.n_layers)
        attn = CausalSelfAttention(self.n_heads, out_std, self.attention, name="attn")
        x = x + attn(LayerNorm(name="ln_1")(x))
        x = x + MLP(self.mlp_ratio * d, out_std, name="mlp")(LayerNorm(name="ln_2")(x))
        return x


def _block_module(cfg: GPTConfig) -> Block:
    return Block(n_heads=cfg.n_heads, mlp_ratio=cfg.mlp_ratio, n_layers=cfg.n_layers,
                 attention=cfg.attention)


@functools.partial(jax.jit, static_argnums=0)
def _init_params(cfg: GPTConfig, key: jax.Array) -> dict:
    k_tok, k_pos, k_blocks = jax.random.split(key, 3)
    normal = nn.initializers.normal(_EMBED_INIT_STD)
    embed = {
        "tokens": normal(k_tok, (cfg.vocab_size, cfg.d_model), jnp.float32),
        "positions": normal(k_pos, (cfg.seq_len, cfg.d_model), jnp.float32),
    }
    block = _block_module(cfg)
    dummy = jnp.zeros((1, 1, cfg.d_model), jnp.float32)
    blocks = jax.vmap(lambda k: block.init(k, dummy)["params"])(
        jax.random.split(k_blocks, cfg.n_layers)
    )
    ln_f = {
        "scale": jnp.ones((cfg.d_model,), jnp.float32),
        "bias": jnp.zeros((cfg.d_model,), jnp.float32),
    }
    return {"embed": embed, "blocks": blocks, "ln_f": ln_f}


def init_params(cfg: GPTConfig, key: jax.Array) -> dict:
    """Initializes float32 parameters.

    Args:
      cfg: model shape.
      key: PRNG key (raw ``uint32[2]`` or typed).

    Returns:
      ``{"embed": {"tokens": (V, d), "positions": (S, d)},
      "blocks": {<Block params, each leaf with a leading (L,) axis>},
      "ln_f": {"scale": (d,), "bias": (d,)}}``, all float32.

    Example:
      >>> params = init_params(GPTConfig(n_layers=2), jax.random.key(0))
      >>> params["blocks"]["attn"]["qkv"]["kernel"].shape
      (2, 128, 384)
    """
    return _init_params(cfg, key)


def _forward(
    params: PyTree,
    inputs: jax.Array,
    cfg: GPTConfig,
    head_out: Callable[[jax.Array], jax.Array],
    gather: Callable[[PyTree], dict],
    layer: Callable[[Callable], Callable],
) -> jax.Array:
    """Shared trunk; ``head_out`` maps float32 logits ``(B, S, V)`` to the result."""
    if inputs.ndim != 2:
        raise ValueError(f"inputs must have shape (batch, seq), got {inputs.shape}.")
    s = inputs.shape[1]
    if s > cfg.seq_len:
        raise ValueError(
            f"Sequence length {s} exceeds GPTConfig.seq_len={cfg.seq_len}; "
            "shorten the inputs or build the model with a larger seq_len."
        )
    block = _block_module(cfg)

    def embed_fn(stored_embed, inputs):
        e = gather(stored_embed)
        tok = e["tokens"]
        x = jnp.take(tok, inputs, axis=0)  # (B, S, d)
        return x + e["positions"][:s].astype(tok.dtype)[None]

    def block_fn(h, stored_blk):
        blk = gather(stored_blk)
        dtype = jax.tree.leaves(blk)[0].dtype
        out = block.apply({"params": blk}, h.astype(dtype))
        return out.astype(h.dtype), None

    def head_fn(stored_embed, stored_ln_f, h):
        ln_f = gather(stored_ln_f)
        tok = gather(stored_embed)["tokens"]
        hn = layer_norm(h, ln_f["scale"], ln_f["bias"]).astype(tok.dtype)
        logits = jnp.einsum("bsd,vd->bsv", hn, tok, preferred_element_type=jnp.float32)
        return head_out(logits)

    h = layer(embed_fn)(params["embed"], inputs)
    h, _ = scan_layers(block_fn, h, params["blocks"], layer_fn=layer)
    return layer(head_fn)(params["embed"], params["ln_f"], h)


def logits_fn(
    params: PyTree,
    inputs: jax.Array,
    cfg: GPTConfig,
    *,
    gather: Callable[[PyTree], dict] = _identity,
    layer: Callable[[Callable], Callable] = _identity,
) -> jax.Array:
    """Computes next-token logits.

    Args:
      params: parameters as returned by :func:`init_params` (float32 or
        bfloat16 leaves), or their stored form that ``gather`` understands.
      inputs: int32 ``(B, S)`` token ids with ``S <= cfg.seq_len``.
      cfg: model shape.
      gather: maps a stored top-level subtree (``params["embed"]``,
        ``params["ln_f"]`` or one layer's slice of ``params["blocks"]``) to a
        dict of arrays. It is the only way the model reads parameters.
      layer: wraps each per-layer function (e.g. ``jax.checkpoint``).

    Returns:
      float32 ``(B, S, V)`` logits.
    """
    return _forward(params, inputs, cfg, _identity, gather, layer)


def loss_fn(
    params: PyTree,
    batch: jax.Array,
    cfg: GPTConfig,
    *,
    gather: Callable[[PyTree], dict] = _identity,
    layer: Callable[[Callable], Callable] = _identity,
) -> jax.Array:
    """Mean next-token cross-entropy.

    Args:
      params: see :func:`logits_fn`.
      batch: int32 ``(B, S + 1)``; inputs are ``batch[:, :-1]``, targets
        ``batch[:, 1:]``.
      cfg: model shape.
      gather: see :func:`logits_fn`.
      layer: see :func:`logits_fn`.

    Returns:
      float32 scalar, the mean cross-entropy over all ``B * S`` positions.

    Example:
      >>> cfg = GPTConfig(n_layers=2)
      >>> params = init_params(cfg, jax.random.key(0))
      >>> batch = jnp.zeros((4, cfg.seq_len + 1), jnp.int32)
      >>> loss = jax.jit(loss_fn, static_argnums=2)(params, batch, cfg)
    """
    if batch.ndim != 2 or batch.shape[1] < 2:
        raise ValueError(
            f"batch must have shape (batch, seq_len + 1) with seq_len >= 1, got {batch.shape}."
        )
    inputs, targets = batch[:, :-1], batch[:, 1:]

    def cross_entropy(logits):
        logz = jax.nn.logsumexp(logits, axis=-1)
        picked = jnp.take_along_axis(logits, targets[..., None], axis=-1)[..., 0]
        return jnp.mean(logz - picked)

    return _forward(params, inputs, cfg, cross_entropy, gather, layer)


def count_params(cfg: GPTConfig) -> int:
    """Number of scalar parameters (the output head is tied, so not counted twice)."""
    d, hidden = cfg.d_model, cfg.mlp_ratio * cfg.d_model
    per_block = (
        2 * d  # ln_1
        + d * 3 * d + 3 * d  # attn.qkv
        + d * d + d  # attn.proj
        + 2 * d  # ln_2
        + d * hidden + hidden  # mlp.fc
        + hidden * d + d  # mlp.proj
    )
    return cfg.vocab_size * d + cfg.seq_len * d + cfg.n_layers * per_block + 2 * d


def flops_per_token(cfg: GPTConfig) -> float:
    """Training FLOPs per token (forward + backward), standard estimate.

    ``6 * N + 12 * L * S * d`` (PaLM, appendix B): ``6N`` for the weight
    matmuls (``N`` = :func:`count_params`, which includes the tied embedding and
    so the output head), plus the attention score and value matmuls over the
    full context ``S = cfg.seq_len`` without discounting the causal mask.
    """
    return float(6 * count_params(cfg) + 12 * cfg.n_layers * cfg.seq_len * cfg.d_model)

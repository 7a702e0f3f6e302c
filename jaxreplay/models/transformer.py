"""A Llama/Qwen-style decoder in Flax NNX: RMSNorm, RoPE, GQA attention, SwiGLU.

The KV cache is passed in and returned explicitly (a pytree, not module state), so
prefill and every decode step are pure functions that ``jit`` and ``lax`` loops
handle without graph bookkeeping.

Shape letters: B batch, T query length, S key/cache length, D model width,
H query heads, K key/value heads, E head dim, V vocabulary, F MLP width.
"""

from __future__ import annotations

import dataclasses

import flax.struct
import jax
import jax.numpy as jnp
from flax import nnx


@dataclasses.dataclass(frozen=True)
class TransformerConfig:
  """Architecture hyper-parameters (all sizes in elements).

  Attributes:
    vocab_size: V. d_model: D. n_layers: number of blocks. n_heads: H.
    n_kv_heads: K (divides H; K < H is grouped-query attention). head_dim: E.
    d_ff: F, SwiGLU hidden width. rope_theta: RoPE base. norm_eps: RMSNorm epsilon.
    tie_embeddings: reuse the embedding matrix as the output projection.
    dtype: activation dtype; parameters are float32.
  """

  vocab_size: int
  d_model: int = 128
  n_layers: int = 4
  n_heads: int = 4
  n_kv_heads: int = 4
  head_dim: int = 32
  d_ff: int = 384
  rope_theta: float = 10_000.0
  norm_eps: float = 1e-6
  tie_embeddings: bool = True
  dtype: str = "float32"


@flax.struct.dataclass
class KVCache:
  """Per-layer keys and values: ``k``/``v`` [L, B, S, K, E]; ``valid`` [B, S] bool."""

  k: jax.Array
  v: jax.Array
  valid: jax.Array


def init_cache(cfg: TransformerConfig, batch: int, length: int) -> KVCache:
  """An empty cache for ``batch`` rows and ``length`` slots (all invalid)."""
  shape = (cfg.n_layers, batch, length, cfg.n_kv_heads, cfg.head_dim)
  return KVCache(k=jnp.zeros(shape, cfg.dtype), v=jnp.zeros(shape, cfg.dtype),
                 valid=jnp.zeros((batch, length), bool))


def positions_from_mask(mask: jax.Array) -> jax.Array:
  """Position ids from an attention mask: ``cumsum(mask) - 1``, pad slots 0.

  Left-padded rows thus give their first real token position 0 (CASES.md case 1).

  Args:
    mask: [B, T] bool, True on real tokens.

  Returns:
    [B, T] int32 positions.
  """
  pos = jnp.cumsum(mask.astype(jnp.int32), axis=-1) - 1
  return jnp.where(mask, pos, 0).astype(jnp.int32)


def rope(x: jax.Array, positions: jax.Array, theta: float) -> jax.Array:
  """Rotary embedding (Su et al. 2021, RoFormer eq. 34), half-split layout as in Llama/Qwen HF.

  Args:
    x: [B, T, N, E] queries or keys.
    positions: [B, T] int positions.
    theta: base frequency.

  Returns:
    [B, T, N, E], same dtype as ``x``.
  """
  e = x.shape[-1]
  inv_freq = 1.0 / (theta ** (jnp.arange(0, e, 2, dtype=jnp.float32) / e))  # [E/2]
  ang = positions.astype(jnp.float32)[..., None] * inv_freq  # [B, T, E/2]
  cos = jnp.cos(ang)[:, :, None, :]
  sin = jnp.sin(ang)[:, :, None, :]
  x1, x2 = jnp.split(x.astype(jnp.float32), 2, axis=-1)
  out = jnp.concatenate([x1 * cos - x2 * sin, x2 * cos + x1 * sin], axis=-1)
  return out.astype(x.dtype)


class RMSNorm(nnx.Module):
  """RMSNorm (Zhang & Sennrich 2019): x / sqrt(mean(x²) + eps) · scale."""

  def __init__(self, dim: int, eps: float):
    self.scale = nnx.Param(jnp.ones((dim,), jnp.float32))
    self.eps = eps

  def __call__(self, x: jax.Array) -> jax.Array:
    xf = x.astype(jnp.float32)
    y = xf * jax.lax.rsqrt(jnp.mean(xf * xf, axis=-1, keepdims=True) + self.eps)
    return (y * self.scale[...]).astype(x.dtype)


class Attention(nnx.Module):
  """Causal multi-head attention with GQA, RoPE and an explicit KV cache."""

  def __init__(self, cfg: TransformerConfig, rngs: nnx.Rngs):
    init = nnx.initializers.normal(cfg.d_model ** -0.5)
    d, h, k, e = cfg.d_model, cfg.n_heads, cfg.n_kv_heads, cfg.head_dim
    self.q = nnx.Linear(d, h * e, use_bias=False, kernel_init=init, rngs=rngs)
    self.k = nnx.Linear(d, k * e, use_bias=False, kernel_init=init, rngs=rngs)
    self.v = nnx.Linear(d, k * e, use_bias=False, kernel_init=init, rngs=rngs)
    self.o = nnx.Linear(h * e, d, use_bias=False,
                        kernel_init=nnx.initializers.normal((h * e) ** -0.5 / (2 * cfg.n_layers) ** 0.5),
                        rngs=rngs)
    self.cfg = cfg

  def __call__(self, x, positions, mask, cache_kv=None, cache_index=None):
    """Attends queries ``x`` over their own keys or over the cache.

    Args:
      x: [B, T, D]. positions: [B, T] int32.
      mask: [B, T, S] bool, True where query t may attend key s.
      cache_kv: optional (k, v) each [B, S, K, E]; the new keys go to slots
        ``cache_index .. cache_index+T-1`` and attention runs over all S slots.
      cache_index: int32 scalar, first slot to write.

    Returns:
      (y [B, T, D], updated (k, v) or None).
    """
    b, t, _ = x.shape
    c = self.cfg
    q = self.q(x).reshape(b, t, c.n_heads, c.head_dim)
    k = self.k(x).reshape(b, t, c.n_kv_heads, c.head_dim)
    v = self.v(x).reshape(b, t, c.n_kv_heads, c.head_dim)
    q, k = rope(q, positions, c.rope_theta), rope(k, positions, c.rope_theta)
    new_kv = None
    if cache_kv is not None:
      ck, cv = cache_kv
      k = jax.lax.dynamic_update_slice(ck, k.astype(ck.dtype), (0, cache_index, 0, 0))
      v = jax.lax.dynamic_update_slice(cv, v.astype(cv.dtype), (0, cache_index, 0, 0))
      new_kv = (k, v)
    g = c.n_heads // c.n_kv_heads
    q = q.reshape(b, t, c.n_kv_heads, g, c.head_dim)
    logits = jnp.einsum("btkge,bske->bkgts", q, k).astype(jnp.float32) * c.head_dim ** -0.5
    logits = jnp.where(mask[:, None, None, :, :], logits, -1e30)
    probs = jax.nn.softmax(logits, axis=-1).astype(v.dtype)
    y = jnp.einsum("bkgts,bske->btkge", probs, v).reshape(b, t, c.n_heads * c.head_dim)
    return self.o(y), new_kv


class MLP(nnx.Module):
  """SwiGLU feed-forward (Shazeer 2020): down(silu(gate(x)) * up(x))."""

  def __init__(self, cfg: TransformerConfig, rngs: nnx.Rngs):
    init = nnx.initializers.normal(cfg.d_model ** -0.5)
    self.gate = nnx.Linear(cfg.d_model, cfg.d_ff, use_bias=False, kernel_init=init, rngs=rngs)
    self.up = nnx.Linear(cfg.d_model, cfg.d_ff, use_bias=False, kernel_init=init, rngs=rngs)
    self.down = nnx.Linear(cfg.d_ff, cfg.d_model, use_bias=False,
                           kernel_init=nnx.initializers.normal(cfg.d_ff ** -0.5 / (2 * cfg.n_layers) ** 0.5),
                           rngs=rngs)

  def __call__(self, x):
    return self.down(jax.nn.silu(self.gate(x)) * self.up(x))


class Block(nnx.Module):
  """Pre-norm transformer block."""

  def __init__(self, cfg: TransformerConfig, rngs: nnx.Rngs):
    self.attn_norm = RMSNorm(cfg.d_model, cfg.norm_eps)
    self.attn = Attention(cfg, rngs)
    self.mlp_norm = RMSNorm(cfg.d_model, cfg.norm_eps)
    self.mlp = MLP(cfg, rngs)

  def __call__(self, x, positions, mask, cache_kv=None, cache_index=None):
    h, new_kv = self.attn(self.attn_norm(x), positions, mask, cache_kv, cache_index)
    x = x + h
    return x + self.mlp(self.mlp_norm(x)), new_kv


class Transformer(nnx.Module):
  """Decoder-only language model.

  ``__call__(tokens, mask)`` scores full sequences (training); ``step`` runs
  prefill/decode against a ``KVCache`` (sampling). Both give float32 logits.
  """

  def __init__(self, cfg: TransformerConfig, rngs: nnx.Rngs):
    if cfg.n_heads % cfg.n_kv_heads:
      raise ValueError(f"model.n_heads={cfg.n_heads} must be a multiple of "
                       f"model.n_kv_heads={cfg.n_kv_heads}")
    self.cfg = cfg
    self.embed = nnx.Embed(cfg.vocab_size, cfg.d_model,
                           embedding_init=nnx.initializers.normal(1.0), rngs=rngs)
    self.blocks = nnx.List([Block(cfg, rngs) for _ in range(cfg.n_layers)])
    self.final_norm = RMSNorm(cfg.d_model, cfg.norm_eps)
    if not cfg.tie_embeddings:
      self.lm_head = nnx.Linear(cfg.d_model, cfg.vocab_size, use_bias=False,
                                kernel_init=nnx.initializers.normal(cfg.d_model ** -0.5), rngs=rngs)

  def _logits(self, x):
    x = self.final_norm(x)
    if self.cfg.tie_embeddings:
      return jnp.einsum("btd,vd->btv", x, self.embed.embedding[...]).astype(jnp.float32) \
          * self.cfg.d_model ** -0.5
    return self.lm_head(x).astype(jnp.float32)

  def __call__(self, tokens: jax.Array, mask: jax.Array) -> jax.Array:
    """Logits for every position of full sequences.

    Args:
      tokens: [B, T] int32. mask: [B, T] bool, True on real tokens (left or right
        padding both allowed; positions come from ``positions_from_mask``).

    Returns:
      [B, T, V] float32 logits; row t predicts token t+1.
    """
    t = tokens.shape[1]
    positions = positions_from_mask(mask)
    causal = jnp.tril(jnp.ones((t, t), bool))
    attn_mask = causal[None] & mask[:, None, :]
    x = self.embed(tokens).astype(self.cfg.dtype)
    for blk in self.blocks:
      x, _ = blk(x, positions, attn_mask)
    return self._logits(x)

  def step(self, tokens: jax.Array, positions: jax.Array, token_valid: jax.Array,
           cache: KVCache, cache_index: jax.Array) -> tuple[jax.Array, KVCache]:
    """Prefill (T > 1) or decode (T = 1) against the cache.

    Args:
      tokens: [B, T] int32 written to slots ``cache_index .. cache_index+T-1``.
      positions: [B, T] int32 position ids.
      token_valid: [B, T] bool, False for padding (never attended to).
      cache: KVCache with S slots.
      cache_index: int32 scalar.

    Returns:
      (logits [B, T, V] float32, updated cache).
    """
    b, t = tokens.shape
    s = cache.valid.shape[1]
    valid = jax.lax.dynamic_update_slice(cache.valid, token_valid, (0, cache_index))
    slot = jnp.arange(s)[None, :]
    query_slot = cache_index + jnp.arange(t)[:, None]
    attn_mask = (slot <= query_slot)[None] & valid[:, None, :]  # [B, T, S]
    x = self.embed(tokens).astype(self.cfg.dtype)
    ks, vs = [], []
    for i, blk in enumerate(self.blocks):
      x, (k, v) = blk(x, positions, attn_mask, (cache.k[i], cache.v[i]), cache_index)
      ks.append(k)
      vs.append(v)
    return self._logits(x), KVCache(k=jnp.stack(ks), v=jnp.stack(vs), valid=valid)

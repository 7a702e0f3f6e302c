"""A Llama/Qwen-style decoder in Flax NNX: RMSNorm, RoPE, GQA attention, SwiGLU.

One implementation covers the Llama 3, Qwen2/Qwen2.5 and Qwen3 families (see
``jaxreplay.models.hf`` for building it from a checkpoint's ``config.json``):
grouped-query attention, RoPE with the families' scaling options (``linear``,
``llama3``, ``yarn``), optional q/k/v (and o, MLP) biases (Qwen2), optional per-head
QK RMSNorm (Qwen3), tied or untied embeddings.

``Transformer.step`` runs one batch against a ``KVCache`` passed in and returned
explicitly (a pytree, not module state): a plain, whole-batch cache path that tests use as
the reference; the sampler's decode engine (``jaxreplay.sampling.engine``) keeps per-slot
caches and calls the blocks' pieces (``Attention.project``, the MLP) itself. The cache update is one ``dynamic_update_slice``
into the whole ``[L, B, K, S, E]`` buffer per layer, which XLA performs in place
inside a ``while_loop``. Keys are stored head-major (K before S): decode attention then
reads contiguous [S, E] panels per head, about 2x faster on a CPU than [S, K, E].
Full sequences and prefill attend through ``models.attention.causal_attention`` when
``cfg.attention`` names a fused kernel (cuDNN on GPU, splash on TPU), else with
``jax.nn.dot_product_attention``'s XLA implementation over a dense mask (the [B, H, T, S]
logits are formed inside XLA's fusion); ``hidden`` also scores packed rows of several
sequences.

Shape letters: B batch, T query length, S key/cache length, D model width,
H query heads, K key/value heads, G = H/K, E head dim, V vocabulary, F MLP width,
L layers.
"""

from __future__ import annotations

import contextlib
import dataclasses
import functools
import math
from typing import Any, Mapping

import flax.struct
import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx

from jaxreplay.models import attention as attention_lib
from jaxreplay.models import lora
from jaxreplay.models.spec import REMAT_POLICIES
from jaxreplay.parallel.sharding import (constrain_batch, constrain_vocab, constrain_whole,
                                         gather_params)

# FLAT ROWS: the linear layers run on [B·T, D] token rows, not [B, T, D]. Their weight
# gradients contract the token axes, and XLA:CPU feeds those dots a transposed copy of the
# cotangent with the elementwise backward (SiLU's) fused in; over three axes it emits that
# copy with strided reads. On token rows a SmolLM2-135M learner step takes a fifth less time
# on the 2-core CPU (bench/flat_rows.py). The math is the same; GPU and TPU steps were not
# timed.

ROPE_TYPES = ("default", "linear", "llama3", "yarn")
# Rematerialisation of each block in the backward pass (``TransformerConfig.remat``):
# none keeps every activation; full keeps only each block's input and recomputes the rest;
# dots_saveable keeps the matmul outputs; dots_no_batch keeps those without batch
# dimensions (the weight-side projections), recomputing attention scores. The names are
# REMAT_POLICIES (models/spec.py, the model section's choices).


def remat_policy(name: str):
  """The ``jax.checkpoint`` policy of a ``REMAT_POLICIES`` name (None = save nothing).

  Raises:
    ValueError: an unknown name.
  """
  if name == "full":
    return None
  if name == "dots_saveable":
    return jax.checkpoint_policies.dots_saveable
  if name == "dots_no_batch":
    return jax.checkpoint_policies.dots_with_no_batch_dims_saveable
  raise ValueError(f"model.remat={name!r} has no checkpoint policy; valid: {REMAT_POLICIES}")


def _freeze(d: Mapping[str, Any] | None) -> tuple[tuple[str, Any], ...] | None:
  """A mapping as a sorted tuple of items (hashable, so it can live in a static config)."""
  if d is None:
    return None
  if isinstance(d, tuple):
    return d
  return tuple(sorted((str(k), v) for k, v in dict(d).items()))


@dataclasses.dataclass(frozen=True)
class TransformerConfig:
  """Architecture hyper-parameters (all sizes in elements).

  Attributes:
    vocab_size: V. d_model: D. n_layers: number of blocks. n_heads: H.
    n_kv_heads: K (divides H; K < H is grouped-query attention). head_dim: E
      (need not equal D / H, e.g. Qwen3). d_ff: F, SwiGLU hidden width.
    rope_theta: RoPE base. norm_eps: RMSNorm epsilon.
    tie_embeddings: reuse the embedding matrix as the output projection.
    dtype: activation dtype (``"float32"`` or ``"bfloat16"``).
    param_dtype: parameter dtype (default ``"float32"``).
    qkv_bias: biases on the q/k/v projections (Qwen2/Qwen2.5: True).
    o_bias: bias on the output projection (Llama ``attention_bias``).
    mlp_bias: biases on the SwiGLU projections (Llama ``mlp_bias``).
    qk_norm: RMSNorm over each head's E features of q and k before RoPE (Qwen3).
    rope_scaling: None, or a mapping (stored as a sorted item tuple) in the Hugging Face
      ``rope_scaling``/``rope_parameters`` format with ``rope_type`` one of
      ``ROPE_TYPES`` and that type's keys (``factor``, ``low_freq_factor``,
      ``high_freq_factor``, ``original_max_position_embeddings``, ``beta_fast``, ...).
    max_position_embeddings: the checkpoint's context length (used by ``yarn`` when
      ``original_max_position_embeddings`` is absent); 0 if unknown.
    scale_tied_logits: multiply tied-embedding logits by D**-0.5. True keeps the
      behaviour of jaxreplay's small default policy (an N(0, 1) embedding); models
      loaded from Hugging Face set False, the exact HF computation.
    scan_layers: hold the blocks' parameters stacked on a leading L axis
      (``blocks/attn/q/kernel`` [L, D, H·E]) and run them with one ``lax.scan``: compile
      time independent of depth. False: a list ``blocks/{i}/...`` run by a Python loop.
    remat: one of ``REMAT_POLICIES``, what each block keeps for the backward pass.
    attention: the full-sequence attention, one of ``attention.IMPLS`` ('xla', 'cudnn',
      'splash'; ``models.attention.resolve`` picks it from ``model.attention``): training
      passes and the sampler's prefill. Decode steps read the KV cache their own way.

  Raises (in ``__post_init__``):
    ValueError: n_heads not a multiple of n_kv_heads, odd head_dim, unknown rope type,
      unknown dtype, remat policy or attention impl, non-bool scan_layers.
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
  param_dtype: str = "float32"
  qkv_bias: bool = False
  o_bias: bool = False
  mlp_bias: bool = False
  qk_norm: bool = False
  rope_scaling: Any = None
  max_position_embeddings: int = 0
  scale_tied_logits: bool = True
  scan_layers: bool = False
  remat: str = "none"
  attention: str = "xla"

  def __post_init__(self):
    object.__setattr__(self, "rope_scaling", _freeze(self.rope_scaling))
    if self.attention not in attention_lib.IMPLS:
      raise ValueError(f"attention={self.attention!r} is invalid: must be one of "
                       f"{attention_lib.IMPLS} (model.attention resolves to one of them)")
    if self.remat not in REMAT_POLICIES:
      raise ValueError(f"model.remat={self.remat!r} is invalid: must be one of {REMAT_POLICIES}")
    if not isinstance(self.scan_layers, bool):
      raise ValueError(f"model.scan_layers={self.scan_layers!r} is invalid: must be a bool")
    if self.n_kv_heads < 1 or self.n_heads % self.n_kv_heads:
      raise ValueError(f"model.n_heads={self.n_heads} must be a multiple of "
                       f"model.n_kv_heads={self.n_kv_heads}")
    if self.head_dim % 2:
      raise ValueError(f"model.head_dim={self.head_dim} must be even for RoPE")
    for name in ("dtype", "param_dtype"):
      if getattr(self, name) not in ("float32", "bfloat16", "float16"):
        raise ValueError(f"model.{name}={getattr(self, name)!r}; valid: float32, bfloat16, float16")
    if self.rope_scaling is not None:
      kind = self.rope_type
      if kind not in ROPE_TYPES:
        raise ValueError(f"model.rope_scaling rope_type={kind!r} is not supported; "
                         f"valid: {ROPE_TYPES} (dynamic NTK and longrope are not implemented)")

  @property
  def rope_type(self) -> str:
    """The RoPE scaling kind: ``"default"`` when ``rope_scaling`` is None."""
    if self.rope_scaling is None:
      return "default"
    d = dict(self.rope_scaling)
    return d.get("rope_type", d.get("type", "default"))


@functools.lru_cache(maxsize=64)
def rope_frequencies(cfg: TransformerConfig) -> tuple[np.ndarray, float]:
  """Inverse frequencies and the cos/sin scale of RoPE under the configured scaling.

  Follows Hugging Face ``modeling_rope_utils`` (default, linear, llama3 — Meta's
  Llama 3.1 recipe — and yarn, Peng et al. 2023 "YaRN"), computed in float32 as there.

  Args:
    cfg: the model config (``head_dim``, ``rope_theta``, ``rope_scaling``).

  Returns:
    (inv_freq [E/2] float32 in radians per position, attention_scaling float that
     multiplies cos and sin).

  Raises:
    KeyError: a scaling type's required key (e.g. ``factor``) is missing.
  """
  dim = cfg.head_dim
  base = cfg.rope_theta
  inv_freq = (1.0 / (base ** (np.arange(0, dim, 2, dtype=np.int64).astype(np.float32) / dim))
              ).astype(np.float32)
  kind = cfg.rope_type
  sc = dict(cfg.rope_scaling or ())
  if kind == "default":
    return inv_freq, 1.0
  if kind == "linear":
    return (inv_freq / np.float32(sc["factor"])).astype(np.float32), 1.0
  if kind == "llama3":
    factor, lo, hi = sc["factor"], sc["low_freq_factor"], sc["high_freq_factor"]
    old = sc["original_max_position_embeddings"]
    lo_wavelen, hi_wavelen = old / lo, old / hi
    wavelen = (2 * math.pi / inv_freq).astype(np.float32)
    f = np.where(wavelen > lo_wavelen, inv_freq / factor, inv_freq).astype(np.float32)
    smooth = ((old / wavelen - lo) / (hi - lo)).astype(np.float32)
    smoothed = ((1 - smooth) * f / factor + smooth * f).astype(np.float32)
    medium = ~(wavelen < hi_wavelen) & ~(wavelen > lo_wavelen)
    return np.where(medium, smoothed, f).astype(np.float32), 1.0
  # yarn
  orig = sc.get("original_max_position_embeddings") or cfg.max_position_embeddings
  if not orig:
    raise KeyError("rope_scaling yarn needs original_max_position_embeddings "
                   "(or model.max_position_embeddings)")
  factor = sc.get("factor") or cfg.max_position_embeddings / orig
  mscale, mscale_all = sc.get("mscale"), sc.get("mscale_all_dim")

  def get_mscale(scale, m=1.0):
    return 1.0 if scale <= 1 else 0.1 * m * math.log(scale) + 1.0

  attn = sc.get("attention_factor")
  if attn is None:
    attn = (get_mscale(factor, mscale) / get_mscale(factor, mscale_all)
            if mscale and mscale_all else get_mscale(factor))
  beta_fast, beta_slow = sc.get("beta_fast") or 32, sc.get("beta_slow") or 1

  def corr_dim(rot):
    return (dim * math.log(orig / (rot * 2 * math.pi))) / (2 * math.log(base))

  low, high = corr_dim(beta_fast), corr_dim(beta_slow)
  if sc.get("truncate", True):
    low, high = math.floor(low), math.ceil(high)
  low, high = max(low, 0), min(high, dim - 1)
  if low == high:
    high += 0.001
  ramp = np.clip((np.arange(dim // 2, dtype=np.float32) - low) / (high - low), 0, 1)
  extra = (1 - ramp).astype(np.float32)
  pos_freqs = (base ** (np.arange(0, dim, 2).astype(np.float32) / dim)).astype(np.float32)
  inv_ex, inv_in = 1.0 / pos_freqs, 1.0 / (factor * pos_freqs)
  return (inv_in * (1 - extra) + inv_ex * extra).astype(np.float32), float(attn)


@flax.struct.dataclass
class KVCache:
  """Per-layer keys and values: ``k``/``v`` [L, B, K, S, E]; ``valid`` [B, S] bool."""

  k: jax.Array
  v: jax.Array
  valid: jax.Array


def init_cache(cfg: TransformerConfig, batch: int, length: int) -> KVCache:
  """An empty cache for ``batch`` rows and ``length`` slots (all invalid), dtype ``cfg.dtype``."""
  shape = (cfg.n_layers, batch, cfg.n_kv_heads, length, cfg.head_dim)
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


def rope(x: jax.Array, positions: jax.Array, theta: float | TransformerConfig) -> jax.Array:
  """Rotary embedding (Su et al. 2021, RoFormer eq. 34), half-split layout as in Llama/Qwen HF.

  Args:
    x: [B, T, N, E] queries or keys.
    positions: [B, T] int positions.
    theta: the base frequency (plain RoPE), or a ``TransformerConfig`` whose
      ``rope_frequencies`` (scaling included) are used.

  Returns:
    [B, T, N, E], same dtype as ``x``.
  """
  e = x.shape[-1]
  if isinstance(theta, TransformerConfig):
    inv_np, scale = rope_frequencies(theta)
    inv_freq = jnp.asarray(inv_np)
  else:
    inv_freq = 1.0 / (theta ** (jnp.arange(0, e, 2, dtype=jnp.float32) / e))  # [E/2]
    scale = 1.0
  ang = positions.astype(jnp.float32)[..., None] * inv_freq  # [B, T, E/2]
  cos = jnp.cos(ang)[:, :, None, :]
  sin = jnp.sin(ang)[:, :, None, :]
  if scale != 1.0:
    cos, sin = cos * scale, sin * scale
  x1, x2 = jnp.split(x.astype(jnp.float32), 2, axis=-1)
  out = jnp.concatenate([x1 * cos - x2 * sin, x2 * cos + x1 * sin], axis=-1)
  return out.astype(x.dtype)


class RMSNorm(nnx.Module):
  """RMSNorm (Zhang & Sennrich 2019): x / sqrt(mean(x²) + eps) · scale, statistics in float32.

  The scale multiplies after the cast back to the input dtype, as in Hugging Face
  ``LlamaRMSNorm``/``Qwen2RMSNorm``.
  """

  def __init__(self, dim: int, eps: float, param_dtype: str = "float32"):
    self.scale = nnx.Param(jnp.ones((dim,), param_dtype))
    self.eps = eps

  def __call__(self, x: jax.Array) -> jax.Array:
    xf = x.astype(jnp.float32)
    y = xf * jax.lax.rsqrt(jnp.mean(xf * xf, axis=-1, keepdims=True) + self.eps)
    return y.astype(x.dtype) * self.scale[...].astype(x.dtype)


def _linear(cfg: TransformerConfig, din: int, dout: int, bias: bool, std: float, rngs: nnx.Rngs):
  return nnx.Linear(din, dout, use_bias=bias, kernel_init=nnx.initializers.normal(std),
                    dtype=cfg.dtype, param_dtype=cfg.param_dtype, rngs=rngs)


class Attention(nnx.Module):
  """Causal multi-head attention with GQA, RoPE, optional QK-norm and biases."""

  def __init__(self, cfg: TransformerConfig, rngs: nnx.Rngs):
    d, h, k, e = cfg.d_model, cfg.n_heads, cfg.n_kv_heads, cfg.head_dim
    std = cfg.d_model ** -0.5
    self.q = _linear(cfg, d, h * e, cfg.qkv_bias, std, rngs)
    self.k = _linear(cfg, d, k * e, cfg.qkv_bias, std, rngs)
    self.v = _linear(cfg, d, k * e, cfg.qkv_bias, std, rngs)
    self.o = _linear(cfg, h * e, d, cfg.o_bias, (h * e) ** -0.5 / (2 * cfg.n_layers) ** 0.5, rngs)
    if cfg.qk_norm:
      self.q_norm = RMSNorm(e, cfg.norm_eps, cfg.param_dtype)
      self.k_norm = RMSNorm(e, cfg.norm_eps, cfg.param_dtype)
    self.cfg = cfg

  def project(self, x: jax.Array, positions: jax.Array, head_major: bool = True):
    """Queries, keys and values of inputs x [B, T, D] at ``positions`` [B, T] int32.

    Returns:
      (q [B, T, H, E], k, v) with RoPE applied to q and k; k and v are [B, K, T, E] with
      ``head_major`` (the cache layout), else [B, T, K, E] (the full-sequence layout,
      which ``jax.nn.dot_product_attention`` reads without a transpose). Activation dtype.
    """
    b, t, _ = x.shape
    c = self.cfg
    x = x.reshape(b * t, -1)  # projections on token rows (see FLAT ROWS above)
    q = self.q(x).reshape(b, t, c.n_heads, c.head_dim)
    k = self.k(x).reshape(b, t, c.n_kv_heads, c.head_dim)
    v = self.v(x).reshape(b, t, c.n_kv_heads, c.head_dim)
    if c.qk_norm:
      q, k = self.q_norm(q), self.k_norm(k)
    k = rope(k, positions, c)
    if head_major:
      k, v = k.transpose(0, 2, 1, 3), v.transpose(0, 2, 1, 3)
    return rope(q, positions, c), k, v

  def attend(self, q: jax.Array, k: jax.Array, v: jax.Array, mask: jax.Array,
             head_major: bool = True) -> jax.Array:
    """Softmax attention (Vaswani et al. 2017, eq. 1) followed by the output projection.

    Full sequences (``head_major`` False, ``Block.__call__``) go through
    ``models.attention.causal_attention`` when ``cfg.attention`` names a fused kernel
    (cudnn, splash), over segment ids; otherwise, and for cache reads, through
    ``jax.nn.dot_product_attention`` (GQA native; its XLA implementation, as
    ``implementation=None`` selects in jax 0.10), which takes keys sequence-major:
    head-major keys are transposed first. A single query against the cache (T = 1, a
    decode step) reads the head-major cache directly with an einsum: its logits are only
    [B, H, 1, S], and a transpose would copy the whole cache at every step. Logits and
    softmax in float32.

    Args:
      q: [B, T, H, E]. k, v: [B, K, S, E] with ``head_major``, else [B, S, K, E].
      mask: [B, T, S] bool, True where query t may attend to key s; for full sequences
        with a fused ``cfg.attention``, [B, T] int32 segment ids (``attention.segments``):
        causal within equal ids.

    Returns:
      [B, T, D] in the activation dtype.
    """
    b, t = q.shape[:2]
    c = self.cfg
    if not head_major and mask.dtype != jnp.bool_:  # segment ids for a fused kernel
      y = attention_lib.causal_attention(q, k.astype(q.dtype), v.astype(q.dtype),
                                         impl=c.attention, segment_ids=mask,
                                         scale=c.head_dim ** -0.5)
    elif head_major and t == 1:
      g = c.n_heads // c.n_kv_heads
      qg = q.reshape(b, t, c.n_kv_heads, g, c.head_dim)
      logits = jnp.einsum("btkge,bkse->bkgts", qg, k,
                          preferred_element_type=jnp.float32) * c.head_dim ** -0.5
      logits = jnp.where(mask[:, None, None, :, :], logits, -1e30)
      probs = jax.nn.softmax(logits, axis=-1).astype(v.dtype)
      y = jnp.einsum("bkgts,bkse->btkge", probs, v)
    else:
      if head_major:
        k, v = k.transpose(0, 2, 1, 3), v.transpose(0, 2, 1, 3)
      y = jax.nn.dot_product_attention(q, k.astype(q.dtype), v.astype(q.dtype),
                                       mask=mask[:, None], scale=c.head_dim ** -0.5)
    return self.o(y.reshape(b * t, c.n_heads * c.head_dim)).reshape(b, t, -1)


class MLP(nnx.Module):
  """SwiGLU feed-forward (Shazeer 2020): down(silu(gate(x)) * up(x))."""

  def __init__(self, cfg: TransformerConfig, rngs: nnx.Rngs):
    std = cfg.d_model ** -0.5
    self.gate = _linear(cfg, cfg.d_model, cfg.d_ff, cfg.mlp_bias, std, rngs)
    self.up = _linear(cfg, cfg.d_model, cfg.d_ff, cfg.mlp_bias, std, rngs)
    self.down = _linear(cfg, cfg.d_ff, cfg.d_model, cfg.mlp_bias,
                        cfg.d_ff ** -0.5 / (2 * cfg.n_layers) ** 0.5, rngs)

  def __call__(self, x):
    rows = x.reshape(-1, x.shape[-1])  # token rows (see FLAT ROWS above)
    return self.down(jax.nn.silu(self.gate(rows)) * self.up(rows)).reshape(x.shape)


class Block(nnx.Module):
  """Pre-norm transformer block."""

  def __init__(self, cfg: TransformerConfig, rngs: nnx.Rngs):
    self.attn_norm = RMSNorm(cfg.d_model, cfg.norm_eps, cfg.param_dtype)
    self.attn = Attention(cfg, rngs)
    self.mlp_norm = RMSNorm(cfg.d_model, cfg.norm_eps, cfg.param_dtype)
    self.mlp = MLP(cfg, rngs)

  def __call__(self, x, positions, mask):
    """One block over the whole sequence: x [B, T, D] -> [B, T, D]; mask [B, T, T] bool, or
    [B, T] int32 segment ids with a fused ``cfg.attention`` (``Attention.attend``)."""
    q, k, v = self.attn.project(self.attn_norm(x), positions, head_major=False)
    return self._attend_and_mlp(x, q, k, v, mask, head_major=False)

  def decode(self, x, positions, mask, ck, cv, layer: int, cache_index):
    """One block against the KV cache.

    Writes this layer's keys and values of the T new tokens into slots
    ``cache_index .. cache_index+T-1`` of ``ck`` / ``cv`` ([L, B, K, S, E], updated in
    place by XLA) and attends over all S slots under ``mask`` [B, T, S] bool. ``layer``
    is an int or a traced int32 scalar (inside the layer scan).

    Returns:
      (x [B, T, D], ck, cv).
    """
    q, k, v = self.attn.project(self.attn_norm(x), positions)
    zero = jnp.zeros((), jnp.int32)
    at = (jnp.asarray(layer, jnp.int32), zero, zero, jnp.asarray(cache_index, jnp.int32), zero)
    ck = jax.lax.dynamic_update_slice(ck, k.astype(ck.dtype)[None], at)
    cv = jax.lax.dynamic_update_slice(cv, v.astype(cv.dtype)[None], at)
    return self._attend_and_mlp(x, q, ck[layer], cv[layer], mask), ck, cv

  def _attend_and_mlp(self, x, q, k, v, mask, head_major=True):
    x = x + self.attn.attend(q, k, v, mask, head_major)
    return x + self.mlp(self.mlp_norm(x))


class Transformer(nnx.Module):
  """Decoder-only language model.

  ``__call__(tokens, mask)`` and ``hidden`` score full or packed sequences (training);
  ``step`` runs prefill/decode of a whole batch against a ``KVCache`` (the reference cache
  path; sampling uses ``jaxreplay.sampling.engine``). Both give float32 logits.

  Parameter paths (used by partition rules and checkpoint conversion):
  ``embed.embedding`` [V, D]; ``blocks.{i}.attn.{q,k,v,o}.kernel`` [in, out] (+ ``.bias``);
  ``blocks.{i}.attn.{q,k}_norm.scale`` [E]; ``blocks.{i}.mlp.{gate,up,down}.kernel``;
  ``blocks.{i}.{attn,mlp}_norm.scale`` [D]; ``final_norm.scale`` [D];
  ``lm_head.kernel`` [D, V] (untied only). With ``cfg.scan_layers`` the blocks are one
  ``Block`` whose parameters carry a leading L axis: ``blocks.attn.q.kernel`` [L, D, H·E],
  the same values as the list layout's ``blocks.{i}...`` stacked (``stack_blocks``).
  """

  def __init__(self, cfg: TransformerConfig, rngs: nnx.Rngs):
    if cfg.n_heads % cfg.n_kv_heads:
      raise ValueError(f"model.n_heads={cfg.n_heads} must be a multiple of "
                       f"model.n_kv_heads={cfg.n_kv_heads}")
    self.cfg = cfg
    self.embed = nnx.Embed(cfg.vocab_size, cfg.d_model, param_dtype=cfg.param_dtype,
                           embedding_init=nnx.initializers.normal(1.0), rngs=rngs)
    blocks = [Block(cfg, rngs) for _ in range(cfg.n_layers)]
    if cfg.scan_layers:  # the list layout's initial values, stacked
      graphdef, _ = nnx.split(blocks[0])
      self.blocks = nnx.merge(graphdef, jax.tree.map(lambda *xs: jnp.stack(xs),
                                                      *[nnx.state(b) for b in blocks]))
    else:
      self.blocks = nnx.List(blocks)
    self.final_norm = RMSNorm(cfg.d_model, cfg.norm_eps, cfg.param_dtype)
    if not cfg.tie_embeddings:
      self.lm_head = _linear(cfg, cfg.d_model, cfg.vocab_size, False, cfg.d_model ** -0.5, rngs)

  def _logits(self, x):
    return self.project_logits(self.final_norm(x))

  def project_logits(self, h: jax.Array) -> jax.Array:
    """The output head: float32 logits [B, T, V] of final-normed hidden states h [B, T, D].

    Applied to slices of ``hidden`` it computes the logits a chunk at a time (the
    learner's chunked log-probs, ``jaxreplay.rl.scoring``); ``logits_projector`` does the
    same with the head's weight gathered once for all chunks.
    """
    return self.logits_projector()(h)

  def logits_projector(self):
    """``project_logits`` with the head's weight laid out once, for many calls.

    Under a context mesh the head is vocabulary-parallel: the weight is split over V on
    every device (``constrain_vocab``; the untied ``lm_head`` is stored so, the tied
    table is resharded here, once), each call gathers the hidden states [B, c, D] whole
    and returns logits split over V. No logits are all-reduced, and the weight's
    gradient accumulates over the log-prob chunks locally. Without a mesh it is
    ``project_logits``, operation for operation.

    Returns:
      A function h [B, T, D] -> float32 logits [B, T, V], equal to ``project_logits``.
    """
    if self.cfg.tie_embeddings:
      return functools.partial(self._tied_logits,
                               constrain_vocab(self.embed.embedding[...], 0))
    return functools.partial(self._head_logits, constrain_vocab(self.lm_head.kernel[...], 1))

  def _tied_logits(self, w_vd, h):
    logits = jnp.einsum("btd,vd->btv", constrain_whole(h), w_vd.astype(h.dtype),
                        preferred_element_type=jnp.float32)
    if self.cfg.scale_tied_logits:
      logits = logits * self.cfg.d_model ** -0.5
    return constrain_vocab(logits.astype(jnp.float32), 2)

  def _head_logits(self, w_dv, h):
    dtype = self.cfg.dtype  # as nnx.Linear(dtype=cfg.dtype) promotes both operands
    y = jax.lax.dot_general(constrain_whole(h).astype(dtype), w_dv.astype(dtype),
                            (((h.ndim - 1,), (0,)), ((), ())))
    return constrain_vocab(y.astype(jnp.float32), y.ndim - 1)

  def _embed(self, tokens):
    """[B, T] int32 -> [B, T, D] in the activation dtype; the table gathered under a
    context mesh in its parameter dtype (its gradient is a scatter-add: accumulating it
    in bfloat16 would lose repeated tokens' updates)."""
    table = gather_params(self.embed.embedding[...], "embed/embedding")
    return constrain_batch(jnp.take(table, tokens, axis=0).astype(self.cfg.dtype))

  def _trunk(self, tokens: jax.Array, mask: jax.Array, segment_ids: jax.Array | None = None,
             positions: jax.Array | None = None, prefix_ids: jax.Array | None = None
             ) -> jax.Array:
    """The blocks over full sequences: tokens [B, T] int32, mask [B, T] bool -> [B, T, D].

    With ``segment_ids`` [B, T] int32 a query attends only to keys of its own segment
    (packed sequences, ``hidden``), and with ``prefix_ids`` [B, T] int32 also to the keys
    of segment ``prefix_ids`` (shared prompts); ``positions`` [B, T] int32 default to
    ``positions_from_mask(mask)``.
    """
    t = tokens.shape[1]
    if positions is None:
      positions = positions_from_mask(mask)
    fused = self.cfg.attention != "xla"
    if fused and prefix_ids is not None:
      attention_lib.warn_once(
          ("prefix", self.cfg.attention),
          f"attention {self.cfg.attention!r}: rows with shared prompts "
          "(algo.share_prompts) attend through XLA's dense mask; the fused kernels take "
          "segment ids only")
      fused = False
    if fused:  # a fused kernel builds its mask from segment ids
      attn_mask = attention_lib.segments(mask, segment_ids)
    else:
      causal = jnp.tril(jnp.ones((t, t), bool))
      attn_mask = causal[None] & mask[:, None, :]
      if segment_ids is not None:
        same = segment_ids[:, :, None] == segment_ids[:, None, :]
        if prefix_ids is not None:
          same |= prefix_ids[:, :, None] == segment_ids[:, None, :]
        attn_mask &= same
    attn_mask, positions = constrain_batch(attn_mask), constrain_batch(positions)
    x = self._embed(tokens)
    remat = self.cfg.remat != "none"
    if self.cfg.scan_layers:
      graphdef, stacked = nnx.split(self.blocks)
      # the layer index only feeds LoRA dropout's masks (lora.layer_scope)
      layers = jnp.arange(self.cfg.n_layers, dtype=jnp.int32) if lora.dropout_active() else None

      def body(x, xs):
        layer, i = xs
        # FSDP: this layer's weights, cast to the activation dtype (the cast each layer
        # makes anyway) and gathered; activations stay split over the batch.
        layer = gather_params(_cast_floats(layer, self.cfg.dtype))
        with lora.layer_scope(i) if i is not None else contextlib.nullcontext():
          return constrain_batch(nnx.merge(graphdef, layer)(constrain_batch(x), positions,
                                                            attn_mask)), None

      if remat:
        body = jax.checkpoint(body, policy=remat_policy(self.cfg.remat), prevent_cse=False)
      x, _ = jax.lax.scan(body, x, (stacked, layers))
      return x
    for i, blk in enumerate(self.blocks):
      with lora.layer_scope(i):
        if remat:
          graphdef, state = nnx.split(blk)
          x = jax.checkpoint(lambda st, x: nnx.merge(graphdef, st)(x, positions, attn_mask),
                             policy=remat_policy(self.cfg.remat))(state, x)
        else:
          x = blk(x, positions, attn_mask)
    return x

  def __call__(self, tokens: jax.Array, mask: jax.Array) -> jax.Array:
    """Logits for every position of full sequences.

    Args:
      tokens: [B, T] int32. mask: [B, T] bool, True on real tokens (left or right
        padding both allowed; positions come from ``positions_from_mask``).

    Returns:
      [B, T, V] float32 logits; row t predicts token t+1.
    """
    return self._logits(self._trunk(tokens, mask))

  def hidden(self, tokens: jax.Array, mask: jax.Array, segment_ids: jax.Array | None = None,
             positions: jax.Array | None = None, prefix_ids: jax.Array | None = None
             ) -> jax.Array:
    """Final-normed hidden states: ``project_logits(hidden(tokens, mask))`` is the logits.

    Packed sequences (``jaxreplay.rl.packing``): several sequences share a row, each a
    contiguous run of one ``segment_ids`` value; a token attends causally to the earlier
    tokens of its own segment only, and ``positions`` restart at 0 in each segment. A
    segment's hidden states then equal those of the same sequence alone in a row (up to
    float rounding: the reductions run over a different width).

    Args:
      tokens: [B, T] int32. mask: [B, T] bool, True on real tokens (as ``__call__``).
      segment_ids: optional [B, T] int32 segment of each token (any values above
        int32's minimum, ``attention.PAD_SEGMENT``; equal values attend to each other, so
        padding may share one id that no real token uses).
        None: one sequence per row.
      positions: optional [B, T] int32 RoPE position ids; default
        ``positions_from_mask(mask)`` (right for one sequence per row, not for packed rows).
      prefix_ids: optional [B, T] int32 (with ``segment_ids``): a token also attends to
        the earlier tokens of segment ``prefix_ids`` — a prompt packed once for several
        completions (``packing.place_units``); this mask runs on XLA's attention.

    Returns:
      [B, T, D] in the activation dtype; row t predicts token t+1 (of its segment).
    """
    return self.final_norm(self._trunk(tokens, mask, segment_ids, positions, prefix_ids))

  def step(self, tokens: jax.Array, positions: jax.Array, token_valid: jax.Array,
           cache: KVCache, cache_index: jax.Array, last_only: bool = False
           ) -> tuple[jax.Array, KVCache]:
    """Prefill (T > 1) or decode (T = 1) against the cache.

    Args:
      tokens: [B, T] int32 written to slots ``cache_index .. cache_index+T-1``.
      positions: [B, T] int32 position ids.
      token_valid: [B, T] bool, False for padding (never attended to).
      cache: KVCache with S slots.
      cache_index: int32 scalar.
      last_only: compute logits for the last query only (prefill that only needs the
        next-token distribution skips the T × V output projection).

    Returns:
      (logits [B, T, V] float32 — [B, 1, V] with ``last_only`` — and the updated cache).
    """
    t = tokens.shape[1]
    s = cache.valid.shape[1]
    valid = jax.lax.dynamic_update_slice(cache.valid, token_valid, (0, cache_index))
    slot = jnp.arange(s)[None, :]
    query_slot = cache_index + jnp.arange(t)[:, None]
    attn_mask = (slot <= query_slot)[None] & valid[:, None, :]  # [B, T, S]
    x = self._embed(tokens)
    ck, cv = cache.k, cache.v
    if self.cfg.scan_layers:
      graphdef, stacked = nnx.split(self.blocks)

      def body(carry, xs):
        x, ck, cv = carry
        layer, i = xs
        return nnx.merge(graphdef, layer).decode(x, positions, attn_mask, ck, cv, i,
                                                 cache_index), None

      (x, ck, cv), _ = jax.lax.scan(body, (x, ck, cv),
                                    (stacked, jnp.arange(self.cfg.n_layers, dtype=jnp.int32)))
    for i, blk in enumerate(() if self.cfg.scan_layers else self.blocks):
      x, ck, cv = blk.decode(x, positions, attn_mask, ck, cv, i, cache_index)
    if last_only:
      x = x[:, -1:]
    return self._logits(x), KVCache(k=ck, v=cv, valid=valid)


def _cast_floats(tree, dtype):
  """Floating leaves of ``tree`` cast to ``dtype`` (others unchanged)."""
  return jax.tree.map(
      lambda x: x.astype(dtype) if jnp.issubdtype(x.dtype, jnp.floating) else x, tree)


def stack_blocks(params: nnx.State, n_layers: int) -> nnx.State:
  """Parameters of the list layout (``blocks/{i}/...``) in the scan layout (stacked on L).

  Args:
    params: ``nnx.State`` of a ``Transformer`` with ``scan_layers=False``.
    n_layers: L.

  Returns:
    The ``nnx.State`` of the same model with ``scan_layers=True``: each block parameter
    [L, ...] = the L per-layer arrays stacked; the other parameters unchanged.
  """
  flat = nnx.to_flat_state(params)
  out, per_layer = [], {}
  for path, var in flat:
    if path[0] == "blocks":
      per_layer.setdefault(path[2:], [None] * n_layers)[int(path[1])] = var
    else:
      out.append((path, var))
  for rest, vars_ in per_layer.items():
    out.append((("blocks",) + rest,
                vars_[0].replace(jnp.stack([v[...] for v in vars_]))))
  return nnx.from_flat_state(out)


def unstack_blocks(params: nnx.State) -> nnx.State:
  """The inverse of ``stack_blocks``: scan-layout parameters in the list layout."""
  out = []
  for path, var in nnx.to_flat_state(params):
    if path[0] == "blocks":
      arr = var[...]
      out += [(("blocks", i) + path[1:], var.replace(arr[i])) for i in range(arr.shape[0])]
    else:
      out.append((path, var))
  return nnx.from_flat_state(out)

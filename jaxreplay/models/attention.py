"""Causal attention over full sequences: XLA, cuDNN's fused kernel, or TPU splash attention.

Every full-sequence pass of the policy (the learner's scoring of rollouts, packed or not,
and the sampler's prefill) attends causally within a segment: a query at position t sees
the keys at positions <= t that carry its segment id. ``causal_attention`` computes that
softmax attention (Vaswani et al. 2017, eq. 1; grouped-query, query head h reads KV head
h // G) through one of ``IMPLS``:

- ``"xla"``: ``jax.nn.dot_product_attention`` with a dense [B, 1, T, S] mask (its XLA
  implementation forms the [B, H, T, S] logits inside a fusion). Runs everywhere; the
  reference the others are tested against.
- ``"cudnn"``: ``jax.nn.dot_product_attention(implementation='cudnn')``, cuDNN's fused
  flash attention (a ``__cudnn$fmha*`` custom call; no [B, H, T, S] array in HBM). With
  ``lengths`` (one right-padded sequence per row, the prefill) it is cuDNN's
  padding-causal mask; with ``segment_ids`` (packed rows) jax turns the segment mask into
  a [B, 1, T, S] additive bias that the kernel reads (the score array stays on chip).
  Needs a CUDA GPU with cuDNN, bfloat16/float16 inputs and a head size that is a
  multiple of 8 (at most 128 before Hopper, 256 from Hopper on); jax checks these while
  tracing, and any refusal falls back to ``"xla"`` with one warning.
- ``"splash"``: ``jax.experimental.pallas.ops.tpu.splash_attention`` (Mosaic), the TPU
  flash kernel with segment ids and a causal mask, forward and backward kernels. It runs
  as one MQA kernel per (row, KV head), G query heads each. XLA cannot partition a Mosaic
  call, so over several devices each device runs the kernel on its own rows inside
  ``jax.shard_map`` over the batch axes (and ``tensor`` over heads, where it divides the
  KV heads) of the mesh in scope: the context mesh (``jax.set_mesh``, the learner's jits),
  else the one ``kernel_mesh`` names (the sampler's prefill; the drift, noise, record and
  evaluation scorers); inside an all-manual ``shard_map`` (per-device code) it is called
  directly. Sequences are padded to a multiple of
  ``SPLASH_BLOCK`` = 128 positions with a segment id no token uses. Lowered for TPU it is
  the Mosaic kernel; on any other platform (CPU tests) the same kernel runs in Pallas
  interpret mode (``jax.lax.platform_dependent`` picks at lowering time, so a TPU
  program can be exported from a CPU host).

The setting (``model.attention``: 'auto' | 'xla' | 'pallas', the same choices as the
decode option ``sampler.attention``) resolves per platform in ``resolve``: 'auto' and
'pallas' pick ``cudnn`` on GPU and ``splash`` on TPU, ``xla`` elsewhere ('pallas' warns
once there).

Shape letters: B rows, T query length, S key length (= T here), H query heads, K KV
heads, G = H / K, E head size.
"""

from __future__ import annotations

import contextlib
import contextvars
import functools
import logging

import jax
import jax.numpy as jnp

from jaxreplay.models.spec import ATTENTION_CHOICES as CHOICES

IMPLS = ("xla", "cudnn", "splash")
SPLASH_BLOCK = 128  # splash's query/key block (positions); sequences pad to a multiple
# cuDNN's custom-call targets carry no export compatibility guarantee: exporting a cudnn
# program (tests, ahead-of-time lowering) must disable jax.export's check for them.
CUDNN_TARGETS = ("__cudnn$fmhaSoftmax", "__cudnn$fmhaScaleBiasSoftmax",
                 "__cudnn$fmhaSoftmaxBackward", "__cudnn$fmhaScaleBiasSoftmaxBackward")

logger = logging.getLogger(__name__)
_WARNED: set = set()
# The mesh whose batch axes split the rows of splash attention traced without a context
# mesh (``kernel_mesh``); read while tracing.
_KERNEL_MESH: contextvars.ContextVar = contextvars.ContextVar("kernel_mesh", default=None)


@contextlib.contextmanager
def kernel_mesh(mesh):
  """Within: splash attention traced without a context mesh splits its rows over ``mesh``.

  For jits whose inputs are split over a mesh but that set no ``jax.set_mesh`` (which
  would also switch on the model's FSDP layout constraints): XLA cannot partition the
  Mosaic kernel, so it needs the mesh to run it per device. Enter it around the call (or
  inside the traced function): it is read while tracing. No effect on the xla and cudnn
  impls, nor with ``mesh`` None.

  Args:
    mesh: a ``jax.sharding.Mesh`` with the batch axes (``parallel.sharding.BATCH_AXES``),
      or None.
  """
  token = _KERNEL_MESH.set(mesh)
  try:
    yield
  finally:
    _KERNEL_MESH.reset(token)


def with_kernel_mesh(fn, mesh):
  """``fn`` called within ``kernel_mesh(mesh)``.

  Args:
    fn: a callable (a jitted function: it is traced within the context), or None.
    mesh: a ``jax.sharding.Mesh``, or None.

  Returns:
    a callable with ``fn``'s signature and attributes; ``fn`` itself when ``fn`` or
    ``mesh`` is None.
  """
  if fn is None or mesh is None:
    return fn

  @functools.wraps(fn)
  def call(*args, **kwargs):
    with kernel_mesh(mesh):
      return fn(*args, **kwargs)

  return call


def warn_once(key, msg: str) -> None:
  """Logs ``msg`` as a warning the first time ``key`` (any hashable) is seen in the process."""
  if key not in _WARNED:
    _WARNED.add(key)
    logger.warning(msg)


def resolve(choice: str, platform: str, field: str = "model.attention") -> str:
  """The full-sequence attention impl for a setting on ``platform``.

  Args:
    choice: 'auto' | 'xla' | 'pallas'. platform: a jax platform name ('cpu', 'gpu',
      'cuda', 'rocm', 'tpu'), e.g. ``jax.default_backend()``. field: the setting's name,
      for messages.

  Returns:
    one of ``IMPLS``: 'cudnn' on gpu/cuda, 'splash' on tpu for 'auto' and 'pallas';
    'xla' otherwise ('pallas' then warns once: there is no fused kernel for the platform).

  Raises:
    ValueError: ``choice`` not in ``CHOICES`` (the message names ``field``).
  """
  if choice not in CHOICES:
    raise ValueError(f"{field} must be one of {', '.join(map(repr, CHOICES))}; got {choice!r}")
  if choice == "xla":
    return "xla"
  impl = {"gpu": "cudnn", "cuda": "cudnn", "tpu": "splash"}.get(platform.lower())
  if impl is None and choice == "pallas":
    warn_once(("resolve", platform, field), f"{field}='pallas' has no fused attention for "
               f"platform {platform!r}; using the xla attention")
  return impl or "xla"


PAD_SEGMENT = -(2 ** 31)  # the segment of padding: int32's minimum, no real token's id


def segments(mask: jax.Array, segment_ids: jax.Array | None = None) -> jax.Array:
  """Segment ids of rows whose padding attends to nothing real.

  Args:
    mask: [B, T] bool, True on real tokens. segment_ids: optional [B, T] int32, one
      sequence per id (``rl.packing``), any values above ``PAD_SEGMENT``; None: one
      sequence per row.

  Returns:
    [B, T] int32: ``segment_ids`` (or 1) on real tokens, ``PAD_SEGMENT`` on padding.
  """
  ids = jnp.ones(mask.shape, jnp.int32) if segment_ids is None else segment_ids.astype(jnp.int32)
  return jnp.where(mask, ids, PAD_SEGMENT)


def _xla(q, k, v, segment_ids, lengths, scale):
  if lengths is not None:
    return jax.nn.dot_product_attention(q, k, v, is_causal=True, key_value_seq_lengths=lengths,
                                        scale=scale)
  t, s = q.shape[1], k.shape[1]
  mask = jnp.tril(jnp.ones((t, s), bool))[None] & (segment_ids[:, :, None]
                                                   == segment_ids[:, None, :])
  return jax.nn.dot_product_attention(q, k, v, mask=mask[:, None], scale=scale)


def _cudnn(q, k, v, segment_ids, lengths, scale):
  if lengths is not None:
    return jax.nn.dot_product_attention(q, k, v, is_causal=True, key_value_seq_lengths=lengths,
                                        scale=scale, implementation="cudnn")
  same = (segment_ids[:, :, None] == segment_ids[:, None, :])[:, None]
  return jax.nn.dot_product_attention(q, k, v, mask=same, is_causal=True, scale=scale,
                                      implementation="cudnn")


def _splash_rows(q, k, v, seg, *, scale: float, interpret: bool):
  """Splash attention of rows: q [B, T, H, E], k/v [B, T, K, E], seg [B, T] -> [B, T, H, E]."""
  from jax.experimental.pallas.ops.tpu import splash_attention as sa
  b, t, h, e = q.shape
  kh = k.shape[2]
  g = h // kh
  pad = -t % SPLASH_BLOCK
  if pad:  # padded positions form their own segment: no real query sees them
    widen = lambda x: jnp.pad(x, ((0, 0), (0, pad)) + ((0, 0),) * (x.ndim - 2))
    q, k, v = widen(q), widen(k), widen(v)
    seg = jnp.pad(seg, ((0, 0), (0, pad)), constant_values=PAD_SEGMENT)
  tp = t + pad
  block = next(bs for bs in (512, 256, 128) if tp % bs == 0)
  sizes = sa.BlockSizes(block_q=block, block_kv=block, block_kv_compute=block,
                        block_q_dkv=block, block_kv_dkv=block, block_kv_dkv_compute=block,
                        block_q_dq=block, block_kv_dq=block)
  mask = sa.MultiHeadMask([sa.CausalMask((tp, tp)) for _ in range(g)])
  kernel = sa.make_splash_mqa_single_device(mask, block_sizes=sizes, interpret=interpret)
  # the kernel applies no softmax scale: fold it into q in float32
  qs = (q.astype(jnp.float32) * scale).astype(q.dtype)
  qs = qs.reshape(b, tp, kh, g, e).transpose(0, 2, 3, 1, 4)  # [B, K, G, T, E]
  ks, vs = k.transpose(0, 2, 1, 3), v.transpose(0, 2, 1, 3)  # [B, K, T, E]

  def row(qr, kr, vr, sr):
    ids = sa.SegmentIds(q=sr, kv=sr)
    return jax.vmap(lambda qh, kh_, vh: kernel(qh, kh_, vh, segment_ids=ids))(qr, kr, vr)

  out = jax.vmap(row)(qs, ks, vs, seg)  # [B, K, G, T, E]
  return out.transpose(0, 3, 1, 2, 4).reshape(b, tp, h, e)[:, :t]


def _splash(q, k, v, segment_ids, scale):
  from jaxreplay.parallel.sharding import BATCH_AXES, context_mesh, fit_spec
  from jax.sharding import PartitionSpec as P
  kernel = functools.partial(_splash_rows, scale=scale)
  # Mosaic on TPU; the same kernel interpreted on any other platform (CPU tests)
  fn = lambda *a: jax.lax.platform_dependent(*a, tpu=functools.partial(kernel, interpret=False),
                                             default=functools.partial(kernel, interpret=True))
  current = jax.sharding.get_abstract_mesh()
  if not current.empty and current.are_all_axes_manual:  # per-device code already
    return fn(q, k, v, segment_ids)
  mesh = context_mesh() or _KERNEL_MESH.get()
  if mesh is not None and mesh.size > 1:  # each device runs the kernel on its own rows
    # and, where the KV heads split evenly over ``tensor``, on its own heads
    tp = dict(zip(mesh.axis_names, mesh.axis_sizes)).get("tensor", 1)
    heads = "tensor" if tp > 1 and k.shape[2] % tp == 0 else None
    spec = lambda x: fit_spec(P(BATCH_AXES, None, heads), x.shape, mesh)
    seg = fit_spec(P(BATCH_AXES), segment_ids.shape, mesh)
    fn = jax.shard_map(fn, mesh=mesh, in_specs=(spec(q), spec(k), spec(v), seg),
                       out_specs=spec(q), check_vma=False)
  return fn(q, k, v, segment_ids)


def supports(impl: str, q_shape, dtype) -> str | None:
  """Why ``impl`` cannot take queries of ``q_shape`` [B, T, H, E] in ``dtype``, or None.

  Only what is known before tracing: cudnn needs bfloat16/float16 and E a multiple of 8
  at most 256 (jax's own checks while tracing cover the GPU generation and cuDNN's
  presence); splash is given E a multiple of 64 only (the presets' 64 and 128: half and
  one TPU lane tile; smaller head sizes lower too, but only a TPU's Mosaic compiler could
  say whether they compile). xla takes everything.

  Raises:
    ValueError: ``impl`` not in ``IMPLS``.
  """
  if impl not in IMPLS:
    raise ValueError(f"attention impl must be one of {IMPLS}, got {impl!r}")
  e = q_shape[-1]
  if impl == "cudnn":
    if jnp.dtype(dtype) not in (jnp.bfloat16, jnp.float16):
      return f"cuDNN's fused attention takes bfloat16/float16, not {jnp.dtype(dtype).name}"
    if e % 8 or e > 256:
      return f"cuDNN's fused attention needs a head size that is a multiple of 8 <= 256, not {e}"
  if impl == "splash" and e % 64:
    return f"splash attention is used for head sizes that are a multiple of 64, not {e}"
  return None


def causal_attention(q: jax.Array, k: jax.Array, v: jax.Array, *, impl: str = "xla",
                     segment_ids: jax.Array | None = None, lengths: jax.Array | None = None,
                     scale: float | None = None) -> jax.Array:
  """Causal softmax attention within segments (Vaswani et al. 2017, eq. 1), grouped-query.

  Query t of row b attends to keys s <= t with ``segment_ids[b, s] == segment_ids[b, t]``
  (``segments`` builds them from a padding mask), or with ``lengths`` to keys s <= t,
  s < lengths[b] (right-padded rows). A query with no visible key (only possible on
  padding) gives an output nobody should read.

  Args:
    q: [B, T, H, E]. k, v: [B, T, K, E], the same dtype as q; K divides H.
    impl: one of ``IMPLS`` (see the module docstring); a kernel that cannot take the
      shapes, dtype or platform runs as 'xla' with one warning.
    segment_ids: [B, T] int32; exactly one of segment_ids and lengths.
    lengths: [B] int32 real tokens per row (right padding), each >= 1.
    scale: logit scale; None means E ** -0.5.

  Returns:
    [B, T, H, E] in q's dtype.

  Raises:
    ValueError: an unknown impl, or not exactly one of segment_ids and lengths.
  """
  if (segment_ids is None) == (lengths is None):
    raise ValueError("causal_attention takes exactly one of segment_ids and lengths")
  reason = supports(impl, q.shape, q.dtype)
  if reason is not None:
    warn_once((impl, q.shape, jnp.dtype(q.dtype).name),
               f"{impl} attention cannot take q {q.shape} {jnp.dtype(q.dtype).name} ({reason}); "
               f"using the xla attention")
    impl = "xla"
  if impl == "cudnn":
    try:
      return _cudnn(q, k, v, segment_ids, lengths, scale)
    except (NotImplementedError, RuntimeError) as e:  # no cuDNN, or a shape it refuses
      warn_once(("cudnn", q.shape, str(e)), f"cudnn attention refused q {q.shape}: {e}; "
                 f"using the xla attention")
      impl = "xla"
  if impl == "splash":
    if segment_ids is None:
      segment_ids = jnp.where(jnp.arange(q.shape[1])[None] < lengths[:, None], 1, PAD_SEGMENT)
    return _splash(q, k, v, segment_ids.astype(jnp.int32),
                   q.shape[-1] ** -0.5 if scale is None else float(scale))
  return _xla(q, k, v, segment_ids, lengths, scale)

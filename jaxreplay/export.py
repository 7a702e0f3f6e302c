"""A run's trained policy as a Hugging Face directory: ``python -m jaxreplay.export``.

    python -m jaxreplay.export --workdir runs/default --out exported [--step N | --best]
                               [--dtype bfloat16] [--max-shard-mb 5000]

Writes ``config.json``, the weights (``model.safetensors``, or shards plus an index above
``--max-shard-mb``), ``generation_config.json`` (the run's stop ids and sampler settings)
and the tokenizer (``tokenizer.json``, ``tokenizer_config.json`` with the chat template and
special tokens): ``AutoModelForCausalLM.from_pretrained(out)`` and
``AutoTokenizer.from_pretrained(out)`` open it with no other file.

Only the policy's parameters are read from the checkpoint (an Orbax partial restore of
``train/params``): no buffer, optimizer state or trainer is built. The model comes from the
run's config (the checkpoint's own, else ``WORKDIR/config.json``):

* ``model.source='builtin'``: the embedded decoder is a Llama; its tied embedding with
  logits scaled by D**-0.5 is written untied, ``lm_head = embedding · D**-0.5`` (the same
  logits). The tokenizer is the run's byte-level BPE (``WORKDIR/tokenizer.json``, else the
  warm-start cache entry) with a post-processor that prepends ``<bos>`` (as the trainer
  encodes prompts) and a chat template that renders the user turns as the trained prompt.
* ``model.source='hf'``: the source checkpoint's tokenizer files are copied
  (``model.path`` must still exist).
* ``model.source='gguf'``: the tokenizer and chat template read from the GGUF metadata.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import os
import shutil
import sys
import time
from typing import Any, Sequence

import numpy as np

# The builtin tokenizer's chat template: the user turns' text, after <bos> — exactly the
# prompt the policy was trained on (``models.tokenizer.encode_prompts``).
BUILTIN_CHAT_TEMPLATE = ("{{ bos_token }}{% for message in messages %}"
                         "{% if message['role'] == 'user' %}{{ message['content'] }}{% endif %}"
                         "{% endfor %}")
# Tokenizer files of a Hugging Face checkpoint copied as they are (those present).
HF_TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json", "special_tokens_map.json",
                      "chat_template.jinja", "chat_template.json", "added_tokens.json",
                      "vocab.json", "merges.txt", "tokenizer.model")
DEFAULT_MAX_SHARD_MB = 5000  # transformers' own default shard size (5 GB)


class ExportError(Exception):
  """An export that cannot proceed; its message is one line naming what to change."""


def _path(p):
  """``p`` as an ``epath.Path``; a local path made absolute, since Orbax reads no metadata
  of a checkpoint named by a relative path (orbax-checkpoint 0.12.8)."""
  from etils import epath
  p = str(p)
  return epath.Path(p if "://" in p else os.path.abspath(p))


def checkpoint_steps(directory) -> list[int]:
  """Steps of the complete checkpoints in an Orbax manager directory, ascending.

  A step counts when its directory's name is an integer and it holds ``state`` (Orbax
  renames a save's temporary directory to the step only when it is complete).

  Args:
    directory: ``WORKDIR/checkpoints`` or ``WORKDIR/checkpoints_best`` (path or URL).

  Returns:
    [int] steps; empty when the directory is absent or holds none.
  """
  d = _path(directory)
  if not d.exists():
    return []
  return sorted(int(p.name) for p in d.iterdir()
                if p.name.isdigit() and (p / "state").exists())


def locate(workdir: str, step: int | None = None, best: bool = False) -> tuple[Any, int, dict]:
  """The checkpoint to export: its ``state`` directory, step and run config tree.

  Args:
    workdir: the run directory. step: a step of ``WORKDIR/checkpoints`` (None: the newest).
    best: the checkpoint of ``WORKDIR/checkpoints_best`` (best held-out accuracy) instead.

  Returns:
    (state directory as an ``epath.Path``, step, config tree dict): the config the
    checkpoint was written under, else ``WORKDIR/config.json``.

  Raises:
    ExportError: no checkpoint, an absent ``step`` (the message lists the steps there), or
      no run config.
  """
  if best and step is not None:
    raise ExportError("pass --step or --best, not both")
  sub = "checkpoints_best" if best else "checkpoints"
  steps = checkpoint_steps(_path(workdir) / sub)
  if not steps:
    raise ExportError(f"no checkpoint in {_path(workdir) / sub} (has the run saved one? "
                      "checkpoint.every > 0 saves every N steps and the last)")
  if step is None:
    step = steps[-1]
  elif step not in steps:
    raise ExportError(f"--step {step}: no checkpoint at that step in {_path(workdir) / sub}; "
                      f"steps there: {', '.join(map(str, steps))}")
  step_dir = _path(workdir) / sub / str(step)
  tree = None
  meta_file = step_dir / "meta" / "metadata"
  if meta_file.exists():
    tree = json.loads(meta_file.read_text()).get("config")
  if tree is None:
    cfg_file = _path(workdir) / "config.json"
    if not cfg_file.exists():
      raise ExportError(f"{workdir} has no config.json and checkpoint {step} records no config")
    tree = json.loads(cfg_file.read_text())
  return step_dir / "state", step, tree


def run_specs(tree: dict):
  """The ``RunConfig`` of a saved config tree (sections checked, files not).

  Raises:
    ExportError: a config the current code rejects (the field named).
  """
  from jaxreplay.config import ConfigError, specs
  try:
    return specs(tree)
  except ConfigError as e:
    raise ExportError(f"the run's config does not load: {e}") from None


def policy_config(c) -> Any:
  """The ``TransformerConfig`` of the run's policy, in the checkpoint's parameter dtype.

  Args:
    c: the run's ``RunConfig``.

  Raises:
    ExportError: ``model.path`` of an ``hf``/``gguf`` run no longer exists.
  """
  from jaxreplay.models import hf as hf_models
  from jaxreplay.train.warmstart import builtin_model_config
  m = c.model
  if m.source == "builtin":
    cfg = builtin_model_config(m)
  else:
    from jaxreplay import storage
    path = storage.local_copy(m.path)
    try:
      if m.source == "hf":
        cfg = hf_models.config_from_hf(path, dtype=m.dtype, param_dtype=m.param_dtype)
      else:
        from jaxreplay.models import gguf
        cfg = gguf.config_from_gguf(gguf.resolve_gguf_path(path), dtype=m.dtype,
                                    param_dtype=m.param_dtype)
    except FileNotFoundError as e:
      raise ExportError(f"model.path={m.path!r}: the run's starting checkpoint is needed for "
                        f"its config and tokenizer ({e})") from None
    cfg = dataclasses.replace(cfg, scan_layers=m.scan_layers)
  return cfg


def read_params(state_dir, cfg, lora_spec=None, merge: bool = True):
  """The policy's parameters of a checkpoint, and only those (Orbax partial restore).

  Args:
    state_dir: the checkpoint's ``state`` directory (``locate``).
    cfg: the policy's ``TransformerConfig`` (``policy_config``).
    lora_spec: the run's ``LoraSpec`` (``model.lora``); when enabled the checkpoint holds
      adapters beside the frozen base.
    merge: with adapters, return the merged kernels W + s·A B (``models.lora.merge_adapters``)
      in the plain model's layout; False keeps the adapters (``nnx.LoRAParam`` leaves).

  Returns:
    ``nnx.State`` of the ``nnx.Param`` arrays, on the first device, each in the dtype it was
    saved in (``model.param_dtype``).

  Raises:
    ExportError: the checkpoint's parameters differ from ``cfg``'s (names or shapes).
  """
  import jax
  import orbax.checkpoint as ocp
  from jax.sharding import SingleDeviceSharding

  from jaxreplay.models.hf import abstract_model
  from jaxreplay.parallel.sharding import path_str

  ckptr = ocp.PyTreeCheckpointer()
  meta = ckptr.metadata(state_dir)
  tree = getattr(getattr(meta, "item_metadata", meta), "tree", None) or meta
  saved = tree["train"]["params"]
  dev = SingleDeviceSharding(jax.devices()[0])
  target = {"train": {"params": jax.tree.map(
      lambda m: jax.ShapeDtypeStruct(tuple(m.shape), m.dtype, sharding=dev), saved)}}
  restored = ckptr.restore(state_dir, args=ocp.args.PyTreeRestore(
      item=target, restore_args=ocp.checkpoint_utils.construct_restore_args(target),
      partial_restore=True))["train"]["params"]
  by_path = {}
  for kp, leaf in jax.tree_util.tree_flatten_with_path(restored)[0]:
    p = path_str(kp)
    by_path[p[:-len("/value")] if p.endswith("/value") else p] = leaf
  graphdef, abstract = abstract_model(cfg)
  if lora_spec is not None and lora_spec.enabled:
    graphdef, abstract = _with_adapters(graphdef, abstract, lora_spec)
  flat, treedef = jax.tree_util.tree_flatten_with_path(abstract)
  want = {path_str(kp): tuple(leaf.shape) for kp, leaf in flat}
  missing = sorted(set(want) - set(by_path))
  wrong = [f"{p} {want[p]} vs {tuple(by_path[p].shape)}" for p in want
           if p in by_path and tuple(by_path[p].shape) != want[p]]
  if missing or wrong or set(by_path) - set(want):
    raise ExportError(f"checkpoint {state_dir} does not hold the parameters of the run's model "
                      f"config: missing {missing[:3]}, wrong shape {wrong[:3]}, unexpected "
                      f"{sorted(set(by_path) - set(want))[:3]}")
  params = jax.tree_util.tree_unflatten(treedef, [by_path[path_str(kp)] for kp, _ in flat])
  if lora_spec is not None and lora_spec.enabled and merge:
    from jaxreplay.models import lora
    _, params = lora.merge_adapters(graphdef, params)
  return params


def _with_adapters(graphdef, abstract, spec):
  """(graphdef, abstract params) of the model with ``spec``'s adapters, allocating nothing."""
  import jax

  from jaxreplay.models import lora
  box = {}

  def add(params):
    box["graphdef"], params = lora.add_adapters(graphdef, params, spec, jax.random.key(0))
    return params

  abstract = jax.eval_shape(add, abstract)
  return box["graphdef"], abstract


def hf_weights(cfg, params, dtype: str | None = None) -> tuple[dict, list[tuple[str, np.ndarray]]]:
  """The ``config.json`` dict and (name, host array) tensors of a policy in HF naming.

  A tied model with ``scale_tied_logits`` (the embedded default) is written untied:
  ``lm_head.weight = embedding · D**-0.5`` gives the same logits, which no tied HF family
  computes.

  Args:
    cfg: ``TransformerConfig``. params: its ``nnx.Param`` state. dtype: cast the tensors to
      this dtype (``"bfloat16"``, ``"float32"``); None keeps the parameters' own.

  Returns:
    (config.json dict, [(tensor name, array [out, in] for kernels)]).

  Raises:
    ExportError: a model with no Hugging Face equivalent (the message names the field).
  """
  import jax.numpy as jnp

  from jaxreplay.models import hf as hf_models
  untie = cfg.tie_embeddings and cfg.scale_tied_logits
  try:  # before any array is gathered
    hf = hf_models.hf_config_from_config(
        dataclasses.replace(cfg, tie_embeddings=False, scale_tied_logits=False) if untie else cfg)
  except ValueError as e:
    raise ExportError(f"no Hugging Face equivalent: {e}") from None
  tensors = hf_models.to_hf_tensors(params)
  if untie:
    emb = dict(tensors)["model.embed_tokens.weight"]
    tensors.append(("lm_head.weight",
                    (emb.astype(np.float32) * np.float32(cfg.d_model ** -0.5)).astype(emb.dtype)))
  if dtype is not None:
    tensors = [(n, a.astype(jnp.dtype(dtype))) for n, a in tensors]
  hf["torch_dtype"] = str(np.dtype(tensors[0][1].dtype)) if dtype is None else dtype
  return hf, tensors


def _builtin_tokenizer(c, workdir: str):
  """The run's byte-level BPE: ``WORKDIR/tokenizer.json``, else the warm-start cache's."""
  from tokenizers import Tokenizer

  from jaxreplay.train.warmstart import base_policy_key
  key = base_policy_key(c.task, c.model, c.warmstart, c.sampler.max_new_tokens, c.seed)
  for p in (_path(workdir) / "tokenizer.json",
            _path(c.warmstart.cache_dir) / key / "tokenizer.json"):
    if p.exists():
      return Tokenizer.from_str(p.read_text())
  raise ExportError(f"the run's tokenizer is in neither {workdir}/tokenizer.json nor "
                    f"warmstart.cache_dir={c.warmstart.cache_dir!r}/{key} (a relative cache "
                    "dir is read from the current directory: run the export from where the "
                    "run started)")


def write_tokenizer(c, workdir: str, out: str) -> tuple[list[str], dict]:
  """Writes the run's tokenizer into ``out`` as Hugging Face files.

  Args:
    c: the run's ``RunConfig``. workdir: the run directory. out: the export directory.

  Returns:
    (file names written, {"bos_token_id", "eos_token_id" (list), "pad_token_id"}: the ids
    ``config.json`` and ``generation_config.json`` carry).

  Raises:
    ExportError: the tokenizer cannot be found (the message names ``model.path`` or
      ``warmstart.cache_dir``).
  """
  from tokenizers import processors

  from jaxreplay.models.hf_tokenizer import HFTokenizer
  from jaxreplay.models.tokenizer import BOS, EOS, PAD, special_ids
  m = c.model
  if m.source == "builtin":
    tok = _builtin_tokenizer(c, workdir)
    pad, bos, eos = special_ids(tok)
    tok.post_processor = processors.TemplateProcessing(
        single=f"{BOS} $A", pair=f"{BOS} $A {BOS} $B", special_tokens=[(BOS, bos)])
    tok.save(os.path.join(out, "tokenizer.json"))
    tcfg = {"tokenizer_class": "PreTrainedTokenizerFast", "bos_token": BOS, "eos_token": EOS,
            "pad_token": PAD, "chat_template": BUILTIN_CHAT_TEMPLATE,
            "model_max_length": c.task.prompt_width + c.sampler.max_new_tokens,
            "clean_up_tokenization_spaces": False}
    with open(os.path.join(out, "tokenizer_config.json"), "w") as f:
      json.dump(tcfg, f, indent=2)
    return ["tokenizer.json", "tokenizer_config.json"], {
        "bos_token_id": bos, "eos_token_id": [eos], "pad_token_id": pad}
  from jaxreplay import storage
  path = storage.local_copy(m.path)
  if m.source == "hf":
    try:
      hf = HFTokenizer.from_pretrained(path)
    except (FileNotFoundError, ValueError) as e:
      raise ExportError(f"model.path={m.path!r}: the run's starting checkpoint must still hold "
                        f"its tokenizer ({e})") from None
    names = []
    for name in HF_TOKENIZER_FILES:
      if os.path.exists(os.path.join(path, name)):
        shutil.copyfile(os.path.join(path, name), os.path.join(out, name))
        names.append(name)
    tcfg_file = os.path.join(out, "tokenizer_config.json")
    tcfg = json.load(open(tcfg_file)) if os.path.exists(tcfg_file) else {}
    if "tokenizer_class" not in tcfg:
      # jaxreplay tokenizes with tokenizer.json alone; without a class, transformers picks
      # the model type's, which may rebuild the pre-tokenizer its own way
      with open(tcfg_file, "w") as f:
        json.dump({**tcfg, "tokenizer_class": "PreTrainedTokenizerFast"}, f, indent=2)
      names = list(dict.fromkeys(names + ["tokenizer_config.json"]))
  else:  # gguf: the tokenizer rebuilt from the file's metadata
    from jaxreplay.models import gguf
    hf = HFTokenizer.from_gguf(gguf.resolve_gguf_path(path))
    hf.tokenizer.save(os.path.join(out, "tokenizer.json"))
    tcfg = {"tokenizer_class": "PreTrainedTokenizerFast", **hf.special_tokens,
            "clean_up_tokenization_spaces": False}
    if hf.chat_template:
      tcfg["chat_template"] = hf.chat_template
    with open(os.path.join(out, "tokenizer_config.json"), "w") as f:
      json.dump(tcfg, f, indent=2)
    names = ["tokenizer.json", "tokenizer_config.json"]
  return names, {"bos_token_id": hf.bos_id, "eos_token_id": list(hf.stop_ids),
                 "pad_token_id": hf.pad_id}


def generation_config(c, ids: dict) -> dict:
  """``generation_config.json``: the run's stop ids and its sampler's distribution (the
  one the policy was trained to sample from) and longest completion."""
  s = c.sampler
  out = {**{k: v for k, v in ids.items() if v is not None}, "do_sample": s.temperature > 0,
         "max_new_tokens": s.max_new_tokens}
  if s.temperature > 0:
    out.update(temperature=s.temperature, top_k=s.top_k, top_p=s.top_p)
  return out


def export(workdir: str, out: str, *, step: int | None = None, best: bool = False,
           dtype: str | None = None, max_shard_mb: float = DEFAULT_MAX_SHARD_MB,
           adapters: bool = False) -> dict:
  """Writes a run's policy at a checkpoint as a Hugging Face directory (module docstring).

  A run with ``model.lora`` exports its merged kernels W + s·A B (Hu et al. 2021, eq. 3);
  with ``adapters`` only the adapters, as a PEFT adapter directory
  (``adapter_model.safetensors``, ``adapter_config.json``: ``peft.PeftModel.from_pretrained``
  applies them to the run's starting ``hf`` checkpoint, recorded as its base model).

  Args:
    workdir: the run directory. out: the export directory (created; files of the same names
      overwritten, and a former export's weight files removed).
    step: the checkpoint step (None: the newest). best: the best held-out checkpoint.
    dtype: ``"bfloat16"`` or ``"float32"`` tensors (None: the parameters' dtype).
    max_shard_mb: weights above this many MB are sharded with an index.
    adapters: write the LoRA adapters alone (PEFT layout) instead of the merged model.

  Returns:
    {"out", "step", "files": {name: bytes}, "bytes": total, "source": model.source}.

  Raises:
    ExportError: see ``locate``, ``policy_config``, ``read_params``, ``hf_weights`` and
      ``write_tokenizer``; an unknown ``dtype``; ``adapters`` for a run without
      ``model.lora``.
  """
  from jaxreplay.models import safetensors_io
  if dtype not in (None, "float32", "bfloat16"):
    raise ExportError(f"--dtype {dtype}: one of float32, bfloat16")
  state_dir, step, tree = locate(workdir, step, best)
  c = run_specs(tree)
  cfg = policy_config(c)
  lora_spec = c.model.lora_spec()
  if adapters:
    if not lora_spec.enabled:
      raise ExportError("--adapters needs a run with LoRA adapters (model.lora.rank > 0)")
    from jaxreplay.models import lora
    params = read_params(state_dir, cfg, lora_spec, merge=False)
    names = lora.save_peft(out, params, lora_spec, cfg.n_layers,
                           base_model=c.model.path if c.model.source == "hf" else "")
    files = {n: os.path.getsize(os.path.join(out, n)) for n in names}
    return {"out": out, "step": step, "files": files, "bytes": sum(files.values()),
            "source": c.model.source}
  params = read_params(state_dir, cfg, lora_spec)
  hf, tensors = hf_weights(cfg, params, dtype)
  os.makedirs(out, exist_ok=True)
  for stale in os.listdir(out):  # a former export's weights would mix with these
    if stale.startswith("model") and (stale.endswith(".safetensors")
                                      or stale == "model.safetensors.index.json"):
      os.remove(os.path.join(out, stale))
  names, ids = write_tokenizer(c, workdir, out)
  hf.update({k: v for k, v in ids.items() if v is not None})
  names += safetensors_io.write_checkpoint(out, tensors, int(max_shard_mb * 1e6))
  with open(os.path.join(out, "config.json"), "w") as f:
    json.dump(hf, f, indent=2)
  with open(os.path.join(out, "generation_config.json"), "w") as f:
    json.dump(generation_config(c, ids), f, indent=2)
  names += ["config.json", "generation_config.json"]
  files = {n: os.path.getsize(os.path.join(out, n)) for n in names}
  return {"out": out, "step": step, "files": files, "bytes": sum(files.values()),
          "source": c.model.source}


def run_text_io(c, workdir: str):
  """The run's prompt encoder (``train.policy.TextIO``), built from its tokenizer alone.

  Args:
    c: the run's ``RunConfig``. workdir: the run directory (the builtin tokenizer's home).

  Returns:
    ``TextIO`` (builtin) or ``HFTextIO`` (``hf``/``gguf``, with the run's chat template and
    system turn): ``prompts(examples)`` gives the token rows the run trained on.

  Raises:
    ExportError: the tokenizer cannot be found (see ``_builtin_tokenizer``), or
      ``model.path`` no longer exists.
  """
  from jaxreplay import storage
  from jaxreplay.train.build import checkpoint_text_io
  from jaxreplay.train.policy import TextIO
  t = c.task
  if c.model.source == "builtin":
    return TextIO.create(_builtin_tokenizer(c, workdir), t.prompt_width, t.on_too_long)
  try:
    model = dataclasses.replace(c.model, path=storage.local_copy(c.model.path))
    return checkpoint_text_io(model, t)
  except FileNotFoundError as e:
    raise ExportError(f"model.path={c.model.path!r}: the run's tokenizer is read from its "
                      f"starting checkpoint ({e})") from None


def main(argv: Sequence[str] | None = None) -> dict:
  """The command line (module docstring); prints what it wrote and its size.

  Returns:
    ``export``'s result.

  Raises:
    SystemExit: with one line, on any ``ExportError``.
  """
  p = argparse.ArgumentParser(prog="python -m jaxreplay.export", description=__doc__.split("\n")[0])
  p.add_argument("--workdir", required=True, help="the run directory")
  which = p.add_mutually_exclusive_group()
  which.add_argument("--step", type=int, default=None, help="checkpoint step (default: newest)")
  which.add_argument("--best", action="store_true", help="the best held-out checkpoint")
  p.add_argument("--out", required=True, help="output directory")
  p.add_argument("--dtype", default=None, choices=("float32", "bfloat16"),
                 help="tensor dtype (default: the parameters')")
  p.add_argument("--max-shard-mb", type=float, default=DEFAULT_MAX_SHARD_MB,
                 help="shard the weights above this size")
  p.add_argument("--adapters", action="store_true",
                 help="a LoRA run's adapters alone, as a PEFT adapter directory")
  a = p.parse_args(argv)
  os.environ.setdefault("JAX_PLATFORMS", "cpu")  # a host-side conversion: no accelerator
  from absl import logging
  # Orbax warns of absent optional metadata; quiet only while exporting, so a caller's own
  # logging (main() run in-process, as the tests do) is left as it was
  verbosity = logging.get_verbosity()
  logging.set_verbosity(logging.ERROR)
  t0 = time.time()
  try:
    r = export(a.workdir, a.out, step=a.step, best=a.best, dtype=a.dtype,
               max_shard_mb=a.max_shard_mb, adapters=a.adapters)
  except ExportError as e:
    raise SystemExit(f"jaxreplay.export: {e}") from None
  finally:
    logging.set_verbosity(verbosity)
  for name, size in sorted(r["files"].items()):
    print(f"  {name}  {size / 1e6:.2f} MB")
  print(f"exported step {r['step']} of {a.workdir} ({r['source']}) to {r['out']}: "
        f"{len(r['files'])} files, {r['bytes'] / 1e6:.1f} MB in {time.time() - t0:.1f}s")
  return r


if __name__ == "__main__":
  main(sys.argv[1:])

"""Supervised warm start of the base policy, cached on disk with Orbax.

The base policy is trained by next-token cross-entropy on the completions of the
train split, with a fraction ``label_noise`` of answers replaced by near misses, so
that it starts with real probability on wrong answers — the situation RL with a
verifiable reward is for. The result is saved under a directory keyed by a hash of
everything that determines it, and reused by later runs.
"""

from __future__ import annotations

import contextlib
import hashlib
import json
import os
import time

import filelock
import jax
import jax.numpy as jnp
import numpy as np
import optax
import orbax.checkpoint as ocp
from etils import epath
from flax import nnx

from jaxreplay import storage
from jaxreplay.models import Transformer, TransformerConfig, attention
from jaxreplay.models.spec import ModelSpec
from jaxreplay.models.tokenizer import encode_answers
from jaxreplay.parallel import multihost
from jaxreplay.parallel.sharding import param_shardings
from jaxreplay.rl.scoring import token_logprobs
from jaxreplay.rl.train_step import scheduled_adamw
from jaxreplay.tasks.spec import TaskSpec
from jaxreplay.train.progress import phase
from jaxreplay.train.spec import WarmstartSpec


def noisy_answers(answers, noise: float, rng: np.random.Generator) -> list[str]:
  """Replaces a fraction ``noise`` of integer answers by a near miss (±1, ±2 or ±10).

  Non-integer answers are kept. Called per batch, so the same question gets fresh
  noise each time it is seen: the policy learns a distribution that puts about
  ``1 − noise`` on the right answer instead of memorising fixed wrong labels.
  """
  out = []
  for a in answers:
    if rng.random() < noise:
      try:
        a = str(int(a) + int(rng.choice([-10, -2, -1, 1, 2, 10])))
      except ValueError:
        pass
    out.append(a)
  return out


def model_attention(model: ModelSpec) -> str:
  """The ``TransformerConfig.attention`` impl of ``model.attention`` on this process's
  default backend (``models.attention.resolve``)."""
  return attention.resolve(ModelSpec.from_config(model).attention, jax.default_backend())


def builtin_model_config(model: ModelSpec) -> TransformerConfig:
  """``TransformerConfig`` of the built-in policy of the ``model`` section.

  Args:
    model: the ``ModelSpec`` (or a ``model`` mapping).
  """
  return TransformerConfig(**ModelSpec.from_config(model).architecture(),
                           attention=model_attention(model))


_FILE_DEFAULTS = {"format": "plain", "question_field": "", "answer_field": "", "solution_field": ""}
# Model fields that hash only when set away from these values: caches written before they
# were fields stay valid (remat never changes the parameters, so it never hashes).
_MODEL_DEFAULTS = {"scan_layers": False}


def base_policy_key(task: TaskSpec, model: ModelSpec, warmstart: WarmstartSpec,
                    max_new_tokens: int, seed: int) -> str:
  """Hash of the fields that determine the base policy (and its tokenizer).

  Args:
    task, model, warmstart: the section specs. max_new_tokens: the sampler's longest
      completion (the answers' encoded width). seed: the run's seed.

  Returns:
    16 hex characters (the cache directory's name under ``warmstart.cache_dir``).
  """
  # How rewards are scored does not change the base policy. The file-source options hash
  # only when set away from their defaults, so caches written before they existed stay valid.
  task_d = {k: v for k, v in task.to_dict().items()
            if k not in ("reward_timeout_s", "reward_workers")
            and not (k in _FILE_DEFAULTS and v == _FILE_DEFAULTS[k])}
  # LoRA adapters are added after the warm start, and the attention impl changes float
  # rounding only: neither changes the base policy.
  model_d = {k: v for k, v in model.to_dict().items()
             if k not in ("remat", "lora", "attention") and not (k in _MODEL_DEFAULTS and v == _MODEL_DEFAULTS[k])}
  blob = json.dumps({"task": task_d, "model": model_d,
                     "warmstart": {k: v for k, v in warmstart.to_dict().items()
                                   if k != "cache_dir"},
                     "max_new_tokens": max_new_tokens, "seed": seed},
                    sort_keys=True, default=str)
  return hashlib.sha256(blob.encode()).hexdigest()[:16]


def sft_batches(io, examples, batch_size: int, max_new_tokens: int, noise: float, seed: int):
  """Endless (tokens [B, T], attention_mask [B, T], completion_mask [B, T]) numpy batches
  of prompts with (noisy) answers; deterministic in ``seed``."""
  rng = np.random.default_rng(seed)
  n = len(examples)
  while True:
    idx = rng.integers(0, n, batch_size)
    p, pm, _ = io.prompts([examples[i] for i in idx])
    answers = noisy_answers([examples[i].answer for i in idx], noise, rng)
    a, am = encode_answers(io.tok, answers, max_new_tokens)
    yield (np.concatenate([p, a], 1), np.concatenate([pm, am], 1),
           np.concatenate([np.zeros_like(pm), am], 1))


def train_base_policy(model: ModelSpec, ws: WarmstartSpec, io, task, *, seed: int,
                      max_new_tokens: int, log=print, callback=None, progress: bool = False):
  """Trains the base policy by supervised learning on noisy labels.

  Args:
    model: the built-in architecture. ws: the warm start's settings. io: ``TextIO``.
    task: the task (its train split). seed: initialisation and data seed.
    max_new_tokens: the answers' encoded width (tokens). log: message sink.
    callback: optional ``(step, params)`` called five times during training.
    progress: show a progress bar over the steps (``log.progress``); the phase's duration
      is logged either way (``train.progress.phase``).

  Returns:
    (graphdef, params, info dict with ``sft_loss`` and ``sft_seconds``).
  """
  mcfg = builtin_model_config(model)
  policy = Transformer(mcfg, nnx.Rngs(seed))
  graphdef, params = nnx.split(policy, nnx.Param)
  opt = scheduled_adamw(ws.lr, ws.warmup_steps, 1.0, schedule="cosine",
                        total_steps=max(ws.steps, ws.warmup_steps + 1), final_lr_fraction=0.1)
  opt_state = opt.init(params)

  @jax.jit
  def step(params, opt_state, tokens, attn, comp):
    def loss_fn(p):
      logp, _ = token_logprobs(graphdef, p, tokens, attn)
      return -(logp * comp).sum() / jnp.maximum(comp.sum(), 1)
    loss, g = jax.value_and_grad(loss_fn)(params)
    upd, opt_state = opt.update(g, opt_state, params)
    return optax.apply_updates(params, upd), opt_state, loss

  batches = sft_batches(io, task.train, ws.batch_size, max_new_tokens, ws.label_noise, seed)
  t0 = time.time()
  loss = float("nan")
  with phase("warm start", enabled=progress, log=log, total=ws.steps, unit="step") as bar:
    for i in range(ws.steps):
      params, opt_state, loss = step(params, opt_state, *next(batches))
      bar.update(1)
      if (i + 1) % max(ws.steps // 5, 1) == 0:
        log(f"warm start {i + 1}/{ws.steps}: loss {float(loss):.3f} ({time.time() - t0:.0f}s)")
        if callback is not None:
          callback(i + 1, params)
  return graphdef, params, {"sft_loss": float(loss), "sft_seconds": time.time() - t0}


def load_or_train_base_policy(model: ModelSpec, ws: WarmstartSpec, io, task, *, key: str,
                              seed: int, max_new_tokens: int, log=print, mesh=None,
                              progress: bool = False):
  """The cached base policy (Orbax) under ``ws.cache_dir/key``, trained and saved on first use.

  With ``mesh`` the parameters come back laid out by ``parallel.PARAM_RULES`` on it: a
  cached policy is restored straight into that layout (each process reads only its
  devices' shards); a fresh one is trained by every process alike (same data, same
  seed) and then placed. In a multi-process job every process takes part in the Orbax
  save, and process 0 alone writes ``info.json``, after which all continue.

  Args:
    model, ws: the ``model`` and ``warmstart`` specs. io: ``TextIO``. task: the task.
    key: the cache key (``base_policy_key``). seed, max_new_tokens: as in
    ``train_base_policy``. log: message sink. mesh: optional device mesh.
    progress: progress bars for the warm start and the cache load (``log.progress``).

  Returns:
    (graphdef, params, info dict with ``path`` and ``cached``).
  """
  path = os.path.join(ws.cache_dir, key)
  path = path if storage.is_remote(path) else os.path.abspath(path)  # gs:// stays a URL
  mcfg = builtin_model_config(model)
  graphdef, abstract = nnx.split(nnx.eval_shape(lambda: Transformer(mcfg, nnx.Rngs(0))), nnx.Param)
  shardings = None if mesh is None else param_shardings(abstract, mesh)
  if shardings is not None:
    abstract = jax.tree.map(lambda x, sh: jax.ShapeDtypeStruct(x.shape, x.dtype, sharding=sh),
                            abstract, shardings)
  with _entry_lock(path):
    return _load_or_train(path, graphdef, abstract, shardings, model, ws, io, task, seed=seed,
                          max_new_tokens=max_new_tokens, log=log, progress=progress)


@contextlib.contextmanager
def _entry_lock(path: str):
  """Holds an exclusive lock on cache entry ``path`` (a local directory) while it is read or
  written, so that independent jobs on one host sharing ``warmstart.cache_dir`` (parallel test
  workers, sweep runs started side by side) train each base policy once: the first writes it,
  the others wait and then load it. Remote entries and multi-process jobs take no lock: a
  job's processes train alike and synchronise with a barrier, and a lock held by one of them
  would keep the others from that barrier."""
  if storage.is_remote(path) or jax.process_count() > 1:
    yield
    return
  os.makedirs(path, exist_ok=True)
  with filelock.FileLock(os.path.join(path, ".lock")):
    yield


def _load_or_train(path, graphdef, abstract, shardings, model, ws, io, task, *, seed, max_new_tokens,
                   log, progress=False):
  """``load_or_train_base_policy``'s body, run under the entry's lock."""
  ckptr = ocp.StandardCheckpointer()
  # info.json is written last (atomically): it marks a complete cache entry; params without
  # it are the leftover of a process killed mid-write and are trained and written again.
  if storage.exists(os.path.join(path, "info.json")):
    with phase("base policy load", enabled=progress, log=log):
      params = ckptr.restore(os.path.join(path, "params"), abstract)
    info = json.loads(epath.Path(path, "info.json").read_text())
    log(f"loaded base policy from {path}")
    return graphdef, params, dict(info, path=path, cached=True)
  graphdef, params, info = train_base_policy(model, ws, io, task, seed=seed,
                                             max_new_tokens=max_new_tokens, log=log,
                                             progress=progress)
  if shardings is not None:
    params = jax.tree.map(multihost.to_global, params, shardings)
  epath.Path(path).mkdir(parents=True, exist_ok=True)
  ckptr.save(os.path.join(path, "params"), params, force=True)
  ckptr.wait_until_finished()
  from jaxreplay.train.checkpoint import fault_point, write_atomic
  fault_point("kill_during_cache_write")
  if multihost.is_primary():
    write_atomic(os.path.join(path, "info.json"), json.dumps(info))
  multihost.barrier("jaxreplay_base_policy_saved")
  log(f"saved base policy to {path}")
  return graphdef, params, dict(info, path=path, cached=False)

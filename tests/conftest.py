"""Test set-up: 8 fake CPU devices (for sharding tests), set before JAX is imported, and one
scratch directory per test session shared by every pytest-xdist worker and every process the
tests start: base policies (keyed as the main job keys them) and JAX's persistent compilation
cache, so that what one test file trains or compiles, the others load."""

import contextlib
import os
import shutil
import tempfile

import pytest

# The suite's programs are small and most are compiled once, so compiling is most of its time:
# LLVM's optimisation level 0 (``--xla_backend_optimization_level=0``) and XLA:CPU's elemental
# emitters (``--xla_cpu_use_fusion_emitters=false``) compile them faster. On the 2-core dev
# machine (2026-12-05, two workers; per file, the summed durations) the suite took 668 s with
# both against 917 s with the emitters alone; test_learner_packing.py 39 s against 101 s, test_lora.py 45 s against
# 92 s; the runs that compute more than they compile are slower, test_train_e2e.py 285 s
# against 243 s and test_train_smollm2.py 181 s against 136 s. .ci/run's numerics tier sets
# its own XLA_FLAGS and so compiles with XLA's defaults: the floating-point comparisons are
# checked under both. An XLA_FLAGS set by the user is kept as it is.
TEST_XLA_FLAGS = "--xla_cpu_use_fusion_emitters=false --xla_backend_optimization_level=0"
os.environ.setdefault("XLA_FLAGS", f"--xla_force_host_platform_device_count=8 {TEST_XLA_FLAGS}")
os.environ.setdefault("JAX_PLATFORMS", "cpu")
# glibc writes why it aborts (a heap check, an assertion) to the terminal, which a pytest-xdist
# worker or a CI log does not have; with this set it writes to stderr, where the log keeps it.
os.environ.setdefault("LIBC_FATAL_STDERR_", "1")

SESSION_ENV = "JAXREPLAY_TEST_SESSION_DIR"
_OWNED = pytest.StashKey[str]()


def pytest_configure(config):
  """Creates the session's shared directory in the controlling process, before any worker
  starts (workers and subprocesses inherit the environment), and points JAX's persistent
  compilation cache at it. An explicit ``JAX_COMPILATION_CACHE_DIR`` is kept."""
  if SESSION_ENV not in os.environ:  # the controller (or a run without xdist)
    os.environ[SESSION_ENV] = tempfile.mkdtemp(prefix="jaxreplay-tests-")
    config.stash[_OWNED] = os.environ[SESSION_ENV]
  session = os.environ[SESSION_ENV]
  os.environ.setdefault("JAX_COMPILATION_CACHE_DIR", os.path.join(session, "xla_cache"))
  # Every compiled program is worth keeping: the tests' models are tiny, so most compiles
  # take well under JAX's default threshold of 1 s, yet the same ones recur across files.
  os.environ.setdefault("JAX_PERSISTENT_CACHE_MIN_COMPILE_TIME_SECS", "0")
  # xdist's loadfile/loadscope scheduling sorts files by their number of tests unless told
  # not to, which would put the long end-to-end files (one to four tests each) last; the
  # order of ``pytest_collection_modifyitems`` below is the one wanted.
  if hasattr(config.option, "loadscopereorder"):
    config.option.loadscopereorder = False


def pytest_unconfigure(config):
  """Removes the session's shared directory, in the process that created it."""
  owned = config.stash.get(_OWNED, None)
  if owned is not None:
    shutil.rmtree(owned, ignore_errors=True)
    os.environ.pop(SESSION_ENV, None)


def xla_flags(devices: int) -> str:
  """The session's ``XLA_FLAGS`` for a process the tests start with ``devices`` fake CPU
  devices: the same flags (emitters, an ISA cap set by .ci/run) with only the device count
  replaced, so that a subprocess compiles as the test that compares with it does."""
  flags = [f for f in os.environ.get("XLA_FLAGS", "").split()
           if not f.startswith("--xla_force_host_platform_device_count")]
  return " ".join([f"--xla_force_host_platform_device_count={devices}", *flags])


@pytest.fixture(scope="session")
def base_policy_cache() -> str:
  """``warmstart.cache_dir`` shared by the session's tests: a base policy is trained once
  per key (its entry is locked while written) and loaded by every later test and worker."""
  path = os.path.join(os.environ[SESSION_ENV], "base_policies")
  os.makedirs(path, exist_ok=True)
  return path


# The files whose module fixtures and end-to-end runs take a minute or more on 2 cores, longest
# first as far as --durations runs on the 2-core dev machine (2026-12-04) measured them. With
# ``--dist loadfile`` xdist hands out whole files in collection order; started first, they
# leave the many short files to fill in behind them, so the workers finish together instead
# of one running a long file alone at the end.
LONG_FILES = ("test_train_e2e.py", "test_train_smollm2.py", "test_multiprocess.py",
              "test_train_modes.py", "test_split.py", "test_notebook.py", "test_crash_kill.py",
              "test_train_mesh.py", "test_sweep.py", "test_learner_packing.py",
              "test_auto_replay.py", "test_export.py", "test_train_hf.py", "test_models_gguf.py",
              "test_math_tasks.py", "test_samples.py")


def pytest_collection_modifyitems(config, items):
  """Runs ``LONG_FILES`` first, in that order, then the rest in collection order (a stable
  sort: each file's tests keep their order)."""
  rank = {name: i for i, name in enumerate(LONG_FILES)}
  items.sort(key=lambda item: rank.get(item.path.name, len(rank)))


def pytest_xdist_auto_num_workers(config):
  """Workers for ``-n auto`` (pyproject's addopts): one per core, at most 4. Each worker is a
  JAX process with 8 fake devices, and ``--dist loadfile`` keeps a file's module fixtures
  (a trained base policy, a sweep) in one worker; the cap bounds memory on many-core hosts
  (measured: 2 workers on 2 cores, 25.4 min against 34.0 min in one process)."""
  return max(1, min(os.cpu_count() or 1, 4))


def load_bench(name: str, folder: str = "bench"):
  """The module ``FOLDER/NAME.py`` (bench/ and tools/ are scripts, not packages)."""
  import importlib.util
  path = os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), folder,
                      name + ".py")
  spec = importlib.util.spec_from_file_location(name, path)
  mod = importlib.util.module_from_spec(spec)
  spec.loader.exec_module(mod)
  return mod


# Floating-point tolerances. Two paths to one value (micro-batches, chunks, packing, shards,
# scan vs loop, another CPU's vector width) round the same terms in different orders; these
# give the largest difference that reordering alone can make, so a test fails only on a
# real difference (a wrong normaliser or a lost token moves the value by far more).
def reorder_tol(n: int, dtype="float32", scale: float = 1.0) -> float:
  """(n - 1)·eps·scale: the most two summation orders of the same n terms can differ by.

  Any order's error is at most (n - 1)·u·Σ|x| with u = eps/2 (Higham, Accuracy and
  Stability of Numerical Algorithms, 2nd ed., §4.2), so two orders differ by at most
  (n - 1)·eps·Σ|x|. Along a chain of reductions the bounds add to first order: n is the
  sum of the chain's lengths (``forward_terms`` for a transformer's forward pass).

  Args:
    n: terms summed along the chain that the two paths order differently.
    dtype: the dtype the sums round in (bfloat16's eps is 2⁻⁷).
    scale: for an ``rtol``, cond = Σ|x| / |Σx| (1 when the terms share a sign); for an
      ``atol``, Σ|x| (for a mean: the mean size of the terms).
  """
  import ml_dtypes
  return max(n - 1, 1) * float(ml_dtypes.finfo(dtype).eps) * scale


def forward_terms(cfg, t: int) -> int:
  """The n of ``reorder_tol`` for one position's logits and log-softmax through a
  ``TransformerConfig`` ``cfg`` over ``t`` positions: the lengths of the reductions along
  the chain. Per layer: RMSNorm and the q/k/v projections (d_model each), QK-norm (head_dim
  each, if on), the attention scores (head_dim), softmax and the weighted values (t each),
  the output projection (heads·head_dim), RMSNorm and gate/up (d_model each), down (d_ff),
  two residual adds; then the final norm and the logits (d_model each) and the log-softmax
  (vocab). A gradient runs the transposed reductions back: twice this, plus the positions
  a weight's gradient sums."""
  layer = (4 * cfg.d_model + cfg.head_dim + 2 * t + cfg.n_heads * cfg.head_dim + cfg.d_ff + 2
           + (2 * cfg.head_dim if cfg.qk_norm else 0))
  return cfg.n_layers * layer + 2 * cfg.d_model + cfg.vocab_size


def logprob_tol(cfg, logits) -> float:
  """The absolute tolerance of a log-prob or entropy of ``logits`` [B, T, V] (float32, from a
  ``TransformerConfig`` ``cfg``) reached along another order: ``reorder_tol`` of the forward
  chain, twice (log-softmax differences two logits). Its scale, the largest |logit|, stands
  for the size of the terms summed along the chain (RMS-normed activations and d^-1/2
  weights keep them about that size). A loss term exp(log-ratio)·A then moves by at most
  this fraction of its size."""
  import numpy as np
  scale = float(np.abs(np.asarray(logits)).max())
  return 2 * reorder_tol(forward_terms(cfg, logits.shape[1]), scale=scale)


@contextlib.contextmanager
def abs_terms():
  """Within it, ``rl.losses.aggregate`` aggregates |x|: a loss traced inside evaluates to
  Σ|x| over its normaliser, the ``scale`` of ``reorder_tol`` for that loss. Build and jit
  the loss function inside (a function compiled before would keep the signed sum)."""
  from jaxreplay.rl import losses
  signed = losses.aggregate
  losses.aggregate = lambda x, *args, **kw: signed(abs(x), *args, **kw)
  try:
    yield
  finally:
    losses.aggregate = signed


# The job's entry points take a validated ``RunConfig``; tests build config trees, so these
# validate first, as ``python -m jaxreplay.main`` does.
def run(cfg, log=print):
  """``jaxreplay.train.loop.run`` of a config tree (validated first)."""
  from jaxreplay import config as config_lib
  from jaxreplay.train import loop
  return loop.run(config_lib.validate(cfg), log)


def restore(cfg, log=print):
  """``jaxreplay.train.loop.restore`` of a config tree (validated first)."""
  from jaxreplay import config as config_lib
  from jaxreplay.train import loop
  return loop.restore(config_lib.validate(cfg), log)


def build(cfg, log=print):
  """``jaxreplay.train.build.build`` of a config tree (validated first)."""
  from jaxreplay import config as config_lib
  from jaxreplay.train import build as build_lib
  return build_lib.build(config_lib.validate(cfg), log)


def apply_overrides(c, overrides):
  """Sets each ``"section.field": value`` of ``overrides`` on config ``c``; returns ``c``."""
  for k, v in overrides.items():
    node = c
    *path, last = k.split(".")
    for p in path:
      node = node[p]
    node[last] = v
  return c


def tiny_run_config(workdir, cache_dir, **overrides):
  """configs/small.py shrunk to seconds: a 1-layer d=32 decoder warm-started for 20 steps,
  R = 16 rollouts per step (groups of 4), B = 32 from a buffer of 64, 6 steps with an
  evaluation (8 × 2), a checkpoint and a drift sample every 3, on one device (``mesh.data=1``:
  what these runs check is the loop, not the layout, and one device's programs are not
  partitioned; test_train_mesh and test_train_e2e's exact resume pass a mesh over all 8).

  The end-to-end tests that need a run but not a learning policy share these shapes
  (``overrides`` that keep them: steps, modes, mesh, what is evaluated when), so that JAX's
  persistent compilation cache serves one file's programs to the next."""
  from jaxreplay.config import load_config
  root = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
  c = load_config(os.path.join(root, "configs", "small.py"))
  c.workdir = str(workdir)
  c.warmstart.cache_dir = str(cache_dir)
  c.log.progress = False
  c.log.tensorboard = False
  c.warmstart.steps = 20
  c.task.train_size, c.task.heldout_size = 400, 64
  c.model.update(d_model=32, n_layers=1, n_heads=2, n_kv_heads=1, head_dim=16, d_ff=64)
  c.rollout.update(per_step=16, group_size=4)
  c.buffer.capacity = 64
  c.train.update(steps=6, batch_size=32)
  c.algo.warmup_steps = 1
  c.eval.update(every=3, num_examples=8, samples_per_example=2)
  c.checkpoint.every = 3
  c.drift.update(every=3, num_samples=32)
  c.mesh.data = 1
  return apply_overrides(c, overrides)


def save_tiny_qwen2(directory: str, tok) -> None:
  """Writes a tiny random Qwen2 (2 layers, d = 32, tied embeddings, ``torch.manual_seed(0)``)
  for the ``tokenizers`` tokenizer ``tok`` into ``directory``: its tokenizer.json, a ChatML
  tokenizer_config.json (eos ``<|im_end|>``, pad ``<|endoftext|>``) and the safetensors
  checkpoint. The tests that train or export a Hugging Face checkpoint build theirs so."""
  import json

  import torch
  import transformers

  from test_models_tokenizer import CHATML
  tok.save(os.path.join(directory, "tokenizer.json"))
  with open(os.path.join(directory, "tokenizer_config.json"), "w") as f:
    json.dump({"chat_template": CHATML, "eos_token": "<|im_end|>", "pad_token": "<|endoftext|>"}, f)
  torch.manual_seed(0)
  hcfg = transformers.Qwen2Config(
      vocab_size=tok.get_vocab_size(), hidden_size=32, intermediate_size=64,
      num_hidden_layers=2, num_attention_heads=2, num_key_value_heads=1,
      max_position_embeddings=1024, tie_word_embeddings=True,
      eos_token_id=tok.token_to_id("<|im_end|>"))
  transformers.Qwen2ForCausalLM(hcfg).save_pretrained(directory)


def tiny_run_argv(c) -> list:
  """``python -m jaxreplay.main`` on configs/small.py with the fields ``tiny_run_config`` (and
  the mode tests) set, read from config ``c``: the same run as a subprocess."""
  import sys
  root = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
  args = [f"{sec}.{k}={c[sec][k]}" for sec, keys in (
      ("task", ("train_size", "heldout_size")),
      ("model", ("d_model", "n_layers", "n_heads", "n_kv_heads", "head_dim", "d_ff")),
      ("warmstart", ("steps", "cache_dir")), ("rollout", ("per_step", "group_size")),
      ("train", ("batch_size", "steps", "mode", "async_timeout_s")), ("buffer", ("capacity",)),
      ("algo", ("warmup_steps",)), ("eval", ("every", "num_examples", "samples_per_example")),
      ("checkpoint", ("every",)), ("drift", ("every", "num_samples")),
      ("log", ("progress", "tensorboard")), ("mesh", ("data",))) for k in keys] + [f"workdir={c.workdir}"]
  return [sys.executable, "-m", "jaxreplay.main", "--config",
          os.path.join(root, "configs", "small.py"), *[f"--config.{a}" for a in args]]


def run_processes(script: str, args: list, n: int = 2, devices: int = 2, env: dict | None = None,
                  timeout_s: float = 600) -> list[str]:
  """Runs ``tests/SCRIPT PROCESS_ID N PORT *ARGS`` as ``n`` local JAX processes (``devices``
  fake CPU devices each, a free coordinator port) and waits for all of them.

  Returns:
    Each process's combined stdout and stderr.

  Raises:
    AssertionError: a process exited non-zero (its output's tail in the message).
    subprocess.TimeoutExpired: a process ran past ``timeout_s`` (all are killed).
  """
  import socket
  import subprocess
  import sys
  with socket.socket() as sock:
    sock.bind(("127.0.0.1", 0))
    port = str(sock.getsockname()[1])
  here = os.path.dirname(os.path.abspath(__file__))
  env = dict(os.environ, XLA_FLAGS=xla_flags(devices), JAX_PLATFORMS="cpu", **(env or {}))
  procs = [subprocess.Popen([sys.executable, os.path.join(here, script), str(i), str(n), port,
                             *map(str, args)], env=env, stdout=subprocess.PIPE,
                            stderr=subprocess.STDOUT, text=True) for i in range(n)]
  logs = []
  for p in procs:
    try:
      logs.append(p.communicate(timeout=timeout_s)[0])
    except subprocess.TimeoutExpired:
      for q in procs:
        q.kill()
      raise
  for i, p in enumerate(procs):
    assert p.returncode == 0, f"process {i} failed:\n{logs[i][-4000:]}"
  return logs

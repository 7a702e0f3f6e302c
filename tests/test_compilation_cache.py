"""``train.compilation_cache_dir``: the entry point turns JAX's persistent compilation cache on."""

import os
import subprocess

import jax
import pytest

from conftest import tiny_run_argv, tiny_run_config
from jaxreplay.main import enable_compilation_cache

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


@pytest.fixture
def jax_cache_setting():
  """Restores JAX's cache directory after a test that sets it."""
  before = jax.config.jax_compilation_cache_dir
  yield
  jax.config.update("jax_compilation_cache_dir", before)


def test_the_cache_directory_is_expanded_off_when_empty_and_the_variable_wins(
    monkeypatch, tmp_path, jax_cache_setting):
  monkeypatch.delenv("JAX_COMPILATION_CACHE_DIR", raising=False)
  monkeypatch.setenv("HOME", str(tmp_path))
  assert enable_compilation_cache("~/xla") == str(tmp_path / "xla")
  assert jax.config.jax_compilation_cache_dir == str(tmp_path / "xla")
  jax.config.update("jax_compilation_cache_dir", None)
  assert enable_compilation_cache("") is None
  assert jax.config.jax_compilation_cache_dir is None
  assert enable_compilation_cache("gs://bucket/xla") == "gs://bucket/xla"  # URLs as given
  jax.config.update("jax_compilation_cache_dir", None)
  monkeypatch.setenv("JAX_COMPILATION_CACHE_DIR", "/elsewhere")
  assert enable_compilation_cache("~/xla") == "/elsewhere"
  assert jax.config.jax_compilation_cache_dir is None  # left to JAX, which reads the variable


@pytest.mark.slow
def test_the_main_job_writes_its_programs_to_the_configured_cache(tmp_path, base_policy_cache):
  # An async run whose learner gives up at once: it builds, loads the shared base policy
  # and compiles its first programs, then stops in one line — the cache's wiring at a
  # fraction of a whole run's compiles (this process cannot share the session's cache).
  c = tiny_run_config(tmp_path / "run", base_policy_cache, **{
      "train.mode": "async", "train.steps": 3, "train.async_timeout_s": 1e-6})
  cache = tmp_path / "xla"
  env = {k: v for k, v in os.environ.items() if k != "JAX_COMPILATION_CACHE_DIR"}
  env["JAX_PERSISTENT_CACHE_MIN_COMPILE_TIME_SECS"] = "0"  # every program, however quick
  out = subprocess.run(tiny_run_argv(c) + [f"--config.train.compilation_cache_dir={cache}"],
                       capture_output=True, text=True, timeout=600, cwd=ROOT, env=env)
  assert out.returncode == 1, out.stderr[-2000:]
  assert out.stderr.strip().splitlines()[-1].startswith("jaxreplay: async mode: no batch")
  entries = [p for p in cache.iterdir() if p.name.endswith("-cache")]
  assert len(entries) >= 3, sorted(p.name for p in cache.iterdir())

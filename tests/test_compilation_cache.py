"""What the entry point sets before JAX starts: the persistent compilation cache
(``train.compilation_cache_dir``) and the GPU memory pool (``train.device_memory_fraction``)."""

import os
import subprocess
import sys

import jax
import pytest

from conftest import tiny_run_argv, tiny_run_config
from jaxreplay.config import ConfigError, load_config, specs
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


def _in_fresh_process(code: str, **env) -> subprocess.CompletedProcess:
  base = {k: v for k, v in os.environ.items() if k != "XLA_PYTHON_CLIENT_MEM_FRACTION"}
  return subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                        timeout=300, cwd=ROOT, env={**base, **env})


def test_the_memory_fraction_is_set_before_the_backend_and_the_variable_wins():
  setter = "from jaxreplay.main import set_device_memory_fraction as f; import os\n"
  out = _in_fresh_process(setter + "print(f(0.9), os.environ['XLA_PYTHON_CLIENT_MEM_FRACTION'])\n"
                          "import jax; jax.devices(); print(f(0.9))")
  assert out.returncode == 0, out.stderr[-2000:]
  assert out.stdout.split() == ["0.9", "0.9", "0.9"]  # set once; later calls read it back
  out = _in_fresh_process(setter + "print(f(0.0), 'XLA_PYTHON_CLIENT_MEM_FRACTION' in os.environ)")
  assert out.stdout.split() == ["None", "False"], out.stderr[-2000:]  # 0: JAX's default
  out = _in_fresh_process(setter + "print(f(0.9))", XLA_PYTHON_CLIENT_MEM_FRACTION="0.5")
  assert out.stdout.split() == ["0.5"], out.stderr[-2000:]  # the user's variable wins
  out = _in_fresh_process(setter + "import jax; jax.devices(); f(0.9)")
  assert out.returncode == 1
  assert "RuntimeError: train.device_memory_fraction must be set before JAX starts" in out.stderr


@pytest.mark.parametrize("bad", [1.0, -0.1])
def test_a_memory_fraction_outside_0_1_names_the_field(bad):
  c = load_config(os.path.join(ROOT, "configs", "default.py"))
  c.train.device_memory_fraction = bad
  with pytest.raises(ConfigError, match="train.device_memory_fraction"):
    specs(c)

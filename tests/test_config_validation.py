"""Bad configs fail in ``config.validate`` (before any compute) with a ConfigError that names
the field, the value and what is allowed: mesh sizes, sizes that do not split over the mesh,
and the basic range checks."""

import os

import pytest

from jaxreplay import config as config_lib
from jaxreplay.config import ConfigError

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def _default(**overrides):
  c = config_lib.load_config(os.path.join(ROOT, "configs", "default.py"))
  for k, v in overrides.items():
    sec, name = k.split(".")
    c[sec][name] = v
  return c


@pytest.mark.parametrize("mesh,devices,expected", [
    ((-1, 1, 1), 8, (8, 1, 1)),
    ((-1, 2, 1), 8, (4, 2, 1)),
    ((2, -1, 2), 8, (2, 2, 2)),
    ((8, 1, 1), 8, (8, 1, 1)),
    ((1, 1, 1), 8, (1, 1, 1)),   # a divisor: the first device only
    ((4, 1, 1), 8, (4, 1, 1)),
    ((-1, 1, 1), 1, (1, 1, 1)),
])
def test_mesh_shape_resolves(mesh, devices, expected):
  c = _default(**{"mesh.data": mesh[0], "mesh.fsdp": mesh[1], "mesh.tensor": mesh[2]})
  assert config_lib.mesh_shape(c, devices) == expected


@pytest.mark.parametrize("mesh,devices,match", [
    ((3, 1, 1), 8, r"config.mesh=\{'data': 3, 'fsdp': 1, 'tensor': 1\} is invalid: the product "
                   r"of the sizes \(3\) must divide jax.device_count\(\)=8"),
    ((-1, 3, 1), 8, r"product of the sizes \(3\) must divide jax.device_count\(\)=8"),
    ((16, 1, 1), 8, r"\(16\) must divide jax.device_count\(\)=8"),
    ((-1, -1, 1), 8, r"at most one of data, fsdp, tensor may be -1"),
    ((0, 1, 1), 8, r"config.mesh.data=0 is invalid: must be a positive int, or -1"),
    ((8, -2, 1), 8, r"config.mesh.fsdp=-2 is invalid"),
    ((2, 2, 4), 8, r"product of the sizes \(16\) must divide"),
    ((1, 1, 0), 8, r"config.mesh.tensor=0 is invalid"),
])
def test_bad_mesh_names_sizes_and_device_count(mesh, devices, match):
  c = _default(**{"mesh.data": mesh[0], "mesh.fsdp": mesh[1], "mesh.tensor": mesh[2]})
  with pytest.raises(ConfigError, match=match):
    config_lib.validate(c, device_count=devices)


@pytest.mark.parametrize("field,value", [
    ("train.batch_size", 252), ("rollout.per_step", 124), ("buffer.capacity", 516)])
def test_sizes_must_split_over_data_times_fsdp(field, value):
  # data=-1 on 8 devices: data×fsdp = 8; 252, 124 (31 groups of 4) and 516 are even but
  # not multiples of 8.
  over = {field: value}
  if field == "rollout.per_step":
    over["rollout.group_size"] = 4
  c = _default(**over)
  with pytest.raises(ConfigError, match=rf"config.{field}={value} is invalid: must be divisible by "
                     r"mesh data×fsdp = 8×1 = 8"):
    config_lib.validate(c, device_count=8)
  config_lib.validate(c, device_count=2)  # fine on 2 devices (data=2)
  c.mesh.data = 1  # or with a 1-device mesh on 8 devices
  config_lib.validate(c, device_count=8)


def test_fsdp_counts_towards_the_batch_split():
  c = _default(**{"mesh.data": 2, "mesh.fsdp": 4, "train.batch_size": 260, "buffer.capacity": 520})
  with pytest.raises(ConfigError, match=r"config.train.batch_size=260 .* 2×4 = 8"):
    config_lib.validate(c, device_count=8)


@pytest.mark.parametrize("field,value,match", [
    ("buffer.capacity", 128, r"config.buffer.capacity=128 is invalid: must be >= "
                             r"train.batch_size=256"),
    ("rollout.group_size", 1, r"config.rollout.group_size=1 is invalid: "
                              r"algo.advantage='grpo' needs groups of >= 2"),
    ("sampler.temperature", -0.5, r"config.sampler.temperature=-0.5 is invalid: must be > 0"),
    ("sampler.temperature", 0.0, r"config.sampler.temperature=0.0 is invalid: must be > 0"),
    ("checkpoint.max_to_keep", 0, r"config.checkpoint.max_to_keep=0 is invalid: must be >= 1"),
    ("rollout.behaviour_logprobs", "learnr", r"config.rollout.behaviour_logprobs='learnr' is "
                                             r"invalid: must be one of \('sampler', 'learner'\) \(did you mean 'learner'\?\)"),
    ("eval.batch_rows", 0, r"config.eval.batch_rows=0 is invalid: must be >= 1"),
    ("sampler.attention", "flash", r"config.sampler.attention='flash' is invalid: must be one "
                                   r"of \('auto', 'xla', 'pallas'\)"),
    ("sampler.page_size", 0, r"config.sampler.page_size=0 is invalid: must be >= 1"),
    ("sampler.num_pages", -1, r"config.sampler.num_pages=-1 is invalid: must be >= 0"),
])
def test_range_checks(field, value, match):
  c = _default(**{field: value})
  with pytest.raises(ConfigError, match=match):
    config_lib.validate(c, device_count=8)


def test_group_size_one_is_fine_without_a_group_baseline():
  c = _default(**{"rollout.group_size": 1, "algo.advantage": "gae"})
  config_lib.validate(c, device_count=8)


def test_bad_mesh_fails_in_run_before_any_compute(tmp_path, monkeypatch):
  """Validation raises the ConfigError before the job builds a task, tokenizer or model."""
  from jaxreplay.train import build as build_lib
  from jaxreplay.train import loop
  c = _default(**{"mesh.data": 3})
  c.workdir = str(tmp_path / "wd")

  def boom(*_a, **_k):
    raise AssertionError("reached the task builder")

  monkeypatch.setattr(build_lib, "make_task", boom)
  with pytest.raises(ConfigError, match="config.mesh="):
    loop.run(config_lib.validate(c), log=lambda *_: None)

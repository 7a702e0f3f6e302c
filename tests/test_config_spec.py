"""Every config section is a frozen spec: defaults in one place, one-line errors for any bad
value (a hypothesis property over random invalid configs), a generated field reference, and
no module outside config.py reading the tree."""

import dataclasses
import math
import os
import re
import subprocess
import sys

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from jaxreplay import config as config_lib
from jaxreplay.config import SECTIONS, ConfigError
from jaxreplay.spec import _kinds, attribute_docs

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def default_tree() -> dict:
  return config_lib.load_config(os.path.join(ROOT, "configs", "default.py")).to_dict()


def test_default_config_states_every_field_at_the_spec_default():
  tree = default_tree()
  assert set(tree) == set(SECTIONS) | {"seed", "workdir"}
  for section, spec_cls in SECTIONS.items():
    names = {f.name for f in dataclasses.fields(spec_cls)}
    assert set(tree[section]) == names, section
    assert spec_cls.from_config(tree[section]) == spec_cls(), section


def test_every_field_has_a_one_line_meaning():
  for section, spec_cls in SECTIONS.items():
    meanings = attribute_docs(spec_cls)
    for f in dataclasses.fields(spec_cls):
      assert meanings.get(f.name), f"{section}.{f.name} has no entry under Attributes:"


def test_specs_are_frozen_and_validated_on_replace():
  spec = SECTIONS["train"]()
  with pytest.raises(dataclasses.FrozenInstanceError):
    spec.steps = 3
  with pytest.raises(ConfigError, match=r"^train\.steps=-1 is invalid: must be >= 0$"):
    dataclasses.replace(spec, steps=-1)


def test_the_reference_page_is_current():
  out = subprocess.run([sys.executable, "-m", "jaxreplay.config_reference", "--check"],
                       cwd=ROOT, capture_output=True, text=True, timeout=120)
  assert out.returncode == 0, out.stderr


@pytest.mark.parametrize("overrides,match", [
    ({"model.n_heads": 3}, r"^config\.model\.n_kv_heads=2 is invalid: must divide "
                           r"model\.n_heads=3$"),
    ({"model.n_heads": 6, "model.n_kv_heads": 3},
     r"^config\.model\.n_heads=6 is invalid: must divide model\.d_model=128$"),
    ({"model.head_dim": 33}, r"^config\.model\.head_dim=33 is invalid: must be even"),
    ({"model.dtype": "float16"}, r"^config\.model\.dtype='float16' is invalid: must be one of "
                                 r"\('float32', 'bfloat16'\)"),
    ({"sampler.top_p": 0.0}, r"^config\.sampler\.top_p=0\.0 is invalid: must be in \(0, 1\]"),
    ({"train.steps": 2.5}, r"^config\.train\.steps=2\.5 is invalid: must be an int >= 0$"),
    ({"eval.temperature": "hot"}, r"^config\.eval\.temperature='hot' is invalid: must be a "
                                  r"number > 0, or None$"),
    ({"rollout.per_step": 12}, r"^config\.rollout\.per_step=12 is invalid: must be a positive "
                               r"multiple of rollout\.group_size=8$"),
    ({"algo.lr": float("nan")}, r"^config\.algo\.lr=nan is invalid: must be > 0$"),
    ({"mesh.data": 0}, r"^config\.mesh\.data=0 is invalid: must be a positive int, or -1"),
    ({"distributed.local_device_ids": "0;1"}, r"^config\.distributed\.local_device_ids='0;1' "
                                              r"is invalid: must be comma-separated"),
    ({"checkpoint.keep_best": "yes"}, r"^config\.checkpoint\.keep_best='yes' is invalid: must "
                                      r"be a bool$"),
    ({"auto_replay.mu_source": "time"}, r"^config\.auto_replay\.mu_source='time' is invalid: "
                                        r"must be one of \('flops', 'configured'\)$"),
    ({"auto_replay.mu_source": "configured"}, r"^config\.auto_replay\.mu=None is invalid: must "
                                              r"be a number > 0 with auto_replay\.mu_source="
                                              r"'configured'$"),
    ({"auto_replay.mu_source": "configured", "auto_replay.mu": 0.0},
     r"^config\.auto_replay\.mu=0\.0 is invalid: must be > 0"),
    ({"auto_replay.mu": 5.3}, r"^config\.auto_replay\.mu=5\.3 is invalid: is used only with "
                              r"auto_replay\.mu_source='configured' \(not 'flops'\)"),
])
def test_field_and_shape_errors_name_field_value_and_what_is_allowed(overrides, match):
  tree = default_tree()
  for key, value in overrides.items():
    section, name = key.split(".")
    tree[section][name] = value
  with pytest.raises(ConfigError, match=match):
    config_lib.validate(tree, device_count=1, process_count=1)


def test_unknown_sections_and_fields_are_refused_with_a_near_match():
  tree = default_tree()
  tree["sampeler"] = {}
  with pytest.raises(ConfigError, match=r"^config\.sampeler is not a section of the config "
                                        r"\(did you mean config\.sampler\?\)"):
    config_lib.specs(tree)
  tree = default_tree()
  tree["eval"]["batchrows"] = 8
  with pytest.raises(ConfigError, match=r"^config\.eval\.batchrows is not a field of the eval "
                                        r"section \(did you mean eval\.batch_rows\?\)$"):
    config_lib.specs(tree)


# --- the property: any invalid field value stops validation with one line naming it -------

_WRONG_TYPE = {"int": ["x", 1.5, [1], None], "float": ["x", [0.5], None, float("nan")],
               "bool": [1, "yes", None], "str": [3, 1.5, True, None], "tuple": [3, "abc", None],
               "dict": [3, "x", None]}


def _invalid_values(f: dataclasses.Field):
  kinds, optional = _kinds(f.type)
  meta = f.metadata
  pool = [v for k in kinds for v in _WRONG_TYPE.get(k, [])
          if not (v is None and optional)
          and not (k == "float" and isinstance(v, float) and not math.isnan(v))]
  strategies = [st.sampled_from(pool)] if pool else []
  if meta.get("choices") is not None:
    strategies.append(st.text(min_size=1, max_size=8).filter(lambda s: s not in meta["choices"]))
  integral = "int" in kinds
  step = st.integers(1, 10**6) if integral else st.floats(1e-3, 1e6)
  if meta.get("ge") is not None:
    strategies.append(step.map(lambda d: meta["ge"] - d))
  if meta.get("gt") is not None:
    strategies.append((st.integers(0, 10**6) if integral else st.floats(0, 1e6))
                      .map(lambda d: meta["gt"] - d))
  if meta.get("le") is not None:
    strategies.append(step.map(lambda d: meta["le"] + d))
  if meta.get("lt") is not None:
    strategies.append((st.integers(0, 10**6) if integral else st.floats(0, 1e6))
                      .map(lambda d: meta["lt"] + d))
  return st.one_of(strategies)


_FIELDS = [(section, f) for section, spec_cls in SECTIONS.items()
           for f in dataclasses.fields(spec_cls)]


@st.composite
def invalid_settings(draw):
  """1-3 (section, field, invalid value) triples on distinct fields."""
  picks = draw(st.lists(st.sampled_from(range(len(_FIELDS))), min_size=1, max_size=3,
                        unique=True))
  return [(_FIELDS[i][0], _FIELDS[i][1].name, draw(_invalid_values(_FIELDS[i][1])))
          for i in picks]


@settings(max_examples=300, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(invalid_settings())
def test_any_invalid_config_is_one_config_error_line_naming_a_bad_field(bad):
  tree = default_tree()
  for section, name, value in bad:
    tree[section][name] = value
  with pytest.raises(ConfigError) as info:
    config_lib.validate(tree, device_count=1, process_count=1)
  msg = str(info.value)
  assert "\n" not in msg and msg.startswith("config.")
  named = [f"config.{section}.{name}=" for section, name, _ in bad]
  assert any(msg.startswith(n) for n in named), (msg, bad)


def test_a_bad_override_on_the_command_line_is_one_line_without_a_traceback(tmp_path):
  out = subprocess.run([sys.executable, "-m", "jaxreplay.main", "--config", "configs/default.py",
                        "--config.sampler.top_p=1.5", f"--config.workdir={tmp_path}"],
                       cwd=ROOT, capture_output=True, text=True, timeout=120)
  assert out.returncode != 0
  assert out.stderr.strip() == ("jaxreplay: config.sampler.top_p=1.5 is invalid: must be in "
                                "(0, 1] (1 = off)")
  assert not os.listdir(tmp_path)  # nothing written, nothing compiled


# --- modules take their own specs: only config.py reads the tree -----------------------------

def test_no_module_outside_config_reads_the_tree():
  pattern = re.compile(r"cfg\.(algo|rollout|buffer|train|eval|sampler|model|task)\b")
  found = []
  for dirpath, _, files in os.walk(os.path.join(ROOT, "jaxreplay")):
    for name in files:
      path = os.path.join(dirpath, name)
      if name.endswith(".py") and os.path.relpath(path, ROOT) != os.path.join("jaxreplay",
                                                                              "config.py"):
        for i, line in enumerate(open(path), 1):
          if pattern.search(line):
            found.append(f"{os.path.relpath(path, ROOT)}:{i}: {line.strip()}")
  assert not found, "\n".join(found)
  from jaxreplay.train.build import Run
  assert "cfg" not in {f.name for f in dataclasses.fields(Run)}

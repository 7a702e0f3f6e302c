"""``AlgoSpec``: every ``algo`` field validated at construction with one-line errors that name
``algo.<field>``, the value and what is allowed; unknown keys rejected; no jax on import."""

import dataclasses
import os
import re
import subprocess
import sys

import pytest

from jaxreplay.rl.spec import AlgoSpec

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def test_importing_spec_loads_neither_jax_flax_nor_optax():
  code = ("import sys, jaxreplay.rl.spec; "
          "print([m for m in ('jax', 'flax', 'optax') if m in sys.modules])")
  out = subprocess.run([sys.executable, "-c", code], cwd=ROOT, capture_output=True, text=True,
                       timeout=120)
  assert out.returncode == 0, out.stderr
  assert out.stdout.strip() == "[]"


def test_defaults_are_the_default_config():
  from jaxreplay.config import load_config
  algo = load_config(os.path.join(ROOT, "configs", "default.py")).algo
  assert AlgoSpec.from_config(algo) == AlgoSpec()
  assert set(algo.keys()) == {f.name for f in dataclasses.fields(AlgoSpec)}


@pytest.mark.parametrize("key,match", [
    ("lrr", r"^algo\.lrr is not a field of the algo section \(did you mean algo\.lr\?\)$"),
    ("num_minibatch", r"^algo\.num_minibatch is not a field .*did you mean algo\.num_minibatches"),
    ("zzz", r"^algo\.zzz is not a field of the algo section$"),
])
def test_unknown_keys_are_rejected_with_a_near_match(key, match):
  with pytest.raises(ValueError, match=match):
    AlgoSpec.from_config({key: 1})


@pytest.mark.parametrize("field,value,allowed", [
    ("lr", 0.0, "must be > 0"),
    ("eps_low", -0.1, "must be > 0"),
    ("eps_high", 0, "must be > 0"),
    ("max_grad_norm", 0.0, "must be > 0"),
    ("warmup_steps", -1, "must be >= 0"),
    ("weight_decay", -0.01, "must be >= 0"),
    ("staleness_rate", -0.5, "must be >= 0"),
    ("kl_coef", -1.0, "must be >= 0"),
    ("final_lr_fraction", 1.5, r"must be in \[0, 1\]"),
    ("gae_lambda", 1.1, r"must be in \[0, 1\]"),
    ("max_consecutive_skips", 0, "must be >= 1"),
    ("update_epochs", 0, "must be >= 1"),
    ("num_minibatches", 2.0, "must be an int"),
    ("lr", "1e-4", "must be a number"),
    ("gae_whiten", 1, "must be a bool"),
    ("ratio_mask_c", 0.5, r"must be > 1 \(or 0 to disable\)"),
    ("lr_schedule", "cosin",
     r"must be one of \('constant', 'cosine'\) \(did you mean 'cosine'\?\)"),
    ("staleness_buckets", (0, 2, 2), "must be ints, strictly increasing and start at 0"),
])
def test_bad_values_name_field_value_and_what_is_allowed(field, value, allowed):
  shown = re.escape(repr(value))
  with pytest.raises(ValueError, match=rf"^algo\.{field}={shown} is invalid: {allowed}"):
    AlgoSpec(**{field: value})
  with pytest.raises(ValueError, match=rf"^algo\.{field}={shown} is invalid"):
    AlgoSpec.from_config({field: value})


def test_combinations_that_need_only_algo_fields():
  with pytest.raises(ValueError, match=r"algo\.advantage='grpo' is invalid: algo\.loss='asymre' "
                     r"uses the group-mean baseline: set algo\.advantage='dr_grpo'"):
    AlgoSpec(loss="asymre")
  assert AlgoSpec(loss="asymre", advantage="dr_grpo").loss == "asymre"
  with pytest.raises(ValueError, match=r"algo\.horizon=0 is invalid: must be > 0"):
    AlgoSpec(aggregation="seq_mean_token_sum_norm")
  # Frozen and validated on every construction, dataclasses.replace included.
  spec = AlgoSpec()
  with pytest.raises(dataclasses.FrozenInstanceError):
    spec.lr = 1.0
  with pytest.raises(ValueError, match=r"algo\.lr=-1\.0"):
    dataclasses.replace(spec, lr=-1.0)
  assert hash(spec) == hash(AlgoSpec())


def test_buckets_become_a_tuple_of_ints():
  spec = AlgoSpec.from_config({"staleness_buckets": [0, 1, 3]})
  assert spec.staleness_buckets == (0, 1, 3)
  assert AlgoSpec.from_config(spec) is spec
  assert AlgoSpec(update_epochs=2, num_minibatches=4).updates_per_step == 8

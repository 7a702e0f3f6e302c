"""Every shipped config validates, and bad values fail before any compute with a clear message."""

import glob
import os

import pytest

from jaxreplay import config as config_lib
from jaxreplay.rl.spec import AlgoSpec

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
CONFIGS = sorted(glob.glob(os.path.join(ROOT, "configs", "*.py")))


load = config_lib.load_config


@pytest.mark.parametrize("path", CONFIGS, ids=lambda p: os.path.basename(p))
def test_shipped_config_validates(path, tmp_path):
  c = load(path)
  if c.model.source == "hf":  # needs a local checkpoint; the rest must validate
    for f in ("config.json", "tokenizer.json"):
      (tmp_path / f).write_text("{}")
    c.model.path = str(tmp_path)
  if c.task.source in ("jsonl", "parquet"):  # needs the dataset's files; the samples stand in
    for field, split in (("train_path", "train"), ("heldout_path", "test")):
      c.task[field] = os.path.join(ROOT, "data", "samples",
                                   f"{c.task.format}_{split}.{c.task.source}")
  config_lib.validate(c)
  name = os.path.basename(path)[:-3]
  if name in ("ppo_clip", "tis", "decoupled", "gspo", "asymre", "reinforce"):
    assert AlgoSpec.from_config(c.algo).loss == name


def test_onpolicy_is_n_equals_r_equals_b():
  c = load(os.path.join(ROOT, "configs", "onpolicy.py"))
  assert c.buffer.capacity == c.rollout.per_step == c.train.batch_size


def test_every_loss_has_a_preset():
  from jaxreplay.rl.losses import LOSSES
  names = {os.path.basename(p)[:-3] for p in CONFIGS}
  assert set(LOSSES) <= names


@pytest.mark.parametrize("field,value,match", [
    ("algo.loss", "ppo", "algo.loss='ppo'.*ppo_clip"),
    ("algo.advantage", "grpo2", "algo.advantage"),
    ("buffer.sampler", "recent", "buffer.sampler='recent'.*recency"),
    ("buffer.capacity", 100, "buffer.capacity=100.*train.batch_size=256"),
    ("rollout.group_size", 1, "rollout.group_size=1"),
    ("rollout.per_step", 100, "rollout.per_step=100.*multiple of rollout.group_size=8"),
    ("sampler.temperature", -1.0, "sampler.temperature=-1.0"),
    ("algo.lr", 0.0, "algo.lr=0.0"),
    ("task.on_too_long", "drop", "task.on_too_long='drop'"),
    ("algo.lr_schedule", "linear", "algo.lr_schedule='linear'"),
    ("eval.num_examples", 0, "eval.num_examples=0.*>= 1"),
    ("sampler.top_p", 0.0, "sampler.top_p=0.0"),
    ("model.source", "torch", "model.source='torch'.*builtin"),
    # algo fields checked by AlgoSpec, raised by validate as ConfigError
    ("algo.eps_low", 0.0, r"config\.algo\.eps_low=0\.0 is invalid: must be > 0"),
    ("algo.max_grad_norm", -1.0, r"config\.algo\.max_grad_norm=-1\.0 is invalid: must be > 0"),
    ("algo.loss", "asymre", r"config\.algo\.advantage='grpo' is invalid: algo\.loss='asymre'"),
    ("algo.lrr", 1e-3, r"config\.algo\.lrr is not a field .*did you mean algo\.lr\?"),
    # algo fields against other sections, checked by validate
    ("algo.warmup_steps", 200, r"config\.algo\.warmup_steps=200 is invalid: must be < "
                               r"train\.steps=200 with algo\.lr_schedule='cosine'"),
    ("algo.num_minibatches", 3, r"config\.algo\.num_minibatches=3 is invalid: must divide "
                                r"train\.batch_size=256"),
])
def test_bad_values_name_the_field(field, value, match):
  c = load(os.path.join(ROOT, "configs", "default.py"))
  sec, name = field.split(".")
  c[sec][name] = value
  with pytest.raises(config_lib.ConfigError, match=match):
    config_lib.validate(c)


@pytest.mark.parametrize("args,match", [
    (["configs/small.py"], "unexpected argument.*configs/small.py.*--config PATH"),
    (["--config", "configs/nope.py"], "cannot load --config.*No such file"),
    (["--config", "configs/small.py", "--config.train.stpes=3"], "bad command line.*steps"),
    (["--config", "configs/small.py", "--config.sampler.overlap_host_check=maybe"],
     "overlap_host_check.*'maybe'.*valid: true, false"),
])
def test_command_line_errors_are_one_line(args, match):
  """A mistyped command line exits with one line (no traceback) before anything runs."""
  import re
  import subprocess
  import sys
  out = subprocess.run([sys.executable, "-m", "jaxreplay.main", *args], cwd=ROOT,
                       capture_output=True, text=True, timeout=120)
  assert out.returncode != 0
  assert "Traceback" not in out.stderr
  assert re.search(match, out.stderr.strip().splitlines()[-1])


def test_summary_wall_time_parts_add_up_to_the_total():
  from jaxreplay.main import summary_lines
  s = dict(acc_sampled_before=0.301, acc_sampled_after=0.489, acc_greedy_before=0.52,
           acc_greedy_after=0.592, generated_tokens=85523, trained_tokens=170272,
           generated_rollouts=25728, ledger={"lost_in_flight_rollouts": 3}, wall_seconds=366.0,
           generate_s=48.2, train_s=93.4, eval_s=29.1, checkpoints="/r/checkpoints",
           base_policy="/r/base")
  lines = summary_lines(s, 1.0)
  assert lines[1] == "held-out accuracy, sampled at T=1.0: 0.301 -> 0.489"
  assert lines[2] == "held-out accuracy, greedy: 0.520 -> 0.592"
  assert lines[4].endswith(": 3")  # lost in flight, shown only when nonzero
  # 366 - (48.2 + 93.4 + 29.1) = 195.3 s outside the three phases
  assert lines[5] == ("wall time: 6.1 min  (generate 48s, train 93s, eval 29s, other 195s: "
                      "set-up, warm start, the evaluation before RL, checkpoints)")
  assert len(summary_lines({**s, "ledger": {}}, 1.0)) == len(lines) - 1
  mu = summary_lines({**s, "ledger": {**s["ledger"], "mu_flops": 0.3321, "mu_time": 0.79}},
                     1.0)
  assert mu[5:7] == [lines[5], "mu (generating a rollout / training on a sample): 0.332 from "
                     "FLOPs, 0.790 from wall time (moves with the machine's load)"]


def test_smollm2_sums_preset_holds_out_300_distinct_questions_disjoint_from_train():
  # issue 39's task: at least 300 distinct held-out questions, none in training, evaluated
  # 300 at a time; the commonest gold is rare (no guessing task)
  from collections import Counter

  from jaxreplay.tasks.reasoning_gym_task import make_reasoning_gym_task
  t = load(os.path.join(ROOT, "configs", "smollm2_135m_sums.py")).task
  task = make_reasoning_gym_task(t.name, t.seed, t.train_size, t.heldout_size, dict(t.kwargs),
                                 t.prompt_template, t.answer_extraction)
  train = {e.prompt for e in task.train}
  heldout = [e.prompt for e in task.heldout]
  assert (len(heldout), len(set(heldout)), task.duplicates_dropped) == (342, 337, 58)
  assert not train & set(heldout)
  assert (heldout[0], task.heldout[0].answer) == (
      "Solve the following: 62 - 34. Give only the result as your final answer.", "28")
  evaluated = task.heldout[:300]
  assert Counter(str(e.answer) for e in evaluated).most_common(1)[0][1] == 5

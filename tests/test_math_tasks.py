"""Math tasks from files: the sample files of data/samples in the GSM8K, MATH and OpenR1-Math
formats (JSONL and Parquet), malformed rows and invalid gold answers counted, every task option
honoured or refused by validation in one line, and an end-to-end run of each format with a tiny
random Hugging Face-format model (file → prompt → reward → update)."""

import json
import os

import ml_collections
import numpy as np
import pytest

from jaxreplay import config as config_lib
from jaxreplay.tasks import make_task
from jaxreplay.tasks.file_task import read_examples

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
SAMPLES = os.path.join(ROOT, "data", "samples")


def sample(name):
  return os.path.join(SAMPLES, name)


def task_cfg(**kw):
  c = dict(source="jsonl", name="", seed=0, train_size=1000, heldout_size=1000, kwargs={},
           prompt_template="{question}", train_path=sample("gsm8k_train.jsonl"),
           heldout_path=sample("gsm8k_test.jsonl"), prompt_width=64, on_too_long="truncate_left",
           reward_timeout_s=5.0, answer_extraction="bare", chat_template=False, system_prompt="",
           format="gsm8k", question_field="", answer_field="", solution_field="",
           reward_workers=0)
  c.update(kw)
  return ml_collections.ConfigDict(c)


def test_gsm8k_jsonl_and_parquet_samples_read_the_same():
  a = make_task(task_cfg(prompt_template="Question: {question}\nAnswer:"))
  b = make_task(task_cfg(source="parquet", train_path=sample("gsm8k_train.parquet"),
                         heldout_path=sample("gsm8k_test.parquet"),
                         prompt_template="Question: {question}\nAnswer:"))
  assert a.name == "jsonl:gsm8k" and b.name == "parquet:gsm8k"
  assert [(e.prompt, e.answer) for e in a.train] == [(e.prompt, e.answer) for e in b.train]
  assert [e.answer for e in a.train] == ["15", "24", "210", "8", "1250", "-5", "12", "300", "18",
                                         "8", "360", "56"]
  assert [e.answer for e in a.heldout] == ["7", "72", "15", "60"]
  assert a.train[0].prompt.startswith("Question: Mira has 12 apples.")
  assert a.train[0].prompt.endswith("\nAnswer:")
  assert a.skipped_rows == {"train": 0, "heldout": 0} and a.invalid_gold == {"train": 0,
                                                                             "heldout": 0}
  # bare extraction: the exact gold after ####; the scorer is in-process (reward_workers=0)
  rewards, failures = a.scorer([" 15", " 16", "7 + 8 = 15"], [a.train[0]] * 3)
  np.testing.assert_array_equal(rewards, [1, 0, 1])
  assert failures == 0 and a.scorer.workers == 0


def test_math_and_openr1_formats_read_the_gold_from_answer_or_the_last_box():
  m = make_task(task_cfg(source="parquet", format="math", train_path=sample("math_train.parquet"),
                         heldout_path=sample("math_test.parquet"), answer_extraction="math",
                         reward_workers=1))
  assert [e.answer for e in m.heldout] == ["\\frac{1}{2}", "5", "9\\pi", "\\frac{1}{3}"]
  assert m.train[2].answer == "5\\sqrt{2}" and m.train[2].gold is not None
  assert m.train[0].prompt == "What is the value of $\\frac{3}{4} + \\frac{1}{8}$?"
  # OpenR1-Math: the answer column; a blank one falls back to the solution's box (55).
  o = make_task(task_cfg(format="math", train_path=sample("openr1_train.jsonl"),
                         heldout_path=sample("openr1_test.jsonl"), answer_extraction="math",
                         reward_workers=1, prompt_template="[{problem_type}] {question}"))
  assert [e.answer for e in o.train] == ["11", "12", "\\frac{3}{2}", "9", "12", "4", "55",
                                         "\\frac{1}{36}"]
  assert o.train[0].prompt.startswith("[Algebra] A number doubled")
  rewards, failures = o.scorer(["so \\boxed{1.5}", "\\boxed{\\frac{1}{36}}", "#### 56"],
                               [o.train[2], o.train[7], o.train[6]])
  np.testing.assert_array_equal(rewards, [1, 1, 0])
  assert failures == 0
  m.scorer.close()
  o.scorer.close()


def test_malformed_rows_and_invalid_gold_are_counted_and_excluded(tmp_path):
  import pyarrow as pa
  import pyarrow.parquet as pq
  good = {"problem": "What is 1 + 1?", "solution": "It is \\boxed{2}.", "answer": ""}
  rows = [good,
          {"problem": "", "solution": "\\boxed{3}", "answer": ""},  # empty question
          {"problem": "No box", "solution": "three", "answer": None},  # no gold
          {"problem": "Figure", "solution": "", "answer": "see figure"},  # unparseable gold
          {"problem": None, "solution": "\\boxed{4}", "answer": "4"}]  # null question
  pq.write_table(pa.Table.from_pylist(rows), tmp_path / "t.parquet")
  c = task_cfg(source="parquet", format="math", train_path=str(tmp_path / "t.parquet"),
               heldout_path=sample("math_test.parquet"), answer_extraction="math",
               reward_workers=1)
  t = make_task(c)
  assert [e.prompt for e in t.train] == ["What is 1 + 1?"]
  assert t.skipped_rows == {"train": 3, "heldout": 0}
  assert t.invalid_gold == {"train": 1, "heldout": 0}  # counted, excluded: never rewarded
  t.scorer.close()
  # With bare extraction the same row's gold is a plain string (exact match), not excluded.
  bare = make_task(task_cfg(source="parquet", format="math", train_path=str(tmp_path / "t.parquet"),
                            heldout_path=sample("math_test.parquet")))
  assert [e.answer for e in bare.train] == ["2", "see figure"]
  # GSM8K rows without "#### N", bad JSON, non-objects, bad UTF-8.
  p = tmp_path / "g.jsonl"
  p.write_bytes(b'{"question": "q1", "answer": "2 + 2\\n#### 4"}\n'
                b'{"question": "q2", "answer": "no final line"}\n'
                b'[1, 2]\nnot json\n\xff\xfe\n'
                b'{"question": "q3", "answer": 7}\n')
  ex, skipped = read_examples(str(p), "jsonl", "gsm8k")
  assert [(e.prompt, e.answer) for e in ex] == [("q1", "4")] and skipped == 5


def test_field_names_subset_and_glob_are_honoured(tmp_path):
  p = tmp_path / "r.jsonl"
  p.write_text("\n".join(json.dumps({"prompt": f"p{i}", "final": str(i)}) for i in range(20)))
  c = task_cfg(format="plain", train_path=str(p), heldout_path=str(p), question_field="prompt",
               answer_field="final", train_size=5, heldout_size=20)
  t = make_task(c)
  assert len(t.train) == 5 and len(t.heldout) == 20
  assert all(e.answer == e.prompt[1:] for e in t.train)
  assert [e.prompt for e in make_task(c).train] == [e.prompt for e in t.train]  # seeded
  c.seed = 1
  assert [e.prompt for e in make_task(c).train] != [e.prompt for e in t.train]
  with pytest.raises(ValueError, match=r"names field 'expression'; valid: final, prompt, question"):
    make_task(task_cfg(format="plain", train_path=str(p), heldout_path=str(p),
                       question_field="prompt", answer_field="final",
                       prompt_template="{expression} ="))
  g = make_task(task_cfg(source="parquet", format="math", train_path=sample("*_train.parquet"),
                         heldout_path=sample("openr1_test.parquet")))
  assert len(g.train) == 10 + 8  # math and openr1 rows; gsm8k rows have no problem column
  assert g.skipped_rows["train"] == 12


@pytest.mark.parametrize("changes,match", [
    (dict(source="jsonl"), r"task.name='chain_sum' is invalid: names a reasoning-gym dataset"),
    (dict(source="jsonl", name=""), r"task.kwargs=.* are reasoning-gym dataset options"),
    (dict(format="gsm8k"), r"task.format='gsm8k' is invalid: is for task.source in"),
    (dict(format="gsm8"), r"must be one of \('plain', 'gsm8k', 'math'\) \(did you mean 'gsm8k'"),
    (dict(train_path="x.jsonl"), r"task.train_path='x.jsonl' is invalid"),
    (dict(question_field="problem"), r"task.question_field='problem' is invalid"),
    (dict(source="parquett"), r"did you mean 'parquet'"),
    (dict(answer_extraction="math"), r"task.reward_workers=0 is invalid: .*needs a process pool"),
    (dict(reward_workers=2, reward_timeout_s=0.0), r"task.reward_timeout_s=0.0 is invalid"),
    (dict(reward_workers=-1), r"task.reward_workers=-1 is invalid"),
    (dict(system_prompt="Be brief."), r"task.system_prompt='Be brief.' is invalid: .*chat_template"),
    (dict(train_size=0), r"task.train_size=0 is invalid"),
])
def test_every_task_option_is_honoured_or_refused_in_one_line(changes, match):
  c = config_lib.load_config(os.path.join(ROOT, "configs", "default.py"))
  c.task.update(changes)
  with pytest.raises(config_lib.ConfigError, match=match) as e:
    config_lib.validate(c, device_count=1)
  assert "\n" not in str(e.value) and str(e.value).startswith("config.task.")


def test_file_source_options_are_refused_or_checked_for_files(tmp_path):
  c = config_lib.load_config(os.path.join(ROOT, "configs", "gsm8k.py"))
  c.model.path = ROOT  # validation only checks config.json/tokenizer.json below; not reached
  with pytest.raises(config_lib.ConfigError, match=r"task.train_path='data/gsm8k/train.parquet'"
                                                   r": no such file"):
    config_lib.validate(c, device_count=1)
  c.task.update(train_path=sample("gsm8k_train.parquet"), heldout_path=sample("gsm8k_test.parquet"),
                solution_field="solution")
  with pytest.raises(config_lib.ConfigError, match="task.solution_field='solution' is invalid"):
    config_lib.validate(c, device_count=1)


# --- end to end: a tiny random Qwen2 checkpoint and the sample files ------------------------

@pytest.fixture(scope="module")
def checkpoint(tmp_path_factory):
  pytest.importorskip("torch")
  pytest.importorskip("transformers")
  from test_train_hf import make_checkpoint
  d = tmp_path_factory.mktemp("ckpt")
  make_checkpoint(str(d))
  return str(d)


@pytest.fixture(scope="module")
def shared_compiles(tmp_path_factory):
  """JAX's persistent compilation cache for this module's runs: each run jits its own
  learner step, and the three runs have the same shapes, so runs 2 and 3 load run 1's
  executables (bit-identical programs) instead of compiling them again."""
  import jax
  from jax._src import compilation_cache
  names = ("jax_compilation_cache_dir", "jax_persistent_cache_min_compile_time_secs",
           "jax_persistent_cache_min_entry_size_bytes")
  old = {n: getattr(jax.config, n) for n in names}
  jax.config.update(names[0], str(tmp_path_factory.mktemp("jax_cache")))
  jax.config.update(names[1], 0.0)
  jax.config.update(names[2], 0)
  compilation_cache.reset_cache()
  yield
  for n, v in old.items():
    jax.config.update(n, v)
  compilation_cache.reset_cache()


def e2e_config(checkpoint, workdir, preset, **task):
  c = config_lib.load_config(os.path.join(ROOT, "configs", f"{preset}.py"))
  c.model.update(path=checkpoint, dtype="float32")
  c.workdir = workdir
  c.task.update(prompt_width=128, reward_workers=1, **task)
  c.sampler.max_new_tokens = 8
  c.rollout.update(per_step=16, group_size=8)
  c.buffer.capacity = 32
  c.train.update(steps=2, batch_size=16)
  c.algo.update(num_minibatches=1, lr=1e-3)
  c.eval.update(every=2, num_examples=2, samples_per_example=2)
  c.checkpoint.update(every=0, keep_best=False)
  c.drift.every = 0
  c.log.update(progress=False, tensorboard=False)
  c.mesh.data = 1  # one device: the claim is the data path, not the layout
  return c


E2E = {
    "gsm8k_jsonl": ("gsm8k", dict(source="jsonl", train_path=sample("gsm8k_train.jsonl"),
                                  heldout_path=sample("gsm8k_test.jsonl"))),
    "math_parquet": ("math", dict(train_path=sample("math_train.parquet"),
                                  heldout_path=sample("math_test.parquet"))),
    "openr1_parquet": ("math", dict(train_path=sample("openr1_train.parquet"),
                                    heldout_path=sample("openr1_test.parquet"))),
}


@pytest.mark.slow
@pytest.mark.parametrize("name", list(E2E))
def test_each_format_runs_end_to_end(name, checkpoint, shared_compiles, tmp_path, monkeypatch):
  """File → chat-templated prompts → generation → math-verify reward in a worker process →
  update → evaluation. In the OpenR1 run one scoring worker dies mid-call and one hangs past
  the timeout: the run finishes and both rewards are counted as failures."""
  from jaxreplay.tasks.scoring import Scorer
  from jaxreplay.train import build as build_lib
  from conftest import run
  from jaxreplay.train.metrics import read_metrics
  from scoring_faults import OneShotFaults

  preset, task = E2E[name]
  c = e2e_config(checkpoint, str(tmp_path / "run"), preset, **task)
  faults = name == "openr1_parquet"
  if faults:
    (tmp_path / "crash").write_text("")
    (tmp_path / "hang").write_text("")
    real = build_lib.make_task

    def make_faulty_task(cfg):
      t = real(cfg)
      t.scorer = Scorer(OneShotFaults(str(tmp_path)), workers=2, timeout_s=cfg.reward_timeout_s)
      return t
    monkeypatch.setattr(build_lib, "make_task", make_faulty_task)
  summary = run(c, log=lambda *_: None)
  assert summary["steps"] == 2 and summary["generated_rollouts"] == 32
  if name == "gsm8k_jsonl":  # the sample files hold no malformed row and no invalid gold
    assert summary["data_rows"] == {"skipped_rows": {"train": 0, "heldout": 0},
                                    "invalid_gold": {"train": 0, "heldout": 0}}
  rows = read_metrics(c.workdir)
  first = next(r for r in rows if r["step"] == 1)
  assert first["ratio_mean"] == pytest.approx(1.0, abs=1e-5)  # the update ran on these rollouts
  assert np.isfinite(first["loss"]) and 0.0 <= first["reward"] <= 1.0
  evals = [r for r in rows if "eval/acc_sampled" in r]
  assert [r["step"] for r in evals] == [0, 2]
  # every evaluation is also graded strictly and leniently; the summary has both, before
  # and after, and the closing summary prints a line for each
  from jaxreplay.main import summary_lines
  for g in ("strict", "lenient"):
    for mode in ("greedy", "sampled"):
      assert [r[f"eval/acc_{mode}_{g}"] for r in evals] == [
          summary[f"acc_{mode}_{g}_before"], summary[f"acc_{mode}_{g}_after"]]
  assert [r["eval/grade_failures"] for r in evals] == [0, 0]
  lines = summary_lines(summary, c.sampler.temperature)
  assert [line.split(",")[1].split("(")[0].strip() for line in lines[3:5]] == ["strict",
                                                                               "lenient"]
  failures = summary["ledger"]["reward_failures"] + sum(r["eval/reward_failures"] for r in evals)
  if faults:
    assert not (tmp_path / "crash").exists() and not (tmp_path / "hang").exists()
    assert failures == 2
  else:
    assert failures == 0

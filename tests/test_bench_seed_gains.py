"""bench/seed_gains.py on hand-made run directories: gains, intervals and the arm comparison."""

import json
import math

import pytest

from conftest import load_bench

GRADES = ("greedy", "sampled", "greedy_strict", "sampled_strict", "greedy_lenient",
          "sampled_lenient")


def _run(root, name, seed, before, after, steps, time_line=None):
  """A finished run: every grade before/after as given; ``steps`` are (train_s cumulative,
  dropped_zero_advantage, zero_gradient_skipped) for steps 1, 2, ..."""
  d = root / name
  (d / "metrics").mkdir(parents=True)
  summary = {"wall_seconds": 100.0 + seed}
  for g in GRADES:
    summary[f"acc_{g}_before"], summary[f"acc_{g}_after"] = before, after
  (d / "summary.json").write_text(json.dumps(summary))
  (d / "config.json").write_text(json.dumps({"seed": seed, "train": {"batch_size": 64}}))
  rows = [{"step": 0}] + [{"step": i + 1, "train_s": t, "dropped_zero_advantage": drop,
                           "zero_gradient_skipped": skip}
                          for i, (t, drop, skip) in enumerate(steps)]
  (d / "metrics" / "000000.jsonl").write_text("\n".join(json.dumps(r) for r in rows))
  if time_line:
    (d / "time.txt").write_text(time_line)
  return str(d)


def test_gains_intervals_timings_and_comparison_by_hand(tmp_path, capsys):
  bench = load_bench("seed_gains")
  # steps 1-3 compile; from step 4: 10 s at half the batch kept, a skipped step, 20 s at 3/4
  steps = [(30.0, 0.0, 0.0), (40.0, 1.0, 1.0), (60.0, 0.5, 0.0), (70.0, 0.5, 0.0),
           (71.0, 1.0, 1.0), (91.0, 0.25, 0.0)]
  for seed, (b, a) in enumerate([(0.10, 0.25), (0.10, 0.20), (0.10, 0.24)]):
    _run(tmp_path, f"full{seed}", seed, b, a, steps, "12.5 s wall 2097152 KB maxrss\n")
  for seed, a in enumerate([0.30, 0.20, 0.22]):
    _run(tmp_path, f"lora{seed}", seed, 0.10, a, steps)
  samples = tmp_path / "full0" / "samples"
  samples.mkdir()
  for step, recs in ((0, [("75 - 32 = 21", 0), ("first 75, then 43", 1)]),
                     (24, [("Solve 75 - 32 = 43", 1), ("75 - 32 = 43.", 1),
                           ("It is 44", 0)])):
    (samples / f"eval_{step}.jsonl").write_text("\n".join(
        json.dumps({"completion": c, "lenient": g}) for c, g in recs))
  out = tmp_path / "out.json"
  bench.main(["--arm", f"full={tmp_path}/full*", "--arm", f"lora={tmp_path}/lora*",
              "--out", str(out)])
  res = json.loads(out.read_text())
  full = res["arms"]["full"]["sampled_lenient"]
  # gains 0.15, 0.10, 0.14: mean 0.13, sd 0.026458, t(0.975, 2) = 4.302653
  h = 4.302653 * 0.0264575 / math.sqrt(3)
  assert math.isclose(full["gain_mean"], 0.13, abs_tol=1e-12)
  assert math.isclose(full["gain_t95"][0], 0.13 - h, abs_tol=1e-5)
  assert math.isclose(full["gain_t95"][1], 0.13 + h, abs_tol=1e-5)
  run = res["runs"]["full"][0]
  # moved steps from step 4: 10 s over 32 rollouts, 20 s over 48; medians 15 s and 0.3646 s
  assert (run["learner_update_s"], run["learner_s_per_rollout"]) == (15.0, 0.365)
  assert (run["moved_steps"], run["time_wall_s"], run["maxrss_gb"]) == (4, 12.5, 2.0)
  assert res["runs"]["lora"][0]["maxrss_gb"] is None
  assert run["recorded_form"] == {
      "first": {"step": 0, "n": 2, "one_line": 1, "one_line_right": 0, "other_right": 1},
      "last": {"step": 24, "n": 3, "one_line": 2, "one_line_right": 2, "other_right": 0}}
  assert res["runs"]["lora"][0]["recorded_form"] is None
  cmp = res["comparison"]["sampled"]
  # lora - full after RL: +0.05, 0.00, -0.02
  assert [round(x, 12) for x in cmp["diff_s"]] == [0.05, 0.0, -0.02]
  assert math.isclose(cmp["diff_mean"], 0.01, abs_tol=1e-12)
  assert "| sampled_lenient | 0.100 | 0.230 | +0.130 |" in capsys.readouterr().out


def test_an_arm_without_a_finished_run_stops_with_its_pattern(tmp_path):
  bench = load_bench("seed_gains")
  with pytest.raises(SystemExit, match=r"no finished run .* matches '.*none\*'"):
    bench.main(["--arm", f"full={tmp_path}/none*"])


def test_previous_runs_are_kept_beside_new_seeds(tmp_path):
  """``--previous``: an earlier result's runs stay in the arm (their workdirs gone), a seed
  run again replaces its old record, and the gains cover every seed."""
  bench = load_bench("seed_gains")
  steps = [(30.0, 0.0, 0.0)] * 5
  for seed, a in enumerate([0.25, 0.20]):
    _run(tmp_path / "old", f"full{seed}", seed, 0.10, a, steps)
  first = tmp_path / "first.json"
  bench.main(["--arm", f"full={tmp_path}/old/full*", "--out", str(first)])
  for seed, a in ((1, 0.30), (2, 0.24)):  # seed 1 again, seed 2 new
    _run(tmp_path / "new", f"full{seed}", seed, 0.10, a, steps)
  out = tmp_path / "out.json"
  bench.main(["--arm", f"full={tmp_path}/new/full*", "--previous", str(first),
              "--out", str(out)])
  res = json.loads(out.read_text())
  assert [r["seed"] for r in res["runs"]["full"]] == [0, 1, 2]
  gains = res["arms"]["full"]["sampled"]["gain_s"]  # 0.25, 0.30 (new), 0.24 - 0.10
  assert [round(g, 12) for g in gains] == [0.15, 0.2, 0.14]
  with pytest.raises(SystemExit, match=r"has no arm 'lora'"):
    bench.main(["--arm", f"lora={tmp_path}/none*", "--previous", str(first)])

"""The regime map (``jaxreplay.regime_map``) on hand-made runs with known answers: the
constants read from the self-tuning runs, the theory's design at them, tokens to reach
on-policy's final accuracy, the best fixed configuration, the verdicts, the page splice."""

import json
import math
import os

import pytest

from jaxreplay import regime_map, report, theory


def _write_run(d, evals, b=4, r=4, n=4, tokens_per_rollout=2.5, gen_s=0.1, train_s=0.2,
               noise=None, auto=None):
  """Step records 1..last (R rollouts of ``tokens_per_rollout`` tokens per step), the
  {step: acc_sampled} evaluations, and per step ``noise`` (alpha, rho) / ``auto`` records
  ({step: {...}})."""
  os.makedirs(d, exist_ok=True)
  with open(os.path.join(d, "metrics.jsonl"), "w") as f:
    for step in range(0, max(evals) + 1):
      rec = {"step": step}
      if step:
        rec.update(generated_tokens=step * r * tokens_per_rollout, generated_rollouts=step * r,
                   trained_samples=step * b, generate_s=gen_s * step, train_s=train_s * step)
      if step in evals:
        rec["eval/acc_sampled"] = evals[step]
      rec.update((noise or {}).get(step, {}))
      rec.update((auto or {}).get(step, {}))
      f.write(json.dumps(rec) + "\n")
  with open(os.path.join(d, "config.json"), "w") as f:
    json.dump({"train": {"batch_size": b, "mode": "sync"}, "rollout": {"per_step": r},
               "buffer": {"capacity": n}}, f)


ONPOL = {0: 0.1, 2: 0.4, 4: 0.6}  # B = R = 4, 10 tokens per step: 0.6 reached at 40 tokens
NOISE = {2: {"noise/alpha": 0.2, "noise/rho": 0.1}, 4: {"noise/alpha": 0.3, "noise/rho": 0.1},
         6: {"noise/alpha": "NaN", "noise/rho": 0.3}}  # NaN as the metric files keep it
AUTO = {s: {"auto/R": 2.0, "auto/max_staleness": 3.0, "auto/changed": float(s == 2)}
        for s in range(1, 9)}


def _sweep(tmp_path):
  """Regime a: a buffer (x = 4, y = 2) reaches 0.6 with half the tokens, the self-tuning
  run needs as many as on-policy. Regime b: the buffer never reaches it, the self-tuning
  run with half the tokens; μ = 10 there (generation 10× slower per step)."""
  for seed in range(3):
    for g in ("a", "b"):
      _write_run(tmp_path / f"{g}_onpolicy" / f"seed{seed}", ONPOL)
    _write_run(tmp_path / "a_fixed" / f"seed{seed}", {0: 0.1, 4: 0.6, 8: 0.7}, r=2, n=8)
    _write_run(tmp_path / "a_auto" / f"seed{seed}", {0: 0.1, 4: 0.5, 8: 0.6}, r=2, n=8,
               noise=NOISE, auto=AUTO)
    _write_run(tmp_path / "b_fixed" / f"seed{seed}", {0: 0.1, 4: 0.3, 8: 0.55}, r=2, n=8)
    _write_run(tmp_path / "b_auto" / f"seed{seed}", {0: 0.1, 4: 0.6, 8: 0.6}, r=2, n=8,
               gen_s=1.0, noise={2: {"noise/alpha": 0.1, "noise/rho": 0.5}}, auto=AUTO)
  configs = []
  for g in ("a", "b"):
    configs += [dict(name=f"{g}_onpolicy", regime=g, role="onpolicy"),
                dict(name=f"{g}_fixed", regime=g, role="fixed"),
                dict(name=f"{g}_auto", regime=g, role="auto")]
  return {"seeds": [0, 1, 2], "configurations": configs, "base_config": "configs/default.py",
          "report": {"kind": "regime_map", "target_last": 1, "x_bounds": (1.0, 8.0),
                     "y_bounds": (1.0, 4.0)}}


def test_constants_theory_and_verdicts_with_known_answers(tmp_path):
  s = _sweep(tmp_path)
  runs, missing = report.load_runs(s, str(tmp_path))
  assert not missing
  a, b = regime_map.regimes_of(s, runs)
  # μ = (0.1 s / 2 rollouts) / (0.2 s / 4 samples) = 1; α median of 0.2, 0.3 (NaN left out)
  assert a.constants == [{"mu": pytest.approx(1.0), "alpha": pytest.approx(0.25),
                          "rho": pytest.approx(0.1), "estimates": 3}] * 3
  assert b.median["mu"] == pytest.approx(10.0)
  assert a.design == pytest.approx(theory.power_law_design_bounded(1.0, 0.1, 0.25, (1, 8),
                                                                   (1, 4)))
  # the closed form's y* at μ = 1 is 0.854 < 1: the box's y is 1, on-policy
  assert a.design[1] == pytest.approx(1.0) and a.theory_says_replay() is False
  # at μ = 10, α = 0.1, ρ = 0.5: y* = (−0.1 + √(0.01 + 10·0.5·0.8))/0.5 = 3.805 (inside)
  assert b.design[1] == pytest.approx((-0.1 + math.sqrt(0.01 + 4.0)) / 0.5, rel=1e-6)
  assert b.theory_says_replay() is True
  # tokens to 0.6: on-policy 40, a_fixed 20 (50%), a_auto 40 (100%); b_fixed never, b_auto 20
  assert a.pct("a_fixed") == [50.0] * 3 and a.pct("a_auto") == [100.0] * 3
  assert a.best_fixed() == "a_fixed" and a.replay_pays() is True
  assert a.auto_verdict() == ("no", pytest.approx(2.0))
  assert b.pct("b_fixed") == [math.inf] * 3 and b.best_fixed() == "b_onpolicy"
  # b: no fixed buffer beats on-policy, the self-tuning one does: replay pays there too
  assert b.best_replay() == "b_auto" and b.replay_pays() is True
  assert b.auto_verdict() == ("yes", pytest.approx(0.5))
  k = a.controller()
  assert k["R"] == [2.0] * 3 and k["y"] == [2.0] * 3 and k["x"] == [4.0] * 3
  assert k["changes"] == [1] * 3
  text = regime_map.summary_sentences([a, b])
  assert text.startswith("Replay saved generation in 2 of 2 regimes, a (`a_fixed`: 50% of "
                         "on-policy's tokens), b (`b_auto`: 50% of on-policy's tokens); ")
  assert "a: μ = 1.00, α = 0.25, ρ = 0.10" in text and "at a buffer in b" in text
  assert text.endswith("in 1 of 2.")


def test_round_design():
  assert regime_map.round_design(3.4, 1.6) == (3, 2)
  assert regime_map.round_design(0.5, 0.9) == (1, 1)
  assert regime_map.round_design(2.2, 3.1) == (4, 4)  # N >= B: x at least y
  with pytest.raises(ValueError, match="NaN"):
    regime_map.round_design(float("nan"), 1.0)
  assert all(math.isnan(v) for v in regime_map.theory_design(float("nan"), 0.1, 0.1, (1, 8),
                                                              (1, 4)))
  # estimates outside the model's range are clipped: ρ < 0 -> 0, α < 0 -> 0
  assert regime_map.theory_design(2.0, -0.1, -0.2, (1, 8), (1, 4)) == pytest.approx(
      theory.power_law_design_bounded(2.0, 0.0, 0.0, (1, 8), (1, 4)))


def test_map_is_spliced_into_the_page_and_kept_by_the_single_regime_report(tmp_path):
  s = _sweep(tmp_path)
  md = tmp_path / "docs" / "results.md"
  md.parent.mkdir()
  md.write_text("# Title\n\nintro\n\n## Figures\n\nold\n")
  paths = report.write_report({**s, "report": {**s["report"], "results_md": str(md)}},
                              str(tmp_path), "cmd")
  text = md.read_text()
  assert paths[0] == str(md) and os.path.getsize(paths[1]) > 5000
  assert text.index("## Where replay pays") < text.index("## Figures") and "old" in text
  # μ on-policy: (0.1 s / 4 rollouts) / (0.2 s / 4 samples) = 0.5
  assert ("| a | 1.00 [1.00, 1.00] | 0.50 [0.50, 0.50] | 0.25 [0.25, 0.25] | 0.10 [0.10, 0.10] "
          "| (1.00, 1.00) |") in text
  assert ("| (1.00, 1.00) | 1.00 [1.00, 1.00] | `a_fixed` (4, 2) | 50 [50, 50] (3/3) | 100 "
          "[100, 100] (3/3) | yes | no | no (2.00×): it settled at (x, y) = (4, 2.00), the best "
          "fixed is (4, 2) |") in text
  # b: on-policy is the best fixed; the self-tuning buffer pays, as the theory predicts
  assert ("| `b_onpolicy` (1, 1) | 100 [100, 100] (3/3) | 50 [50, 50] (3/3) | yes | yes | "
          "yes (0.50×) |") in text
  assert "Where self-tuning misses" not in text  # no ``why`` in the sweep file
  # the map again: replaced, not duplicated
  report.write_report({**s, "report": {**s["report"], "results_md": str(md)}}, str(tmp_path),
                      "cmd")
  assert md.read_text() == text and text.count(regime_map.MAP_END) == 1
  # a sweep file's ``why`` is printed under the table when a verdict is no (a's is)
  report.write_report({**s, "report": {**s["report"], "results_md": str(md),
                                       "why": "stale items keep no signal."}},
                      str(tmp_path), "cmd")
  assert "\nWhere self-tuning misses its target: stale items keep no signal.\n" in md.read_text()
  report.write_report({**s, "report": {**s["report"], "results_md": str(md)}}, str(tmp_path),
                      "cmd")
  # the single-regime report rewrites the page and keeps the map
  single = {"seeds": [0, 1, 2], "base_config": "configs/default.py",
            "configurations": [dict(name="a_onpolicy", family="on"),
                               dict(name="a_fixed", family="fifo")],
            "report": {"reference": "a_onpolicy", "results_md": str(md)}}
  report.write_report(single, str(tmp_path), "cmd2")
  new = md.read_text()
  assert "old" not in new and "Regenerate: `cmd2`" in new
  assert regime_map.map_block(new) == regime_map.map_block(text)


def test_a_configuration_without_regime_or_role_is_named(tmp_path):
  s = _sweep(tmp_path)
  s["configurations"][1] = dict(name="a_fixed", regime="a", role="buffer")
  with pytest.raises(ValueError, match=r"'a_fixed'.*'role' in \('onpolicy', 'fixed', 'auto'\)"):
    regime_map.regimes_of(s, {})


def test_readme_headline_becomes_the_map(tmp_path):
  """A results page with a map gives the README's headline block as the map's two
  sentences and its regime table, then the single-regime sweep in one sentence."""
  s = _sweep(tmp_path)
  md = tmp_path / "docs" / "results.md"
  md.parent.mkdir()
  root = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
  page = open(os.path.join(root, "docs", "results.md")).read()
  md.write_text(page.replace(regime_map.map_block(page) and "\n".join(
      regime_map.map_block(page)) or "\0", ""))
  report.write_report({**s, "report": {**s["report"], "results_md": str(md)}}, str(tmp_path),
                      "cmd")
  h = report.headline_from_results(md.read_text())
  assert h["map"]["summary"].startswith("Replay saved generation in 2 of 2 regimes")
  assert [r["regime"] for r in h["map"]["rows"]] == ["a", "b"]
  assert h["map"]["rows"][0]["replay pays"] == "yes"
  block = report.render_headline(h)
  assert block[0] == report.HEADLINE_NOTE and block[-1] == report.HEADLINE_END
  assert block[2].startswith("**Where replay pays**, `configs/sweep/where_replay_pays.py` "
                             "(2 regimes × 3 seeds): ") and h["map"]["summary"] in block[2]
  assert block[4] == "| " + " | ".join(report.MAP_COLUMNS) + " |"
  assert block[6].startswith("| a | 1.00 [1.00, 1.00] | 0.50 [0.50, 0.50] | 0.25 [0.25, 0.25] |")
  assert f"best configuration found: `{h['best']}`" in block[-3]

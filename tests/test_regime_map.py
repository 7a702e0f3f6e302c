"""The regime map (``jaxreplay.regime_map``) on hand-made runs with known answers: the
constants read from the self-tuning runs, the theory's design at them, the paired comparisons
and the decisions drawn from them, the y* checks on the compute axis, the page splice and its
closing study line."""

import json
import math
import os
import re

import numpy as np
import pytest
from scipy import stats as sps

from jaxreplay import regime_map, report, theory
from jaxreplay.study import evidence, null, tables
from jaxreplay.study.runs import load_runs

BASE = [0.30, 0.36, 0.40, 0.43, 0.45, 0.46, 0.47]  # accuracy every 20 generated tokens
OFFSET = [0.0, 0.01, -0.01]                          # each seed's warm start and curve


def _write_run(d, acc, b=4, r=4, n=4, tokens_per_rollout=2.5, gen_s=0.1, train_s=0.2,
               noise=None, auto=None, gen_f=0.5, train_f=1.0):
  """Step records 1..last (R rollouts of ``tokens_per_rollout`` tokens per step; FLOPs
  ``gen_f`` per rollout and ``train_f`` per trained sample), an evaluation every 20
  generated tokens (``acc``, step 0 first), and per step ``noise`` (alpha, rho) / ``auto``
  records ({step: {...}})."""
  every = int(20 / (r * tokens_per_rollout))
  evals = {i * every: a for i, a in enumerate(acc)}
  os.makedirs(d, exist_ok=True)
  with open(os.path.join(d, "metrics.jsonl"), "w") as f:
    for step in range(0, max(evals) + 1):
      rec = {"step": step}
      if step:
        rec.update(generated_tokens=step * r * tokens_per_rollout, generated_rollouts=step * r,
                   trained_samples=step * b, generate_s=gen_s * step, train_s=train_s * step,
                   generation_flops=gen_f * step * r, training_flops=train_f * step * b)
      if step in evals:
        rec["eval/acc_sampled"] = evals[step]
      rec.update((noise or {}).get(step, {}))
      rec.update((auto or {}).get(step, {}))
      f.write(json.dumps(rec) + "\n")
  with open(os.path.join(d, "config.json"), "w") as f:
    json.dump({"train": {"batch_size": b, "mode": "sync"}, "rollout": {"per_step": r},
               "buffer": {"capacity": n}}, f)


NOISE = {4: {"noise/alpha": 0.2, "noise/rho": 0.1}, 8: {"noise/alpha": 0.3, "noise/rho": 0.1},
         12: {"noise/alpha": "NaN", "noise/rho": 0.3}}  # NaN as the metric files keep it
AUTO = {s: {"auto/R": 2.0, "auto/max_staleness": 3.0, "auto/changed": float(s == 2)}
        for s in range(1, 25)}
# per seed, a configuration's curve minus on-policy's (the same at every evaluation)
SHIFT = {"a_fixed": [0.14, 0.15, 0.16], "a_auto": [0.10, 0.11, 0.10],
         "b_fixed": [-0.05, -0.04, -0.06], "b_auto": [0.01, -0.01, 0.0]}


def _sweep(tmp_path):
  """Regime a: the buffer (x = 4, y = 2) is ahead of on-policy by 0.15 on average, the
  self-tuning run by 0.103, below the buffer. Regime b: the buffer is behind, the self-tuning
  run level with on-policy; μ = 10 there (generation 10× slower per step)."""
  for seed in range(3):
    curve = lambda shift: [v + OFFSET[seed] + shift for v in BASE]  # noqa: E731
    for g in ("a", "b"):
      _write_run(tmp_path / f"{g}_onpolicy" / f"seed{seed}", curve(0.0))
      _write_run(tmp_path / f"{g}_fixed" / f"seed{seed}", curve(SHIFT[f"{g}_fixed"][seed]),
                 r=2, n=8)
    _write_run(tmp_path / "a_auto" / f"seed{seed}", curve(SHIFT["a_auto"][seed]), r=2, n=8,
               noise=NOISE, auto=AUTO)
    _write_run(tmp_path / "b_auto" / f"seed{seed}", curve(SHIFT["b_auto"][seed]), r=2, n=8,
               gen_s=1.0, gen_f=10.0, noise={4: {"noise/alpha": 0.1, "noise/rho": 0.5}}, auto=AUTO)
  configs = []
  for g in ("a", "b"):
    configs += [dict(name=f"{g}_onpolicy", regime=g, role="onpolicy"),
                dict(name=f"{g}_fixed", regime=g, role="fixed"),
                dict(name=f"{g}_auto", regime=g, role="auto")]
  return {"seeds": [0, 1, 2], "configurations": configs, "base_config": "configs/default.py",
          "report": {"kind": "regime_map", "x_bounds": (1.0, 8.0), "y_bounds": (1.0, 4.0),
                     "null_sims": 400}}


def _p_greater(d):
  d = np.asarray(d, float)
  return sps.t.sf(d.mean() / (d.std(ddof=1) / math.sqrt(len(d))), len(d) - 1)


def test_constants_theory_and_decisions_with_known_answers(tmp_path):
  s = _sweep(tmp_path)
  runs, missing = load_runs(s, str(tmp_path))
  assert not missing
  a, b = regime_map.regimes_of(s, runs)
  # μ (time) = (0.1 s / 2 rollouts) / (0.2 s / 4 samples) = 1; μ (FLOPs) = 0.5 / 1.0;
  # α median of 0.2, 0.3 (NaN left out)
  assert a.constants == [{"mu_flops": pytest.approx(0.5), "mu": pytest.approx(1.0),
                          "alpha": pytest.approx(0.25), "rho": pytest.approx(0.1),
                          "estimates": 3}] * 3
  assert b.median["mu"] == pytest.approx(10.0) and b.median["mu_flops"] == pytest.approx(10.0)
  # the theory reads μ (FLOPs), not the load-dependent μ (time)
  assert a.design == pytest.approx(theory.power_law_design_bounded(0.5, 0.1, 0.25, (1, 8),
                                                                   (1, 4)))
  # the closed form's y* at μ = 0.5 is below 1: the box's y is 1, on-policy
  assert a.design[1] == pytest.approx(1.0) and a.theory_says_replay() is False
  # at μ = 10, α = 0.1, ρ = 0.5: y* = (−0.1 + √(0.01 + 10·0.5·0.8))/0.5 = 3.805 (inside)
  assert b.design[1] == pytest.approx((-0.1 + math.sqrt(0.01 + 4.0)) / 0.5, rel=1e-6)
  # a curve shifted by c at every evaluation has an AUC and smoothed accuracies c higher
  ea, eb = a.evidence, b.evidence
  fx = ea.vs_reference["a_fixed"]
  assert fx.auc.diff_s == pytest.approx(tuple(SHIFT["a_fixed"]))
  half = sps.t.ppf(0.975, 2) * 0.01 / math.sqrt(3)
  assert fx.auc.t == pytest.approx((0.15 - half, 0.15 + half))
  assert all(fx.at[f].mean == pytest.approx(0.15) for f in evidence.FRACTIONS)
  assert fx.auc.p_value == pytest.approx(_p_greater(SHIFT["a_fixed"]))
  assert fx.auc.p_improve == 1.0 and fx.tokens.reached == 3
  # replay pays in a (p far below 5%/2; the rule reads the buffer with the smallest p: the
  # self-tuning run's differences are smaller but steadier), not in b (the best p is 0.5)
  assert _p_greater(SHIFT["a_auto"]) < _p_greater(SHIFT["a_fixed"]) < 0.05 / 2
  assert ea.pays and ea.lead == "a_auto" and ea.best_fixed == "a_fixed"
  assert not eb.pays and eb.lead == "b_auto" and eb.best_fixed == "b_onpolicy"
  assert eb.vs_reference["b_auto"].auc.p_value == pytest.approx(0.5)
  # self-tuning against the best fixed: short in a (best − it = 0.04, 0.04, 0.06), not in b
  d = np.subtract(SHIFT["a_fixed"], SHIFT["a_auto"])
  assert ea.vs_best["a_auto"].auc.mean == pytest.approx(-d.mean())
  assert _p_greater(d) < 0.05 / 2 and ea.auto_short is True
  assert eb.auto_short is False
  k = a.controller()
  assert k["R"] == [2.0] * 3 and k["y"] == [2.0] * 3 and k["x"] == [4.0] * 3
  assert k["changes"] == [1] * 3
  assert k["mu_source"] == ["time"] * 3  # the hand-made config.json names none: wall time


def test_y_star_checks_on_the_compute_axis(tmp_path):
  """In a the buffer (y = 2) is far ahead at every μ, in b far behind: the runs exclude one
  y, and a check agrees when the theory's y* (nearest y run) is the other."""
  s = _sweep(tmp_path)
  runs, _ = load_runs(s, str(tmp_path))
  a, b = regime_map.regimes_of(s, runs)
  for g, ys, alpha, rho in ((a, (2.0,), 0.25, 0.1), (b, (1.0,), 0.1, 0.5)):
    assert [c.mu for c in g.checks] == list(evidence.MUS)
    for c in g.checks:
      assert c.ys == ys and c.grid == (1.0, 2.0) and c.informative
      y = evidence.theory_design(c.mu, alpha, rho, (1, 8), (1, 4))[1]
      nearest = 1.0 if abs(math.log2(y)) < abs(math.log2(y) - 1) else 2.0
      assert c.theory_grid == nearest and c.agree == (nearest in ys)
  # every y run not shown worse: cannot tell, never an agreement
  c = evidence.YStarCheck(1.0, 1.2, 1.0, (1.0, 2.0), "x", 1.0, (1.0, 2.0))
  assert not c.informative and not c.agree


def test_registered_y_star_prediction_is_scored_and_counted_in_the_line(tmp_path):
  """A prediction registered in the sweep file (``report.y_star_test``) is scored against
  the same checks: a's runs exclude y = 1 (so predicting 2 agrees 4 times of 4), b's exclude
  y = 2 (predicting 2 never agrees); the study line counts only the registered checks."""
  s = _sweep(tmp_path)
  s = {**s, "report": {**s["report"], "y_star_test": {"a": {"predicted": (2, 2, 2, 2)},
                                                      "b": {"predicted": (2, 2, 2, 2)}}}}
  runs, _ = load_runs(s, str(tmp_path))
  a, b = regime_map.regimes_of(s, runs)
  assert [c.predicted for c in a.checks] == [2.0] * 4
  assert [c.agree_predicted for c in a.checks] == [True] * 4
  assert [c.agree_predicted for c in b.checks] == [False] * 4
  assert evidence.best_y_rises(a.checks) and evidence.best_y_rises(b.checks)
  study = regime_map.study_of([a, b], n_sims=200)
  assert study.line().endswith("y_star_checks=8 y_star_agree=4")
  # only a registered: 4 checks, all agree
  one = {**s, "report": {**s["report"], "y_star_test": {"a": {"predicted": (2, 2, 2, 2)}}}}
  a1, b1 = regime_map.regimes_of(one, runs)
  assert regime_map.study_of([a1, b1], n_sims=200).line().endswith(
      "y_star_checks=4 y_star_agree=4")
  row = tables.y_star_row("a", a.checks[0])
  assert row[2] == "2" and row[7] == "yes"
  # a falling best y is against the theory; a wrong length or regime is refused
  c = [evidence.YStarCheck(m, 1.0, 1.0, (1.0, 2.0), "x", y, (y,)) for m, y in ((1, 2.0), (2, 1.0))]
  assert not evidence.best_y_rises(c)
  with pytest.raises(ValueError, match="one y per μ"):
    regime_map.regimes_of({**s, "report": {**s["report"], "y_star_test": {
        "a": {"predicted": (2, 2)}}}}, runs)
  with pytest.raises(ValueError, match="regimes \\['zz'\\] are not in the sweep"):
    regime_map.regimes_of({**s, "report": {**s["report"], "y_star_test": {
        "zz": {"predicted": (2, 2, 2, 2)}}}}, runs)


def test_a_configuration_with_fewer_than_two_seeds_waits_and_counts_in_seeds_min(tmp_path):
  """A configuration the file lists with one seed run (or none) is left out of the evidence
  and named as pending; the study line's seeds_min is the file's fewest (here 1), while the
  simulations use the seeds of the configurations in the evidence (3)."""
  s = _sweep(tmp_path)
  _write_run(tmp_path / "a_new" / "seed0", [v + OFFSET[0] for v in BASE], r=2, n=8)
  s = {**s, "configurations": s["configurations"] + [
      dict(name="a_new", regime="a", role="fixed"), dict(name="b_new", regime="b", role="fixed")]}
  runs, _ = load_runs(s, str(tmp_path))
  a, b = regime_map.regimes_of(s, runs)
  assert a.pending == {"a_new": 1} and b.pending == {"b_new": 0}
  assert "a_new" not in a.evidence.vs_reference and a.seeds() == 3 and a.seeds_file() == 1
  study = regime_map.study_of([a, b], n_sims=200)
  assert study.n_seeds == {"a": 3, "b": 3} and study.seeds_min == 0
  # each regime is simulated and judged at its own design: k = its buffers with evidence
  assert study.n_buffers == {"a": 2, "b": 2} == {g.name: g.evidence.n_tests for g in (a, b)}
  assert study.detectable["a"] == pytest.approx(null.detectable_difference(study.sd_d, 3, 2))
  assert " at a (3 seeds, k = 2), a token saving of " in regime_map.summary_sentences(study)
  assert " seeds_min=0 " in study.line()
  intro = " ".join(regime_map._intro(s, study))
  assert "(2 regimes × 3 seeds; seeds per configuration: a 3, b 3;" in intro
  assert "fewer than 2 of the file's 3 seeds run): `a_new` (1), `b_new` (0)." in intro


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
  md.write_text("# Title\n\nintro\n\n## Figures\n\nOLD-FIGURES\n")
  paths = report.write_report({**s, "report": {**s["report"], "results_md": str(md)}},
                              str(tmp_path), "cmd")
  text = md.read_text()
  assert paths[0] == str(md) and os.path.getsize(paths[1]) > 5000
  assert text.index("## Where replay pays") < text.index("## Figures") and "OLD-FIGURES" in text
  # μ (FLOPs) 0.5, μ (time) 1; μ (time) on-policy: (0.1 s / 4 rollouts) / (0.2 s / 4 samples)
  assert ("| a | 0.50 [0.50, 0.50] | 1.00 [1.00, 1.00] | 0.50 [0.50, 0.50] | 0.25 [0.25, 0.25] "
          "| 0.10 [0.10, 0.10] "
          "| (1.00, 1.00) | 1.00 [1.00, 1.00] | `a_auto` | +0.103 [0.089, 0.118] | ") in text
  assert "| **yes** | -0.047 [" in text  # a: replay pays; self-tuning − best fixed
  assert "| `b_auto` | +0.000 [-0.025, 0.025] | 0.500 | not shown |" in text
  # the page ends with the study line; its counts are the hand-made sweep's
  last = text.rstrip().splitlines()[-1]
  m = re.fullmatch(r"regimes=2 seeds_min=3 null_fpr_max=([\d.]+) y_star_checks=8 "
                   r"y_star_agree=(\d+)", last)
  assert m and 0 < float(m.group(1)) <= 0.1
  checks = [c for g in regime_map.regimes_of(s, load_runs(s, str(tmp_path))[0])
            for c in g.checks]
  assert int(m.group(2)) == sum(c.agree for c in checks)
  # the map again: replaced, not duplicated
  report.write_report({**s, "report": {**s["report"], "results_md": str(md)}}, str(tmp_path),
                      "cmd")
  assert md.read_text() == text and text.count(regime_map.MAP_END) == 1
  assert text.count("\nregimes=") == 1
  # the single-regime report rewrites the page and keeps the map and the study line
  report.write_report(_single_regime("a", md), str(tmp_path), "cmd2")
  new = md.read_text()
  assert "OLD-FIGURES" not in new and "Regenerate: `cmd2`" in new
  assert regime_map.map_block(new) == regime_map.map_block(text)
  assert new.rstrip().splitlines()[-1] == last


def _single_regime(prefix: str, md) -> dict:
  """A single-regime sweep (``PREFIX_onpolicy`` against ``PREFIX_fixed``, 3 seeds) whose
  report rewrites the page ``md``."""
  return {"seeds": [0, 1, 2], "base_config": "configs/default.py",
          "configurations": [dict(name=f"{prefix}_onpolicy", family="on"),
                             dict(name=f"{prefix}_fixed", family="fifo")],
          "report": {"reference": f"{prefix}_onpolicy", "results_md": str(md)}}


def test_a_configuration_without_regime_or_role_is_named(tmp_path):
  s = _sweep(tmp_path)
  s["configurations"][1] = dict(name="a_fixed", regime="a", role="buffer")
  with pytest.raises(ValueError, match=r"'a_fixed'.*'role' in \('onpolicy', 'fixed', 'auto'\)"):
    regime_map.regimes_of(s, {})


def test_readme_headline_becomes_the_map(tmp_path):
  """A results page with a map gives the README's headline block as the map's sentences, its
  regime table and its study line, then the single-regime sweep in one sentence."""
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
  assert h["map"]["summary"].startswith("Paired by seed (3 seeds, one warm start each)")
  assert "in 1 of 2 regimes: a (`a_auto`, +0.103 [0.089, 0.118]); not shown in b" in \
      h["map"]["summary"]
  assert [r["regime"] for r in h["map"]["rows"]] == ["a", "b"]
  assert h["map"]["rows"][0]["replay pays"] == "**yes**"
  assert h["map"]["line"].startswith("regimes=2 seeds_min=3 ")
  block = report.render_headline(h)
  assert block[0] == report.HEADLINE_NOTE and block[-1] == report.HEADLINE_END
  assert block[2].startswith("**Where replay pays**, `configs/sweep/where_replay_pays.py` "
                             "(2 regimes × 3 seeds): ") and h["map"]["summary"] in block[2]
  assert block[4] == "| " + " | ".join(report.MAP_COLUMNS) + " |"
  assert block[6].startswith("| a | 0.50 [0.50, 0.50] | 1.00 [1.00, 1.00] | 0.25 [0.25, 0.25] |")
  assert block[-3].startswith(f"Study: `{h['map']['line']}`.")
  assert f"at a rate of {h['map']['rules']['first_crossing']} under" in block[-3]


def test_one_direction_of_imports():
  """statistics ← runs ← evidence ← tables / figures ← regime_map ← report: no module
  imports one after it."""
  order = ["stats", "fit", "null", "runs", "evidence", "tables", "figures"]
  root = os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "jaxreplay")
  later = {m: order[i + 1:] + ["regime_map", "report"] for i, m in enumerate(order)}
  later["regime_map"] = ["report"]
  for mod, banned in later.items():
    path = os.path.join(root, "study", f"{mod}.py") if mod in order else \
        os.path.join(root, f"{mod}.py")
    src = open(path).read()
    for b in banned:
      assert not re.search(rf"^\s*(from jaxreplay(\.study)? import .*\b{b}\b|"
                           rf"from jaxreplay(\.study)?\.{b} import|import jaxreplay(\.study)?\.{b})",
                           src, re.M), (mod, b)


def test_eval_noise_sentence_reads_the_bench_result(tmp_path):
  p = tmp_path / "noise.json"
  p.write_text(json.dumps({
      "run": "r", "seed": 0, "keys": 8, "examples": 400, "samples_per_example": 4,
      "base": {"step": 0, "sd_acc_sampled": 0.0093, "sd_acc_greedy": 0.0},
      "final": {"step": 240, "sd_acc_sampled": 0.0096, "sd_acc_greedy": 0.0},
      "provenance": {"date": "2026-12-04"}}))
  s = regime_map.eval_noise_sentence(str(p), 0.020)
  assert "SD 0.009 at the warm start and 0.010 at step 240" in s
  assert "of the jitter 0.020 the rest is the policy moving" in s
  assert regime_map.eval_noise_sentence(str(tmp_path / "absent.json"), 0.02) == ""
  p.write_text(json.dumps({"run": "r"}))
  with pytest.raises(ValueError, match="not a bench/eval_noise.py result"):
    regime_map.eval_noise_sentence(str(p), 0.02)


def test_a_paired_sweep_is_a_section_spliced_into_the_page_and_kept(tmp_path):
  """``report.kind = "paired"`` (``jaxreplay.paired``): a_fixed against a_onpolicy on 3 seeds,
  ahead by 0.14, 0.15 and 0.16 at every evaluation, so by their mean, 0.150, in AUC with a t
  interval of ±t(0.975, 2)·0.01/√3; the section is spliced after the map, replaced (not
  duplicated) when written again, and kept when the single-regime report rewrites the page."""
  from jaxreplay import paired
  s = _sweep(tmp_path)
  md = tmp_path / "docs" / "results.md"
  md.parent.mkdir()
  md.write_text("# Title\n\nintro\n\n## Figures\n\nOLD-FIGURES\n")
  report.write_report({**s, "report": {**s["report"], "results_md": str(md)}}, str(tmp_path),
                      "cmd")
  pair = {"seeds": [0, 1, 2], "base_config": "configs/default.py",
          "configurations": [dict(name="a_onpolicy"), dict(name="a_fixed")],
          "report": {"kind": "paired", "section": "pair-a", "title": "A pair",
                     "reference": "a_onpolicy", "results_md": str(md)}}
  report.write_report(pair, str(tmp_path), "cmd-pair")
  text = md.read_text()
  half = sps.t.ppf(0.975, 2) * 0.01 / math.sqrt(3)
  assert f"| — | `a_fixed` | `a_onpolicy` | +0.150 [{0.15 - half:.3f}, {0.15 + half:.3f}] |" in text
  assert text.index(regime_map.MAP_END) < text.index("<!-- pair-a:start") < text.index(
      "## Figures") and "OLD-FIGURES" in text
  assert "| `a_onpolicy` | 0.300 @ 0k · 0.360 @ 0k" in text  # seeds' mean curve
  report.write_report(pair, str(tmp_path), "cmd-pair")
  assert md.read_text() == text and text.count("<!-- pair-a:end -->") == 1
  report.write_report(_single_regime("b", md), str(tmp_path), "cmd2")
  new = md.read_text()
  assert "OLD-FIGURES" not in new and "Regenerate: `cmd2`" in new
  assert paired.blocks(new)["pair-a"] == paired.blocks(text)["pair-a"]
  assert regime_map.map_block(new) == regime_map.map_block(text)
  with pytest.raises(ValueError, match="2 seeds with runs of both"):
    paired.render({**pair, "seeds": [0], "configurations": [dict(name="a_onpolicy"),
                                                             dict(name="zz")]}, str(tmp_path), "c")

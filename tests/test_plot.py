"""``python -m jaxreplay.plot`` writes one PNG per figure from runs' metrics."""

import json

import numpy as np
import pytest

from jaxreplay import plot

LEDGER = {"mu_flops": 0.3, "mu_time": 0.6, "gamma_flops": 0.88, "gamma_time": 0.8,
          "first_use_tokens": 90, "evicted_unused_tokens": 6, "unused_in_buffer_tokens": 4,
          "trained_tokens": 180}


def _run(path, scale, summary=True):
  path.mkdir()
  recs = [{"step": 0, "eval/acc_sampled": 0.3, "eval/acc_greedy": 0.5}]
  for s in range(1, 5):
    recs.append({"step": s, "entropy": 1.0 / s, "generated_tokens": 100 * s,
                 "generate_s": s * scale, "train_s": s, "eval_s": 0.0,
                 "staleness_hist": [4, 2, 1, 0], "eval/acc_sampled": 0.3 + 0.05 * s,
                 "eval/acc_greedy": 0.5, "replay_count_mean": 1.5, "frac_never_used": 0.5})
  (path / "metrics.jsonl").write_text("\n".join(json.dumps(r) for r in recs) + "\n")
  if summary:
    (path / "summary.json").write_text(json.dumps({"ledger": LEDGER}))
  return str(path)


def test_plot_writes_every_figure(tmp_path, capsys):
  a, b = _run(tmp_path / "a", 1.0), _run(tmp_path / "b", 2.0)
  plot.main([a, b, "--out", str(tmp_path / "out")])
  printed = capsys.readouterr().out.split()
  names = sorted(p.rsplit("/", 1)[1] for p in printed)
  assert names == ["acc_vs_steps.png", "acc_vs_time.png", "acc_vs_tokens.png", "entropy.png",
                   "ledger.png", "replay.png", "staleness.png"]
  for p in printed:
    with open(p, "rb") as f:
      head = f.read(8)
    assert head == b"\x89PNG\r\n\x1a\n"
  # the time axis is generate + train + eval seconds
  recs = plot._elapsed([{"generate_s": 2.0, "train_s": 3.0, "eval_s": 1.0}])
  assert recs[0]["time_s"] == 6.0


def test_strict_fails_on_an_empty_series_after_drawing(tmp_path):
  full = _run(tmp_path / "full", 1.0)
  assert len(plot.plot_runs([full], str(tmp_path / "ok"), strict=True)) == 7
  bare = tmp_path / "bare"  # no evaluation, no replay statistics, not finished
  bare.mkdir()
  (bare / "metrics.jsonl").write_text(json.dumps({"step": 1, "entropy": 0.5,
                                                  "staleness_hist": [1, 0]}) + "\n")
  with pytest.raises(ValueError, match=r"bare: acc_vs_tokens.png.*bare: replay.png.*"
                                       r"bare: ledger.png \(no summary.json"):
    plot.plot_runs([full, str(bare)], str(tmp_path / "out"), strict=True)
  assert (tmp_path / "out" / "acc_vs_tokens.png").exists()  # drawn before the error
  plot.plot_runs([full, str(bare)], str(tmp_path / "lax"))  # without strict: no error


def test_series_keeps_the_records_holding_both_keys():
  recs = [{"step": 0, "a": 1.0}, {"step": 1}, {"step": 2, "a": 3.0}]
  np.testing.assert_array_equal(plot.series(recs, "step", "a"), [[0.0, 1.0], [2.0, 3.0]])
  assert plot.series(recs, "step", "b").shape == (0, 2)

"""``python -m jaxreplay.plot`` writes one PNG per figure from runs' metrics."""

import json

from jaxreplay import plot


def _run(path, scale):
  path.mkdir()
  recs = [{"step": 0, "eval/acc_sampled": 0.3, "eval/acc_greedy": 0.5}]
  for s in range(1, 5):
    recs.append({"step": s, "entropy": 1.0 / s, "generated_tokens": 100 * s,
                 "generate_s": s * scale, "train_s": s, "eval_s": 0.0,
                 "staleness_hist": [4, 2, 1, 0], "eval/acc_sampled": 0.3 + 0.05 * s,
                 "eval/acc_greedy": 0.5})
  (path / "metrics.jsonl").write_text("\n".join(json.dumps(r) for r in recs) + "\n")
  return str(path)


def test_plot_writes_every_figure(tmp_path, capsys):
  a, b = _run(tmp_path / "a", 1.0), _run(tmp_path / "b", 2.0)
  plot.main([a, b, "--out", str(tmp_path / "out")])
  printed = capsys.readouterr().out.split()
  names = sorted(p.rsplit("/", 1)[1] for p in printed)
  assert names == ["acc_vs_steps.png", "acc_vs_time.png", "acc_vs_tokens.png", "entropy.png",
                   "staleness.png"]
  for p in printed:
    with open(p, "rb") as f:
      head = f.read(8)
    assert head == b"\x89PNG\r\n\x1a\n"
  # the time axis is generate + train + eval seconds
  recs = plot._elapsed([{"generate_s": 2.0, "train_s": 3.0, "eval_s": 1.0}])
  assert recs[0]["time_s"] == 6.0

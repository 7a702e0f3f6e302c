"""bench/staleness_bias.py's archive readers, on a hand-made ``--export-runs`` archive."""

import io
import json
import tarfile

import pytest

from conftest import load_bench


def _archive(path, runs: dict[str, list[float]]):
  """A tar.xz with ``NAME/seed0/metrics.jsonl`` per run: one eval record every 20 steps."""
  with tarfile.open(path, "w:xz") as tar:
    for name, accs in runs.items():
      body = "\n".join(json.dumps({"step": 20 * i, "eval/acc_sampled": a})
                       for i, a in enumerate(accs)).encode()
      info = tarfile.TarInfo(f"{name}/seed0/metrics.jsonl")
      info.size = len(body)
      tar.addfile(info, io.BytesIO(body))


def test_evaluation_jitter_and_on_policy_gain_by_hand(tmp_path):
  bench = load_bench("staleness_bias")
  path = str(tmp_path / "runs.tar.xz")
  _archive(path, {"r_onpolicy": [0.30, 0.40, 0.42, 0.38, 0.44, 0.40],
                  "r_fixed_x4_y2": [0.30, 0.35, 0.37, 0.37, 0.41],
                  "q_auto": [0.5, 0.5]})  # too short for a second half of >= 3 evaluations
  out = bench.evaluation_jitter(path)
  # r_onpolicy: second half 0.38, 0.44, 0.40 -> steps +0.06, -0.04 -> stdev 0.0707 / sqrt 2
  # = 0.05; r_fixed: 0.37, 0.37, 0.41 -> 0, +0.04 -> 0.0283 / sqrt 2 = 0.02; median 0.035.
  # gain: mean(0.38, 0.44, 0.40) - 0.38 (the evaluation at half the run) = 0.02667.
  assert set(out) == {"r"}
  assert out["r"] == pytest.approx((0.035, 0.4066667 - 0.38), abs=1e-6)

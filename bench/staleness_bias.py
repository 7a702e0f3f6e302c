"""How much of the fresh gradient a stale item keeps: the bias of the paper's Thm 4.4, measured.

Protocol (issue 27): for each learning rate of ``configs/sweep/where_replay_pays.py``
(5e-5, 1e-4, 2e-4; seed 0) one run of that sweep's self-tuning configuration with the
controller held still (``auto_replay.warmup`` never reached, so the buffer stays at its
start, x = 4, y = 2: ages 0..3 in every batch) for ``--steps`` learner steps; every 25 steps
the noise pass (``rl.noise.estimate_noise``, 256 buffer items, 64 projections, between
INSERT and UPDATE, so the freshest items are age 0) logs per staleness bucket σ̂²(s) and
the bias β̂²(s) = ‖E g(age s) − E g(age 0)‖² (``rl.noise.bias_profile``), ‖∇F‖² and the
fresh items' variance. Per regime it prints the medians over the estimates of

* ``var_ratio``: σ̂²(1)/σ̂²(0), the per-item error variance of one-step-old items over fresh
  ones (the theory assumes >= 1: σ non-decreasing);
* ``alpha``: the fitted power-law exponent of σ(s) (App. 9.3.2; < 0 when variance falls);
* ``bias1``: β̂²(1)/‖∇F‖², the squared distance of a one-step-old item's mean gradient from
  the fresh one, in units of the fresh gradient's own squared norm (0: it carries the same
  signal; ~1 or more: none of it);
* ``k``: the relative bias per step of age (``replay.auto.relative_bias``) and the horizon
  bound Thm 4.4's step-size condition gives, x_cap = 1/(2√2·k) (``auto_replay.bias_limit``);

and, over all the run's learner steps, the share of loss tokens of age 0, 1 and 2–3 whose
gradient the PPO clip removed (``stale/<bucket>/clip_frac``, token-weighted). With
``--unclipped`` each regime runs again with the noise pass scoring the same items at the same
parameters with the clip range opened: whether the clip is what makes older items' gradient
noise smaller.

With ``--longer_onpolicy N`` it first runs the sweep's on-policy configuration at lr 2e-4 for
N learner steps (the sweep's 240 are a generation budget; a buffer at y = 2 or 4 takes 2–4×
as many learner steps for it), seeds 0–2, and prints the held-out sampled accuracy averaged
over the evaluations at steps 200–280 and over the last 80 steps: whether more learner steps
alone lower accuracy at that rate.

Before both, from the sweep's committed runs (``--archive``, read in place), it prints each
configuration's held-out sampled accuracy at equal learner steps — the mean of its evaluations
at steps 200–280 (on-policy's runs end at 240), median over seeds — to compare progress per
learner step across designs, the range of the sweep's single ρ estimates, and per regime one
held-out evaluation's jitter next to on-policy's gain over the second half of its run
(``evaluation_jitter``; when they are of a size, the step at which a run first reaches
on-policy's final accuracy is set by one evaluation's noise). ``--steps 0`` prints only those.

  python bench/staleness_bias.py [--steps 100] [--unclipped] [--longer_onpolicy 480]
                                 [--workdir DIR]

On a 2-core CPU: about 6 minutes for the three regimes (twice that with ``--unclipped``), 18
with ``--longer_onpolicy 480`` (each seed's base policy warm start, cached, comes on top once).
The last line names the three k's.
"""

from __future__ import annotations

import argparse
import importlib.util
import math
import os
import shutil
import statistics

SWEEP = "configs/sweep/where_replay_pays.py"


def _load(path):
  spec = importlib.util.spec_from_file_location(os.path.basename(path)[:-3], path)
  mod = importlib.util.module_from_spec(spec)
  spec.loader.exec_module(mod)
  return mod


def _apply(cfg, overrides: dict) -> None:
  """Sets dotted ``section.field`` overrides on a config in place."""
  for key, value in overrides.items():
    *parents, leaf = key.split(".")
    target = cfg
    for part in parents:
      target = target[part]
    target[leaf] = value


def run_regime(lr: float, steps: int, workdir: str, unclipped: bool = False) -> list[dict]:
  """One held-still self-tuning run at ``lr``; returns its metric records, one per step.

  ``unclipped``: the noise pass scores the items with the clip range opened
  (ε_low = ε_high = 1e9), the training itself unchanged — the same parameters, items and
  projections as the clipped run's, so the two runs' estimates are paired.
  """
  import dataclasses
  from jaxreplay.config import specs, validate
  from jaxreplay.train import build, loop
  from jaxreplay.train.metrics import read_records
  sweep = _load(SWEEP)
  cfg = _load(sweep.get_config().base_config).get_config()
  overrides = {**sweep.get_config().base_overrides.to_dict(), **sweep.auto(),
               "algo.lr": lr, "auto_replay.warmup": 10 ** 6,
               "auto_replay.num_samples": 256, "auto_replay.num_projections": 64,
               "train.steps": steps, "train.max_generated_rollouts": 0,
               "eval.every": 10 ** 6, "checkpoint.every": 10 ** 6, "seed": 0,
               "workdir": workdir}
  _apply(cfg, overrides)
  shutil.rmtree(workdir, ignore_errors=True)
  make_noise = build.make_buffer_noise_fn
  if unclipped:
    build.make_buffer_noise_fn = lambda graphdef, algo, *a, **k: make_noise(
        graphdef, dataclasses.replace(algo, eps_low=1e9, eps_high=1e9), *a, **k)
  try:
    loop.run(validate(specs(cfg)), log=lambda *a: None)
  finally:
    build.make_buffer_noise_fn = make_noise
  return read_records(workdir)


def clip_fractions(recs: list[dict], buckets=("s0", "s1", "s2-3")) -> dict[str, float]:
  """{bucket: share of the learner's loss tokens of that staleness whose gradient the PPO
  clip removed} over a run (``stale/<bucket>/clip_frac`` weighted by its ``tokens``)."""
  out = {}
  for b in buckets:
    pairs = [(r[f"stale/{b}/clip_frac"], r[f"stale/{b}/tokens"]) for r in recs
             if f"stale/{b}/clip_frac" in r]
    tokens = sum(t for _, t in pairs)
    out[b] = sum(c * t for c, t in pairs) / tokens if tokens else math.nan
  return out


def longer_onpolicy(steps: int, workdir: str) -> list[tuple[int, float, float]]:
  """(seed, mean accuracy over the evaluations at steps 200–280, over the last 80 steps)
  of the sweep's lr 2e-4 on-policy configuration run for ``steps`` learner steps."""
  from jaxreplay.config import specs, validate
  from jaxreplay.train import loop
  from jaxreplay.train.metrics import read_records
  sweep = _load(SWEEP)
  out = []
  for seed in (0, 1, 2):
    cfg = _load(sweep.get_config().base_config).get_config()
    run_dir = os.path.join(workdir, f"lr2e-4_onpolicy_{steps}", f"seed{seed}")
    _apply(cfg, {**sweep.get_config().base_overrides.to_dict(), **sweep.fifo(1, 1),
                 "algo.lr": sweep.REGIMES["lr2e-4"], "train.steps": steps,
                 "eval.every": sweep.EVAL_EVERY, "checkpoint.every": 10 ** 6, "seed": seed,
                 "workdir": run_dir})
    shutil.rmtree(run_dir, ignore_errors=True)
    loop.run(validate(specs(cfg)), log=lambda *a: None)
    ev = {r["step"]: r["eval/acc_sampled"] for r in read_records(run_dir)
          if "eval/acc_sampled" in r}
    window = lambda lo, hi: statistics.mean(v for s, v in ev.items() if lo <= s <= hi)
    out.append((seed, window(200, 280), window(steps - 80, steps)))
  return out


def archive_runs(archive: str):
  """Yields (configuration, records) for each ``NAME/seedK/metrics.jsonl`` of an
  ``--export-runs`` archive (a .tar.xz), read in place.

  Raises:
    FileNotFoundError, tarfile.ReadError: the archive is missing or not a tar file.
  """
  import json
  import tarfile
  with tarfile.open(archive) as tar:
    for m in tar.getmembers():
      if m.name.endswith("/metrics.jsonl"):
        body = tar.extractfile(m).read().decode()
        yield m.name.split("/")[0], [json.loads(line) for line in body.splitlines()]


def accuracy_at_equal_steps(archive: str, lo: int = 200, hi: int = 280) -> dict[str, float]:
  """{configuration: median over seeds of the mean ``eval/acc_sampled`` (accuracy in [0, 1])
  at steps lo..hi} of an ``--export-runs`` archive's runs (``archive_runs``)."""
  per = {}
  for name, recs in archive_runs(archive):
    vals = [r["eval/acc_sampled"] for r in recs
            if "eval/acc_sampled" in r and lo <= r["step"] <= hi]
    if vals:
      per.setdefault(name, []).append(statistics.mean(vals))
  return {name: statistics.median(v) for name, v in sorted(per.items())}


def evaluation_jitter(archive: str) -> dict[str, tuple[float, float]]:
  """{regime: (jitter, gain)} of an ``--export-runs`` archive's runs (``archive_runs``): how
  noisy one held-out evaluation is next to how much on-policy still improves when the target
  is set. Both floats are in accuracy units; the regime is a configuration's name up to its
  first ``_``.

  ``jitter`` is the median over the regime's runs of std(a_{k+1} - a_k)/√2 over the
  consecutive evaluations a_k of ``eval/acc_sampled`` in the second half of a run (a slowly
  moving curve: what remains is mostly the evaluation's own noise); runs with fewer than 3
  evaluations there are skipped. ``gain`` is the median over the regime's on-policy seeds
  (>= 6 evaluations) of the mean of the last 3 evaluations (the report's target) minus the
  evaluation at half the run; NaN without one.
  """
  jit, gain = {}, {}
  for name, recs in archive_runs(archive):
    regime = name.split("_")[0]
    acc = [r["eval/acc_sampled"] for r in recs if "eval/acc_sampled" in r]
    half = acc[len(acc) // 2:]
    if len(half) >= 3:
      diffs = [b - a for a, b in zip(half, half[1:])]
      jit.setdefault(regime, []).append(statistics.stdev(diffs) / math.sqrt(2))
    if name.endswith("_onpolicy") and len(acc) >= 6:
      gain.setdefault(regime, []).append(statistics.mean(acc[-3:]) - acc[len(acc) // 2])
  return {r: (statistics.median(jit[r]), statistics.median(gain.get(r, [math.nan])))
          for r in sorted(jit)}


def rho_estimates(archive: str) -> list[float]:
  """Every finite single ``noise/rho`` estimate of an ``--export-runs`` archive's runs."""
  return [r["noise/rho"] for _, recs in archive_runs(archive) for r in recs
          if isinstance(r.get("noise/rho"), float) and math.isfinite(r["noise/rho"])]


def summarize(recs: list[dict]) -> dict:
  """Medians over the estimates (module docstring), and the run's clip fractions."""
  clip = clip_fractions(recs)
  recs = [r for r in recs if "noise/bias_slope" in r]
  med = lambda xs: statistics.median(xs) if xs else math.nan
  var_ratio = [r["noise/sigma2_s1"] / r["noise/sigma2_s0"] for r in recs
               if "noise/sigma2_s1" in r and r.get("noise/sigma2_s0", 0) > 0]
  bias1 = [r["noise/bias2_s1"] / r["noise/grad2"] for r in recs
           if "noise/bias2_s1" in r and r["noise/grad2"] > 0]
  k = [r["auto/kappa_measured"] for r in recs if math.isfinite(r["auto/kappa_measured"])]
  alpha = [r["noise/alpha"] for r in recs if math.isfinite(r["noise/alpha"])]
  km = med(k)
  return {"estimates": len(recs), "var_ratio": med(var_ratio), "alpha": med(alpha),
          "bias1": med(bias1), "k": km, "x_cap": 1 / (2 * math.sqrt(2) * km) if km else math.nan, "clip": clip}


def main():
  ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
  ap.add_argument("--steps", type=int, default=100,
                  help="learner steps per regime run (0: the archive table only)")
  ap.add_argument("--workdir", default="/tmp/staleness_bias")
  ap.add_argument("--longer_onpolicy", type=int, default=0,
                  help="also run lr 2e-4 on-policy for this many learner steps (>= 280)")
  ap.add_argument("--unclipped", action="store_true",
                  help="also rerun each regime with the noise pass's clip range opened")
  ap.add_argument("--archive", default="data/sweeps/where_replay_pays.tar.xz")
  args = ap.parse_args()
  print("| configuration | acc at steps 200–280 (median over seeds) |")
  print("|---|---|")
  for name, acc in accuracy_at_equal_steps(args.archive).items():
    print(f"| {name} | {acc:.3f} |")
  rho = rho_estimates(args.archive)
  if rho:
    print(f"single rho estimates of the sweep: {len(rho)}, min {min(rho):.1f}, median "
          f"{statistics.median(rho):.2f}, max {max(rho):.1f}")
  print("| regime | one evaluation's jitter (median over runs) | on-policy's gain over its "
        "second half |")
  print("|---|---|---|")
  for regime, (jitter, gain) in evaluation_jitter(args.archive).items():
    print(f"| {regime} | {jitter:.3f} | {gain:+.3f} |")
  if args.longer_onpolicy:
    if args.longer_onpolicy < 280:
      ap.error(f"--longer_onpolicy={args.longer_onpolicy} must be >= 280 (0: skip)")
    print(f"| seed | lr2e-4 on-policy: acc, steps 200–280 | acc, last 80 of {args.longer_onpolicy} |")
    print("|---|---|---|")
    for seed, mid, end in longer_onpolicy(args.longer_onpolicy, args.workdir):
      print(f"| {seed} | {mid:.3f} | {end:.3f} |")
  if not args.steps:
    return
  rows = {}
  for name, lr in _load(SWEEP).REGIMES.items():
    rows[name] = summarize(run_regime(lr, args.steps, os.path.join(args.workdir, name)))
  print("| regime | estimates | σ²(1)/σ²(0) | α | β²(1)/‖∇F‖² | k | x_cap = 1/(2√2 k) |")
  print("|---|---|---|---|---|---|---|")
  for name, s in rows.items():
    print(f"| {name} | {s['estimates']} | {s['var_ratio']:.2f} | {s['alpha']:.2f} | "
          f"{s['bias1']:.2f} | {s['k']:.2f} | {s['x_cap']:.2f} |")
  print("| regime | PPO-clipped share of loss tokens: age 0 | age 1 | ages 2–3 |")
  print("|---|---|---|---|")
  for name, s in rows.items():
    c = s["clip"]
    print(f"| {name} | {c['s0']:.3f} | {c['s1']:.3f} | {c['s2-3']:.3f} |")
  if args.unclipped:
    from jaxreplay.train.metrics import read_records
    print("| regime | σ²(1)/σ²(0) clipped | unclipped | α clipped | unclipped | same training |")
    print("|---|---|---|---|---|---|")
    for name, lr in _load(SWEEP).REGIMES.items():
      recs = run_regime(lr, args.steps, os.path.join(args.workdir, name + "_unclipped"), True)
      u, c = summarize(recs), rows[name]
      same = [r.get("loss") for r in recs] == [r.get("loss") for r in
                                               read_records(os.path.join(args.workdir, name))]
      print(f"| {name} | {c['var_ratio']:.2f} | {u['var_ratio']:.2f} | {c['alpha']:.2f} | "
            f"{u['alpha']:.2f} | {'yes' if same else 'no'} |")
  print("relative bias per step of age k: " + ", ".join(
      f"{name} {s['k']:.2f}" for name, s in rows.items()))


if __name__ == "__main__":
  main()

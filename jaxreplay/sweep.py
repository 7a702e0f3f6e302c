"""A grid of configurations × seeds, run one after another, resumable, then a report.

  python -m jaxreplay.sweep --config configs/sweep/NAME.py [--workdir DIR] [--only REGEX]
                            [--report-only] [--dry-run] [--publish]
                            [--import-runs FILE.tar.xz] [--export-runs FILE.tar.xz]
                            [--verify REGEX]

A sweep file has ``get_config()`` returning a ConfigDict (or dict) with
  base_config:    path of a trainer config file (``configs/default.py``, a Qwen preset, ...),
                  relative to the working directory or to the repository root;
  workdir:        the sweep's directory (``--workdir`` overrides it);
  seeds:          seeds, each run once per configuration;
  base_overrides: ``{"section.field": value}`` applied to every run (dotted keys:
                  ``ConfigDict(..., allow_dotted_keys=True)``, or nested dicts);
  configurations: list of ``dict(name=..., family=..., overrides={"a.b": v, ...})``;
  report:         what ``jaxreplay.report`` needs (reference configuration, claims, output
                  paths; see that module). Optional. Its ``results_md`` is written only
                  when the sweep runs in its own ``workdir`` or with ``--publish``;
                  elsewhere the report goes to ``WORKDIR/results.md`` (``results_path``).

Every run (configuration × seed) is a subprocess
  python -m jaxreplay.main --config BASE --config.seed=K --config.workdir=WORKDIR/NAME/seedK
         --config.warmstart.cache_dir=WORKDIR/base_policies --config.a.b=v ...
so the sweep knows nothing of the trainer's internals: it reads back only the files a run
leaves in its directory (``summary.json``, ``metrics/``, ``config.json``). Its output
goes to ``WORKDIR/NAME/seedK/sweep.log``. All runs share one base-policy cache, so the runs
of a seed reuse that seed's warm-started policy (the cache key includes the seed; a
configuration that overrides a field of the key trains its own, and the sweep says so).

Resuming: a run whose ``summary.json`` says ``steps`` == its configured ``train.steps`` (and
that it ran them all or spent its generation budget, ``train.max_generated_rollouts``) is
skipped; any other run is launched with its same command, and the trainer resumes from the
last checkpoint in its directory. Interrupt the sweep at any point and start it again.
A failed run is reported and the grid goes on; the exit status is then 1.

Archives: ``--export-runs FILE`` writes, after the grid and the report, every finished run's
``config.json``, ``summary.json`` and its metric records cut to what the reports read
(``ARCHIVE_KEYS``) as one ``.tar.xz`` — small enough to commit beside the results it
produced. ``--import-runs FILE`` unpacks one into the sweep's directory first (runs already
present are left alone), so a report can be regenerated, or a sweep finished, on a machine
that did not run it: the imported runs count as finished and are skipped. The warm-start
weights the runs started from travel beside the archive (``FILE.base_policies/KEY.tar.xz``,
``export_base_policies``: written once per base policy) and are unpacked with it, so
``--verify REGEX`` can rerun chosen archived runs from the same weights and report each
difference against the noise band it expects (``jaxreplay.study.verify``).
"""

from __future__ import annotations

import argparse
import dataclasses
import importlib.util
import json
import os
import re
import shutil
import signal
import subprocess
import sys
import tarfile
import tempfile
import time
from typing import Any

from jaxreplay import storage
from jaxreplay.train.metrics import has_metrics, read_metrics

REPO_ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


class SweepError(ValueError):
  """A sweep file or command line that cannot run; the message names the field."""


@dataclasses.dataclass(frozen=True, eq=False)
class Run:
  """One configuration at one seed.

  Attributes:
    name: configuration name. family: its plot group. seed: int.
    overrides: dotted field -> value, base overrides first, then the configuration's.
    workdir: the run's directory.
  """

  name: str
  family: str
  seed: int
  overrides: dict
  workdir: str

  @property
  def label(self) -> str:
    return f"{self.name} seed{self.seed}"


def _load_module_config(path: str):
  if not os.path.exists(path):
    raise SweepError(f"sweep config file {path!r} does not exist")
  spec = importlib.util.spec_from_file_location(
      "jaxreplay_sweep_" + re.sub(r"\W", "_", os.path.basename(path)[:-3]), path)
  mod = importlib.util.module_from_spec(spec)
  spec.loader.exec_module(mod)
  return mod.get_config()


def _plain(x):
  """ConfigDict / FrozenConfigDict / nested containers -> plain dicts, lists and scalars."""
  if hasattr(x, "to_dict"):
    x = x.to_dict()
  if isinstance(x, dict):
    return {k: _plain(v) for k, v in x.items()}
  if isinstance(x, (list, tuple)):
    return [_plain(v) for v in x]
  return x


def flatten(overrides: dict | None, prefix: str = "") -> dict:
  """``{"a": {"b": 1}, "c.d": 2}`` -> ``{"a.b": 1, "c.d": 2}`` (dotted keys kept)."""
  out = {}
  for k, v in (overrides or {}).items():
    key = f"{prefix}{k}"
    if isinstance(v, dict):
      out.update(flatten(v, key + "."))
    else:
      out[key] = v
  return out


def resolve_path(path: str) -> str:
  """``path`` as given if it exists (relative to the working directory), else relative to
  the repository root; absolute."""
  if os.path.isabs(path) or os.path.exists(path):
    return os.path.abspath(path)
  return os.path.join(REPO_ROOT, path)


def load_sweep(path: str) -> dict:
  """The sweep file's config as a checked plain dict (see the module docstring).

  Raises:
    SweepError: a missing or ill-formed field, duplicate configuration names, fewer than
      one seed, a base config file that does not exist, or (``report.kind =
      "regime_map"``) a configuration without ``regime`` or a ``role`` in onpolicy / fixed /
      auto.
  """
  s = _plain(_load_module_config(path))
  for f in ("base_config", "workdir", "seeds", "configurations"):
    if f not in s:
      raise SweepError(f"sweep config {path}: missing field {f!r}")
  if not s["seeds"]:
    raise SweepError(f"sweep config {path}: seeds is empty")
  s["seeds"] = [int(k) for k in s["seeds"]]
  if not os.path.exists(resolve_path(s["base_config"])):
    raise SweepError(f"sweep config {path}: base_config {s['base_config']!r} does not exist")
  s["base_overrides"] = flatten(s.get("base_overrides"))
  names = set()
  for i, c in enumerate(s["configurations"]):
    if "name" not in c or not re.fullmatch(r"[A-Za-z0-9_.+-]+", str(c["name"])):
      raise SweepError(f"sweep config {path}: configurations[{i}] needs a name of letters, "
                       f"digits and _.+- (got {c.get('name')!r})")
    if c["name"] in names:
      raise SweepError(f"sweep config {path}: configuration name {c['name']!r} appears twice")
    names.add(c["name"])
    c.setdefault("family", c["name"])
    c["overrides"] = flatten(c.get("overrides"))
    for k in ("seed", "workdir", "warmstart.cache_dir"):
      if k in c["overrides"] or k in s["base_overrides"]:
        raise SweepError(f"sweep config {path}: {k} is set by the sweep, not by overrides")
  s.setdefault("report", {})
  if (s["report"] or {}).get("kind") == "regime_map":
    roles = ("onpolicy", "fixed", "auto")  # regime_map.ROLES (not imported: it loads numpy)
    for c in s["configurations"]:
      if "regime" not in c or c.get("role") not in roles:
        raise SweepError(f"sweep config {path}: configuration {c['name']!r} of a regime map "
                         f"needs 'regime' and 'role' in {roles} (got {c.get('regime')!r}, "
                         f"{c.get('role')!r})")
  return s


def plan(sweep: dict, workdir: str) -> list[Run]:
  """Every run of the grid in execution order: for each seed, every configuration.

  Seeds outermost, so that the first seed's results cover all configurations early and
  each seed's base policy is trained by its first run.
  """
  runs = []
  for seed in sweep["seeds"]:
    for c in sweep["configurations"]:
      runs.append(Run(name=c["name"], family=c["family"], seed=seed,
                      overrides={**sweep["base_overrides"], **c["overrides"]},
                      workdir=os.path.join(workdir, c["name"], f"seed{seed}")))
  return runs


def format_value(v: Any) -> str:
  """A value as ``config_flags`` parses it on the command line."""
  if isinstance(v, bool):
    return "True" if v else "False"
  if isinstance(v, (list, tuple)):
    return "(" + ", ".join(format_value(x) for x in v) + ("," if len(v) == 1 else "") + ")"
  if v is None:
    return "None"
  return str(v)


def command(sweep: dict, run: Run, workdir: str) -> list[str]:
  """The trainer's command line for ``run`` (the same at every launch of the run)."""
  cmd = [sys.executable, "-m", "jaxreplay.main", "--config", resolve_path(sweep["base_config"]),
         f"--config.seed={run.seed}", f"--config.workdir={storage.absolute(run.workdir)}",
         f"--config.warmstart.cache_dir={storage.absolute(os.path.join(workdir, 'base_policies'))}"]
  return cmd + [f"--config.{k}={format_value(v)}" for k, v in run.overrides.items()]


def resolved_config(sweep: dict, run: Run, workdir: str):
  """The trainer config ``run`` will use (base file + overrides), locked.

  Raises:
    SweepError: an override that names no field of the base config.
  """
  from ml_collections import config_dict
  cfg = _load_module_config(resolve_path(sweep["base_config"]))
  if not isinstance(cfg, config_dict.ConfigDict):
    cfg = config_dict.ConfigDict(cfg)
  cfg.lock()
  sets = {"seed": run.seed, "workdir": storage.absolute(run.workdir),
          "warmstart.cache_dir": storage.absolute(os.path.join(workdir, "base_policies")),
          **run.overrides}
  for k, v in sets.items():
    node = cfg
    *path, last = k.split(".")
    try:
      for p in path:
        node = node[p]
      if last not in node:
        raise KeyError(last)
      node[last] = v
    except (KeyError, AttributeError, TypeError) as e:
      raise SweepError(f"configuration {run.name!r}: override {k}={v!r} does not fit "
                       f"{sweep['base_config']}: {e}") from None
  return cfg


def finished(run: Run, steps: int) -> bool:
  """Whether ``run``'s directory holds a summary of a run with ``steps`` learner steps that
  ran them all or spent its generation budget (``train.max_generated_rollouts``)."""
  try:
    summary = json.loads(storage.read_text(os.path.join(run.workdir, "summary.json")))
    return (int(summary.get("steps", -1)) == int(steps)
            and (int(summary.get("steps_done", steps)) >= int(steps)
                 or bool(summary.get("budget_reached", False))))
  except (OSError, ValueError):
    return False


def base_policy_groups(cfgs: dict[Run, Any]) -> dict[int, dict[str, list[str]]]:
  """Per seed: base-policy cache key -> configurations using it, or {} when the trainer
  exposes no ``base_policy_key`` (e.g. a Hugging Face checkpoint needs none)."""
  from jaxreplay.config import specs
  from jaxreplay.train.warmstart import base_policy_key
  groups: dict[int, dict[str, list[str]]] = {}
  for run, cfg in cfgs.items():
    c = specs(cfg)
    if c.model.source != "builtin":
      continue
    key = base_policy_key(c.task, c.model, c.warmstart, c.sampler.max_new_tokens, c.seed)
    groups.setdefault(run.seed, {}).setdefault(key, []).append(run.name)
  return groups


def _summary_line(run: Run) -> str:
  """", acc 0.31→0.50" from the run's summary (sampled accuracy), or ""."""
  try:
    s = json.loads(storage.read_text(os.path.join(run.workdir, "summary.json")))
    return f", acc {s['acc_sampled_before']:.2f}→{s['acc_sampled_after']:.2f}"
  except (OSError, ValueError, KeyError, TypeError):
    return ""


def execute(cmd: list[str], log_path: str, cache_dir: str | None = None) -> int:
  """Runs ``cmd`` with stdout and stderr appended to ``log_path``; its exit status.

  The child gets its own process group; an interrupt of the sweep stops it (and only it)
  before re-raising. With ``cache_dir`` (and no ``JAX_COMPILATION_CACHE_DIR`` already in
  the environment) the child uses JAX's persistent compilation cache there: the runs of
  one configuration compile the same programs for every seed, and a cached executable
  gives the same numbers (one measurement here: a 10-step run 36 s → 20 s, identical
  metrics by bench/compare_runs.py).
  """
  env = dict(os.environ)
  if cache_dir is not None and "JAX_COMPILATION_CACHE_DIR" not in env:
    env.update(JAX_COMPILATION_CACHE_DIR=os.path.abspath(cache_dir),
               JAX_PERSISTENT_CACHE_MIN_COMPILE_TIME_SECS="0.5")
  os.makedirs(os.path.dirname(log_path), exist_ok=True)
  with open(log_path, "a") as log:
    log.write(f"\n=== {time.strftime('%Y-%m-%d %H:%M:%S')} {' '.join(cmd)}\n")
    log.flush()
    proc = subprocess.Popen(cmd, stdout=log, stderr=subprocess.STDOUT, start_new_session=True,
                            env=env)
    try:
      return proc.wait()
    except BaseException:
      try:
        os.killpg(proc.pid, signal.SIGTERM)
        proc.wait(timeout=30)
      except (ProcessLookupError, subprocess.TimeoutExpired):
        os.killpg(proc.pid, signal.SIGKILL)
      raise


def _say(msg: str) -> None:
  print(msg, flush=True)


def run_grid(sweep: dict, workdir: str, only: str | None = None, dry_run: bool = False,
             print_fn=_say) -> list[Run]:
  """Runs every not-yet-finished run of the grid in order; returns the runs that failed.

  Raises:
    SweepError: a bad override (checked for every run before any runs).
  """
  runs = plan(sweep, workdir)
  if only:
    pat = re.compile(only)
    runs = [r for r in runs if pat.search(f"{r.name}/seed{r.seed}")]
  cfgs = {r: resolved_config(sweep, r, workdir) for r in runs}
  for seed, keys in base_policy_groups(cfgs).items():
    if len(keys) > 1:
      print_fn(f"note: seed {seed} trains {len(keys)} base policies: "
               + "; ".join(", ".join(v) for v in keys.values())
               + " (their overrides change fields of the base policy's cache key)")
  failed = []
  n = len(runs)
  for i, run in enumerate(runs, 1):
    steps = cfgs[run].train.steps
    head = f"[{i}/{n}] {run.label}"
    cmd = command(sweep, run, workdir)
    if dry_run:
      print_fn(f"{head}: {' '.join(cmd)}")
      continue
    if finished(run, steps):
      print_fn(f"{head}: skipped (finished)")
      continue
    resumed = has_metrics(run.workdir)
    # The log is appended to and the compilation cache written file by file: both stay on
    # the local disk when the sweep directory is on cloud storage (storage.local_side).
    log_path = os.path.join(storage.local_side(run.workdir), "sweep.log")
    print_fn(f"{head}: {'resuming' if resumed else 'running'} ({steps} steps, log {log_path})")
    t0 = time.time()
    rc = execute(cmd, log_path, os.path.join(storage.local_side(workdir), "jax_cache"))
    dt = time.time() - t0
    if rc == 0 and finished(run, steps):
      print_fn(f"{head}: done in {dt:.0f} s{_summary_line(run)}")
    else:
      failed.append(run)
      print_fn(f"{head}: FAILED (exit {rc}) after {dt:.0f} s; see {log_path}")
  return failed


# What an exported run keeps of its metric records: what ``report`` and ``regime_map`` read.
ARCHIVE_KEYS = ("step", "eval/", "generated_", "trained_", "generate_s", "train_s", "eval_s",
                "noise/", "auto/", "staleness_mean", "replay_ratio", "generation_flops",
                "training_flops")


def export_runs(sweep: dict, workdir: str, path: str) -> int:
  """Writes the finished runs of the grid to ``path`` (``.tar.xz``): per run
  ``NAME/seedK/config.json``, ``summary.json`` and ``metrics.jsonl`` (its records, the last
  per step, with the keys starting with an ``ARCHIVE_KEYS`` prefix).

  Returns:
    The number of runs written.
  """
  n = 0
  with tempfile.TemporaryDirectory() as tmp, tarfile.open(path, "w:xz") as tar:
    for run in plan(sweep, workdir):
      src = run.workdir
      if not os.path.exists(os.path.join(src, "summary.json")) or not has_metrics(src):
        continue
      rel = os.path.join(run.name, f"seed{run.seed}")
      dst = os.path.join(tmp, rel)
      os.makedirs(dst)
      for f in ("config.json", "summary.json"):
        if os.path.exists(os.path.join(src, f)):
          shutil.copyfile(os.path.join(src, f), os.path.join(dst, f))
      with open(os.path.join(dst, "metrics.jsonl"), "w") as f:
        for rec in read_metrics(src):
          f.write(json.dumps({k: v for k, v in rec.items() if k.startswith(ARCHIVE_KEYS)}) + "\n")
      tar.add(dst, arcname=rel)
      n += 1
  return n


def base_policies_dir(path: str) -> str:
  """Where an archive's warm-start weights go: ``NAME.tar.xz`` -> ``NAME.base_policies/``."""
  return re.sub(r"(\.tar\.xz|\.tar\.gz|\.tgz|\.tar)$", "", path) + ".base_policies"


def _base_policy_key(run_dir: str) -> str | None:
  """The base-policy cache key a finished run used (from its summary), or None."""
  try:
    path = json.loads(storage.read_text(os.path.join(run_dir, "summary.json"))).get("base_policy")
  except (OSError, ValueError):
    return None
  return os.path.basename(path.rstrip("/")) if path else None


def export_base_policies(sweep: dict, workdir: str, path: str) -> int:
  """Writes the warm-start weights the grid's finished runs used beside archive ``path``:
  ``base_policies_dir(path)/KEY.tar.xz``, one per base-policy cache entry (the Orbax
  checkpoint and ``info.json`` of ``WORKDIR/base_policies/KEY``), each written once and
  never rewritten, so a committed file keeps its bytes (3.1 MB for the default model).

  Returns:
    The number of files written (entries already archived are skipped).
  """
  out = base_policies_dir(path)
  keys = sorted({k for r in plan(sweep, workdir) if (k := _base_policy_key(r.workdir))})
  n = 0
  for key in keys:
    src = os.path.join(workdir, "base_policies", key)
    dst = os.path.join(out, f"{key}.tar.xz")
    if os.path.exists(dst) or not os.path.exists(os.path.join(src, "info.json")):
      continue
    os.makedirs(out, exist_ok=True)
    with tarfile.open(dst + ".tmp", "w:xz") as tar:
      tar.add(src, arcname=key, filter=lambda m: None if m.name.endswith("/.lock") else m)
    os.replace(dst + ".tmp", dst)
    n += 1
  return n


def import_base_policies(workdir: str, path: str) -> int:
  """Unpacks the warm-start weights archived beside ``path`` (``export_base_policies``)
  into ``WORKDIR/base_policies/KEY`` where that entry is absent; a rerun of an imported
  run then starts from the archived weights, not from a warm start rebuilt here.

  Returns:
    The number of entries unpacked (0 when the archive has none).

  Raises:
    SweepError: a member outside ``KEY/`` or not a plain file or directory.
  """
  src = base_policies_dir(path)
  if not os.path.isdir(src):
    return 0
  n = 0
  for f in sorted(os.listdir(src)):
    if not f.endswith(".tar.xz"):
      continue
    key = f[:-len(".tar.xz")]
    dst = os.path.join(workdir, "base_policies", key)
    if os.path.exists(os.path.join(dst, "info.json")):
      continue
    with tarfile.open(os.path.join(src, f), "r:xz") as tar:
      members = tar.getmembers()
      for m in members:
        parts = m.name.split("/")
        if parts[0] != key or ".." in parts or not (m.isfile() or m.isdir()):
          raise SweepError(f"{os.path.join(src, f)}: unexpected member {m.name!r} "
                           f"(not the base policy {key})")
      os.makedirs(os.path.dirname(dst), exist_ok=True)
      tmp = tempfile.mkdtemp(dir=os.path.dirname(dst))  # same disk: the rename is atomic
      tar.extractall(tmp, members=members, filter="data")
    shutil.rmtree(dst, ignore_errors=True)
    os.replace(os.path.join(tmp, key), dst)
    shutil.rmtree(tmp, ignore_errors=True)
    n += 1
  return n


def import_runs(workdir: str, path: str) -> int:
  """Unpacks an ``export_runs`` archive into ``workdir``; a run directory that exists and
  was not itself imported (a run of this machine, finished or not) is left as it is.

  Returns:
    The number of runs unpacked.

  Raises:
    SweepError: a missing or unreadable archive, or a member outside
      ``NAME/seedK/{config.json,summary.json,metrics.jsonl}``.
  """
  n = 0
  try:
    tar = tarfile.open(path, "r:*")
  except (OSError, tarfile.TarError) as e:
    raise SweepError(f"--import-runs {path}: cannot read it as a run archive ({e})") from None
  with tar:
    for m in tar.getmembers():
      parts = m.name.split("/")
      if m.isdir():
        continue
      if (not m.isfile() or len(parts) != 3 or not re.fullmatch(r"seed\d+", parts[1])
          or parts[2] not in ("config.json", "summary.json", "metrics.jsonl")
          or not re.fullmatch(r"[A-Za-z0-9_.+-]+", parts[0]) or parts[0] in (".", "..")):
        raise SweepError(f"{path}: unexpected member {m.name!r} (not a run archive)")
      run_dir = os.path.join(workdir, parts[0], parts[1])
      marker = os.path.join(run_dir, ".imported")
      if os.path.isdir(run_dir) and not os.path.exists(marker):
        continue  # a run of this machine, finished or not: its own files win
      os.makedirs(run_dir, exist_ok=True)
      open(marker, "w").close()
      with tar.extractfile(m) as f, open(os.path.join(run_dir, parts[2]), "wb") as out:
        out.write(f.read())
      n += parts[2] == "summary.json"
  return n


def verify_runs(sweep: dict, workdir: str, only: str, print_fn=_say) -> list:
  """Reruns the imported runs matching ``only`` (a regex on ``NAME/seedK``) from their
  archived warm start in ``WORKDIR/verify/NAME/seedK`` and compares each with the archive
  (``study.verify.compare``): bit-identical, or the AUC difference against the band two
  runs of one seed span under the sweep's noise model.

  Returns:
    [``study.verify.Verdict``], one per rerun that finished.

  Raises:
    SweepError: no imported run matches, or a chosen run's warm start is not in
      ``WORKDIR/base_policies`` (an archive without its ``.base_policies``).
  """
  from jaxreplay import regime_map
  from jaxreplay.study import verify
  from jaxreplay.study.runs import RunData, load_runs
  pat = re.compile(only)
  chosen = [r for r in plan(sweep, workdir) if pat.search(f"{r.name}/seed{r.seed}")
            and os.path.exists(os.path.join(r.workdir, ".imported"))
            and os.path.exists(os.path.join(r.workdir, "summary.json"))]
  if not chosen:
    raise SweepError(f"--verify {only!r}: no imported run matches (import an archive with "
                     "--import-runs; runs are NAME/seedK)")
  for r in chosen:
    key = _base_policy_key(r.workdir)
    if key and not os.path.exists(os.path.join(workdir, "base_policies", key, "info.json")):
      raise SweepError(f"--verify: {r.name}/seed{r.seed} started from base policy {key}, "
                       f"which the archive does not carry ({base_policies_dir('ARCHIVE')}/"
                       f"{key}.tar.xz); a rerun would start from another warm start")
  sd = regime_map.noise_sd(sweep, load_runs(sweep, workdir)[0])
  out = []
  for r in chosen:
    again = dataclasses.replace(r, workdir=os.path.join(workdir, "verify", r.name,
                                                        f"seed{r.seed}"))
    steps = resolved_config(sweep, again, workdir).train.steps
    if not finished(again, steps):
      print_fn(f"verify {r.name} seed{r.seed}: rerunning ({steps} steps, log "
               f"{again.workdir}/sweep.log)")
      rc = execute(command(sweep, again, workdir), os.path.join(again.workdir, "sweep.log"),
                   os.path.join(storage.local_side(workdir), "jax_cache"))
      if rc != 0 or not finished(again, steps):
        print_fn(f"verify {r.name} seed{r.seed}: FAILED (exit {rc}); see "
                 f"{again.workdir}/sweep.log")
        continue
    v = verify.compare(RunData(r.workdir, r.name, r.family, r.seed),
                       RunData(again.workdir, r.name, r.family, r.seed), sd)
    print_fn(v.line())
    out.append(v)
  print_fn(verify.summary_line(out))
  return out


def report_command(config_path: str, workdir_arg: str | None) -> str:
  """The command line that regenerates the report (what the report prints at its top)."""
  cmd = f"python -m jaxreplay.sweep --config {config_path}"
  if workdir_arg:
    cmd += f" --workdir {workdir_arg}"
  return cmd + " --report-only"


def results_path(sweep: dict, workdir: str, workdir_arg: str | None, publish: bool) -> str:
  """Where the report's results page goes.

  The sweep file's ``report.results_md`` (such as the committed ``docs/results.md``) only
  when the sweep runs in the file's own ``workdir`` or with ``--publish``; a sweep moved
  elsewhere with ``--workdir`` (a subset, a trial) reports into that directory, so it never
  overwrites the published page by accident.

  Args:
    sweep: the loaded sweep dict. workdir: the sweep's absolute directory.
    workdir_arg: the ``--workdir`` given, or None. publish: ``--publish`` was given.

  Returns:
    The results page's path (``WORKDIR/results.md`` unless published).
  """
  own = sweep.get("report", {}).get("results_md") or ""
  moved = (workdir_arg is not None and not storage.is_remote(workdir)
           and os.path.abspath(workdir_arg) != os.path.abspath(sweep["workdir"]))
  if own and (publish or not moved):
    return own
  return os.path.join(workdir, "results.md")


def main(argv=None) -> int:
  p = argparse.ArgumentParser(prog="python -m jaxreplay.sweep",
                              description=__doc__.split("\n")[0])
  p.add_argument("--config", required=True, help="sweep file with get_config()")
  p.add_argument("--workdir", help="the sweep's directory (default: the file's workdir)")
  p.add_argument("--only", help="run only the runs whose NAME/seedK matches this regex "
                                "(the report still reads every run present)")
  p.add_argument("--report-only", action="store_true", help="skip the grid; write the report")
  p.add_argument("--dry-run", action="store_true", help="print each run's command and stop")
  p.add_argument("--import-runs", metavar="FILE",
                 help="unpack an --export-runs archive into the sweep's directory first")
  p.add_argument("--export-runs", metavar="FILE",
                 help="after the report, write the finished runs (configs, summaries, the "
                      "metrics the reports read) to this .tar.xz")
  p.add_argument("--verify", metavar="REGEX",
                 help="rerun the imported runs whose NAME/seedK matches from the archived "
                      "warm start and compare each with the archive (no grid, no report)")
  p.add_argument("--publish", action="store_true",
                 help="write the report to the sweep file's report.results_md (such as "
                      "docs/results.md) even with a --workdir of its own")
  a = p.parse_args(argv)
  try:
    sweep = load_sweep(a.config)
    workdir = os.path.abspath(a.workdir or sweep["workdir"])
    if a.import_runs:
      print(f"imported {import_runs(workdir, a.import_runs)} runs and "
            f"{import_base_policies(workdir, a.import_runs)} base policies from "
            f"{a.import_runs}", flush=True)
    if a.verify:
      verdicts = verify_runs(sweep, workdir, a.verify)
      return 0 if verdicts and all(v.within for v in verdicts) else 1
    failed = []
    if not a.report_only:
      print(f"sweep {a.config}: {len(sweep['configurations'])} configurations × "
            f"{len(sweep['seeds'])} seeds in {workdir}", flush=True)
      t0 = time.time()
      failed = run_grid(sweep, workdir, a.only, a.dry_run)
      if a.dry_run:
        return 0
      print(f"grid finished in {(time.time() - t0) / 60:.1f} min"
            + (f"; {len(failed)} run(s) failed" if failed else ""), flush=True)
  except SweepError as e:
    print(f"jaxreplay.sweep: {e}", file=sys.stderr)
    return 2
  from jaxreplay import report  # matplotlib, scipy and jax load only for the report
  sweep = {**sweep, "report": {**(sweep.get("report") or {}),
                               "results_md": results_path(sweep, workdir, a.workdir, a.publish)}}
  paths = report.write_report(sweep, workdir, report_command(a.config, a.workdir))
  print(f"report written to {paths[0]} (+{len(paths) - 1} figures)")
  if a.export_runs:
    print(f"exported {export_runs(sweep, workdir, a.export_runs)} runs to {a.export_runs} "
          f"and {export_base_policies(sweep, workdir, a.export_runs)} new base policies to "
          f"{base_policies_dir(a.export_runs)}")
  return 1 if failed else 0


if __name__ == "__main__":
  sys.exit(main())

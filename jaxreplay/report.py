"""The sweep's report: ``docs/results.md`` and its figures, from the runs' metrics alone.

``write_report`` writes a sweep's results page: for a regime map (``report.kind =
"regime_map"``) the "Where replay pays" section (``jaxreplay.regime_map``), spliced into the
page; otherwise the single-regime page (provenance, figures, then the sections of
``jaxreplay.study.tables``), which keeps a map section and the study's closing line it finds.
Beside a repository's ``docs/`` it also rewrites the README's headline block from the page
(``render_headline``); ``python -m jaxreplay.report`` redoes only that.

The numbers come from ``jaxreplay.study``: ``stats`` ← ``fit`` ← ``null`` ← ``runs`` ←
``evidence`` ← ``tables`` / ``figures``, then ``regime_map``, then this module; nothing
imports back. The definitions the single-regime page uses are in ``jaxreplay.study.runs``.
"""

from __future__ import annotations

import json
import math
import os
import re
import subprocess
import tempfile
from typing import Any, Sequence

from jaxreplay import paired, regime_map, storage
from jaxreplay.study import figures, tables
# The report's names from before the split, kept importable from here:
from jaxreplay.study.figures import aggregate, plot_band, plot_panels  # noqa: F401
from jaxreplay.study.runs import (METRICS, PAPER_MU, Analysis, RunData,  # noqa: F401
                                  load_runs, sweep_mu)
from jaxreplay.study.stats import INF, quantiles, verdict  # noqa: F401
from jaxreplay.study.tables import evaluate_claim, fmt, fmt_q  # noqa: F401


# --- the report ---------------------------------------------------------------------------

def _git_commit(outputs: Sequence[str] = ()) -> str:
  """The repository's short HEAD, marked when tracked files other than ``outputs`` (the
  report's own files, rewritten by every regeneration) differ from it."""
  try:
    root = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
    out = subprocess.run(["git", "-C", root, "rev-parse", "--short", "HEAD"],
                         capture_output=True, text=True, timeout=10)
    status = subprocess.run(["git", "-C", root, "status", "--porcelain", "--untracked-files=no"],
                            capture_output=True, text=True, timeout=10).stdout.splitlines()
    own = {os.path.relpath(os.path.abspath(p), root) for p in outputs}
    own_dirs = tuple(d.rstrip(os.sep) + os.sep for d in own)
    dirty = [ln for ln in status
             if ln[3:] not in own and not ln[3:].startswith(own_dirs)]
    if out.returncode or not out.stdout.strip():
      return "unknown"
    return out.stdout.strip() + (" (with uncommitted changes)" if dirty else "")
  except (OSError, subprocess.SubprocessError):
    return "unknown"


def _shown_path(path: str) -> str:
  """``path`` relative to the working directory when it lies inside it, else absolute (a
  URL as it is)."""
  if storage.is_remote(path):
    return path
  rel = os.path.relpath(os.path.abspath(path))
  return path if rel.startswith(os.pardir) else rel


def _wall_seconds(runs: dict[str, list[RunData]]) -> float:
  total = 0.0
  for rs in runs.values():
    for r in rs:
      try:
        summary = json.loads(storage.read_text(os.path.join(r.dir, "summary.json")))
        total += float(summary.get("wall_seconds", 0.0))
      except (OSError, ValueError):
        pass
  return total


def write_report(sweep: dict, workdir: str, command: str) -> list[str]:
  """Writes the results page and its figures; returns [results.md, figure paths...].

  Output: ``sweep['report']['results_md']`` (default ``WORKDIR/results.md``), figures in
  the folder of the same name without ``.md``; relative paths are relative to the working
  directory; on cloud storage (``gs://...``) the files are written locally, then uploaded
  one object each. Settings read from ``sweep['report']``: ``reference`` (default the first
  configuration), ``paper_mu`` (5.3), ``theory`` (list of dicts ``rho``, ``alpha``),
  ``claims`` (list of claim specs, see ``evaluate_claim``), ``title``, ``target_last`` (K,
  default 1: a run's final accuracy is the mean of its last K evaluations). With
  ``kind = "regime_map"`` the sweep is a regime map instead (``jaxreplay.regime_map``): its
  "Where replay pays" section is spliced into the page and the rest left as it is (its
  ``why``, a markdown string, is printed under the table when a self-tuning verdict is no);
  the single-regime report keeps that section when it rewrites the page.
  """
  rep = sweep.get("report", {}) or {}
  target = rep.get("results_md") or os.path.join(workdir, "results.md")
  if storage.is_remote(target):  # written locally, then each file uploaded whole
    with tempfile.TemporaryDirectory() as tmp:
      local = _write_any(sweep, workdir, command, os.path.join(tmp, os.path.basename(target)))
      urls = [target.rsplit("/", 1)[0] + "/" + os.path.relpath(p, tmp) for p in local]
      for p, url in zip(local, urls):
        storage.upload(p, url)
      return urls
  return _write_any(sweep, workdir, command, os.path.abspath(target))


def _write_any(sweep: dict, workdir: str, command: str, md_path: str) -> list[str]:
  """The regime map (``report.kind = "regime_map"``, ``jaxreplay.regime_map``: one section
  spliced into the page) or the single-regime report (the whole page)."""
  kind = (sweep.get("report") or {}).get("kind")
  if kind == "regime_map":
    paths = regime_map.write_map(sweep, workdir, md_path)
  elif kind == "paired":
    paths = paired.write(sweep, workdir, command, md_path)
  else:
    paths = _write_report(sweep, workdir, command, md_path)
  readme = readme_beside(md_path)
  if readme:
    write_readme_headline(readme, md_path)
  return paths


def _write_report(sweep: dict, workdir: str, command: str, md_path: str) -> list[str]:
  """``write_report`` into the local file ``md_path`` (figures beside it)."""
  rep = sweep.get("report", {}) or {}
  fig_dir = os.path.splitext(md_path)[0]
  os.makedirs(fig_dir, exist_ok=True)
  configs = sweep["configurations"]
  reference = rep.get("reference", configs[0]["name"])
  runs, missing = load_runs(sweep, workdir)
  present = {k: v for k, v in runs.items() if v}
  L = _provenance(sweep, workdir, command, md_path, runs, missing)
  if not present.get(reference):
    L += ["", f"No run of the reference configuration `{reference}` yet: nothing to compare."]
    tables.write_lines(md_path, L)
    return [md_path]
  k_last = int(rep.get("target_last", 1))
  mu = sweep_mu(present)
  paper_mu = float(rep.get("paper_mu", PAPER_MU))
  an = Analysis(present, reference, mu["time"], paper_mu, target_last=k_last)
  names = [c["name"] for c in configs if present.get(c["name"])]
  L += tables.target_lines(an, mu, paper_mu)
  figure_lines, paths = _figures(an, configs, mu, paper_mu, md_path, fig_dir)
  L += figure_lines
  L += tables.headline_lines(an, configs, names, mu, paper_mu)
  L += tables.accuracy_lines(an, names)
  L += tables.accounting_lines(an, names, mu, paper_mu)
  L += tables.claims_lines(an, rep.get("claims", []))
  L += tables.theory_lines(an, names, mu, paper_mu,
                           rep.get("theory", [dict(rho=0.1, alpha=0.25),
                                              dict(rho=0.1, alpha=0.1)]))
  tables.write_lines(md_path, _keep_map(md_path, L))
  return [md_path] + paths


def _provenance(sweep: dict, workdir: str, command: str, md_path: str,
                runs: dict[str, list[RunData]], missing: list[str]) -> list[str]:
  """The page's title, how to regenerate it, and which runs it read."""
  rep = sweep.get("report", {}) or {}
  configs = sweep["configurations"]
  L = [f"# {rep.get('title', 'Sweep results')}", "",
       f"Regenerate: `{command}`", "",
       "*Generated by jaxreplay.sweep; do not edit by hand.* Every number below is computed "
       "by `jaxreplay/report.py` and `jaxreplay/study/` from the runs' metrics (`metrics/`) "
       "and `config.json`.", "",
       f"- runs: {sum(len(v) for v in runs.values())} present of "
       f"{len(configs) * len(sweep['seeds'])} ({len(configs)} configurations × seeds "
       f"{', '.join(map(str, sweep['seeds']))}); report code at commit "
       f"{_git_commit([md_path, os.path.splitext(md_path)[0]])}",
       f"- base config: `{sweep['base_config']}`; sweep directory: `{_shown_path(workdir)}`",
       f"- sum of the runs' wall time (summary.json): {_wall_seconds(runs) / 60:.1f} min"]
  if missing:
    L.append(f"- missing: {', '.join(missing)}")
  return L


def _figures(an: Analysis, configs: list[dict], mu: dict, paper_mu: float, md_path: str,
             fig_dir: str) -> tuple[list[str], list[str]]:
  """Draws the three accuracy figures into ``fig_dir``; returns (page lines, figure paths)."""
  tok = "generated_tokens"
  figs = [
      ("acc_vs_tokens.png", "Held-out accuracy against generated tokens",
       [("sampled (T = sampler's)", tok, "eval/acc_sampled", "generated tokens"),
        ("greedy", tok, "eval/acc_greedy", "generated tokens")]),
      ("acc_vs_steps.png", "Held-out accuracy against learner steps",
       [("sampled", "step", "eval/acc_sampled", "learner step"),
        ("greedy", "step", "eval/acc_greedy", "learner step")]),
      ("acc_vs_compute.png", "Held-out sampled accuracy against compute on the paper's axis",
       [(f"measured μ = {fmt(mu['time'], 2)}", lambda r, e: r.compute(e, an.mus["measured"],
                                                                       an.ref_batch),
         "eval/acc_sampled", "compute (on-policy updates)"),
        (f"paper's μ = {paper_mu}", lambda r, e: r.compute(e, paper_mu, an.ref_batch),
         "eval/acc_sampled", "compute (on-policy updates)")]),
  ]
  L = ["## Figures", "",
       "Median over seeds (line) and interquartile range (band), one line per "
       "configuration, one colour per family; the dotted line is the target.", ""]
  paths = []
  for name, title, panels in figs:
    p = os.path.join(fig_dir, name)
    figures.plot_panels(an, configs, panels, p, an.target)
    paths.append(p)
    L += [f"**{title}**", "", f"![{title}]({os.path.relpath(p, os.path.dirname(md_path))})", ""]
  return L, paths


def _keep_map(md_path: str, lines: list[str]) -> list[str]:
  """``lines`` with the regime map's section of the page now at ``md_path`` (if any)
  spliced in before the first ``## `` heading, and the page's closing study line kept: a
  regime-map sweep wrote them; then the page's paired sections (``jaxreplay.paired``)."""
  try:
    with open(md_path) as f:
      old = f.read()
  except OSError:
    return lines
  block = regime_map.map_block(old)
  if block:
    lines = regime_map.splice_map("\n".join(lines), block,
                                  regime_map.map_footer(old)).splitlines()
  # the paired sections (``jaxreplay.paired``) after it, as they were
  text = "\n".join(lines)
  for name, section in paired.blocks(old, skip=("where-replay-pays", "headline")).items():
    text = paired.splice(text, name, section)
  return text.splitlines()


# --- the README's headline block ----------------------------------------------------------
#
# README.md states the sweep's result between two markers. The block is rendered from the
# results page itself (``headline_from_results`` parses it, ``render_headline`` writes the
# block), so the README and docs/results.md cannot disagree: the report step rewrites the
# block whenever it rewrites the page, ``python -m jaxreplay.report`` redoes just that, and
# tests/test_readme_headline.py fails when they differ.

HEADLINE_START = "<!-- headline:start"
HEADLINE_END = "<!-- headline:end -->"
HEADLINE_NOTE = ("<!-- headline:start (written by `python -m jaxreplay.report` from "
                 "docs/results.md; do not edit by hand) -->")


def _md_sections(text: str) -> dict[str, list[str]]:
  """The lines of each ``## heading`` section of a markdown page ("" = before the first)."""
  out: dict[str, list[str]] = {"": []}
  cur = ""
  for line in text.splitlines():
    if line.startswith("## "):
      cur = line[3:].strip()
      out[cur] = []
    else:
      out[cur].append(line)
  return out


def md_table(lines: Sequence[str]) -> list[dict[str, str]]:
  """The first markdown table in ``lines`` as one dict per row (header → cell text)."""
  rows = [ln for ln in lines if ln.startswith("|")]
  if len(rows) < 2:
    return []
  split = lambda ln: [c.strip() for c in ln.strip().strip("|").split("|")]  # noqa: E731
  header = split(rows[0])
  return [dict(zip(header, split(r))) for r in rows[2:]]


def _section(sections: dict[str, list[str]], prefix: str) -> list[str]:
  for name, lines in sections.items():
    if name.startswith(prefix):
      return lines
  raise ValueError(f"results page has no section '## {prefix}...'")


def headline_from_results(text: str) -> dict[str, Any]:
  """The numbers the README's headline states, read from a results page (docs/results.md).

  Returns:
    A dict: ``title``, ``runs``, ``configurations``, ``seeds`` (counts), ``wall_min``,
    ``mu_time``, ``paper_mu``, ``target``, ``reference``, ``rows`` (one dict per
    configuration of the headline table, its final sampled accuracy added as ``final``),
    ``best`` (the configuration the page names best) and ``map`` (``map_from_results``:
    the regime map, or None).

  Raises:
    ValueError: a page without the expected lines or tables.
  """
  sections = _md_sections(text)
  head = sections[""]
  title = next((ln[2:].strip() for ln in head if ln.startswith("# ")), "")
  joined = "\n".join(head)

  def grab(pattern: str) -> re.Match:
    m = re.search(pattern, joined)
    if not m:
      raise ValueError(f"results page: no line matching {pattern!r}")
    return m

  runs = grab(r"- runs: (\d+) present of \d+ \((\d+) configurations × seeds ([^)]*)\)")
  wall = grab(r"wall time \(summary\.json\): ([\d.]+) min")
  mu = grab(r"measured μ \(median over runs\): ([\d.]+) from phase times.*the paper's μ: ([\d.]+)")
  target = grab(r"target: the reference `([^`]+)`.*= \*\*([\d.]+)\*\*")
  headline = md_table(_section(sections, "Headline"))
  accuracy = {r["configuration"]: r for r in md_table(_section(sections, "Accuracy"))}
  tokens_col = "tokens to target, % of on-policy"
  compute_cols = [k for k in (headline[0] if headline else {}) if k.startswith("compute to target")]
  rows = []
  for r in headline:
    rows.append({"configuration": r["configuration"].strip("`"), "x": r["x = N/R"],
                 "y": r["y = B/R"], "tokens_pct": r[tokens_col], "reached": r["reached"],
                 "compute_pct": [r[c] for c in compute_cols],
                 "final": accuracy[r["configuration"]]["final sampled"]})
  best = re.search(r"Best configuration found: `([^`]+)`", text)
  return {"title": title, "runs": int(runs.group(1)), "configurations": int(runs.group(2)),
          "seeds": len(runs.group(3).split(",")), "wall_min": wall.group(1),
          "mu_time": mu.group(1), "paper_mu": mu.group(2), "reference": target.group(1),
          "target": target.group(2), "compute_cols": compute_cols, "rows": rows,
          "best": best.group(1) if best else "", "map": map_from_results(text)}


MAP_COLUMNS = regime_map.MAP_COLUMNS


def map_from_results(text: str) -> dict[str, Any] | None:
  """The regime map of a results page (``jaxreplay.regime_map``), or None without one.

  Returns:
    {"summary": its summary sentences, "sweep": "`file` (n regimes × k seeds)", "rows": its
     regime table's rows (``MAP_COLUMNS``), "rules": {rule name: its false-positive rate
     cell}, "line": the page's closing study line (or "")}.
  """
  block = regime_map.map_block(text)
  if not block:
    return None
  summary = next((ln.strip("*") for ln in block if ln.startswith("**")), "")
  sweep_line = next((ln for ln in block if ln.startswith("Sweep `")), "")
  head = sweep_line.split(";")[0].removeprefix("Sweep ") + ")"  # "`file` (n regimes × k seeds)"
  tabs, cur = [], []
  for ln in block + [""]:
    if ln.startswith("|"):
      cur.append(ln)
    elif cur:
      tabs.append(md_table(cur))
      cur = []
  rows = [{k: r[k] for k in MAP_COLUMNS} for r in tabs[0]] if tabs else []
  fpr_col = next((k for t in tabs for k in (t[0] if t else {}) if k.startswith("false-positive")),
                 None)
  rules = {r["rule"].strip("`"): r[fpr_col] for t in tabs for r in t if "rule" in r and fpr_col}
  return {"summary": summary, "sweep": head, "rows": rows, "rules": rules,
          "line": regime_map.map_footer(text) or ""}


def _median_cell(cell: str) -> float:
  """The median of a "median [q25, q75]" cell as a float (+inf for "not reached")."""
  m = cell.split("[")[0].strip()
  return INF if m.startswith("not reached") else float(m)


def render_headline(h: dict[str, Any]) -> list[str]:
  """The README's headline block (markers included) for ``headline_from_results``'s dict.

  Rows: the reference and every configuration that reached the target in more than half
  of its seeds (a finite median); the others are named with how many seeds reached it.
  "Replay" configurations are those with x = N/R > 1. When the page has a regime map
  (``map_from_results``), the block is the map instead (``_render_map_headline``).
  """
  ref = h["reference"]
  rows = [r for r in h["rows"] if r["configuration"] == ref or
          math.isfinite(_median_cell(r["tokens_pct"]))]
  others = [r for r in h["rows"] if r not in rows]
  replay = [r for r in rows if float(r["x"]) > 1]  # a buffer holding more than one round
  best_pct = min((_median_cell(r["tokens_pct"]) for r in replay), default=INF)
  if not math.isfinite(best_pct):
    verdict_line = "no replay configuration reached on-policy's final accuracy"
  elif best_pct < 100:
    verdict_line = (f"the best replay configuration reached on-policy's final accuracy with "
                    f"**{best_pct:.0f}%** of its generated tokens")
  else:
    verdict_line = (f"**replay did not save generation**: the best replay configurations "
                    f"reached on-policy's final accuracy with **{best_pct:.0f}%** of its "
                    "generated tokens")
  if h.get("map"):
    return _render_map_headline(h)
  L = [HEADLINE_NOTE, "",
       f"{h['title']}: {h['configurations']} configurations × {h['seeds']} seeds at equal "
       f"generation budgets ({h['runs']} runs, {h['wall_min']} min of run time in all). "
       f"On-policy (`{ref}`) ends at held-out sampled accuracy **{h['target']}** (median "
       f"over seeds); {verdict_line}.", "",
       "| configuration | x = N/R | y = B/R | final sampled accuracy, median [IQR] | "
       f"generated tokens to reach {h['target']}, % of on-policy | seeds that reach it | "
       + " | ".join(c.replace("compute to target, %", "compute to reach it, %")
                    for c in h["compute_cols"]) + " |",
       "|" + "---|" * (6 + len(h["compute_cols"]))]
  for r in rows:
    L.append(f"| `{r['configuration']}` | {r['x']} | {r['y']} | {r['final']} | "
             f"{r['tokens_pct']} | {r['reached']} | " + " | ".join(r["compute_pct"]) + " |")
  L += ["", "Reaching it in at most half of their seeds: "
        + ", ".join(f"`{r['configuration']}` ({r['reached']})" for r in others) + ". "
        f"Measured μ = {h['mu_time']} (the paper's: {h['paper_mu']}); best configuration "
        f"found: `{h['best']}`.", "", HEADLINE_END]
  return L


def _render_map_headline(h: dict[str, Any]) -> list[str]:
  """The headline block of a page with a regime map: its summary sentences, its regime
  table, its closing study line, and one sentence on the single-regime sweep below it
  (not re-scored: its runs are not archived, and it decided by first crossings)."""
  m = h["map"]
  fpr = m["rules"].get("first_crossing", "–")
  L = [HEADLINE_NOTE, "", f"**Where replay pays**, {m['sweep']}: {m['summary']}", "",
       "| " + " | ".join(MAP_COLUMNS) + " |", "|" + "---|" * len(MAP_COLUMNS)]
  L += ["| " + " | ".join(r[k] for k in MAP_COLUMNS) + " |" for r in m["rows"]]
  L += ["", f"Study: `{m['line']}`. {h['title']} ({h['configurations']} configurations × "
        f"{h['seeds']} seeds, {h['runs']} runs) is not re-scored by these statistics: its runs "
        "are not archived, and its verdicts rest on the first evaluation reaching on-policy's "
        f"final accuracy, a rule that fires on equal curves at a rate of {fpr} under the map's "
        "noise.", "", HEADLINE_END]
  return L


def readme_beside(md_path: str) -> str | None:
  """The README.md of the repository whose ``docs/`` holds ``md_path``, when it has the
  headline markers; else None (a sweep writing its page elsewhere leaves READMEs alone)."""
  docs = os.path.dirname(os.path.abspath(md_path))
  if os.path.basename(docs) != "docs":
    return None
  readme = os.path.join(os.path.dirname(docs), "README.md")
  try:
    with open(readme) as f:
      text = f.read()
  except OSError:
    return None
  return readme if HEADLINE_START in text and HEADLINE_END in text else None


def splice_headline(readme_text: str, block: Sequence[str]) -> str:
  """``readme_text`` with the lines from the start marker to the end marker replaced.

  Raises:
    ValueError: the markers are missing or out of order.
  """
  lines = readme_text.splitlines()
  start = next((i for i, ln in enumerate(lines) if ln.startswith(HEADLINE_START)), None)
  end = next((i for i, ln in enumerate(lines) if ln.strip() == HEADLINE_END), None)
  if start is None or end is None or end < start:
    raise ValueError(f"README has no '{HEADLINE_START} ... -->' line followed by "
                     f"'{HEADLINE_END}'")
  return "\n".join(lines[:start] + list(block) + lines[end + 1:]) + "\n"


def readme_headline_block(readme_text: str) -> list[str]:
  """The lines of the README's headline block, markers included."""
  lines = readme_text.splitlines()
  start = next(i for i, ln in enumerate(lines) if ln.startswith(HEADLINE_START))
  end = next(i for i, ln in enumerate(lines) if ln.strip() == HEADLINE_END)
  return lines[start:end + 1]


def write_readme_headline(readme: str, results_md: str) -> bool:
  """Rewrites the headline block of ``readme`` from ``results_md``; True if it changed."""
  with open(results_md) as f:
    block = render_headline(headline_from_results(f.read()))
  with open(readme) as f:
    old = f.read()
  new = splice_headline(old, block)
  if new != old:
    storage.write_atomic(readme, new)
  return new != old


def main(argv=None) -> int:
  """``python -m jaxreplay.report [--check]``: the README's headline block from
  docs/results.md (no run is read); ``--check`` only reports whether it is current."""
  import argparse
  root = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
  p = argparse.ArgumentParser(prog="python -m jaxreplay.report", description=main.__doc__)
  p.add_argument("--results", default=os.path.join(root, "docs", "results.md"))
  p.add_argument("--readme", default=os.path.join(root, "README.md"))
  p.add_argument("--check", action="store_true", help="exit 1 if the block is out of date")
  a = p.parse_args(argv)
  with open(a.results) as f:
    block = render_headline(headline_from_results(f.read()))
  with open(a.readme) as f:
    old = f.read()
  new = splice_headline(old, block)
  if a.check:
    print("README headline: " + ("current" if new == old else "out of date"))
    return int(new != old)
  if new != old:
    storage.write_atomic(a.readme, new)
  print(f"README headline: {'rewritten' if new != old else 'already current'} ({a.readme})")
  return 0


if __name__ == "__main__":
  raise SystemExit(main())

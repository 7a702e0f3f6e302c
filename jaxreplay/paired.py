"""A two-configuration sweep as one section of the results page: a buffer against on-policy,
paired by seed, at equal generated tokens.

``report.kind = "paired"`` in a sweep file (``configs/sweep/smollm2_sums_replay.py``): the
sweep's ``reference`` (on-policy) and one other configuration, run on the same seeds. The
section reads, per seed, both runs' held-out accuracy curves against generated tokens and
compares them with the study's paired statistics (``study.evidence.compare``: the mean
accuracy over the reference's log-token budget, AUC, its paired difference with a 95% t
interval, a one-sided t p-value, and the smoothed accuracy at 25/50/100% of the budget). It
is rendered between ``<!-- NAME:start`` and ``<!-- NAME:end -->`` (NAME =
``report.section``) and spliced into the page (``report.results_md``), replacing the same
section or, when absent, going after the page's last marked section; the rest of the page
stays as it is. ``report.keep_sections`` keeps such sections when the single-regime report
rewrites the page.
"""

from __future__ import annotations

import os
import re
from typing import Sequence

import numpy as np

from jaxreplay.study import evidence, tables
from jaxreplay.study.runs import load_runs

_START = re.compile(r"^<!-- ([\w-]+):start\b")


def marker(name: str) -> tuple[str, str]:
  """(start prefix, end line) of section ``name``'s markers."""
  return f"<!-- {name}:start", f"<!-- {name}:end -->"


def blocks(text: str, skip: Sequence[str] = ()) -> dict[str, list[str]]:
  """Every marked section of a page: {name: its lines, markers included}, in page order,
  less the names in ``skip``. A section without its end marker is left out."""
  lines, out, i = text.splitlines(), {}, 0
  while i < len(lines):
    m = _START.match(lines[i])
    if m and m.group(1) not in skip:
      end = marker(m.group(1))[1]
      j = next((k for k in range(i, len(lines)) if lines[k].strip() == end), None)
      if j is not None:
        out[m.group(1)] = lines[i:j + 1]
        i = j
    i += 1
  return out


def splice(text: str, name: str, block: Sequence[str]) -> str:
  """``text`` with section ``name`` replaced by ``block`` (markers included), or ``block``
  inserted after the page's last marked section's end (before its first ``## `` heading
  when it has none, at the end when it has neither)."""
  lines = text.splitlines()
  start, end = marker(name)
  i = next((k for k, ln in enumerate(lines) if ln.startswith(start)), None)
  j = next((k for k, ln in enumerate(lines) if ln.strip() == end), None)
  if i is not None and j is not None and j >= i:
    lines = lines[:i] + list(block) + lines[j + 1:]
  else:
    ends = [k for k, ln in enumerate(lines) if re.match(r"^<!-- [\w-]+:end -->$", ln.strip())]
    at = (ends[-1] + 1 if ends else
          next((k for k, ln in enumerate(lines) if ln.startswith("## ")), len(lines)))
    lines = lines[:at] + [""] + list(block) + [""] + lines[at:]
  return re.sub(r"\n{3,}", "\n\n", "\n".join(lines)).rstrip() + "\n"


def render(sweep: dict, workdir: str, command: str) -> list[str]:
  """The section's lines for the sweep's runs (markers included).

  Raises:
    ValueError: ``report.section`` missing, not exactly two configurations, or fewer than
      two seeds with runs of both.
  """
  rep = sweep.get("report") or {}
  name = rep.get("section")
  if not name:
    raise ValueError("report.section: a paired report needs a section name (its markers)")
  configs = sweep["configurations"]
  if len(configs) != 2:
    raise ValueError(f"a paired report compares 2 configurations, the sweep has {len(configs)}")
  reference = rep.get("reference", configs[0]["name"])
  other = next(c["name"] for c in configs if c["name"] != reference)
  runs, _ = load_runs(sweep, workdir)
  ref, oth = evidence.by_seed(runs.get(reference, [])), evidence.by_seed(runs.get(other, []))
  seeds = sorted(set(ref) & set(oth))
  if len(seeds) < 2:
    raise ValueError(f"a paired report needs 2 seeds with runs of both `{reference}` and "
                     f"`{other}`; it has {seeds}")
  budget = {s: float(ref[s].curve()[0][-1]) for s in seeds}
  comp = evidence.compare(other, [oth[s] for s in seeds], reference, [ref[s] for s in seeds],
                          budget)
  start, end = marker(name)
  L = [f"{start} (written by `{command}`; do not edit by hand) -->", "",
       f"## {rep.get('title', f'{other} against {reference}')}", "",
       f"Regenerate: `{command}`. Seeds {', '.join(map(str, seeds))}; each seed's two runs "
       f"share its warm start and evaluation questions. Held-out accuracy is "
       f"`eval/acc_sampled` (the task's reward, one sample per question).", ""]
  L += ["Paired by seed on the reference's generated-token budget (`study.evidence.compare`: "
        "AUC is the mean accuracy over log generated tokens up to the budget):", ""]
  L += tables.table(tables.COMPARISON_HEADER, [tables.comparison_row("—", comp)]) + [""]
  # the curves: mean over seeds at each evaluation, by generated tokens
  L += ["Held-out accuracy at each evaluation (mean over seeds; generated tokens, mean):", ""]
  rows = []
  for c in (reference, other):
    curves = [(by[s].curve()) for by in ((ref if c == reference else oth),) for s in seeds]
    n = min(len(t) for t, _ in curves)
    tok = np.mean([t[:n] for t, _ in curves], 0)
    acc = np.mean([a[:n] for _, a in curves], 0)
    rows.append([f"`{c}`", " · ".join(f"{a:.3f} @ {t / 1e3:.0f}k" for t, a in zip(tok, acc))])
  L += tables.table(["configuration", "accuracy @ generated tokens"], rows) + [""]
  per_seed = [[str(s), f"{ref[s].curve()[1][0]:.3f}", f"{ref[s].curve()[1][-1]:.3f}",
               f"{oth[s].curve()[1][-1]:.3f}", f"{budget[s] / 1e3:.0f}k"] for s in seeds]
  L += tables.table(["seed", "before RL", f"`{reference}` last", f"`{other}` last",
                     "budget (generated tokens)"], per_seed)
  return L + ["", end]


def write(sweep: dict, workdir: str, command: str, md_path: str) -> list[str]:
  """Renders the section and splices it into ``md_path`` (created with the sweep's title
  when absent).

  Returns:
    [md_path].
  """
  block = render(sweep, workdir, command)
  name = sweep["report"]["section"]
  try:
    with open(md_path) as f:
      old = f.read()
  except OSError:
    old = ""
  os.makedirs(os.path.dirname(os.path.abspath(md_path)), exist_ok=True)
  tables.write_lines(md_path, splice(old, name, block).splitlines())
  return [md_path]

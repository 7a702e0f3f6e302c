"""Every third-party module ``jaxreplay/`` imports is installed by ``pip install -e .`` alone:
its distribution is one of ``[project] dependencies`` or required by them (the test extras
are not there for a newcomer's first command)."""

import ast
import importlib.metadata as md
import os
import sys
import tomllib

from packaging.requirements import Requirement

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def imported_top_level_modules() -> set[str]:
  names = set()
  for folder, _, files in os.walk(os.path.join(ROOT, "jaxreplay")):
    for f in files:
      if f.endswith(".py"):
        tree = ast.parse(open(os.path.join(folder, f)).read())
        for node in ast.walk(tree):
          if isinstance(node, ast.Import):
            names |= {a.name.split(".")[0] for a in node.names}
          elif isinstance(node, ast.ImportFrom) and node.level == 0:
            names.add(node.module.split(".")[0])
  return names - set(sys.stdlib_module_names) - {"jaxreplay", "__future__"}


def runtime_closure() -> set[str]:
  """Normalised names of the main dependencies and everything they require (installed)."""
  norm = lambda n: n.lower().replace("_", "-").replace(".", "-")
  with open(os.path.join(ROOT, "pyproject.toml"), "rb") as f:
    todo = [Requirement(r) for r in tomllib.load(f)["project"]["dependencies"]]
  seen = set()
  while todo:
    req = todo.pop()
    name = norm(req.name)
    if name in seen:
      continue
    seen.add(name)
    try:
      requires = md.requires(req.name) or []
    except md.PackageNotFoundError:
      continue
    for r in map(Requirement, requires):
      extras = [""] + sorted(req.extras)
      if r.marker is None or any(r.marker.evaluate({"extra": e}) for e in extras):
        todo.append(r)
  return seen


def test_every_runtime_import_comes_with_the_main_dependencies():
  dists = md.packages_distributions()
  closure = runtime_closure()
  norm = lambda n: n.lower().replace("_", "-").replace(".", "-")
  missing = {m: dists.get(m) for m in imported_top_level_modules()
             if not any(norm(d) in closure for d in dists.get(m, [m]))}
  assert not missing, f"imported by jaxreplay/ but not installed by `pip install -e .`: {missing}"

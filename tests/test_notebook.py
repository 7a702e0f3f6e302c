"""``notebooks/quickstart.ipynb`` runs top to bottom at its tiny size, and is kept without outputs.

The notebook asserts its own plotted series are non-empty (``plot.plot_runs(...,
strict=True)`` and its own checks), so a cell error or an empty curve fails here.
"""

import os
import time

import nbformat
import pytest
from nbclient import NotebookClient

from conftest import xla_flags

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
NOTEBOOK = os.path.join(ROOT, "notebooks", "quickstart.ipynb")
FIGURES = ("acc_vs_tokens", "acc_vs_steps", "staleness", "replay", "ledger", "uses_per_rollout")


def test_notebook_is_stored_without_outputs():
  nb = nbformat.read(NOTEBOOK, as_version=4)
  nbformat.validate(nb)
  for i, cell in enumerate(nb.cells):
    if cell.cell_type == "code":
      assert cell.outputs == [] and cell.execution_count is None, f"cell {i} has outputs"
  assert "widgets" not in nb.metadata
  params = [c for c in nb.cells if "parameters" in c.metadata.get("tags", [])]
  assert len(params) == 1 and "JAXREPLAY_NOTEBOOK_SIZE" in params[0].source


@pytest.mark.slow
def test_notebook_runs_at_tiny_size(tmp_path, monkeypatch):
  runs = tmp_path / "runs"
  monkeypatch.setenv("JAXREPLAY_NOTEBOOK_SIZE", "tiny")
  monkeypatch.setenv("JAXREPLAY_NOTEBOOK_RUNS", str(runs))
  monkeypatch.setenv("JAXREPLAY_HF_CHECKPOINT", "")
  monkeypatch.setenv("XLA_FLAGS", xla_flags(1))  # one CPU device, as a user has
  nb = nbformat.read(NOTEBOOK, as_version=4)
  t0 = time.time()
  NotebookClient(nb, timeout=600, kernel_name="python3",
                 resources={"metadata": {"path": os.path.dirname(NOTEBOOK)}}).execute()
  seconds = time.time() - t0
  for name in FIGURES:
    with open(runs / "figures" / f"{name}.png", "rb") as f:
      assert f.read(8) == b"\x89PNG\r\n\x1a\n", name
  for run in ("onpolicy", "replay", "replay_extended"):
    assert (runs / run / "summary.json").exists(), run
  printed = "".join(o.get("text", "") for c in nb.cells if c.cell_type == "code"
                    for o in c.outputs)
  assert "is complete at step 4" in printed  # the resume cell found the finished run
  print(f"notebook executed in {seconds:.0f} s")

"""Metric files an object store accepts: numbered chunks rewritten whole, never appended to;
one reader (``read_metrics`` / ``read_records``) for both layouts, local and ``gs://``."""

import json
import os

import pytest
from etils.epath import backend as backend_lib
from fsspec.implementations.memory import MemoryFileSystem

from jaxreplay.train import metrics


class ObjectStore(MemoryFileSystem):
  """An in-memory bucket with an object store's limits: no append, no rename."""

  protocol = ("objstore",)

  def _open(self, path, mode="rb", **kw):
    if "a" in mode or "+" in mode:
      raise NotImplementedError(f"object store: mode {mode!r} (append) is not supported")
    return super()._open(path, mode, **kw)

  def mv(self, *a, **k):
    raise NotImplementedError("object store: no rename")


@pytest.fixture
def bucket(monkeypatch):
  store = ObjectStore()
  store.store, store.pseudo_dirs = {}, [""]
  monkeypatch.setattr(backend_lib.fsspec_backend, "fs", lambda path: store)
  return store


def test_chunks_local_resume_and_no_leftovers(tmp_path):
  w = metrics.MetricWriter(tmp_path, tensorboard=False, primary=True, chunk_records=3)
  for s in range(7):
    w.write(s, {"loss": 1.0 / (s + 1), "bad": float("nan"), "n": s})
  w.close()
  w.write(99, {"loss": 0.0})  # after close: ignored
  assert sorted(os.listdir(tmp_path / "metrics")) == ["000000.jsonl", "000001.jsonl",
                                                       "000002.jsonl"]
  assert not (tmp_path / "metrics.jsonl").exists()
  lines = (tmp_path / "metrics" / "000001.jsonl").read_text().splitlines()
  assert [json.loads(x)["step"] for x in lines] == [3, 4, 5]
  assert json.loads(lines[0]) == {"step": 3, "loss": 0.25, "bad": "nan", "n": 3}
  # a resumed run recomputes steps 5, 6 and goes on: a new chunk; the later record wins
  w = metrics.MetricWriter(tmp_path, tensorboard=False, primary=True, chunk_records=3)
  assert w.path.name == "000003.jsonl"
  for s in (5, 6, 7):
    w.write(s, {"loss": -float(s), "n": s})
  w.close()
  assert [r["step"] for r in metrics.read_records(tmp_path)] == [0, 1, 2, 3, 4, 5, 6, 5, 6, 7]
  recs = metrics.read_metrics(str(tmp_path))
  assert [r["step"] for r in recs] == list(range(8))
  assert recs[5]["loss"] == -5.0 and recs[4]["loss"] == 0.2 and "bad" not in recs[6]
  assert metrics.has_metrics(tmp_path)


def test_non_primary_writes_nothing(tmp_path):
  w = metrics.MetricWriter(tmp_path / "run", tensorboard=False, primary=False)
  w.write(0, {"x": 1})
  w.close()
  assert not (tmp_path / "run").exists() and not metrics.has_metrics(tmp_path / "run")
  with pytest.raises(FileNotFoundError, match=r"run holds no metrics/ nor metrics.jsonl"):
    metrics.read_metrics(tmp_path / "run")
  with pytest.raises(ValueError, match="chunk_records=0: must be >= 1"):
    metrics.MetricWriter(tmp_path, primary=True, chunk_records=0)


def test_old_layout_read_first_and_interrupted_writes_skipped(tmp_path):
  # a run of the old layout (one appended metrics.jsonl, killed mid-line), resumed now
  (tmp_path / "metrics.jsonl").write_text('{"step": 0, "x": 0}\n{"step": 1, "x": 1}\n{"ste')
  w = metrics.MetricWriter(tmp_path, tensorboard=False, primary=True)
  w.write(1, {"x": 10})
  w.write(2, {"x": 20})
  (tmp_path / "metrics" / "000000.jsonl.tmp-123").write_text('{"step": 9}\n')  # killed write
  (tmp_path / "metrics" / "notes.txt").write_text("not a chunk")
  assert [p.name for p in metrics.chunk_files(tmp_path)] == ["metrics.jsonl", "000000.jsonl"]
  assert [(r["step"], r["x"]) for r in metrics.read_metrics(tmp_path)] == [(0, 0), (1, 10),
                                                                          (2, 20)]


def test_chunks_sort_by_number_not_by_name(tmp_path):
  d = tmp_path / "metrics"
  d.mkdir()
  (d / "999999.jsonl").write_text('{"step": 1, "x": "first"}\n')
  (d / "1000000.jsonl").write_text('{"step": 1, "x": "second"}\n')
  assert metrics.read_metrics(tmp_path) == [{"step": 1, "x": "second"}]
  assert metrics.MetricWriter(tmp_path, tensorboard=False, primary=True).path.name == (
      "1000001.jsonl")


def test_gs_workdir_on_a_store_without_append_or_rename(bucket):
  with pytest.raises(NotImplementedError, match="append"):  # what the old writer did
    bucket.open("gs://b/x.jsonl", "a")
  w = metrics.MetricWriter("gs://b/run", tensorboard=False, primary=True, chunk_records=2)
  for s in range(5):
    w.write(s, {"reward": s / 4})
    # each record is readable (whole) as soon as write returns
    assert metrics.read_metrics("gs://b/run")[-1] == {"step": s, "reward": s / 4}
  w.close()
  assert sorted(bucket.store) == [f"gs://b/run/metrics/00000{i}.jsonl" for i in range(3)]
  assert metrics.has_metrics("gs://b/run") and not metrics.has_metrics("gs://b/other")
  w = metrics.MetricWriter("gs://b/run", tensorboard=False, primary=True)
  assert str(w.path) == "gs://b/run/metrics/000003.jsonl"

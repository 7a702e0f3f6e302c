"""Inputs on cloud storage: task files, checkpoint directories and the base policy's tokenizer
read from a ``gs://`` bucket (an in-memory fake with an object store's limits), copied once
into the local cache where a library needs local files."""

import json
import os

import pytest
from etils.epath import backend as backend_lib
from fsspec.implementations.memory import MemoryFileSystem

from jaxreplay import config as config_lib
from jaxreplay import storage

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
SAMPLES = os.path.join(ROOT, "data", "samples")


class ObjectStore(MemoryFileSystem):
  """An in-memory bucket that refuses append and rename, and counts the files it opens."""

  protocol = ("objstore",)

  def _open(self, path, mode="rb", **kw):
    if "a" in mode or "+" in mode:
      raise NotImplementedError(f"object store: mode {mode!r} (append) is not supported")
    if "r" in mode:
      self.reads.append(path)
    return super()._open(path, mode, **kw)

  def mv(self, *a, **k):
    raise NotImplementedError("object store: no rename")


@pytest.fixture
def bucket(monkeypatch, tmp_path):
  store = ObjectStore()
  store.store, store.pseudo_dirs, store.reads = {}, [""], []
  monkeypatch.setattr(backend_lib.fsspec_backend, "fs", lambda path: store)
  monkeypatch.setenv("JAXREPLAY_CACHE", str(tmp_path / "cache"))
  return store


def upload(bucket, url, local_path):
  with open(local_path, "rb") as f, bucket.open(url, "wb") as out:
    out.write(f.read())


def test_glob_and_local_copy_read_the_bucket_once(bucket, tmp_path):
  for name in ("gsm8k_train.jsonl", "gsm8k_test.jsonl"):
    upload(bucket, f"gs://b/data/{name}", os.path.join(SAMPLES, name))
  assert storage.glob("gs://b/data/gsm8k_*.jsonl") == ["gs://b/data/gsm8k_test.jsonl",
                                                      "gs://b/data/gsm8k_train.jsonl"]
  assert storage.glob("gs://b/data/none_*.jsonl") == [] and storage.glob("gs://c/x*") == []
  local = storage.local_copy("gs://b/data/gsm8k_train.jsonl")
  assert local.startswith(str(tmp_path / "cache")) and os.path.basename(local) == \
      "gsm8k_train.jsonl"
  assert open(local, "rb").read() == open(os.path.join(SAMPLES, "gsm8k_train.jsonl"), "rb").read()
  n = len(bucket.reads)
  assert storage.local_copy("gs://b/data/gsm8k_train.jsonl") == local and len(bucket.reads) == n
  assert storage.local_copy("data/x.jsonl") == "data/x.jsonl"  # local paths are not copied
  with pytest.raises(FileNotFoundError, match="gs://b/nothing"):
    storage.local_copy("gs://b/nothing")


def test_a_file_task_on_the_bucket_reads_the_same_rows_as_local_files(bucket):
  from jaxreplay.tasks import make_task
  for name in ("gsm8k_train.jsonl", "gsm8k_test.jsonl"):
    upload(bucket, f"gs://b/gsm8k/{name}", os.path.join(SAMPLES, name))
  task = dict(source="jsonl", name="", kwargs={}, format="gsm8k",
              prompt_template="Question: {question}\nAnswer:")
  local = make_task({**task, "train_path": os.path.join(SAMPLES, "gsm8k_train.jsonl"),
                     "heldout_path": os.path.join(SAMPLES, "gsm8k_test.jsonl")})
  remote = make_task({**task, "train_path": "gs://b/gsm8k/gsm8k_tr*.jsonl",
                      "heldout_path": "gs://b/gsm8k/gsm8k_test.jsonl"})
  assert [(e.prompt, e.answer) for e in remote.train] == \
      [(e.prompt, e.answer) for e in local.train] and len(local.train) > 0
  assert [(e.prompt, e.answer) for e in remote.heldout] == \
      [(e.prompt, e.answer) for e in local.heldout]
  tree = config_lib.load_config(os.path.join(ROOT, "configs", "default.py")).to_dict()
  tree["task"].update(task, train_path="gs://b/gsm8k/missing.jsonl",
                      heldout_path="gs://b/gsm8k/gsm8k_test.jsonl")
  with pytest.raises(config_lib.ConfigError,
                     match=r"^config\.task\.train_path='gs://b/gsm8k/missing\.jsonl': no such "
                           r"file"):
    config_lib.validate(tree, device_count=1, process_count=1)


def test_a_checkpoint_directory_is_copied_whole_and_checked_first(bucket):
  files = {"config.json": json.dumps({"model_type": "llama"}), "tokenizer.json": "{}",
           "model.safetensors": "weights", "sub/extra.txt": "x"}
  tree = config_lib.load_config(os.path.join(ROOT, "configs", "default.py")).to_dict()
  tree["model"].update(source="hf", path="gs://b/ckpt")
  with pytest.raises(config_lib.ConfigError, match=r"^config\.model\.path='gs://b/ckpt' is "
                                                   r"invalid: .*missing: config\.json, "
                                                   r"tokenizer\.json"):
    config_lib.validate(tree, device_count=1, process_count=1)
  for name, text in files.items():
    with bucket.open(f"gs://b/ckpt/{name}", "w") as f:
      f.write(text)
  config_lib.validate(tree, device_count=1, process_count=1)  # the files are found
  local = storage.local_copy("gs://b/ckpt")
  for name, text in files.items():
    assert open(os.path.join(local, name)).read() == text


def test_the_base_policy_tokenizer_is_trained_once_into_the_bucket(bucket):
  from jaxreplay.models.tokenizer import load_or_train_tokenizer
  texts = [f"{a} + {b} = {a + b}" for a in range(30) for b in range(30)]
  tok = load_or_train_tokenizer("gs://b/cache/key/tokenizer.json", texts, 300)
  assert "gs://b/cache/key/tokenizer.json" in bucket.store
  again = load_or_train_tokenizer("gs://b/cache/key/tokenizer.json", ["unrelated"], 300)
  assert again.to_str() == tok.to_str()  # read back, not retrained on other texts


# --- a whole run, its resume and the report in a bucket ---------------------------------------

@pytest.fixture
def disk_bucket(monkeypatch, tmp_path):
  """``gs://`` on the local disk, as an object store behaves: every epath call goes to
  ``tmp_path/bucket`` through fsspec (no append, no rename), and Orbax's TensorStore writes
  its arrays to the same place with its file driver instead of the GCS one."""
  from fsspec.implementations.dirfs import DirFileSystem
  from fsspec.implementations.local import LocalFileSystem
  from orbax.checkpoint._src.serialization import tensorstore_utils

  root = tmp_path / "bucket"
  root.mkdir()

  class Bucket(DirFileSystem):
    @classmethod
    def _strip_protocol(cls, path):
      path = str(path)
      return path.split("://", 1)[1] if "://" in path else path

    def open(self, path, mode="rb", **kw):
      if "a" in mode or "+" in mode:
        raise NotImplementedError(f"object store: mode {mode!r} (append) is not supported")
      return super().open(path, mode, **kw)

    def mv(self, *a, **k):
      raise NotImplementedError("object store: no rename")

    rename = move = mv

  fs = Bucket(path=str(root), fs=LocalFileSystem())
  monkeypatch.setattr(backend_lib.fsspec_backend, "fs", lambda path: fs)
  monkeypatch.setattr(tensorstore_utils.gcs_utils, "get_kvstore_for_gcs",
                      lambda path: {"driver": "file",
                                    "path": str(root / path.split("://", 1)[1])})
  # the bucket's metadata Orbax asks Google's client for (a flat namespace, as most buckets)
  monkeypatch.setattr(tensorstore_utils.gcs_utils, "is_hierarchical_namespace_enabled",
                      lambda *a, **k: False)
  monkeypatch.setenv("JAXREPLAY_CACHE", str(tmp_path / "local_cache"))
  return root


@pytest.mark.slow
def test_a_run_its_resume_and_the_report_with_every_path_in_a_bucket(disk_bucket):
  from conftest import run
  from jaxreplay import report
  for name in ("gsm8k_train.jsonl", "gsm8k_test.jsonl"):
    with open(os.path.join(SAMPLES, name), "rb") as f:
      (disk_bucket / "b" / "data").mkdir(parents=True, exist_ok=True)
      (disk_bucket / "b" / "data" / name).write_bytes(f.read())
  c = config_lib.load_config(os.path.join(ROOT, "configs", "small.py"))
  config_lib.apply_overrides(c, [
      "workdir=gs://b/sweep/tiny/seed0", "warmstart.cache_dir=gs://b/base_policies",
      "log.progress=False", "log.tensorboard=False", "warmstart.steps=10", "train.steps=2",
      "model.d_model=32", "model.n_layers=1", "model.n_heads=2", "model.n_kv_heads=1",
      "model.head_dim=16", "model.d_ff=64", "rollout.per_step=8", "rollout.group_size=4",
      "train.batch_size=8", "buffer.capacity=16", "algo.warmup_steps=1", "eval.every=1",
      "eval.num_examples=4", "eval.samples_per_example=1", "checkpoint.every=1",
      "drift.every=0", "mesh.data=1"])
  c.task.kwargs = {}
  c.task.update(source="jsonl", name="", format="gsm8k",
                train_path="gs://b/data/gsm8k_train.jsonl",
                heldout_path="gs://b/data/gsm8k_test.jsonl",
                prompt_template="{question}", prompt_width=24)
  logs = []
  first = run(c, log=logs.append)
  assert first["steps"] == 2 and first["checkpoints"] == "gs://b/sweep/tiny/seed0/checkpoints"
  c.train.steps = 3
  second = run(c, log=logs.append)
  assert any("resumed from" in line and "gs://b/sweep/tiny/seed0/checkpoints" in line
             for line in logs)
  assert second["steps"] == 3
  assert second["generated_rollouts"] == first["generated_rollouts"] + 8  # one more round
  run_dir = disk_bucket / "b" / "sweep" / "tiny" / "seed0"
  for name in ("config.json", "summary.json", "metrics"):
    assert (run_dir / name).exists(), name
  assert (disk_bucket / "b" / "base_policies").is_dir()
  assert json.loads((run_dir / "summary.json").read_text())["steps"] == 3
  sweep = {"base_config": "configs/small.py", "seeds": [0], "workdir": "gs://b/sweep",
           "configurations": [{"name": "tiny", "family": "tiny", "overrides": {}}],
           "report": {"results_md": "gs://b/sweep/results.md"}}
  paths = report.write_report(sweep, "gs://b/sweep", "python -m jaxreplay.sweep --report-only")
  assert paths[0] == "gs://b/sweep/results.md"
  md = (disk_bucket / "b" / "sweep" / "results.md").read_text()
  assert "runs: 1 present of 1" in md and "sweep directory: `gs://b/sweep`" in md

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

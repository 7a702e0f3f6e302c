"""One process of the two-process test (tests/test_multiprocess.py); also the tiny config.

``python tests/multiprocess_worker.py PROCESS_ID NUM_PROCESSES PORT WORKDIR CACHE_DIR OUT``
starts JAX's distributed runtime from the config's ``distributed`` section (what
``jaxreplay.main`` does), trains 2 learner steps with a checkpoint at step 2, then, in the
same process, runs the job again with ``train.steps=3``: it restores step 2 and trains
step 3. It writes ``OUT/process_I.json`` (which run files this process wrote, its logs)
and, from process 0, ``OUT/params.npz``: the final parameters gathered from all processes.
"""

from __future__ import annotations

import json
import os
import resource
import sys

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def tiny_config(workdir: str, cache_dir: str, steps: int, record: bool = False):
  """configs/small.py shrunk to seconds: a 1-layer d=32 decoder, 16 rollouts per step,
  B = 16 from a buffer of 32, a checkpoint every 2 steps, a 4-device data mesh. With
  ``record``, an evaluation (8 x 2) every 2 steps whose completions are recorded, and the
  trained rollouts recorded every step (``samples/``)."""
  sys.path.insert(0, ROOT)
  from jaxreplay.config import load_config
  c = load_config(os.path.join(ROOT, "configs", "small.py"))
  c.workdir = workdir
  c.warmstart.update(cache_dir=cache_dir, steps=20, batch_size=32)
  c.task.update(train_size=400, heldout_size=60)
  c.model.update(d_model=32, n_layers=1, n_heads=2, n_kv_heads=1, head_dim=16, d_ff=64)
  c.rollout.update(per_step=16, group_size=4)
  c.buffer.capacity = 32
  c.train.update(steps=steps, batch_size=16)
  c.algo.warmup_steps = 1
  c.eval.update(every=2 if record else 0, num_examples=8, samples_per_example=2, record=4)
  c.log.update(record_every=1 if record else 0, record_rollouts=2)
  c.drift.every = 0
  c.checkpoint.update(every=2, keep_best=False)
  c.log.update(progress=False, tensorboard=False)
  c.mesh.update(data=4, fsdp=1, tensor=1)
  return c


def main(argv):
  pid, n, port, workdir, cache_dir, out = argv[1:7]
  pid, n = int(pid), int(n)
  cfg = tiny_config(workdir, cache_dir, steps=2, record=True)
  cfg.distributed.update(initialize=True, coordinator_address=f"127.0.0.1:{port}",
                         num_processes=n, process_id=pid)
  from jaxreplay import config as config_lib
  from jaxreplay.parallel import multihost
  multihost.initialize(**config_lib.distributed_settings(cfg))  # as jaxreplay.main does

  import jax
  import numpy as np
  from jaxreplay.train import checkpoint as ckpt_lib
  from jaxreplay.train import metrics as metrics_lib
  from jaxreplay import config as config_lib
  from jaxreplay.train import loop
  run = lambda c, log: loop.run(config_lib.validate(c), log)  # noqa: E731

  # Spies: the run files this process writes, and the tree of the last checkpoint.
  wrote, saved, logs = [], {}, []
  real_write_atomic, real_save = ckpt_lib.write_atomic, ckpt_lib.save
  real_metric_write = metrics_lib.MetricWriter.write
  from jaxreplay.train import samples as samples_lib
  real_samples_write = samples_lib.write

  def samples_write(workdir, name, step, records):
    path = real_samples_write(workdir, name, step, records)
    if path is not None:
      wrote.append(f"samples/{name}")
    return path

  def write_atomic(path, text):
    wrote.append(os.path.basename(str(path)))
    real_write_atomic(path, text)

  def metric_write(self, step, m):
    if self.active:
      wrote.append(f"metrics.jsonl:{step}")
    real_metric_write(self, step, m)

  def save(manager, step, tree, meta):
    saved["tree"] = tree
    real_save(manager, step, tree, meta)

  ckpt_lib.write_atomic, ckpt_lib.save = write_atomic, save
  metrics_lib.MetricWriter.write = metric_write
  samples_lib.write = samples_write

  run(cfg, log=logs.append)  # steps 0, 1; checkpoint at step 2
  cfg = tiny_config(workdir, cache_dir, steps=3, record=True)
  cfg.distributed.update(initialize=True, coordinator_address=f"127.0.0.1:{port}",
                         num_processes=n, process_id=pid)
  run(cfg, log=logs.append)  # restores step 2, trains step 3, checkpoint at step 3

  params = multihost.to_host(saved["tree"]["train"].params)  # a collective: all processes
  if pid == 0:
    flat = jax.tree_util.tree_flatten_with_path(params)[0]
    np.savez(os.path.join(out, "params.npz"),
             **{jax.tree_util.keystr(k): np.asarray(v) for k, v in flat})
  with open(os.path.join(out, f"process_{pid}.json"), "w") as f:
    cpu = resource.getrusage(resource.RUSAGE_SELF)
    json.dump({"wrote": wrote, "logs": [str(m) for m in logs],
               "cpu_s": round(cpu.ru_utime + cpu.ru_stime, 1),
               "process_count": jax.process_count(), "device_count": jax.device_count(),
               "local_devices": len(jax.local_devices())}, f)


if __name__ == "__main__":
  main(sys.argv)

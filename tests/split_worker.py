"""One process of the two-process actor–learner test (tests/test_split.py).

``python tests/split_worker.py PROCESS_ID NUM_PROCESSES PORT WORKDIR CACHE_DIR OUT``: 2
processes × 2 fake CPU devices; each gives 1 device to the generator mesh (W = 2) and 1 to
the learner mesh (T = 2). Trains 3 learner steps with a checkpoint at step 2 (the last step
checkpoints too), then, in the same process, restores the latest checkpoint with
``train.steps=4`` and trains step 4. Writes ``OUT/process_I.json``: the checks this process
made (every inserted token's behaviour log-prob against the learner's float32 recomputation
under the parameters of the version it records; the restored parameters against the saved
ones), its logs and counters.
"""

from __future__ import annotations

import json
import os
import sys

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, HERE)


def config(workdir, cache, steps, pid, n, port):
  from multiprocess_worker import tiny_config
  c = tiny_config(workdir, cache, steps=steps, record=True)
  c.train.update(mode="async", weight_sync_every=1)
  c.mesh.update(data=2, generator_devices=1)
  c.sampler.chunk_steps = 2
  c.buffer.max_staleness = 3
  c.distributed.update(initialize=True, coordinator_address=f"127.0.0.1:{port}",
                       num_processes=n, process_id=pid)
  return c


def main(argv):
  pid, n, port, workdir, cache, out = argv[1:7]
  pid, n = int(pid), int(n)
  from jaxreplay import config as config_lib
  from jaxreplay.parallel import multihost
  multihost.initialize(**config_lib.distributed_settings(config(workdir, cache, 3, pid, n,
                                                                port)))
  import jax
  import numpy as np
  from jaxreplay.rl.scoring import token_logprobs
  from jaxreplay.train import checkpoint as ckpt_lib
  from jaxreplay.train import loop, split
  from jaxreplay.train.metrics import read_metrics

  from jaxreplay.train import samples as samples_lib
  made, published, saved, graphdefs, logs, wrote = [], {}, {}, [], [], []
  real_deliver, real_publish, real_init = (split.Generator._deliver, split.Generator.publish,
                                           split.Generator.__init__)
  real_save = ckpt_lib.save
  real_samples_write = samples_lib.write

  def samples_write(workdir, name, step, records):  # the recorded completions it wrote
    path = real_samples_write(workdir, name, step, records)
    if path is not None:
      wrote.append(name)
    return path

  def deliver_spy(self, rollout, produced):  # each finished round, in order
    graphdefs.append(self._run.source.graphdef)
    # the rollout is split over the learner mesh (one device per process): this process
    # checks its own rows (a gather here would be a learner-mesh collective off its thread)
    rows = rollout.tokens.addressable_shards[0].index[0]
    local = jax.tree.map(lambda x: np.asarray(x.addressable_shards[0].data), rollout)
    made.append((local, produced.token_versions[rows]))
    real_deliver(self, rollout, produced)

  def host(params):  # the generator copy is replicated over the generator mesh
    return jax.tree.map(lambda x: np.asarray(x.addressable_shards[0].data), params)

  def init_spy(self, *, params, version, **kw):
    published[version] = host(params)
    real_init(self, params=params, version=version, **kw)

  def publish_spy(self, params, version):
    published[version] = host(params)
    real_publish(self, params, version)

  def save_spy(manager, step, tree, meta):
    saved[step] = multihost.to_host(tree["train"].params)
    real_save(manager, step, tree, meta)

  split.Generator._deliver = deliver_spy
  split.Generator.publish, split.Generator.__init__ = publish_spy, init_spy
  ckpt_lib.save = save_spy
  samples_lib.write = samples_write
  run = lambda c: loop.run(config_lib.validate(c), logs.append)  # noqa: E731
  summary = run(config(workdir, cache, 3, pid, n, port))
  last_saved = max(saved)

  # Every inserted or queued token against the learner's recomputation (float32).
  worst, checked = 0.0, 0
  for rollout, versions in made:
    p_width = rollout.tokens.shape[1] - versions.shape[1]
    mask = rollout.completion_mask[:, p_width:]
    for v in np.unique(versions[mask]):
      logp, _ = jax.jit(token_logprobs, static_argnums=(0, 4))(
          graphdefs[0], published[int(v)], rollout.tokens, rollout.attention_mask, 1.0)
      sel = mask & (versions == v)
      diff = np.abs(rollout.behaviour_logprobs[:, p_width:][sel] - np.asarray(logp)[:, p_width:][sel])
      worst, checked = max(worst, float(diff.max())), checked + int(sel.sum())

  # Resume: the restored learner state is the saved one, then one more step trains.
  from jaxreplay.train import build as build_lib, carry as carry_lib
  job, carry = build_lib.build(config_lib.validate(config(workdir, cache, 4, pid, n, port)),
                               logs.append)
  carry = carry_lib.resume(job, carry)
  restored = multihost.to_host(carry.state.params)
  same = all(np.array_equal(a, b) for a, b in zip(jax.tree.leaves(restored),
                                                  jax.tree.leaves(saved[last_saved])))
  restored_step = carry.step
  job.writer.close()
  summary2 = run(config(workdir, cache, 4, pid, n, port))
  recs = [r for r in read_metrics(workdir) if "staleness_max" in r]
  with open(os.path.join(out, f"process_{pid}.json"), "w") as f:
    json.dump({"checked_tokens": checked, "worst_logprob_diff": worst,
               "rounds": len(made), "versions": sorted(published),
               "span": max((int((r.newest_version - r.policy_version).max()) for r, _ in made),
                           default=0),
               "restored_step": restored_step, "last_saved": last_saved,
               "restored_equals_saved": same,
               "staleness_max": max(r["staleness_max"] for r in recs),
               "bad_slots": sum(r["batch_bad_slots"] for r in recs),
               "steps": [r["step"] for r in recs],
               "lost": [summary["ledger"]["lost_in_flight_rollouts"],
                        summary2["ledger"]["lost_in_flight_rollouts"]],
               "samples_written": wrote,
               "process_count": jax.process_count(), "device_count": jax.device_count(),
               "logs": [str(m) for m in logs]}, f)


if __name__ == "__main__":
  main(sys.argv)

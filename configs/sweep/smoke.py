"""Smoke version of the replay-vs-on-policy sweep: 2 configurations × 1 seed, 4 steps, tiny model.

Runs in the test suite (tests/test_sweep.py) in well under a minute of compute per run:
  python -m jaxreplay.sweep --config configs/sweep/smoke.py --workdir /tmp/smoke
"""

from ml_collections import config_dict


def get_config():
  c = config_dict.ConfigDict()
  c.base_config = "configs/small.py"
  c.workdir = "runs/sweep/smoke"
  c.seeds = (0,)
  c.base_overrides = config_dict.ConfigDict({
      "task.train_size": 400, "task.heldout_size": 60,
      "model.d_model": 32, "model.n_layers": 1, "model.n_heads": 1, "model.n_kv_heads": 1,
      "model.head_dim": 32, "model.d_ff": 64,
      "warmstart.steps": 20, "warmstart.batch_size": 32, "warmstart.warmup_steps": 2,
      "algo.warmup_steps": 1, "train.steps": 4, "eval.every": 2, "eval.num_examples": 16,
      "eval.samples_per_example": 2, "checkpoint.every": 2, "checkpoint.keep_best": False,
      "drift.every": 0, "log.progress": False, "log.tensorboard": False,
      "train.batch_size": 16,
  }, allow_dotted_keys=True)
  c.configurations = [
      dict(name="onpolicy", family="on-policy",
           overrides={"rollout.per_step": 16, "buffer.capacity": 16}),
      dict(name="fifo_x4_y2", family="FIFO uniform",
           overrides={"rollout.per_step": 8, "buffer.capacity": 32}),
  ]
  c.report = config_dict.ConfigDict(dict(
      reference="onpolicy", title="Smoke sweep", results_md="",  # "": WORKDIR/results.md
      claims=[dict(id="2", text="per step, the buffer is slightly worse or slower",
                   kind="compare", metric="sampled_at_ref_steps", a="fifo_x4_y2",
                   b="onpolicy", expect="lower"),
              dict(id="6", text="replay ratio ≈ K_train/K_inf", kind="replay_ratio")],
  ))
  return c

"""Replay against on-policy on a real model: SmolLM2-135M-Instruct's two-digit sums (issue 39).

  python -m jaxreplay.sweep --config configs/sweep/smollm2_sums_replay.py

Task, model and learner: ``configs/smollm2_135m_sums.py`` (B = 64, sampled at T = 0.5, the
zero-advantage rollouts left out of the learner). Two configurations at equal generation,
1,536 rollouts each, so the comparison is read on the generated-token axis:

  onpolicy     R = N = B = 64, 24 learner steps (the preset itself)
  fifo_x2_y2   R = 32, N = 64, B = 64, 48 learner steps: each rollout trained on about
               twice, at most one policy version stale

Both evaluate 100 held-out questions (greedy and one sample) at the same five generated-token
points (every 6 on-policy steps, every 12 replay steps), so each seed gives two curves on the
token axis and the report pairs them by seed.

Cost on the 2-core CPU, from the preset's runs (about 7 s of generation and 15 s of learner
per on-policy step; an evaluation of 100 questions about 55 s): about 14 min for an on-policy
run and 20 min for a replay run, about 1 h 45 min for the three seeds. The sweep resumes:
interrupt it and start it again.
"""

from ml_collections import config_dict

STEPS = 24        # on-policy learner steps (the preset's)
EVAL_EVERY = 6    # on-policy steps between evaluations


def get_config():
  c = config_dict.ConfigDict()
  c.base_config = "configs/smollm2_135m_sums.py"
  c.workdir = "runs/sweep/smollm2_sums_replay"
  c.seeds = (0, 1, 2)
  c.base_overrides = config_dict.ConfigDict({
      "eval.num_examples": 100,
      "eval.record": 100,                # every evaluated question's completions, to tell
                                         # form (one-line answers) from correctness
      "log.progress": False,
      "log.tensorboard": False,
  }, allow_dotted_keys=True)
  c.configurations = [
      dict(name="onpolicy", family="on-policy", overrides={
          "rollout.per_step": 64, "buffer.capacity": 64, "train.steps": STEPS,
          "eval.every": EVAL_EVERY, "checkpoint.every": STEPS}),
      dict(name="fifo_x2_y2", family="FIFO uniform", overrides={
          "rollout.per_step": 32, "buffer.capacity": 64, "train.steps": 2 * STEPS,
          "eval.every": 2 * EVAL_EVERY, "checkpoint.every": 2 * STEPS}),
  ]
  c.report = config_dict.ConfigDict(dict(
      kind="paired",     # one section of docs/results.md (jaxreplay.paired)
      section="smollm2-sums-replay",
      title="Replay on a real model: SmolLM2-135M-Instruct, two-digit sums (B = 64)",
      results_md="docs/results.md",
      reference="onpolicy",
  ))
  return c

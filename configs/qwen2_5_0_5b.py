"""Qwen2.5-0.5B-Instruct on GSM8K-style word problems: one GPU or a Colab runtime.

Loads a local Hugging Face checkpoint (no download at run time): fetch it once, e.g.
``hf download Qwen/Qwen2.5-0.5B-Instruct --local-dir ckpt/qwen2.5-0.5b-instruct``,
then ``python -m jaxreplay.main --config configs/qwen2_5_0_5b.py
--config.model.path=ckpt/qwen2.5-0.5b-instruct``.

Task: reasoning-gym's ``gsm_symbolic`` (GSM8K problems re-instantiated with new numbers,
generated locally), prompts wrapped in the checkpoint's chat template with a system turn
asking for a boxed answer, rewards by math-verify on the final answer (scored in 2 worker
processes, each call killed at ``task.reward_timeout_s``). Replay as in the
default: N = 4R, B = 2R (each rollout trained on twice on average, at most 3 versions
stale). bf16 compute with float32 parameters and Adam state.
"""

from jaxreplay.config import sibling_config


def get_config():
  c = sibling_config(__file__, "default")
  c.workdir = "runs/qwen2_5_0_5b"
  c.model.update(source="hf", path="", dtype="bfloat16", param_dtype="float32")
  c.task.kwargs = {}  # replaces chain_sum's options (update() would merge them)
  c.task.update(name="gsm_symbolic", prompt_template="{question}",
                train_size=20000, heldout_size=600, prompt_width=320,
                answer_extraction="math", reward_workers=2, chat_template=True,
                system_prompt="Please reason step by step, and put your final answer "
                              "within \\boxed{}.")
  c.sampler.update(max_new_tokens=512, temperature=1.0)
  c.rollout.update(per_step=128, group_size=8)  # R = 16 prompts × G = 8
  c.buffer.capacity = 512  # N
  c.train.update(steps=300, batch_size=256)  # B
  c.algo.update(lr=1e-6, warmup_steps=10, lr_schedule="constant", max_grad_norm=1.0,
                num_minibatches=4)  # 4 optimizer steps of 64 rollouts per learner step
  c.eval.update(every=25, num_examples=256, samples_per_example=4)
  c.checkpoint.update(every=25, max_to_keep=2)
  return c

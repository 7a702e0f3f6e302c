"""Qwen2.5-0.5B-Instruct on GSM8K-style word problems: one GPU.

Loads a local Hugging Face checkpoint (no download at run time): fetch it once, e.g.
``hf download Qwen/Qwen2.5-0.5B-Instruct --local-dir ckpt/qwen2.5-0.5b-instruct``,
then ``python -m jaxreplay.main --config configs/qwen2_5_0_5b.py
--config.model.path=ckpt/qwen2.5-0.5b-instruct``.

Task: reasoning-gym's ``gsm_symbolic`` (GSM8K problems re-instantiated with new numbers,
generated locally), prompts wrapped in the checkpoint's chat template with a system turn
asking for a boxed answer, rewards by math-verify on the final answer (scored in 2 worker
processes, each call killed at ``task.reward_timeout_s``).

The paper's settings where they apply (Arnal et al. 2026): G = 16 completions per prompt,
64 rollouts per optimizer update (R = 4 prompts × G per step, B = 64, one Adam step per
learner step), ε = 0.2, constant learning rate, training temperature 1.0; pass@1 on the
held-out set sampled at T = 0.1, top-p 0.95. Replay: N = 4R = 256, B = R (each rollout
trained on once on average, at most 3 versions stale).

Memory (bf16 compute, float32 parameters and Adam state): layers scanned with full
rematerialisation, log-probs over the vocabulary in chunks of 128 positions, gradients
accumulated over 4 micro-batches of 16 rows. ``bench/memory_plan.py --config
configs/qwen2_5_0_5b.py --devices 1 --chip h100`` (XLA:CPU's memory analysis of the compiled
learner step, sampler, rescoring, drift monitor and evaluation; not measured on a GPU):
  per device, GB        args      out  aliased     temp    total   +resident
    learner          5.93     5.93     5.93    11.34    17.27      17.27
    sampler          2.67     0.69     0.69     1.64     4.31       8.26
    rescoring        1.98     0.00     0.00     2.51     4.48       8.44
    drift            1.98     0.00     0.00     2.51     4.49       8.44
    eval sampler     4.76     2.78     2.78     5.56    10.32      14.27
    eval entropy     1.98     0.00     0.00     5.66     7.64      11.59
    train state 5.93 GB (parameters 1.98), buffer 0.00 GB
    +resident: total + the state and buffer not among the program's arguments (sampler: 3.95 GB)
  peak per device: 17.27 GB of 80 GB (22%); fits JAX's pool 0.75 x 80 = 60.0 GB with 20%
    headroom (<= 48.0 GB): yes
  (peak 17.3 GB: within 80% of a 24 GB GPU, 19.2 GB.)
"""

from jaxreplay.config import sibling_config


def get_config():
  c = sibling_config(__file__, "default")
  c.workdir = "runs/qwen2_5_0_5b"
  c.model.update(source="hf", path="", dtype="bfloat16", param_dtype="float32")
  c.model.scan_layers = True
  c.model.remat = "full"
  c.task.kwargs = {}  # replaces chain_sum's options (update() would merge them)
  c.task.update(name="gsm_symbolic", prompt_template="{question}",
                train_size=20000, heldout_size=600, prompt_width=320,
                answer_extraction="math", reward_workers=2, chat_template=True,
                system_prompt="Please reason step by step, and put your final answer "
                              "within \\boxed{}.")
  c.sampler.update(max_new_tokens=512, temperature=1.0)
  c.rollout.update(per_step=64, group_size=16)  # R = 4 prompts × G = 16
  # bf16: the learner rescores each rollout before insertion, so a fresh rollout's ratio is
  # exactly 1 (the sampler's decode and the learner's forward round differently; see
  # bench/bf16_ratio.py and the README's "bfloat16 and the importance ratio").
  c.rollout.behaviour_logprobs = "learner"
  c.buffer.capacity = 256  # N
  c.train.update(steps=300, batch_size=64)  # B
  c.algo.update(lr=1e-6, warmup_steps=0, lr_schedule="constant", max_grad_norm=1.0,
                eps_low=0.2, eps_high=0.2, num_minibatches=1, grad_accum_steps=4,
                logprob_chunk=128)
  c.eval.update(every=25, num_examples=256, samples_per_example=4, temperature=0.1,
                top_p=0.95, batch_rows=256)
  c.checkpoint.update(every=25, max_to_keep=2)
  return c

"""Embedded default: GRPO with a replay buffer on reasoning-gym chain_sum, CPU-sized.

The paper's knobs (Arnal et al. 2026, §4): buffer capacity N = ``buffer.capacity``,
rollouts generated per learner step R = ``rollout.per_step``, batch size
B = ``train.batch_size``, group size G = ``rollout.group_size``. On-policy training
is N = R = B (see ``configs/onpolicy.py``).
"""

from ml_collections import config_dict


def get_config():
  c = config_dict.ConfigDict()
  c.seed = 0
  c.workdir = "runs/default"

  # source: "reasoning_gym" (generated offline), or "jsonl" / "parquet" files in a format
  # (plain, gsm8k, math) — see jaxreplay/tasks/spec.py for which option applies to which.
  c.task = config_dict.ConfigDict(dict(
      source="reasoning_gym",
      name="chain_sum",
      seed=1234,
      train_size=20000,
      heldout_size=2000,  # before deduplication against train (~740 remain)
      kwargs=dict(min_terms=2, max_terms=4, min_digits=1, max_digits=1),
      prompt_template="{expression} =",  # the instruction is constant; "{question}" keeps it
      train_path="",
      heldout_path="",
      prompt_width=16,  # P, tokens (incl. <bos>); longer prompts: data.on_too_long
      on_too_long="truncate_left",
      reward_timeout_s=5.0,  # a reward call running longer scores 0 and is counted; 0 = no limit
      answer_extraction="bare",  # "bare": the completion is the answer; "math"/"boxed": math-verify
      chat_template=False,  # model.source="hf": wrap prompts in the checkpoint's chat template
      system_prompt="",  # with chat_template: a system turn ("" = none)
      format="plain",  # file sources: how the gold is read: plain, gsm8k (####), math (boxed)
      question_field="", answer_field="", solution_field="",  # file columns; "" = format's
      # Reward calls run in this many worker processes (killed and replaced at the timeout);
      # 0 = in this process, for scorers that cannot hang (chain_sum's string compare).
      reward_workers=0,
  ))

  # source "builtin": this small decoder, warm-started below; "hf": a local Hugging Face
  # checkpoint directory in model.path (Llama 3 / Qwen2 / Qwen2.5 / Qwen3; see configs/qwen*).
  # scan_layers=True runs the blocks as one lax.scan over stacked parameters (the Qwen presets
  # set it); remat="full" | "dots_saveable" | "dots_no_batch" recomputes each block in the
  # backward pass (models/transformer.py). attention="auto" runs full sequences through the
  # platform's fused kernel (cuDNN on GPU, splash on TPU; XLA here), "xla" never
  # (models/attention.py). Every field: docs/configuration.md.
  c.model = config_dict.ConfigDict(dict(
      source="builtin", path="", dtype="float32", param_dtype="float32",
      vocab_size=300, d_model=128, n_layers=4, n_heads=4, n_kv_heads=2, head_dim=32,
      d_ff=384, rope_theta=10_000.0, tie_embeddings=True, scan_layers=False, remat="none",
      attention="auto",
      # LoRA adapters (Hu et al. 2021): rank > 0 trains only W + (alpha/rank)·A B's A and B
      # on the targeted layers, the rest frozen (models/lora.py); rank 0 is off.
      lora=dict(rank=0, alpha=32.0, dropout=0.0,
                targets=("q", "k", "v", "o", "gate", "up", "down")),
  ))

  # Supervised warm start on deliberately noisy labels: the base policy puts real mass
  # on wrong answers, which the verifiable reward then corrects.
  c.warmstart = config_dict.ConfigDict(dict(
      steps=600, batch_size=128, lr=2e-3, warmup_steps=50, label_noise=0.3,
      cache_dir="runs/base_policies",
  ))

  # top_k = 0 / top_p = 1 disable truncation; with truncation the trainer recomputes
  # log-probs under the same truncated distribution (ratio 1 at identical parameters).
  # slots: rows the decode engine runs at once (0: one per rollout); a finished row's slot
  # takes the next request. chunk_steps: decode steps between the engine's host checks
  # (refill, batch shrink, attention width); a finished row idles at most this many steps.
  # paged: the KV cache as a pool of pages of page_size positions (prompt pages shared by a
  # group); num_pages: the pool (0 = every slot at full length); attention: paged decode
  # attention, 'auto' | 'xla' | 'pallas'. overlap_host_check: dispatch each decode chunk
  # before the host reads the one before (a freed slot is refilled a chunk later).
  # on_weight_swap: an in-flight weight update re-prefills the decoding slots ('recompute')
  # or keeps their KV cache ('keep_kv', as PipelineRL).
  c.sampler = config_dict.ConfigDict(dict(max_new_tokens=6, temperature=1.0, top_k=0, top_p=1.0,
                                          slots=0, chunk_steps=16, paged=False, page_size=16,
                                          num_pages=0, attention="auto",
                                          overlap_host_check=False,
                                          on_weight_swap="recompute"))

  # behaviour_logprobs: "sampler" stores the sampler's log-probs; "learner" rescores the
  # completions with the learner's forward before insertion, so a fresh rollout's
  # importance ratio is exactly 1 in bfloat16 too (bench/bf16_ratio.py; the bf16 presets).
  c.rollout = config_dict.ConfigDict(dict(per_step=128, group_size=8,  # R = 16 prompts × G
                                          behaviour_logprobs="sampler"))
  # N = capacity. Samplers: uniform (the paper's), recency, priority, positive_bias,
  # fresh_first — see jaxreplay/replay/config.py for every field.
  c.buffer = config_dict.ConfigDict(dict(
      capacity=512, sampler="uniform", replace=False,
      recency="exponential", recency_temperature=4.0, recency_p=0.05, recency_beta=0.0,
      priority_alpha=0.6, priority_beta=0.4, priority_eps=1e-6,
      positive_bias_delta=0.5, positive_bias_size=config_dict.placeholder(int),
      correct_threshold=1.0, group_size=1,
      max_staleness=config_dict.placeholder(int),
      max_times_sampled=config_dict.placeholder(int),
  ))
  # Self-tuning replay (off): every ``every`` learner steps measure μ, α, ρ (rl/noise.py)
  # and set R (rollout.per_step, B fixed) and the age cut-off (buffer.max_staleness, inside
  # the fixed capacity) to the theory's optimum within the bounds (replay/auto.py). Lagged
  # modes only (sync, simulated_async). mu_source: "flops" (the run's FLOP ratio, the same
  # on any machine) or "configured" (set mu, e.g. a deployment's measured μ); never wall time.
  # bias_limit > 0 caps the horizon at bias_limit / (measured bias per step of age).
  c.auto_replay = config_dict.ConfigDict(dict(
      enabled=False, every=50, num_samples=256, num_projections=128, center="mean",
      min_samples=4, warmup=2, ema=0.8, x_min=1.0, x_max=64.0, y_min=1.0, y_max=16.0,
      tolerance=0.2, bias_limit=0.0, mu_source="flops", mu=config_dict.placeholder(float),
  ))
  # B = 2R: each rollout is trained on twice on average; N = 4R: at most 3 versions stale.
  # mode: "sync" (generate with the current policy, then train: the paper's theory model),
  # "simulated_async" (deterministic; generate with the policy of exactly ``lag`` learner
  # steps ago), "async" (a generator thread with its own weights, refreshed every
  # ``weight_sync_every`` learner steps; the rate limiter paces generation and training;
  # not bit-reproducible). On-policy is N = R = B in any mode.
  c.train = config_dict.ConfigDict(dict(steps=200, batch_size=256, mode="sync", lag=1,
                                        weight_sync_every=1, async_timeout_s=600.0,
                                        max_generated_rollouts=0,
                                        # JAX's persistent compilation cache ("" = off):
                                        # restarts load their programs, not compile them
                                        compilation_cache_dir="~/.cache/jaxreplay/xla",
                                        # a packed learner shape's compile cost in steps:
                                        # batches reuse larger compiled shapes until their
                                        # padding wastes that much (0 = always compile)
                                        compile_cost_steps=0.0,
                                        # of each GPU's memory for JAX (0 = its 0.75)
                                        device_memory_fraction=0.0))
  # Reverb-style samples-per-insert limiter (async mode). samples_per_insert ρ is the replay
  # ratio it holds — the one-host stand-in for the paper's W/T split (W/T = μ/ρ); unset:
  # B/R. min_fill: items before the first sample (unset: B). error_buffer: tolerance of
  # ρ·inserted − sampled, in sequences (unset: ρR + B, twice the deadlock-free minimum).
  c.rate_limiter = config_dict.ConfigDict(dict(
      samples_per_insert=config_dict.placeholder(float),
      min_fill=config_dict.placeholder(int),
      error_buffer=config_dict.placeholder(float),
  ))

  c.algo = config_dict.ConfigDict(dict(
      # estimators: grpo, dr_grpo, rloo, gae; losses: ppo_clip, tis, decoupled, gspo,
      # asymre (needs dr_grpo), reinforce — see jaxreplay/rl/spec.py AlgoSpec.
      advantage="grpo", loss="ppo_clip", eps_low=0.2, eps_high=0.2,
      aggregation="token_mean", horizon=0, delta_v=-0.1,
      is_cap=2.0, ratio_mask_c=0.0, mask_truncated=False,
      kl_coef=0.0, kl_estimator="k3", kl_mode="loss", entropy_coef=0.0,
      gae_gamma=1.0, gae_lambda=0.95, vf_coef=0.5, value_clip=0.2, gae_whiten=True,
      staleness_target="none", staleness_fn="inverse", staleness_rate=0.5,
      staleness_buckets=(0, 1, 2, 4, 8),
      # grad_accum_steps: micro-batches per optimizer step (gradients summed, the same
      # update in less memory); logprob_chunk: positions per chunk of the learner's
      # log-softmax over the vocabulary (0 = the whole sequence at once); pack_sequences:
      # the learner runs on the batch's real tokens packed into rows, not the padded batch;
      # share_prompts: packed, a group's rollouts run their common prompt once.
      update_epochs=1, num_minibatches=1, grad_accum_steps=1, logprob_chunk=0,
      pack_sequences=True, share_prompts=False,
      lr=1e-4, warmup_steps=10, lr_schedule="cosine", final_lr_fraction=0.1,
      max_grad_norm=1.0, weight_decay=0.0,
      max_consecutive_skips=10, skip_zero_gradient=False, drop_zero_advantage=False,
  ))

  # Held-out evaluation: greedy and sampled accuracy, pass@k (k = 1, 2, 4, ... up to
  # samples_per_example), length and fresh-sample entropy; temperature and top_p unset: the
  # sampler's.
  # batch_rows: decode slots of the evaluation engine (and rows per entropy pass); its KV
  # cache and logits set evaluation's memory (bench/memory_plan.py).
  # record: questions whose completions each evaluation writes to samples/eval_STEP.jsonl
  # (greedy and sampled; the same questions every time; 0 = none).
  c.eval = config_dict.ConfigDict(dict(every=25, num_examples=1000, samples_per_example=4,
                                       batch_rows=1024,
                                       temperature=config_dict.placeholder(float),
                                       top_p=config_dict.placeholder(float), record=16))
  # Drift monitor: every ``every`` steps (0 = off) score ``num_samples`` buffer items under
  # the current policy: KL(behaviour ‖ current), IS effective sample size, reward by staleness.
  c.drift = config_dict.ConfigDict(dict(every=10, num_samples=256))
  # keep_best: also keep the checkpoint with the best eval/acc_sampled in checkpoints_best/.
  c.checkpoint = config_dict.ConfigDict(dict(every=50, max_to_keep=2, keep_best=True))
  # Device mesh (data, fsdp, tensor); -1 = the remaining devices. Batches and the buffer's
  # capacity axis split over data×fsdp / data; parameters by parallel.sharding.PARAM_RULES.
  # generator_devices W > 0 (with train.mode='async'): each process's last W devices generate
  # on their own mesh (tensor-parallel over generator_tensor) with an inference copy of the
  # weights, and data/fsdp/tensor describe the learner mesh over the rest.
  c.mesh = config_dict.ConfigDict(dict(data=-1, fsdp=1, tensor=1, generator_devices=0,
                                       generator_tensor=1))
  # record_every: learner steps between samples/train_STEP.jsonl files of record_rollouts
  # trained rollouts (text, reward, advantage, staleness, importance ratio); unset = eval.every,
  # 0 = none. progress=False silences every progress bar.
  c.log = config_dict.ConfigDict(dict(progress=True, tensorboard=True,
                                      record_every=config_dict.placeholder(int),
                                      record_rollouts=4))
  # Multi-process jobs (TPU pods, GPU nodes under SLURM, local processes): with
  # initialize=True the entry point calls jax.distributed.initialize with these fields;
  # the unset ones JAX detects from the environment (TPU metadata, SLURM_* variables).
  # Every process runs the same command; process 0 writes the run files. See launch/.
  c.distributed = config_dict.ConfigDict(dict(
      initialize=False,
      coordinator_address="",  # "host:port" of process 0; "" = detect
      num_processes=config_dict.placeholder(int),  # unset = detect
      process_id=config_dict.placeholder(int),  # unset = detect
      # e.g. "0,1"; "" = detect: under SLURM every GPU the task owns (all of the node's with
      # one task per node, its own with --gpus-per-task), elsewhere all local devices
      local_device_ids="",
  ))
  return c

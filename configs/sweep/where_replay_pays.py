"""Where does replay pay? The regime map (issue 27; NOTES.md §4, Thm 4.5, App. 9.3.2)

  python -m jaxreplay.sweep --config configs/sweep/where_replay_pays.py

The theory says whether a replay buffer saves generation depends on three constants: μ
(generating one rollout over training on one sample), α (the gradient noise of an item s
policy versions old grows as σ(s) ∝ s^α) and ρ (the correlation of reused samples). This
sweep measures them in three regimes and, in each, compares on-policy training with two
fixed buffers and the self-tuning buffer (``auto_replay``) at equal generation budgets.

Task and model: the embedded default (``configs/default.py``, reasoning-gym chain_sum, the
4-layer × 128 decoder warm-started on noisy labels), B = 64, G = 8, constant learning
rate after 10 warm-up steps, 6 seeds (0–2 first, 3–5 with the y*(μ) test) — as
``configs/sweep/replay_vs_onpolicy.py``. All regimes share each seed's warm-started policy (the regimes differ in ``algo.lr`` only,
which is not part of the base policy's cache key).

Regimes, chosen because the learning rate sets how much an item's age costs per step
(α, ρ are measured at the parameters the learner is at; a smaller step moves the policy
less between versions, so the theory's x*, y* should rise as the rate falls):
  lr1e-4   today's regime (docs/results.md's sweep): on-policy plateaus from ~step 175;
  lr5e-5   half the rate: staleness should cost less per step;
  lr2e-4   twice the rate: staleness should cost more (3e-4 collapsed in the pilots).
Longer completions and a larger model would move μ, the constant that matters most;
on this 2-core CPU machine neither fits the ~45 min per regime the issue allows.

Per regime, at one generation budget (STEPS·B = 15,360 rollouts: on-policy's 240 steps):
  onpolicy       x = 1, y = 1 (N = R = B);
  fixed A, B     FIFO uniform at (x, y) from FIXED below: A is the theory's (x*, y*) at the
                 constants the self-tuning runs measured in phase 1, rounded
                 (``regime_map.round_design``: y to the nearest power of two, x to whole
                 steps, x >= y); B one more point;
  auto           the self-tuning buffer: starts at (x, y) = (4, 2), re-estimates α, ρ on
                 the buffer every 25 learner steps (128 items, 32 projections: at 256 and
                 128 one estimate took 16–25 s, as long as 20 learner steps), μ from
                 FLOPs (``auto_replay.mu_source``; the archived runs steered by μ from
                 wall time, before the controller stopped reading timers), and sets
                 R in [B/4, B] and the age cut-off x in
                 [1, 8] steps inside a fixed capacity of 8B; it stops when its generation
                 budget is spent (``train.max_generated_rollouts``).
  y grid         (lr5e-5 and lr1e-4 only) FIFO buffers at y = 1, 2, 4 with x = 8, and (2, 2):
                 the pre-registered test of the theory's y*(μ) below.
Evaluations fall every EVAL_EVERY·B generated rollouts for the fixed configurations (every
EVAL_EVERY·y learner steps), every 40 learner steps for ``auto``.

Pre-registered test of the theory's y*(μ) (written 2026-12-04, before any run of the y grid;
``Y_STAR_TEST``): re-score every on-policy and fixed run on the theory's compute axis
C = K_train + μ·K_inf ((B + μR)·T) at μ ∈ MUS and, per μ, find the best y (highest mean AUC
over log C up to on-policy's C) and the y's not shown worse (one-sided paired t, 5%/(n − 1)).
The prediction is the theory's y*(μ) (``theory.power_law_design_bounded``, x ≤ 8, y ≤ 4) at
the constants the archived self-tuning runs measured (median over seeds 0–2: lr5e-5 α = −0.53
→ 0, ρ = 0.17; lr1e-4 α = −0.44 → 0, ρ = 0.90), rounded to the nearest y of {1, 2, 4} on a
log scale: lr5e-5 (1.85, 2.62, 4.00, 4.00) → (2, 2, 4, 4); lr1e-4, the control, where
reused samples are strongly correlated (1.00, 1.40, 2.27, 3.12) → (1, 1, 2, 4). It agrees at
a μ when the predicted y is among the y's not shown worse while the runs exclude some y; and
the theory says the best y does not fall as μ grows. lr2e-4 is not part of the test.

Phases (the sweep runs seeds outermost; ``--only`` picks a phase):
  1. ``--only '_(onpolicy|auto)/'``: on-policy and self-tuning, every regime and seed;
  2. FIXED from phase 1's estimates (``python -m jaxreplay.sweep --report-only`` prints the
     theory's (x*, y*) per regime), then the rest of the grid;
  3. ``--only '^lr5e-5_'``, then ``--only '^lr1e-4_'``: the y grid and seeds 3–5.
"""

from ml_collections import config_dict

B = 64            # train.batch_size, every configuration
G = 8             # rollout.group_size
STEPS = 240       # on-policy learner steps: the generation budget is STEPS·B rollouts
EVAL_EVERY = 20   # on-policy steps between evaluations
REGIMES = {"lr1e-4": 1e-4, "lr5e-5": 5e-5, "lr2e-4": 2e-4}
# (x, y) of fixed A and fixed B per regime. A: the theory's (x*, y*) at phase 1's median
# constants, rounded (``regime_map.round_design``): lr1e-4 (8.00, 1.61), lr5e-5 (8.00,
# 3.85), lr2e-4 (8.00, 4.00) when it was set, with lr5e-5's third seed part-way and lr2e-4's
# not run (the final values, on all seeds, are in docs/results.md: they round the same). B:
# (4, 2), the moderate buffer of configs/sweep/replay_vs_onpolicy.py.
FIXED = {
    "lr1e-4": ((8, 2), (4, 2)),
    "lr5e-5": ((8, 4), (4, 2)),
    "lr2e-4": ((8, 4), (4, 2)),
}


# The y grid of the pre-registered y*(μ) test: (x, y) at x = 8 and (2, 2), beside the regime's
# on-policy run (y = 1) and FIXED; MUS and the predicted nearest y per μ (docstring above).
Y_GRID = ((8, 1), (8, 2), (8, 4), (2, 2))
MUS = (1.0, 2.0, 5.3, 10.0)
Y_STAR_TEST = {
    "lr5e-5": {"predicted": (2, 2, 4, 4)},
    "lr1e-4": {"predicted": (1, 1, 2, 4)},   # the control regime
}


def fifo(x: int, y: int, **extra) -> dict:
  """Overrides of a FIFO buffer at horizon x = N/R and replay ratio y = B/R, equal generation."""
  r = B // y
  return {"rollout.per_step": r, "buffer.capacity": x * r, "train.steps": y * STEPS,
          "eval.every": y * EVAL_EVERY, "checkpoint.every": 2 * y * EVAL_EVERY, **extra}


def auto() -> dict:
  """Overrides of the self-tuning buffer (``auto_replay``) at the same generation budget."""
  y_max = 4
  return {
      "rollout.per_step": B // 2, "buffer.capacity": 8 * B, "buffer.max_staleness": 3,
      "train.steps": y_max * STEPS, "train.max_generated_rollouts": STEPS * B,
      "eval.every": 2 * EVAL_EVERY, "checkpoint.every": 4 * EVAL_EVERY,
      "auto_replay.enabled": True, "auto_replay.every": 25, "auto_replay.warmup": 2,
      "auto_replay.num_samples": 128, "auto_replay.num_projections": 32,
      "auto_replay.x_min": 1.0, "auto_replay.x_max": 8.0,
      "auto_replay.y_min": 1.0, "auto_replay.y_max": float(y_max),
      "auto_replay.mu_source": "flops",
  }


def get_config():
  c = config_dict.ConfigDict()
  c.base_config = "configs/default.py"
  c.workdir = "runs/sweep/where_replay_pays"
  c.seeds = (0, 1, 2, 3, 4, 5)
  c.base_overrides = config_dict.ConfigDict({
      "train.batch_size": B,
      "rollout.group_size": G,
      "algo.lr_schedule": "constant",
      "eval.num_examples": 400,          # of the ~740 held-out examples
      "eval.samples_per_example": 4,
      "drift.every": 0,
      "checkpoint.keep_best": False,
      "log.progress": False,
      "log.tensorboard": False,
  }, allow_dotted_keys=True)
  configs = []
  for regime, lr in REGIMES.items():
    lr_o = {"algo.lr": lr}
    (xa, ya), (xb, yb) = FIXED[regime]
    configs += [
        dict(name=f"{regime}_onpolicy", family="on-policy", regime=regime, role="onpolicy",
             overrides={**fifo(1, 1), **lr_o}),
        dict(name=f"{regime}_fixed_x{xa}_y{ya}", family="fixed A", regime=regime,
             role="fixed", overrides={**fifo(xa, ya), **lr_o}),
        dict(name=f"{regime}_fixed_x{xb}_y{yb}", family="fixed B", regime=regime,
             role="fixed", overrides={**fifo(xb, yb), **lr_o}),
    ]
    if regime in Y_STAR_TEST:
      configs += [dict(name=f"{regime}_fixed_x{x}_y{y}", family="y grid", regime=regime,
                       role="fixed", overrides={**fifo(x, y), **lr_o})
                  for x, y in Y_GRID if (x, y) not in FIXED[regime]]
    configs.append(dict(name=f"{regime}_auto", family="self-tuning", regime=regime,
                        role="auto", overrides={**auto(), **lr_o}))
  c.configurations = configs
  c.report = config_dict.ConfigDict(dict(
      kind="regime_map",
      title="Where replay pays: three regimes of the embedded task (B = 64)",
      results_md="docs/results.md",
      target_last=3,   # a run's final accuracy: the mean of its last 3 evaluations
      # simulated studies per rate: a Bonferroni rule's true rate sits just under 5%, and
      # 4000 draws (SE 0.0034) put it above in some regimes by chance; 20000: SE 0.0015
      null_sims=20000,
      x_bounds=(1.0, 8.0), y_bounds=(1.0, 4.0),
      y_star_mus=MUS,
      # evaluation noise at fixed parameters: bench/eval_noise.py --run lr5e-5_onpolicy
      eval_noise="data/sweeps/where_replay_pays.eval_noise.json",
      y_star_test={k: {"predicted": v["predicted"]} for k, v in Y_STAR_TEST.items()},
  ))
  return c

"""Advantage estimators, off-policy policy-gradient losses and the jitted train step.

spec         AlgoSpec, the validated ``algo`` config section, and the names it accepts
             (imports neither jax, flax nor optax)
advantages   group estimators (grpo, dr_grpo, rloo) at generation time; GAE over tokens
losses       ppo_clip, tis, decoupled, gspo, asymre, reinforce; KL k1/k2/k3; aggregation
weights      PER sampling weights, staleness factor, staleness-adaptive trust region
value        value head on the policy's hidden states, clipped value loss
diagnostics  ratio/clip/KL/entropy/ESS metrics, overall and per staleness bucket
update       TrainState, objective, train_step
"""

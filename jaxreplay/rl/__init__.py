"""Advantage estimators, off-policy policy-gradient losses and the jitted train step.

spec         AlgoSpec, the validated ``algo`` config section, and the names it accepts
             (imports neither jax, flax nor optax)
advantages   group estimators (grpo, dr_grpo, rloo) at generation time; GAE over tokens
losses       ppo_clip, tis, decoupled, gspo, asymre, reinforce (one contract,
             ``POLICY_LOSSES``); KL k1/k2/k3; aggregation
weights      PER sampling weights, staleness factor, staleness-adaptive trust region
value        value head on the policy's hidden states, clipped value loss
scoring      per-token log-probs, entropy and values of stored rollouts under a policy
objective    the learner loss from per-token outputs; GAE advantages of the learner step
diagnostics  ratio/clip/KL/entropy/ESS metrics, overall and per staleness bucket
train_step   TrainState, the optimizer, the jitted train step

The package imports no submodule, so ``import jaxreplay.rl.spec`` stays free of jax.
"""

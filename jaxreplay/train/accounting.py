"""Compute accounting: where generated tokens go, FLOPs of each phase, μ and γ.

The paper's cost model (Arnal et al. 2026, §3 and §4): training on one sequence costs
1 unit, generating one rollout costs μ units, and a run that trains on B sequences and
generates R rollouts per learner step pays c = B + μR per step. With W inference workers
per T trainers the per-update cost relative to on-policy training without a buffer is
γ = (1 + W/T)/(1 + μ) (eq. 2).

On one host there are no separate workers: the W/T split is *emulated* by how many
rollouts are generated per learner step. Holding the replay ratio ρ = B/R (samples per
insert) while generation takes μ units per rollout needs W/T = μR/B = μ/ρ (§4, "mapping
to the async setup"), which is what ``emulated_w_over_t`` reports.

FLOPs are a property of the run, not of the machine: they depend on the model's shapes
and on the tokens the run actually generated and trained, never on load or clock speed,
so ``mu_flops`` (or a configured μ) is what the self-tuning controller steers by
(``train.self_tuning``).
Counts follow Kaplan et al. 2020 (arXiv 2001.08361, Table 1: 2·N FLOPs per token for
the matmuls of N parameters) and Hoffmann et al. 2022 (Chinchilla, App. F) / Chowdhery
et al. 2022 (PaLM, App. B), which count both attention products, Q·Kᵀ and the weighted
sum of V: 2·2·L·H·D_h·c FLOPs per token at context length c; Kaplan's table keeps only
the first. Forward + backward is 3× forward. These are useful FLOPs: padding, compute
rematerialised in the backward pass and early-stopped decode rows are not counted, and
neither are softmax, norms or the host's reward calls. On accelerators decoding is
memory-bound, so the seconds of a generated rollout exceed its FLOP share: FLOP μ is
the compute-bound floor (≈ 1/3 with one pass over each trained sample and no rescoring),
not the wall-time μ of any one machine (the paper's μ ≈ 5.3 is a ratio of GPU throughputs).
All functions are pure and work on Python/NumPy numbers or traced ``jnp`` arrays.
"""

from __future__ import annotations

import dataclasses

import jax
import jax.numpy as jnp

from jaxreplay import theory


@dataclasses.dataclass(frozen=True)
class ModelCost:
  """What the FLOP estimate needs of a decoder.

  Attributes:
    n_params: parameters that take part in a matmul per token (all parameters, less the
      input embedding table of an untied model, whose lookup is free).
    n_layers: L. n_heads: H (query heads). head_dim: D_h.
  """

  n_params: int
  n_layers: int
  n_heads: int
  head_dim: int

  @classmethod
  def from_params(cls, params, model_cfg) -> "ModelCost":
    """From an ``nnx.State`` of parameters and the policy's ``TransformerConfig``.

    Args:
      params: pytree of arrays. model_cfg: has ``vocab_size``, ``d_model``, ``n_layers``,
        ``n_heads``, ``head_dim`` and ``tie_embeddings``.
    """
    total = sum(int(x.size) for x in jax.tree.leaves(params))
    if not model_cfg.tie_embeddings:
      total -= int(model_cfg.vocab_size) * int(model_cfg.d_model)
    return cls(n_params=total, n_layers=int(model_cfg.n_layers),
               n_heads=int(model_cfg.n_heads), head_dim=int(model_cfg.head_dim))


def forward_flops_causal(cost: ModelCost, length):
  """FLOPs of one forward pass over a causal sequence of ``length`` tokens.

  Position c (1-based) attends to c tokens, so the total is
  Σ_{c=1}^{S} (2N + 4·L·H·D_h·c) = 2N·S + 2·L·H·D_h·S(S+1) (module docstring: Kaplan et
  al. 2020, Table 1; Chinchilla App. F for the two attention products).

  Args:
    cost: the model. length: S >= 0 real tokens, int or int array (any shape).

  Returns:
    float FLOPs, the shape of ``length`` (float64 in NumPy, float32 under jit).
  """
  s = length * 1.0
  return 2.0 * cost.n_params * s + 2.0 * cost.n_layers * cost.n_heads * cost.head_dim * s * (s + 1)


def generation_flops(cost: ModelCost, prompt_len, completion_len, forwards=0):
  """FLOPs of producing one rollout: sampling it with a KV cache, then ``forwards`` scoring
  passes over it (forward only).

  Sampling prefills the prompt and feeds each completion token but the last back once, so
  positions 1 .. P + m − 1 each run one forward step: ``forward_flops_causal(P + m − 1)``.
  A scoring pass (the learner's rescoring of the behaviour log-probs,
  ``rollout.behaviour_logprobs='learner'``; the reference's for the KL reward penalty,
  ``algo.kl_mode='reward'``) is one full forward over the P + m tokens.

  Args:
    cost: the model. prompt_len: P real prompt tokens. completion_len: m >= 1 generated
      tokens (ints or arrays). forwards: scoring passes per rollout (int >= 0).

  Returns:
    float FLOPs per rollout, the broadcast shape of the inputs.
  """
  return (forward_flops_causal(cost, prompt_len + completion_len - 1)
          + forwards * forward_flops_causal(cost, prompt_len + completion_len))


def training_flops(cost: ModelCost, prompt_len, completion_len, epochs: int = 1,
                   forwards=0):
  """FLOPs of one learner step's work on one drawn sequence: ``epochs`` forward + backward
  passes (3 × forward each; Kaplan et al. 2020 §2.1, PaLM App. B) and ``forwards``
  gradient-free passes (``learner_forwards``).

  Args:
    cost: the model. prompt_len: P real prompt tokens. completion_len: m (ints or arrays).
    epochs: passes over the batch per learner step (``algo.update_epochs``).
    forwards: gradient-free forward passes per sequence per learner step.

  Returns:
    float FLOPs per trained sequence, the broadcast shape of the inputs.
  """
  return (3.0 * epochs + forwards) * forward_flops_causal(cost, prompt_len + completion_len)


def learner_forwards(algo) -> int:
  """Gradient-free forward passes the learner step makes per drawn sequence, besides its
  ``update_epochs`` forward + backward passes (``rl.train_step.make_train_step``).

  One for the frozen reference's log-probs (``algo.kl_coef`` > 0); one for the proximal
  log-probs / start values when a step takes several optimizer steps with the decoupled
  loss or a value head; and, with a value head and ``grad_accum_steps`` > 1, one per epoch
  for the values the whole minibatch's GAE needs before its micro-batches
  (``make_grad_fn``).

  Args:
    algo: ``rl.spec.AlgoSpec``.

  Returns:
    int >= 0.
  """
  n = int(algo.uses_reference)
  if algo.updates_per_step > 1 and (algo.loss == "decoupled" or algo.uses_value_head):
    n += 1
  if algo.uses_value_head and algo.grad_accum_steps > 1:
    n += algo.update_epochs
  return n


def design_mu(cost: ModelCost, prompt_len, completion_len, *, generation_forwards: int = 0,
              epochs: int = 1, training_forwards: int = 0) -> float:
  """FLOP μ of rollouts of one length, before any run: ``generation_flops`` over
  ``training_flops`` of the same sequence (what ``mu`` of a run's ledger gives when every
  rollout has these lengths).

  Args:
    cost: the model. prompt_len: P. completion_len: m >= 1 (ints).
    generation_forwards, epochs, training_forwards: as ``generation_flops`` (``forwards``)
      and ``training_flops``.

  Returns:
    float μ (unitless).
  """
  return float(generation_flops(cost, prompt_len, completion_len, generation_forwards)
               / training_flops(cost, prompt_len, completion_len, epochs, training_forwards))


def mu(generation_cost: float, generated_rollouts: int, training_cost: float,
       trained_sequences: int) -> float:
  """μ = (cost per generated rollout) / (cost per trained sequence) (paper §3, App. 10.4).

  Costs in any one unit (seconds of a phase, or FLOPs). Trained sequences count reuse
  (K_train = steps × B in the paper).

  Returns:
    float μ, or NaN when any count or the training cost is 0.
  """
  if generated_rollouts <= 0 or trained_sequences <= 0 or training_cost <= 0:
    return float("nan")
  return (generation_cost / generated_rollouts) / (training_cost / trained_sequences)


def emulated_w_over_t(mu_value: float, replay_ratio: float) -> float:
  """The W/T a one-host run emulates: W/T = μ/ρ = μ·R/B (paper §4, mapping to async).

  Args:
    mu_value: μ. replay_ratio: ρ = trained sequences / generated rollouts.

  Returns:
    float W/T, NaN when either input is not a positive number.
  """
  if not (mu_value > 0 and replay_ratio > 0):
    return float("nan")
  return mu_value / replay_ratio


def gamma(mu_value: float, replay_ratio: float) -> float:
  """γ = (1 + W/T)/(1 + μ) with W/T = μ/ρ (paper eq. 2): per-update cost vs on-policy.

  Equals (B + μR)/(B(1 + μ)), the theory's per-step cost c = B + μR over the
  on-policy cost (N = R = B). NaN when μ or ρ is not positive.
  """
  w = emulated_w_over_t(mu_value, replay_ratio)
  return float("nan") if w != w else theory.compute_ratio(w, mu_value)


def unused_overwritten(buffer, n: int):
  """Rollouts and completion tokens that ``replay.add`` of ``n`` items will overwrite
  before they were ever sampled (valid, ``times_sampled == 0``): generation wasted.

  Call before the add (jittable; ``n`` static). Slots ``write_index .. write_index+n−1``
  modulo C are the ones ``add`` writes when n <= C.

  Args:
    buffer: ``replay.BufferState`` whose items have ``completion_mask`` [C, T] bool.
    n: items about to be added (<= C).

  Returns:
    (rollouts int32 scalar, tokens int32 scalar).
  """
  c = buffer.valid.shape[0]
  idx = (buffer.write_index + jnp.arange(min(n, c), dtype=jnp.int32)) % c
  lost = buffer.valid[idx] & (buffer.times_sampled[idx] == 0)
  toks = buffer.items.completion_mask[idx].sum(-1, dtype=jnp.int32)
  return lost.sum(dtype=jnp.int32), jnp.where(lost, toks, 0).sum(dtype=jnp.int32)


def unused_in_buffer(buffer):
  """(rollouts, tokens) int32 scalars now in the buffer and never sampled (jittable)."""
  lost = buffer.valid & (buffer.times_sampled == 0)
  toks = buffer.items.completion_mask.sum(-1, dtype=jnp.int32)
  return lost.sum(dtype=jnp.int32), jnp.where(lost, toks, 0).sum(dtype=jnp.int32)


def summarize(counts: dict, timers: dict) -> dict:
  """The derived ledger entries of a run so far, from its running counters.

  Args:
    counts: the loop's counters — ``generated_rollouts``, ``trained_samples``,
      ``generation_flops``, ``training_flops`` (floats, FLOPs).
    timers: ``generate_s`` and ``train_s`` (seconds of each phase).

  Returns:
    dict of floats: ``replay_ratio`` ρ, ``mu_flops``, ``w_over_t_flops`` (emulated, see
    ``emulated_w_over_t``), ``gamma_flops``, and the same three from measured phase time
    (``mu_time``, ``w_over_t_time``, ``gamma_time``).
  """
  n_gen, n_train = counts["generated_rollouts"], counts["trained_samples"]
  rho = n_train / n_gen if n_gen else float("nan")
  out = {"replay_ratio": rho}
  for tag, g, t in (("flops", counts["generation_flops"], counts["training_flops"]),
                    ("time", timers["generate_s"], timers["train_s"])):
    m = mu(g, n_gen, t, n_train)
    out.update({f"mu_{tag}": m, f"w_over_t_{tag}": emulated_w_over_t(m, rho),
                f"gamma_{tag}": gamma(m, rho)})
  return out

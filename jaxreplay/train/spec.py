"""The trainer's config sections: rollout, train, warmstart, eval, drift, checkpoint, log.

The paper's knobs (Arnal et al. 2026, §4): rollouts per learner step R =
``RolloutSpec.per_step``, group size G = ``RolloutSpec.group_size``, batch size B =
``TrainSpec.batch_size`` (the buffer's capacity N is ``buffer.capacity``). Imports nothing
heavy: ``jaxreplay.config.validate`` builds these before any compute.
"""

from __future__ import annotations

import dataclasses
from typing import ClassVar

from jaxreplay.spec import Spec, field

BEHAVIOUR_LOGPROBS = ("sampler", "learner")
MODES = ("sync", "simulated_async", "async")


@dataclasses.dataclass(frozen=True)
class RolloutSpec(Spec):
  """The ``rollout`` section: what one generation round produces.

  Attributes:
    per_step: R >= 1, rollouts generated per learner step (a multiple of group_size).
    group_size: G >= 1, completions sampled per prompt (a GRPO group).
    behaviour_logprobs: where the stored behaviour log-probs come from, one of
      ``BEHAVIOUR_LOGPROBS``: ``sampler`` (the sampler's own) or ``learner`` (the completions
      rescored by the learner's forward before insertion, so a fresh rollout's ratio is
      exactly 1 in bfloat16 too).
  """

  SECTION: ClassVar[str] = "rollout"

  per_step: int = field(128, ge=1, allowed="(a multiple of group_size)")
  group_size: int = field(8, ge=1)
  behaviour_logprobs: str = field("sampler", choices=BEHAVIOUR_LOGPROBS)

  def check(self):
    """Raises ``ConfigError`` when R is not a multiple of G."""
    if self.per_step % self.group_size:
      self.fail("per_step", self.per_step,
                f"must be a positive multiple of rollout.group_size={self.group_size}")

  @property
  def prompts_per_step(self) -> int:
    """P = R / G prompts per generation round."""
    return self.per_step // self.group_size


@dataclasses.dataclass(frozen=True)
class TrainSpec(Spec):
  """The ``train`` section: how long, how large a batch, which strategy.

  Attributes:
    steps: >= 0 learner steps of the run.
    batch_size: B >= 1, items drawn from the buffer per learner step.
    mode: the strategy, one of ``MODES``: ``sync`` (generate with the current policy, then
      train: the paper's theory model), ``simulated_async`` (deterministic; generate with
      the policy of exactly ``lag`` learner steps ago) or ``async`` (a generator thread with
      its own weights, paced by the rate limiter; not bit-reproducible).
    lag: >= 0 learner steps between the learner and the generating policy in
      ``simulated_async``.
    weight_sync_every: >= 1 learner steps between weight refreshes of the ``async``
      generator.
    async_timeout_s: > 0 seconds the ``async`` learner waits for a batch before it fails.
    max_generated_rollouts: >= 0 generation budget in rollouts (0: none): the run ends after
      the first learner step at which the ledger's ``generated_rollouts`` reach it, or at
      ``steps``, whichever comes first — equal-generation comparisons of runs whose R
      changes (``auto_replay``). The lagged strategy only (``sync``, ``simulated_async``).
    compilation_cache_dir: JAX's persistent compilation cache, set by the entry point
      (``python -m jaxreplay.main``) before anything compiles: a directory (``~`` expanded)
      or a URL; "" = off. A restart, a resumed run or the next run of the same shapes loads
      its programs instead of compiling them again (the decode engine alone compiles a
      program per slot-count and attention-width bucket). ``JAX_COMPILATION_CACHE_DIR``, when
      set, wins.
    compile_cost_steps: >= 0, what compiling one packed learner shape costs, in learner
      steps of that shape's work (0 = compile every batch's own shape). A batch whose
      packed shape (``packing.PlanShape``) is not compiled runs in the cheapest compiled
      larger shape it fits, with more empty slots, until the work so wasted for its shape
      would reach this many steps; that batch compiles its own (ski rental,
      ``train.shape_reuse``). On a CPU, where a 135M-parameter learner shape compiles in
      about three of its steps, it stops the recompilation at nearly every step while
      completions shorten (docs/performance.md). A resumed run starts with no compiled
      shapes, so its packing (and float rounding) may differ from the uninterrupted run's.
    device_memory_fraction: in [0, 1), the fraction of each GPU's memory JAX's allocator
      takes when the process starts, set by the entry point before the backend starts
      (``XLA_PYTHON_CLIENT_MEM_FRACTION``); 0 leaves JAX's default (0.75). A preset whose
      memory plan (``bench/memory_plan.py``) needs more of the device than 0.75 sets it.
      ``XLA_PYTHON_CLIENT_MEM_FRACTION``, when set, wins; CPUs and TPUs ignore it.
  """

  SECTION: ClassVar[str] = "train"

  steps: int = field(200, ge=0)
  batch_size: int = field(256, ge=1)
  mode: str = field("sync", choices=MODES)
  lag: int = field(1, ge=0)
  weight_sync_every: int = field(1, ge=1)
  async_timeout_s: float = field(600.0, gt=0)
  max_generated_rollouts: int = field(0, ge=0)
  compilation_cache_dir: str = field("~/.cache/jaxreplay/xla")
  compile_cost_steps: float = field(0.0, ge=0, allowed="(0 = always compile)")
  device_memory_fraction: float = field(0.0, ge=0, lt=1, allowed="(0 = JAX's default)")

  def budget_reached(self, generated_rollouts: int) -> bool:
    """Whether ``generated_rollouts`` (the ledger's count) exhaust the generation budget
    ``max_generated_rollouts`` (never when it is 0)."""
    return 0 < self.max_generated_rollouts <= int(generated_rollouts)

  @property
  def policy_lag(self) -> int:
    """Policy versions between the learner and the generating policy in the lagged modes:
    0 for ``sync``, ``lag`` for ``simulated_async`` (``async``: 0, its lag is timing)."""
    return self.lag if self.mode == "simulated_async" else 0

  @property
  def is_async(self) -> bool:
    """The actor–learner strategy (``mode='async'``)."""
    return self.mode == "async"


@dataclasses.dataclass(frozen=True)
class WarmstartSpec(Spec):
  """The ``warmstart`` section: supervised warm start of the built-in policy on noisy labels.

  The base policy puts real mass on wrong answers, which the verifiable reward then
  corrects. Only ``model.source='builtin'`` uses it.

  Attributes:
    steps: >= 0 supervised steps.
    batch_size: >= 1 sequences per supervised step.
    lr: > 0, the peak learning rate of the warm start.
    warmup_steps: >= 0 steps of linear warmup.
    label_noise: in [0, 1], the probability that a training answer is replaced by a wrong one.
    cache_dir: where base policies are cached, keyed by the fields that determine them.
  """

  SECTION: ClassVar[str] = "warmstart"

  steps: int = field(600, ge=0)
  batch_size: int = field(128, ge=1)
  lr: float = field(2e-3, gt=0)
  warmup_steps: int = field(50, ge=0)
  label_noise: float = field(0.3, ge=0, le=1)
  cache_dir: str = field("runs/base_policies")


@dataclasses.dataclass(frozen=True)
class EvalSpec(Spec):
  """The ``eval`` section: held-out greedy and sampled accuracy, pass@k, length, entropy.

  Attributes:
    every: >= 0 learner steps between evaluations (0 = only before and after the run).
    num_examples: >= 1 held-out examples scored.
    samples_per_example: >= 1 sampled completions per example (pass@k for k = 1, 2, 4, ...).
    batch_rows: >= 1 decode slots of the evaluation engine (and rows per entropy pass); its
      KV cache and logits set evaluation's memory.
    temperature: > 0, the sampled evaluation's temperature (None = sampler.temperature).
    top_p: in (0, 1], the sampled evaluation's top-p (None = sampler.top_p).
    record: >= 0 held-out questions whose completions (greedy and sampled) every evaluation
      writes to ``WORKDIR/samples/eval_STEP.jsonl`` (0 = none): the same questions every
      time, drawn once from the first ``num_examples`` with the run's seed (at most
      ``num_examples``).
  """

  SECTION: ClassVar[str] = "eval"

  every: int = field(25, ge=0)
  num_examples: int = field(1000, ge=1)
  samples_per_example: int = field(4, ge=1)
  batch_rows: int = field(1024, ge=1)
  temperature: float | None = field(None, gt=0)
  top_p: float | None = field(None, gt=0, le=1)
  record: int = field(16, ge=0)


@dataclasses.dataclass(frozen=True)
class DriftSpec(Spec):
  """The ``drift`` section: the drift monitor.

  Attributes:
    every: >= 0 learner steps between passes (0 = off); each scores num_samples buffer items
      under the current policy: KL(behaviour ‖ current), IS effective sample size, reward
      by staleness.
    num_samples: >= 1 buffer items scored per pass.
  """

  SECTION: ClassVar[str] = "drift"

  every: int = field(10, ge=0)
  num_samples: int = field(256, ge=1)


@dataclasses.dataclass(frozen=True)
class CheckpointSpec(Spec):
  """The ``checkpoint`` section (Orbax).

  Attributes:
    every: >= 0 learner steps between checkpoints (0 = none; the last step is always saved
      when > 0).
    max_to_keep: >= 1 latest checkpoints kept.
    keep_best: also keep the checkpoint with the best eval/acc_sampled in checkpoints_best/.
  """

  SECTION: ClassVar[str] = "checkpoint"

  every: int = field(50, ge=0)
  max_to_keep: int = field(2, ge=1)
  keep_best: bool = field(True)


@dataclasses.dataclass(frozen=True)
class LogSpec(Spec):
  """The ``log`` section.

  Attributes:
    progress: show tqdm progress bars (training steps, model load, warm start, each
      evaluation, blocking checkpoint saves); False silences all of them (CI, SLURM logs).
    tensorboard: also write TensorBoard event files (tensorboardX) beside the metrics/ files.
    record_every: >= 0 learner steps between ``WORKDIR/samples/train_STEP.jsonl`` files of
      rollouts the learner trained on (None = ``eval.every``; 0 = none).
    record_rollouts: >= 1 rollouts per ``train_STEP.jsonl`` (at most ``train.batch_size``):
      the first rows of that step's batch.
  """

  SECTION: ClassVar[str] = "log"

  progress: bool = field(True)
  tensorboard: bool = field(True)
  record_every: int | None = field(None, ge=0)
  record_rollouts: int = field(4, ge=1)

  def record_interval(self, eval_every: int) -> int:
    """Learner steps between ``train_STEP.jsonl`` files: ``record_every``, or
    ``eval_every`` when unset (0 = none)."""
    return eval_every if self.record_every is None else self.record_every

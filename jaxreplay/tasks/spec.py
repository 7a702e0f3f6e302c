"""The ``task`` section: its choices and the check that every option is honoured by the
chosen source or refused. Imports nothing heavy (no reasoning-gym, math-verify or jax), so
``jaxreplay.config.validate`` runs it before any compute.

Which option applies to which source:

| option | reasoning_gym | jsonl / parquet |
|---|---|---|
| ``name``, ``kwargs`` | the dataset and its options | must be ``""`` / ``{}`` |
| ``train_path``, ``heldout_path`` | must be ``""`` | the two splits, each a file or a glob (both required) |
| ``format`` | must be ``"plain"`` | ``plain``, ``gsm8k`` or ``math``: how the gold is read |
| ``question_field``, ``answer_field`` | must be ``""`` | column names (``""``: the format's) |
| ``solution_field`` | must be ``""`` | ``format='math'`` only (``""``: ``solution``) |
| ``seed``, ``train_size``, ``heldout_size`` | generator seed and sizes | a seeded subset of at most that many rows per split |
| ``prompt_template`` | over ``question`` and the item's metadata | over ``question`` and the row's columns |
| ``answer_extraction`` | ``bare``: the dataset's scorer; ``math``, ``boxed``: math-verify | ``bare``: exact match; ``math``, ``boxed``: math-verify |
| ``chat_template``, ``system_prompt``, ``prompt_width``, ``on_too_long`` | the prompt's encoding (any source) | same |
| ``reward_timeout_s``, ``reward_workers`` | how rewards are scored (any source) | same |
"""

from __future__ import annotations

import dataclasses
from typing import Any, ClassVar

from jaxreplay.spec import Spec, fail, field

SOURCES = ("reasoning_gym", "jsonl", "parquet")
FILE_SOURCES = ("jsonl", "parquet")
FORMATS = ("plain", "gsm8k", "math")
ANSWER_EXTRACTIONS = ("bare", "math", "boxed")
# The extractions graded by math-verify: their evaluations are also graded strictly and
# leniently (``train.evaluate``), and they need a worker pool.
MATH_EXTRACTIONS = ("math", "boxed")
ON_TOO_LONG = ("truncate_left", "skip")
# Column names of each file format when the config leaves them "" (GSM8K: question/answer;
# MATH and OpenR1-Math: problem/solution, and OpenR1's answer column).
DEFAULT_FIELDS = {
    "plain": {"question": "question", "answer": "answer"},
    "gsm8k": {"question": "question", "answer": "answer"},
    "math": {"question": "problem", "answer": "answer", "solution": "solution"},
}
FIELD_OPTIONS = ("question_field", "answer_field", "solution_field")


@dataclasses.dataclass(frozen=True)
class TaskSpec(Spec):
  """The ``task`` section: the prompts, their gold answers and how completions are scored.

  Attributes:
    source: where items come from, one of ``SOURCES``: ``reasoning_gym`` (generated
      offline) or ``jsonl`` / ``parquet`` files.
    name: the reasoning-gym dataset ("" for file sources).
    seed: the generator's seed (reasoning_gym) or the subset's seed (files).
    train_size: >= 1 items of the train split (files: a seeded subset of at most this many).
    heldout_size: >= 1 items of the held-out split, before deduplication against train.
    kwargs: the reasoning-gym dataset's options ({} for file sources).
    prompt_template: the prompt, formatted over ``question`` and the item's fields.
    train_path: the train split's file or glob (file sources; "" otherwise).
    heldout_path: the held-out split's file or glob (file sources; "" otherwise).
    prompt_width: P >= 2 prompt tokens, <bos> included (longer prompts: on_too_long).
    on_too_long: what happens to a longer prompt, one of ``ON_TOO_LONG``.
    reward_timeout_s: >= 0 seconds a reward call may run before it scores 0 and is counted
      (0 = no limit).
    answer_extraction: how the answer is read, one of ``ANSWER_EXTRACTIONS``: ``bare`` (the
      completion is the answer), ``math`` (the stated answer by ``math_answer``'s rules,
      math-verify) or ``boxed`` (only the last ``\\boxed{}``, math-verify: the strict
      grade). With ``math`` and ``boxed`` each evaluation is also graded strictly and
      leniently (``train.evaluate``).
    chat_template: wrap prompts in the checkpoint's chat template (model.source='hf').
    system_prompt: a system turn of the chat template ("" = none).
    format: how a file's gold is read, one of ``FORMATS`` (plain, gsm8k ``####``, math boxed).
    question_field: the question's column ("" = the format's).
    answer_field: the answer's column ("" = the format's).
    solution_field: the solution's column of ``format='math'`` ("" = ``solution``).
    reward_workers: >= 0 worker processes scoring rewards (0 = in this process, for scorers
      that cannot hang).
  """

  SECTION: ClassVar[str] = "task"

  source: str = field("reasoning_gym", choices=SOURCES)
  name: str = field("chain_sum")
  seed: int = field(1234)
  train_size: int = field(20000, ge=1)
  heldout_size: int = field(2000, ge=1)
  kwargs: dict = field(dict(min_terms=2, max_terms=4, min_digits=1, max_digits=1))
  prompt_template: str = field("{expression} =")
  train_path: str = field("")
  heldout_path: str = field("")
  prompt_width: int = field(16, ge=2)
  on_too_long: str = field("truncate_left", choices=ON_TOO_LONG)
  reward_timeout_s: float = field(5.0, ge=0, allowed="(0 = no limit)")
  answer_extraction: str = field("bare", choices=ANSWER_EXTRACTIONS)
  chat_template: bool = field(False)
  system_prompt: str = field("")
  format: str = field("plain", choices=FORMATS)
  question_field: str = field("")
  answer_field: str = field("")
  solution_field: str = field("")
  reward_workers: int = field(0, ge=0)

  __hash__ = None  # kwargs is a dict; the spec is never a static argument of a jit

  def check(self):
    """Every option is honoured by the chosen source or refused.

    Raises:
      ConfigError: ``"task.FIELD=VALUE is invalid: what is allowed"`` for an option the
        chosen source would ignore, or a combination that cannot run.
    """
    _check_task(self)

  def check_files(self) -> None:
    """Requires that a file source's paths match files (local, or URLs such as ``gs://``).

    Raises:
      FileNotFoundError: a path or glob that matches nothing.
    """
    if self.source in FILE_SOURCES:
      from jaxreplay import storage
      for f in ("train_path", "heldout_path"):
        if not storage.glob(getattr(self, f)):
          raise FileNotFoundError(f"task.{f}={getattr(self, f)!r}: no such file (a path or a "
                                  "glob pattern such as data/openr1/train-*.parquet)")


def _fail(name: str, value: Any, allowed: str):
  fail("task", name, value, allowed)


def field_names(task: TaskSpec | Any) -> dict[str, str]:
  """The column names a file source reads: the format's defaults overridden by the
  non-empty ``task.question_field`` / ``answer_field`` / ``solution_field``.

  Args:
    task: the ``TaskSpec``, or a mapping with ``format`` and (optionally) the ``*_field``
      options.

  Returns:
    {"question": ..., "answer": ...} plus "solution" for ``format='math'``.
  """
  get = ((lambda k, d: getattr(task, k)) if isinstance(task, TaskSpec)
         else (lambda k, d: task.get(k, d)))
  names = dict(DEFAULT_FIELDS[get("format", "plain")])
  for key in names:
    if get(f"{key}_field", ""):
      names[key] = get(f"{key}_field", "")
  return names


def validate_task(task, check_files: bool = True) -> TaskSpec:
  """The validated ``TaskSpec`` of a ``task`` section.

  Args:
    task: the ``task`` ConfigDict, a dict, or a ``TaskSpec``.
    check_files: also require that the file sources' paths exist.

  Returns:
    The ``TaskSpec``.

  Raises:
    ConfigError: ``"task.FIELD=VALUE is invalid: what is allowed"`` (one line) for a value
      out of range, not among the choices, or an option the chosen source would ignore.
    FileNotFoundError: a file source's path does not exist (``check_files``).
  """
  spec = TaskSpec.from_config(task)
  if check_files:
    spec.check_files()
  return spec


def _check_task(cfg: TaskSpec) -> None:
  """The rules of ``TaskSpec.check``."""
  fmt = cfg.format
  extraction = cfg.answer_extraction
  source = cfg.source
  if source == "reasoning_gym":
    for f in ("train_path", "heldout_path") + FIELD_OPTIONS:
      if getattr(cfg, f):
        _fail(f, getattr(cfg, f), "is for task.source in ('jsonl', 'parquet'); reasoning_gym "
              "generates its items: set it to ''")
    if fmt != "plain":
      _fail("format", fmt, "is for task.source in ('jsonl', 'parquet'); reasoning_gym items "
            "carry their gold answer: set it to 'plain'")
  else:
    if cfg.name:
      _fail("name", cfg.name, f"names a reasoning-gym dataset; task.source={source!r} reads "
            "task.train_path and task.heldout_path: set it to ''")
    if cfg.kwargs:
      _fail("kwargs", dict(cfg.kwargs), f"are reasoning-gym dataset options; task.source="
            f"{source!r} has none: set task.kwargs = {{}} in the config file (configs/gsm8k.py "
            "and configs/math.py do)")
    if cfg.solution_field and fmt != "math":
      _fail("solution_field", cfg.solution_field, f"is read only with task.format='math' "
            f"(task.format={fmt!r})")
    for f in ("train_path", "heldout_path"):
      if not getattr(cfg, f):
        _fail(f, getattr(cfg, f), f"task.source={source!r} needs both task.train_path and "
              "task.heldout_path")
  timeout = cfg.reward_timeout_s
  workers = cfg.reward_workers
  if workers == 0 and extraction in MATH_EXTRACTIONS:
    _fail("reward_workers", 0, f"task.answer_extraction={extraction!r} needs a process pool "
          "(>= 1): math-verify and sympy can hang in C code that no thread or signal can stop")
  if workers > 0 and not timeout > 0:
    _fail("reward_timeout_s", timeout, f"must be > 0 with task.reward_workers={workers}: the "
          "timeout is what replaces a stuck worker")
  if cfg.system_prompt and not cfg.chat_template:
    _fail("system_prompt", cfg.system_prompt, "is a turn of the chat template: it needs "
          "task.chat_template=True")

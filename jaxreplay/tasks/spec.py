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
| ``answer_extraction`` | ``bare``: the dataset's scorer; ``math``: math-verify | ``bare``: exact match; ``math``: math-verify |
| ``chat_template``, ``system_prompt``, ``prompt_width``, ``on_too_long`` | the prompt's encoding (any source) | same |
| ``reward_timeout_s``, ``reward_workers`` | how rewards are scored (any source) | same |
"""

from __future__ import annotations

import difflib
from typing import Any

SOURCES = ("reasoning_gym", "jsonl", "parquet")
FILE_SOURCES = ("jsonl", "parquet")
FORMATS = ("plain", "gsm8k", "math")
ANSWER_EXTRACTIONS = ("bare", "math")
ON_TOO_LONG = ("truncate_left", "skip")
# Column names of each file format when the config leaves them "" (GSM8K: question/answer;
# MATH and OpenR1-Math: problem/solution, and OpenR1's answer column).
DEFAULT_FIELDS = {
    "plain": {"question": "question", "answer": "answer"},
    "gsm8k": {"question": "question", "answer": "answer"},
    "math": {"question": "problem", "answer": "answer", "solution": "solution"},
}
FIELD_OPTIONS = ("question_field", "answer_field", "solution_field")


def _fail(field: str, value: Any, allowed: str):
  raise ValueError(f"task.{field}={value!r} is invalid: {allowed}")


# Values of options a task section may lack (older configs, hand-built test configs).
DEFAULTS = {"format": "plain", "on_too_long": "truncate_left", "answer_extraction": "bare",
            "reward_workers": 0, "reward_timeout_s": 0.0}


def _choice(cfg, field: str, choices) -> None:
  value = cfg.get(field, DEFAULTS.get(field))
  if value not in choices:
    near = difflib.get_close_matches(str(value), [str(c) for c in choices], n=1)
    hint = f" (did you mean {near[0]!r}?)" if near else ""
    _fail(field, value, f"must be one of {tuple(choices)}{hint}")


def field_names(cfg) -> dict[str, str]:
  """The column names a file source reads: the format's defaults overridden by the
  non-empty ``task.question_field`` / ``answer_field`` / ``solution_field``.

  Args:
    cfg: the ``task`` ConfigDict (or a dict) with ``format`` and the ``*_field`` options.

  Returns:
    {"question": ..., "answer": ...} plus "solution" for ``format='math'``.
  """
  names = dict(DEFAULT_FIELDS[cfg.get("format", "plain")])
  for key in names:
    if cfg.get(f"{key}_field"):
      names[key] = cfg.get(f"{key}_field")
  return names


def validate_task(cfg, check_files: bool = True) -> None:
  """Checks the ``task`` section; raises naming the first bad field.

  Args:
    cfg: the ``task`` ConfigDict; options in ``DEFAULTS`` (and the ``*_field`` options,
      default ``""``) may be absent.
    check_files: also require that the file sources' paths exist.

  Raises:
    ValueError: ``"task.FIELD=VALUE is invalid: what is allowed"`` (one line) for a value
      out of range, not among the choices, or an option the chosen source would ignore.
    FileNotFoundError: a file source's path does not exist (``check_files``).
  """
  _choice(cfg, "source", SOURCES)
  _choice(cfg, "on_too_long", ON_TOO_LONG)
  _choice(cfg, "answer_extraction", ANSWER_EXTRACTIONS)
  _choice(cfg, "format", FORMATS)
  fmt = cfg.get("format", "plain")
  extraction = cfg.get("answer_extraction", "bare")
  source = cfg.source
  for f in ("train_size", "heldout_size"):
    if not isinstance(cfg[f], int) or cfg[f] < 1:
      _fail(f, cfg[f], "must be an int >= 1")
  if source == "reasoning_gym":
    for f in ("train_path", "heldout_path") + FIELD_OPTIONS:
      if cfg.get(f):
        _fail(f, cfg.get(f), "is for task.source in ('jsonl', 'parquet'); reasoning_gym "
              "generates its items: set it to ''")
    if fmt != "plain":
      _fail("format", fmt, "is for task.source in ('jsonl', 'parquet'); reasoning_gym items "
            "carry their gold answer: set it to 'plain'")
  else:
    if cfg.get("name"):
      _fail("name", cfg.name, f"names a reasoning-gym dataset; task.source={source!r} reads "
            "task.train_path and task.heldout_path: set it to ''")
    if cfg.get("kwargs"):
      _fail("kwargs", dict(cfg.kwargs), f"are reasoning-gym dataset options; task.source="
            f"{source!r} has none: set task.kwargs = {{}} in the config file (configs/gsm8k.py "
            "and configs/math.py do)")
    if cfg.get("solution_field") and fmt != "math":
      _fail("solution_field", cfg.solution_field, f"is read only with task.format='math' "
            f"(task.format={fmt!r})")
    for f in ("train_path", "heldout_path"):
      if not cfg.get(f):
        _fail(f, cfg.get(f), f"task.source={source!r} needs both task.train_path and "
              "task.heldout_path")
      if check_files:
        import glob
        if not glob.glob(cfg[f]):
          raise FileNotFoundError(f"task.{f}={cfg[f]!r}: no such file (a path or a glob "
                                  "pattern such as data/openr1/train-*.parquet)")
  timeout = cfg.get("reward_timeout_s", 0.0)
  if not timeout >= 0:
    _fail("reward_timeout_s", timeout, "must be >= 0 seconds (0 = no limit)")
  workers = cfg.get("reward_workers", 0)
  if isinstance(workers, bool) or not isinstance(workers, int) or workers < 0:
    _fail("reward_workers", workers, "must be an int >= 0 (0 = score in this process)")
  if workers == 0 and extraction == "math":
    _fail("reward_workers", 0, "task.answer_extraction='math' needs a process pool (>= 1): "
          "math-verify and sympy can hang in C code that no thread or signal can stop")
  if workers > 0 and not timeout > 0:
    _fail("reward_timeout_s", timeout, f"must be > 0 with task.reward_workers={workers}: the "
          "timeout is what replaces a stuck worker")
  if cfg.get("system_prompt") and not cfg.get("chat_template"):
    _fail("system_prompt", cfg.system_prompt, "is a turn of the chat template: it needs "
          "task.chat_template=True")

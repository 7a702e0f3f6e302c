"""MATH / OpenR1-Math from files: Qwen2.5-0.5B-Instruct on competition problems.

Put the splits under ``data/math/`` (see the README section "Real math datasets"), then
``python -m jaxreplay.main --config configs/math.py --config.model.path=PATH``. Rows:
``problem``, plus ``answer`` (OpenR1-Math, MATH-500) or ``solution`` with a final
``\\boxed{}`` (MATH); the answer column wins when it is non-empty. A gold answer
math-verify cannot parse makes its row invalid (counted, excluded). Longer completions
than GSM8K's; everything else is ``configs/qwen2_5_0_5b.py``.
"""

from jaxreplay.config import sibling_config


def get_config():
  c = sibling_config(__file__, "qwen2_5_0_5b")
  c.workdir = "runs/math"
  c.task.kwargs = {}  # reasoning-gym options; a file source has none
  c.task.update(source="parquet", name="", format="math",
                train_path="data/math/train.parquet", heldout_path="data/math/test.parquet",
                train_size=20000, heldout_size=500, prompt_width=384)
  c.sampler.max_new_tokens = 1024
  return c

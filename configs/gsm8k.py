"""GSM8K from files: Qwen2.5-0.5B-Instruct on the real GSM8K (or any file in its format).

Put the dataset's two splits under ``data/gsm8k/`` (see the README section "Real math
datasets"), then ``python -m jaxreplay.main --config configs/gsm8k.py
--config.model.path=PATH``. Rows: ``question`` and ``answer`` ending in ``#### N``; the gold
is ``N``. Everything else is ``configs/qwen2_5_0_5b.py``: the checkpoint's chat template
with a system turn asking for a boxed answer, math-verify rewards in 2 worker processes.
"""

from jaxreplay.config import sibling_config


def get_config():
  c = sibling_config(__file__, "qwen2_5_0_5b")
  c.workdir = "runs/gsm8k"
  c.task.kwargs = {}  # reasoning-gym options; a file source has none
  c.task.update(source="parquet", name="", format="gsm8k",
                train_path="data/gsm8k/train.parquet", heldout_path="data/gsm8k/test.parquet",
                train_size=7473, heldout_size=1319)  # the whole splits of GSM8K
  return c

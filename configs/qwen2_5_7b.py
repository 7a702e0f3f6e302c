"""Qwen2.5-7B-Instruct: the 8-GPU node preset ``configs/qwen2_5_7b_h100x8.py``.

Kept under this name for the launch scripts; ``configs/qwen2_5_7b_v5p.py`` is the TPU v5p
one. Both are checked by ``bench/memory_plan.py`` (numbers in their docstrings).
"""

from jaxreplay.config import sibling_config


def get_config():
  return sibling_config(__file__, "qwen2_5_7b_h100x8")

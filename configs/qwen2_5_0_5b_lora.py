"""Qwen2.5-0.5B-Instruct with LoRA adapters on one small GPU (24 GB, e.g. an NVIDIA L4).

``python -m jaxreplay.main --config configs/qwen2_5_0_5b_lora.py
--config.model.path=ckpt/qwen2.5-0.5b-instruct``. Task, reward, G = 16, R = B = 64, N = 256,
widths and evaluation of ``configs/qwen2_5_0_5b.py``; only rank-8 adapters on every block
linear layer train (``model.lora``, ``jaxreplay/models/lora.py``; alpha 32), the base stays
frozen in bfloat16.

Memory: the frozen base in bfloat16 (0.99 GB), 4.40M float32 adapter parameters (0.02 GB),
the only ones with Adam state (0.04 GB) and gradients; layers scanned with full
rematerialisation, log-probs in chunks of 128 positions, gradients accumulated over 4
micro-batches of 16 rows, evaluation in 256 rows.
``bench/memory_plan.py --config configs/qwen2_5_0_5b_lora.py --devices 1 --chip l4``
(XLA:CPU's memory analysis of the compiled learner step, sampler, rescoring, drift
monitor and evaluation; not measured on a GPU; 2026-12-05):
  per device, GB        args      out  aliased     temp    total   +resident
    learner          1.04     1.04     1.04     7.78     8.82       8.82
    sampler          1.70     0.69     0.69     3.61     5.31       5.35
    rescoring        1.01     0.00     0.00     4.21     5.22       5.26
    drift            1.01     0.00     0.00     4.21     5.22       5.26
    eval sampler     3.79     2.78     2.78     7.54    11.33      11.37
    eval entropy     1.01     0.00     0.00     7.29     8.30       8.33
    train state 1.04 GB (parameters 1.01), buffer 0.00 GB
    +resident: total + the state and buffer not among the program's arguments (sampler: 0.04 GB)
  peak per device: 11.37 GB of 24 GB (47%); fits JAX's pool 0.75 x 24 = 18.0 GB with 20%
    headroom (<= 14.4 GB): yes
  (9.39 GB without XLA:CPU's float32 copies of the bf16 weights for its dots, which a GPU
  does not make.)
"""

from jaxreplay.config import sibling_config


def get_config():
  c = sibling_config(__file__, "qwen2_5_0_5b")
  c.workdir = "runs/qwen2_5_0_5b_lora"
  # The frozen base never takes an optimizer step, so bfloat16 loses nothing a float32
  # master copy would keep; the adapters are float32 whatever this says.
  c.model.param_dtype = "bfloat16"
  c.model.lora.update(rank=8, alpha=32.0)
  # LoRA's best learning rate is about 10x full fine-tuning's (Schulman et al. 2025, "LoRA
  # Without Regret"): 10 x the 0.5B preset's 1e-6.
  c.algo.lr = 1e-5
  return c

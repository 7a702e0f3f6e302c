"""Learner-step time with the linear layers' dots on bfloat16 operands and float32 results.

XLA:CPU runs a dot of bfloat16 operands into a float32 result on this CPU's AMX units at
about 5-6x its float32 rate, and a bfloat16 → bfloat16 dot at the float32 rate
(``bench/matmul_rates.py``). ``model.dtype="bfloat16"`` asks for bfloat16 results, and
autodiff hands the backward's dots a float32 cotangent, so neither reaches the fast path.
This benchmark measures what the fast path would buy jaxreplay's whole learner step
(``rl.train_step.make_train_step``: forward, chunked log-probs, PPO-clip loss, backward,
AdamW), parameters and every other operation still float32:

* ``f32``: the model as it is (float32 everywhere);
* ``bf16_dots``: every ``nnx.Linear`` (attention q/k/v/o, the SwiGLU MLP) computes
  ``x·W`` as ``bf16(x)·bf16(W)`` into float32, with a custom VJP whose two backward dots
  take ``bf16(g)`` against the saved bfloat16 operands, also into float32 — the
  mixed-precision recipe of Micikevicius et al. 2018 (float32 master weights; products in
  half precision, accumulation in float32), which PyTorch's ``autocast`` applies to a
  peer's matmuls. The output head and attention's score/value products stay float32;
* ``bf16_dots_head``: the same, and the tied output head's logits too (``bf16_dot_nt``).

It prints each variant's loss and gradient norm from the same parameters and batch (the
price in precision) and the step times. Model and batch: ``bench/flat_rows.py``'s (a
randomly initialised decoder at SmolLM2-135M's shapes; 4 × 192 tokens, 132 completion),
with the model's own float32 log-probs as the behaviour's, so that no token is clipped.
Each variant: one call to compile, then ``--rounds`` × ``--steps`` timed calls, alternating.
It also prints the rate of the weight gradient's dot (xᵀ g at the MLP gate's shape, bfloat16
into float32) written two ways: contracting both operands' token axis, and through
``_rows_transposed``.

Usage: python bench/amx_dots.py [--batch 4 --seq 192 --prompt 60 --steps 3 --rounds 2]
Ends with ``amx_dots: f32_step_s=F bf16_dots_step_s=F bf16_dots_head_step_s=F speedup=F
loss_rel_diff=F grad_norm_rel_diff=F`` (median step seconds; the speedup and the relative
differences are ``bf16_dots_head``'s against ``f32``).
"""

from __future__ import annotations

import contextlib
import os
import statistics
import sys

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

import jax  # noqa: E402
import jax.numpy as jnp  # noqa: E402
from flax import nnx  # noqa: E402

from flat_rows import parse_args, smollm2_learner_inputs, time_variants  # noqa: E402
from matmul_rates import rate  # noqa: E402


@jax.custom_vjp
def bf16_dot(x: jax.Array, w: jax.Array) -> jax.Array:
  """``x @ w`` for x [N, Din], w [Din, Dout] (any float dtype) with bfloat16 operands and a
  float32 result [N, Dout]; the backward's dots also take bfloat16 operands into float32."""
  return jnp.dot(x.astype(jnp.bfloat16), w.astype(jnp.bfloat16),
                 preferred_element_type=jnp.float32)


def _bf16_dot_fwd(x, w):
  xb, wb = x.astype(jnp.bfloat16), w.astype(jnp.bfloat16)
  dtypes = (jnp.zeros((), x.dtype), jnp.zeros((), w.dtype))  # residuals must be arrays
  return jnp.dot(xb, wb, preferred_element_type=jnp.float32), (xb, wb, dtypes)


def _bf16_dot_bwd(res, g):
  xb, wb, (x0, w0) = res
  gb = g.astype(jnp.bfloat16)
  dx = jax.lax.dot_general(gb, wb, (((1,), (1,)), ((), ())),
                           preferred_element_type=jnp.float32)  # g Wᵀ: [N, Din]
  # xᵀ g: [Din, Dout] (see _rows_transposed)
  dw = jnp.dot(_rows_transposed(xb), gb, preferred_element_type=jnp.float32)
  return dx.astype(x0.dtype), dw.astype(w0.dtype)


bf16_dot.defvjp(_bf16_dot_fwd, _bf16_dot_bwd)


def _rows_transposed(a: jax.Array) -> jax.Array:
  """[N, D] -> [D, N], spelled through a rank-3 reshape: XLA folds a plain transpose into the
  dot that reads it, and XLA:CPU then runs that dot (contracting both operands' token axis)
  at its float32 rate; this one stays a copy, and the dot takes the fast path."""
  n, d = a.shape
  return a.reshape(n, d, 1).transpose(1, 2, 0).reshape(d, n)


@jax.custom_vjp
def bf16_dot_nt(h: jax.Array, w: jax.Array) -> jax.Array:
  """``h @ wᵀ`` for h [N, D], w [V, D] (the tied head: the embedding table) with bfloat16
  operands and a float32 result [N, V]; the backward's dots as ``bf16_dot``'s."""
  return jax.lax.dot_general(h.astype(jnp.bfloat16), w.astype(jnp.bfloat16),
                             (((1,), (1,)), ((), ())), preferred_element_type=jnp.float32)


def _bf16_dot_nt_fwd(h, w):
  hb, wb = h.astype(jnp.bfloat16), w.astype(jnp.bfloat16)
  dtypes = (jnp.zeros((), h.dtype), jnp.zeros((), w.dtype))
  return bf16_dot_nt(h, w), (hb, wb, dtypes)


def _bf16_dot_nt_bwd(res, g):
  hb, wb, (h0, w0) = res
  gb = g.astype(jnp.bfloat16)
  dh = jnp.dot(gb, wb, preferred_element_type=jnp.float32)  # g W: [N, D]
  dw = jnp.dot(_rows_transposed(gb), hb, preferred_element_type=jnp.float32)  # gᵀ h: [V, D]
  return dh.astype(h0.dtype), dw.astype(w0.dtype)


bf16_dot_nt.defvjp(_bf16_dot_nt_fwd, _bf16_dot_nt_bwd)


@contextlib.contextmanager
def bf16_head():
  """The tied output head's logits as ``bf16_dot_nt`` while active (SmolLM2 ties its head
  and does not scale the tied logits)."""
  from jaxreplay.models.transformer import Transformer
  tied = Transformer._tied_logits

  def call(self, w_vd, h):
    assert not self.cfg.scale_tied_logits
    logits = bf16_dot_nt(h.reshape(-1, h.shape[-1]), w_vd)
    return logits.reshape(*h.shape[:-1], w_vd.shape[0])

  Transformer._tied_logits = call
  try:
    yield
  finally:
    Transformer._tied_logits = tied


@contextlib.contextmanager
def bf16_everywhere():
  """``bf16_linears`` and ``bf16_head`` together."""
  with bf16_linears(), bf16_head():
    yield


@contextlib.contextmanager
def bf16_linears():
  """Every ``nnx.Linear`` call as ``bf16_dot`` (plus its float32 bias) while active."""
  linear = nnx.Linear.__call__

  def call(self, x):
    kernel = self.kernel[...]
    y = bf16_dot(x.reshape(-1, x.shape[-1]), kernel).reshape(*x.shape[:-1], kernel.shape[-1])
    if self.bias is not None:
      y = y + self.bias[...]
    return y.astype(x.dtype)

  nnx.Linear.__call__ = call
  try:
    yield
  finally:
    nnx.Linear.__call__ = linear


def main():
  a = parse_args(__doc__)

  b, t, prompt = a.batch, a.seq, a.prompt
  graphdef, params, spec, optimizer, batch, weights = smollm2_learner_inputs(
      b, t, prompt, on_policy=True)
  variants = {"f32": contextlib.nullcontext(), "bf16_dots": bf16_linears(),
              "bf16_dots_head": bf16_everywhere()}
  metrics, times = time_variants(variants, graphdef, params, optimizer, spec, batch, weights,
                                 a.steps, a.rounds)
  # the weight gradient's dot xᵀ g at the MLP gate's shape, bfloat16 into float32, two ways
  x = jnp.ones((b * t, 576), jnp.bfloat16)
  g = jnp.ones((b * t, 1536), jnp.bfloat16)
  flops = 2.0 * x.size * g.shape[1]
  folded = rate(lambda x, g: jax.lax.dot_general(x, g, (((0,), (0,)), ((), ())),
                                                 preferred_element_type=jnp.float32),
                x, g, flops, 30)
  copied = rate(lambda x, g: jnp.dot(_rows_transposed(x), g, preferred_element_type=jnp.float32),
                x, g, flops, 30)
  print(f"weight-gradient dot [{b * t}, 576]ᵀ × [{b * t}, 1536], bfloat16 → float32: "
        f"{folded:.0f} GFLOP/s contracting the token axes, {copied:.0f} GFLOP/s through "
        f"_rows_transposed")
  f32, bf16 = metrics["f32"], metrics["bf16_dots_head"]
  rel = {k: abs(float(bf16[k]) / float(f32[k]) - 1.0) for k in ("loss", "grad_norm")}
  med = {k: statistics.median(v) for k, v in times.items()}
  dev = jax.devices()[0]
  print(f"device: {dev.platform}, {os.cpu_count()} CPUs, jax {jax.__version__}; batch "
        f"{b} x {t} tokens ({t - prompt} completion); medians of {len(times['f32'])} steps")
  for name, m in metrics.items():
    print(f"  {name}: step {med[name]:.3f} s, loss {float(m['loss']):.6f}, "
          f"grad norm {float(m['grad_norm']):.6f}")
  print(f"amx_dots: f32_step_s={med['f32']:.3f} bf16_dots_step_s={med['bf16_dots']:.3f} "
        f"bf16_dots_head_step_s={med['bf16_dots_head']:.3f} "
        f"speedup={med['f32'] / med['bf16_dots_head']:.2f} loss_rel_diff={rel['loss']:.2e} "
        f"grad_norm_rel_diff={rel['grad_norm']:.2e}")
  return 0


if __name__ == "__main__":
  sys.exit(main())

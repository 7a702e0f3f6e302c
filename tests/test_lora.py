"""LoRA adapters (``model.lora``, ``models.lora``): a fresh adapter (B = 0) leaves every
forward path exactly the base model's; the learner's gradient and optimizer state cover only
the adapters; the unmerged adapters and the merged kernel W + s·A B give the same loss and
gradient for every policy loss; exported adapters load in PEFT with the same logits; adapter
dropout draws inverted Bernoulli masks in the learner's differentiated pass only, the same in
both layer layouts; a tiny LoRA run with dropout resumed halfway ends bit-identical to the
straight run; bad fields fail naming themselves."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

from conftest import forward_terms, reorder_tol, tiny_run_config
from jaxreplay import config as config_lib
from jaxreplay.models import lora
from jaxreplay.models.spec import LoraSpec, ModelSpec
from jaxreplay.models.transformer import KVCache, Transformer, TransformerConfig, init_cache
from jaxreplay.rl import train_step
from jaxreplay.rl.scoring import token_logprobs
from jaxreplay.rl.spec import LOSSES
from jaxreplay.rollout import Rollout
from jaxreplay.spec import ConfigError

B, T = 4, 6
RANK, ALPHA = 2, 4.0


def tiny_cfg(scan=False):
  return TransformerConfig(vocab_size=16, d_model=16, n_layers=2, n_heads=2, n_kv_heads=1,
                           head_dim=8, d_ff=24, scan_layers=scan)


def with_adapters(cfg, b_std=0.0, targets=None, dropout=0.0):
  """(base graphdef, base params, LoRA graphdef, LoRA params); B ~ N(0, b_std²)."""
  g, p = nnx.split(Transformer(cfg, nnx.Rngs(0)))
  spec = LoraSpec(rank=RANK, alpha=ALPHA, dropout=dropout,
                  **({} if targets is None else {"targets": targets}))
  g2, p2 = lora.add_adapters(g, p, spec, jax.random.key(1))
  if b_std:
    ad, frozen = lora.split_adapters(p2)
    leaves, treedef = jax.tree.flatten(ad)
    keys = jax.random.split(jax.random.key(2), len(leaves))
    ad = treedef.unflatten([x + b_std * jax.random.normal(k, x.shape) for x, k in
                            zip(leaves, keys)])
    p2 = lora.join_adapters(ad, frozen)
  return g, p, g2, p2


def batch():
  tokens = jax.random.randint(jax.random.key(3), (B, T), 1, 16)
  cols = np.arange(T)[None, :]
  comp = jnp.asarray((cols >= 2) & (cols < 2 + np.array([4, 2, 3, 1])[:, None]))
  return Rollout(tokens=tokens, attention_mask=jnp.ones((B, T), bool), completion_mask=comp,
                 behaviour_logprobs=jnp.where(comp, -2.0, 0.0),
                 rewards=jnp.array([1.0, 0.0, 1.0, 0.0]),
                 advantages=jnp.array([1.0, -1.0, 0.5, -0.5]),
                 group_id=jnp.zeros(B, jnp.int32), policy_version=jnp.zeros(B, jnp.int32),
                 newest_version=jnp.zeros(B, jnp.int32), truncated=jnp.zeros(B, bool))


@pytest.mark.parametrize("scan", [False, True])
def test_fresh_adapters_give_the_base_models_logits_exactly(scan):
  g, p, g2, p2 = with_adapters(tiny_cfg(scan))
  base, model = nnx.merge(g, p), nnx.merge(g2, p2)
  tok = batch().tokens
  mask = jnp.ones((B, T), bool)
  np.testing.assert_array_equal(model(tok, mask), base(tok, mask))
  np.testing.assert_array_equal(model.project_logits(model.hidden(tok, mask)),
                                base.project_logits(base.hidden(tok, mask)))
  pos = jnp.broadcast_to(jnp.arange(T), (B, T))
  run = lambda m: m.step(tok, pos, mask, init_cache(m.cfg, B, T + 2), jnp.int32(0))[0]
  np.testing.assert_array_equal(run(model), run(base))  # the KV-cache (decode) path
  # the base parameters keep their paths and values; only lora_a / lora_b are added
  ad, frozen = lora.split_adapters(p2)
  assert jax.tree.structure(frozen) == jax.tree.structure(p)
  assert all(bool((x == y).all()) for x, y in zip(jax.tree.leaves(frozen), jax.tree.leaves(p)))
  assert {str(k[-1]) for k, _ in nnx.to_flat_state(ad)} == {"lora_a", "lora_b"}


def test_adapters_are_float32_over_a_bfloat16_base_and_start_exact():
  import dataclasses
  cfg = dataclasses.replace(tiny_cfg(), dtype="bfloat16", param_dtype="bfloat16")
  g, p, g2, p2 = with_adapters(cfg)
  ad, frozen = lora.split_adapters(p2)
  assert {x.dtype for x in jax.tree.leaves(ad)} == {jnp.dtype("float32")}
  assert {x.dtype for x in jax.tree.leaves(frozen)} == {jnp.dtype("bfloat16")}
  tok, mask = batch().tokens, jnp.ones((B, T), bool)
  np.testing.assert_array_equal(nnx.merge(g2, p2)(tok, mask), nnx.merge(g, p)(tok, mask))
  # the same policy on shapes alone (memory plans): same paths, shapes and dtypes, no arrays
  from jaxreplay.models import hf
  ga, pa = lora.abstract_adapters(*hf.abstract_model(cfg), LoraSpec(rank=RANK, alpha=ALPHA))
  assert ga == g2
  shapes = lambda t: {jax.tree_util.keystr(k): (v.shape, v.dtype)
                      for k, v in jax.tree_util.tree_flatten_with_path(t)[0]}
  assert shapes(pa) == shapes(p2)
  assert all(isinstance(x, jax.ShapeDtypeStruct) for x in jax.tree.leaves(pa))


@pytest.mark.slow
@pytest.mark.parametrize("scan", [False, True])
def test_only_adapters_get_gradients_and_optimizer_state(scan):
  cfg = tiny_cfg(scan)
  g, p, g2, p2 = with_adapters(cfg, targets=("q", "v", "down"))
  algo = dict(staleness_buckets=(0,))
  opt = train_step.make_optimizer(dict(lr=1e-2, warmup_steps=0), 1)
  state = train_step.init_train_state(g2, p2, opt, algo)
  ad, frozen = lora.split_adapters(p2)
  n_ad = sum(x.size for x in jax.tree.leaves(ad))
  # Adam's two moments over the adapters only (besides its scalar step counts)
  assert sum(x.size for x in jax.tree.leaves(state.opt_state) if x.ndim) == 2 * n_ad
  step = train_step.make_train_step(g2, opt, algo, temperature=1.0)
  frozen_before = jax.tree.map(np.asarray, frozen)  # the step donates the state
  ad_before = {k: np.asarray(v[...]) for k, v in nnx.to_flat_state(ad)}
  new, metrics = step(state, batch())
  assert float(metrics["skipped_update"]) == 0.0
  ad_new, frozen_new = lora.split_adapters(new.params)
  for x, y in zip(jax.tree.leaves(frozen_new), jax.tree.leaves(frozen_before)):
    np.testing.assert_array_equal(x, y)
  moved = {str(k[-1]) for k, v in nnx.to_flat_state(ad_new)
           if not np.array_equal(v[...], ad_before[k])}
  assert "lora_b" in moved  # B starts at 0 and gets a gradient; W does not move
  grad_fn = train_step.make_grad_fn(g2, algo, temperature=1.0)
  ad, frozen = lora.split_adapters(new.params)
  _, grads = grad_fn(ad, batch(), jnp.ones(B), jnp.zeros(B, jnp.int32), None, None, None,
                     frozen=frozen)
  assert jax.tree.structure(grads) == jax.tree.structure(ad)


@pytest.mark.parametrize("loss", LOSSES)
def test_merged_and_unmerged_forms_give_one_loss_and_gradient(loss):
  cfg = tiny_cfg()
  g, _, g2, p2 = with_adapters(cfg, b_std=0.1)
  ad, frozen = lora.split_adapters(p2)
  g_m, p_m = lora.merge_adapters(g2, p2)
  assert g_m == g
  b = batch()
  logp, _ = token_logprobs(g_m, p_m, b.tokens, b.attention_mask)
  b = b.replace(behaviour_logprobs=jnp.where(b.completion_mask, logp - 0.2, 0.0))
  algo = dict(loss=loss, staleness_buckets=(0,), update_epochs=2 if loss == "decoupled" else 1,
              advantage="dr_grpo" if loss == "asymre" else "grpo")
  args = (b, jnp.ones(B), jnp.zeros(B, jnp.int32),
          jnp.where(b.completion_mask, logp + 0.1, 0.0) if loss == "decoupled" else None,
          None, None)
  (loss_u, _), g_ad = jax.jit(lambda a, f: train_step.make_grad_fn(g2, algo, 1.0)(
      a, *args, frozen=f))(ad, frozen)
  (loss_m, _), g_w = jax.jit(lambda p: train_step.make_grad_fn(g_m, algo, 1.0)(p, *args))(p_m)
  # The two forms round x(W + sAB) and xW + s(xA)B differently: a reordering along the forward
  # chain (conftest.forward_terms, plus the rank), run back for the gradient, plus the B·T
  # positions a weight's gradient sums and the chain rule's own sum over W's in·out.
  n = 2 * forward_terms(cfg, T) + 2 * RANK + B * T + cfg.d_ff
  np.testing.assert_allclose(loss_u, loss_m, rtol=reorder_tol(n), atol=reorder_tol(n))
  # oracle: dL/dA = s·(dL/dW) Bᵀ, dL/dB = s·Aᵀ (dL/dW) (Hu et al. 2021, eq. 3, chain rule)
  s = ALPHA / RANK
  gw = dict(nnx.to_flat_state(g_w))
  for path, var in nnx.to_flat_state(g_ad):
    layer = path[:-1]
    dw = gw[layer + ("kernel",)][...]
    a = dict(nnx.to_flat_state(ad))[layer + ("lora_a",)][...]
    bb = dict(nnx.to_flat_state(ad))[layer + ("lora_b",)][...]
    want = s * (dw @ bb.T if path[-1] == "lora_a" else a.T @ dw)
    scale = float(jnp.abs(want).max()) + 1e-30
    np.testing.assert_allclose(var[...], want, atol=reorder_tol(n, scale=scale), rtol=0,
                               err_msg=str(path))


def test_packed_and_accumulated_gradients_of_adapters_equal_the_whole_batchs():
  from jaxreplay.rl import packing
  cfg = tiny_cfg()
  _, _, g2, p2 = with_adapters(cfg, b_std=0.1)
  ad, frozen = lora.split_adapters(p2)
  b = batch().replace(attention_mask=jnp.asarray(np.arange(T)[None, :] < np.array(
      [[6], [4], [5], [3]])))
  args = (b, jnp.ones(B), jnp.zeros(B, jnp.int32), None, None, None)
  algo = dict(staleness_buckets=(0,), entropy_coef=0.01)
  (l1, _), g1 = train_step.make_grad_fn(g2, algo, 1.0)(ad, *args, frozen=frozen)
  plan = jax.tree.map(lambda x: jnp.asarray(x[0]),
                      packing.plan_batch(np.asarray(b.attention_mask), 1, 2))
  (l2, _), g2_ = train_step.make_grad_fn(g2, {**algo, "grad_accum_steps": 2}, 1.0)(
      ad, *args, plan, frozen=frozen)
  # packing and micro-batches reorder the forward chain, its backward run and the B·T
  # positions a gradient sums (conftest.forward_terms)
  n = 2 * forward_terms(cfg, T) + B * T
  np.testing.assert_allclose(l2, l1, rtol=reorder_tol(n), atol=reorder_tol(n))
  for x, y in zip(jax.tree.leaves(g2_), jax.tree.leaves(g1)):
    np.testing.assert_allclose(x, y, rtol=0,
                               atol=reorder_tol(n, scale=float(jnp.abs(y).max()) + 1e-30))


def test_exported_adapters_load_in_peft_with_the_same_logits(tmp_path):
  torch = pytest.importorskip("torch")
  transformers = pytest.importorskip("transformers")
  peft = pytest.importorskip("peft")
  from jaxreplay.models import hf as hf_models
  base_dir, ad_dir = tmp_path / "base", tmp_path / "adapter"
  torch.manual_seed(0)
  hcfg = transformers.Qwen2Config(vocab_size=64, hidden_size=32, intermediate_size=48,
                                  num_hidden_layers=2, num_attention_heads=2,
                                  num_key_value_heads=1, max_position_embeddings=64,
                                  tie_word_embeddings=True)
  transformers.Qwen2ForCausalLM(hcfg).save_pretrained(base_dir)
  cfg, g, p = hf_models.from_pretrained(str(base_dir))
  spec = LoraSpec(rank=RANK, alpha=ALPHA, targets=("q", "k", "v", "o", "gate", "up", "down"))
  g2, p2 = lora.add_adapters(g, p, spec, jax.random.key(1))
  ad, frozen = lora.split_adapters(p2)
  ad = jax.tree.map(lambda x: x + 0.05, ad)  # B ≠ 0: the adapters change the logits
  p2 = lora.join_adapters(ad, frozen)
  lora.save_peft(str(ad_dir), p2, spec, cfg.n_layers, base_model=str(base_dir))
  tok = np.random.default_rng(0).integers(0, 64, (2, 7))
  ours = np.asarray(nnx.merge(g2, p2)(jnp.asarray(tok), jnp.ones(tok.shape, bool)))
  model = peft.PeftModel.from_pretrained(
      transformers.Qwen2ForCausalLM.from_pretrained(base_dir, dtype=torch.float32), ad_dir)
  model.eval()
  with torch.no_grad():
    theirs = model(torch.as_tensor(tok)).logits.numpy()
  base = np.asarray(nnx.merge(g, p)(jnp.asarray(tok), jnp.ones(tok.shape, bool)))
  assert np.abs(ours - base).max() > 1e-3  # the adapters matter
  # two float32 implementations of one forward pass: conftest.forward_terms' reordering,
  # scaled by the largest logit
  tol = 2 * reorder_tol(forward_terms(cfg, 7) + 2 * RANK, scale=float(np.abs(ours).max()))
  np.testing.assert_allclose(theirs, ours, atol=tol, rtol=0)


def test_adapter_dropout_draws_an_inverted_bernoulli_mask_per_layer_and_target():
  # x_j = 2^j, A = 1, B = 1, W = 0: the output times (1 - p) spells the kept inputs in binary
  p, n, d_in = 0.25, 512, 8
  base = nnx.Linear(d_in, 1, use_bias=False, rngs=nnx.Rngs(0))
  base.kernel = nnx.Param(jnp.zeros((d_in, 1)))
  ones_a, ones_b = jnp.ones((d_in, 1)), jnp.ones((1, 1))
  layer = lambda target: lora.LoRALinear(base, ones_a, ones_b, 1.0, p, target)
  x = jnp.broadcast_to(2.0 ** jnp.arange(d_in), (n, d_in))
  np.testing.assert_array_equal(layer(0)(x)[:, 0], 255.0)  # no dropout_rng: deterministic

  def mask(target, key):
    with lora.dropout_rng(key):
      code = np.asarray(layer(target)(x)[:, 0]) * (1 - p)
    # kept inputs scaled by 1/(1 - p): (1 - p)·out is an integer up to float32 rounding
    np.testing.assert_allclose(code, np.round(code), rtol=0, atol=1e-3)
    return (np.round(code).astype(np.int64)[:, None] >> np.arange(d_in)) & 1

  m = mask(0, jax.random.key(7))
  # 4,096 Bernoulli(0.75) draws: 6 standard errors is 0.04
  assert abs(m.mean() - (1 - p)) < 0.04
  np.testing.assert_array_equal(mask(0, jax.random.key(7)), m)  # a key gives one mask
  assert (mask(3, jax.random.key(7)) != m).mean() > 0.2  # each target its own stream
  assert (mask(0, jax.random.key(8)) != m).mean() > 0.2  # and each key
  assert not lora.dropout_active()


def test_adapter_dropout_is_the_same_in_the_list_and_scan_layouts_and_only_inside_its_block():
  from jaxreplay.models.transformer import stack_blocks
  cfg = tiny_cfg()
  _, _, g_list, p_list = with_adapters(cfg, b_std=0.1, dropout=0.5)
  g_scan, _ = lora.abstract_adapters(*nnx.split(Transformer(tiny_cfg(scan=True), nnx.Rngs(0))),
                                     LoraSpec(rank=RANK, alpha=ALPHA, dropout=0.5))
  p_scan = stack_blocks(p_list, cfg.n_layers)
  _, _, g_off, _ = with_adapters(cfg, b_std=0.1)  # the same model without dropout
  tok, mask = batch().tokens, jnp.ones((B, T), bool)
  hidden = lambda g, p: np.asarray(nnx.merge(g, p).hidden(tok, mask))
  off = hidden(g_off, p_list)
  np.testing.assert_array_equal(hidden(g_list, p_list), off)  # outside dropout_rng
  with lora.dropout_rng(jax.random.key(5)):
    dropped_list, dropped_scan = hidden(g_list, p_list), hidden(g_scan, p_scan)
  assert np.abs(dropped_list - off).max() > 1e-3
  # the layer index reaches the masks in both layouts: the same masks, one forward pass
  # computed twice (float32; only the scan's reassociation differs)
  np.testing.assert_allclose(dropped_scan, dropped_list, rtol=0,
                             atol=reorder_tol(forward_terms(cfg, T),
                                              scale=float(np.abs(dropped_list).max())))
  assert lora.graph_dropout(g_list) == 0.5 and lora.graph_dropout(g_off) == 0.0


def test_adapter_dropout_reaches_the_learners_gradient_and_nothing_else():
  cfg = tiny_cfg()
  _, _, g_drop, p2 = with_adapters(cfg, b_std=0.1, targets=("q", "v", "down"), dropout=0.5)
  _, _, g_off, _ = with_adapters(cfg, b_std=0.1, targets=("q", "v", "down"))
  ad, frozen = lora.split_adapters(p2)
  args = (batch(), jnp.ones(B), jnp.zeros(B, jnp.int32), None, None, None)
  algo = dict(staleness_buckets=(0,))
  grad = lambda g, **kw: train_step.make_grad_fn(g, algo, 1.0)(ad, *args, frozen=frozen, **kw)
  (l_off, _), g_ref = grad(g_off)
  (l_none, _), g_none = grad(g_drop)  # no key: the deterministic pass
  np.testing.assert_array_equal(l_none, l_off)
  for x, y in zip(jax.tree.leaves(g_none), jax.tree.leaves(g_ref)):
    np.testing.assert_array_equal(x, y)
  (l_a, _), g_a = grad(g_drop, dropout_key=jax.random.key(1))
  (l_b, _), g_b = grad(g_drop, dropout_key=jax.random.key(1))
  (l_c, _), _ = grad(g_drop, dropout_key=jax.random.key(2))
  assert float(l_a) == float(l_b) and float(l_a) != float(l_off) and float(l_c) != float(l_a)
  for x, y in zip(jax.tree.leaves(g_a), jax.tree.leaves(g_b)):
    np.testing.assert_array_equal(x, y)
  # the train step: the seed picks the masks; the metrics of the pass itself move
  opt = train_step.make_optimizer(dict(lr=1e-2, warmup_steps=0), 1)
  on_policy = batch()  # behaviour log-probs: the deterministic policy's own
  logp, _ = token_logprobs(g_off, p2, on_policy.tokens, on_policy.attention_mask, 1.0)
  on_policy = on_policy.replace(
      behaviour_logprobs=jnp.where(on_policy.completion_mask, logp, 0.0))
  run = lambda g, seed: jax.tree.map(float, train_step.make_train_step(
      g, opt, algo, 1.0, seed=seed)(train_step.init_train_state(
          g, jax.tree.map(jnp.copy, p2), opt, algo), on_policy)[1])
  m0, m0_again, m1, m_off = run(g_drop, 0), run(g_drop, 0), run(g_drop, 1), run(g_off, 0)
  assert m0 == m0_again
  assert m0["loss"] != m1["loss"] and m0["loss"] != m_off["loss"]
  # on-policy at identical parameters the deterministic pass has ratio 1; the dropped one not
  assert m_off["ratio_max"] == pytest.approx(1.0, abs=1e-5)
  assert abs(m0["ratio_max"] - 1.0) > 1e-3


@pytest.mark.parametrize("bad, match", [
    ({"rank": -1}, r"model\.lora\.rank=-1 is invalid: must be >= 0"),
    ({"rank": 4, "targets": ("q", "qq")}, r"model\.lora\.targets=.* one of \('q', 'k'"),
    ({"rank": 4, "targets": ()}, r"model\.lora\.targets=\(\) is invalid"),
    ({"rank": 4, "targets": ("q", "q")}, r"must not repeat"),
    ({"rank": 4, "alpha": 0.0}, r"model\.lora\.alpha=0\.0 is invalid: must be > 0"),
    ({"rank": 4, "dropout": 1.0}, r"model\.lora\.dropout=1\.0 is invalid: must be in \[0, 1\)"),
    ({"ranks": 4}, r"model\.lora\.ranks is not a field .*did you mean model\.lora\.rank"),
])
def test_bad_lora_fields_fail_naming_the_field(bad, match):
  with pytest.raises(ConfigError, match=match):
    ModelSpec(lora=bad)


def test_lora_off_by_default():
  assert not ModelSpec().lora_spec().enabled
  assert ModelSpec(lora={"rank": 8}).lora_spec().scale == 32.0 / 8


@pytest.mark.slow
def test_a_tiny_lora_run_resumes_bit_identically(base_policy_cache, tmp_path):
  from conftest import run
  from jaxreplay.train.loop import restore as restore_run
  # with adapter dropout: its masks follow the policy version, so they resume too
  kw = {"model.lora": {"rank": 2, "alpha": 4.0, "targets": ("q", "v", "up"), "dropout": 0.25},
        "train.steps": 4, "eval.every": 2, "checkpoint.every": 2, "drift.every": 2,
        # the tiny policy earns no reward in 4 steps: the entropy bonus gives a gradient
        "algo.entropy_coef": 0.01}
  quiet = lambda *_: None
  run(tiny_run_config(tmp_path / "a", base_policy_cache, **kw), log=quiet)
  run(tiny_run_config(tmp_path / "c", base_policy_cache, **{**kw, "train.steps": 2}), log=quiet)
  run(tiny_run_config(tmp_path / "c", base_policy_cache, **kw), log=quiet)
  from jaxreplay.train.metrics import read_metrics
  strip = lambda rs: [{k: v for k, v in r.items() if not k.endswith("_s")} for r in rs]
  assert strip(read_metrics(tmp_path / "c")) == strip(read_metrics(tmp_path / "a"))
  states = [restore_run(config_lib.validate(tiny_run_config(tmp_path / w, base_policy_cache,
                                                            **kw)), quiet)
            for w in ("a", "c")]
  (_, ca), (_, cc) = states
  for x, y in zip(jax.tree.leaves(ca.state), jax.tree.leaves(cc.state)):
    np.testing.assert_array_equal(x, y)
  ad, _ = lora.split_adapters(ca.state.params)
  assert any(float(jnp.abs(x[...]).max()) > 0 for k, x in nnx.to_flat_state(ad)
             if k[-1] == "lora_b")  # the adapters trained
  # the merged export (W + s·A B in the Hugging Face layout) gives the run's own logits
  transformers = pytest.importorskip("transformers")
  torch = pytest.importorskip("torch")
  from jaxreplay import export
  out = tmp_path / "hf"
  export.export(str(tmp_path / "a"), str(out))
  job, _ = states[0]
  assert lora.graph_dropout(job.graphdef) == 0.25  # the run's learner dropped adapter inputs
  tok = np.random.default_rng(0).integers(3, 50, (2, 9))
  ours = np.asarray(nnx.merge(job.graphdef, ca.state.params)(jnp.asarray(tok),
                                                             jnp.ones(tok.shape, bool)))
  model = transformers.AutoModelForCausalLM.from_pretrained(out).eval()
  with torch.no_grad():
    theirs = model(torch.as_tensor(tok)).logits.numpy()
  cfg = nnx.merge(job.graphdef, ca.state.params).cfg
  tol = 2 * reorder_tol(forward_terms(cfg, 9) + 2 * 2, scale=float(np.abs(ours).max()))
  np.testing.assert_allclose(theirs, ours, atol=tol, rtol=0)
  r = export.export(str(tmp_path / "a"), str(tmp_path / "peft"), adapters=True)
  assert set(r["files"]) == {"adapter_model.safetensors", "adapter_config.json"}

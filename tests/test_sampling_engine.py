"""Decode engine tests: slot count, refill, tail shrink and chunk size leave every request's
tokens unchanged; a prompt prefilled once for its G samples equals G separate prefills;
attention over the filled prefix of the cache equals the learner's masked full attention;
forced completion lengths; input validation; and decoding on an 8-device mesh, as one
program or as one engine per device.

Every engine run here shares one request layout (16 left-padded prompts of lengths 1..8,
G = 2, so 32 requests; M = 24) so that the compiled insert and decode programs are reused
across tests.
"""

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx
from jax.sharding import NamedSharding, PartitionSpec

from conftest import forward_terms, logprob_tol, reorder_tol
from jaxreplay.models import Transformer, TransformerConfig
from jaxreplay.parallel import hlo, make_mesh
from jaxreplay.rl.scoring import token_logprobs
from jaxreplay.sampling import engine, generate
from jaxreplay.sampling.generate import as_generation

PAD = 0
STOPS = (2, 3, 5, 7)  # several stop ids: completions of varied length within M
CFG = TransformerConfig(vocab_size=64, d_model=32, n_layers=2, n_heads=4, n_kv_heads=2,
                        head_dim=8, d_ff=64, tie_embeddings=False, qkv_bias=True)
N, G, P_WIDTH, M, TEMP = 16, 2, 8, 24, 1.0
R = N * G
REFILL_SLOTS = 16  # < R (refill) and > engine.MIN_SLOTS (the tail shrinks to 8)
KEY = jax.random.key(7)
# Slot counts, refills, the cache and the mesh reorder the forward chain: log-probs agree to
# conftest.logprob_tol of the learner's logits (the ``logp_atol`` fixture), logits to half
# that (no log-softmax), cached keys and values to the chain with their own size.
N_FWD = forward_terms(CFG, P_WIDTH + M)


@pytest.fixture(scope="module")
def policy():
  return nnx.split(Transformer(CFG, nnx.Rngs(0)), nnx.Param)


@pytest.fixture(scope="module")
def prompts():
  """[N, P] left-padded prompts of lengths 1 .. P (every length present), their mask."""
  rng = np.random.default_rng(0)
  lengths = np.concatenate([np.arange(1, P_WIDTH + 1), rng.integers(1, P_WIDTH + 1, N - P_WIDTH)])
  toks = np.full((N, P_WIDTH), PAD, np.int32)
  mask = np.zeros((N, P_WIDTH), bool)
  for i, n in enumerate(lengths):
    toks[i, P_WIDTH - n:] = rng.integers(8, CFG.vocab_size, n)
    mask[i, P_WIDTH - n:] = True
  return toks, mask


@pytest.fixture(scope="module")
def forward(policy):
  """The model's full-sequence logits, jitted once: (params, tokens, mask) -> [B, T, V]."""
  graphdef, _ = policy
  return jax.jit(lambda params, tokens, mask: nnx.merge(graphdef, params)(tokens, mask))


@pytest.fixture(scope="module")
def logp_atol(policy, prompts, refilled, forward):
  """conftest.logprob_tol of the learner's logits on the reference run's sequences."""
  _, params = policy
  gen = refilled[0]
  toks, mask = (np.repeat(x, G, 0) for x in prompts)
  logits = forward(params, np.concatenate([toks, gen.tokens], 1),
                   np.concatenate([mask, gen.mask], 1))
  return logprob_tol(CFG, logits)


def run(policy, prompts, **kw):
  """``generate`` with the shared settings; returns (Generation as NumPy, EngineStats)."""
  graphdef, params = policy
  toks, mask = prompts
  args = dict(max_new_tokens=M, temperature=TEMP, eos_ids=STOPS, pad_id=PAD, group_size=G,
              chunk_steps=16, return_stats=True) | kw
  gen, stats = generate(graphdef, params, toks, mask, args.pop("key", KEY), **args)
  return jax.tree.map(np.asarray, gen), stats


class ChunkLog:
  """Wraps ``engine._decode_chunk``: ``chunks`` holds (slots, steps run) of every chunk and
  ``kv_specs`` the partition spec of the KV cache it decoded (None off a mesh)."""

  def __init__(self, monkeypatch):
    self.chunks, self.kv_specs = [], []
    original = engine._decode_chunk

    def logged(graphdef, params, state, *args, **kw):
      self.kv_specs.append(getattr(state.k.sharding, "spec", None))  # before donation
      out = original(graphdef, params, state, *args, **kw)
      self.chunks.append((int(state.done.shape[0]), int(np.max(out[1]))))  # longest replica
      return out

    monkeypatch.setattr(engine, "_decode_chunk", logged)


@pytest.fixture(scope="module")
def refilled(policy, prompts):
  """The reference run: 16 slots for 32 requests (refill, then the tail shrinks to 8),
  with the slot count and steps of every decode chunk."""
  with pytest.MonkeyPatch.context() as mp:
    log = ChunkLog(mp)
    gen, stats = run(policy, prompts, slots=REFILL_SLOTS)
  return gen, stats, log.chunks


def assert_same_requests(a, b, logp_atol):
  """Equal tokens (a draw flips only within rounding of a CDF step) and log-probs within
  ``logp_atol``."""
  np.testing.assert_array_equal(a.tokens, b.tokens)
  np.testing.assert_array_equal(a.length, b.length)
  np.testing.assert_array_equal(a.mask, b.mask)
  np.testing.assert_allclose(a.logprobs, b.logprobs, rtol=0, atol=logp_atol)
  np.testing.assert_allclose(a.full_logprobs, b.full_logprobs, rtol=0, atol=logp_atol)


def learner_logprobs(policy, prompts, gen, group_size):
  """The learner's log-probs of each completion: one full forward of prompt + completion
  under the attention mask (``rl.scoring.token_logprobs``), completion columns."""
  graphdef, params = policy
  toks, mask = (np.repeat(x, group_size, 0) for x in prompts)
  full = jnp.concatenate([toks, gen.tokens], 1)
  attn = jnp.concatenate([mask, gen.mask], 1)
  logp, _ = jax.jit(token_logprobs, static_argnums=(0, 4))(graphdef, params, full, attn, TEMP)
  return np.asarray(logp)[:, P_WIDTH:]


# ---------------------------------------------------------------- slots, refill, chunks
def test_refill_run_really_refills_and_shrinks(refilled):
  """With fewer slots than requests the engine inserts several times, prefills each
  prompt once per insert it appears in, and shrinks to MIN_SLOTS once at most half of
  the slots still decode; the stats count exactly the row-steps of the chunks run."""
  gen, stats, chunks = refilled
  lengths = gen.length
  assert len(np.unique(lengths)) >= 5 and lengths.min() < M // 2  # varied completions
  assert stats.inserts > 1
  assert N <= stats.prefill_rows < R  # a prompt's G samples mostly share one prefill
  assert stats.useful_row_steps == int(lengths.sum())
  slot_counts = [s for s, _ in chunks]
  assert slot_counts[0] == REFILL_SLOTS and slot_counts[-1] == engine.MIN_SLOTS
  assert stats.chunks == len(chunks)
  steps = sum(ran for _, ran in chunks)
  assert stats.row_steps == sum(s * ran for s, ran in chunks)
  assert stats.row_steps < REFILL_SLOTS * steps  # the tail ran on fewer slots
  assert stats.useful_row_steps <= stats.row_steps
  assert stats.programs == 2  # one width (capacity 32 < MIN_WIDTH), two slot counts


@pytest.mark.numerics
def test_slot_count_does_not_change_any_request(policy, prompts, refilled, logp_atol):
  """All requests at once (slots = 0), 16 refilled slots and 3 slots give every request
  the same tokens and behaviour log-probs."""
  ref, ref_stats, _ = refilled
  at_once, at_once_stats = run(policy, prompts, slots=0)
  odd, odd_stats = run(policy, prompts, slots=3)
  assert at_once_stats.inserts == 1 and odd_stats.inserts > ref_stats.inserts
  assert_same_requests(at_once, ref, logp_atol)
  assert_same_requests(odd, ref, logp_atol)
  # Random bits follow the request: its two samples differ somewhere, and another key
  # changes the tokens.
  assert (ref.tokens[0::2] != ref.tokens[1::2]).any()
  other, _ = run(policy, prompts, slots=0, key=jax.random.key(8))
  assert (other.tokens != ref.tokens).any()


@pytest.mark.numerics
def test_chunk_size_and_width_buckets_do_not_change_any_request(policy, prompts, refilled,
                                                               logp_atol, monkeypatch):
  """One step per chunk, with attention over the first 16 positions while every slot fits
  in them (a MIN_WIDTH below the capacity), equals 16-step chunks at the full width."""
  ref, _, _ = refilled
  monkeypatch.setattr(engine, "MIN_WIDTH", 16)
  monkeypatch.setattr(engine, "attention_floor", lambda cfg: 16)  # this model's is 20
  one, stats = run(policy, prompts, slots=3, chunk_steps=1)
  assert stats.programs == 5  # widths 16, 20, 24, 28 and 32 (four per octave)
  assert stats.kv_read < stats.row_steps * (P_WIDTH + M)
  assert_same_requests(one, ref, logp_atol)


def test_attention_floor_and_width_buckets_by_hand():
  """SmolLM2-135M's matmuls read N = 30·(2·576·576 + 2·576·192 + 3·576·1536) + 49152·576 =
  134,479,872 parameters per token; its attention over w positions is an eighth of the
  step's FLOPs at w = N / (16·30·9·64) = 486.4: its 96 + 128 positions decode at one width."""
  smollm2 = TransformerConfig(vocab_size=49152, d_model=576, n_layers=30, n_heads=9,
                              n_kv_heads=3, head_dim=64, d_ff=1536)
  assert engine.attention_floor(smollm2) == 486
  assert {engine.width_bucket(n, 224, 486) for n in (1, 80, 200, 224)} == {224}
  # the default tiny model: N = 4·(2·128·128 + 2·128·64 + 3·128·384) + 300·128 = 824,832
  tiny = TransformerConfig(vocab_size=300, d_model=128, n_layers=4, n_heads=4, n_kv_heads=2,
                           head_dim=32, d_ff=384)
  assert engine.attention_floor(tiny) == 824_832 // (16 * 4 * 4 * 32) == 100
  assert [engine.width_bucket(n, 4096, 100) for n in (1, 100, 113, 1000)] == [112, 112, 128, 1024]
  assert [engine.width_bucket(n, 4096) for n in (1, 65, 100, 1000)] == [64, 80, 112, 1024]


# ---------------------------------------------------------------- shared prefill
@pytest.mark.numerics
def test_shared_prefill_equals_repeated_prefill(policy, prompts, logp_atol):
  """G samples of one prefilled prompt equal G copies of the prompt prefilled separately:
  the same request ids draw the same tokens with the same log-probs."""
  shared, shared_stats = run(policy, prompts, slots=0)
  toks, mask = prompts
  repeated, rep_stats = run(policy, (np.repeat(toks, G, 0), np.repeat(mask, G, 0)), slots=0,
                            group_size=1)
  assert shared_stats.prefill_rows == N and rep_stats.prefill_rows == R
  assert_same_requests(shared, repeated, logp_atol)


# ---------------------------------------------------------------- attention over the cache
@pytest.mark.numerics
def test_decode_step_width_bucket_equals_full_capacity(policy, forward, logp_atol):
  """decode_step attending to the first w < C cache positions gives the logits of
  attending to all C positions, for slots filled to different lengths (prompts prefilled
  into a cache whose other positions hold garbage), and both equal the full forward."""
  graphdef, params = policy
  s, w_prompt, capacity, width = N, 16, P_WIDTH + M, 16
  rng = np.random.default_rng(1)
  lengths = np.concatenate([[1, w_prompt - 1], rng.integers(1, w_prompt, s - 2)]).astype(np.int32)
  seqs = rng.integers(8, CFG.vocab_size, (s, capacity)).astype(np.int32)
  aligned = np.where(np.arange(w_prompt)[None] < lengths[:, None], seqs[:, :w_prompt], PAD)
  nxt = seqs[np.arange(s), lengths]  # the token decoded after each prompt
  shape = (CFG.n_layers, s, CFG.n_kv_heads, capacity, CFG.head_dim)
  garbage_k, garbage_v = (rng.normal(size=shape).astype(np.float32) for _ in range(2))

  @jax.jit
  def prefill_then_step(params, aligned, lengths, nxt, ck, cv):
    model = nnx.merge(graphdef, params)
    k, v, _ = engine.prefill(model, aligned, lengths)
    ck, cv = ck.at[:, :, :, :w_prompt].set(k), cv.at[:, :, :, :w_prompt].set(v)
    return (ck,) + tuple(engine.decode_step(model, nxt, lengths, ck, cv, w)
                         for w in (width, capacity))

  ck, (small, ck_s, cv_s), (full, ck_f, cv_f) = prefill_then_step(
      params, aligned, lengths, nxt, garbage_k, garbage_v)
  np.testing.assert_allclose(np.asarray(small), np.asarray(full), rtol=0, atol=logp_atol / 2)
  # Layers after the first see inputs that went through attention reductions of another
  # width: the chain, its terms about the size of the largest cached entry.
  kv_atol = reorder_tol(N_FWD, scale=float(max(np.abs(ck_f).max(), np.abs(cv_f).max())))
  np.testing.assert_allclose(np.asarray(ck_s), np.asarray(ck_f), rtol=0, atol=kv_atol)
  np.testing.assert_allclose(np.asarray(cv_s), np.asarray(cv_f), rtol=0, atol=kv_atol)
  # The new key is written at each slot's length; nothing else changes.
  changed = np.asarray(ck_f != ck).any(axis=(0, 2, 4))  # [S, C]
  assert (changed == (np.arange(capacity)[None] == lengths[:, None])).all()
  # Both equal the full forward of prompt + token (right padding after it).
  mask = np.arange(capacity)[None] <= lengths[:, None]
  ref = np.asarray(forward(params, np.where(mask, seqs, PAD), mask))[np.arange(s), lengths]
  np.testing.assert_allclose(np.asarray(full), ref, rtol=0, atol=logp_atol / 2)


@pytest.mark.numerics
def test_behaviour_logprobs_equal_learner_full_forward(policy, prompts, refilled, logp_atol):
  """With refilled slots, G = 2 and left-padded prompts of every length 1 .. P, the
  engine's behaviour log-probs equal the learner's masked full-forward log-probs."""
  gen, _, _ = refilled
  logp = learner_logprobs(policy, prompts, gen, G)
  comp = gen.mask
  assert comp.sum() > 100
  np.testing.assert_allclose(logp[comp], gen.logprobs[comp], rtol=0, atol=logp_atol)
  assert (gen.logprobs[~comp] == 0).all() and (gen.tokens[~comp] == PAD).all()


@pytest.mark.numerics
def test_greedy_equals_full_model_greedy_loop(policy, prompts, forward, logp_atol):
  """Greedy decoding equals argmax over a full forward of the growing sequence, and its
  stored log-probs are that forward's log-softmax at the chosen tokens."""
  _, params = policy
  gen, _ = run(policy, prompts, slots=3, temperature=0.0)
  toks, mask = prompts
  seq = np.concatenate([toks, np.full((N, M), PAD, np.int32)], 1)
  attn = np.concatenate([mask, np.zeros((N, M), bool)], 1)
  ref_lp = np.zeros((N, M), np.float32)
  for t in range(M):
    logits = np.asarray(forward(params, seq, attn))[:, P_WIDTH + t - 1]
    seq[:, P_WIDTH + t] = logits.argmax(-1)
    attn[:, P_WIDTH + t] = True
    top = logits.max(-1)
    lse = top + np.log(np.exp(logits - top[:, None]).sum(-1))
    ref_lp[:, t] = logits[np.arange(N), seq[:, P_WIDTH + t]] - lse
  ref = seq[:, P_WIDTH:]
  is_stop = np.isin(ref, STOPS)
  length = np.where(is_stop.any(-1), is_stop.argmax(-1) + 1, M)
  keep = np.arange(M)[None] < length[:, None]
  for g in range(G):  # every sample of a prompt is the same greedy completion
    np.testing.assert_array_equal(gen.length[g::G], length)
    np.testing.assert_array_equal(gen.tokens[g::G], np.where(keep, ref, PAD))
    np.testing.assert_allclose(gen.logprobs[g::G], np.where(keep, ref_lp, 0.0), rtol=0,
                               atol=logp_atol)
  assert len(np.unique(ref[:, 0])) > 1  # the prompts lead to different completions


# ---------------------------------------------------------------- forced lengths
def test_forced_lengths_are_exact(policy, prompts):
  """Each request stops exactly at its forced length (1 and M included), on the first stop
  id, although other stop ids could otherwise end it earlier."""
  rng = np.random.default_rng(3)
  target = rng.integers(1, M + 1, R)
  target[:4] = [1, M, 1, M]
  gen, _ = run(policy, prompts, slots=3, forced_lengths=target)
  np.testing.assert_array_equal(gen.length, target)
  np.testing.assert_array_equal(gen.tokens[np.arange(R), target - 1], STOPS[0])
  assert not gen.truncated.any()
  before = np.arange(M)[None] < (target - 1)[:, None]
  assert not np.isin(gen.tokens[before], STOPS).any()
  np.testing.assert_array_equal(gen.mask, np.arange(M)[None] < target[:, None])


# ---------------------------------------------------------------- validation
@pytest.mark.parametrize("field,bad", [("prompt_mask", None), ("slots", dict(slots=-1)),
                                       ("chunk_steps", dict(chunk_steps=0)),
                                       ("group_size", dict(group_size=0))])
def test_bad_input_raises_naming_the_field(policy, prompts, field, bad):
  """A prompt row without a real token, negative slots, chunk_steps 0 and group_size 0
  are rejected before any decoding, with the offending field in the message."""
  toks, mask = prompts
  if bad is None:  # a prompt row without any real token
    mask = mask.copy()
    mask[3] = False
    bad = {}
  with pytest.raises(ValueError, match=field):
    run(policy, (toks, mask), **bad)


# ---------------------------------------------------------------- sharding
@pytest.mark.numerics
def test_mesh_with_refilled_slots_matches_no_mesh(policy, prompts, refilled, logp_atol,
                                                  monkeypatch):
  """On a data × fsdp × tensor = 2 × 2 × 2 mesh, refilled and shrinking slots (split over
  data × fsdp, KV heads over tensor) give the same tokens and log-probs as one device."""
  if jax.device_count() < 8:
    pytest.skip("needs 8 (fake) devices; see tests/conftest.py")
  ref, ref_stats, ref_chunks = refilled
  log = ChunkLog(monkeypatch)
  gen, stats = run(policy, prompts, slots=REFILL_SLOTS, mesh=make_mesh(data=2, fsdp=2, tensor=2))
  assert log.chunks == ref_chunks  # the same refills and shrink
  assert stats.inserts == ref_stats.inserts and stats.row_steps == ref_stats.row_steps
  for spec in log.kv_specs:
    assert tuple(spec)[1:3] == (("data", "fsdp"), "tensor")
  assert_same_requests(gen, ref, logp_atol)


@pytest.mark.numerics
def test_engine_replicas_per_device_match_no_mesh(policy, prompts, refilled, logp_atol,
                                                  monkeypatch):
  """Parameters replicated on a data = 8 mesh: eight engines, one per device, each decoding
  its own slots and stopping on its own (``engine_replicas``), give the reference run's
  chunks (the longest replica's steps), tokens and log-probs."""
  if jax.device_count() < 8:
    pytest.skip("needs 8 (fake) devices; see tests/conftest.py")
  ref, ref_stats, ref_chunks = refilled
  graphdef, params = policy
  mesh = make_mesh(data=8, fsdp=1, tensor=1)
  placed = jax.device_put(params, NamedSharding(mesh, PartitionSpec()))
  assert engine.engine_replicas(mesh, placed) == 8
  assert engine.engine_replicas(mesh, params) == 1  # not on the mesh: one program
  log = ChunkLog(monkeypatch)
  gen, stats = run((graphdef, placed), prompts, slots=REFILL_SLOTS, mesh=mesh)
  assert log.chunks == ref_chunks
  assert stats.inserts == ref_stats.inserts and stats.row_steps == ref_stats.row_steps
  assert stats.kv_needed == ref_stats.kv_needed
  assert_same_requests(gen, ref, logp_atol)


def test_decode_chunk_of_engine_replicas_has_no_collective(policy):
  """The compiled decode chunk on a data = 4 mesh with replicated parameters holds no
  collective (each device decodes alone); with the KV heads split over tensor = 2 it needs
  them, which shows the count reads the program."""
  if jax.device_count() < 8:
    pytest.skip("needs 8 (fake) devices; see tests/conftest.py")
  graphdef, params = policy

  def decode_collectives(mesh):
    placed = jax.tree.map(
        lambda x: jax.ShapeDtypeStruct(x.shape, x.dtype,
                                       sharding=NamedSharding(mesh, PartitionSpec())), params)
    progs = engine.lower_programs(graphdef, placed, slots=8, prompt_width=P_WIDTH,
                                  max_new_tokens=M, requests=R, temperature=TEMP,
                                  chunk_steps=4, mesh=mesh)
    return hlo.collectives(progs["decode"].as_text())

  four = jax.devices()[:4]
  assert decode_collectives(make_mesh(data=4, fsdp=1, tensor=1, devices=four)) == []
  assert len(decode_collectives(make_mesh(data=2, fsdp=1, tensor=2, devices=four))) > 0


def test_overlapped_host_check_reads_each_chunk_after_dispatching_the_next(
    policy, prompts, refilled, logp_atol, monkeypatch):
  """``overlap_host_check``: every chunk but the last is read by the host only after the
  next one was dispatched, and the requests come out the same (tokens exactly, log-probs
  within the reordering tolerance: the attention width covers the chunk in flight). The
  price: a freed slot is refilled a chunk later, so more row-steps run."""
  ref, ref_stats, _ = refilled
  events = []
  dispatch, to_host = engine._decode_chunk, engine.multihost.to_host

  def dispatched(*args, **kw):
    events.append("dispatch")
    return dispatch(*args, **kw)

  def read(tree):
    if isinstance(tree, dict) and "ran" in tree:
      events.append("read")
    return to_host(tree)

  monkeypatch.setattr(engine, "_decode_chunk", dispatched)
  monkeypatch.setattr(engine.multihost, "to_host", read)
  gen, stats = run(policy, prompts, slots=REFILL_SLOTS, overlap_host_check=True)
  assert_same_requests(gen, ref, logp_atol)
  assert events.count("dispatch") == events.count("read") == stats.chunks
  assert events[:3] == ["dispatch", "dispatch", "read"]
  # the j-th read comes after j + 1 dispatches (a chunk runs while the one before is read),
  # except where the tail's shrinks and the end read the chunk in flight first
  ahead = [events[:i].count("dispatch") - events[:i].count("read")
           for i, e in enumerate(events) if e == "read"]
  assert set(ahead) <= {1, 2} and ahead.count(2) >= stats.chunks // 2
  assert stats.row_steps > ref_stats.row_steps
  assert stats.useful_row_steps == ref_stats.useful_row_steps


# ---------------------------------------------------------------- a stream of rounds
ROUND_KEYS = (KEY, jax.random.key(8), jax.random.key(9))  # round 0 is the reference run


def stream_rounds(policy, prompts, monkeypatch=None, **kw):
  """``engine.stream`` of three rounds — the shared prompts, then reversed, then the
  reference order again — with keys ``ROUND_KEYS``; returns ({round: Generation as NumPy},
  EngineStats, decode steps run, the rounds held by the slots of each chunk)."""
  graphdef, params = policy
  toks, mask = prompts
  order = [np.arange(N), np.arange(N)[::-1], np.arange(N)]
  queue = [(toks[o], mask[o], k, j) for j, (o, k) in enumerate(zip(order, ROUND_KEYS))]
  got, held, steps = {}, [], []
  if monkeypatch is not None:
    original = engine._decode_chunk

    def logged(graphdef, params, state, *args, **kw):
      live = ~np.asarray(state.done)
      held.append(set((np.asarray(state.request)[live] // R).tolist()))  # regions decoding
      out = original(graphdef, params, state, *args, **kw)
      steps.append(int(np.max(out[1])))
      return out

    monkeypatch.setattr(engine, "_decode_chunk", logged)

  def deliver(tag, tokens, logprobs, full, length, versions):
    gen = as_generation(tokens, logprobs, full, versions, eos_ids=STOPS, pad_id=PAD)
    got[tag] = jax.tree.map(np.asarray, gen)

  args = dict(max_new_tokens=M, temperature=TEMP, eos_ids=STOPS, pad_id=PAD, group_size=G,
              chunk_steps=16, slots=REFILL_SLOTS) | kw
  stats = engine.stream(graphdef, params, lambda block: queue.pop(0) if queue else None,
                        deliver, **args)
  return got, stats, sum(steps), held


@pytest.mark.numerics
def test_stream_keeps_slots_full_across_rounds_with_each_rounds_tokens(
    policy, prompts, refilled, logp_atol, monkeypatch):
  """Three rounds streamed through 16 slots give each round what ``run`` gives it with its
  key (round 0 is the reference run): tokens and lengths exactly, log-probs within the
  reordering tolerance, delivered in order. The next round's requests take the slots a
  round's finished requests free, so chunks hold two rounds at once and the three rounds
  take fewer decode steps than three ``run`` calls: 136 against 3 × 56 here, every chunk
  but the last with its 16 slots decoding."""
  ref, _, ref_chunks = refilled
  got, stats, steps, held = stream_rounds(policy, prompts, monkeypatch)
  assert list(got) == [0, 1, 2]
  assert_same_requests(got[0], ref, logp_atol)
  toks, mask = prompts
  flipped, _ = run(policy, (toks[::-1], mask[::-1]), slots=REFILL_SLOTS, key=ROUND_KEYS[1])
  assert_same_requests(got[1], flipped, logp_atol)
  again, _ = run(policy, prompts, slots=REFILL_SLOTS, key=ROUND_KEYS[2])
  assert_same_requests(got[2], again, logp_atol)
  assert stats.useful_row_steps == sum(int(g.length.sum()) for g in got.values())
  assert any(len(h) == 2 for h in held)  # a chunk decoding two rounds' requests
  one_run_steps = sum(ran for _, ran in ref_chunks)
  assert steps < 0.85 * 3 * one_run_steps, (steps, one_run_steps)


@pytest.mark.numerics
def test_stream_on_engine_replicas_and_paged_equals_one_device(policy, prompts, logp_atol):
  """The stream with one engine per device (data = 8, replicated parameters: a round's
  region is cleared on every replica before its next round) and with the paged cache
  gives the one-device stream's rounds."""
  if jax.device_count() < 8:
    pytest.skip("needs 8 (fake) devices; see tests/conftest.py")
  ref, _, _, _ = stream_rounds(policy, prompts)
  graphdef, params = policy
  mesh = make_mesh(data=8, fsdp=1, tensor=1)
  placed = jax.device_put(params, NamedSharding(mesh, PartitionSpec()))
  replicas, _, _, _ = stream_rounds((graphdef, placed), prompts, mesh=mesh)
  paged, stats, _, _ = stream_rounds(policy, prompts, paged=True, page_size=4)
  for j in range(3):
    assert_same_requests(replicas[j], ref[j], logp_atol)
    assert_same_requests(paged[j], ref[j], logp_atol)
  assert stats.peak_pages > 0


def test_stream_rejects_a_round_of_another_shape_and_passes_on_an_abandon(policy, prompts):
  graphdef, params = policy
  toks, mask = prompts
  queue = [(toks, mask, KEY, 0), (toks[:4], mask[:4], KEY, 1)]
  kw = dict(max_new_tokens=M, temperature=TEMP, eos_ids=STOPS, pad_id=PAD, group_size=G)
  with pytest.raises(ValueError, match=r"\[16, 8\] prompts .* got \(4, 8\)"):
    engine.stream(graphdef, params, lambda block: queue.pop(0) if queue else None,
                  lambda *a: None, **kw)

  class Stop(Exception):
    pass

  def stop_after_one(block):
    if block and not stop_after_one.asked:
      stop_after_one.asked = True
      return toks, mask, KEY, 0
    raise Stop
  stop_after_one.asked = False
  delivered = []
  with pytest.raises(Stop):
    engine.stream(graphdef, params, stop_after_one, lambda tag, *a: delivered.append(tag), **kw)
  assert delivered == []  # asked for the next round before round 0 ended: abandoned


def test_stream_forces_each_rounds_lengths(policy, prompts):
  """Forced lengths per round (``run``'s ``forced_lengths``, a benchmark's control): each
  round stops exactly at its own; a round without them in a forced stream is refused."""
  graphdef, params = policy
  toks, mask = prompts
  forced = [np.arange(R) % M + 1, M - np.arange(R) % M]
  queue = [(toks, mask, k, j, f) for j, (k, f) in enumerate(zip(ROUND_KEYS, forced))]
  got = {}
  kw = dict(max_new_tokens=M, temperature=TEMP, eos_ids=STOPS, pad_id=PAD, group_size=G,
            slots=REFILL_SLOTS)
  engine.stream(graphdef, params, lambda block: queue.pop(0) if queue else None,
                lambda tag, tokens, logprobs, full, length, versions: got.update({tag: length}),
                **kw)
  np.testing.assert_array_equal(got[0], forced[0])
  np.testing.assert_array_equal(got[1], forced[1])
  queue = [(toks, mask, KEY, 0, forced[0]), (toks, mask, KEY, 1)]
  with pytest.raises(ValueError, match="forced_lengths must be given for every round"):
    engine.stream(graphdef, params, lambda block: queue.pop(0) if queue else None,
                  lambda *a: None, **kw)

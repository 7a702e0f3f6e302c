"""``policy.sample_completions``: decoded completions of a policy, each scored with its example."""

import jax
import numpy as np
import pytest
from flax import nnx

from jaxreplay.models import Transformer, TransformerConfig
from jaxreplay.models.tokenizer import train_bpe_tokenizer
from jaxreplay.tasks.base import Example
from jaxreplay.train.policy import TextIO, sample_completions


class _LengthTask:
  """Reward len(text) + 100 · int(answer): says which example and text each reward scored."""

  def reward(self, text, example):
    return float(len(text) + 100 * int(example.answer))


def _policy():
  tok = train_bpe_tokenizer([f"{a} + {b} = {a + b}" for a in range(10) for b in range(10)], 270)
  io = TextIO.create(tok, prompt_width=8)
  cfg = TransformerConfig(vocab_size=tok.get_vocab_size(), d_model=32, n_layers=1, n_heads=2,
                          n_kv_heads=1, head_dim=16, d_ff=64)
  graphdef, params = nnx.split(Transformer(cfg, nnx.Rngs(0)), nnx.Param)
  return io, graphdef, params


def test_sample_completions_scores_each_text_with_its_example():
  io, graphdef, params = _policy()
  examples = [Example(prompt=f"{i} + 1 =", answer=str(i)) for i in range(3)]
  kw = dict(max_new_tokens=5, temperature=1.0, samples_per_example=4)
  texts, rewards = sample_completions(graphdef, params, io, _LengthTask(), examples,
                                      jax.random.key(0), **kw)
  assert len(texts) == 3 and all(len(t) == 4 for t in texts)
  assert rewards.shape == (3, 4) and rewards.dtype == np.float32
  expected = [[len(t) + 100 * e for t in texts[e]] for e in range(3)]
  np.testing.assert_array_equal(rewards, np.array(expected, np.float32))
  assert len({t for row in texts for t in row}) > 1  # a random policy samples varied text
  again, _ = sample_completions(graphdef, params, io, _LengthTask(), examples,
                                jax.random.key(0), **kw)
  assert again == texts  # the key fixes the draw
  greedy, _ = sample_completions(graphdef, params, io, _LengthTask(), examples[:1],
                                 jax.random.key(1), max_new_tokens=5, temperature=0.0,
                                 samples_per_example=3)
  assert len(set(greedy[0])) == 1


def test_sample_completions_refuses_no_examples():
  io, graphdef, params = _policy()
  with pytest.raises(ValueError, match="samples_per_example"):
    sample_completions(graphdef, params, io, _LengthTask(), [], jax.random.key(0),
                       max_new_tokens=2, temperature=1.0)

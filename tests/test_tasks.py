"""Tasks: splits are deterministic and disjoint; rewards are binary and come from the task's scorer."""

import json

import ml_collections
import numpy as np
import pytest

from jaxreplay.models.tokenizer import (decode_completions, encode_answers, encode_prompts,
                                        train_bpe_tokenizer)
from jaxreplay.tasks import make_task
from jaxreplay.tasks.base import extract_answer
from jaxreplay.tasks.file_task import read_examples


def _cfg(**kw):
  c = dict(source="reasoning_gym", name="chain_sum", seed=7, train_size=300, heldout_size=200,
           kwargs=dict(min_terms=2, max_terms=3, min_digits=1, max_digits=1),
           prompt_template="{expression} =", train_path="", heldout_path="")
  c.update(kw)
  return ml_collections.ConfigDict(c)


@pytest.fixture(scope="module")
def task():
  return make_task(_cfg())


def test_splits_are_deterministic_and_disjoint(task):
  again = make_task(_cfg())
  assert [e.prompt for e in again.train] == [e.prompt for e in task.train]
  assert {e.prompt for e in task.heldout}.isdisjoint({e.prompt for e in task.train})
  assert len(task.heldout) + task.duplicates_dropped == 200
  assert task.duplicates_dropped > 0  # nearby space: dedup really removed something


def test_prompt_template_uses_the_expression(task):
  e = task.train[0]
  assert e.prompt == e.meta["metadata"]["expression"] + " ="
  assert str(eval(e.meta["metadata"]["expression"])) == e.answer  # noqa: S307


def test_reward_is_binary_and_uses_the_scorer(task):
  e = next(x for x in task.train if x.answer.lstrip("-").isdigit() and len(x.answer) == 1)
  assert task.reward(" " + e.answer, e) == 1.0
  assert task.reward(f" {int(e.answer) + 1}", e) == 0.0
  # reasoning-gym gives partial credit to "<answer>1" style near misses; ours is binary.
  assert task.reward(" 1" + e.answer, e) == 0.0
  assert task.reward("", e) == 0.0
  assert task.reward("3 + 4 = " + e.answer, e) == 1.0  # text after the last "=" wins


@pytest.mark.parametrize("text,expected", [(" 12", "12"), ("", None), ("  ", None),
                                           ("1 + 2 = 3", "3"), (" -4 ", "-4")])
def test_extract_answer(text, expected):
  assert extract_answer(text) == expected


def test_unknown_task_name_lists_valid_ones():
  with pytest.raises(ValueError, match="chain_sum"):
    make_task(_cfg(name="chain_summ"))


def test_bad_template_field_is_named():
  with pytest.raises(ValueError, match="prompt_template.*expression"):
    make_task(_cfg(prompt_template="{expr} ="))


def test_jsonl_rows_malformed_are_skipped_and_counted(tmp_path):
  p = tmp_path / "d.jsonl"
  p.write_bytes(b'{"question": "1 + 1 =", "answer": "2"}\n'
                b'not json\n'
                b'{"question": "", "answer": "3"}\n'
                b'{"answer": "3"}\n'
                b'\xff\xfe\n'
                + json.dumps({"question": "2 + 2 =", "answer": 4}).encode() + b"\n")
  ex, skipped = read_examples(str(p), "jsonl")
  assert [(e.prompt, e.answer) for e in ex] == [("1 + 1 =", "2"), ("2 + 2 =", "4")]
  assert skipped == 4


def test_jsonl_missing_or_empty_file_is_a_clear_error(tmp_path):
  with pytest.raises(FileNotFoundError, match="nope.jsonl"):
    read_examples(str(tmp_path / "nope.jsonl"), "jsonl")
  (tmp_path / "e.jsonl").write_text("bad\n")
  with pytest.raises(ValueError, match="no valid rows"):
    read_examples(str(tmp_path / "e.jsonl"), "jsonl")


def test_tokenizer_round_trip_and_left_padding(task):
  tok = train_bpe_tokenizer([e.prompt + " " + e.answer for e in task.train], 300)
  assert [tok.token_to_id(t) for t in ("<pad>", "<bos>", "<eos>")] == [0, 1, 2]
  toks, mask, keep = encode_prompts(tok, ["1 + 2 =", "12 - 3 + 4 ="], 12)
  assert keep.all()
  assert mask[0].sum() < mask[1].sum()
  # left padding: real tokens are a suffix, the first real token is <bos>
  for row, m in zip(toks, mask):
    first = int(np.argmax(m))
    assert m[first:].all() and not m[:first].any() and row[first] == 1
  # digits are single tokens
  assert tok.encode("12345").ids == [tok.token_to_id(c) for c in "12345"]
  ans, am = encode_answers(tok, ["-17", "4"], 6)
  assert decode_completions(tok, ans, am) == [" -17", " 4"]
  assert ans[1, am[1].sum() - 1] == 2  # ends with <eos>


def test_too_long_prompts_truncate_or_skip(task):
  tok = train_bpe_tokenizer([e.prompt for e in task.train], 300)
  long = "1 + 2 + 3 + 4 + 5 + 6 + 7 ="
  t, m, keep = encode_prompts(tok, [long], 6, "truncate_left")
  assert keep[0] and m[0].all()
  assert tok.decode(t[0].tolist()).endswith("7 =")
  t, m, keep = encode_prompts(tok, [long, "1 + 2 ="], 6, "skip")
  assert keep.tolist() == [False, True] and not m[0].any()
  with pytest.raises(ValueError, match="on_too_long"):
    encode_prompts(tok, [long], 6, "drop")

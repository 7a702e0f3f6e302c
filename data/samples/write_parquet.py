"""Writes the Parquet copies of this folder's JSONL samples (``python data/samples/write_parquet.py``).

The samples were written for jaxreplay's tests in the shape of the public datasets (GSM8K:
question/answer with ``#### N``; MATH: problem/solution with ``\\boxed{}``; OpenR1-Math:
problem/solution/answer); no row is copied from a dataset.
"""

import glob
import json
import os

import pyarrow as pa
import pyarrow.parquet as pq

HERE = os.path.dirname(os.path.abspath(__file__))


def main():
  for path in sorted(glob.glob(os.path.join(HERE, "*.jsonl"))):
    with open(path) as f:
      rows = [json.loads(line) for line in f if line.strip()]
    out = path[:-len(".jsonl")] + ".parquet"
    pq.write_table(pa.Table.from_pylist(rows), out)
    print(f"{out}: {len(rows)} rows")


if __name__ == "__main__":
  main()

"""Collectives of a compiled XLA program, read from its optimized HLO text.

``collectives(hlo_text)`` lists every all-reduce, all-gather, reduce-scatter, all-to-all
and collective-permute with its bytes and how many times one run of the program executes
it: an op inside a ``while`` body counts once per trip (the layer scan, the
micro-batch scan, the log-prob chunks), using the trip count XLA records
(``known_trip_count``) or, failing that, the loop condition's ``compare`` against a
constant. Bytes are those of the whole array the collective produces or reduces (the
all-gather's output, the reduce-scatter's input, the all-reduce's operand), in the
dtype the compiled program moves: XLA:CPU runs bfloat16 collectives in float32, so on
fake CPU devices bf16 traffic counts 4 bytes per element.

Text processing (jax is imported only by ``param_sizes``), for tests and benches to
apply to ``jax.jit(f).lower(...).compile().as_text()``.
"""

from __future__ import annotations

import dataclasses
import re
from collections import defaultdict

KINDS = ("all-reduce", "all-gather", "reduce-scatter", "all-to-all", "collective-permute")
DTYPE_BYTES = {"pred": 1, "s8": 1, "u8": 1, "s16": 2, "u16": 2, "f16": 2, "bf16": 2,
               "s32": 4, "u32": 4, "f32": 4, "s64": 8, "u64": 8, "f64": 8, "c64": 8,
               "c128": 16}

_COMP = re.compile(r"^(?:ENTRY\s+)?%?([\w.\-]+)\s+\(.*\)\s*->\s*.*\{\s*$")
_OP = re.compile(r"^\s*(?:ROOT\s+)?%?[\w.\-]+\s*=\s*(.+?)\s+([\w\-]+)\((.*)$")
_ARRAY = re.compile(r"(\w+)\[([\d,]*)\]")
_CALLS = re.compile(r"(?:calls|to_apply|body|condition|branch_computations|"
                    r"true_computation|false_computation)=(\{[%\w.\-, ]+\}|%?[\w.\-]+)")
_TRIP = re.compile(r'"known_trip_count":\{"n":"(\d+)"')
_GROUPS_IOTA = re.compile(r"replica_groups=\[(\d+),(\d+)\]")
_GROUPS_LIST = re.compile(r"replica_groups=\{\{([\d,]*)\}")


@dataclasses.dataclass(frozen=True)
class Collective:
  """One collective op of a compiled program.

  Attributes:
    kind: one of ``KINDS`` (an async ``-start`` op under its plain name).
    shapes: tuple of (dtype, dims) of the arrays it moves (several for a combined op).
    nbytes: bytes of the whole arrays moved (module docstring).
    count: executions per run of the program (product of enclosing loops' trip counts).
    computation: the HLO computation that holds it.
  """

  kind: str
  shapes: tuple[tuple[str, tuple[int, ...]], ...]
  nbytes: int
  count: int
  computation: str

  @property
  def total_bytes(self) -> int:
    """Bytes moved per run of the program: ``nbytes × count``."""
    return self.nbytes * self.count


def array_bytes(dtype: str, dims: tuple[int, ...]) -> int:
  """Bytes of one HLO array: the product of ``dims`` (ints; () is a scalar) times the
  element size of ``dtype`` (an HLO type name such as ``bf16``, ``f32``; 4 bytes for a
  name not in ``DTYPE_BYTES``). Raises nothing."""
  n = 1
  for d in dims:
    n *= d
  return n * DTYPE_BYTES.get(dtype, 4)


def _shapes(type_text: str) -> tuple[tuple[str, tuple[int, ...]], ...]:
  return tuple((m.group(1), tuple(int(d) for d in m.group(2).split(",") if d))
               for m in _ARRAY.finditer(type_text) if m.group(1) in DTYPE_BYTES)


def _group_size(line: str) -> int:
  m = _GROUPS_IOTA.search(line)
  if m:
    return int(m.group(2))
  m = _GROUPS_LIST.search(line)
  return len(m.group(1).split(",")) if m else 1


def _split_computations(hlo_text: str) -> tuple[dict[str, list[str]], str]:
  """Computation name -> its op lines, and the ENTRY computation's name."""
  comps, entry, name = {}, "", None
  for line in hlo_text.splitlines():
    m = _COMP.match(line)
    if m:
      name = m.group(1)
      comps[name] = []
      if line.startswith("ENTRY"):
        entry = name
    elif name is not None and line.strip() == "}":
      name = None
    elif name is not None:
      comps[name].append(line)
  return comps, entry


def _trip_count(line: str, comps: dict[str, list[str]]) -> int:
  """Trips of a ``while`` op: XLA's ``known_trip_count``, else its condition's bound."""
  m = _TRIP.search(line)
  if m:
    return int(m.group(1))
  cond = re.search(r"condition=%?([\w.\-]+)", line)
  for op in comps.get(cond.group(1) if cond else "", ()):
    c = re.search(r"constant\((\d+)\)", op)
    if c:
      return int(c.group(1))
  return 1


def execution_counts(hlo_text: str) -> dict[str, int]:
  """Computation name -> times it runs per run of the program (0 if never called).

  A ``while`` body and condition run once per trip; fusions, calls, reducers and
  conditional branches once per execution of their caller (a branch is counted as if
  taken: an upper bound).
  """
  comps, entry = _split_computations(hlo_text)
  edges = defaultdict(list)  # caller -> [(callee, factor)]
  for name, lines in comps.items():
    for line in lines:
      is_while = re.search(r"\swhile\(", line) is not None
      trips = _trip_count(line, comps) if is_while else 1
      for group in _CALLS.finditer(line):
        for callee in group.group(1).strip("{}").split(","):
          callee = callee.strip().lstrip("%")
          if callee in comps:
            edges[name].append((callee, trips))
  counts = defaultdict(int)

  def visit(name: str, mult: int, depth: int = 0) -> None:
    if depth > 64:  # HLO call graphs are acyclic; this only bounds malformed text
      return
    counts[name] += mult
    for callee, factor in edges[name]:
      visit(callee, mult * factor, depth + 1)

  if entry:
    visit(entry, 1)
  return dict(counts)


def collectives(hlo_text: str) -> list[Collective]:
  """Every collective op of an optimized HLO module, with bytes and execution count.

  Args:
    hlo_text: ``compiled.as_text()`` of a jitted function (one HLO module).

  Returns:
    list of ``Collective`` in text order; ``-done`` halves of async pairs are skipped
    (their ``-start`` is counted). Ops in computations never reached from ENTRY get
    count 0.
  """
  comps, _ = _split_computations(hlo_text)
  counts = execution_counts(hlo_text)
  out = []
  for name, lines in comps.items():
    for line in lines:
      m = _OP.match(line)
      if not m:
        continue
      kind = m.group(2).removesuffix("-start")
      if kind not in KINDS:
        continue
      shapes = _shapes(m.group(1))
      if m.group(2).endswith("-start") and len(shapes) > 1:
        shapes = shapes[len(shapes) // 2:]  # (operands..., results...): the results
      nbytes = sum(array_bytes(d, s) for d, s in shapes)
      if kind == "reduce-scatter":
        nbytes *= _group_size(line)
      out.append(Collective(kind, shapes, nbytes, counts.get(name, 0), name))
  return out


def bytes_by_kind(ops: list[Collective]) -> dict[str, int]:
  """Per-run bytes summed per collective kind (every ``KINDS`` key present)."""
  out = dict.fromkeys(KINDS, 0)
  for op in ops:
    out[op.kind] += op.total_bytes
  return out


def param_sizes(params) -> set[int]:
  """Element counts that mark a collective's array as a parameter (or its gradient):
  every leaf's whole size and, for a leaf stacked over layers (a ``blocks`` path of
  rank ≥ 2), one layer's.

  Args:
    params: pytree of arrays or ``jax.ShapeDtypeStruct`` (only shapes are read).
  """
  import jax
  sizes = set()
  for path, x in jax.tree_util.tree_leaves_with_path(params):
    n = 1
    for d in x.shape:
      n *= d
    sizes.add(n)
    if "blocks" in jax.tree_util.keystr(path) and len(x.shape) > 1:
      sizes.add(n // x.shape[0])
  return sizes


def _elements(dims: tuple[int, ...]) -> int:
  n = 1
  for d in dims:
    n *= d
  return n


def split_bytes(op: Collective, sizes: set[int]) -> tuple[int, int]:
  """(bytes of parameter-sized arrays, bytes of the others) ``op`` moves per run of the
  program (``total_bytes`` split array by array for a combined op)."""
  arrays = [(array_bytes(d, s), _elements(s) in sizes) for d, s in op.shapes]
  scale = op.total_bytes / max(1, sum(b for b, _ in arrays))
  param = int(sum(b for b, is_param in arrays if is_param) * scale)
  return param, op.total_bytes - param


def learner_traffic(hlo_text: str, sizes: set[int]) -> dict:
  """A compiled learner step's collective bytes per run, by what they move.

  Arrays of a parameter's size (``param_sizes``) in all-gathers are parameter gathers;
  in all-reduces and reduce-scatters, gradient reductions (XLA:CPU emits an all-reduce
  and a slice where GPU and TPU passes form a reduce-scatter: the same bytes here).
  Every other all-reduced array is an activation (hidden states, norm statistics,
  logits).

  Args:
    hlo_text: the optimized HLO. sizes: ``param_sizes`` of the parameters.

  Returns:
    dict of ints: ``activation_allreduce``, ``param_allgather``, ``grad_reduce`` and
    ``total`` bytes; ``largest_activation_allreduce``, the most elements of one
    non-parameter array an all-reduce sums (0 if none); ``by_kind`` (``bytes_by_kind``).
  """
  ops = collectives(hlo_text)
  out = dict(activation_allreduce=0, param_allgather=0, grad_reduce=0,
             largest_activation_allreduce=0)
  for op in ops:
    if not op.count:
      continue
    param, other = split_bytes(op, sizes)
    if op.kind == "all-gather":
      out["param_allgather"] += param
    elif op.kind in ("all-reduce", "reduce-scatter"):
      out["grad_reduce"] += param
    if op.kind == "all-reduce":
      out["activation_allreduce"] += other
      out["largest_activation_allreduce"] = max(
          [out["largest_activation_allreduce"]] +
          [_elements(s) for _, s in op.shapes if _elements(s) not in sizes])
  out["total"] = sum(op.total_bytes for op in ops)
  out["by_kind"] = bytes_by_kind(ops)
  return out

"""A rerun of an archived run against the archive: what differs, and whether it is noise.

``python -m jaxreplay.sweep --config F --import-runs A.tar.xz --verify REGEX`` reruns the
chosen archived runs from the archived warm-start weights (``sweep.import_base_policies``)
in ``WORKDIR/verify/NAME/seedK`` and compares each rerun with its archived run here. The
same program on the same kind of machine repeats a run bit for bit (every evaluation
identical); on another CPU, XLA's floating-point results differ in the last bits and the
run drifts like a run of another seed's noise, but with the seed's warm start held fixed.
The expected band is then that of two runs of one seed and configuration under the noise
model fitted to the sweep's runs (``null.auc_difference_sd``: run offsets and evaluation
jitter, the seed's offset cancelling): the AUC difference should fall within 1.96 of its SD.
"""

from __future__ import annotations

import dataclasses

from jaxreplay.study import stats

Z95 = 1.959964   # two-sided 95% normal quantile


@dataclasses.dataclass(frozen=True)
class Verdict:
  """One rerun against its archived run.

  Attributes:
    name, seed: the run. evals: evaluations compared (those at the same learner step in
    both). identical: how many of them have bit-identical sampled accuracy and generated
    tokens. max_abs_diff: largest |rerun − archive| sampled accuracy over them. auc_archive,
    auc_rerun: ``stats.log_auc`` of each curve up to the budget (the smaller of the two
    runs' last generated tokens). sd: SD of the AUC difference expected between two runs of
    one seed (NaN without a noise model).
  """

  name: str
  seed: int
  evals: int
  identical: int
  max_abs_diff: float
  auc_archive: float
  auc_rerun: float
  sd: float

  @property
  def diff(self) -> float:
    """AUC of the rerun minus the archive's (accuracy units)."""
    return self.auc_rerun - self.auc_archive

  @property
  def band(self) -> float:
    """Half-width of the 95% band the difference should fall in (NaN without a model)."""
    return Z95 * self.sd

  @property
  def bit_identical(self) -> bool:
    return self.evals > 0 and self.identical == self.evals

  @property
  def within(self) -> bool:
    """Bit-identical, or the AUC difference inside the band (False without a model)."""
    return self.bit_identical or abs(self.diff) <= self.band

  def line(self) -> str:
    """One human-readable line."""
    if self.bit_identical:
      how = "bit-identical (same program, same kind of machine)"
    elif self.sd == self.sd:
      how = (f"{'within' if self.within else 'OUTSIDE'} the band ±{self.band:.3f} expected "
             f"of two runs of one seed (1.96 × SD {self.sd:.3f} under the runs' noise model)")
    else:
      how = "no noise model to judge it (not a regime-map sweep)"
    return (f"verify {self.name} seed{self.seed}: rerun − archive AUC {self.diff:+.4f} "
            f"({self.auc_rerun:.4f} vs {self.auc_archive:.4f}); {self.identical}/{self.evals} "
            f"evaluations identical, largest difference {self.max_abs_diff:.4f}: {how}")


def compare(archived, rerun, sd: float = float("nan")) -> Verdict:
  """``Verdict`` of ``rerun`` against ``archived`` (``study.runs.RunData`` each).

  Args:
    archived, rerun: the runs (same configuration and seed). sd: SD of the AUC difference
      of two runs of one seed (``null.auc_difference_sd``), or NaN.

  Returns:
    The verdict.

  Raises:
    ValueError: a run without evaluations.
  """
  if not archived.evals or not rerun.evals:
    raise ValueError(f"{archived.name} seed{archived.seed}: a run without evaluations")
  a = {r["step"]: r for r in archived.evals}
  b = {r["step"]: r for r in rerun.evals}
  steps = sorted(set(a) & set(b))
  same = sum(a[s]["eval/acc_sampled"] == b[s]["eval/acc_sampled"]
             and a[s].get("generated_tokens") == b[s].get("generated_tokens") for s in steps)
  mad = max((abs(a[s]["eval/acc_sampled"] - b[s]["eval/acc_sampled"]) for s in steps),
            default=float("nan"))
  (ta, ya), (tb, yb) = archived.curve(), rerun.curve()
  budget = float(min(ta[-1], tb[-1]))
  auc_a = float(stats.log_auc(ta, ya, budget)) if budget > 0 else float("nan")
  auc_b = float(stats.log_auc(tb, yb, budget)) if budget > 0 else float("nan")
  return Verdict(archived.name, archived.seed, len(steps), int(same), float(mad), auc_a, auc_b,
                 float(sd))


def summary_line(verdicts: list[Verdict]) -> str:
  """``verify runs=N identical=I within_band=W`` (W counts the identical ones too)."""
  return (f"verify runs={len(verdicts)} identical={sum(v.bit_identical for v in verdicts)} "
          f"within_band={sum(v.within for v in verdicts)}")

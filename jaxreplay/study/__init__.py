"""What a sweep's runs support: the statistics of the study.

Imports go one way, each module using only the ones before it:

  ``stats`` (intervals, paired comparisons, curve summaries) ← ``fit`` (the saturating
  compute curve) ← ``null`` (the noise model and the null simulator of decision rules).

These modules read arrays only (numpy, scipy); nothing in them knows a run file.
"""

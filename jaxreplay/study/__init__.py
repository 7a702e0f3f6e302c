"""What a sweep's runs support: the statistics of the study, the runs as data, the tables
and figures of the report.

Imports go one way, each module using only the ones before it:

  ``stats`` (intervals, paired comparisons, curve summaries) ← ``fit`` (the saturating
  compute curve) ← ``null`` (the noise model and the null simulator of decision rules)
  ← ``runs`` (a sweep's run files as curves and per-run metrics) ← ``evidence`` (a regime's
  comparisons, decisions, fits and y* checks) ← ``tables`` (markdown) and ``figures``
  (matplotlib) ← ``jaxreplay.regime_map`` ← ``jaxreplay.report``.

``stats``, ``fit`` and ``null`` read arrays only (numpy, scipy); nothing in them knows a
run file.
"""

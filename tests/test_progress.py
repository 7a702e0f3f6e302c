"""Progress of the long phases: a bar on stderr while a phase runs (none when disabled) and
one closing log line with the phase's duration either way."""

import re

from jaxreplay.train.progress import phase


def test_a_disabled_phase_prints_no_bar_but_logs_its_duration(capfd):
  lines = []
  with phase("eval step 25", enabled=False, log=lines.append, total=4) as bar:
    bar.update(4)
  out, err = capfd.readouterr()
  assert out == "" and err == ""
  assert len(lines) == 1 and re.fullmatch(r"eval step 25: \d+\.\ds", lines[0])


def test_an_enabled_phase_draws_its_bar_on_stderr(capfd):
  lines = []
  with phase("warm start", enabled=True, log=lines.append, total=3, unit="step") as bar:
    for _ in range(3):
      bar.update(1)
  out, err = capfd.readouterr()
  assert out == "" and "warm start: 0%| | 0/3" in re.sub(" +", " ", err)
  assert len(lines) == 1 and lines[0].startswith("warm start: ")

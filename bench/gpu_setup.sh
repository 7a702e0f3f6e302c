#!/usr/bin/env bash
# Sourced by the GPU scripts (bench/gpu_session.sh, bench/gpu_peer.sh) after they set OUT,
# BUDGET_S and start: defines their timed `step`, then installs the runtime dependencies the
# device machine's image lacks from the wheels carried in .gpu/ (see bench/gpu_session.sh's
# header for how they are made), builds or stubs pycosat, uses the pinned flax/optax/chex/orbax-checkpoint where the image's are outside
# pyproject's range, and exports PYTHONPATH so jaxreplay imports from this checkout.
: "${start:=$SECONDS}" "${OUT:=/tmp}" "${BUDGET_S:=450}"
# left: seconds left of BUDGET_S. step NAME MAX_S MIN_S CMD...: CMD (stderr merged) under
# timeout min(MAX_S, time left), skipped when under MIN_S is left, so one hang does not eat
# the rest of a device session.
left() { echo $((BUDGET_S - (SECONDS - start))); }
step() {
  local name=$1 max=$2 min=$3 t t0 rc
  shift 3
  t=$(left)
  ((t > max)) && t=$max
  if ((t < min)); then
    echo "=== $name: skipped ($(left) s left of $BUDGET_S)"
    return 0
  fi
  echo "=== $name (timeout ${t} s, at $((SECONDS - start)) s): $*"
  t0=$SECONDS
  timeout -k 10 "$t" "$@" 2>&1
  rc=$?
  echo "=== $name: rc=$rc after $((SECONDS - t0)) s$( ((rc == 124 || rc == 137)) && echo ' (timed out)')"
}

echo "=== setup"
nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv,noheader
SITE=/tmp/site
mkdir -p "$SITE"
python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade \
  --target "$SITE" .gpu/deps/*.whl 2>&1 | grep -v -i warning
export PYTHONPATH="$SITE":$PWD
if ! python3 -c "import pycosat" 2>/dev/null; then
  timeout 45 python3 -m pip install -q --no-index --no-deps --no-build-isolation --no-cache-dir \
    --target "$SITE" .gpu/src/pycosat-*.tar.gz >"$OUT/pycosat_build.txt" 2>&1 || tail -3 "$OUT/pycosat_build.txt"
  rm -f "$OUT/pycosat_build.txt"
  if python3 -c "import pycosat" 2>/dev/null; then
    echo "pycosat: built from its sdist"
  else
    printf '%s\n' '"""Stub (bench/gpu_session.sh): the C extension could not be built here."""' \
      'def _missing(*args, **kwargs):' \
      '  raise ImportError("pycosat is a stub on this machine")' \
      'solve = itersolve = _missing' >"$SITE"/pycosat.py
    echo "pycosat: stub (reasoning-gym imports it; chain_sum never calls it)"
  fi
fi
# versions of pyproject's runtime dependencies; prints the pinned wheels to use instead
python3 - >/tmp/replace.txt <<'PY'
import importlib.metadata as md, sys, tomllib
from packaging.requirements import Requirement
deps = tomllib.load(open("pyproject.toml", "rb"))["project"]["dependencies"]
carried = {"flax", "optax", "chex", "orbax-checkpoint"}
for line in deps:
  r = Requirement(line)
  try:
    v = md.version(r.name)
  except md.PackageNotFoundError:
    v = None
  ok = v is not None and r.specifier.contains(v, prereleases=True)
  print(f"{r.name:18s} {v or 'MISSING':12s} {'ok' if ok else 'outside ' + str(r.specifier)}",
        file=sys.stderr)
  if not ok and r.name in carried:
    print(r.name.replace("-", "_"))
PY
while read -r name; do
  python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade \
    --target "$SITE" .gpu/wheels/"$name"-*.whl && echo "using carried $name"
done </tmp/replace.txt
IMPORTS="import jaxreplay.train.loop, jaxreplay.tasks.reasoning_gym_task, math_verify, tensorboardX"
if ! python3 -c "$IMPORTS" 2>/tmp/import_err.txt; then
  tail -5 /tmp/import_err.txt
  python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade \
    --target "$SITE" .gpu/wheels/*.whl && echo "using all carried pinned wheels"
  python3 -c "$IMPORTS" || echo "jaxreplay still does not import"
fi
python3 -c "import jax, flax, optax, chex, orbax.checkpoint as o; print('jax', jax.__version__, 'flax', flax.__version__, 'optax', optax.__version__, 'chex', chex.__version__, 'orbax', o.__version__, jax.devices())"
echo "=== setup done at $((SECONDS - start)) s"

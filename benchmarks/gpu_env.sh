# Sourced by the device scripts, from the repo root: $OUT (default ./gpu-session) made, pydantic's
# wheels from .whl/ installed where the image lacks them (see the device tool's README), the repo
# on PYTHONPATH, Python's output unbuffered. Each script sets its own COLUMNS.
OUT=${OUT:-$PWD/gpu-session}
mkdir -p "$OUT"
if compgen -G ".whl/*.whl" > /dev/null; then
  python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl || exit 1
  export PYTHONPATH="/tmp/site:${PYTHONPATH:-}"
fi
export PYTHONPATH="$PWD:${PYTHONPATH:-}" PYTHONUNBUFFERED=1

#!/usr/bin/env bash
# The CUDA validation kit (bench/cuda_check.py, on the harness in bench/harness/): one script, under
# 8 minutes on one GPU, for a session that is lent one. Runs the suite's CUDA tests (`pytest -m cuda`), then
# the checks, and writes bench/results/cuda-*.json (and copies them to $OUT when that is set, as on the
# device machine).
#
#   bash bench/cuda_check.sh                       # on a machine with a GPU
#   bash bench/cuda_check.sh --device cpu --quick  # a dry run anywhere (seconds; CI's tests run it)
#
# PY picks the interpreter: .venv/bin/python when it exists, else python3 with src/ on PYTHONPATH
# (a machine with its own CUDA PyTorch and no venv).
set -uo pipefail
cd "$(dirname "$0")/.."
if [ -z "${PY:-}" ]; then
  if [ -x .venv/bin/python ]; then PY=.venv/bin/python; else PY=python3; export PYTHONPATH="$PWD/src${PYTHONPATH:+:$PYTHONPATH}"; fi
fi
export MALLOC_MMAP_THRESHOLD_=65536 PYTHONUNBUFFERED=1
# TORCHCKPT_COMMIT first: a copied tree (the device machine) may carry a .git that is not the commit tested.
commit=${TORCHCKPT_COMMIT:-$(git rev-parse HEAD 2>/dev/null || echo unknown)}
mkdir -p bench/results
status=0
case " $* " in
  *" --device cpu "*) ;;  # a dry run: the CUDA tests would only skip
  *) timeout 150 "$PY" -m pytest -q -p no:cacheprovider --continue-on-collection-errors -m cuda tests 2>&1 | tail -n 30 | tee bench/results/cuda-pytest.txt
     status=${PIPESTATUS[0]} ;;
esac
timeout 330 "$PY" bench/cuda_check.py --commit "$commit" "$@" || status=$?
if [ -n "${OUT:-}" ]; then cp bench/results/cuda-* "$OUT"/ 2>/dev/null || true; fi
exit "$status"

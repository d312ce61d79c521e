#!/usr/bin/env bash
# The whole test suite, exactly as CI runs it (.ci/run calls this script): installs what
# the tests need into the active Python environment (a fresh venv, say), checks the
# builds, then runs the tests on the compiled core, on the interpreted core, and the
# kernel tests again on the oldest Triton the project declares.
#
# torch: the tests need torch 2.13.0. Where pip would fetch the CUDA build (a large
# download), install the CPU build first with pip's --index-url pointed at PyTorch's CPU
# wheel index; torch==2.13.0 below is then already satisfied and stays the CPU build.
set -euo pipefail
cd "$(dirname "$0")/.."
# The Triton range of the `kernels` extra in pyproject.toml: the newest is the suite's,
# the oldest gets the kernel tests once more (its interpreter needs NumPy < 2.4).
TRITON_NEWEST="3.9.0"
TRITON_OLDEST="3.6.0"

python -m pip install --quiet --upgrade pip
# Builds the compiled core (mypyc; setup.py) into build/native, outside the source folders
# (kvtwin._native loads it from there): the tests below run it first.
python -m pip install --quiet -e ".[test,cluster]"
python -m pip install --quiet torch==2.13.0 "triton==$TRITON_NEWEST"
if ! kvtwin --version | grep -q "core: compiled"; then
    echo "kvtwin: the compiled core did not build here (a C compiler is needed): $(kvtwin --version)"
    exit 1
fi
if [ -n "$(find sim kvtwin -name '*.so' -print -quit)" ]; then
    echo "kvtwin: the editable build left compiled modules beside the sources: $(find sim kvtwin -name '*.so')"
    exit 1
fi

scratch="$(mktemp -d)"
trap 'rm -rf "$scratch"' EXIT
# A regular (non-editable) install must work too: build the wheel (its compiled modules
# inside the package, beside the sources there), install it into a fresh venv and run the
# default replay from another working directory, so nothing may depend on the checkout
# (scenarios, bundled traces and presets are package data).
python -m pip wheel --quiet --no-deps -w "$scratch/wheel" . 2>/dev/null
python -m venv "$scratch/wheel-venv"
"$scratch/wheel-venv/bin/python" -m pip install --quiet "$scratch"/wheel/kvtwin-*.whl
(cd "$scratch" && "$scratch/wheel-venv/bin/kvtwin" replay --limit 200 --quiet --out "$scratch/run" >/dev/null)
test -f "$scratch/run/summary.parquet"
# The bundled calibrations are package data too: the default scenario's GPU gets its own.
"$scratch/wheel-venv/bin/python" -c "import pyarrow.parquet as pq, sys; \
label = pq.read_table(sys.argv[1]).column('calibration')[0].as_py(); \
sys.exit(0 if label.startswith('bundled b200') else f'the wheel replayed on {label!r}')" "$scratch/run/summary.parquet"
"$scratch/wheel-venv/bin/kvtwin" --version | grep -q "core: compiled"
# Without a C compiler the build falls back to the interpreted core, with one notice.
CC=false python -m pip wheel -v --no-deps -w "$scratch/wheel-nocc" . > "$scratch/wheel.log" 2>&1
grep -q "kvtwin: notice: no working C compiler" "$scratch/wheel.log"
if python -c "import sys, zipfile; sys.exit(not any(n.endswith('.so') for n in zipfile.ZipFile(sys.argv[1]).namelist()))" \
        "$scratch"/wheel-nocc/kvtwin-*.whl; then
    echo "compiled modules in a wheel built without a compiler"
    exit 1
fi

# The suite on the compiled core ...
# (on every core, up to four: pytest-xdist workers; CI's two cores nearly halve its time)
PARALLEL=(-n auto --maxprocesses 4)
python -m pytest -q "${PARALLEL[@]}"
# ... on the Python source of the same modules ...
KVTWIN_INTERPRETED=1 python -m pytest -q "${PARALLEL[@]}"
# ... and the kernels on the oldest declared Triton, shadowing the newest for this run only.
python -m pip install --quiet --no-deps --target "$scratch/triton-oldest" "triton==$TRITON_OLDEST" "numpy<2.4"
PYTHONPATH="$scratch/triton-oldest" python -c "import triton; assert triton.__version__ == '$TRITON_OLDEST'"
PYTHONPATH="$scratch/triton-oldest" python -m pytest -q -p no:cacheprovider tests/kernels tests/executor

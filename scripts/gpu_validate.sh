#!/usr/bin/env bash
# The GPU half of `kvtwin validate` and the kernel benchmark, on one GPU, with no network.
#
#   OUT=/some/dir scripts/gpu_validate.sh          # or: scripts/gpu_validate.sh /some/dir
#
# Installs nothing. Runs from a plain checkout (the project is carried in as source): a
# throw-away directory maps the kvtwin.* namespace onto the checkout's folders, exactly as
# pyproject.toml's package-dir does. Needs torch with CUDA, Triton, numpy, pyarrow,
# pandas, simpy, typer and rich; says which are missing before anything runs.
#
# Writes under $OUT: kernels/ (bench/gpu_kernels.py: correctness at real sizes, decode
# bandwidth, prefill throughput), validate-llama8b/ (all four checks on Llama-3.1-8B at
# real size), validate-hybrid-*/ (checks 1 and 2 on hybrid layouts), and log.txt with
# every line printed. Budget: about 8 minutes on an H200; each stage has its own timeout
# so one slow stage cannot starve the rest.
#
# Every validation runs at --size full (the scenario's own lengths, times and pool).
# GPU_VALIDATE_DEVICE=cpu runs the same stages on a CPU at toy sizes (the scaled model,
# two requests each, the benchmark's --smoke), so the script itself is tested without a GPU.
set -uo pipefail
cd "$(dirname "$0")/.."
repo="$PWD"
OUT="${1:-${OUT:-$repo/gpu-validate-out}}"
mkdir -p "$OUT"
log="$OUT/log.txt"
: >"$log"
say() { echo "$*" | tee -a "$log"; }

missing=$(python3 - <<'PY'
import importlib.util
need = ["torch", "triton", "numpy", "pyarrow", "pandas", "simpy", "typer", "rich"]
print(" ".join(n for n in need if importlib.util.find_spec(n) is None))
PY
)
if [ -n "$missing" ]; then
    say "gpu_validate: missing Python packages: $missing (this script installs nothing)"
    exit 2
fi

# kvtwin.* from the checkout: kvtwin/ itself plus one link per mapped folder.
site="$(mktemp -d)"
trap 'rm -rf "$site"' EXIT
mkdir "$site/kvtwin"
for entry in "$repo"/kvtwin/*; do ln -s "$entry" "$site/kvtwin/"; done
for pkg in sim traces kernels executor reports scenarios; do ln -s "$repo/$pkg" "$site/kvtwin/$pkg"; done
export PYTHONPATH="$site${PYTHONPATH:+:$PYTHONPATH}"
kvtwin() { python3 -c 'from kvtwin.cli import app; app()' "$@"; }

device="${GPU_VALIDATE_DEVICE:-cuda}"
if [ "$device" = cpu ]; then
    n() { echo 2; }; bench_args=(--smoke); stage_timeout() { echo 300; }
else
    n() { echo "$1"; }; bench_args=(--quick); stage_timeout() { echo "$1"; }
fi

# GPU_VALIDATE_STAGES=backends,bench,llama,gemma,qwen picks stages (default: all).
stages=",${GPU_VALIDATE_STAGES:-backends,bench,llama,gemma,qwen},"

status=0
stage() {  # stage KEY NAME SECONDS COMMAND...
    local key="$1" name="$2" seconds="$3"; shift 3
    case "$stages" in *",$key,"*) ;; *) return 0 ;; esac
    say "== $name (timeout ${seconds}s)"
    local started=$SECONDS
    timeout "$seconds" "$@" 2>&1 | tee -a "$log"
    local rc=${PIPESTATUS[0]}
    say "== $name: exit $rc after $((SECONDS - started)) s"
    [ "$rc" -eq 0 ] || status=1
}

python3 -c 'import torch; print("torch", torch.__version__, "cuda", torch.version.cuda,
           torch.cuda.get_device_name(0) if torch.cuda.is_available() else "no GPU")' 2>&1 | tee -a "$log"
stage backends "kernel backends" "$(stage_timeout 60)" kvtwin kernels --device "$device"
stage bench "kernel benchmark" "$(stage_timeout 150)" env OUT="$OUT/kernels" python3 bench/gpu_kernels.py "${bench_args[@]}"
stage llama "validate llama-3.1-8b, all checks" "$(stage_timeout 200)" \
    kvtwin validate scenarios/validate-llama8b-h200.toml --device "$device" --size full --requests "$(n 40)" \
    --out "$OUT/validate-llama8b"
stage gemma "validate gemma-3-27b (sliding window), checks 1-2" "$(stage_timeout 60)" \
    kvtwin validate scenarios/replay-gemma3-27b.toml --device "$device" --size full --requests "$(n 12)" \
    --checks prefix_hits_are_real,predicted_hits_are_executed --out "$OUT/validate-hybrid-gemma3"
stage qwen "validate qwen3-next (gated DeltaNet), checks 1-2" "$(stage_timeout 60)" \
    kvtwin validate scenarios/replay-qwen3-next.toml --device "$device" --size full --requests "$(n 8)" \
    --checks prefix_hits_are_real,predicted_hits_are_executed --out "$OUT/validate-hybrid-qwen3next"
say "gpu_validate: done, exit $status; results under $OUT"
exit $status

#!/usr/bin/env bash
# The checks that need a GPU, in one go, for a session lent one (an H200 host with 16 cores: under 10 minutes).
#
# Here, once, on a machine that reaches PyPI (x86-64): the packages the GPU machine's image lacks, as wheels
# for its Python 3.12 (zarr, numcodecs, crc32c and nvCOMP for CUDA 13, what its torch is built for; about
# 38 MiB, which travels with the working tree: 42 MiB with it, of the 64 MiB a call takes):
#   bash benchmarks/gpu_checks.sh wheels        # into .whl/ (ignored by git); NVCOMP_CUDA=12 for a CUDA 12 torch
# There, in one call of the device tool (read docs/performance.md's GPU sections for what the numbers mean):
#   run(command="bash benchmarks/gpu_checks.sh", carry=[".whl"], timeout_s=600)
# or some of the steps: `bash benchmarks/gpu_checks.sh tests bench` (setup always runs first).
#
# Steps, each under its own timeout (SIGINT first, so pytest prints its failures and summary and the bench
# keeps its JSON; SIGKILL 20 s later), all of them within GPU_CHECKS_BUDGET_S (default 560 s) so the call
# returns inside its 600 s with every log; a step the budget cannot hold is skipped, and says so:
#   setup    the carried wheels into /tmp/site; the compiled reader built in place for this Python (without
#            it the pipeline decodes on its Python path and the engine's tests skip)
#   tests    pytest -m cuda, tests/gpu first (the hybrid decode, the streams, nvCOMP, the fused placement:
#            tests/gpu/test_hybrid_executor.py; the copy, decode and place streams over many waves, and a
#            staging buffer held until its slowed copy has read it, slowed decodes and placements (the hybrid's
#            too) waited for by events, close() with the place stream busy ~2 s bounded and its buffers kept:
#            tests/gpu/test_gpu_streams.py), then every other test marked cuda (the CUDA path, fields,
#            padding, integer casts, CF decoding, keyed transforms on the device); -rfEs --durations=20. A
#            test module whose imports are missing there is reported as a collection error, not a stop
#   bench    stoker bench --device cuda --decode-on hybrid --scenarios 8,9,1 --rounds 2: the plain
#            --device cuda run's peers (stoker cpu, stoker cuda, tensorstore+pin) plus the GPU decode, the
#            2-thread CPU decode and the hybrid decode (its PCIe bytes per engine); without nvCOMP the plain
#            --device cuda run. Scenarios 8, 9 and 1 are those of issue 48's targets (hybrid >= 1.5x the
#            16-thread CPU path on 8 and 9, >= 1.3x on 1: the `stoker cpu` peer, all 16 cores by default),
#            run in that order (the bench writes its JSON after each). Not 10: its float32 data into bf16 is
#            a cast the device does not make (sources.device_casts), so every chunk of it decodes on the
#            CPU and the hybrid says nothing
#   threads  issue 48's thread sweep of the CPU path: stoker bench --scenarios 8,1,6 --threads 2,4,8,16
#            --peers stoker --rounds 2 (each thread count a peer beside the default one; the targets'
#            scenarios first)
# Logs and the bench's JSON records land in $OUT (the device tool's; ./gpu-checks-out elsewhere), the bench
# datasets in $GPU_CHECKS_DATA (default /tmp/stoker-bench: written on a fresh machine, about a minute in all).
# A rehearsal on a machine without a GPU: GPU_CHECKS_TINY=1 (the bench's --tiny datasets) runs every step that
# can run there (the cuda tests all skip; bench-cuda is skipped and says so; the thread sweep runs).
set -uo pipefail
cd "$(dirname "$0")/.."

PY=${PYTHON:-python3}

if [[ ${1:-} == wheels ]]; then
    # the platforms of the device README's recipe; --no-deps: each package the image lacks is named
    exec "$PY" -m pip download --no-deps --only-binary=:all: --python-version 3.12 --implementation cp \
        --platform manylinux_2_28_x86_64 --platform manylinux_2_27_x86_64 --platform manylinux_2_17_x86_64 \
        --platform manylinux2014_x86_64 --platform manylinux1_x86_64 -d .whl \
        "zarr==3.1.6" "numcodecs==0.16.6" "donfig==0.8.1.post1" "google-crc32c==1.9.0" "crc32c==2.9.post0" \
        "nvidia-libnvcomp-cu${NVCOMP_CUDA:-13}>=6.0,<7"
fi

STEPS=("$@")
[[ ${#STEPS[@]} -eq 0 ]] && STEPS=(tests bench threads)
OUT_DIR=${OUT:-gpu-checks-out}
DATA=${GPU_CHECKS_DATA:-/tmp/stoker-bench}
BUDGET=${GPU_CHECKS_BUDGET_S:-560}
TINY=()
[[ -n ${GPU_CHECKS_TINY:-} ]] && TINY=(--tiny)
SUMMARY=$OUT_DIR/summary.txt
mkdir -p "$OUT_DIR" "$DATA"
: >"$SUMMARY"
export PYTHONUNBUFFERED=1
START=$SECONDS

wanted() { [[ " ${STEPS[*]} " == *" $1 "* ]]; }

# step NAME LIMIT_S CMD...: CMD under `timeout` (LIMIT_S, or what the budget has left; SIGINT first: a
# pytest killed by SIGTERM prints no summary, so its failures would be lost), its output in
# $OUT_DIR/NAME.log, its tail printed, one line in the summary
step() {
    local name=$1 limit=$2
    shift 2
    local left=$((BUDGET - (SECONDS - START)))
    ((left < limit)) && limit=$left
    if ((limit < 30)); then
        echo "$name: SKIPPED, ${left}s of the ${BUDGET}s budget left" | tee -a "$SUMMARY"
        return
    fi
    echo "== $name (at most ${limit}s): $*"
    local t0=$SECONDS rc
    timeout -s INT -k 20 "$limit" "$@" >"$OUT_DIR/$name.log" 2>&1
    rc=$?
    tail -n "${TAIL_LINES:-40}" "$OUT_DIR/$name.log"
    local what="rc=$rc"
    ((rc == 124 || rc == 137)) && what="TIMED OUT after ${limit}s"
    echo "$name: $what in $((SECONDS - t0))s" | tee -a "$SUMMARY"
}

# -- setup ------------------------------------------------------------------------------------------------
{
    echo "host: $(nproc) cores; $("$PY" --version 2>&1)"
    nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv,noheader 2>&1 | head -n 2
    if compgen -G ".whl/*.whl" >/dev/null; then
        "$PY" -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site \
            .whl/*.whl && echo "wheels: $(ls .whl | tr '\n' ' ')"
        export PYTHONPATH=/tmp/site
    else
        echo "wheels: none carried (.whl/): stoker's imports may be missing there; see this script's header"
    fi
    export PYTHONPATH=$PWD/src${PYTHONPATH:+:$PYTHONPATH}
    # the compiled reader for this Python (one built elsewhere is for another Python, or ignored and absent)
    if timeout 180 "$PY" setup.py build_ext --inplace -q >/tmp/gpu-checks-build.log 2>&1; then
        rm -rf build
        echo "compiled reader: built"
    else
        echo "compiled reader: NOT built (the Python path decodes); tail of /tmp/gpu-checks-build.log:"
        tail -n 15 /tmp/gpu-checks-build.log
    fi
    "$PY" - <<'EOF'
import torch
import stoker
from stoker.engine.cpu import native
from stoker.engine.gpu import nvcomp
print(f"stoker from {stoker.__file__}; torch {torch.__version__} (CUDA {torch.version.cuda}), "
      f"GPU: {torch.cuda.get_device_name() if torch.cuda.is_available() else 'NONE'}; "
      f"compiled engine: {native.Engine is not None}; nvCOMP: {nvcomp.available()}")
EOF
} 2>&1 | tee "$OUT_DIR/setup.log"
export PYTHONPATH=$PWD/src${PYTHONPATH:+:$PYTHONPATH}
[[ -d /tmp/site ]] && export PYTHONPATH=$PYTHONPATH:/tmp/site
echo "setup: done in $((SECONDS - START))s" | tee -a "$SUMMARY"

# -- the CUDA tests ---------------------------------------------------------------------------------------
if wanted tests; then
    # tests/gpu first and, in it, the tests of what has never run on a GPU; then the rest of tests/, each
    # path named once (pytest merges a folder named beside a path inside it into the folder's own order)
    paths=(tests/gpu/test_hybrid_executor.py tests/gpu/test_gpu_streams.py tests/gpu/test_gpu_nvcomp.py
        tests/gpu/test_gpu_fused.py)
    for p in tests/gpu/test_*.py tests/*/ tests/test_*.py; do
        [[ $p == tests/gpu/ || " ${paths[*]} " == *" $p "* ]] || paths+=("$p")
    done
    step tests 210 "$PY" -m pytest -q -p no:cacheprovider -m cuda -rfEs --durations=20 \
        --continue-on-collection-errors "${paths[@]}"
fi

# -- the bench on the GPU ---------------------------------------------------------------------------------
if wanted bench; then
    decode=()
    "$PY" -c "from stoker.engine.gpu import nvcomp; raise SystemExit(not nvcomp.available())" 2>/dev/null \
        && decode=(--decode-on hybrid)
    if "$PY" -c "import torch; raise SystemExit(not torch.cuda.is_available())" 2>/dev/null; then
        step bench-cuda 200 "$PY" -m stoker bench --device cuda ${decode[@]+"${decode[@]}"} --scenarios 8,9,1 \
            --rounds 2 ${TINY[@]+"${TINY[@]}"} --data "$DATA" --json "$OUT_DIR/bench-cuda.json"
    else
        echo "bench-cuda: SKIPPED, no CUDA device visible to torch" | tee -a "$SUMMARY"
    fi
fi

# -- issue 48: the CPU path from 2 to 16 threads ----------------------------------------------------------
if wanted threads; then
    step bench-threads 170 "$PY" -m stoker bench --scenarios 8,1,6 --threads 2,4,8,16 --peers stoker --rounds 2 \
        --thread-cpu ${TINY[@]+"${TINY[@]}"} --data "$DATA" --json "$OUT_DIR/bench-threads.json"
fi

echo "== summary ($((SECONDS - START))s in all; logs in $OUT_DIR)"
cat "$SUMMARY"

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
# The plan: one call, then one rerun at most. A session has about 15 minutes of device time, the machine's
# start (a few minutes) included, and a warm machine goes back after about 30 s idle, so a second call on
# the same machine cannot wait for a fix, and two planned calls (setup and tests, then the benches) would
# each pay the setup again for nothing; a rerun starts a fresh machine. Hence: setup stops the call within
# about 1.5 minutes (rc 3, STOPPED lines in the summary) when what it set up cannot answer the questions
# (below), leaving time for a fresh machine and a full rerun once it is fixed; otherwise the one call runs
# every step within its 560 s budget, the steps and the bench's scenarios in order of importance, so a
# budget cut short loses the least (on 16 cores the threads step is the one cut). For a rerun after a full
# call, set GPU_CHECKS_BUDGET_S to what will be left (status's budget_left_s, less about 3 minutes for the
# start, less 40 s), timeout_s 30 s above it, and name only the steps still wanted, e.g.
# `GPU_CHECKS_BUDGET_S=300 bash benchmarks/gpu_checks.sh bench`.
#
# Steps, each under its own timeout (SIGINT first, so pytest prints its failures and summary and the bench
# keeps its JSON; SIGKILL 20 s later), all of them within GPU_CHECKS_BUDGET_S (default 560 s) so the call
# returns inside its 600 s with every log; a step the budget cannot hold is skipped, and says so:
#   setup    the carried wheels installed into the running Python's environment (pip --no-index --no-deps;
#            where that is refused, into $GPU_CHECKS_SITE (/tmp/site), first on PYTHONPATH, with an
#            nvidia/__init__.py that extends nvidia's __path__: the nvCOMP wheel has none, so an image's
#            regular `nvidia` package would hide nvidia.libnvcomp); the compiled reader built in place for
#            this Python (without it the pipeline decodes on its Python path and the engine's tests skip). It
#            prints where stoker and nvidia.libnvcomp resolved, and STOPS the run (rc 3; GPU_CHECKS_GO_ON=1
#            goes on anyway) when the compiled reader is not there, stoker does not import, no CUDA device is
#            visible (unless GPU_CHECKS_TINY), or nvCOMP's wheel was carried and it is not available: the
#            numbers after that would not answer issue 48
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
# in this shell (not a pipe's subshell): PYTHONPATH and what stops the run are needed after it
STOP=$OUT_DIR/setup-stop.txt
SITE=${GPU_CHECKS_SITE:-/tmp/site}
: >"$STOP"
export PYTHONPATH=$PWD/src${PYTHONPATH:+:$PYTHONPATH}
{
    echo "host: $(nproc) cores; $("$PY" --version 2>&1)"
    nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv,noheader 2>&1 | head -n 2
    if compgen -G ".whl/*.whl" >/dev/null; then
        echo "wheels: $(ls .whl | tr '\n' ' ')"
        # into the running Python's own environment where it may be written: nvidia.libnvcomp then lands
        # beside the image's other nvidia packages, found however `nvidia` is laid out there
        if "$PY" -m pip install -q --no-index --no-deps --no-compile --no-cache-dir .whl/*.whl \
            >/tmp/gpu-checks-pip.log 2>&1; then
            echo "wheels: installed into $("$PY" -c 'import sysconfig; print(sysconfig.get_paths()["purelib"])')"
        else
            echo "wheels: the Python's environment refused them ($(tail -n 1 /tmp/gpu-checks-pip.log)); into $SITE"
            if "$PY" -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade \
                --target "$SITE" .whl/*.whl >>/tmp/gpu-checks-pip.log 2>&1; then
                # the nvCOMP wheel's nvidia/ has no __init__.py: a regular `nvidia` package anywhere on the
                # path (the image's) would win over it and hide nvidia.libnvcomp; this one, first on the
                # path, is the regular package, and its __path__ takes in every other nvidia/ on sys.path
                [[ ! -d $SITE/nvidia || -f $SITE/nvidia/__init__.py ]] ||
                    echo "__path__ = __import__('pkgutil').extend_path(__path__, __name__)" \
                        >"$SITE/nvidia/__init__.py"
                export PYTHONPATH=$PWD/src:$SITE${PYTHONPATH#"$PWD/src"}
            else
                echo "wheels: NOT installed; tail of /tmp/gpu-checks-pip.log:"
                tail -n 15 /tmp/gpu-checks-pip.log
            fi
        fi
    else
        echo "wheels: none carried (.whl/): stoker's imports may be missing there; see this script's header"
    fi
    # the compiled reader for this Python (one built elsewhere is for another Python, or ignored and absent)
    if timeout 180 "$PY" setup.py build_ext --inplace -q >/tmp/gpu-checks-build.log 2>&1; then
        rm -rf build
        echo "compiled reader: built"
    else
        echo "compiled reader: NOT built (the Python path decodes); tail of /tmp/gpu-checks-build.log:"
        tail -n 15 /tmp/gpu-checks-build.log
    fi
    carried=
    compgen -G ".whl/nvidia_libnvcomp*.whl" >/dev/null && carried=1
    NVCOMP_CARRIED=$carried STOP_FILE=$STOP CHECKS_TINY=${GPU_CHECKS_TINY:-} timeout 120 "$PY" - <<'EOF'
import importlib.util
import os
import sys

stops = []
try:  # where the nvCOMP package resolved (before torch, whose import must not decide it)
    spec = importlib.util.find_spec("nvidia.libnvcomp")
    why = "not found"
except (ImportError, ValueError) as exc:
    spec, why = None, f"{type(exc).__name__}: {exc}"
nvidia = sys.modules.get("nvidia")
print(f"nvidia.libnvcomp: {spec.origin if spec else why}; nvidia's __path__: "
      f"{list(getattr(nvidia, '__path__', [])) if nvidia else 'no nvidia package'}")
try:
    import torch

    import stoker
    from stoker.engine.cpu import native
    from stoker.engine.gpu import nvcomp
except Exception as exc:  # the run cannot go on: say why
    stops.append(f"stoker does not import ({type(exc).__name__}: {exc})")
else:
    cuda = torch.cuda.is_available()
    print(f"stoker from {stoker.__file__}; torch {torch.__version__} (CUDA {torch.version.cuda}), "
          f"GPU: {torch.cuda.get_device_name() if cuda else 'NONE'}; "
          f"compiled engine: {native.Engine is not None}; nvCOMP: {nvcomp.available()}")
    if native.Engine is None:
        stops.append("the compiled reader is not there (see 'compiled reader' above)")
    if not cuda and not os.environ["CHECKS_TINY"]:
        stops.append("torch sees no CUDA device")
    if cuda and os.environ["NVCOMP_CARRIED"] and not nvcomp.available():
        try:
            nvcomp._batched()
        except Exception as exc:
            why = str(exc)
        stops.append(f"nvCOMP's wheel was carried but nvCOMP is not available ({why})")
with open(os.environ["STOP_FILE"], "w") as f:
    f.write("".join(f"{s}\n" for s in stops))
EOF
    (($? == 0)) || echo "the setup check did not finish (see setup.log)" >>"$STOP"
} >"$OUT_DIR/setup.log" 2>&1
cat "$OUT_DIR/setup.log"
echo "setup: done in $((SECONDS - START))s" | tee -a "$SUMMARY"
if [[ -s $STOP ]]; then
    sed 's/^/setup: STOPPED: /' "$STOP" | tee -a "$SUMMARY"
    if [[ -z ${GPU_CHECKS_GO_ON:-} ]]; then
        echo "setup: what follows would not answer issue 48; fix the above and rerun (or GPU_CHECKS_GO_ON=1)" \
            | tee -a "$SUMMARY"
        echo "== summary ($((SECONDS - START))s in all; logs in $OUT_DIR)"
        cat "$SUMMARY"
        exit 3
    fi
fi

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

#!/usr/bin/env bash
# One call on the lent H200: versions, the CUDA test lane, an end-to-end
# generate, and the decode benchmark. Logs and JSON under $OUT; a short
# table prints last. Usage: bash bench/h200.sh [tests|bench|spec|all] [bench runners] [spec topks]
#   bash bench/h200.sh kernels [pytest -k filter]: the fused-kernel CUDA tests only
#   bash bench/h200.sh pytest "FILES [pytest args]": those CUDA tests (CUDA_WORKERS, 8; CUDA_DIST, loadgroup)
#   bash bench/h200.sh exec "COMMAND": any command with this tree's package and the caches
#   bash bench/h200.sh chooser [tokens]: auto's charges by kind of step in fresh processes
#     (bench/chooser_trace.py, CHOOSER_REPS pairs with --no-draft), then bench/profile_auto.py
#     with auto forced to rounds of 5 beside it (issue 20)
#   bash bench/h200.sh profile [models] [batch sizes] [variants]: bench/profile_step.py
#     (variants: tuned,no-pdl,cublas, all three unless named)
#   bash bench/h200.sh round [topk] [kernels listed] [batch sizes]: bench/profile_round.py
#   bash bench/h200.sh patch FILE [models] [batch sizes]: a kernel patch's step against this
#     tree's (`context` at prompt 512, as `ab` runs it, on one set of GEMV choices), the
#     patch applied here to a copy of core/, devices/ and spec/
#   bash bench/h200.sh ab DIR "MODE ARGS": MODE with this tree's package, then DIR's, twice
#     over, on one machine (a host-side change against its base)
#   bash bench/h200.sh enginetests: the CUDA tests of the engine's step path
#   bash bench/h200.sh host [tokens] [engines]: a decode step's host time by phase at batch
#     1, 8 and 64 (bench/step_phases.py)
#   bash bench/h200.sh onepass [--onepass settings]: the one-pass verify kernel's CUDA tests,
#     one attention layer (bench/attention_layer.py) and the round of 4 at batch 1, 8, 64
#   bash bench/h200.sh forced ["VARIANTS"] [model] [batch sizes]: the step with projections'
#     GEMV choices forced against the tuner's (bench/gemv_forced.py; issue 21's batch 1)
#   bash bench/h200.sh widths [model]: GEMV CUDA tests, then bench/gemv_widths.py (cuBLAS,
#     tiles and split-K tiles at verify widths)
#   bash bench/h200.sh onerow [models] [N:K:W,...]: decode's GEMVs at batch 1, each row-path
#     configuration (and those given) on each projection, us and TB/s against the copy
#     bandwidth (bench/gemv_widths.py --one-row; llama-1b,llama-8b,gemma4-e2b)
#   bash bench/h200.sh fused: the CUDA tests of stops 60-62's kernels (the GEMV's rope
#     epilogue and Gemma residual-norm prologue, greedy tokens on Triton, and the decode
#     paths that run them: conformance, parity, Gemma 4, the embedded pair, engine,
#     attention, verify), then the greedy sampler by vocabulary width (bench/greedy_argmax.py)
#   bash bench/h200.sh cold: the README's first command from empty caches, then warm, with
#     where the seconds go (bench/cold_start.py; the cold run's captures and the warm run's
#     compiling ahead profiled)
#   bash bench/h200.sh splits: decode attention by KV split count and context (issue 21;
#     bench/decode_splits.py, the combine's narrower step beside), then the decode step
#     against the context (graphrt bench --prompt-len 512,2048,8192,32768)
#   bash bench/h200.sh launches ["B:W:S,..." llama] ["B:W:S,..." gemma]: decode attention's
#     stage 1 by BLOCK_N:num_warps:num_stages (bench/decode_splits.py --launches), llama-1b's
#     shape, Gemma 4's sliding layers (window 512 in the engine), its full layers
#   bash bench/h200.sh ncu ["B:W:S,..."]: where decode attention's stage 1 waits, by Nsight
#     Compute (Firecracker hosts; --clock-control none, as METHOD.md asks): llama-1b's shape
#     at 8 requests of 8k keys and one of 32k, for each launch (64:4:2,64:4:3,128:4:2)
#   bash bench/h200.sh context [batch sizes] [prompt lengths] [model]: the decode step against
#     the context alone (graphrt bench, random:llama-1b, graphs; 1,8 at 8192,32768): `ab`'s unit
#   bash bench/h200.sh auto [tokens]: the README's command with and without drafting, and
#     bench/profile_auto.py (auto vs --no-draft vs rounds of 5, side by side in one process)
#   bash bench/h200.sh overlap [tokens]: --overlap's CUDA tests, then generate with and without
#     it (the README's command with and without drafting, llama-1b at 1 and 8 prompts), and
#     the device's idle between steps either way (bench/step_gaps.py; STEP_GAPS_LIMIT seconds,
#     300; OVERLAP_REPS runs of each generate, 2)
#   bash bench/h200.sh matrix ["spec_matrix.py flags"]: the speculative speed matrix (issue 20);
#     "--workloads closed,steady ..." measures both workloads on one set of engines; then
#     bench/profile_auto.py, unless MATRIX_ONLY=1 (MATRIX_LIMIT: the matrix's seconds, 480)
#   bash bench/h200.sh onegraph [batch sizes]: one graph a round (spec.round_graph, the
#     default) against two-graph rounds: the one-graph conformance tests on CUDA,
#     step_phases side by side at batch 1 and 64, the pair's matrix with both kinds of round
#   bash bench/h200.sh oracle [rate]: random:gemma4-e2b with bench/oracles.py's TokenOracle
#     (bench/eval_pair.py --oracle-rate, 0.7): bf16 and fp16 output with the drafter against
#     without, batch-invariant kernels and default (issue 20)
#   bash bench/h200.sh invariant [eval configs]: batch-invariant kernels' tests, bf16 spec ==
#     plain on the embedded pair with and without --batch-invariant, the README's command
#     with its default kernels and without (its decode cost by model: bench/invariant_cost.sh)
#   bash bench/h200.sh pair ["train flags"]: train the embedded Gemma 4 pair, eval on cuda
#     (EVAL_CONFIGS=3x1,5x1,... picks the speculative configurations measured)
#   bash bench/h200.sh paireval ["name=target:assistant ..."]: eval pairs on cuda
#   bash bench/h200.sh reliability [steps]: capture under a memory cap, differential, soak
#   bash bench/h200.sh soakspec [steps]: differential and soak with speculative rounds
#   bash bench/h200.sh lanes [steps]: the CUDA lane beside capture_oom and soakspec (one call)
#   bash bench/h200.sh prefill [lengths] [profile]: prefill tokens/s against transformers
#     (bench/prefill.py; profile: where each length's time goes, in $OUT/prefill.log)
#   bash bench/h200.sh sdpa: one layer's prefill attention through SDPA by backend and call
#     (bench/sdpa_prefill.py: graphrt's call, K/V expanded, a chunk split in two), both shapes
#   bash bench/h200.sh tp [batch sizes|-]: all-reduce micro-bench, random:llama-8b decode at TP=1
#     and (with 2 GPUs) TP=2 over each all-reduce
#   bash bench/h200.sh tptests: the tensor-parallel CUDA tests
#   bash bench/h200.sh recheck: one call after stops without a device (RECHECK_LIMIT seconds
#     of tests, 300): first `cold` (below: its main-thread compiles by phase have not run on
#     a device yet), then the CUDA tests of what those stops changed (the embedding kernel,
#     drafts graph vs eager, rounds and plain steps launched ahead, first prompts' prefill
#     compiled ahead, long prefill chunks on SDPA), the round bench at batch 1 and 64, and
#     the README command with --no-draft, auto (steps launched ahead: the CUDA default),
#     and auto --no-overlap; then
#     prefill against transformers at 512, 8k and 32k (stop 54's attention changes; stop
#     55's prefill rope and token-table write: tests/test_triton_ops.py and parity run too)
#   bash bench/h200.sh serve [requests] [llama-1b,pair] [1,16,64] [check|nocheck]: graphrt
#     serve (issue 23): the openai client's streams against offline greedy (embedded pair,
#     drafting, float32), then the load test (bench/serve_load.py) on random:llama-1b and
#     on the embedded pair (drafting, auto; pair-nodraft: without), each with a step trace.
#     Needs the serve extra's wheels: carry .whl (device README) and install them first
set -uo pipefail
cd "$(dirname "$0")/.."
OUT=${OUT:-out}
mkdir -p "$OUT"
what=${1:-all}
runners=${2:-eager,graph,hf}
topks=${3:-1,3}
export PYTHONUNBUFFERED=1

# graphrt from this working tree without pip (the machine has no registry): symlinks to
# core/, devices/, spec/ and graphrt's own __init__.py (core/package_root/) do.
# GRAPHRT_TREE=DIR takes the package from another tree instead (`ab` below), the scripts
# and tests still from this one.
tree=$(cd "${GRAPHRT_TREE:-.}" && pwd)
site=$(mktemp -d)
mkdir -p "$site/graphrt"
for p in core devices spec; do ln -s "$tree/$p" "$site/graphrt/$p"; done
ln -s "$tree/core/package_root/__init__.py" "$site/graphrt/__init__.py"  # graphrt.LLM
# Triton marks each cache entry it opens (bench/triton_cache_marks.py): save_caches keeps those
ln -s "$PWD/bench/triton_cache_marks.py" "$site/triton_cache_marks.py"
export TRITON_CACHE_MANAGER=triton_cache_marks:MarkingCacheManager
export PYTHONPATH="$site${PYTHONPATH:+:$PYTHONPATH}"
graphrt() { python -m graphrt.core.cli.main "$@"; }

# Triton's and graphrt's caches kept between device calls: a bare machine compiles every
# kernel again (most of the CUDA lane's 7 minutes, out of a session's 30). Each call
# leaves both in $OUT/kernel-caches.txz (xz; .tgz where the machine has no xz; if under the
# 16 MiB a file may bring back): graphrt's whole, Triton's entries that this call's work
# opened (save_caches). Copy it to .tcache/ here (git ignores .tcache/) and carry .tcache:
#   cp /work/.device/N/kernel-caches.txz .tcache/   and   run(..., carry=[".tcache"])
# (over 16 MiB it comes in parts: cat /work/.device/N/kernel-caches.txz.part-* > .tcache/kernel-caches.txz)
# (a narrow call's archive holds its own kernels only: keep a lane call's for the lane, or
# merge: extract both into one folder, the lane's last, and `tar -cJf` its triton and graphrt).
# xz: the lane's kernels took 30 MiB gzipped, 14 xz'd (stop 86), and the carry is at most
# 64 MiB with the tree (33 MiB).
# Triton keys each entry by the kernel's source, so an edited kernel compiles afresh; its
# index files hold absolute paths, so the caches live at one fixed path on every machine
# (from a new random directory each call, nothing hit). `cold` empties its own caches.
# A run nested in `ab` (H200_NESTED=1) keeps the caches its caller set up and saves none.
caches=/tmp/graphrt-kernel-caches
# (AB_TUNING_DIR: the GEMV tuner's cache of one side of `alternate`, AB_OWN_TUNING below)
export TRITON_CACHE_DIR="$caches/triton" GRAPHRT_CACHE_DIR="${AB_TUNING_DIR:-$caches/graphrt}"
if [[ -z ${H200_NESTED:-} ]]; then
    rm -rf "$caches"
    mkdir -p "$TRITON_CACHE_DIR" "$GRAPHRT_CACHE_DIR"
    # The .txz carried, or a newer .tgz (a machine without xz saved one); tar finds the
    # compression itself.
    carried=.tcache/kernel-caches.txz
    if [[ ! -f $carried || .tcache/kernel-caches.tgz -nt $carried ]]; then
        carried=.tcache/kernel-caches.tgz
    fi
    if [[ -f $carried ]]; then
        tar -xf "$carried" -C "$caches" && echo "kernel caches: $(du -sh "$caches" | cut -f1) carried"
    fi
    find "$caches/triton" -name .used -delete  # marks of the calls that saved them
fi
save_caches() {
    # At most 8 files come back from $OUT: the caches only where a result would not go.
    if (( $(find "$OUT" -type f | wc -l) >= 8 )); then
        echo "kernel caches: not brought back ($OUT holds 8 files already)"
        return
    fi
    # A cache hit needs the cubin and the metadata alone (checked with Triton 3.7: 0.35 s
    # against 2.6 compiling); the compiler's intermediate forms are 80% of the bytes. Only
    # the Triton entries this call opened (marked .used): every entry ever compiled, stale
    # kernels' too, had grown the archive past what comes back (22 MiB at stop 62).
    (cd "$caches" && find triton -name .used -printf '%h\n' | sort) > "$caches/used-entries"
    echo "kernel caches: $(wc -l < "$caches/used-entries") of $(ls "$caches/triton" | wc -l) Triton entries used"
    local archive="$OUT/kernel-caches.txz" pack=-J bytes parts
    if ! command -v xz > /dev/null; then
        archive="$OUT/kernel-caches.tgz" pack=-z
    fi
    XZ_OPT="-T0 -6" tar $pack -cf "$archive" -C "$caches" --exclude='*.llir' --exclude='*.ttir' \
        --exclude='*.ttgir' --exclude='*.source' --exclude='*.ptx' --exclude=.used \
        -T "$caches/used-entries" graphrt
    # A file over 16 MiB does not come back (the CUDA lane's kernels: 31 MiB gzipped at stop
    # 63): in 15 MiB parts where the 8 files allow; here: cat the parts into one archive.
    bytes=$(stat -c %s "$archive")
    if (( bytes > 16 * 1024 * 1024 )); then
        parts=$(( (bytes + 15 * 1024 * 1024 - 1) / (15 * 1024 * 1024) ))
        if (( $(find "$OUT" -type f | wc -l) - 1 + parts <= 8 )); then
            split -b 15M "$archive" "$archive.part-"
            echo "kernel caches: $(du -sh "$archive" | cut -f1) in $parts parts (cat them into one)"
        else
            echo "kernel caches: $(du -sh "$archive" | cut -f1), $parts parts: too many files to bring back"
        fi
        rm -f "$archive"
    fi
}
[[ -z ${H200_NESTED:-} ]] && trap save_caches EXIT

{
    date -u +%FT%TZ
    python -c "import torch, triton, transformers; print('torch', torch.__version__, 'cuda', torch.version.cuda, '| triton', triton.__version__, '| transformers', transformers.__version__)"
    # torch's kernels for this card as SASS (sm_90) or only PTX (compute_90: the driver
    # compiles each at its first launch on a fresh machine; a suspect for the cold start's
    # 4.6 s of graph captures)
    python -c "import torch; print('torch arch list', torch.cuda.get_arch_list())"
    nvidia-smi --query-gpu=name,driver_version,memory.total,clocks.max.sm --format=csv,noheader
} | tee "$OUT/versions.txt"

if [[ $what == tests || $what == all ]]; then
    # The tests-cuda lane's selection, run with pytest directly (no nox venv offline). On a
    # bare machine Triton's cold compiles dominate (over 7 minutes serial), so files run in
    # CUDA_WORKERS processes; tests that read free device memory can see another worker's
    # allocations, so whatever fails is run again alone, and both results print.
    # -v: each test's name and result as it finishes, so a run cut at LANE_LIMIT seconds
    # (the device's commands stop at 10 minutes) still names its failures; stop 44's -q
    # run printed five Fs and no names. 14 workers: the lane in about 7 minutes from cold
    # caches (the slowest 25 tests listed last). loadgroup: each file's tests on one worker,
    # as loadfile, except the slow kernel tests marked own_worker, each by itself (conftest's
    # group_by_file: tests/test_triton_fused.py's, about 550 s on one worker, cut the lane at
    # 480-500 s at stops 84 and 86). The rerun below follows a run that finished only.
    timeout "${LANE_LIMIT:-480}" python -m pytest tests -m cuda -v -p no:cacheprovider -ra --durations=25 \
        -n "${CUDA_WORKERS:-14}" --dist loadgroup > "$OUT/tests-cuda.log" 2>&1
    status=$?
    grep -E "^(FAILED|ERROR)|\] (FAILED|ERROR)" "$OUT/tests-cuda.log" | sort -u | head -n 20
    tail -n 3 "$OUT/tests-cuda.log"
    if [[ $status != 0 && $status != 124 ]]; then
        # By id from the log, less loadgroup's "@group" suffix (pytest's last-failed cache
        # keeps the suffixed ids, which a run without xdist never collects).
        failed=$(grep -oE "(FAILED|ERROR) tests/[^ ]+" "$OUT/tests-cuda.log" | cut -d' ' -f2 \
            | sed 's/@[^]@]*$//' | sort -u | head -n 40)
        echo "== the failures again, one process"
        timeout 300 python -m pytest $failed -m cuda -q -p no:cacheprovider -ra \
            2>&1 | tee "$OUT/tests-cuda-rerun.log" | tail -n 15
    fi
    graphrt generate --model random:llama-1b --prompt-ids 1,2,3,4 --prompt-ids 5,6 --max-new-tokens 16 \
        --ignore-eos --json > "$OUT/generate-cuda.json" 2> "$OUT/generate-cuda.err"
    echo "generate exit $?: $(head -c 600 "$OUT/generate-cuda.json")"
fi

if [[ $what == kernels ]]; then
    python -m pytest tests/test_triton_fused.py tests/test_triton_ops.py tests/test_gemma4.py \
        tests/test_centroid_ops.py tests/test_scaled_embed.py -m cuda \
        -q -p no:cacheprovider -ra ${2:+-k "$2"} 2>&1 \
        | tee "$OUT/tests-kernels.log" | tail -n 25
fi

if [[ $what == chooser ]]; then
    # Issue 20: what auto is charged for each kind of step (bench/chooser_trace.py), the
    # README's command in fresh processes, --no-draft and auto alternating CHOOSER_REPS
    # times (3), then the engines side by side in one process with auto forced to rounds
    # of 5 beside them (bench/profile_auto.py, FORCED=1).
    for i in $(seq "${CHOOSER_REPS:-3}"); do
        for mode in no-draft auto; do
            python bench/chooser_trace.py "$mode" "${2:-400}" 2>&1 | grep -v Warning \
                | grep -v "^loaded\|^set up" | sed "s/^/[$i] /" | tee -a "$OUT/chooser-trace.log"
        done
    done
    FORCED=1 python bench/profile_auto.py "${2:-400}" cuda 5 2>&1 | grep -v Warning | tail -n 8
fi

if [[ $what == exec ]]; then
    # Any command in this prepared environment (the package from the tree, the caches):
    # bash bench/h200.sh exec "python bench/x.py ARGS"
    eval "$2" 2>&1 | grep -v Warning | tee "$OUT/exec.log"
fi

if [[ $what == pytest ]]; then
    # Some CUDA tests with this tree's package and the carried caches: the files or pytest
    # arguments in $2, in CUDA_WORKERS processes (8), CUDA_DIST their spread (loadgroup: a
    # file's tests on one worker, but those marked own_worker each by itself, see conftest's
    # group_by_file; `load` spreads every case: tests/test_triton_fused.py on one worker ran
    # past 200 s after a GEMV edit, stop 75, every variant compiling afresh).
    python -m pytest $2 -m cuda -q -p no:cacheprovider -ra -n "${CUDA_WORKERS:-8}" \
        --dist "${CUDA_DIST:-loadgroup}" 2>&1 | tee "$OUT/tests-pytest.log" | tail -n 15
fi

if [[ $what == auto ]]; then
    # Issue 20: the README's first command with and without drafting (fresh processes,
    # interleaved), then the three engines side by side in one process.
    for i in 1 2; do
        for mode in no-draft auto; do
            flag=$([[ $mode == no-draft ]] && echo --no-draft)
            graphrt generate --prompt "def fibonacci(n):" --max-new-tokens "${2:-400}" --ignore-eos \
                $flag --json > "$OUT/cli-$mode-$i.json" 2> "$OUT/cli-$mode-$i.err"
            python -c "import json,sys; s=json.load(open(sys.argv[1]))['stats']; print(sys.argv[2], s['tokens_per_s'], 'tok/s', s.get('spec', ''))" \
                "$OUT/cli-$mode-$i.json" "$mode $i"
        done
    done
    python bench/profile_auto.py "${2:-400}" cuda 5 2>&1 | grep -v Warning | tail -n 7
fi

if [[ $what == overlap ]]; then
    # Plain steps launched ahead (--overlap): its CUDA tests, then the README's command
    # (the embedded pair: --no-draft and auto) and random:llama-1b at 1 and 8 prompts,
    # each with and without --overlap in fresh processes, interleaved, OVERLAP_REPS times (2).
    python -m pytest tests/conformance/test_overlap.py tests/conformance/test_spec_rounds.py \
        tests/test_bad_inputs.py tests/test_spec.py -m cuda -q -ra -p no:cacheprovider \
        -k "overlap or launch_ahead or nan_decode or waits_on_the_device_once" 2>&1 \
        | tee "$OUT/tests-overlap-cuda.log" | tail -n 5
    prompts8=$(for i in 1 2 3 4 5 6 7 8; do printf -- "--prompt-ids %d,%d,%d " $i $((i + 7)) $((i + 20)); done)
    for i in $(seq "${OVERLAP_REPS:-2}"); do
        for run in "pair-nodraft|--prompt def_fibonacci --no-draft" "pair-auto|--prompt def_fibonacci" \
            "llama1b-bs1|--model random:llama-1b --prompt-ids 1,2,3" \
            "llama1b-bs8|--model random:llama-1b $prompts8"; do
            name=${run%%|*}
            for flag in --no-overlap --overlap; do  # (each explicit)
                graphrt generate ${run#*|} --max-new-tokens "${2:-300}" --ignore-eos $flag --json \
                    > "$OUT/run.json" 2> "$OUT/run.err" || tail -n 3 "$OUT/run.err"
                python -c "import json,sys; s=json.load(open(sys.argv[1]))['stats']; print(f\"{sys.argv[2]:<28} {s['tokens_per_s']:9.1f} tok/s\", s.get('spec', ''))" \
                    "$OUT/run.json" "$name $flag $i" | tee -a "$OUT/overlap.txt"
            done
        done
    done
    rm -f "$OUT/run.json" "$OUT/run.err"
    # The device's idle between steps, reading each step against launching ahead.
    timeout "${STEP_GAPS_LIMIT:-300}" python bench/step_gaps.py --tokens "${2:-300}" --out "$OUT/step-gaps.json" 2>&1 \
        | grep -v Warning | tee "$OUT/step-gaps.log" | tail -n 16
fi

if [[ $what == matrix ]]; then
    # Issue 20: the speculative speed matrix (bench/spec_matrix.py), then auto vs --no-draft
    # side by side on the embedded pair (bench/profile_auto.py).
    timeout "${MATRIX_LIMIT:-480}" python bench/spec_matrix.py --out "$OUT/spec-matrix.json" ${2:---tokens 128} 2>&1 \
        | grep -v Warning > "$OUT/spec-matrix.log"
    echo "matrix exit $?"; grep -v '^{' "$OUT/spec-matrix.log" | tail -n 40
    # MATRIX_ONLY=1: the matrix alone (a call that runs more after it).
    if [[ -z ${MATRIX_ONLY:-} ]]; then
        python bench/profile_auto.py 400 cuda 5 2>&1 | grep -v Warning | tail -n 7
    fi
fi

if [[ $what == onegraph ]]; then
    # Issue 20: one graph a round against two, side by side in one process each.
    timeout 200 python -m pytest tests/conformance/test_spec_rounds.py -m cuda -q -ra \
        -p no:cacheprovider -k one_graph 2>&1 | tail -n 6
    for bs in 1 64; do
        BATCH=$bs ENGINES=plain,round4,round4+2g,auto,auto+2g timeout 170 \
            python bench/step_phases.py 128 cuda 3 $bs 2>&1 | grep -v Warning \
            > "$OUT/phases-bs$bs.log"
        echo "phases bs$bs exit $?"; tail -n 22 "$OUT/phases-bs$bs.log"
    done
    timeout 260 python bench/spec_matrix.py --models pair --batch-sizes ${2:-1,8,64} \
        --modes plain,4,4+2g,auto,auto+2g --tokens 128 --out "$OUT/spec-matrix.json" 2>&1 \
        | grep -v Warning > "$OUT/spec-matrix.log"
    echo "matrix exit $?"; grep -v '^{' "$OUT/spec-matrix.log" | tail -n 12
fi

if [[ $what == oracle ]]; then
    # Issue 20: random:gemma4-e2b's greedy output with an oracle drafter that drafts the
    # target's own continuation (bench/oracles.py's TokenOracle, rate $2, 0.7) equal to
    # plain decoding's, on 16 random prompts: batch-invariant kernels in bf16 and fp16, then
    # the default kernels in bf16 (stop 78, an H100: 16/16, 16/16, 0/16).
    for run in "bfloat16 invariant" "float16 invariant" "bfloat16 default"; do
        read -r dtype kernels <<< "$run"
        flag=; [[ $kernels == invariant ]] && flag=--batch-invariant
        # 38-53 s each on an H100 with warm kernel caches (stop 78).
        timeout 170 python bench/eval_pair.py --device cuda --runner graph \
            --target random:gemma4-e2b --draft random:gemma4-e2b-assistant --tokens random \
            --files 16 --prompt-len 64 --max-new-tokens 128 --oracle-rate "${2:-0.7}" \
            --configs 4x1,3x3 --dtype "$dtype" $flag --out "$OUT/eval-oracle-$dtype-$kernels.json" \
            > "$OUT/eval-oracle-$dtype-$kernels.log" 2>&1
        echo "== $dtype, $kernels kernels: exit $?"
        grep -v "Warning\|Loading weights" "$OUT/eval-oracle-$dtype-$kernels.log" | tail -n 6
    done
fi

if [[ $what == invariant ]]; then
    # Issue 20: batch-invariant matmuls, the embedded pair's default (stop 70). The kernel
    # invariance tests and the pair's default-command test; bf16 greedy output with and
    # without the drafter on 16 held-out prompts (default ops vs --batch-invariant; needs
    # build/pair/tokens.pt carried); then the README's command in fresh processes, its
    # default, --no-batch-invariant and --no-draft in turn, INV_REPS times (3); then
    # bench/profile_auto.py with the invariant engines beside (INVARIANT=1).
    python -m pytest tests/test_triton_fused.py tests/test_triton_verify.py tests/test_spec.py \
        tests/test_embedded_pair.py -m cuda -q -p no:cacheprovider -n 4 --dist loadfile \
        -k "invariant or decode_rows or default_command" 2>&1 | tee "$OUT/tests-invariant.log" | tail -n 3
    pair="--target core/pretrained/gemma4-code-target --draft core/pretrained/gemma4-code-assistant"
    for flag in "" --batch-invariant; do
        python bench/eval_pair.py --device cuda --runner graph $pair --dtype bfloat16 \
            --configs "${2:-auto,3x1,5x1,3x3}" $flag --out "$OUT/eval-bf16${flag:+-invariant}.json" \
            2>&1 | grep -v "Warning\|Loading weights" | tail -n 7
    done
    for i in $(seq "${INV_REPS:-3}"); do
        for flag in "" --no-batch-invariant --no-draft; do
            graphrt generate --prompt "def fibonacci(n):" --max-new-tokens 400 --ignore-eos \
                $flag --json > "$OUT/cli.json" 2> /dev/null
            python -c "import json,sys; r=json.load(open(sys.argv[1])); s=r['stats']; print(sys.argv[2], s['tokens_per_s'], 'tok/s, invariant', s['batch_invariant'], 'ids', hash(tuple(r['requests'][0]['output_ids'])) % 10**6, 'rounds', s.get('spec', {}).get('rounds_by_steps'))" \
                "$OUT/cli.json" "${flag:-default} $i"
        done
    done
    INVARIANT=1 python bench/profile_auto.py 400 cuda 5 2>&1 | grep -v Warning | tail -n 9
fi

if [[ $what == fused ]]; then
    timeout "${LANE_LIMIT:-300}" python -m pytest tests/test_gemv_rope.py tests/test_greedy_tokens.py \
        tests/test_gemv_residual_linear.py tests/test_gemma4.py tests/test_embedded_pair.py \
        tests/test_bad_inputs.py tests/test_models_parity.py tests/conformance tests/test_engine*.py \
        tests/test_triton_attention.py tests/test_triton_verify.py \
        -m cuda -q -p no:cacheprovider -ra -n "${CUDA_WORKERS:-14}" --dist loadfile \
        > "$OUT/tests-fused.log" 2>&1
    echo "fused tests exit $?"; grep -E "^(FAILED|ERROR)" "$OUT/tests-fused.log" | head -n 20
    tail -n 2 "$OUT/tests-fused.log"
    python bench/greedy_argmax.py 2>&1 | grep -v Warning | tee "$OUT/greedy-argmax.log"
fi

if [[ $what == onerow ]]; then
    # Issue 21's batch-1 targets: how far each projection's GEMV is from the copy bandwidth.
    models=${2:-llama-1b,llama-8b,gemma4-e2b}
    for model in ${models//,/ }; do
        python bench/gemv_widths.py --model "$model" --one-row ${3:+--extra "$3"} \
            --out "$OUT/gemv-one-row-$model.json" 2>&1 | grep -v Warning \
            | tee -a "$OUT/gemv-one-row.log"
    done
fi

if [[ $what == forced ]]; then
    # Issue 21's batch-1 target: the step with projections' GEMV choices forced, against the
    # tuner's (bench/gemv_forced.py, ABBA). $2: variants (';'-separated), $3: model, $4: sizes.
    python bench/gemv_forced.py --model "random:${3:-llama-1b}" --batch-sizes "${4:-1}" \
        --variants "${2:-tuned;linear_rope:3072x2048=4:2048:8;linear_rope:3072x2048=2:2048:4}" \
        2>&1 | grep -v Warning | tee "$OUT/gemv-forced.log"
fi

if [[ $what == widths ]]; then
    # Issue 20: skinny matmuls at verify widths, cuBLAS / tiles / split-K tiles ($2: model),
    # after the GEMV's CUDA tests (split-K's among them).
    python -m pytest tests/test_triton_fused.py -m cuda -q -p no:cacheprovider -n 4 --dist load \
        -ra 2>&1 | tee "$OUT/tests-gemv.log" | tail -n 4
    python bench/gemv_widths.py --model "${2:-gemma4-e2b}" --out "$OUT/gemv-widths.json" 2>&1 \
        | grep -v Warning | tee "$OUT/gemv-widths.log"
fi

if [[ $what == serve ]]; then
    # $2: requests a client count, $3: models, $4: client counts, $5: "check" also runs
    # serve_check. Each server writes a step trace, summarised per client count.
    requests=${2:-64}; models=${3:-llama-1b,pair}; clients=${4:-1,16,64}
    [[ ${5:-check} == check ]] && python bench/serve_check.py --prompts 8 --max-tokens 64 \
        -- --dtype float32 2>&1 | grep -v -E "Warning|server: " | tee "$OUT/serve-check.log" \
        | tail -n 10
    for model in ${models//,/ }; do
        case $model in
            pair) flags=(--code-prompts --) ;;
            pair-nodraft) flags=(--code-prompts -- --no-draft) ;;
            *) flags=(-- --model "random:$model" --dtype bfloat16) ;;
        esac
        python bench/serve_load.py --clients "$clients" --requests "$requests" \
            --out "$OUT/serve-load-$model.json" "${flags[@]}" --max-running-requests 64 \
            --step-trace "$OUT/serve-trace-$model.json" 2>&1 | grep -v Warning \
            | tee "$OUT/serve-load-$model.log" | tail -n 6
        python bench/step_trace.py "$OUT/serve-trace-$model.json" | tee "$OUT/serve-trace-$model.txt"
    done
fi

if [[ $what == round ]]; then
    # Where a round's time goes, kernel by kernel ($2: topk, $3: kernels listed per graph,
    # $4: batch sizes, comma-separated, default 1).
    batches=${4:-1}
    for bs in ${batches//,/ }; do
        python bench/profile_round.py "${2:-1}" "${3:-16}" "$bs" 2>&1 | grep -v Warning \
            | tee -a "$OUT/profile-round.log" | grep -E "kernels,|replay|=="
    done
fi

# alternate NEW BASE "MODE ARGS": `h200.sh MODE ARGS` with NEW's package, then BASE's, in the
# order new, base, base, new, this tree's scripts and caches every time (`ab`, `patch`).
# AB_OWN_TUNING=1: each tree keeps GEMV tuner choices of its own, from an empty cache (a
# change to how the tuner decides leaves its keys as they were, so a shared cache would
# hand the second side the first side's choices; the carried cache, the first's of all).
alternate() {
    local side tree tuning=
    for side in new base base new; do
        echo "=== $side"
        tree=$([[ $side == base ]] && echo "$2" || echo "$1")
        [[ ${AB_OWN_TUNING:-} == 1 ]] \
            && tuning="$caches/graphrt-$(realpath "$tree" | md5sum | cut -c1-12)" \
            && mkdir -p "$tuning"
        H200_NESTED=1 GRAPHRT_TREE=$tree AB_TUNING_DIR=$tuning OUT=$(mktemp -d) \
            bash bench/h200.sh $3
    done
}

if [[ $what == ab ]]; then
    # A host-side change against its base on one machine ($2: the base's tree, made here
    # with `mkdir -p scratch/base && git archive REV core devices spec | tar -x -C
    # scratch/base`; scratch/ travels with the working tree): `h200.sh $3` with this
    # tree's package and the base's, twice each (new, base, base, new), this tree's
    # scripts both times. The hosts of two machine starts differed 3x (stop 46: one decode
    # graph's launch took 22 and 6.6 us), so only this compares host-bound figures.
    # In the order new, base, base, new: each side once early and once late (stop 67: in
    # new, base, new, base the unchanged plain step read 0.16-0.19 ms slower on the side
    # that ran first in each pair, and equal with the base first).
    alternate . "$2" "$3"
fi

if [[ $what == patch ]]; then
    # A kernel change kept as a patch (bench/results/*.patch) against this tree, on one
    # machine: the patch goes onto a copy of the package here (tests/ hunks left out: the
    # copy has no tests), then `context` at prompt 512 for each model, as `ab` runs a mode
    # (patched, base, base, patched). The runs share the GEMV tuner's choices (one
    # GRAPHRT_CACHE_DIR, keyed by shape and candidates, not kernel source), so the figures
    # compare the patch alone; a patch that changes a key's candidates tunes it afresh, and
    # one that changes how the tuner decides needs AB_OWN_TUNING=1 (alternate above).
    patched=$(mktemp -d)
    cp -r core devices spec "$patched"/
    python - "$2" > "$patched/src.patch" <<'PY'
import re, sys
text = open(sys.argv[1]).read()
print("".join(p for p in re.split(r"(?m)^(?=diff --git |--- a/)", text)
              if not re.match(r"(diff --git a/|--- a/)tests/", p)), end="")
PY
    # patch(1), or git apply (outside a repository it applies to the folder it runs in)
    if command -v patch > /dev/null; then
        patch -s -p1 -d "$patched" < "$patched/src.patch"
    else
        (cd "$patched" && git apply src.patch)
    fi || { echo "patch $2 does not apply"; exit 1; }
    models=${3:-llama-1b,gemma4-e2b}
    for model in ${models//,/ }; do
        echo "=== random:$model (new: patched)"
        alternate "$patched" . "context ${4:-1,8} 512 $model"
    done 2>&1 | tee "$OUT/patch-ab.log"
fi

if [[ $what == enginetests ]]; then
    # The CUDA tests of the engine's step path (conformance, engine, speculative rounds):
    # a change to the host side of a step, checked in about three minutes.
    timeout "${LANE_LIMIT:-300}" python -m pytest tests/conformance tests/test_engine*.py tests/test_spec*.py \
        tests/test_embedded_pair.py tests/test_llm.py -m cuda -v -ra -n "${CUDA_WORKERS:-14}" --dist loadfile \
        > "$OUT/tests-engine-cuda.log" 2>&1
    grep -E "^(FAILED|ERROR)|\] (FAILED|ERROR)" "$OUT/tests-engine-cuda.log" | sort -u | head -n 20
    tail -n 2 "$OUT/tests-engine-cuda.log"
fi

if [[ $what == host ]]; then
    # Where a decode step's host time goes (bench/step_phases.py), batch 1, 8 and 64 (64
    # request slots), engines $3 (default: plain and auto forced to plain steps).
    for bs in 1 8 64; do
        BATCH=$bs ENGINES=${3:-plain,auto-plain} python bench/step_phases.py "${2:-200}" cuda 3 64 \
            2>&1 | grep -v Warning | tee -a "$OUT/step-phases.log" | tail -n 30
    done
fi

if [[ $what == onepass ]]; then
    # Issue 20: the one-pass verify kernel's CUDA tests (the kernel, the backend, the
    # speculative conformance rounds), one layer beside decode and the width-invariant
    # kernel ($2: --onepass settings), and the round of 4 against a decode step.
    timeout 200 python -m pytest -q -p no:cacheprovider -m cuda -n 14 tests/test_triton_verify_onepass.py \
        tests/test_triton_spec_attention.py tests/conformance/test_spec_rounds.py 2>&1 \
        | tee "$OUT/tests-onepass.log" | grep -E "^(FAILED|ERROR)|passed|failed" | tail -n 12
    python bench/attention_layer.py --batch-sizes 1,8,64 --onepass "${2:-0/0/0}" 2>&1 \
        | grep -v Warning | tee "$OUT/attention-layer.log" | tail -n 13
    graphrt bench --model random:gemma4-e2b --draft random:gemma4-e2b-assistant --dtype bfloat16 \
        --prompt-len 512 --batch-sizes 1,8,64 --spec-steps 4 --spec-topk 1 --steps 30 --runners graph \
        --out "$OUT/bench-h200-spec-topk1.json" 2>&1 | grep -v Warning | tail -n 4
fi

if [[ $what == splits ]]; then
    for shape in llama-1b gemma4-global; do
        python bench/decode_splits.py --shape $shape --splits 16,64,128 --rest-chunk 16 2>&1 \
            | grep -v Warning | tee "$OUT/decode-splits-$shape.log"
    done
    graphrt bench --model random:llama-1b --batch-sizes 1,8,64 --runners graph --steps 30 \
        --prompt-len 512,2048,8192,32768 --out "$OUT/bench-llama-1b-context.json" 2>&1 \
        | grep -v Warning | grep -E "^ +[0-9]|== prompt|wrote"
fi

if [[ $what == cold || $what == recheck ]]; then
    # Issue 21: the README's first command from empty Triton and graphrt caches (every
    # kernel compiles, every GEMV shape is timed), then again (caches warm): wall time from
    # the shell, and where the seconds go (bench/cold_start.py).
    kept=("$TRITON_CACHE_DIR" "$GRAPHRT_CACHE_DIR")
    TRITON_CACHE_DIR=$(mktemp -d) GRAPHRT_CACHE_DIR=$(mktemp -d)
    for run in cold warm; do
        start=$(date +%s.%N)
        # (the cold run also lists its captures' costliest calls, the warm one compiling
        # ahead's: its dry runs find every kernel cached; last in its file)
        python bench/cold_start.py \
            $([[ $run == cold ]] && echo --profile-captures 30 || echo --profile-ahead 30) \
            > "$OUT/first-$run.txt" 2>&1
        rc=$? wall=$(python -c "print(round($(date +%s.%N) - $start, 1))")
        echo "first command ($run): exit $rc, $wall s wall"
        grep -E "set up|tok/s" "$OUT/first-$run.txt" | head -n 3
        sed -n '/^== /,$p' "$OUT/first-$run.txt" | head -n 24
        # The cold captures' profile in this log too: the file may not come back (the
        # device tool brings 8 files; stop 56's did not).
        [[ $run == cold ]] && sed -n '/^graph captures, the/,$p' "$OUT/first-$run.txt" \
            | grep -E "ncalls|^ +[0-9]" | cut -c1-160 | head -n 34
        [[ $run == warm ]] && sed -n '/^compiling ahead, the/,$p' "$OUT/first-$run.txt" \
            | grep -E "ncalls|^ +[0-9]" | cut -c1-160 | head -n 34
    done
    # The GEMV tuner's choices (devices/cuda/gemv_choices/ ships a card's): its file name
    # holds torch's '+', which the device tool does not bring back. The shapes it holds
    # are those this start had to time: ship them (python bench/ship_choices.py FILE).
    for f in "$GRAPHRT_CACHE_DIR"/*.json; do
        [[ -f $f ]] && cp "$f" "$OUT/$(basename "$f" | tr -c 'A-Za-z0-9._\n-' _)"
    done
    TRITON_CACHE_DIR=${kept[0]} GRAPHRT_CACHE_DIR=${kept[1]}
fi

if [[ $what == context ]]; then
    graphrt bench --model "random:${4:-llama-1b}" --batch-sizes "${2:-1,8}" --runners graph \
        --steps 30 --prompt-len "${3:-8192,32768}" --out "$OUT/bench-${4:-llama-1b}-context.json" 2>&1 \
        | grep -v Warning | grep -E "^ +[0-9]|== prompt"
fi

if [[ $what == ncu ]]; then
    profiler=$(command -v ncu || ls /opt/nvidia/nsight-compute/*/ncu 2>/dev/null | head -n 1)
    for cell in "8|8192" "1|32768"; do
        IFS='|' read -r bs ctx <<< "$cell"
        # each launch twice (--once): its first compiles, both are profiled
        "$profiler" --clock-control none -k regex:_decode_partial_kernel --section SpeedOfLight \
            --section MemoryWorkloadAnalysis --section Occupancy --section WarpStateStats \
            --section LaunchStats --section SchedulerStats \
            python bench/decode_splits.py --once --batch-sizes "$bs" --contexts "$ctx" \
            --launches "${2:-64:4:2,64:4:3,128:4:2}" > "$OUT/ncu-$bs-$ctx.log" 2>&1
        echo "== ncu, llama-1b, $bs requests of $ctx keys: exit $?"
        grep -E "_decode_partial_kernel|Duration|DRAM Throughput|L2 Hit|Achieved Occupancy|Theoretical Occupancy|Registers Per|Block Limit (Reg|Shared)|Warp Cycles Per Issued|Issued Warp|No Eligible|Active Warps Per" \
            "$OUT/ncu-$bs-$ctx.log" | cut -c1-120 | head -n 90
    done
fi

if [[ $what == launches ]]; then
    for run in "llama-1b|${2:-64:4:2,64:4:3,128:4:2,128:4:3}|" \
        "gemma4-sliding|${3:-32:4:2,32:4:3}|" "gemma4-global|${3:-32:4:2,32:4:3,16:4:3}|"; do
        IFS='|' read -r shape launches flag <<< "$run"
        python bench/decode_splits.py --shape "$shape" --contexts 512,8192,32768 \
            --launches "$launches" $flag 2>&1 | grep -v Warning \
            | tee -a "$OUT/decode-launches.log"
    done
fi

if [[ $what == prefill ]]; then
    # Issue 21: prefill tokens/s against transformers on the same weights ($2: lengths;
    # $3 = profile: also each length's kernels by device time and host ops, in the log).
    python bench/prefill.py --model random:llama-1b --lens "${2:-512,2048,8192,32768}" \
        --out "$OUT/prefill.json" ${3:+--profile} 2>&1 | grep -v "Warn\|USDT\|warn_once" \
        > "$OUT/prefill.log"
    grep -E "^ +[0-9]+ graphrt" "$OUT/prefill.log"
fi

if [[ $what == sdpa ]]; then
    # Issue 21: which SDPA backend graphrt's long prefill chunks get, and what the others cost.
    for shape in llama-1b gemma-global; do
        (cd bench && python sdpa_prefill.py --shape "$shape") 2>&1 | grep -v Warning \
            | tee "$OUT/sdpa-$shape.log"
    done
fi

if [[ $what == profile ]]; then
    python bench/profile_step.py "${2:-random:llama-1b,random:gemma4-e2b}" "${3:-1,32}" 512 ${4:-tuned,no-pdl,cublas} 2>&1 \
        | grep -v Warning | tee "$OUT/profile-step.log" | tail -n 80
fi

eval_pair() {  # eval_pair NAME TARGET_DIR ASSISTANT_DIR [eval_pair.py flags]
    python bench/eval_pair.py --device cuda --runner graph --target "$2" --draft "$3" \
        --configs "${EVAL_CONFIGS:-3x1,3x3,5x1,5x3,7x1}" --out "$OUT/eval-$1-cuda.json" "${@:4}" \
        2>&1 | grep -v "Warning\|Loading weights" | tail -n 12
}

if [[ $what == pair ]]; then
    # Issue 9: train the Gemma 4 pair and measure decoding with and without its drafter on
    # the GPU (graphs). Needs build/pair/tokens.pt carried (`carry: ["build/pair/tokens.pt"]`),
    # made here by: python scripts/train_pair.py tokenize --tokenizer core/pretrained/gemma4-code-target
    #   --out build/pair/tokens.pt. Extra train flags in $2, e.g. "--distill-sequences 512".
    # $OUT holds at most 8 files: the checkpoints come back as two tars.
    python scripts/train_pair.py train --tokens build/pair/tokens.pt \
        --tokenizer core/pretrained/gemma4-code-target --out pair ${2:-} > "$OUT/train-pair.log" 2>&1
    echo "train exit $?"; grep -v "step\|Writing" "$OUT/train-pair.log" | tail -n 12
    for m in target assistant; do tar cf "$OUT/pair-$m.tar" -C pair "$m"; done
    cp pair/report.json "$OUT/pair-report.json"
    eval_pair shipped core/pretrained/gemma4-code-target core/pretrained/gemma4-code-assistant
    eval_pair trained pair/target pair/assistant
fi

if [[ $what == paireval ]]; then
    # bash bench/h200.sh paireval "name=target_dir:assistant_dir[:dtype] ..." (default: the
    # shipped pair): eval_pair for each (--explain: where outputs differ, the target's
    # top-2 gap), the speculative round's pieces timed for the last, then the README's
    # first command on the GPU.
    for item in ${2:-shipped=core/pretrained/gemma4-code-target:core/pretrained/gemma4-code-assistant}; do
        IFS=: read -r target assistant dtype <<< "${item#*=}"
        eval_pair "${item%%=*}" "$target" "$assistant" --explain --dtype "${dtype:-auto}"
    done
    graphrt bench --model "$target" --draft "$assistant" --prompt-len 32 --batch-sizes 1 \
        --spec-steps 5 --spec-topk 1 --steps 50 --runners graph --out "$OUT/bench-spec-pair.json" \
        2>&1 | grep -v Warning | tail -n 4
    dirs="$target:$assistant"
    graphrt generate --model "${dirs%%:*}" --draft "${dirs#*:}" --device cuda \
        --prompt "def fibonacci(n):" > "$OUT/generate-pair-cuda.txt" 2>&1
    echo "generate exit $?"; tail -n 4 "$OUT/generate-pair-cuda.txt"
fi

if [[ $what == reliability ]]; then
    # Issue 10, items 5-7: captures failing under a memory cap, then the differential
    # (eager vs graphs) and the soak, each 10,000 decode steps ($2: steps).
    timeout 150 python bench/capture_oom.py --out "$OUT/capture-oom.json" 2>"$OUT/capture-oom.err" \
        | tail -n 12
    echo "capture_oom exit ${PIPESTATUS[0]}"; grep -v "^{" "$OUT/capture-oom.err" | tail -n 3
    if [[ ${2:-10000} != 0 ]]; then
        timeout 240 python tests/soak.py --device cuda --steps "${2:-10000}" --out "$OUT/soak.json" \
            2>"$OUT/soak.err" | tail -n 8
        echo "soak exit ${PIPESTATUS[0]}"; grep -v "step/s" "$OUT/soak.err" | tail -n 5
    fi
fi

if [[ $what == soakspec ]]; then
    # The differential and soak with speculative rounds on every engine: the embedded pair,
    # whose drafts are accepted 0 to 5 at a time ($2: steps, default 3000).
    timeout "${SOAK_TIMEOUT:-500}" python tests/soak.py --device cuda --steps "${2:-3000}" \
        --model core/pretrained/gemma4-code-target --draft core/pretrained/gemma4-code-assistant \
        --out "$OUT/soak-spec.json" 2>"$OUT/soak-spec.err" | tail -n 8
    echo "soak (speculative) exit ${PIPESTATUS[0]}"; grep -v "step/s" "$OUT/soak-spec.err" | tail -n 5
fi

if [[ $what == lanes ]]; then
    # The CUDA lane in the background while the capture-under-a-cap demonstration and the
    # speculative soak run (separate processes; each caps or measures its own memory only).
    # $OUT keeps few files: logs go to one tar, summaries print.
    mkdir -p "$OUT/logs"
    (OUT="$OUT/logs" timeout 530 bash bench/h200.sh tests > "$OUT/logs/lane.txt" 2>&1) &
    lane=$!
    OUT="$OUT/logs" bash bench/h200.sh reliability 0 2>&1 | tail -n 14
    OUT="$OUT/logs" SOAK_TIMEOUT=360 bash bench/h200.sh soakspec "${2:-3000}" 2>&1 | tail -n 12
    wait $lane
    tail -n 16 "$OUT/logs/lane.txt"
    tar cf "$OUT/logs.tar" -C "$OUT/logs" . && rm -r "$OUT/logs"
fi

if [[ $what == tp ]]; then
    # Issue 11: the all-reduce micro-benchmark, then random:llama-8b bf16, prompt 512, graph
    # decode step per batch size at TP=1 and, where the machine has two GPUs, TP=2 with
    # each all-reduce (GRAPHRT_ALL_REDUCE nccl, then symm_mem) and each graph step's
    # collective time. $2 "-": the micro-benchmark only.
    gpus=$(nvidia-smi -L | wc -l)
    export NCCL_NVLS_ENABLE=0 TORCH_SYMM_MEM_DISABLE_MULTICAST=1  # multicast stays off here
    python -m torch.distributed.run --nproc-per-node "$(( gpus >= 2 ? 2 : 1 ))" \
        bench/allreduce_cuda.py --out "$OUT/allreduce.json" 2>&1 | grep -v Warning | tail -n 6
    runs="1:nccl"; (( gpus >= 2 )) && runs="1:nccl 2:nccl 2:symm_mem"
    [[ ${2:-} == - ]] && runs=""
    for run in $runs; do
        tp=${run%%:*} ar=${run#*:}
        GRAPHRT_ALL_REDUCE=$ar graphrt bench --model random:llama-8b --dtype bfloat16 \
            --prompt-len 512 --tp "$tp" --batch-sizes "${2:-1,8,64}" --max-running-requests 64 \
            --runners graph --no-plot --out "$OUT/bench-llama8b-tp$tp-$ar.json" \
            > /tmp/bench-run.log 2>&1
        echo "TP=$tp $ar exit $?"; grep -v Warning /tmp/bench-run.log | tail -n 6
        cat /tmp/bench-run.log >> "$OUT/bench-llama8b.log"  # one log: $OUT returns few files
    done
fi

if [[ $what == tptests ]]; then
    # Issue 11: the TP CUDA tests (two GPUs: NCCL and one-shot sums in graphs, TP=2 tokens
    # against one GPU's over each all-reduce; one GPU: the one-shot set-up and capture).
    gpus=$(nvidia-smi -L | wc -l)
    export NCCL_NVLS_ENABLE=0 TORCH_SYMM_MEM_DISABLE_MULTICAST=1  # multicast stays off here
    python -m pytest tests/test_cuda_collectives.py tests/test_tp_launch.py -m cuda -q \
        -p no:cacheprovider -ra 2>&1 | tee "$OUT/tests-tp-cuda.log" | tail -n 6
    if (( gpus < 2 )); then  # the one-line refusal a user gets asking for more GPUs than exist
        graphrt generate --model random:llama-tiny --prompt-ids 1,2 --max-new-tokens 4 --tp 2 \
            --device cuda > /dev/null 2> "$OUT/tp2-one-gpu.err"
        echo "generate --tp 2 on $gpus GPU: exit $?: $(tail -n 1 "$OUT/tp2-one-gpu.err")"
    fi
fi

if [[ $what == recheck ]]; then
    # (A bare machine compiles every kernel these tests launch: the files are few, the
    # workers the lane's, so `cold` above (about 30 s), the tests, the bench and the three
    # runs below fit one 600 s call.)
    timeout "${RECHECK_LIMIT:-300}" python -m pytest tests/test_scaled_embed.py tests/test_spec.py \
        tests/test_compile_ahead.py tests/conformance/test_spec_rounds.py tests/conformance/test_overlap.py \
        tests/test_triton_attention.py tests/test_triton_ops.py tests/test_models_parity.py -m cuda -v \
        -p no:cacheprovider -ra -n "${CUDA_WORKERS:-14}" --dist loadfile \
        > "$OUT/tests-recheck.log" 2>&1
    echo "recheck tests exit $?"; grep -E "\] (FAILED|ERROR)" "$OUT/tests-recheck.log" | sort -u | head -n 20
    tail -n 2 "$OUT/tests-recheck.log"
    graphrt bench --model random:gemma4-e2b --draft random:gemma4-e2b-assistant --dtype bfloat16 \
        --prompt-len 512 --batch-sizes 1,64 --spec-steps 4 --spec-topk 1 --steps 30 --runners graph \
        --out "$OUT/bench-recheck-spec.json" 2>&1 | grep -v Warning | tail -n 12
    for flags in "--no-draft" "" "--no-overlap"; do
        graphrt generate --prompt "def fibonacci(n):" $flags --max-new-tokens 300 --ignore-eos --json \
            > "$OUT/run.json" 2> "$OUT/run.err" || tail -n 3 "$OUT/run.err"
        python -c "import json,sys; s=json.load(open(sys.argv[1]))['stats']; print(f\"{sys.argv[2]:<22} {s['tokens_per_s']:9.1f} tok/s\", s.get('spec', ''))" \
            "$OUT/run.json" "pair ${flags:-auto}"
    done
    rm -f "$OUT/run.json" "$OUT/run.err"
    # Stop 54's prefill changes (no wait a layer, long chunks on cuDNN): against transformers.
    python bench/prefill.py --model random:llama-1b --lens 512,8192,32768 \
        --out "$OUT/prefill.json" 2>&1 | grep -E "^ +[0-9]+ graphrt"
fi

if [[ $what == bench || $what == all ]]; then
    # One JSON per model. Gemma 4's sliding layers keep the transformers peer from
    # compiling once (the bench says so and skips hf for it).
    for model in llama-1b gemma4-e2b; do
        graphrt bench --model "random:$model" --dtype bfloat16 --prompt-len 512 --batch-sizes 1,8,32,64 \
            --runners "$runners" --out "$OUT/bench-h200-$model.json" 2>&1 \
            | tee "$OUT/bench-$model.log" | grep -v Warning
    done
fi

if [[ $what == spec || $what == all ]]; then
    # Frozen-KV MTP rounds: random:gemma4-e2b with its assistant, bf16, prompt 512.
    for topk in ${topks//,/ }; do
        graphrt bench --model random:gemma4-e2b --draft random:gemma4-e2b-assistant --dtype bfloat16 \
            --prompt-len 512 --batch-sizes "${SPEC_BATCHES:-1,8,32,64}" --spec-steps 4 --spec-topk "$topk" --steps 30 \
            --runners "${SPEC_RUNNERS:-graph,hf}" --out "$OUT/bench-h200-spec-topk$topk.json" 2>&1 \
            | tee "$OUT/bench-spec-topk$topk.log" | grep -v Warning
    done
fi

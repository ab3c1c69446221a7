#!/usr/bin/env bash
# One call on the lent H200: versions, the CUDA test lane, an end-to-end
# generate, and the decode benchmark. Logs and JSON under $OUT; a short
# table prints last. Usage: bash bench/h200.sh [tests|bench|spec|all] [bench runners] [spec topks]
#   bash bench/h200.sh kernels [pytest -k filter]: the fused-kernel CUDA tests only
#   bash bench/h200.sh profile [models] [batch sizes]: bench/profile_step.py
#   bash bench/h200.sh pair ["train flags"]: train the embedded Gemma 4 pair, eval on cuda
set -uo pipefail
cd "$(dirname "$0")/.."
OUT=${OUT:-out}
mkdir -p "$OUT"
what=${1:-all}
runners=${2:-eager,graph,hf}
topks=${3:-1,3}
export PYTHONUNBUFFERED=1

# graphrt from this working tree without pip (the machine has no registry):
# graphrt is a namespace package, so symlinks to core/, devices/, spec/ do.
site=$(mktemp -d)
mkdir -p "$site/graphrt"
for p in core devices spec; do ln -s "$PWD/$p" "$site/graphrt/$p"; done
export PYTHONPATH="$site${PYTHONPATH:+:$PYTHONPATH}"
graphrt() { python -m graphrt.core.cli.main "$@"; }

{
    date -u +%FT%TZ
    python -c "import torch, triton, transformers; print('torch', torch.__version__, 'cuda', torch.version.cuda, '| triton', triton.__version__, '| transformers', transformers.__version__)"
    nvidia-smi --query-gpu=name,driver_version,memory.total,clocks.max.sm --format=csv,noheader
} | tee "$OUT/versions.txt"

if [[ $what == tests || $what == all ]]; then
    # The tests-cuda lane's selection, run with pytest directly (no nox venv offline).
    python -m pytest tests -m cuda -q -p no:cacheprovider -ra 2>&1 | tee "$OUT/tests-cuda.log" | tail -n 15
    graphrt generate --model random:llama-1b --prompt-ids 1,2,3,4 --prompt-ids 5,6 --max-new-tokens 16 \
        --ignore-eos --json > "$OUT/generate-cuda.json" 2> "$OUT/generate-cuda.err"
    echo "generate exit $?: $(head -c 600 "$OUT/generate-cuda.json")"
fi

if [[ $what == kernels ]]; then
    python -m pytest tests/test_triton_fused.py tests/test_triton_ops.py tests/test_gemma4.py -m cuda \
        -q -p no:cacheprovider -ra ${2:+-k "$2"} 2>&1 \
        | tee "$OUT/tests-kernels.log" | tail -n 25
fi

if [[ $what == profile ]]; then
    python bench/profile_step.py "${2:-random:llama-1b,random:gemma4-e2b}" "${3:-1,32}" 2>&1 \
        | grep -v Warning | tee "$OUT/profile-step.log" | tail -n 80
fi

if [[ $what == pair ]]; then
    # Issue 9: train the Gemma 4 pair and measure decoding with and without its drafter on
    # the GPU (graphs). Needs build/pair/tokens.pt carried (`carry: ["build/pair"]`), made
    # here by: python scripts/train_pair.py tokenize --tokenizer core/pretrained/gemma4-code-target
    #   --out build/pair/tokens.pt. Extra train flags in $2, e.g. "--distill-sequences 512".
    # $OUT holds at most 8 files: the checkpoints come back as two tars.
    python scripts/train_pair.py train --tokens build/pair/tokens.pt \
        --tokenizer core/pretrained/gemma4-code-target --out pair ${2:-} > "$OUT/train-pair.log" 2>&1
    echo "train exit $?"; grep -v "step\|Writing" "$OUT/train-pair.log" | tail -n 12
    for m in target assistant; do tar cf "$OUT/pair-$m.tar" -C pair "$m"; done
    cp pair/report.json "$OUT/pair-report.json"
    for which in shipped trained; do
        dirs=(core/pretrained/gemma4-code-target core/pretrained/gemma4-code-assistant)
        [[ $which == trained ]] && dirs=(pair/target pair/assistant)
        python scripts/eval_pair.py --device cuda --runner graph --target "${dirs[0]}" \
            --draft "${dirs[1]}" --out "$OUT/eval-$which-cuda.json" 2>&1 | grep -v Warning | tail -n 9
    done
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
            --prompt-len 512 --batch-sizes 1,8,32 --spec-steps 4 --spec-topk "$topk" --steps 30 \
            --runners graph,hf --out "$OUT/bench-h200-spec-topk$topk.json" 2>&1 \
            | tee "$OUT/bench-spec-topk$topk.log" | grep -v Warning
    done
fi

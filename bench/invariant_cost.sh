#!/usr/bin/env bash
# Issue 20: what --batch-invariant costs a decode step by model size (graphs, bf16, prompt
# 512, batch 1 / 8 / 64): the embedded pair's target (~5M parameters), random Llama
# checkpoints made here with transformers (~30M and ~110M), random:llama-1b. Each model's
# two modes run back to back in fresh processes, twice, alternating. Run on the GPU
# through bench/h200.sh exec "bash bench/invariant_cost.sh"; writes $OUT/invariant.tgz.
set -uo pipefail
mk=$(mktemp -d) res=$(mktemp -d)  # $OUT takes few files: one tar at the end
python - "$mk" <<'PY'
import sys, torch
from transformers import LlamaConfig, LlamaForCausalLM
for name, h, layers, heads, kv, vocab in (("llama-30m", 512, 8, 8, 4, 16000), ("llama-110m", 768, 12, 12, 4, 32000)):
    cfg = LlamaConfig(hidden_size=h, intermediate_size=4 * h, num_hidden_layers=layers,
                      num_attention_heads=heads, num_key_value_heads=kv, vocab_size=vocab,
                      max_position_embeddings=4096, torch_dtype="bfloat16")
    model = LlamaForCausalLM(cfg).to(torch.bfloat16)
    model.save_pretrained(f"{sys.argv[1]}/{name}")
    print(name, sum(p.numel() for p in model.parameters()) / 1e6, "M parameters")
PY
for model in core/pretrained/gemma4-code-target "$mk/llama-30m" "$mk/llama-110m" random:llama-1b; do
    for rep in 1 2; do
        for flag in "" --batch-invariant; do
            out="$res/invariant-$(basename "$model")-$rep${flag:+-inv}.json"
            python -m graphrt.core.cli.main bench --model "$model" --batch-sizes 1,8,64 --runners graph \
                --prompt-len 512 --steps 100 --no-plot $flag --out "$out" > "$out.log" 2>&1 || { echo "bench failed: $model $flag"; tail -n 3 "$out.log"; }
            python -c "
import json, sys
r = json.load(open(sys.argv[1]))
print(sys.argv[2], sys.argv[3] or 'default', [(b['batch_size'], round(b.get('graph_ms') or b['decode_ms'], 3)) for b in r['batches']])
" "$out" "$(basename "$model")#$rep" "$flag"
        done
    done
done
tar czf "$OUT/invariant.tgz" -C "$res" .

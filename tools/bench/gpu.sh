#!/usr/bin/env bash
# Tessera against hand-written baselines on ONE NVIDIA H200 (141 GB), bf16, one rank.
#
# Model: ~1.1B Llama (configs/models/llama-1b.yaml: hidden 2048, 16 layers, 32 heads / 8 KV heads, SwiGLU
# 8192, vocab 32000 untied), seq 2048, 8 x 2048 = 16,384 tokens per step (recipes/bench-llama-1b-h200.yaml;
# data: the stdlib corpus with its 512-token BPE, packed into 2048-token rows).
# Runs, each BENCH_STEPS (35) steps, the first BENCH_WARMUP (5) left out of the figures, each pair
# Tessera then raw, on the same batches from the same initial weights:
#   zero0         tessera run (engine deepspeed, ZeRO-0)   vs tools/bench/raw_deepspeed.py
#   zero3         tessera run (engine deepspeed, ZeRO-3)   vs tools/bench/raw_deepspeed.py
#   megatron-tp1  tessera run (engine megatron, TP1, DDP)  vs tools/bench/raw_megatron.py
# Output: bench-results/gpu.json (tools/bench/gpu_summary.py: median step time, tokens/s = 16,384 / step
# time, MFU = (6·N + 12·L·H·Q·T) · tokens/s / 989e12, the H200's dense bf16 peak from
# configs/hardware/h200-141g.yaml; Tessera / raw ratios), the runs under bench-results/gpu-runs/.
# Expected wall time: well under 8 minutes (six launches of ~30-60 s of start-up and ~10 s of steps).
#
# Usage, from the repository root after `make setup`:
#   tools/bench/gpu.sh               # the GPU benchmark (needs a CUDA build of torch 2.13.0, see below)
#   tools/bench/gpu.sh --cpu-smoke   # every code path on CPU (gloo): tiny model, 3 steps, 1 rank;
#                                    # writes bench-results/gpu-smoke.json
#
# torch: `make setup` installs torch==2.13.0 from the configured package index, which on the project's
# machines is the CPU build (2.13.0+cpu). On the GPU machine the venv needs the CUDA build of the same
# version, e.g.  .venv/bin/pip install --force-reinstall --no-deps torch==2.13.0 \
#                    --index-url https://download.pytorch.org/whl/cu128   (the CUDA version of the driver)
# The script stops with that message when torch sees no CUDA device.
set -euo pipefail
cd "$(dirname "${BASH_SOURCE[0]}")/../.."

MODE=gpu
case "${1:-}" in
  "") ;;
  --cpu-smoke) MODE=cpu-smoke ;;
  -h | --help) sed -n '2,/^set -euo/p' "$0" | sed '$d; s/^# \{0,1\}//'; exit 0 ;;
  *) echo "usage: $0 [--cpu-smoke]" >&2; exit 2 ;;
esac

PY=.venv/bin/python
TESSERA=.venv/bin/tessera
DEEPSPEED=.venv/bin/deepspeed
RECIPE=recipes/bench-llama-1b-h200.yaml
for exe in "$PY" "$TESSERA" "$DEEPSPEED"; do
  [[ -x $exe ]] || { echo "$exe not found: run make setup first" >&2; exit 1; }
done

if [[ $MODE == gpu ]]; then
  STEPS=${BENCH_STEPS:-35}
  WARMUP=${BENCH_WARMUP:-5}
  RUN_TIMEOUT=${BENCH_RUN_TIMEOUT:-300}
  WORK=bench-results/gpu-runs
  OUT=bench-results/gpu.json
  export DS_ACCELERATOR=cuda
  COMMON=()
  LAUNCH=(--num_gpus 1)
  "$PY" - <<'EOF'
import sys

import torch

if not torch.cuda.is_available():
    sys.exit(
        f"torch {torch.__version__} sees no CUDA device. `make setup` installs torch==2.13.0 from the "
        "configured index (the CPU build on the project machines); put the CUDA build of the same version "
        "in .venv, e.g. .venv/bin/pip install --force-reinstall --no-deps torch==2.13.0 --index-url "
        "https://download.pytorch.org/whl/cu128 (the CUDA version of the driver), then rerun."
    )
name = torch.cuda.get_device_name(0)
print(f"torch {torch.__version__} (CUDA {torch.version.cuda}), device 0: {name}, {torch.cuda.device_count()} visible")
if not torch.__version__.startswith("2.13."):
    print(f"warning: the project pins torch 2.13.0, this is {torch.__version__}", file=sys.stderr)
if "H200" not in name:
    print("warning: not an H200: MFU is still computed against the H200's 989 TFLOP/s", file=sys.stderr)
EOF
else
  STEPS=3
  WARMUP=1
  RUN_TIMEOUT=${BENCH_RUN_TIMEOUT:-900}
  WORK=bench-results/gpu-smoke-runs
  OUT=bench-results/gpu-smoke.json
  export DS_ACCELERATOR=cpu
  # the same recipe (bf16, sdpa), shrunk: tiny Llama, short rows, 1 CPU rank, the CPU hardware profile
  COMMON=(run.device=cpu run.hardware=cpu-2core run.bind_cores_to_rank=true
    model.hf_config.hidden_size=64 model.hf_config.intermediate_size=128
    model.hf_config.num_hidden_layers=2 model.hf_config.num_attention_heads=4
    model.hf_config.num_key_value_heads=2 model.hf_config.vocab_size=512
    model.hf_config.max_position_embeddings=256 data.seq_len=64)
  LAUNCH=(--num_gpus 1 --bind_cores_to_rank)
fi

rm -rf "$WORK"
mkdir -p "$WORK"
TABLE=$WORK/runs.tsv
: >"$TABLE"
T_START=$SECONDS

free_port() { "$PY" -c 'import socket; s = socket.socket(); s.bind(("127.0.0.1", 0)); print(s.getsockname()[1])'; }

# run_one CONFIG IMPL PATH OVERRIDES -- COMMAND...: one run with its log, its row in the run table
run_one() {
  local config=$1 impl=$2 path=$3 overrides=$4
  shift 5
  local log=$WORK/$impl-$config.log rc=0 t0=$SECONDS
  echo "[$((SECONDS - T_START))s] $impl $config: $*"
  timeout --kill-after=15 "$RUN_TIMEOUT" "$@" >"$log" 2>&1 || rc=$?
  printf '%s\t%s\t%s\t%s\t%s\t%s\t%s\n' "$config" "$impl" "$path" "$rc" "$((SECONDS - t0))" "$RECIPE" \
    "${COMMON[*]+${COMMON[*]} }$overrides" >>"$TABLE"
  if ((rc != 0)); then
    echo "  FAILED (exit $rc), the last lines of $log:"
    tail -n 15 "$log" | sed 's/^/    /'
  fi
  return 0
}

# the tokenised data once, before any run (tessera run prepares it before launch, outside its timing;
# the raw scripts read the same cache), and the libraries read once from disk
"$PY" - "$RECIPE" ${COMMON[@]+"${COMMON[@]}"} <<'EOF'
import sys

import deepspeed  # noqa: F401
import megatron.core  # noqa: F401
import transformers  # noqa: F401

from tessera.config.loader import load_recipe
from tessera.data import prepare_data

data = prepare_data(load_recipe(sys.argv[1], sys.argv[2:]).recipe.data)
print(f"data: {tuple(data.input_ids.shape)} rows x seq, vocab {data.vocab_size}")
EOF

CONFIGS=(
  "zero0|deepspeed|parallel.zero=0"
  "zero3|deepspeed|parallel.zero=3"
  "megatron-tp1|megatron|parallel.engine=megatron parallel.zero=0"
)
for entry in "${CONFIGS[@]}"; do
  IFS='|' read -r config raw overrides <<<"$entry"
  read -r -a ov <<<"$overrides"
  run_one "$config" tessera "$WORK/tessera-$config" "$overrides" -- \
    "$TESSERA" run "$RECIPE" ${COMMON[@]+"${COMMON[@]}"} "${ov[@]}" "train.steps=$STEPS" \
    "run.out_dir=$WORK/tessera-$config"
  port=$(free_port)
  run_one "$config" raw "$WORK/raw-$config.jsonl" "$overrides" -- \
    env DS_ACCELERATOR="$DS_ACCELERATOR" "$DEEPSPEED" "${LAUNCH[@]}" --master_addr 127.0.0.1 --master_port "$port" \
    "tools/bench/raw_$raw.py" --recipe "$RECIPE" ${COMMON[@]+"${COMMON[@]}"} "${ov[@]}" --steps "$STEPS" \
    --out "$WORK/raw-$config.jsonl"
  if [[ $MODE == cpu-smoke ]]; then  # DeepSpeed's CPU all-reduce segments of a killed run
    rm -f /dev/shm/deepspeed_allreduce_buffer_"$(id -u)"_127.0.0.1_"$port"_* 2>/dev/null || true
  fi
done

echo "[$((SECONDS - T_START))s] runs done; summary:"
"$PY" tools/bench/gpu_summary.py --runs "$TABLE" --warmup "$WARMUP" --mode "$MODE" --out "$OUT"

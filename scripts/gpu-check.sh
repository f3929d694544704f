#!/usr/bin/env bash
# The GPU check: about 5 minutes on the GPU machine (one H200; torch 2.11, triton 3.6,
# transformers 5.17, no network), every step time-boxed so a hang cannot eat the budget.
#
#   scripts/gpu-check.sh            # on the GPU machine
#   scripts/gpu-check.sh --cpu      # the same steps on the CPU: --tiny workloads, tiny models,
#                                   # and only the packages the H200 image has (scripts/h200_image)
#   scripts/gpu-check.sh --out DIR  # results folder (default: $OUT if set, else ./gpu-check-out)
#   scripts/gpu-check.sh --only 'rag,long-prefill*'   # just these steps (shell patterns,
#                                   # comma-separated): a cheap rerun after a fix; versions and
#                                   # summary always run
#
# Steps, in order (a failing step is recorded and the next one still runs):
#   versions      python, torch, triton, transformers, the device; nvidia-smi
#   kernels       pytest -q tests/kernels (CUDA when present; the Triton interpreter otherwise),
#                 on KERNELS_WORKERS pytest-xdist workers when xdist is there (the H200 image
#                 has it): cold, Triton's compiles are most of the step, and they use the CPU
#   prefill-splits  scripts/prefill_split_bench.py: the prefill kernel on one short chunk after a
#                 32k context at 1..32 key splits and the automatic choice (ms each), every
#                 split checked against the unsplit output (--cpu: a tiny shape)
#   quant-gemm    scripts/quant_gemm_bench.py: dense vs W4A16 (fused, and dequantize-then-GEMM),
#                 FP8 and INT8 W8A8 on Llama-3.1-8B's linear shapes at batch 1..1024 (ms, speed-up,
#                 error against the float GEMM of the same weights; --cpu: two tiny shapes)
#   triton-test   pytest -q tests/engine/attention/test_triton_backend.py
#                 tests/engine/attention/test_fp8_kv_cache.py tests/engine/exec/test_cuda_graphs.py
#                 tests/engine/quant/test_gemm_kernels.py (the quantized layers' kernel path)
#   greedy        scripts/greedy_check.py: kvbatch (triton backend, float32) vs transformers on
#                 a tiny random model and on the rag-shape model (--cpu: the tiny one, with
#                 the Triton interpreter)
#   rag           kvbatch bench rag --peers hf-static,kvbatch-sync --repeat 2 --kernel-profile
#                 --json rag.json (kvbatch-sync: async scheduling off, so its ratio is what
#                 async gains; --kernel-profile: one more kvbatch run under torch.profiler,
#                 kernels ranked, and how busy the GPU was)
#   long-prefill  kvbatch bench long-prefill --json long-prefill.json (the defaults: chunks
#                 of the 32k prompt sized from timed steps, long_prefill_step_ratio 2.5)
#   rag-gemma     kvbatch bench gemma-window --size gpu --json gemma-window.json: Gemma 3 1B's
#                 shape (26 layers, 22 of them windowed, window 512; random weights, bfloat16),
#                 64 prompts of 8k tokens, 256 out, under a KV budget of 8 whole sequences, run
#                 with window KV (sliding_window_kv) on and off: sequences at once, KV blocks,
#                 preemptions, tokens/s, and greedy tokens equal between them (--cpu: its tiny
#                 size; GEMMA_WINDOW_ARGS replaces the flags; skipped past BUDGET_S)
#   rag-hybrid    kvbatch bench hybrid-linear --size gpu --device cuda --json rag-hybrid.json: a
#                 Qwen3.5-shaped hybrid (24 layers, 18 Gated DeltaNet and 6 gated full attention,
#                 about 2B parameters, random, bfloat16), 32 prompts of 2,048 tokens sharing
#                 1,536, 64 out, beside transformers' generate, and sequences per GiB against
#                 full attention (--cpu: its tiny size; skipped past BUDGET_S)
#   rag-mla       kvbatch bench mla --size gpu --device cuda --dtype float32 --json rag-mla.json:
#                 DeepSeek-V3's attention widths (128 heads, latent 512 + rope 64) on 4 layers
#                 with 16 grouped-routed experts, random; 32 prompts of 1,024 tokens sharing 768,
#                 32 out, beside transformers' generate (greedy tokens must be equal), and KV
#                 bytes per token against GQA (--cpu: its tiny size; skipped past BUDGET_S)
#   quant-greedy  scripts/quant_greedy_check.py: online FP8, W4A16 (GPTQ, rounded random
#                 weights) and block-wise FP8 (Qwen3-*-FP8's layout) models on kvbatch.kernels'
#                 GEMMs against the reference path, float32, on tiny, rag-shape and tiny
#                 Qwen3-MoE models (quantized experts in the fused
#                 MoE kernel; --cpu: tiny only, the Triton interpreter: the quantized experts
#                 are tried there by the moe-w4a16 row)
#   moe-greedy    scripts/greedy_check.py --models tiny-moe: a tiny Qwen3-MoE (fused MoE kernel)
#                 against transformers, float32 (--cpu: the Triton interpreter)
#   quant-ROW     kvbatch bench rows of the quantized formats, kvbatch alone, into quant-ROW.json,
#                 most wanted first: no-share-gpu bf16 / FP8 / FP8 + FP8 KV, rag FP8, then
#                 decode-small-batch (Llama-3.1-8B's layers, 8 of them) at batch 1 and 8 in
#                 bf16 / W4A16 / FP8, then W4A16 and FP8 KV rows of rag and no-share-gpu,
#                 then rag-moe with FP8 and W4A16 experts (moe-fp8, moe-w4a16), then block-wise
#                 FP8 weights on rag and rag-moe (rag-fp8-block, moe-fp8-block)
#                 ($QUANT_ROWS picks them, empty skips them); each skipped past BUDGET_S
#   rag-moe       kvbatch bench rag-moe --peers hf-static --repeat 1 --json moe-rag.json: rag's
#                 prompts on Qwen3-30B-A3B's layer shapes, 4 of its 48 layers, random weights
#                 (skipped past BUDGET_S)
#   rag-qwen3     kvbatch bench rag-qwen3 --peers hf-static --repeat 1 --json qwen3-rag.json:
#                 the same prompts on Qwen3-8B's layer shapes (dense; q/k RMSNorm), 8 of its 36
#                 layers, random weights: the dense path at a realistic size (skipped past
#                 BUDGET_S)
#   rag-gpt-oss   kvbatch bench rag-gpt-oss --peers hf-static --repeat 1 --json gpt-oss-rag.json:
#                 the same prompts on gpt-oss-20b's layer shapes, 4 of its 24 layers, random
#                 MXFP4 experts (sinks, 128-token windows, the MXFP4 MoE kernel) against
#                 transformers dequantizing the same files to bfloat16 (skipped past BUDGET_S)
#   long-prefill-eager  the same with --cuda-graph-max-chunk 0 into long-prefill-eager.json:
#                 every step with a chunk eager, as before mixed-step CUDA graphs (what they
#                 gain; LONG_PREFILL_EAGER=0 skips it; skipped past BUDGET_S like the caps)
#   long-prefill-gc  the same with --no-freeze-gc into long-prefill-gc.json: the heap the
#                 engine starts with left in the cycle collector's full passes, as before
#                 engine/core/startup_heap.py (whether a full pass was the longest gap: each run
#                 names its longest GC pause while prefilling; LONG_PREFILL_GC=0 skips it;
#                 skipped past BUDGET_S like the caps)
#   long-prefill-CAP  the same with --long-prefill-token-threshold CAP
#                 --long-prefill-step-ratio 0 (token caps alone), for each CAP in
#                 $LONG_PREFILL_CAPS (default none, e.g. "256 1024") into
#                 long-prefill-CAP.json: what a fixed cap does to the gap target (and to the
#                 long prompt's first token) next to timed chunks; each is skipped when it
#                 could not end inside BUDGET_S (560; 900 with --cpu) seconds of the run
#   rag-hf-cb     kvbatch bench rag --peers hf-cb --repeat 1 --json rag-hf-cb.json: transformers'
#                 paged continuous batching (generate_batch) as the peer (RAG_HF_CB=0 skips it;
#                 skipped, like the caps, when it could not end inside BUDGET_S)
#   rag-sweep     kvbatch bench rag --sweep over max_num_seqs 512 x max_num_batched_tokens
#                 8192,16384 (kv fraction 0.9) into rag-sweep.json: whether all 512 requests
#                 at once serve rag better than the defaults (256 x 8192: the rag step's
#                 kvbatch row) ($RAG_SWEEP_ARGS replaces the grid; empty skips it); skipped,
#                 like the caps, when it could not end inside BUDGET_S
#   index-gpu     kvbatch bench index-cpu --device cuda --json index-gpu.json: the indexing job
#                 (kvbatch index: context + embed into LanceDB) beside transformers generate +
#                 sentence-transformers encode + LanceDB add, rows and vectors compared; needs
#                 lancedb, sentence-transformers, semchunk and gguf (the models come from
#                 wheels), which the H200 image lacks: skipped with a line naming what is absent
#                 (INDEX_GPU_DOCS documents, default 40; skipped past BUDGET_S)
#   summary       scripts/gpu_check_summary.py: the short table (also summary.txt)
#
# The results folder gets gpu-check.log (every step's output), steps.tsv, rag.json,
# rag-hf-cb.json, long-prefill.json, long-prefill-eager.json, long-prefill-gc.json,
# rag-sweep.json, quant-ROW.json (one per row), moe-rag.json, qwen3-rag.json,
# gemma-window.json and summary.txt
# (more than the eight files the device tool brings back, so there run it with
# `--out /tmp/gpu-check` and end the command with
# `tar -czf $OUT/gpu-check.tgz -C /tmp/gpu-check . ; cp /tmp/gpu-check/summary.txt $OUT/`). Each
# step's time limit can be changed through the environment (e.g. RAG_TIMEOUT=400); the
# required steps' limits add up to 1035 s, the optional ones (eager, gc, caps, quant rows,
# rag-moe, rag-qwen3, rag-gemma, hf-cb, sweep) run only while the run can end inside BUDGET_S;
# before the quantized steps a run took about 5 to 6 minutes (the quantized, MoE and rag-qwen3 steps are
# not yet timed on a GPU), and if the run is cut short every finished step's files are there.
# PER_TEST_TIMEOUT (75 s; 120 with --cpu) bounds each test of the kernels and triton-test steps,
# whose logs also list their slowest tests.
# LONG_PREFILL_ARGS adds options to the long-prefill bench (e.g.
# LONG_PREFILL_ARGS="--long-prefill-token-threshold 512"); RAG_PEERS replaces rag's peers.
set -u -o pipefail

cd "$(dirname "$0")/.."
CPU=0
ONLY=""
OUT_DIR="${OUT:-./gpu-check-out}"
while [ $# -gt 0 ]; do
  case "$1" in
    --cpu) CPU=1 ;;
    --out) OUT_DIR="$2"; shift ;;
    --only) ONLY="$2"; shift ;;
    -h|--help) awk 'NR > 1 && !/^#/ { exit } NR > 1' "$0"; exit 0 ;;
    *) echo "gpu-check: unknown option $1 (see --help)" >&2; exit 2 ;;
  esac
  shift
done

if [ -n "${PYTHON:-}" ]; then PY="$PYTHON"
elif [ -x .venv/bin/python ]; then PY=.venv/bin/python
else PY=python3
fi
# The GPU image runs a plain checkout: no `pip install`, no network. kvbatch/ is the package
# itself, so the checkout's root on PYTHONPATH is all an import needs.
export PY PYTHONPATH="$PWD${PYTHONPATH:+:$PYTHONPATH}"
export PYTHONUNBUFFERED=1 HF_HUB_OFFLINE=1 TRANSFORMERS_OFFLINE=1 TOKENIZERS_PARALLELISM=false

if [ "$CPU" = 1 ]; then
  # Same steps, tiny workloads; Triton kernels run under its interpreter (slow: longer limits).
  # Our dependencies that the H200 image lacks (pydantic, boto3, celery, gguf, ...) are hidden,
  # so an import the GPU path should not make fails here rather than on the device.
  MODE=cpu
  export PYTHONPATH="$PWD/scripts/h200_image:$PYTHONPATH"
  TINY=(--tiny)
  GREEDY=(env TRITON_INTERPRET=1 "$PY" scripts/greedy_check.py --device cpu --backend triton
          --models tiny)
  KERNELS_TIMEOUT=${KERNELS_TIMEOUT:-150}
  KERNELS_WORKERS=${KERNELS_WORKERS:-0}  # the interpreter on 2 cores: no gain
  # the interpreter's step takes minutes, and a busy shared host can double it
  TRITON_TEST_TIMEOUT=${TRITON_TEST_TIMEOUT:-480}
  BUDGET_S=${BUDGET_S:-900}  # the optional steps' test: the CPU's limits are longer
  PER_TEST_TIMEOUT=${PER_TEST_TIMEOUT:-120}  # the interpreter: slower than CUDA per test
  GREEDY_TIMEOUT=${GREEDY_TIMEOUT:-180}
  QUANT_GREEDY=(env TRITON_INTERPRET=1 "$PY" scripts/quant_greedy_check.py --device cpu
                --models tiny --max-tokens 6)
  QUANT_GREEDY_TIMEOUT=${QUANT_GREEDY_TIMEOUT:-240}
  MOE_GREEDY=(env TRITON_INTERPRET=1 "$PY" scripts/greedy_check.py --device cpu --backend triton
              --models tiny-moe)
  MOE_GREEDY_TIMEOUT=${MOE_GREEDY_TIMEOUT:-240}
  QUANT_GEMM=(--device cpu --shapes 256x128,200x72 --batches 1,5)
  SPLITS=(--device cpu --context 1100 --chunks 4 --splits 1,3 --kv-heads 1 --group 2 --head-dim 16
          --cascade-groups 2 --cascade-rows 3 --cascade-keys 600)
  # CUDA's timed chunks and startup freeze (off by default on the CPU); the tiny long prompt
  # (2,048 tokens) is made longer than the threshold, as the 32k one is on the GPU
  LONG_PREFILL_DEFAULTS=(--long-prefill-step-ratio 2.5 --long-prefill-token-threshold 1024
                         --freeze-gc)
  GEMMA_WINDOW_SIZE=(--size tiny)
  HYBRID_SIZE=(--size tiny --device cpu)
  MLA_SIZE=(--size tiny --device cpu)
else
  MODE=gpu
  TINY=()
  GREEDY=("$PY" scripts/greedy_check.py --device cuda --backend triton --models tiny,rag)
  QUANT_GREEDY=("$PY" scripts/quant_greedy_check.py --device cuda --models tiny,rag,tiny-moe)
  MOE_GREEDY=("$PY" scripts/greedy_check.py --device cuda --backend triton
              --models tiny-moe,tiny-gpt-oss)
  SPLITS=()
  QUANT_GEMM=()
  LONG_PREFILL_DEFAULTS=()
  GEMMA_WINDOW_SIZE=(--size gpu)
  # float32: the greedy tokens must equal transformers' (the latent decode kernel's check)
  MLA_SIZE=(--size gpu --device cuda --dtype float32 --num-prompts 32 --prompt-tokens 1024
            --system-tokens 768 --output-tokens 32)
  HYBRID_SIZE=(--size gpu --device cuda --num-prompts 32 --prompt-tokens 2048 --system-tokens 1536
               --output-tokens 64)
fi
# The required steps' GPU limits add up to 1035 s (first Triton compiles included); the
# optional steps (caps, quant rows, rag-moe, rag-qwen3, sweep) keep the run inside BUDGET_S.
VERSIONS_TIMEOUT=${VERSIONS_TIMEOUT:-20}
# with a cold Triton cache the compiles are most of this step (hence the workers below); once
# compiled the tests themselves take seconds
KERNELS_TIMEOUT=${KERNELS_TIMEOUT:-120}
KERNELS_WORKERS=${KERNELS_WORKERS:-8}  # the H200 machine has 16 cores
PREFILL_SPLITS_TIMEOUT=${PREFILL_SPLITS_TIMEOUT:-60}
QUANT_GEMM_TIMEOUT=${QUANT_GEMM_TIMEOUT:-120}
TRITON_TEST_TIMEOUT=${TRITON_TEST_TIMEOUT:-150}  # room for a cold Triton cache
# Each test of the two pytest steps (pytest-timeout, on the H200 image): a test stuck in Python
# fails with its stack and the rest still run and report, instead of the step's limit cutting
# off the whole summary. (A wait inside a CUDA call is only cut by the step's limit.)
PER_TEST_TIMEOUT=${PER_TEST_TIMEOUT:-75}
GREEDY_TIMEOUT=${GREEDY_TIMEOUT:-100}
QUANT_GREEDY_TIMEOUT=${QUANT_GREEDY_TIMEOUT:-120}
# each row (the first decode rows build the 2.8 B-parameter model); skipped past BUDGET_S
QUANT_ROW_TIMEOUT=${QUANT_ROW_TIMEOUT:-90}
MOE_GREEDY_TIMEOUT=${MOE_GREEDY_TIMEOUT:-60}
RAG_MOE_TIMEOUT=${RAG_MOE_TIMEOUT:-150}  # builds the 3.1 B-parameter model; skipped past BUDGET_S
RAG_QWEN3_TIMEOUT=${RAG_QWEN3_TIMEOUT:-150}  # builds the 2.8 B-parameter model; as rag-moe
RAG_GPT_OSS_TIMEOUT=${RAG_GPT_OSS_TIMEOUT:-180}  # builds 4.2 GB of weights; as rag-moe
EMBED_GPU_TIMEOUT=${EMBED_GPU_TIMEOUT:-120}  # builds two random embedding models; as rag-moe
RAG_HYBRID_TIMEOUT=${RAG_HYBRID_TIMEOUT:-180}  # builds the 2 B-parameter Qwen3.5 shape once
RAG_MLA_TIMEOUT=${RAG_MLA_TIMEOUT:-180}  # builds the 0.8 B-parameter DeepSeek-V3 shape once
# builds the 1 B-parameter model, then two engines each run the job; skipped past BUDGET_S
RAG_GEMMA_TIMEOUT=${RAG_GEMMA_TIMEOUT:-240}
RAG_TIMEOUT=${RAG_TIMEOUT:-200}
LONG_PREFILL_TIMEOUT=${LONG_PREFILL_TIMEOUT:-70}
LONG_PREFILL_CAP_TIMEOUT=${LONG_PREFILL_CAP_TIMEOUT:-60}  # each; skipped past BUDGET_S
RAG_SWEEP_TIMEOUT=${RAG_SWEEP_TIMEOUT:-90}  # skipped past BUDGET_S
RAG_HF_CB_TIMEOUT=${RAG_HF_CB_TIMEOUT:-120}  # skipped past BUDGET_S; two hf-cb runs on CUDA
INDEX_GPU_TIMEOUT=${INDEX_GPU_TIMEOUT:-150}  # skipped past BUDGET_S
SUMMARY_TIMEOUT=${SUMMARY_TIMEOUT:-15}
BUDGET_S=${BUDGET_S:-560}  # the optional steps run only while the run can end inside it

mkdir -p "$OUT_DIR"
OUT_DIR="$(cd "$OUT_DIR" && pwd)"
LOG="$OUT_DIR/gpu-check.log"
STEPS="$OUT_DIR/steps.tsv"
rm -f "$OUT_DIR"/rag*.json "$OUT_DIR"/long-prefill*.json "$OUT_DIR"/quant-*.json \
  "$OUT_DIR"/moe-*.json "$OUT_DIR"/qwen3-*.json "$OUT_DIR"/embed-gpu.json \
  "$OUT_DIR/gemma-window.json" \
  "$OUT_DIR/index-gpu.json" "$OUT_DIR/summary.txt"
STEP_LOG="$(mktemp)"
trap 'rm -rf "$STEP_LOG"' EXIT
printf 'step\tstatus\trc\tseconds\tlimit\tlast line\n' > "$STEPS"
echo "gpu-check ($MODE) $(date -u +%Y-%m-%dT%H:%M:%SZ) in $PWD with $PY" | tee "$LOG"

# wanted NAME: whether --only (if given) names the step; versions and summary always run
wanted() {
  [ -z "$ONLY" ] || [ "$1" = versions ] || [ "$1" = summary ] && return 0
  local pattern patterns
  IFS=',' read -r -a patterns <<< "$ONLY"  # (no pathname expansion of the patterns)
  for pattern in "${patterns[@]}"; do
    # shellcheck disable=SC2053  # a pattern on purpose
    [[ "$1" == $pattern ]] && return 0
  done
  return 1
}

# step NAME LIMIT CMD...: run CMD under `timeout`, log its output, record its status.
step() {
  local name="$1" limit="$2"; shift 2
  if ! wanted "$name"; then skip "$name" "not in --only"; return; fi
  echo "== $name (limit ${limit}s): $*" | tee -a "$LOG"
  local start=$SECONDS
  timeout --kill-after=10 "$limit" "$@" > "$STEP_LOG" 2>&1
  local rc=$? secs=$((SECONDS - start)) status=ok
  if [ $rc -eq 124 ] || [ $rc -eq 137 ]; then status=TIMEOUT
  elif [ $rc -ne 0 ]; then status=FAIL
  fi
  # pytest exits 5 when it collected no test: nothing failed, nothing was checked
  if [ $rc -eq 5 ] && grep -q "no tests ran" "$STEP_LOG"; then status=no-tests; fi
  cat "$STEP_LOG" >> "$LOG"
  tail -n 40 "$STEP_LOG"
  local last
  last="$(grep -v '^\s*$' "$STEP_LOG" | tail -n 1 | tr '\t' ' ' | cut -c1-160)"
  printf '%s\t%s\t%s\t%s\t%s\t%s\n' "$name" "$status" "$rc" "$secs" "$limit" "$last" >> "$STEPS"
  echo "== $name: $status (rc $rc, ${secs}s)" | tee -a "$LOG"
}

skip() {
  echo "== $1: skipped ($2)" | tee -a "$LOG"
  printf '%s\tskipped\t-\t0\t-\t%s\n' "$1" "$2" >> "$STEPS"
}

# fits NAME LIMIT: an optional step runs only if it (and the summary) can end inside BUDGET_S
fits() {
  [ $((SECONDS + $2 + SUMMARY_TIMEOUT)) -le "$BUDGET_S" ] && return 0
  skip "$1" "not enough of BUDGET_S=$BUDGET_S s left"
  return 1
}

versions() {
  "$PY" - <<'EOF'
import platform
import torch
import transformers
print("python", platform.python_version(), platform.platform())
print("torch", torch.__version__, "cuda", torch.version.cuda, "available", torch.cuda.is_available())
try:
    import triton
    print("triton", triton.__version__)
except ImportError as e:
    print("triton missing:", e)
print("transformers", transformers.__version__)
if torch.cuda.is_available():
    p = torch.cuda.get_device_properties(0)
    print("device", p.name, f"{p.total_memory / 2**30:.0f} GiB", p.multi_processor_count, "SMs")
EOF
  local rc=$?
  if command -v nvidia-smi > /dev/null; then nvidia-smi; else echo "nvidia-smi: not on this machine"; fi
  return $rc
}

export -f versions
step versions "$VERSIONS_TIMEOUT" bash -c versions
# --durations: the log names the slowest tests, should a step come near its limit
PYTEST=("$PY" -m pytest -q -p no:cacheprovider --durations=8)
if "$PY" -c "import pytest_timeout" 2> /dev/null; then PYTEST+=(--timeout="$PER_TEST_TIMEOUT"); fi
KERNELS_PARALLEL=()
if [ "$KERNELS_WORKERS" -gt 1 ] && "$PY" -c "import xdist" 2> /dev/null; then
  KERNELS_PARALLEL=(-n "$KERNELS_WORKERS")
fi
step kernels "$KERNELS_TIMEOUT" "${PYTEST[@]}" ${KERNELS_PARALLEL[@]+"${KERNELS_PARALLEL[@]}"} \
  tests/kernels
step prefill-splits "$PREFILL_SPLITS_TIMEOUT" "$PY" scripts/prefill_split_bench.py \
  ${SPLITS[@]+"${SPLITS[@]}"}
step quant-gemm "$QUANT_GEMM_TIMEOUT" "$PY" scripts/quant_gemm_bench.py \
  ${QUANT_GEMM[@]+"${QUANT_GEMM[@]}"}
step triton-test "$TRITON_TEST_TIMEOUT" "${PYTEST[@]}" \
  tests/engine/attention/test_triton_backend.py tests/engine/attention/test_fp8_kv_cache.py \
  tests/engine/exec/test_cuda_graphs.py tests/engine/quant/test_gemm_kernels.py
step greedy "$GREEDY_TIMEOUT" "${GREEDY[@]}"
step rag "$RAG_TIMEOUT" "$PY" -m kvbatch.cli bench rag ${TINY[@]+"${TINY[@]}"} \
  --peers "${RAG_PEERS:-hf-static,kvbatch-sync}" --repeat "${RAG_REPEAT:-2}" --kernel-profile \
  --json "$OUT_DIR/rag.json"
# LONG_PREFILL_ARGS: extra bench options, e.g. "--long-prefill-token-threshold 512"
read -r -a LONG_PREFILL_EXTRA <<< "${LONG_PREFILL_ARGS:-}"
step long-prefill "$LONG_PREFILL_TIMEOUT" "$PY" -m kvbatch.cli bench long-prefill ${TINY[@]+"${TINY[@]}"} \
  ${LONG_PREFILL_DEFAULTS[@]+"${LONG_PREFILL_DEFAULTS[@]}"} \
  ${LONG_PREFILL_EXTRA[@]+"${LONG_PREFILL_EXTRA[@]}"} --json "$OUT_DIR/long-prefill.json"
# rag-gemma: Gemma 3's window layers with window KV on and off under one KV budget, if BUDGET_S
# allows (GEMMA_WINDOW_ARGS: the bench's flags instead of the size's defaults)
read -r -a GEMMA_WINDOW_EXTRA <<< "${GEMMA_WINDOW_ARGS:-}"
if ! wanted rag-gemma; then
  skip rag-gemma "not in --only"
elif fits rag-gemma "$RAG_GEMMA_TIMEOUT"; then
  step rag-gemma "$RAG_GEMMA_TIMEOUT" "$PY" -m kvbatch.cli bench gemma-window \
    "${GEMMA_WINDOW_SIZE[@]}" ${GEMMA_WINDOW_EXTRA[@]+"${GEMMA_WINDOW_EXTRA[@]}"} \
    --json "$OUT_DIR/gemma-window.json"
fi
# Quantized paths: the kernels' greedy tokens against the reference path, then the benchmark
# rows, most wanted first, each kvbatch alone and skipped when it could not end inside BUDGET_S
# (QUANT_ROWS: the rows to run, space-separated names of QUANT_ROW_FLAGS; empty skips them)
step quant-greedy "$QUANT_GREEDY_TIMEOUT" "${QUANT_GREEDY[@]}"
# A mixture-of-experts model: greedy tokens against transformers (rag-moe follows the rows)
step moe-greedy "$MOE_GREEDY_TIMEOUT" "${MOE_GREEDY[@]}"
declare -A QUANT_ROW_FLAGS=(
  [no-share-bf16]="no-share-gpu"
  [no-share-fp8]="no-share-gpu --quantization fp8"
  [rag-fp8]="rag --quantization fp8"
  [no-share-fp8-kv]="no-share-gpu --quantization fp8 --kv-cache-dtype fp8"
  [decode-b1-bf16]="decode-small-batch --max-num-seqs 1"
  [decode-b1-w4a16]="decode-small-batch --max-num-seqs 1 --weights w4a16"
  [decode-b1-fp8]="decode-small-batch --max-num-seqs 1 --quantization fp8"
  [decode-b8-bf16]="decode-small-batch --max-num-seqs 8"
  [decode-b8-w4a16]="decode-small-batch --max-num-seqs 8 --weights w4a16"
  [decode-b8-fp8]="decode-small-batch --max-num-seqs 8 --quantization fp8"
  [no-share-w4a16]="no-share-gpu --weights w4a16"
  [rag-fp8-kv]="rag --quantization fp8 --kv-cache-dtype fp8"
  [rag-w4a16]="rag --weights w4a16"
  [moe-fp8]="rag-moe --quantization fp8"
  [moe-w4a16]="rag-moe --weights w4a16"
  [rag-fp8-block]="rag --weights fp8-block"
  [moe-fp8-block]="rag-moe --weights fp8-block"
)
read -r -a QUANT_ROW_LIST <<< "${QUANT_ROWS-no-share-bf16 no-share-fp8 rag-fp8 no-share-fp8-kv \
decode-b1-bf16 decode-b1-w4a16 decode-b1-fp8 decode-b8-bf16 decode-b8-w4a16 decode-b8-fp8 \
no-share-w4a16 rag-fp8-kv rag-w4a16 moe-fp8 moe-w4a16 rag-fp8-block moe-fp8-block}"
for row in ${QUANT_ROW_LIST[@]+"${QUANT_ROW_LIST[@]}"}; do
  if [ -z "${QUANT_ROW_FLAGS[$row]+set}" ]; then skip "quant-$row" "unknown row"; continue; fi
  wanted "quant-$row" || { skip "quant-$row" "not in --only"; continue; }
  fits "quant-$row" "$QUANT_ROW_TIMEOUT" || continue
  read -r -a row_flags <<< "${QUANT_ROW_FLAGS[$row]}"
  step "quant-$row" "$QUANT_ROW_TIMEOUT" "$PY" -m kvbatch.cli bench "${row_flags[@]}" \
    ${TINY[@]+"${TINY[@]}"} --json "$OUT_DIR/quant-$row.json"
done
# rag-moe against transformers' static generate, if BUDGET_S allows
if ! wanted rag-moe; then
  skip rag-moe "not in --only"
elif fits rag-moe "$RAG_MOE_TIMEOUT"; then
  step rag-moe "$RAG_MOE_TIMEOUT" "$PY" -m kvbatch.cli bench rag-moe ${TINY[@]+"${TINY[@]}"} \
    --peers hf-static --repeat 1 --json "$OUT_DIR/moe-rag.json"
fi
# rag-qwen3: the dense path on Qwen3-8B's layer shapes against transformers' static generate,
# if BUDGET_S allows
if ! wanted rag-qwen3; then
  skip rag-qwen3 "not in --only"
elif fits rag-qwen3 "$RAG_QWEN3_TIMEOUT"; then
  step rag-qwen3 "$RAG_QWEN3_TIMEOUT" "$PY" -m kvbatch.cli bench rag-qwen3 \
    ${TINY[@]+"${TINY[@]}"} --peers hf-static --repeat 1 --json "$OUT_DIR/qwen3-rag.json"
fi
# rag-gpt-oss: gpt-oss-20b's layer shapes with random MXFP4 experts against transformers'
# static generate (its own MXFP4 dequantization), if BUDGET_S allows
if ! wanted rag-gpt-oss; then
  skip rag-gpt-oss "not in --only"
elif fits rag-gpt-oss "$RAG_GPT_OSS_TIMEOUT"; then
  step rag-gpt-oss "$RAG_GPT_OSS_TIMEOUT" "$PY" -m kvbatch.cli bench rag-gpt-oss \
    ${TINY[@]+"${TINY[@]}"} --peers hf-static --repeat 1 --json "$OUT_DIR/gpt-oss-rag.json"
fi
# embed-gpu: LLM.embed on bge-base's and Qwen3-Embedding-0.6B's shapes (random weights, token
# ids) beside transformers batched as sentence-transformers does, with each model's floor
if ! wanted embed-gpu; then
  skip embed-gpu "not in --only"
elif fits embed-gpu "$EMBED_GPU_TIMEOUT"; then
  step embed-gpu "$EMBED_GPU_TIMEOUT" "$PY" -m kvbatch.cli bench embed-gpu ${TINY[@]+"${TINY[@]}"} \
    --repeat 3 --json "$OUT_DIR/embed-gpu.json"
fi
# rag-hybrid: a Qwen3.5-shaped hybrid (3 Gated DeltaNet : 1 full attention, state cache and
# snapshots) beside transformers' generate, and sequences per GiB against full attention
if ! wanted rag-hybrid; then
  skip rag-hybrid "not in --only"
elif fits rag-hybrid "$RAG_HYBRID_TIMEOUT"; then
  step rag-hybrid "$RAG_HYBRID_TIMEOUT" "$PY" -m kvbatch.cli bench hybrid-linear \
    "${HYBRID_SIZE[@]}" --json "$OUT_DIR/rag-hybrid.json"
fi
# rag-mla: a DeepSeek-V3-shaped model (multi-head latent attention: the latent cache, expanded
# prefill, absorbed decode in kernels/mla_attention.py; grouped routing) beside transformers'
# generate, and KV bytes per token against GQA
if ! wanted rag-mla; then
  skip rag-mla "not in --only"
elif fits rag-mla "$RAG_MLA_TIMEOUT"; then
  step rag-mla "$RAG_MLA_TIMEOUT" "$PY" -m kvbatch.cli bench mla \
    "${MLA_SIZE[@]}" --json "$OUT_DIR/rag-mla.json"
fi
# The same with every mixed step eager (no CUDA graphs for steps with a chunk): what the
# mixed-step graphs gain; LONG_PREFILL_EAGER=0 skips it
if [ "${LONG_PREFILL_EAGER:-1}" = 1 ] && fits long-prefill-eager "$LONG_PREFILL_CAP_TIMEOUT"; then
  step long-prefill-eager "$LONG_PREFILL_CAP_TIMEOUT" "$PY" -m kvbatch.cli bench long-prefill \
    ${TINY[@]+"${TINY[@]}"} ${LONG_PREFILL_DEFAULTS[@]+"${LONG_PREFILL_DEFAULTS[@]}"} \
    ${LONG_PREFILL_EXTRA[@]+"${LONG_PREFILL_EXTRA[@]}"} --cuda-graph-max-chunk 0 \
    --json "$OUT_DIR/long-prefill-eager.json"
fi
# The same with the startup heap left in the collector's passes: what the freeze gains;
# LONG_PREFILL_GC=0 skips it
if [ "${LONG_PREFILL_GC:-1}" = 1 ] && fits long-prefill-gc "$LONG_PREFILL_CAP_TIMEOUT"; then
  step long-prefill-gc "$LONG_PREFILL_CAP_TIMEOUT" "$PY" -m kvbatch.cli bench long-prefill \
    ${TINY[@]+"${TINY[@]}"} ${LONG_PREFILL_DEFAULTS[@]+"${LONG_PREFILL_DEFAULTS[@]}"} \
    ${LONG_PREFILL_EXTRA[@]+"${LONG_PREFILL_EXTRA[@]}"} --no-freeze-gc \
    --json "$OUT_DIR/long-prefill-gc.json"
fi
# LONG_PREFILL_CAPS: token caps alone (no timed chunks) to compare, one step each, while
# BUDGET_S allows
read -r -a LONG_PREFILL_CAP_LIST <<< "${LONG_PREFILL_CAPS-}"
for cap in ${LONG_PREFILL_CAP_LIST[@]+"${LONG_PREFILL_CAP_LIST[@]}"}; do
  fits "long-prefill-$cap" "$LONG_PREFILL_CAP_TIMEOUT" || continue
  step "long-prefill-$cap" "$LONG_PREFILL_CAP_TIMEOUT" "$PY" -m kvbatch.cli bench long-prefill \
    ${TINY[@]+"${TINY[@]}"} --long-prefill-token-threshold "$cap" --long-prefill-step-ratio 0 \
    --json "$OUT_DIR/long-prefill-$cap.json"
done
# transformers' continuous batching (generate_batch) as rag's peer, in a step of its own so
# that a failure or a slow run of it cannot cost the rag step's figures; RAG_HF_CB=0 skips it
if [ "${RAG_HF_CB:-1}" = 1 ] && fits rag-hf-cb "$RAG_HF_CB_TIMEOUT"; then
  step rag-hf-cb "$RAG_HF_CB_TIMEOUT" "$PY" -m kvbatch.cli bench rag ${TINY[@]+"${TINY[@]}"} \
    --peers hf-cb --repeat 1 --json "$OUT_DIR/rag-hf-cb.json"
fi
# RAG_SWEEP_ARGS: the sweep's grid (empty: no sweep), if BUDGET_S allows
read -r -a RAG_SWEEP_GRID <<< "${RAG_SWEEP_ARGS---sweep-max-num-seqs 512 \
--sweep-max-num-batched-tokens 8192,16384 --sweep-kv-cache-memory-fraction 0.9}"
if [ ${#RAG_SWEEP_GRID[@]} -eq 0 ]; then
  skip rag-sweep "RAG_SWEEP_ARGS is empty"
elif fits rag-sweep "$RAG_SWEEP_TIMEOUT"; then
  step rag-sweep "$RAG_SWEEP_TIMEOUT" "$PY" -m kvbatch.cli bench rag ${TINY[@]+"${TINY[@]}"} \
    --sweep "${RAG_SWEEP_GRID[@]}" --json "$OUT_DIR/rag-sweep.json"
fi
# The indexing job on the device beside the user's pipeline, where its packages are there
INDEX_GPU_ABSENT="$("$PY" -c 'import importlib.util, sys
print(" ".join(m for m in sys.argv[1:] if importlib.util.find_spec(m) is None))' \
  lancedb sentence_transformers semchunk gguf)"
if ! wanted index-gpu; then
  skip index-gpu "not in --only"
elif [ -n "$INDEX_GPU_ABSENT" ]; then
  skip index-gpu "needs $INDEX_GPU_ABSENT, absent here (the H200 image has torch, triton, transformers)"
elif fits index-gpu "$INDEX_GPU_TIMEOUT"; then
  if [ "$CPU" = 1 ]; then INDEX_GPU=(--tiny --device cpu); else
    INDEX_GPU=(--docs "${INDEX_GPU_DOCS:-40}" --device cuda); fi
  step index-gpu "$INDEX_GPU_TIMEOUT" "$PY" -m kvbatch.cli bench index-cpu "${INDEX_GPU[@]}" \
    --json "$OUT_DIR/index-gpu.json"
fi
step summary "$SUMMARY_TIMEOUT" "$PY" scripts/gpu_check_summary.py "$OUT_DIR" \
  --write "$OUT_DIR/summary.txt"

echo "results in $OUT_DIR" | tee -a "$LOG"
# failed (or timed-out) steps make the script fail; skipped ones and empty suites do not
! cut -f2 "$STEPS" | grep -qE '^(FAIL|TIMEOUT)$'

# Sourced by the GPU launchers in this folder: a Megatron-LM launch script's flags for a ~1.2B
# GPT (Llama-like: RMSNorm, SwiGLU, RoPE, GQA, untied embeddings) in bf16, plus the lines that
# make it train with EoD reset under context parallelism (EOD_ARGS, last). Every value can be
# overridden from the environment.
#   ALGO            ring | ulysses | hybrid                  (first argument of the launcher)
#   CP_SIZE         context-parallel size                    (launcher default)
#   ULYSSES_DEGREE  Ulysses degree inside CP for hybrid      (launcher default)
#   TP_SIZE PP_SIZE tensor / pipeline parallel sizes         (1, 1)
#   SEQ_LENGTH      tokens per row                           (32768)
#   MBS GBS         micro / global batch size                (1, 64)
#   TRAIN_ITERS     iterations                               (1000)
#   DATA_PATH       indexed dataset prefix (tools/preprocess_data.py); unset: --mock-data
#   TOKENIZER       a HuggingFace tokenizer folder (or hub name); unset: the data's own
#                   (byte-level data made by tools/preprocess_data.py needs no flags)
#   CKPT_DIR        checkpoints (--save and --load)          (runs/gpt_<algo>/ckpt)
#                   several nodes: a folder every node shares (refused at start-up otherwise)
#   DATA_CACHE      --data-cache-path, the sample-index cache (unset: beside each dataset);
#                   several nodes: a folder every node shares
#   USE_FLASH_ATTN  1: --use-flash-attn (flash-attn's kernels; an error if not installed),
#                   0: PyTorch's varlen kernel, auto: 1 when flash_attn imports  (auto)
#   NUM_EXPERTS     mixture of experts in every layer (megatron-core's MoE layer; unset:
#                   dense): top-MOE_TOPK (2) routing, the load-balancing loss, experts of
#                   MOE_FFN (1408) hidden units over EP_SIZE (1) expert-parallel ranks,
#                   the all-to-all dispatcher, grouped GEMMs where TransformerEngine is
#   DRY_RUN=1       print the command instead of running it
# Extra arguments after ALGO are appended to the flags (Megatron-LM's spellings).

: "${ALGO:?first argument: ring, ulysses or hybrid}"
SEQ_LENGTH="${SEQ_LENGTH:-32768}"
RUN_DIR="${RUN_DIR:-$ROOT/runs/gpt_${ALGO}}"
CKPT_DIR="${CKPT_DIR:-$RUN_DIR/ckpt}"
PY="${PYTHON:-python3}"

# --- a Megatron-LM GPT launch script, as its examples/ write one ---
GPT_MODEL_ARGS=(
  --num-layers 24 --hidden-size 2048 --ffn-hidden-size 5632
  --num-attention-heads 16 --group-query-attention --num-query-groups 8
  --normalization RMSNorm --swiglu --disable-bias-linear --untie-embeddings-and-output-weights
  --position-embedding-type rope --rotary-base 500000
  --seq-length "$SEQ_LENGTH" --max-position-embeddings "$SEQ_LENGTH"
  --attention-dropout 0 --hidden-dropout 0
)
TRAINING_ARGS=(
  --micro-batch-size "${MBS:-1}" --global-batch-size "${GBS:-64}"
  --train-iters "${TRAIN_ITERS:-1000}" --lr 3e-4 --min-lr 3e-5 --lr-warmup-iters 100
  --lr-decay-style cosine --weight-decay 0.1 --clip-grad 1.0 --adam-beta2 0.95 --bf16
  --use-distributed-optimizer --overlap-grad-reduce --overlap-param-gather
)
MODEL_PARALLEL_ARGS=(
  --tensor-model-parallel-size "${TP_SIZE:-1}" --pipeline-model-parallel-size "${PP_SIZE:-1}"
)
if [ "${TP_SIZE:-1}" -gt 1 ]; then
  MODEL_PARALLEL_ARGS+=(--sequence-parallel)
fi
DATA_ARGS=(--num-workers 2)
if [ -n "${DATA_PATH:-}" ]; then
  DATA_ARGS+=(--data-path $DATA_PATH --split 99,1,0)  # unquoted: "W1 P1 W2 P2" blends
else
  DATA_ARGS+=(--mock-data --tokenizer-type NullTokenizer --vocab-size 32000)
fi
if [ -n "${DATA_CACHE:-}" ]; then
  DATA_ARGS+=(--data-cache-path "$DATA_CACHE")
fi
if [ -n "${TOKENIZER:-}" ]; then
  DATA_ARGS+=(--tokenizer-type HuggingFaceTokenizer --tokenizer-model "$TOKENIZER")
fi
EVAL_AND_LOGGING_ARGS=(
  --log-interval 10 --log-throughput --eval-interval 200 --eval-iters 10
  --save "$CKPT_DIR" --load "$CKPT_DIR" --save-interval 500
  --dist-ckpt-optim-fully-reshardable  # a checkpoint that also loads at another TP/PP
  --tensorboard-dir "$RUN_DIR/tensorboard"
)
if [ -n "${NUM_EXPERTS:-}" ]; then
  MODEL_PARALLEL_ARGS+=(--expert-model-parallel-size "${EP_SIZE:-1}")
  GPT_MODEL_ARGS+=(--num-experts "$NUM_EXPERTS" --moe-router-topk "${MOE_TOPK:-2}"
                   --moe-ffn-hidden-size "${MOE_FFN:-1408}" --moe-aux-loss-coeff 1e-2
                   --moe-router-load-balancing-type aux_loss
                   --moe-token-dispatcher-type alltoall)
fi
# Without TransformerEngine or Apex (a GPU machine with neither): Megatron-LM's local layers,
# and no gradient-accumulation fusion (it needs Apex's CUDA extension).
if ! "$PY" -c "import transformer_engine" 2>/dev/null; then
  TRAINING_ARGS+=(--transformer-impl local)
elif [ -n "${NUM_EXPERTS:-}" ]; then
  GPT_MODEL_ARGS+=(--moe-grouped-gemm)
fi
if ! "$PY" -c "import fused_weight_gradient_mlp_cuda" 2>/dev/null; then
  TRAINING_ARGS+=(--no-gradient-accumulation-fusion)
fi

# --- EoD reset under context parallelism: the lines megatron-eod adds ---
EOD_ARGS=(
  --reset-attention-mask --reset-position-ids --eod-mask-loss
  --context-parallel-size "$CP_SIZE"
  --metrics-file "$RUN_DIR/metrics.jsonl"
)
case "$ALGO" in
  ring) EOD_ARGS+=(--cp-comm-type p2p) ;;
  ulysses) EOD_ARGS+=(--cp-comm-type a2a) ;;
  hybrid) EOD_ARGS+=(--cp-comm-type a2a+p2p --hierarchical-context-parallel-sizes
                     "$ULYSSES_DEGREE" "$((CP_SIZE / ULYSSES_DEGREE))") ;;
  *) echo "ALGO must be ring, ulysses or hybrid, not '$ALGO'" >&2; exit 2 ;;
esac
USE_FLASH_ATTN="${USE_FLASH_ATTN:-auto}"
if [ "$USE_FLASH_ATTN" = auto ]; then
  "$PY" -c "import flash_attn" 2>/dev/null && USE_FLASH_ATTN=1 || USE_FLASH_ATTN=0
fi
if [ "$USE_FLASH_ATTN" = 1 ]; then
  EOD_ARGS+=(--use-flash-attn)
fi

GPT_FLAGS=("${GPT_MODEL_ARGS[@]}" "${TRAINING_ARGS[@]}" "${MODEL_PARALLEL_ARGS[@]}"
           "${DATA_ARGS[@]}" "${EVAL_AND_LOGGING_ARGS[@]}" "${EOD_ARGS[@]}")

# Megatron requires one CUDA work queue per device for TP/CP communication overlap (before
# Blackwell); keep a value the caller set.
export CUDA_DEVICE_MAX_CONNECTIONS="${CUDA_DEVICE_MAX_CONNECTIONS:-1}"

# launch CMD...: run it, or print it with DRY_RUN=1 (one argument per line after the program).
launch() {
  if [ "${DRY_RUN:-0}" = 1 ]; then
    echo "CUDA_DEVICE_MAX_CONNECTIONS=$CUDA_DEVICE_MAX_CONNECTIONS"
    printf '%s\n' "$@"
  else
    mkdir -p "$RUN_DIR"
    "$@"
  fi
}

"""The golden tiny GPT: the flags of the CPU golden run (golden_cpu_losses.json) and of the GPU
runs compared with it (test_gpu_training.py).

2 layers, hidden 64, 4 heads over 2 query groups (GQA), RoPE, sequence 128, micro-batch 2,
global batch 4, 10 iterations, float32 unless a run adds --bf16, dropout off, EoD reset on,
weights initialised on the CPU (--use-cpu-initialization: the GPU run trains the same model),
byte-level data through Megatron-LM's NullTokenizer, Megatron-LM's fused kernels off (they
need TransformerEngine or Apex, absent from the CPU and the lent GPU machine).
"""

from tests.training.megatron_lm_checkout import null_tokenizer_vocab_size

ITERS = 10


def golden_flags(data_path, *extra):
    return ["--num-layers", "2", "--hidden-size", "64", "--num-attention-heads", "4",
            "--group-query-attention", "--num-query-groups", "2",
            "--position-embedding-type", "rope", "--seq-length", "128",
            "--max-position-embeddings", "128", "--micro-batch-size", "2",
            "--global-batch-size", "4", "--train-iters", str(ITERS), "--lr", "2e-3",
            "--min-lr", "2e-4", "--lr-warmup-iters", "2", "--lr-decay-style", "cosine",
            "--hidden-dropout", "0", "--attention-dropout", "0", "--data-path", data_path,
            "--split", "90,8,2", "--reset-attention-mask", "--reset-position-ids",
            "--eod-mask-loss", "--eval-interval", "1000", "--eval-iters", "1",
            "--log-interval", "100", "--seed", "1234", "--use-cpu-initialization",
            "--tokenizer-type", "NullTokenizer",
            "--vocab-size", str(null_tokenizer_vocab_size(256)),
            "--transformer-impl", "local", "--no-gradient-accumulation-fusion",
            "--no-bias-dropout-fusion", "--no-bias-gelu-fusion", "--no-masked-softmax-fusion",
            "--no-persist-layer-norm", *extra]

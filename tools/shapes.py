"""The benchmark shapes: each a model preset and the data shape it is measured with
(`python -m tools.bench --shape NAME`; the README's tables list them in this order)."""

SHAPES = {
    "llama-1b": ["--model", "llama-1b", "--seq-len", "4096", "--micro-batch", "4"],
    "llama-3b": ["--model", "llama3.2-3b", "--seq-len", "8192", "--micro-batch", "1"],
    "llama-8b": ["--model", "llama3-8b", "--seq-len", "8192", "--micro-batch", "1"],
    # Four layers of Llama-3-70B (d=8192, FFN 28672, 64/8 heads): its matmul shapes on two GPUs.
    "llama-70b-4l": ["--model", "llama3-70b", "--model-overrides", "num_layers=4", "--seq-len", "8192",
                     "--micro-batch", "1"],
    "mixtral-small": ["--model", "mixtral-small", "--seq-len", "4096", "--micro-batch", "2"],
    # 15.7B parameters: fp32 master weights and AdamW (16 bytes/param) are ~126 GB per GPU over two,
    # which leaves little of an H200 for activations; `--model-overrides num_layers=14` keeps the
    # shape of each layer at half the depth.
    "deepseek-v2-lite": ["--model", "deepseek-v2-lite", "--seq-len", "4096", "--micro-batch", "1"],
    # Today's families at their published widths; the suite sets how many layers fit one GPU.
    "qwen3-8b": ["--model", "qwen3-8b", "--seq-len", "8192", "--micro-batch", "2"],
    "gpt-oss-20b": ["--model", "gpt-oss-20b", "--seq-len", "4096", "--micro-batch", "4"],
    "llama4-scout": ["--model", "llama4-scout-17b-16e", "--seq-len", "8192", "--micro-batch", "1"],
    "tiny": ["--model", "tiny", "--seq-len", "256", "--micro-batch", "4"],
    "tiny-qwen3": ["--model", "tiny-qwen3", "--seq-len", "256", "--micro-batch", "4"],
    "tiny-gpt-oss": ["--model", "tiny-gpt-oss", "--seq-len", "256", "--micro-batch", "4"],
    "tiny-llama4": ["--model", "tiny-llama4", "--seq-len", "256", "--micro-batch", "4"],
    "tiny-moe": ["--model", "tiny-moe", "--seq-len", "256", "--micro-batch", "4"],
    "tiny-defaults": ["--model", "tiny", "--seq-len", "256"],
    # The micro-batch the run's defaults choose (dtrain/layout/defaults.py), as a user gets it.
    "llama-1b-defaults": ["--model", "llama-1b", "--seq-len", "4096"],
    "llama-3b-defaults": ["--model", "llama3.2-3b", "--seq-len", "8192"],
    # Runs give --model-overrides num_layers=N themselves (one GPU holds a few layers), so that rows record it.
    "llama-8b-4k-defaults": ["--model", "llama3-8b", "--seq-len", "4096"],
}

# The shapes small enough to run on a CPU (a smoke test of the tool, not a measurement).
CPU_SHAPES = ("tiny", "tiny-qwen3", "tiny-gpt-oss", "tiny-llama4", "tiny-defaults", "tiny-moe")

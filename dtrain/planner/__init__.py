"""The planner: what a layout costs on GPUs, and the best layouts of a model for a number of them.

    workload.py    what one rank holds and computes in a step, read from the sharding plan
    activations.py the bytes a block's forward keeps for its backward
    memory.py      the peak of one rank's GPU memory in a step, by category
    steptime.py    seconds per step, tokens/s per GPU and MFU (fsdp_time.py: FSDP's and AdamW's share)
    kernels.py     seconds of a block's matmuls, FP8 casts and attention, and of the head
    hardware.py    the GPU the models predict for: memory, kernel rates, links
    search.py      every layout of a model on a number of GPUs, the ones that fit, the fastest first
    advice.py      `--mesh auto`, and what an out-of-memory error reports
    measured.py    the models against the measured benchmark rows (`--validate`)
    __main__.py    `python -m dtrain.planner`
"""

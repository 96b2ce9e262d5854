"""Other formats' checkpoints <-> dtrain's.

    hf.py       Hugging Face safetensors checkpoints: read one parameter at a time, write in the
                hub's layout, convert configs; finds the families below
    family.py   what a family is (`HFFamily`), and the names and config fields all families share
    llama.py    LlamaForCausalLM
    mixtral.py  MixtralForCausalLM (experts per expert or fused; the load-balancing coefficient)

A new family is one more module here that defines `FAMILY`.
"""

"""dtrain: train dense and MoE language models on one GPU or thousands, from one functional model
core and a declarative sharding plan."""

__version__ = "0.1.0"

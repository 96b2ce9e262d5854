"""Training data: where tokens come from and how a step's batch is cut from them.

    dataset.py   TokenDataset: the batch of step s is a pure function of (seed, s); bundled corpus,
                 text files, synthetic tokens, indexed data
    text.py      a text file's tokens, tokenized once (streamed) into a cached indexed dataset
    indexed.py   Megatron's indexed format (PREFIX.bin + PREFIX.idx), read and written
    blend.py     weighted blends of indexed datasets and their train/validation/test split
    packed.py    samples packed across documents, with cached shuffle indices
"""

from dtrain.data.dataset import (
    BUNDLED, BUNDLED_CORPUS, BUNDLED_TOKENIZER, END_OF_TEXT, SYNTHETIC, MicroBatch, TokenDataset,
    validate_data_args,
)

__all__ = ["BUNDLED", "BUNDLED_CORPUS", "BUNDLED_TOKENIZER", "END_OF_TEXT", "SYNTHETIC", "MicroBatch",
           "TokenDataset", "validate_data_args"]

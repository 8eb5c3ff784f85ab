"""Moved to ``trainforge.loading.gguf_header`` (file reading, below train and infer)."""
# shim: remove after merge
from trainforge.loading.gguf_header import *  # noqa: F401,F403
from trainforge.loading.gguf_header import (MAX_DIMS, MAX_KEYS, MAX_METADATA_BYTES, MAX_METADATA_ITEMS,  # noqa: F401
                                            MAX_TENSORS, FileTensor, GGUFFile, StringArray, gguf_package,
                                            read_header, typed)

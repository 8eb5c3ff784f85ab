"""Moved to ``trainforge.loading.gguf`` (file reading, below train and infer)."""
# shim: remove after merge
from trainforge.loading.gguf import *  # noqa: F401,F403
from trainforge.loading.gguf import (GGUF_KEYS, gguf_tokenizer, model_config_from_gguf, open_gguf,  # noqa: F401
                                     read_gguf)

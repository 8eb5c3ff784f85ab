"""trainforge: PyTorch-native large-model training and inference.

Read first: ``config.py`` (every knob), ``model/llama.py`` (the model),
``data/prepare.py`` (tokens on disk), ``train/trainer.py`` (the loop),
``train/checkpoint.py`` (exact resume).
"""

__version__ = "0.1.0"

"""Reading a model's weights from disk: trainforge checkpoints, Hugging Face directories
(Llama, DeepSeek-V3, Glm4Moe, Mixtral; float or compressed-tensors) and llama.cpp GGUF files.

``loader.load_model`` is the entry point. Below both training (``model.init_from``) and
inference in the layers contract (pyproject.toml): a quantised checkpoint's layers are built by
a ``swap_quantized`` the caller passes (the engine's: ``infer/loading.py``), never imported here.
"""

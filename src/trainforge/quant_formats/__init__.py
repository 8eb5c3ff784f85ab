"""Quantisation formats: what a quantised weight *is*, shared by training and serving.

The int8 and int4 grids (``int8.py``, ``int4.py``), the int4 group-size policy
(``int4_groups.py``), which layers are quantised (``layers.py``) and the compressed-tensors
layout of exported directories (``compressed_tensors.py``). Pure tensor functions with no
kernels: QAT (``train/qat.py``) fake-quantises on these grids and the engine's quantised
modules (``infer/quantize/``) store and dequantise with them, so a weight trained against a
grid is served on exactly that grid. Sits below both ``train`` and ``infer`` in the layers
contract (pyproject.toml); imports only ``model`` (to name the layers) and ``errors``.
"""

"""Moved to ``trainforge.quant_formats.compressed_tensors`` (a format, below train and infer)."""
# shim: remove after merge
from trainforge.quant_formats.compressed_tensors import *  # noqa: F401,F403
from trainforge.quant_formats.compressed_tensors import (FORMATS, QUANT_METHOD, ct_prefixes, ct_shapes,  # noqa: F401
                                                         from_ct, group_sizes_by_target, pack_int4_codes,
                                                         quantization_config, read_quantization_config, to_ct,
                                                         unpack_int4_codes)

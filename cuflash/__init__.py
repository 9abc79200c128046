"""cuflash: FlashAttention for Python on CuPy, compiled at run time with NVRTC."""

__version__ = "0.1.0"

from cuflash.api import attention, attention_backward, explain
from cuflash.kvcache import attention_with_kvcache, combine, merge_states
from cuflash.mla import mla_decode
from cuflash.quantize import quantize_fp8
from cuflash.varlen import attention_varlen, attention_varlen_backward

__all__ = ["attention", "attention_backward", "attention_varlen", "attention_varlen_backward", "attention_with_kvcache",
           "combine", "explain", "merge_states", "mla_decode", "quantize_fp8", "__version__"]

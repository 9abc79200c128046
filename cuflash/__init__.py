"""cuflash: FlashAttention for Python on CuPy, compiled at run time with NVRTC."""

__version__ = "0.1.0"

from cuflash.api import attention

__all__ = ["attention", "__version__"]

"""Stand-in for flash-attn 2.8.3, written for mmpg's CPU tests (see ../README.md). Never installed."""

__version__ = "2.8.3"

from flash_attn.flash_attn_interface import flash_attn_func, flash_attn_varlen_func, flash_attn_with_kvcache

__all__ = ["flash_attn_func", "flash_attn_varlen_func", "flash_attn_with_kvcache"]

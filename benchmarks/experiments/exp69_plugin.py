"""pytest plugin (session 24): runs the GPU suite with make_exp69.py's backward variant
``$EXP69_VARIANT`` (chain, lse, mask, pre) in place of the tree's warp-specialised backward. Use
``EXP69_VARIANT=chain PYTHONPATH=benchmarks/experiments python -m pytest -p exp69_plugin ...``."""
import importlib
import os

from glm5_dsa_plugin.ops import tilelang_kernels as tk

_variant = importlib.import_module(f"glm5_dsa_plugin.ops._exp69_{os.environ['EXP69_VARIANT']}")
tk.sparse_mla_bwd_ws_kernel = _variant.sparse_mla_bwd_ws_kernel

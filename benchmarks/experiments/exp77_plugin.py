"""pytest plugin (session 27): runs the GPU suite with exp77_kernel's warp-specialised backward (dKV
per pair of blocks, atomics from registers) in place of the tree's. Use
``PYTHONPATH=benchmarks/experiments python -m pytest -p exp77_plugin ...``."""
import exp77_kernel

from glm5_dsa_plugin.ops import tilelang_kernels as tk

tk.sparse_mla_bwd_ws_kernel = exp77_kernel.sparse_mla_bwd_ws_kernel

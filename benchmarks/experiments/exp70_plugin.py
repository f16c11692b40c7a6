"""pytest plugin (session 24): runs the GPU suite with make_exp70.py's warp-specialised forward in
place of the tree's. Use ``PYTHONPATH=benchmarks/experiments python -m pytest -p exp70_plugin ...``."""
from glm5_dsa_plugin.ops import _exp70
from glm5_dsa_plugin.ops import tilelang_kernels as tk

tk.sparse_mla_fwd_ws_kernel = _exp70.sparse_mla_fwd_ws_kernel

"""pytest plugin (session 23): runs the GPU suite with make_exp65.py's warp-specialised forward and
backward (compiled without TileLang's fence pass) in place of the tree's. Use
``PYTHONPATH=benchmarks/experiments python -m pytest -p exp65_plugin ...`` after make_exp65.py."""
from glm5_dsa_plugin.ops import _exp65
from glm5_dsa_plugin.ops import tilelang_kernels as tk

tk.sparse_mla_fwd_ws_kernel = _exp65.sparse_mla_fwd_ws_kernel
tk.sparse_mla_bwd_ws_kernel = _exp65.sparse_mla_bwd_ws_kernel

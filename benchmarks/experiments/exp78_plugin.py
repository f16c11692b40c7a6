"""pytest plugin (session 27): runs the GPU suite with make_exp78.py's backward in place of the tree's;
``EXP78_REGS`` ("232,40" by default) sets its MMA / gather warpgroups' registers. Use
``PYTHONPATH=benchmarks/experiments python -m pytest -p exp78_plugin ...`` after make_exp78.py."""
import functools
import os

from glm5_dsa_plugin.ops import _exp78 as exp78_kernel  # written by make_exp78.py

from glm5_dsa_plugin.ops import tilelang_kernels as tk

_mma, _producer = (int(x) for x in os.environ.get("EXP78_REGS", "232,40").split(","))
tk.sparse_mla_bwd_ws_kernel = functools.partial(exp78_kernel.sparse_mla_bwd_ws_kernel, mma_regs=_mma,
                                                producer_regs=_producer)

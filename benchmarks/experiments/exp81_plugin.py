"""pytest plugin (session 27): runs GPU tests with make_exp81.py's backward in place of the tree's;
``EXP81_REGS`` ("240,24" by default) sets its MMA / gather-drain warpgroups' registers. Use
``PYTHONPATH=benchmarks/experiments python -m pytest -p exp81_plugin ...`` after make_exp81.py."""
import functools
import os

from glm5_dsa_plugin.ops import _exp81 as exp81_kernel  # written by make_exp81.py

from glm5_dsa_plugin.ops import tilelang_kernels as tk

_mma, _producer = (int(x) for x in os.environ.get("EXP81_REGS", "240,24").split(","))
tk.sparse_mla_bwd_ws_kernel = functools.partial(exp81_kernel.sparse_mla_bwd_ws_kernel, mma_regs=_mma,
                                                producer_regs=_producer)

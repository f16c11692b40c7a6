"""pytest plugin (session 23): runs the GPU suite with a persistent forward (exp59's, or the one
named by ``PERSISTENT_MODULE``, e.g. ``_exp60``) in place of the tree's warp-specialised forward at
one row per block (row groups keep the tree's kernel). Use ``PYTHONPATH=benchmarks/experiments
python -m pytest -p exp59_plugin ...`` after make_exp59.py / make_exp60.py."""
import functools
import importlib
import os

import torch

from glm5_dsa_plugin.ops import tilelang_kernels as tk

TREE = tk.sparse_mla_fwd_ws_kernel


@functools.cache
def persistent_or_tree(heads, d_v, d_tail, topk, kv_group, sm_scale, rows_per_block=1, target="cuda"):
    if rows_per_block != 1 or target != "cuda":
        return TREE(heads, d_v, d_tail, topk, kv_group, sm_scale, rows_per_block=rows_per_block, target=target)
    sms = torch.cuda.get_device_properties(0).multi_processor_count
    make = importlib.import_module("glm5_dsa_plugin.ops." + os.environ.get("PERSISTENT_MODULE", "_exp59"))
    k = make.sparse_mla_fwd_ws_kernel(heads, d_v, d_tail, topk, kv_group, sm_scale, persistent=sms)
    counter = torch.zeros(1, dtype=torch.int32, device="cuda")
    return lambda *args: k(*args, counter)


tk.sparse_mla_fwd_ws_kernel = persistent_or_tree

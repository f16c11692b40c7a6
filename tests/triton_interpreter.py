"""Run a test script with Triton's interpreter (``TRITON_INTERPRET=1``) in a fresh process: the
flag is read when Triton is imported, so the CPU tests of our Triton kernels run out of process.

Triton's interpreter reduces with numpy for sum / min / max / argmin / argmax, and otherwise calls
the combine function once per element in Python. ``tl.sort`` (a bitonic network) reduces with
``xor_sum`` at every stage, so a kernel sorting 2048 lanes spends minutes there. Before the script,
:data:`XOR_SUM_FAST_PATH` gives the interpreter numpy's ``bitwise_xor.reduce`` for that one combine
function (the same value: xor is associative and commutative); the kernels' own code runs as is.

The interpreter holds a kernel's scalar arguments as one-element arrays and converts them with
``int(array)``, which numpy >= 2.4 refuses for arrays of one dimension: a loop over a runtime bound
(``range(0, n, BLOCK)``) fails there. :data:`SCALAR_INDEX` converts through ``.item()`` instead (the
same integer)."""

import os
import subprocess
import sys

XOR_SUM_FAST_PATH = r"""
import numpy as _np
import triton.language as _tl
from triton.runtime import interpreter as _interpreter

_generic_apply = _interpreter.ReduceOps.apply_impl


def _apply_impl(self, input):
    if self.combine_fn == _tl.standard._xor_combine:
        x = input[0]
        return self.to_tensor(_np.bitwise_xor.reduce(x.handle.data, axis=self.axis, keepdims=self.keep_dims), x.dtype)
    return _generic_apply(self, input)


_interpreter.ReduceOps.apply_impl = _apply_impl
"""

SCALAR_INDEX = r"""
from triton.runtime import interpreter as _interpreter

_generic_patch_tensor = _interpreter._patch_lang_tensor


def _patch_lang_tensor(tensor, scope):
    _generic_patch_tensor(tensor, scope)
    scope.set_attr(tensor, "__index__", lambda self: int(self.handle.data.reshape(-1)[0]))


_interpreter._patch_lang_tensor = _patch_lang_tensor
"""


def run_interpreted(script: str, timeout: int = 600) -> None:
    """Run ``script`` (it prints "OK" when its checks pass) and fail with its output otherwise."""
    env = dict(os.environ, TRITON_INTERPRET="1")
    r = subprocess.run([sys.executable, "-W", "ignore", "-c", XOR_SUM_FAST_PATH + SCALAR_INDEX + script], env=env,
                       capture_output=True, text=True, timeout=timeout)
    assert r.returncode == 0 and "OK" in r.stdout, r.stdout[-2000:] + r.stderr[-4000:]

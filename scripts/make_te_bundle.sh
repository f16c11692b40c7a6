#!/usr/bin/env bash
# Packs TransformerEngine 2.20.2 (PyTorch, CUDA 13) for an offline Hopper box whose Python 3.12
# already has torch 2.11+cu130 (with its nvidia-* libraries) and no TE, small enough to carry:
#   .gpu/te.tar.xz (about 28 MB), one folder for PYTHONPATH holding
#   - transformer_engine/ (Python; the JAX part dropped) and its core library with device code
#     for sm_90 only (scripts/prune_fatbin.py; the wheel's 343 MB library holds 251 MiB of
#     device code for sm_75..sm_120), stripped;
#   - transformer_engine_torch, the PyTorch extension, built here against the venv's torch
#     (host-only C++: about 20 CPU-minutes once, cached in $TE_BUILD_DIR);
#   - megatron-core 0.19.2, so that TE tests run with the PyTorch reference attention without
#     the TileLang bundle; _pydeps/: einops, the pydantic stack, packaging, omegaconf (added to
#     PYTHONPATH only where the box lacks them).
#
# Usage (project root, after the README's install):  bash scripts/make_te_bundle.sh
# On the GPU box:
#   mkdir -p /tmp/te && tar -xJf .gpu/te.tar.xz -C /tmp/te
#   export PYTHONPATH=/tmp/te:$PWD:/tmp/te/_pydeps
# With the TileLang bundle too (together over the 64 MiB a remote GPU run may take along): one run
# takes only .gpu/te.tar.xz and unpacks it into the checkout's ignored .gpu/te (kept while the
# machine stays up), the next takes .gpu/site.tar.xz and puts both folders on PYTHONPATH.
# TE's loader finds cuDNN / cuBLAS / NVRTC in torch's nvidia-* packages itself. Do not set
# LD_BIND_NOW: the core library names one cuBLAS >= 13.2 symbol (grouped GEMM only, checked at
# run time) that torch's cuBLAS 13.1 lacks; lazy binding never resolves it otherwise.
set -euo pipefail
TE_VER=2.20.2
root="$(git rev-parse --show-toplevel)"
PY=${PY:-$root/.venv/bin/python}
WORK=${TE_BUILD_DIR:-$HOME/.cache/glm5-dsa-te-bundle}
out="$root/.gpu"
mkdir -p "$WORK/dl" "$WORK/ext" "$out"
$PY -c 'import sys, torch; assert sys.version_info[:2] == (3, 12); assert (torch.version.cuda or "").startswith("13"), "needs a CUDA 13 build of torch"'
SP=$($PY -c 'import sysconfig; print(sysconfig.get_paths()["purelib"])')
export MAX_JOBS=${MAX_JOBS:-1}

# 1. the Python package, the core library (wheels) and the extension's source (sdist)
core="$WORK/dl/transformer_engine_cu13-$TE_VER-py3-none-manylinux_2_28_x86_64.whl"
pyw="$WORK/dl/transformer_engine-$TE_VER-py3-none-any.whl"
sdist="$WORK/dl/transformer_engine_torch-$TE_VER.tar.gz"
[ -f "$core" ] && [ -f "$pyw" ] || $PY -m pip download -q --no-deps -d "$WORK/dl" --python-version 3.12 \
    --platform manylinux_2_28_x86_64 --only-binary=:all: "transformer-engine==$TE_VER" "transformer-engine-cu13==$TE_VER"
if [ ! -f "$sdist" ]; then  # pip download would run the sdist's build backend, which wants torch
  url=$(curl -fsSL https://pypi.org/simple/transformer-engine-torch/ \
        | grep -o "https://[^\"#]*transformer_engine_torch-$TE_VER\.tar\.gz" | head -1)
  curl -fsSL -o "$sdist" "$url"
fi

# 2. the PyTorch extension, for sm_90, against this venv's torch and nvidia-* headers
if ! ls "$WORK"/ext/transformer_engine_torch-$TE_VER-*.whl >/dev/null 2>&1; then
  $PY -m pip install -q --no-deps --target "$WORK/buildenv" wheel "nvidia-cudnn-frontend>=1.29.0"
  mkdir -p "$WORK/coreinc" && unzip -q -o "$core" 'transformer_engine/wheel_lib/nccl_ep/include/*' -d "$WORK/coreinc"
  rm -rf "$WORK/src" && mkdir -p "$WORK/src" && tar -xzf "$sdist" -C "$WORK/src" --strip-components=1
  (cd "$WORK/src"
   export PYTHONPATH=$WORK/buildenv NVTE_BUILD_USE_NVIDIA_WHEELS=1 NVTE_CUDA_ARCHS=90 NVTE_PYTORCH_FORCE_BUILD=TRUE \
          CUDA_HOME=${CUDA_HOME:-/usr/local/cuda}
   # the nvidia-* wheels' CUDA headers lack crt/: the toolkit's include folder comes last
   export CPLUS_INCLUDE_PATH=$WORK/coreinc/transformer_engine/wheel_lib/nccl_ep/include:$WORK/buildenv/include:$CUDA_HOME/include
   $PY setup.py -q build_ext && $PY setup.py -q bdist_wheel --skip-build -d "$WORK/ext")
fi

# 3. one site folder: TE, megatron-core, and the pure-Python packages TE and megatron-core import
stage="$WORK/stage"; rm -rf "$stage"
$PY -m pip install -q --no-deps --no-index --target "$stage" "$pyw" "$core" "$WORK"/ext/transformer_engine_torch-$TE_VER-*.whl
$PY -m pip install -q --no-deps --target "$stage" --only-binary=:all: --python-version 3.12 \
    --platform manylinux_2_28_x86_64 --platform manylinux_2_17_x86_64 "megatron-core==0.19.2"
$PY -m pip install -q --no-deps --target "$stage/_pydeps" --only-binary=:all: --python-version 3.12 \
    --platform manylinux_2_28_x86_64 --platform manylinux_2_17_x86_64 --platform manylinux2014_x86_64 \
    einops pydantic pydantic-core annotated-types typing-inspection packaging omegaconf antlr4-python3-runtime pyyaml
rm -rf "$stage/transformer_engine/jax" "$stage/bin" "$stage"/transformer_engine/wheel_lib/libnccl_ep.so \
       "$stage/transformer_engine/wheel_lib/nccl_ep"
find "$stage" -name __pycache__ -type d -prune -exec rm -rf {} +
# transformer_engine.pytorch imports onnx / onnxscript for ONNX export whenever torch >= 2.4;
# import them only where they are installed
$PY - "$stage/transformer_engine/pytorch/export.py" <<'EOF'
import sys
p = sys.argv[1]
s = open(p).read()
old = "if TORCH_MAJOR == 2 and TORCH_MINOR >= 4 or TORCH_MAJOR > 2:\n"
assert s.count(old) == 1, f"{p} changed: look at its onnx import"
s = s.replace(old, "import importlib.util as _ilu\n\nif (TORCH_MAJOR == 2 and TORCH_MINOR >= 4 or TORCH_MAJOR > 2) and all(\n"
                   "    _ilu.find_spec(_m) is not None for _m in (\"onnx\", \"onnxscript\")):\n")
open(p, "w").write(s)
EOF

# 4. sm_90 device code only, symbols stripped, zeros made sparse; it must still load
lib="$stage/transformer_engine/wheel_lib/libtransformer_engine.so"
$PY "$root/scripts/prune_fatbin.py" "$lib" 90
strip --strip-unneeded "$lib"
fallocate --dig-holes "$lib" 2>/dev/null || true
LD_LIBRARY_PATH=$SP/nvidia/cu13/lib:$SP/nvidia/cudnn/lib:$SP/nvidia/nccl/lib \
    $PY -c 'import ctypes, os, sys; ctypes.CDLL(sys.argv[1], mode=ctypes.RTLD_GLOBAL | os.RTLD_LAZY)' "$lib"

tar -C "$stage" --sparse --owner=0 --group=0 -cf - . | xz -9 -T1 > "$out/te.tar.xz.part"
mv "$out/te.tar.xz.part" "$out/te.tar.xz"
ls -l "$out/te.tar.xz"

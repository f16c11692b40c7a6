"""Block-FP8 checkpoints (the published GLM-5.x-FP8 layout) dequantised to bf16, one tensor at a time.

Layout (DeepSeek-V3 style, as ``zai-org/GLM-5*-FP8`` ship it):

* ``config.json`` carries ``quantization_config = {"quant_method": "fp8", "fmt": "e4m3",
  "activation_scheme": "dynamic", "weight_block_size": [128, 128], "modules_to_not_convert": [...]}``;
* each quantised linear weight ``<name>.weight`` [out, in] is stored as ``float8_e4m3fn`` beside
  ``<name>.weight_scale_inv``, float32 [ceil(out / b0), ceil(in / b1)] for ``weight_block_size = [b0, b1]``;
* the real weight is ``w[i, j] = q[i, j] * scale_inv[i // b0, j // b1]`` (computed in fp32, rounded once to
  bf16); the last block row / column is partial when ``out`` / ``in`` is not a multiple of the block
  (e.g. ``kv_a_proj_with_mqa`` [576, 6144]);
* every other tensor (embeddings, ``lm_head``, norms, the MoE router ``mlp.gate`` and its
  ``e_score_correction_bias``, the indexer's ``weights_proj`` and ``k_norm``) keeps its stored dtype.

Activation scales do not exist in this layout (``activation_scheme: dynamic``); anything else is refused
by :func:`parse_quantization_config` with the field and its value.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch

__all__ = ["SCALE_SUFFIX", "BlockFP8", "parse_quantization_config", "dequantize"]

SCALE_SUFFIX = "_scale_inv"  # "<name>.weight" -> "<name>.weight_scale_inv"
_KNOWN_FIELDS = {"quant_method", "fmt", "activation_scheme", "weight_block_size", "scale_fmt",
                 "modules_to_not_convert", "ignored_layers"}
_HINT = ("glm5_dsa_plugin reads bf16 checkpoints and block-FP8 ones in the published GLM-5.x-FP8 layout "
         "(quant_method 'fp8', fmt 'e4m3', activation_scheme 'dynamic', a two-int weight_block_size, float "
         "scales); convert this checkpoint to bf16 first, or use the bf16 release")


@dataclass(frozen=True)
class BlockFP8:
    """A validated block-FP8 quantisation: ``block`` = (rows, cols) of one scale block."""

    block: tuple[int, int]


def parse_quantization_config(qc, where: str = "config.json") -> BlockFP8 | None:
    """``quantization_config`` (dict, or None for an unquantised checkpoint) -> :class:`BlockFP8` or None.

    Raises ValueError naming ``quantization_config.<field>`` and its value for anything this loader
    does not implement exactly."""
    if qc is None:
        return None
    if not isinstance(qc, dict):
        raise ValueError(f"{where}: quantization_config = {qc!r} is not a dict. {_HINT}")

    def bad(field, value, why):
        return ValueError(f"{where}: quantization_config.{field} = {value!r} {why}. {_HINT}")

    unknown = sorted(set(qc) - _KNOWN_FIELDS)
    if unknown:
        raise bad(unknown[0], qc[unknown[0]], "is a field this loader does not know")
    if qc.get("quant_method") != "fp8":
        raise bad("quant_method", qc.get("quant_method"), "is not supported (only 'fp8', block-wise)")
    if qc.get("fmt", "e4m3") != "e4m3":
        raise bad("fmt", qc.get("fmt"), "is not supported (only 'e4m3', stored as float8_e4m3fn)")
    if qc.get("activation_scheme", "dynamic") != "dynamic":
        raise bad("activation_scheme", qc.get("activation_scheme"),
                  "is not supported (only 'dynamic': no stored activation scales)")
    if qc.get("scale_fmt", "float") != "float":
        raise bad("scale_fmt", qc.get("scale_fmt"), "is not supported (only float scales)")
    block = qc.get("weight_block_size")
    if (not isinstance(block, (list, tuple)) or len(block) != 2
            or not all(isinstance(b, int) and not isinstance(b, bool) and b > 0 for b in block)):
        raise bad("weight_block_size", block, "is not two positive ints (per-tensor / per-channel FP8 is not "
                  "supported)")
    for field in ("modules_to_not_convert", "ignored_layers"):
        if qc.get(field) is not None and not isinstance(qc[field], list):
            raise bad(field, qc[field], "is not a list of module names")
    return BlockFP8(block=(block[0], block[1]))


def dequantize(q: torch.Tensor, scale_inv: torch.Tensor, block: tuple[int, int], name: str = "weight",
               out_dtype: torch.dtype = torch.bfloat16) -> torch.Tensor:
    """``q`` float8_e4m3fn [R, C], ``scale_inv`` [ceil(R / b0), ceil(C / b1)] -> ``out_dtype`` [R, C].

    ``out[i, j] = round(float32(q[i, j]) * float32(scale_inv[i // b0, j // b1]))``; partial edge blocks
    use their block's scale. Works one block row at a time: besides the output, at most one block row
    in fp32 is alive."""
    if q.dtype != torch.float8_e4m3fn:
        raise ValueError(f"{name}: has a {name}{SCALE_SUFFIX} beside it but dtype {q.dtype}, not float8_e4m3fn")
    if q.dim() != 2:
        raise ValueError(f"{name}: block-FP8 weight must be 2-D, got shape {tuple(q.shape)}")
    if not scale_inv.is_floating_point() or scale_inv.element_size() < 2:
        raise ValueError(f"{name}{SCALE_SUFFIX}: dtype {scale_inv.dtype} is not a float scale")
    (R, C), (b0, b1) = q.shape, block
    want = (math.ceil(R / b0), math.ceil(C / b1))
    if tuple(scale_inv.shape) != want:
        raise ValueError(f"{name}{SCALE_SUFFIX}: shape {tuple(scale_inv.shape)}, but weight {tuple(q.shape)} in "
                         f"{b0}x{b1} blocks needs {want}")
    s = scale_inv.to(torch.float32)
    if not torch.isfinite(s).all():
        pos = tuple(torch.nonzero(~torch.isfinite(s))[0].tolist())
        raise ValueError(f"{name}{SCALE_SUFFIX}: non-finite scale {s[pos].item()} at block {pos}")
    out = torch.empty(R, C, dtype=out_dtype, device=q.device)
    for bi in range(want[0]):
        r0, r1 = bi * b0, min((bi + 1) * b0, R)
        block_row = q[r0:r1].to(torch.float32) * s[bi].repeat_interleave(b1)[:C]
        if not torch.isfinite(block_row).all():  # float8_e4m3fn has NaN codes
            i, j = torch.nonzero(~torch.isfinite(block_row))[0].tolist()
            raise ValueError(f"{name}: non-finite value {block_row[i, j].item()} at ({r0 + i}, {j}) after "
                             f"dequantisation")
        out[r0:r1] = block_row.to(out_dtype)
    return out

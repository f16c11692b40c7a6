"""``Backend.saved_bytes`` of the TileLang backend, where its layout depends on the call (CPU:
sizes only; the interpreted prepare-indices test compares them with the tensors it keeps)."""

from glm5_dsa_plugin.ops.contract import Problem
from glm5_dsa_plugin.ops.tilelang.backend import TileLangBackend


def _prob(heads, topk, T=100, T_kv=300):
    return Problem(batch=1, seq_len=T, seq_len_kv=T_kv, heads=heads, kv_groups=1, topk=topk, d_qk=576, d_v=512,
                   sm_scale=256**-0.5)


def test_tilelang_saved_bytes_follow_its_choices():
    be = TileLangBackend()
    full = be.saved_bytes(_prob(64, 2048), 2)
    # kv with its sentinel row; the caller's indices read as they are (topk a multiple of 64); one row per block
    assert full == {"kv": 301 * 576 * 2, "indices": 0, "extent": 100 * 4, "key_lists": 0, "key_list_extent": 0}
    assert be.saved_bytes(_prob(64, 100), 2)["indices"] == 100 * 128 * 4  # its own copy, topk padded to 128
    assert be.deterministic_variant().saved_bytes(_prob(64, 2048), 2)["indices"] == 100 * 2048 * 4
    grouped = be.saved_bytes(_prob(16, 2048), 2)  # 16 heads: blocks of 4 rows, 25 groups
    assert grouped["key_lists"] == 25 * 4 * 2048 * 5 and grouped["key_list_extent"] == 25 * 4
    assert TileLangBackend(row_groups=False).saved_bytes(_prob(16, 2048), 2)["key_lists"] == 0
    assert TileLangBackend()._with_choices(safe=False).saved_bytes(_prob(64, 2048), 2)["kv"] == 300 * 576 * 2


def test_tilelang_backward_bytes():
    be = TileLangBackend()
    # fp32 accumulator with the sentinel row, the result in kv's dtype; no slot buffer outside deterministic mode
    assert be.backward_bytes(_prob(64, 2048), 2) == {"dkv_fp32": 301 * 576 * 4, "dkv": 300 * 576 * 2}
    det = TileLangBackend(deterministic=True, slot_buffer_bytes=1 << 20)
    one_block = 2048 * 576 * 4  # 64 heads: one tile per row, a row's 2048 slots of 576 fp32
    assert det.backward_bytes(_prob(64, 2048), 2)["slot_buffer"] == one_block  # the buffer holds one row at least
    big = TileLangBackend(deterministic=True, slot_buffer_bytes=1 << 40)
    assert big.backward_bytes(_prob(64, 2048), 2)["slot_buffer"] == 100 * one_block  # never more than every row
    mid = TileLangBackend(deterministic=True, slot_buffer_bytes=10 * one_block)
    assert mid.backward_bytes(_prob(64, 2048), 2)["slot_buffer"] == 10 * one_block
    # 16 heads: row groups of 4 rows (lists of 4 * 2048 slots) or one row per block, whichever is larger
    assert big.backward_bytes(_prob(16, 2048), 2)["slot_buffer"] == 25 * 4 * one_block

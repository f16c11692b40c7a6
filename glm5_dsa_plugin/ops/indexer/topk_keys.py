"""The indexer's top-k keys, shared by its kernels and the model (imports nothing).

A top-k key is an int64 whose descending order is the top-k order: the order-preserving 32-bit
image of the fp32 score in the high half, ``T_kv - 1 - key index`` in the low half (the lower
index wins a tie); :func:`glm5_dsa_plugin.model.indexer.score_keys` is the definition.
"""

__all__ = ["INVISIBLE_KEY"]

# the key of every invisible (row, key) pair: below the key of any score, -inf included
INVISIBLE_KEY = -(1 << 63)

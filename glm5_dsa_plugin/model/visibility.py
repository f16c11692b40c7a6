"""Who may see whom in a packed (THD) micro batch: :class:`Visibility`, in packed coordinates.

A batch is flattened into one packed sequence set (bshd is THD with ``cu_seqlens = [0, s, 2s, ...]``);
key s is visible to query t iff both are in the same sequence and key position <= query position
(positions within the sequence). Pure PyTorch, no Megatron.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

__all__ = ["Visibility"]


def _boundary_errors(cu: torch.Tensor, padded: torch.Tensor | None) -> tuple[bool, bool, int, int]:
    """(lengths decrease somewhere, a padded length is below its real one, first boundary, packed
    total) of int64 boundaries, in one host read."""
    layout = cu if padded is None else padded
    lengths = cu[1:] - cu[:-1]
    bad_order, bad_pad, first, total = torch.stack([(lengths < 0).any().long(),
                                                    ((layout[1:] - layout[:-1]) < lengths).any().long(),
                                                    layout[0], layout[-1]]).tolist()
    return bool(bad_order), bool(bad_pad), int(first), int(total)


def _to_device(t: torch.Tensor, device: torch.device) -> torch.Tensor:
    """A small host tensor on ``device`` without waiting for the device's queue (pinned staging)."""
    if device.type != "cuda":
        return t.to(device)
    return t.pin_memory().to(device, non_blocking=True)


@dataclass(frozen=True)
class Visibility:
    """Who may see whom, in packed coordinates.

    query_seq/query_pos [T] and key_seq/key_pos [T_kv] (int64): sequence id and position inside
    the sequence; key s is visible to query t iff same sequence and key_pos[s] <= query_pos[t].
    Query rows and key rows may be different token sets (context parallel: local queries against
    the all-gathered keys, both in the natural packed order)."""

    query_seq: torch.Tensor
    query_pos: torch.Tensor
    key_seq: torch.Tensor
    key_pos: torch.Tensor
    query_index: torch.Tensor | None = None  # packed index of each query row among the keys (default: same rows)

    @property
    def qidx(self) -> torch.Tensor:
        if self.query_index is not None:
            return self.query_index
        return torch.arange(self.query_seq.shape[0], device=self.query_seq.device)

    @staticmethod
    def from_cu_seqlens(cu_seqlens: torch.Tensor, device=None, cu_seqlens_padded: torch.Tensor | None = None
                        ) -> "Visibility":
        """cu_seqlens [n_seq + 1] (megatron-core PackedSeqParams) -> self-attention visibility.

        With ``cu_seqlens_padded`` the packed layout is the padded one: sequence i occupies
        [padded[i], padded[i + 1]) and its real tokens are the first cu_seqlens[i+1] - cu_seqlens[i];
        pad tokens see no key and no query sees them (their top-k rows are all padding).

        Host reads: none for boundaries on the host (checked there, copied through pinned memory);
        one for boundaries on a GPU (the check and the total read together). Each read waits for
        the GPU's queued work, so a layer that hands over host boundaries keeps the host ahead."""
        dev = torch.device(device) if device is not None else cu_seqlens.device
        cu = cu_seqlens.to(dtype=torch.int64)
        cp = cu_seqlens_padded.to(dtype=torch.int64) if cu_seqlens_padded is not None else None
        if cp is not None and cp.shape != cu.shape:
            raise ValueError(f"cu_seqlens_padded {cp.tolist()} does not hold cu_seqlens {cu.tolist()}")
        if cu.device.type == "cpu" and (cp is None or cp.device.type == "cpu"):
            bad_order, bad_pad, first, total = _boundary_errors(cu, cp)
            cu, cp = _to_device(cu, dev), None if cp is None else _to_device(cp, dev)
        else:
            cu, cp = cu.to(dev), None if cp is None else cp.to(dev)
            bad_order, bad_pad, first, total = _boundary_errors(cu, cp)
        layout = cu if cp is None else cp
        if bad_order:
            raise ValueError(f"cu_seqlens must be non-decreasing, got {cu.tolist()}")
        if bad_pad:
            raise ValueError(f"cu_seqlens_padded {layout.tolist()} does not hold cu_seqlens {cu.tolist()}")
        if first != 0:
            raise ValueError(f"packed boundaries must start at 0, got {layout.tolist()}")
        lengths = layout[1:] - layout[:-1]
        seq = torch.repeat_interleave(torch.arange(len(lengths), device=dev), lengths, output_size=total)
        pos = torch.arange(total, device=dev) - layout[:-1][seq]
        if cp is None:
            return Visibility(seq, pos, seq, pos)
        real = pos < (cu[1:] - cu[:-1])[seq]
        q_seq = torch.where(real, seq, torch.full_like(seq, -1))
        k_seq = torch.where(real, seq, torch.full_like(seq, -2))
        return Visibility(q_seq, pos, k_seq, pos)

    @staticmethod
    def uniform(batch: int, seq_len: int, device=None) -> "Visibility":
        """``batch`` sequences of ``seq_len`` tokens each, packed one after another (bshd as THD):
        the same as ``from_cu_seqlens(arange(batch + 1) * seq_len)``, built on the device with no
        host read or copy."""
        rows = torch.arange(batch * seq_len, device=device)
        seq, pos = rows // max(1, seq_len), rows % max(1, seq_len)
        return Visibility(seq, pos, seq, pos)

    @staticmethod
    def causal(T: int, device=None) -> "Visibility":
        return Visibility.uniform(1, T, device=device)

    def rows(self, sel) -> "Visibility":
        """Visibility of a subset of query rows (index tensor or slice) against the same keys."""
        return Visibility(self.query_seq[sel], self.query_pos[sel], self.key_seq, self.key_pos, self.qidx[sel])

    def mask(self, rows=slice(None)) -> torch.Tensor:
        """bool [T_rows, T_kv]."""
        qs, qp = self.query_seq[rows], self.query_pos[rows]
        return (qs[:, None] == self.key_seq[None, :]) & (self.key_pos[None, :] <= qp[:, None])

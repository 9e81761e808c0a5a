"""The token batches ``flashrun model`` feeds a model, all from one seeded generator.

* :func:`copy_task`: each row is random tokens followed by the same tokens again, so the second
  half can be predicted only by attending back (the loss falls when attention works; a kernel
  that leaks the future would make the first half predictable too);
* :func:`padded`: the same rows left-padded to different lengths with a 2-D attention mask
  (what ``generate`` and batched inference send);
* :func:`packed`: rows of different lengths back to back in one row, ``position_ids`` restarting
  at each (how packed training batches are sent).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

PAD = 0  # the pad token id; real tokens are drawn from 1..vocab-1


@dataclass(frozen=True)
class Batch:
    input_ids: torch.Tensor  # (B, N)
    attention_mask: torch.Tensor | None = None  # (B, N), 1 = real token
    position_ids: torch.Tensor | None = None  # (B, N)

    def kwargs(self) -> dict:
        return {name: value for name, value in (("input_ids", self.input_ids), ("attention_mask", self.attention_mask),
                                                ("position_ids", self.position_ids)) if value is not None}

    def valid(self) -> torch.Tensor:
        """(B, N) bool: the positions whose outputs are compared (padding is not)."""
        if self.attention_mask is None:
            return torch.ones_like(self.input_ids, dtype=torch.bool)
        return self.attention_mask.bool()

    def to(self, device: str) -> Batch:
        return Batch(*(None if t is None else t.to(device) for t in (self.input_ids, self.attention_mask,
                                                                      self.position_ids)))


def copy_task(vocab: int, batch: int, seq_len: int, seed: int) -> Batch:
    """Random halves repeated: row = x, x (an odd length ends with one more random token)."""
    gen = torch.Generator().manual_seed(seed)
    half = torch.randint(1, vocab, (batch, (seq_len + 1) // 2), generator=gen)
    return Batch(torch.cat([half, half], dim=1)[:, :seq_len])


def padded(rows: Batch) -> Batch:
    """Row b keeps its last N - pad_b tokens, left-padded (pad_b from 0 up to a third of N, so
    one row is unpadded); positions count real tokens only, as ``generate`` does."""
    ids = rows.input_ids.clone()
    batch, n = ids.shape
    mask = torch.ones_like(ids)
    for b in range(batch):
        pad = (b * max(1, n // 3)) // max(1, batch - 1) if batch > 1 else n // 3
        ids[b, :pad] = PAD
        mask[b, :pad] = 0
    positions = (mask.cumsum(dim=1) - 1).clamp(min=0)
    return Batch(ids, mask, positions)


def packed(rows: Batch) -> Batch:
    """Three sequences back to back in one row of N tokens - prefixes of the rows, of lengths
    N/2, N/3 and the rest (rounded up; fewer when N < 3) - positions restarting at 0 at each."""
    batch, n = rows.input_ids.shape
    first, second = -(-n // 2), -(-n // 3)
    lengths = [length for length in (first, second, n - first - second) if length > 0] if n >= 3 else [n]
    pieces = [rows.input_ids[i % batch, :length] for i, length in enumerate(lengths)]
    positions = [torch.arange(length) for length in lengths]
    return Batch(torch.cat(pieces)[None], None, torch.cat(positions)[None])

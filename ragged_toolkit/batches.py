"""Lengths, offsets, positions and padding: the ragged batch itself.

A batch of ``B`` sequences is packed values ``(T, ...)`` plus offsets
``(B + 1,)``: sequence ``i`` is ``values[offsets[i]:offsets[i + 1]]``.
"""

import torch
import torch.nn.functional as F

__all__ = [
    "offsets_from_lengths",
    "offsets_from_position_ids",
    "token_index",
    "to_padded",
    "from_padded",
]


def offsets_from_lengths(lengths, device=None):
    """(B,) lengths -> (B + 1,) offsets: where each sequence starts in the packed
    tensor, then where the last one ends (``cu_seqlens`` in FlashAttention)."""
    lengths = torch.as_tensor(lengths, dtype=torch.long, device=device)
    return F.pad(lengths.cumsum(0), (1, 0))


def offsets_from_position_ids(position_ids):
    """Offsets of a packed row whose ``position_ids`` restart at 0 at every
    sequence, as Hugging Face's ``DataCollatorWithFlattening`` writes them."""
    position_ids = position_ids.flatten()
    starts = (position_ids == 0).nonzero().flatten()
    return torch.cat([starts, starts.new_tensor([len(position_ids)])])


def token_index(offsets, total=None):
    """The sequence of every packed token and its position in that sequence,
    both (T,): offsets [0, 2, 5] give [0, 0, 1, 1, 1] and [0, 1, 0, 1, 2].
    ``total``: T where the caller knows it (the packed tensor's length), so
    that the size of the result is not read from the device: then
    ``torch.compile`` traces it without a graph break."""
    lengths = offsets.diff()
    seq = torch.repeat_interleave(
        torch.arange(len(lengths), device=offsets.device), lengths, output_size=total
    )
    return seq, torch.arange(len(seq), device=offsets.device) - offsets[seq]


def to_padded(values, offsets, pad_value=0.0):
    """Packed (T, ...) -> padded (B, S, ...) and a (B, S) mask, True on real tokens."""
    lengths = offsets.diff()
    S = int(lengths.max()) if len(lengths) else 0
    padded = values.new_full((len(lengths), S, *values.shape[1:]), pad_value)
    padded = padded.index_put(token_index(offsets), values)
    return padded, torch.arange(S, device=values.device) < lengths[:, None]


def from_padded(padded, offsets):
    """Padded (B, S, ...) -> packed (T, ...): the real tokens, in packed order."""
    return padded[token_index(offsets)]


def check_offsets(offsets, total, name="offsets"):
    """Raise ``ValueError``, naming the problem, unless ``offsets`` describe a packed
    tensor of ``total`` tokens."""
    if offsets.dim() != 1 or len(offsets) < 1 or offsets.dtype not in (torch.int32, torch.int64):
        raise ValueError(
            f"{name} must be a 1-D int32 or int64 tensor of B + 1 entries, "
            f"got shape {tuple(offsets.shape)} and {offsets.dtype}"
        )
    if int(offsets[0]) != 0:
        raise ValueError(f"{name} must start at 0, got {int(offsets[0])}")
    steps = offsets.diff()
    if bool((steps < 0).any()):
        i = int((steps < 0).nonzero()[0])
        raise ValueError(
            f"{name} must not decrease: {name}[{i}] = {int(offsets[i])} "
            f"> {name}[{i + 1}] = {int(offsets[i + 1])}"
        )
    if int(offsets[-1]) != total:
        raise ValueError(f"{name} must end at the token count, {total}, got {int(offsets[-1])}")

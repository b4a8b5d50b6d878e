"""State transfer to a joiner: a ``dict[str, Tensor]`` broadcast over a generation's group, checksummed.

Contract: every member of the group calls, in the same order, either :func:`send_state` (exactly
one member, the source; normally rank 0 of the members that were not just admitted, see
:func:`source_rank`) or :func:`receive_state` (everybody else). Three broadcasts follow: the header
length, a JSON header (names, dtypes, shapes, byte offsets and the payload's checksum), and the
payload (all tensors' raw bytes in one buffer, 16-byte aligned). Only tensors and JSON cross the
wire, never pickle; the receiver validates the header against a whitelist of dtypes and
consistent sizes before allocating, and verifies the checksum before returning anything.

The checksum (:func:`checksum`) is computed where the payload lives (no copy to the host: a 1b
model's parameters and AdamW state are ~15 GB): the sum, modulo 2**64, of the payload's 8-byte words
read as integers, word i weighted by the odd number 2i+1. Any error confined to one word changes it
(the change is a nonzero multiple of an odd number modulo 2**64), and so does swapping two words
unless the difference of their values times twice their distance is a multiple of 2**64. It guards
against corruption in transit, not against a malicious sender (the sender is a member of the job).

Invariant: ``receive_state`` returns tensors bitwise-identical to the sender's, or raises
(:class:`StateTransferError` for a corrupt transfer, ``PeerFailure`` if a member died meanwhile).
Returned tensors are views into one buffer; copy them into the model (``load_state_dict`` does).
"""

from __future__ import annotations

import json
from collections.abc import Mapping
from typing import Any

import torch
from torch import Tensor

from recover.errors import RecoverError

FORMAT = "recover-state/2"
ALIGN = 16  # a multiple of 8: the payload is read as 8-byte words
CHECKSUM_CHUNK_WORDS = 1 << 24  # 128 MiB of words per step: bounds the temporaries on the device
MAX_HEADER_BYTES = 64 << 20
DTYPES: dict[str, torch.dtype] = {
    str(d).removeprefix("torch."): d
    for d in (torch.float64, torch.float32, torch.float16, torch.bfloat16, torch.int64, torch.int32,
              torch.int16, torch.int8, torch.uint8, torch.bool, torch.complex64, torch.complex128)
}


class StateTransferError(RecoverError):
    """A state transfer whose header is invalid or whose payload fails its checksum."""


def source_rank(group: Any) -> int:
    """The lowest rank among members that were already in the previous generation."""
    joined = set(group.membership.joined)
    for rank, replica in enumerate(group.members):
        if replica not in joined:
            return rank
    raise StateTransferError(f"generation {group.generation} has no member to send state from")


def _align(n: int) -> int:
    return (n + ALIGN - 1) // ALIGN * ALIGN


def checksum(payload: Tensor) -> str:
    """16 hex digits: sum over the 8-byte words x_i of ``payload`` (uint8, length a multiple of 8) of
    x_i * (2i + 1), modulo 2**64, computed on the payload's device (see the module docstring)."""
    words = payload.view(torch.int64)
    n = min(words.numel(), CHECKSUM_CHUNK_WORDS)
    odd = torch.arange(n, dtype=torch.int64, device=payload.device).mul_(2).add_(1)  # 2j + 1 within a chunk
    total = torch.zeros((), dtype=torch.int64, device=payload.device)
    for start in range(0, words.numel(), CHECKSUM_CHUNK_WORDS):
        chunk = words[start:start + CHECKSUM_CHUNK_WORDS]
        total += (chunk * odd[:chunk.numel()]).sum() + chunk.sum() * (2 * start)  # 2(start+j)+1; wraps
    return f"{int(total) & (2**64 - 1):016x}"


def send_state(group: Any, state: Mapping[str, Tensor]) -> str:
    """Broadcasts ``state`` from this rank to every other member; returns the payload's checksum."""
    entries: list[dict[str, Any]] = []
    offset = 0
    for name, t in state.items():
        if not isinstance(t, Tensor):
            raise TypeError(f"state[{name!r}] is {type(t).__name__}; only tensors can be transferred")
        dtype = str(t.dtype).removeprefix("torch.")
        if dtype not in DTYPES:
            raise TypeError(f"state[{name!r}] has dtype {t.dtype}, not one of {sorted(DTYPES)}")
        nbytes = t.numel() * t.element_size()
        entries.append({"name": str(name), "dtype": dtype, "shape": list(t.shape), "offset": offset,
                        "nbytes": nbytes})
        offset = _align(offset + nbytes)
    payload = torch.zeros(offset, dtype=torch.uint8, device=group.device)
    for e, t in zip(entries, state.values(), strict=True):
        if e["nbytes"]:
            raw = t.detach().contiguous().reshape(-1).view(torch.uint8)
            payload[e["offset"]:e["offset"] + e["nbytes"]].copy_(raw)
    digest = checksum(payload)
    header = json.dumps({"format": FORMAT, "total_bytes": offset, "checksum": digest, "tensors": entries},
                        separators=(",", ":")).encode()
    _broadcast_bytes(group, header, group.rank)
    group.broadcast_into([payload], group.rank)
    return digest


def receive_state(group: Any, src_rank: int) -> dict[str, Tensor]:
    """Receives the state that rank ``src_rank`` sends with :func:`send_state`.

    Raises:
        StateTransferError: invalid header or checksum mismatch. PeerFailure: a member died.
    """
    header = _parse_header(_broadcast_bytes(group, None, src_rank))
    payload = torch.empty(header["total_bytes"], dtype=torch.uint8, device=group.device)
    group.broadcast_into([payload], src_rank)
    digest = checksum(payload)
    if digest != header["checksum"]:
        raise StateTransferError(f"state checksum mismatch from rank {src_rank}: got {digest}, "
                                 f"sender said {header['checksum']}")
    out: dict[str, Tensor] = {}
    for e in header["tensors"]:
        raw = payload[e["offset"]:e["offset"] + e["nbytes"]]
        out[e["name"]] = raw.view(DTYPES[e["dtype"]]).view(e["shape"])
    return out


def _broadcast_bytes(group: Any, data: bytes | None, src_rank: int) -> bytes:
    length = torch.tensor([len(data) if data is not None else 0], dtype=torch.int64, device=group.device)
    group.broadcast_into([length], src_rank)
    n = int(length.item())
    if not 0 <= n <= MAX_HEADER_BYTES:
        raise StateTransferError(f"state header of {n} bytes is outside 0..{MAX_HEADER_BYTES}")
    if data is not None:
        buf = torch.frombuffer(bytearray(data), dtype=torch.uint8).to(group.device)
    else:
        buf = torch.empty(n, dtype=torch.uint8, device=group.device)
    group.broadcast_into([buf], src_rank)
    return bytes(buf.cpu().numpy().tobytes())


def _parse_header(raw: bytes) -> dict[str, Any]:
    try:
        h = json.loads(raw.decode("utf-8"))
    except (UnicodeDecodeError, ValueError) as exc:
        raise StateTransferError(f"state header is not valid JSON: {exc}") from None
    if not isinstance(h, dict) or h.get("format") != FORMAT:
        raise StateTransferError(f"state header format is not {FORMAT!r}")
    total, tensors = h.get("total_bytes"), h.get("tensors")
    if not isinstance(total, int) or total < 0 or total % ALIGN or not isinstance(tensors, list):
        raise StateTransferError("state header lacks total_bytes (a multiple of 16) or tensors")
    if not isinstance(h.get("checksum"), str):
        raise StateTransferError("state header lacks checksum")
    names = set()
    for e in tensors:
        _check_entry(e, total)
        if e["name"] in names:
            raise StateTransferError(f"state header names tensor {e['name']!r} twice")
        names.add(e["name"])
    return h


def _check_entry(e: Any, total: int) -> None:
    if not isinstance(e, dict) or not isinstance(e.get("name"), str) or e.get("dtype") not in DTYPES:
        raise StateTransferError(f"bad state header entry {str(e)[:200]}")
    shape, off, nbytes = e.get("shape"), e.get("offset"), e.get("nbytes")
    if not isinstance(shape, list) or not all(isinstance(s, int) and s >= 0 for s in shape):
        raise StateTransferError(f"bad shape for {e['name']!r}: {shape}")
    numel = 1
    for s in shape:
        numel *= s
    itemsize = torch.empty(0, dtype=DTYPES[e["dtype"]]).element_size()
    if nbytes != numel * itemsize or not isinstance(off, int) or off < 0 or off % ALIGN or off + nbytes > total:
        raise StateTransferError(f"inconsistent size or offset for {e['name']!r}")

"""`RouteStore`: compact, packed storage of MoE routes (top-k expert indices per token per MoE layer).

Routes of B sequences are concatenated, never padded to the batch's longest sequence:

    indices  uint8 [total_tokens, layers, topk]  (uint16 when num_experts > 256)
    offsets  int64 [B + 1]                       sequence i owns rows offsets[i]:offsets[i+1]
    token_hash int64 [B]                         crc32 of the token ids the routes belong to

Row t of sequence i is the routing of the token at position t (the token fed in at t, whose output scores
token t + 1), so a sequence of n tokens has routes for its n - 1 input positions. `layers` are the 0-based
model layer indices of the MoE layers (columns of `indices`). Saved as safetensors (no pickle):

    store.save("routes.safetensors"); RouteStore.load("routes.safetensors")
"""
from __future__ import annotations

import json
import zlib
from dataclasses import dataclass, field, fields
from pathlib import Path
from typing import Sequence

import torch


class RoutingError(ValueError):
    """Routes missing, of the wrong shape, or for the wrong tokens (always names layer and/or sequence)."""


def index_dtype(num_experts: int) -> torch.dtype:
    """The narrowest unsigned dtype holding every expert index: uint8 up to 256 experts, else uint16."""
    if not 1 <= num_experts <= 65536:
        raise ValueError(f"num_experts must be in [1, 65536] (got {num_experts})")
    return torch.uint8 if num_experts <= 256 else torch.uint16


def token_hash(tokens: torch.Tensor | Sequence[int]) -> int:
    """crc32 of the token ids (as int32 bytes): identifies which tokens a sequence's routes belong to."""
    t = torch.as_tensor(tokens, dtype=torch.int64).reshape(-1).to(torch.int32).cpu().contiguous()
    return zlib.crc32(t.numpy().tobytes())


def _join(how: str, **kw):
    """A `RouteStore` field that says how `RouteStore.concat` joins it: "rows" (tensors concatenated in order: per-token
    indices, per-sequence hashes), "offsets" (re-based on the rows before) or "shared" (describes the whole store:
    every part must agree)."""
    return field(metadata={"join": how}, **kw)


@dataclass(frozen=True)
class RouteStore:
    indices: torch.Tensor = _join("rows")
    offsets: torch.Tensor = _join("offsets")
    token_hash: torch.Tensor = _join("rows")
    num_experts: int = _join("shared")
    layers: tuple[int, ...] = _join("shared")
    source: str = _join("shared", default="unknown")

    def __post_init__(self):
        if self.indices.dim() != 3:
            raise RoutingError(f"RouteStore.indices must be [tokens, layers, topk] (got shape {tuple(self.indices.shape)})")
        if self.indices.dtype != index_dtype(self.num_experts):
            raise RoutingError(f"RouteStore.indices must be {index_dtype(self.num_experts)} for {self.num_experts} "
                               f"experts (got {self.indices.dtype})")
        if self.indices.shape[1] != len(self.layers):
            raise RoutingError(f"RouteStore has {self.indices.shape[1]} layer columns but layers={list(self.layers)}")
        off = self.offsets
        if off.dim() != 1 or off.numel() < 1 or int(off[0]) != 0 or int(off[-1]) != self.indices.shape[0] \
                or bool((off[1:] < off[:-1]).any()):
            raise RoutingError(f"RouteStore.offsets must rise from 0 to {self.indices.shape[0]} (got {off.tolist()[:8]}...)")
        if self.token_hash.shape != (off.numel() - 1,):
            raise RoutingError(f"RouteStore.token_hash must have one entry per sequence ({off.numel() - 1}), "
                               f"got {tuple(self.token_hash.shape)}")

    # ---- construction ---------------------------------------------------------------------------
    @classmethod
    def from_sequences(cls, routes: Sequence[torch.Tensor], tokens: Sequence[torch.Tensor | Sequence[int]], *,
                       num_experts: int, layers: Sequence[int], source: str = "unknown") -> "RouteStore":
        """Pack per-sequence routes ([T_i, layers, topk] integer tensors) with the T_i tokens they route."""
        if len(routes) != len(tokens):
            raise RoutingError(f"{len(routes)} route tensors for {len(tokens)} token sequences")
        dtype = index_dtype(num_experts)
        hashes, lens = [], [0]
        for i, (r, t) in enumerate(zip(routes, tokens)):
            t = torch.as_tensor(t).reshape(-1)
            if r.dim() != 3 or r.shape[0] != t.numel() or r.shape[1] != len(layers):
                raise RoutingError(f"sequence {i}: routes of shape {tuple(r.shape)} for {t.numel()} tokens and "
                                   f"{len(layers)} layers (want [{t.numel()}, {len(layers)}, topk])")
            if r.numel() and (int(r.min()) < 0 or int(r.max()) >= num_experts):
                raise RoutingError(f"sequence {i}: expert index out of [0, {num_experts}) "
                                   f"(min {int(r.min())}, max {int(r.max())})")
            hashes.append(token_hash(t))
            lens.append(r.shape[0])
        topk = routes[0].shape[2] if routes else 0
        flat = torch.cat([r.to(dtype) for r in routes]) if routes else torch.zeros(0, len(layers), topk, dtype=dtype)
        return cls(indices=flat, offsets=torch.tensor(lens, dtype=torch.int64).cumsum(0),
                   token_hash=torch.tensor(hashes, dtype=torch.int64), num_experts=num_experts,
                   layers=tuple(int(x) for x in layers), source=source)

    # ---- access ---------------------------------------------------------------------------------
    def __len__(self) -> int:
        return self.offsets.numel() - 1

    @property
    def topk(self) -> int:
        return self.indices.shape[2]

    @property
    def lengths(self) -> torch.Tensor:
        return self.offsets[1:] - self.offsets[:-1]

    def sequence(self, i: int) -> torch.Tensor:
        """Routes of sequence i: [T_i, layers, topk] (a view, compact dtype)."""
        return self.indices[int(self.offsets[i]):int(self.offsets[i + 1])]

    def select(self, rows: Sequence[int] | torch.Tensor) -> "RouteStore":
        """A new store holding sequences `rows`, in that order."""
        rows = [int(r) for r in torch.as_tensor(rows).reshape(-1).tolist()]
        for r in rows:
            if not 0 <= r < len(self):
                raise RoutingError(f"sequence {r}: no routes (the store holds {len(self)} sequences)")
        parts = [self.sequence(r) for r in rows]
        lens = torch.tensor([0] + [p.shape[0] for p in parts], dtype=torch.int64).cumsum(0)
        flat = torch.cat(parts) if parts else self.indices[:0]
        return RouteStore(indices=flat, offsets=lens, token_hash=self.token_hash[rows] if rows else self.token_hash[:0],
                          num_experts=self.num_experts, layers=self.layers, source=self.source)

    @classmethod
    def concat(cls, parts: Sequence["RouteStore"]) -> "RouteStore":
        """The sequences of `parts` in order, one store. Each field is joined as its `_join` kind says (a field that
        names none fails here, so a new one cannot be left out)."""
        if not parts:
            raise RoutingError("RouteStore.concat needs at least one store")
        values = {}
        for f in sorted(fields(cls), key=lambda f: f.metadata.get("join") != "shared"):  # disagreement named first
            got, how = [getattr(p, f.name) for p in parts], f.metadata.get("join")
            if how == "rows":
                values[f.name] = torch.cat(got)
            elif how == "offsets":
                values[f.name] = torch.cat([torch.zeros(1, dtype=torch.int64)] + [p.lengths for p in parts]).cumsum(0)
            elif how == "shared":
                if any(v != got[0] for v in got):
                    raise RoutingError(f"RouteStore.concat: the stores disagree on {f.name} ({got})")
                values[f.name] = got[0]
            else:
                raise NotImplementedError(f"RouteStore.{f.name} names no join kind (rows, offsets, shared) for concat")
        return cls(**values)

    @property
    def nbytes(self) -> int:
        """Bytes held (indices + offsets + hashes)."""
        return sum(t.numel() * t.element_size() for t in (self.indices, self.offsets, self.token_hash))

    def bytes_per_token(self) -> float:
        return self.nbytes / max(1, self.indices.shape[0])

    # ---- persistence ----------------------------------------------------------------------------
    def save(self, path: str | Path) -> Path:
        """Write a safetensors file atomically (temp file, then rename)."""
        from safetensors.torch import save_file

        path = Path(path)
        tmp = path.with_name(path.name + ".tmp")
        meta = {"num_experts": str(self.num_experts), "layers": json.dumps(list(self.layers)), "source": self.source,
                "format": "msrl-routes-v1"}
        save_file({"indices": self.indices.contiguous(), "offsets": self.offsets.contiguous(),
                   "token_hash": self.token_hash.contiguous()}, str(tmp), metadata=meta)
        tmp.replace(path)
        return path

    @classmethod
    def load(cls, path: str | Path) -> "RouteStore":
        from safetensors import safe_open

        path = Path(path)
        if not path.is_file():
            raise FileNotFoundError(f"{path}: no such routes file")
        with safe_open(str(path), framework="pt") as f:
            meta = f.metadata() or {}
            if meta.get("format") != "msrl-routes-v1":
                raise RoutingError(f"{path}: not a routes file (metadata format={meta.get('format')!r}, "
                                   "want 'msrl-routes-v1')")
            t = {k: f.get_tensor(k) for k in ("indices", "offsets", "token_hash")}
        return cls(**t, num_experts=int(meta["num_experts"]), layers=tuple(json.loads(meta["layers"])),
                   source=meta.get("source", "unknown"))

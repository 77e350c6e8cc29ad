"""R3 route capture on the rollout engine: the experts vLLM actually used for every token it processed.

vLLM's own routed-experts output needs Model Runner V2 + Triton (GPU). On CPU we bind a capture callback to
every MoE router (`BaseRouter.set_capture_fn`: called by vLLM with the top-k ids right after it computes
them and right before the experts run, the same point vLLM's GPU capturer uses), plus a forward pre-hook
on the model that notes, per engine step, which request owns which rows of the flat token batch and the token
ids and positions of those rows (`vllm_access.StepContext`, through the shared `StepCapture` base).
The ids are LOGICAL expert ids (vLLM calls the callback before any expert-placement / EPLB remapping) and are
whatever the router selected, whatever its scoring: softmax top-k, or DeepSeek-V3 / Kimi-K2's sigmoid scores plus
`e_score_correction_bias` with group-limited top-k (vLLM's CPURouter; tests/e2e/test_rollout_mla.py checks them
against transformers' DeepseekV3TopkRouter). Only MoE layers have a router: dense layers (DeepSeek's first
`first_k_dense_replace`) are not recorded, and shared experts, which every token uses, are not part of a route.

After `generate`, every output row (prompt + response) gets the routes of its n - 1 input positions,
checked against the tokens the engine fed at each position; a gap or a mismatch raises naming the
sequence and position. Routes are packed into a `moe.RouteStore` (uint8 when experts <= 256).

    engine = RolloutEngine(model_dir, cfg, extensions=[EngineRouteCapture()])
    batch = engine.generate(prompts, sampling)    # batch.features.routed_experts: RouteStore, one sequence per row

Across the turns of an episode (`turn_fields`, rollout/multi_turn.py) each row's record is a one-sequence RouteStore
of the whole sequence so far: the positions an earlier turn routed are kept from that turn's record (the turn that
first saw them: its prefill or decode steps), the rest come from this turn (the prefill of the observation and
of the previous turn's last sampled token, then the decode steps). With prefix caching the cached prefix is not
computed again, so its routes exist only in the earlier record; without it the recomputed routes are dropped.
With prefix caching a request may also find blocks another request computed (the n episodes of one prompt in the
same turn, an earlier generate since the last reset): every routed position is kept, until the engine's prefix
cache is reset (`on_prefix_reset`: new weights), under (position, a chained 128-bit BLAKE2b digest of the tokens up
to it), and a position vLLM did not compute is taken from there; memory grows with the distinct tokens routed
between two resets (layers x top-k x 2 bytes + 16 per position).
"""
from __future__ import annotations

import hashlib
from functools import partial

import torch

from megatron_sparse_rl import vllm_access
from megatron_sparse_rl.moe.storage import RouteStore, RoutingError, token_hash
from megatron_sparse_rl.rollout.step_capture import LayerStepCapture


def moe_layers(model) -> list[vllm_access.MoELayer]:
    """The vLLM model's MoE layers, by layer id (raises if it has none)."""
    moe = vllm_access.moe_layers(model)
    if not moe:
        raise RoutingError("route capture: the engine's model has no MoE layers")
    return moe


def moe_layout(model) -> tuple[tuple[int, ...], int]:
    """(layer ids of the vLLM model's MoE layers, routed expert count)."""
    return _layout(moe_layers(model))


def _layout(moe: list[vllm_access.MoELayer]) -> tuple[tuple[int, ...], int]:
    return tuple(m.layer_id for m in moe), moe[0].num_experts


class EngineRouteCapture(LayerStepCapture):
    """Route capture bound to one RolloutEngine's in-process worker (see module docstring)."""

    provides = "routes"
    field = "routed_experts"
    features = ("step", "moe")
    error = RoutingError
    no_rows = ("route capture", "reported no routes")
    follows_turns = True

    def __init__(self):
        super().__init__()
        self.layers: tuple[int, ...] = ()
        self.num_experts = 0
        self._moe: list = []
        self.keeps_prefixes = False  # rollout.prefix_caching: a position may be served from vLLM's cache, not computed
        self._pool: dict[tuple[int, int], torch.Tensor] = {}  # (position, prefix hash) -> routes, until a cache reset
        # self._seen: internal request id -> position -> (token id, int16 [layers, k])

    # ---- worker side (runs in the engine's process) -------------------------------------------------
    def _install_hooks(self, runner) -> None:
        moe = moe_layers(vllm_access.model(runner))
        for m in moe:
            if not m.reports_topk:
                raise RoutingError(f"route capture: layer {m.layer_id} uses a monolithic MoE kernel / router "
                                   f"{m.router_name} that cannot report its top-k")
        self.layers, self.num_experts = _layout(moe)
        for j, m in enumerate(moe):
            vllm_access.set_route_callback(m, partial(self._on_topk, j))
            self._moe.append(m)

    def _remove_hooks(self) -> None:
        for m in self._moe:
            vllm_access.set_route_callback(m, None)
        self._moe = []

    def _on_topk(self, j: int, topk_ids: torch.Tensor) -> None:
        self._keep_layer(j, topk_ids, torch.int16)

    # ---- driver side -------------------------------------------------------------------------------
    def on_started(self, engine) -> None:
        super().on_started(engine)
        self.keeps_prefixes = bool(engine.cfg.prefix_caching)

    def on_prefix_reset(self) -> None:
        self._pool.clear()

    def collect(self, outputs, prompts: list[list[int]]) -> RouteStore:
        """Stop capturing; routes of every (prompt, response) row of vLLM's `outputs`, in RolloutBatch order."""
        self._flush()
        seqs, seens = self._rows_seen(outputs, prompts, "routes")
        routes = self._rows_routes(seqs, seens, [None] * len(seqs))
        self._seen.clear()
        return RouteStore.from_sequences(routes, [s[:-1] for s in seqs], num_experts=self.num_experts,
                                         layers=self.layers, source="engine")

    def turn_fields(self, outputs, prompts: list[list[int]], earlier: list[dict]) -> list[dict]:
        """Stop capturing; per row (one sample per prompt) {"routed_experts": one-sequence RouteStore of prompt +
        this turn's tokens}, continuing the row's earlier record (module docstring)."""
        self._flush()
        self.active = False
        by_key = self._by_sample()
        seqs, seens, olds = [], [], []
        for row, (out, prompt, before) in enumerate(zip(outputs, prompts, earlier)):
            seq = list(prompt) + list(out.outputs[0].token_ids)
            req = by_key.get((out.request_id, 0))
            kept = before.get(self.field)
            old = None if kept is None else kept.sequence(0)
            if old is not None and (old.shape[0] > len(seq) - 1 or
                                    int(kept.token_hash[0]) != token_hash(seq[:old.shape[0]])):
                raise RoutingError(f"sequence {row}: the earlier turn's routes ({old.shape[0]} positions) are not "
                                   "of this sequence's leading tokens")
            seqs.append(seq)
            seens.append(self._seen[req] if req is not None else {})
            olds.append(old)
        routes = self._rows_routes(seqs, seens, olds)
        self._seen.clear()
        return [{self.field: RouteStore.from_sequences([r], [s[:-1]], num_experts=self.num_experts,
                                                       layers=self.layers, source="engine")}
                for r, s in zip(routes, seqs)]

    def _rows_routes(self, seqs: list[list[int]], seens: list[dict], olds: list) -> list[torch.Tensor]:
        """int16 [n - 1, layers, k] per row: each input position from the row's earlier-turn record (`olds`), else
        from this call's steps, else (prefix caching: vLLM served it from its cache) from the pool of routes filed
        under (position, hash of the tokens up to it), which a position's routes depend on alone."""
        keys = [_prefix_keys(s[:-1]) if self.keeps_prefixes else [None] * (len(s) - 1) for s in seqs]
        for row, (seq, seen) in enumerate(zip(seqs, seens)):
            for pos, (tok, _) in seen.items():
                if pos < len(seq) - 1 and tok != seq[pos]:
                    raise RoutingError(f"sequence {row}: position {pos} was routed for token {tok}, the sequence "
                                       f"has {seq[pos]}")
        pool = self._pool
        if self.keeps_prefixes:
            for k, seen, old in zip(keys, seens, olds):
                n_old = 0 if old is None else old.shape[0]
                pool.update(((pos, k[pos]), old[pos].to(torch.int16)) for pos in range(n_old)
                            if (pos, k[pos]) not in pool)
                pool.update(((pos, k[pos]), r) for pos, (_, r) in seen.items()
                            if pos < len(k) and (pos, k[pos]) not in pool)
        out = []
        for row, (k, seen, old) in enumerate(zip(keys, seens, olds)):
            n_old = 0 if old is None else old.shape[0]
            picked = []
            for pos, h in enumerate(k):
                r = old[pos].to(torch.int16) if pos < n_old else seen[pos][1] if pos in seen else pool.get((pos, h))
                if r is None:
                    raise RoutingError(f"sequence {row}: the engine never routed position {pos}")
                picked.append(r)
            out.append(torch.stack(picked) if picked else torch.zeros(0, len(self.layers), 1, dtype=torch.int16))
        return out


def _prefix_keys(tokens: list[int]) -> list[bytes]:
    """Per position t, a 128-bit BLAKE2b digest of tokens[:t + 1], chained (each digest covers the previous one and
    the token), so equal keys mean equal prefixes up to a 2^-64 birthday bound over the pool; Python's 64-bit
    `hash` of ints is not collision-resistant enough to stand in for comparing the tokens."""
    h, keys = b"", []
    for t in tokens:
        h = hashlib.blake2b(h + int(t).to_bytes(8, "little", signed=True), digest_size=16).digest()
        keys.append(h)
    return keys

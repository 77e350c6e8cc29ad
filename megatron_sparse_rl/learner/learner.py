"""`Learner`: one rank's Megatron-Core model shard with DDP, optimizer and LR schedule.

    learner = Learner(adapter, spec, layout, groups, model_cfg=run.model, cfg=run.learner, total_steps=100,
                      routing=run.routing)            # MoE: owns its routing replay state (learner/routing.py)
    learner.load_hf(model_dir)                        # HF safetensors -> local shards
    out = learner.forward_logprobs(tokens)            # {"logprobs": [B, S-1], "entropy": [B, S-1]}
    out = learner.forward_logprobs(tokens, extras=ForwardExtras(sampling_support=batch.features.sampling_mask,
                                                                attention_mask=allowed, routes=request))
    metrics = learner.train_step(tokens, loss_fn)     # micro-batched forward/backward + optimizer step

`tokens` is this data-parallel rank's [B, S] right-padded batch; position t of the outputs scores token
t + 1. `loss_fn(logprobs, entropy, index) -> (loss, metrics)` receives one micro-batch (rows `index` of the
rank's batch) and returns a loss that is already normalised by the GLOBAL token/sequence count, so
micro-batch and data-parallel contributions are summed, never averaged. `extras` (learner/extras.py
`ForwardExtras`: sampling support, per-layer attention mask, routes to replay or record) are the call's own
inputs, applied for that call only.

Interleaved pipelines (parallel.vpp > 1): `self.model` is a `ModelChunks` (learner/chunks.py) of vpp DDP-wrapped
chunks, run by Megatron's interleaved 1F1B schedule; the optimizer holds every chunk and the logprobs come from the
last pipeline rank's last chunk. A training call's micro-batches must be a multiple of pp (validate checks the
run's); a forward-only call of any row count is padded to one (`pipeline_split`, e.g. the weight-sync probe's 1 row).
"""
from __future__ import annotations

import contextlib
import logging
from functools import partial
from typing import Callable

import torch
import torch.distributed as dist

from megatron_sparse_rl.config.routing import RoutingConfig
from megatron_sparse_rl.config.schema import LearnerConfig, ModelConfig
from megatron_sparse_rl.formats.hf_io import iter_mcore_tensors
from megatron_sparse_rl.learner.attention_mask import LayerAttentionMasks, pad_causal
from megatron_sparse_rl.learner.chunks import ModelChunks, check_micro_batches, chunks_of
from megatron_sparse_rl.learner.dsa_indexer_loss import IndexerLoss, indexer_loss_config
from megatron_sparse_rl.learner.extras import NO_EXTRAS, ForwardExtras
from megatron_sparse_rl.learner.host_metrics import summed_on_host
from megatron_sparse_rl.learner.indexer_replay import LearnerIndexer
from megatron_sparse_rl.learner.logprobs import vocab_parallel_entropy, vocab_parallel_logprobs
from megatron_sparse_rl.learner.model import build_gpt_model
from megatron_sparse_rl.learner.params import load_full_tensors, local_params
from megatron_sparse_rl.learner.routing import LearnerRouting
from megatron_sparse_rl.lora.layers import adapted_linears, adapted_weights, attach_lora
from megatron_sparse_rl.models.base import GPTAdapter
from megatron_sparse_rl.models.spec import ModelSpec
from megatron_sparse_rl.learner.chunks import pipeline_split
from megatron_sparse_rl.learner.logprobs import context_parallel_scores
from megatron_sparse_rl.parallel.context import split_sequence
from megatron_sparse_rl.parallel.layout import ParallelGroups, ParallelLayout

log = logging.getLogger(__name__)

LossFn = Callable[[torch.Tensor, torch.Tensor, torch.Tensor], tuple[torch.Tensor, dict]]


class Learner:
    def __init__(self, adapter: GPTAdapter, spec: ModelSpec, layout: ParallelLayout, groups: ParallelGroups, *,
                 model_cfg: ModelConfig, cfg: LearnerConfig, total_steps: int = 1, temperature: float = 1.0,
                 routing: RoutingConfig | None = None, indexer_replay: str = "none"):
        from megatron.core.distributed import DistributedDataParallel, DistributedDataParallelConfig
        from megatron.core.distributed import finalize_model_grads

        self.adapter, self.spec, self.layout, self.groups, self.cfg = adapter, spec, layout, groups, cfg
        self.temperature = temperature
        model, config = build_gpt_model(
            adapter, spec, layout, groups, dtype=model_cfg.dtype, seed=cfg.seed,
            recompute=model_cfg.recompute_activations, aux_loss_coeff=model_cfg.moe_aux_loss_coeff,
            kernels=cfg.kernels, calculate_per_token_loss=True,
            **({"moe_enable_routing_replay": True} if routing is not None else {}),
            **indexer_loss_config(spec, model_cfg.dsa_indexer_loss_coeff),
        )
        self.config = config
        # LoRA (model.lora): the base frozen, adapters hooked on its linears; DDP and the optimizer hold them only
        self.lora_params = attach_lora(model, adapter, spec, model_cfg.lora, tp=layout.tp, pp=layout.pp,
                                       seed=cfg.seed) if model_cfg.lora is not None else {}
        self.lora = model_cfg.lora  # config.LoraConfig or None: what an adapter checkpoint records
        self.lora_linears = adapted_linears(model)  # {weight name: its adapters} of this stage: merged to sync
        # every stage's adapted weights: a sync after the first sends them alone (the same names on every rank)
        self.lora_weights = adapted_weights(adapter, spec, model_cfg.lora) if model_cfg.lora else frozenset()
        self._layer_masks = None  # LayerAttentionMasks: hooks made on the first call with an attention mask
        ddp_cfg = DistributedDataParallelConfig(grad_reduce_in_fp32=True, overlap_grad_reduce=False,
                                                use_distributed_optimizer=False)
        if isinstance(model, ModelChunks):  # one DDP per chunk; later chunks in one bucket, as Megatron's training
            self.model = ModelChunks([DistributedDataParallel(config=config, ddp_config=ddp_cfg, module=c,
                                                              disable_bucketing=i > 0) for i, c in enumerate(model)])
            config.no_sync_func = [c.no_sync for c in self.model]
        else:
            self.model = DistributedDataParallel(config=config, ddp_config=ddp_cfg, module=model)
            config.no_sync_func = self.model.no_sync
        # Losses arrive globally normalised; the schedule sums micro-batches and finalize_model_grads sums
        # data-parallel ranks (num_tokens = 0 means "do not rescale").
        config.finalize_model_grads_func = finalize_model_grads
        config.grad_sync_func = None
        # This model's routing replay/recording state (learner/routing.py); calls use it through extras.routes.
        self.routing = LearnerRouting(self.model, layout, groups, routing) if routing is not None else None
        # DSA models: the indexers' replay/recording state (learner/indexer_replay.py), used through extras.indexer;
        # `indexer_replay` (routing.indexer_replay) says what the RL step's forwards ask of it.
        self.indexer = None
        if layout.vpp > 1 and (indexer_replay != "none" or model_cfg.dsa_indexer_loss_coeff):
            raise ValueError("routing.indexer_replay and model.dsa_indexer_loss_coeff need parallel.vpp = 1 (a rank's "
                             f"DSA layers are not one run of columns across model chunks); got vpp={layout.vpp}")
        if getattr(config, "experimental_attention_variant", None) == "dsa":
            self.indexer = LearnerIndexer(self.model, layout, groups, indexer_replay)
        elif indexer_replay != "none":
            raise ValueError(f"routing.indexer_replay = {indexer_replay!r} needs a DeepSeek Sparse Attention model "
                             f"(DeepSeek-V3.2, GLM-5); {spec.architecture} has no indexer: set 'none'")
        # DSA indexer KL loss (model.dsa_indexer_loss_coeff > 0): its gradient scale and indexer/kl_loss per step
        self.indexer_loss = None
        if getattr(config, "dsa_indexer_loss_coeff", None):
            self.indexer_loss = IndexerLoss(self.model, config, groups, dp=layout.dp, pp=layout.pp)
        self.optimizer, self.scheduler = self._build_optimizer(cfg, model_cfg, total_steps)
        self.step = 0

    # ---- construction --------------------------------------------------------------------------
    def _build_optimizer(self, cfg: LearnerConfig, model_cfg: ModelConfig, total_steps: int):
        from megatron.core.optimizer import OptimizerConfig, get_megatron_optimizer
        from megatron.core.optimizer_param_scheduler import OptimizerParamScheduler

        o = cfg.optimizer
        bf16 = model_cfg.dtype == "bfloat16"
        opt_cfg = OptimizerConfig(
            optimizer="adam", lr=o.lr, min_lr=o.min_lr, weight_decay=o.weight_decay, adam_beta1=o.beta1,
            adam_beta2=o.beta2, adam_eps=o.eps, clip_grad=o.clip_grad, bf16=bf16,
            params_dtype=torch.bfloat16 if bf16 else torch.float32, use_distributed_optimizer=False,
        )
        optimizer = get_megatron_optimizer(opt_cfg, chunks_of(self.model))
        decay_steps = max(total_steps, o.warmup_steps + 1)
        scheduler = OptimizerParamScheduler(
            optimizer, init_lr=0.0 if o.warmup_steps else o.lr, max_lr=o.lr, min_lr=o.min_lr,
            lr_warmup_steps=o.warmup_steps, lr_decay_steps=decay_steps, lr_decay_style=o.schedule,
            start_wd=o.weight_decay, end_wd=o.weight_decay, wd_incr_steps=decay_steps, wd_incr_style="constant",
        )
        return optimizer, scheduler

    def load_hf(self, model_dir) -> None:
        """Load Hugging Face safetensors weights into this rank's shards (every parameter must be covered)."""
        wanted = set(local_params(self.model, self.groups)) - set(self.lora_params)  # adapters are not in HF files
        loaded = load_full_tensors(self.model, self.groups, iter_mcore_tensors(model_dir, self.adapter, self.spec,
                                                                               wanted=wanted))
        missing = wanted - loaded
        if missing:
            raise ValueError(f"{model_dir}: no weights for {len(missing)} parameters, e.g. {sorted(missing)[:3]}")
        for opt in self._inner_optimizers():
            if hasattr(opt, "reload_model_params"):
                opt.reload_model_params()

    def _inner_optimizers(self):
        return getattr(self.optimizer, "chained_optimizers", [self.optimizer])

    # ---- forward -------------------------------------------------------------------------------
    def _micro_batches(self, tokens: torch.Tensor, lengths: torch.Tensor | None,
                       forward_only: bool = False) -> list[tuple[torch.Tensor, int]]:
        """(row indices, real rows) of each micro-batch: consecutive rows, or with `lengths` and learner.group_by_length
        the rows sorted longest first, so rows of similar length share a micro-batch (and its trimmed width).

        A pipeline (pp > 1) needs equal micro-batches and, interleaved (vpp > 1), a multiple of pp of them. A training
        batch must come so (validate checks the run's; `_run_schedule` refuses others); a forward-only call at pp > 1
        is split by `pipeline_split`, its last slots filled with repeats of its last row: padding, which comes after
        the `real` rows of its micro-batch and whose outputs are dropped (rows do not see each other, so the real
        rows' logprobs are those of an unpadded run)."""
        mbs, n = self.cfg.micro_batch_size, tokens.shape[0]
        order = torch.arange(n)
        if lengths is not None and self.cfg.group_by_length:
            order = torch.argsort(lengths, descending=True, stable=True)
        if self.layout.pp == 1 or not forward_only:
            return [(index, len(index)) for index in order.split(mbs)]
        count, size = pipeline_split(n, mbs, self.layout.pp, self.layout.vpp)
        slots = torch.cat([order, order[-1:].expand(count * size - n)])
        return [(slots[i * size:(i + 1) * size], min(size, max(0, n - i * size))) for i in range(count)]

    def _width(self, tokens: torch.Tensor, lengths: torch.Tensor | None, index: torch.Tensor) -> int:
        """Tokens a micro-batch runs: its longest row; the whole batch width without `lengths` or when pipeline
        stages must exchange one fixed activation shape (pp > 1)."""
        if lengths is None or self.layout.pp > 1:
            return tokens.shape[1]
        return max(2, int(lengths[index].max()))

    @staticmethod
    def _check_lengths(tokens: torch.Tensor, lengths) -> torch.Tensor | None:
        if lengths is None:
            return None
        lengths = torch.as_tensor(lengths, dtype=torch.long).reshape(-1)
        if lengths.numel() != tokens.shape[0] or bool((lengths < 1).any()) or bool((lengths > tokens.shape[1]).any()):
            raise ValueError(f"lengths must hold one value in [1, {tokens.shape[1]}] per row (got "
                             f"{lengths.tolist()[:8]} for {tokens.shape[0]} rows)")
        return lengths

    def _padded(self, tokens: torch.Tensor) -> torch.Tensor:
        """Right-pad the sequence so its input positions split into the 2 x cp context-parallel chunks and over the
        TP ranks under sequence parallelism (`layout.sequence_multiple`; padding after a token changes nothing
        before it under causal attention)."""
        length, multiple = tokens.shape[1] - 1, self.layout.sequence_multiple
        if length % multiple:
            tokens = torch.nn.functional.pad(tokens, (0, multiple - length % multiple))
        return tokens

    def _this_cp_rank(self, **batch: torch.Tensor) -> dict[str, torch.Tensor]:
        """The positions of each [b, W] input this context-parallel rank runs (Megatron's `get_batch_on_this_cp_rank`:
        chunks r and 2cp - 1 - r of 2 x cp); unchanged at cp 1."""
        if self.layout.cp == 1:
            return batch
        from megatron.core.utils import get_batch_on_this_cp_rank

        return get_batch_on_this_cp_rank(dict(batch), cp_group=self.groups.cp)

    def _scores(self, logits: torch.Tensor, tokens: torch.Tensor, index: torch.Tensor, support=None):
        """Last-stage logits [b, s, V/tp] of right-padded `tokens` -> (logprobs, entropy) [b, S-1]. With the
        call's sampling `support` (ForwardExtras.sampling_support) the logprobs are renormalised over each
        position's kept ids; the entropy is the unrestricted policy's."""
        length = tokens.shape[1] - 1
        allowed = None
        if support is not None:
            start = self.groups.tp_rank * logits.shape[-1]
            allowed = support.local_mask(index, length, start, start + logits.shape[-1])
        if self.layout.cp > 1:  # logits [b, W / cp, V/tp]: this rank's positions of the padded width W
            targets = self._padded(tokens)[:, 1:].to(logits.device)
            return context_parallel_scores(logits, targets, length, self.groups, self.temperature, allowed)
        logits = logits[:, :length]
        entropy = vocab_parallel_entropy(logits, self.groups.tp)
        targets = self._padded(tokens)[:, 1:length + 1].to(logits.device).contiguous()
        allowed = None if allowed is None else allowed.to(logits.device)
        return vocab_parallel_logprobs(logits, targets, self.temperature, allowed), entropy

    def _run_schedule(self, tokens: torch.Tensor, loss_fn: LossFn | None, forward_only: bool,
                      extras: ForwardExtras, lengths: torch.Tensor | None = None):
        """Megatron's forward/backward schedule (pipelined when pp > 1) over micro-batches of `tokens`; the
        loss (or logprob collection) runs on the last pipeline stage only. `extras`: the call's (checked;
        routes already begun); `lengths`: real tokens per row, so each micro-batch runs only up to its longest
        row (see forward_logprobs)."""
        from megatron.core.pipeline_parallel import get_forward_backward_func

        batches = self._micro_batches(tokens, lengths, forward_only)
        mbs = check_micro_batches(batches, rows=tokens.shape[0], layout=self.layout,
                                  micro_batch_size=self.cfg.micro_batch_size, recorded=extras.routes is not None
                                  or extras.indexer is not None)
        chunks = chunks_of(self.model)
        padded = self._padded(tokens)
        device = next(self.model.parameters()).device
        blocked = None  # Megatron's convention: True = masked out
        if extras.attention_mask is not None:
            blocked = ~pad_causal(extras.attention_mask, padded.shape[1] - 1)

        def forward_step(data_iterator, model):
            number, (index, real) = next(data_iterator)  # every chunk forwards micro-batch `number` in turn
            mb_tokens = tokens[index, :self._width(tokens, lengths, index)]
            inputs = self._padded(mb_tokens)[:, :-1].to(device).contiguous()
            positions = torch.arange(inputs.shape[1], device=device).unsqueeze(0).expand_as(inputs)
            if extras.routes is not None:
                self.routing.before_micro_batch(index, inputs, number)
            if extras.indexer is not None:
                self.indexer.before_micro_batch(index, inputs)
            if self.indexer_loss is not None:
                self.indexer_loss.before_micro_batch(mb_tokens.shape[1] - 1)
            mask = None  # None: Megatron's causal mask; else the per-layer mask its core-attention hooks slice
            if blocked is not None:
                width = inputs.shape[1]
                mask = blocked[index][..., :width, :width]
                if self.layout.cp > 1:  # this rank's query rows against every key (key positions are global)
                    mask = split_sequence(mask, self.groups.cp, mask.dim() - 2)
            local = self._this_cp_rank(tokens=inputs, position_ids=positions)
            output = model(local["tokens"], local["position_ids"], mask)
            return output, partial(self._loss_wrapper, loss_fn, mb_tokens, index, real, extras.sampling_support,
                                   tokens.shape[1] - 1)

        numbered = list(enumerate(batches))
        return get_forward_backward_func()(
            forward_step_func=forward_step, model=chunks,
            data_iterator=[iter(numbered) for _ in chunks] if len(chunks) > 1 else iter(numbered),
            num_microbatches=len(batches), seq_length=padded.shape[1] - 1, micro_batch_size=mbs,  # Megatron divides by cp
            forward_only=forward_only,
        )

    def _loss_wrapper(self, loss_fn, tokens, index, real, support, full, logits):
        logprobs, entropy = self._scores(logits, tokens, index, support)
        logprobs, entropy, index = logprobs[:real], entropy[:real], index[:real]  # padding rows (forward-only): out
        if logprobs.shape[1] < full:  # a trimmed micro-batch: zeros after its longest row, as the caller's layout
            logprobs = torch.nn.functional.pad(logprobs, (0, full - logprobs.shape[1]))
            entropy = torch.nn.functional.pad(entropy, (0, full - entropy.shape[1]))
        zero = torch.zeros((), dtype=torch.int)
        if loss_fn is None:  # forward-only collection
            return logprobs.sum() * 0, zero, {"logprobs": logprobs.detach(), "entropy": entropy, "index": index}
        loss, metrics = loss_fn(logprobs, entropy, index)
        return loss, zero, {"loss": loss.detach(), **metrics}

    # ---- the call's extras ---------------------------------------------------------------------
    def _check_extras(self, tokens: torch.Tensor, extras: ForwardExtras) -> None:
        """Shapes of the call's extras, before any work; installs the attention hooks on first need."""
        support, mask = extras.sampling_support, extras.attention_mask
        if support is not None and len(support) != tokens.shape[0]:
            raise ValueError(f"extras.sampling_support has {len(support)} rows, the batch has {tokens.shape[0]}")
        if mask is not None:
            want = (tokens.shape[0], self.config.num_layers, self._mask_kv_heads(), tokens.shape[1] - 1,
                    tokens.shape[1] - 1)
            if mask.dtype != torch.bool or tuple(mask.shape) != want:
                raise ValueError(f"extras.attention_mask must be bool [batch, layers, kv_heads, seq-1, seq-1] = "
                                 f"{list(want)} (got {mask.dtype} {list(mask.shape)})")
            if self._layer_masks is None:
                self._layer_masks = LayerAttentionMasks(self.model, self.groups.tp_rank)
        if extras.routes is not None and self.routing is None:
            raise ValueError("extras.routes: this learner was built without routing (Learner(..., routing=...))")
        if extras.indexer is not None and self.indexer is None:
            raise ValueError(f"extras.indexer: {self.spec.architecture} has no DeepSeek Sparse Attention indexer")

    def _mask_kv_heads(self) -> int:
        """KV heads of a per-layer attention mask (kv_keep records): 1 for multi-head latent attention (one latent
        row per token shared by every head, so one keep set per layer), else the model's query groups."""
        from megatron.core.transformer.transformer_config import MLATransformerConfig

        return 1 if isinstance(self.config, MLATransformerConfig) else self.config.num_query_groups

    @contextlib.contextmanager
    def _routes_applied(self, tokens: torch.Tensor, lengths: torch.Tensor | None, extras: ForwardExtras):
        """`extras.routes` and `extras.indexer` in force for the block (one call): yields a dict that holds
        "routing" (the RoutingResult) and "indexer" (the IndexerResult) once the block has run; the routers and
        indexers select themselves again after it, also on error."""
        done: dict = {}
        states = [(name, state, request) for name, state, request in
                  (("routing", self.routing, extras.routes), ("indexer", self.indexer, extras.indexer))
                  if request is not None]
        try:
            for _, state, request in states:
                state.begin(tokens, lengths, request)
            yield done
            for name, state, _ in states:
                done[name] = state.finish()
        finally:
            for _, state, _ in states:
                state.stop()

    @torch.no_grad()
    def forward_logprobs(self, tokens: torch.Tensor, *, lengths=None,
                         extras: ForwardExtras = NO_EXTRAS) -> dict:
        """Log-probabilities and entropy of every next token: {"logprobs", "entropy"}: [B, S-1] fp32; with
        `extras.routes` also "routing": the RoutingResult (learner/routing.py: recorded routes, metrics).

        `extras` (learner/extras.py `ForwardExtras`, rows = `tokens`' rows): `sampling_support` renormalises the
        logprobs over the ids the sampler could draw (keep-sampling-mask); `attention_mask` gives every layer
        and KV head its own visibility (sparse KV); `routes` replays or records MoE routes.
        `lengths`: optional int [B], the real (unpadded) tokens of each row: micro-batches then run only up to
        their longest row (rows grouped by length with learner.group_by_length), and the outputs of a row's
        padding positions (column >= length - 1) are 0. Without it every micro-batch runs the full width S.
        """
        lengths = self._check_lengths(tokens, lengths)
        self._check_extras(tokens, extras)
        with self._routes_applied(tokens, lengths, extras) as routed:
            self.model.eval()
            try:
                out = self._run_schedule(tokens, None, forward_only=True, extras=extras, lengths=lengths)
            finally:
                self.model.train()
            shape = (tokens.shape[0], tokens.shape[1] - 1)
            result = {k: torch.zeros(shape, dtype=torch.float32) for k in ("logprobs", "entropy")}
            for item in out:  # empty on all but the last pipeline stage
                for k in result:
                    result[k][item["index"]] = item[k].float().cpu()
            if self.layout.pp > 1:
                last = dist.get_process_group_ranks(self.groups.pp)[-1]
                for k in result:
                    dist.broadcast(result[k], src=last, group=self.groups.pp)
        if lengths is not None:  # padding positions: 0, whatever micro-batch a row ran in
            beyond = torch.arange(shape[1])[None, :] >= (lengths - 1)[:, None]
            for k in result:
                result[k][beyond] = 0.0
        return {**result, **routed}

    @contextlib.contextmanager
    def scoring_temperature(self, temperature: float):
        """Score at `temperature` meanwhile (e.g. 1.0 to compare with an engine's raw prompt logprobs)."""
        if not temperature > 0:
            raise ValueError(f"temperature must be > 0 (got {temperature})")
        saved, self.temperature = self.temperature, temperature
        try:
            yield
        finally:
            self.temperature = saved

    # ---- training ------------------------------------------------------------------------------
    def train_step(self, tokens: torch.Tensor, loss_fn: LossFn, *, lengths=None, lr: float | None = None,
                   extras: ForwardExtras = NO_EXTRAS) -> dict[str, float]:
        """One optimizer step over this rank's batch; returns loss, grad norm, lr and the loss_fn metrics summed
        over micro-batches (numbers or tensors as host floats; a dataclass of them, such as algorithms/objective.py
        `ObjectiveSums`, field by field on the host and added with its own `+`) (local to the data-parallel rank, the same on its every pipeline stage: the last stage's;
        reduce across data-parallel ranks in the caller), and with `extras.routes` the
        routing metrics (routing/replay_applied_fraction; with `compare_with`, routing/drift/..., already global
        over the data-parallel ranks). `lengths`, `extras`: as in forward_logprobs (the loss_fn sees [b, S-1]
        logprobs either way; routes are replayed in the forward and in any activation-recompute backward; routes
        recorded here are only compared with `compare_with`, not returned). With model.dsa_indexer_loss_coeff > 0
        also indexer/kl_loss (learner/dsa_indexer_loss.py: the DSA indexer's KL, already global).

        `lr` runs this step at a fixed learning rate outside the schedule (e.g. an SFT warm-start): the
        schedule and `self.step` do not advance.
        """
        if extras.routes is not None and extras.routes.record and extras.routes.compare_with is None:
            raise ValueError("extras.routes.record: train_step returns no routes, it only compares them with "
                             "extras.routes.compare_with (not given); record routes with forward_logprobs")
        lengths = self._check_lengths(tokens, lengths)
        self._check_extras(tokens, extras)
        with self._routes_applied(tokens, lengths, extras) as routed:
            self.model.train()
            self.model.zero_grad_buffer()
            self.optimizer.zero_grad()
            if lr is not None:
                for group in self.optimizer.param_groups:
                    group["lr"] = lr
            if self.indexer_loss is not None:
                self.indexer_loss.begin(len(self._micro_batches(tokens, lengths)))
            out = self._run_schedule(tokens, loss_fn, forward_only=False, extras=extras, lengths=lengths)
            indexer_loss = self.indexer_loss.finish() if self.indexer_loss is not None else {}
            ok, grad_norm, _ = self.optimizer.step()
            if not ok:
                raise FloatingPointError("optimizer step skipped: gradients were not finite")
            if lr is None:
                self.scheduler.step(increment=1)
                self.step += 1
            else:  # back to the schedule's rate for the next scheduled step
                self.scheduler.step(increment=0)
        metrics = summed_on_host(out)  # empty on all but the last pipeline stage; every stage takes its metrics
        if self.layout.pp > 1:
            held = [metrics]
            dist.broadcast_object_list(held, src=dist.get_process_group_ranks(self.groups.pp)[-1], group=self.groups.pp)
            metrics = held[0]
        metrics["grad_norm"] = float(grad_norm) if grad_norm is not None else 0.0
        metrics["lr"] = float(self.optimizer.param_groups[0]["lr"])
        for name in ("routing", "indexer"):
            if name in routed:
                metrics.update(routed[name].metrics)
        metrics.update(indexer_loss)
        return metrics

    def named_full_parameters(self):
        """(full name, LocalParam) for every local parameter (see learner/params.py)."""
        return local_params(self.model, self.groups).items()


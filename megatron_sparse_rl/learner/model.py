"""Build a Megatron-Core GPTModel for a Hugging Face architecture at a parallel layout.

The TransformerConfig comes from the model adapter (derived from config.json), never from YAML.
"""
from __future__ import annotations

import torch

from megatron_sparse_rl._optional import has_te
from megatron_sparse_rl.learner.chunks import ModelChunks
from megatron_sparse_rl.models import kernels as model_kernels
from megatron_sparse_rl.models.base import GPTAdapter
from megatron_sparse_rl.models.spec import ModelSpec
from megatron_sparse_rl.parallel.layout import ParallelGroups, ParallelLayout

DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16}


def build_gpt_model(adapter: GPTAdapter, spec: ModelSpec, layout: ParallelLayout, groups: ParallelGroups, *,
                    dtype: str = "float32", seed: int = 1234, recompute: bool = False,
                    aux_loss_coeff: float = 0.0, kernels: str = "local", **config_extra):
    """Construct this rank's GPTModel shard (random init from `seed`); returns (model, transformer_config).
    `kernels`: learner.kernels (models/kernels.py), `auto` resolved for this machine's device. With parallel.vpp > 1
    the model is a `ModelChunks` (learner/chunks.py) of vpp GPTModels, chunk i built with vp_stage=i: virtual stage
    i * pp + pp_rank, the embedding on the first rank's chunk 0, the output layer on the last rank's last chunk."""
    from megatron.core import tensor_parallel
    from megatron.core.models.gpt import GPTModel

    cuda = torch.cuda.is_available()
    kernels = model_kernels.resolve(kernels, "cuda" if cuda else "cpu")
    # uneven stages reach Megatron as its layout string; its get_transformer_layer_offset then numbers each stage's
    # layers (layer_number), which every layer-indexed feature of the learner reads
    stages = layout.stages(spec.num_layers).megatron_kwargs()
    if layout.vpp > 1:
        # The interleaved 1F1B steady state sends an activation to the next stage and a gradient to the previous one in
        # one exchange. Batched (Megatron's default batch_p2p_comm) both go out in one batch_isend_irecv, and at pp 2,
        # where next and previous are the same rank, the peer receives them in the other order: swapped, silently
        # (a training step of more than pp micro-batches computed other rows' logprobs on gloo,
        # tests/distributed/test_interleaved_pipeline.py). Unbatched (`_p2p_ops`), Megatron orders the exchange by
        # even/odd rank and, at pp 2, sends one direction over another group.
        stages["batch_p2p_comm"] = False
    if layout.cp > 1:  # the learner splits each sequence (learner/context.py); attention all-gathers K/V
        model_kernels.check_context_parallel(kernels, use_te=has_te() and cuda,
                                             sparse_attention=bool(getattr(spec, "index_topk", 0)))
        stages["context_parallel_size"] = layout.cp
    config = adapter.transformer_config(
        spec, tp=layout.tp, pp=layout.pp, ep=layout.ep, etp=layout.etp,
        sequence_parallel=layout.sequence_parallel, dtype=DTYPES[dtype], recompute=recompute,
        aux_loss_coeff=aux_loss_coeff, **{**model_kernels.config_kwargs(kernels, cuda), **stages, **config_extra},
    )
    use_te = has_te() and cuda
    tensor_parallel.model_parallel_cuda_manual_seed(seed)
    vpp = layout.vpp

    def chunk(i: int):
        vp_stage = i if vpp > 1 else None
        layer_spec = model_kernels.apply(adapter.layer_spec(config, use_te=use_te, vp_stage=vp_stage), kernels, config)
        return GPTModel(
            config=config, transformer_layer_spec=layer_spec, vocab_size=spec.vocab_size,
            max_sequence_length=spec.max_position_embeddings, pre_process=groups.pp_rank == 0 and i == 0,
            post_process=groups.pp_rank == layout.pp - 1 and i == vpp - 1,
            share_embeddings_and_output_weights=spec.tie_embeddings, position_embedding_type="rope",
            rotary_base=int(spec.rope_theta), **({"vp_stage": vp_stage} if vpp > 1 else {}),
        )

    model = chunk(0) if vpp == 1 else ModelChunks([chunk(i) for i in range(vpp)])
    _mark_expert_params(model)
    if torch.cuda.is_available():
        model.cuda(torch.cuda.current_device())
    return model, config


def _mark_expert_params(model) -> None:
    """Route routed-expert gradients through the expert-data-parallel group.

    Megatron-Core marks expert weights `allreduce=False` (-> expert-DP reduction) only when EP > 1; with
    EP = 1 they are reduced over the dense DP group. That is right only when expert TP equals TP: with
    TP > 1 and expert TP = 1 (the CPU layout) each TP rank holds a full replica of every expert and sees
    different tokens, so their grads must be summed over the expert-DP group, which includes the TP ranks.
    The expert-DP group is correct in every layout, so mark them always.
    """
    from megatron.core.transformer.moe.experts import GroupedMLP, SequentialMLP, TEGroupedMLP

    for module in model.modules():
        if isinstance(module, (SequentialMLP, GroupedMLP, TEGroupedMLP)):
            for param in module.parameters():
                param.allreduce = False

"""Module-level worker of the LoRA learner test (pickled into a spawned rank): tests/distributed/test_lora.py."""
from __future__ import annotations

import torch

from tests import learner_workers as W


def lora_key(name: str) -> tuple[int, bool, str, str]:
    """(layer, in shared experts, Hugging Face module, 'A' or 'B') of an adapter, from PEFT's name
    (`...layers.{i}...{module}.lora_{A|B}.default.weight`) or the learner's (`decoder.layers.{i}...lora.{A|B}.{module}`)."""
    parts = name.split(".")
    shared = "shared_expert" in name
    if parts[-1] == "weight":  # PEFT
        return int(parts[parts.index("layers") + 1]), shared, parts[-4], parts[-3][-1]
    return int(parts[parts.index("layers") + 1]), shared, parts[-1], parts[-2]


def lora_learner_worker(rank, world_size, model_dir, tokens, lora, adapters):
    """A TP1 learner with `lora` (config.LoraConfig) adapters set to `adapters` ({name: tensor}): its logprobs of
    `tokens`, the adapters' gradients (by lora_key) of the summed-logprob SFT loss (a step at lr 0, no clipping), what its optimizer
    holds, and after one step at lr 1e-2 the base parameters that changed and the adapters that did not."""
    from megatron_sparse_rl.learner.sft import make_sft_loss

    learner = W.make_learner(world_size, model_dir, lora=lora, clip=1e9)
    params = learner.lora_params
    keys = {lora_key(n): n for n in params}
    assert len(keys) == len(params) and set(keys) == set(adapters), sorted(set(keys) ^ set(adapters))[:4]
    with torch.no_grad():
        for key, value in adapters.items():
            params[keys[key]].copy_(value)
    logprobs = learner.forward_logprobs(tokens)["logprobs"]
    mask = torch.ones(tokens.shape[0], tokens.shape[1] - 1)
    loss = make_sft_loss(mask, mask.sum().item())
    base = {n: p.detach().clone() for n, p in learner.model.module.named_parameters() if n not in params}
    learner.train_step(tokens, loss, lr=0.0)
    grads = {lora_key(n): p.main_grad.detach().clone() for n, p in params.items()}
    held = [p for group in learner.optimizer.param_groups for p in group["params"]]
    held_ids = {id(p) for p in held}
    learner.train_step(tokens, loss, lr=1e-2)
    named = dict(learner.model.module.named_parameters())
    base_changed = [n for n, v in base.items() if not torch.equal(named[n], v)]
    adapters_unchanged = [k for k, v in adapters.items() if torch.equal(params[keys[k]].detach(), v)]
    return dict(logprobs=logprobs, grads=grads, held=len(held), held_are_adapters=held_ids == {id(p) for p in
                params.values()}, base_changed=base_changed, adapters_unchanged=adapters_unchanged,
                base_requires_grad=[n for n, p in named.items() if p.requires_grad and n not in params])


def _random_adapters(learner, seed: int) -> None:
    """Every adapter A and B random (B non-zero, so the adapters change the logprobs)."""
    g = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for _, p in sorted(learner.lora_params.items()):
            p.copy_(torch.randn(p.shape, generator=g) * 0.1)


def _sft_loss(tokens):
    from megatron_sparse_rl.learner.sft import make_sft_loss

    mask = torch.ones(tokens.shape[0], tokens.shape[1] - 1)
    return make_sft_loss(mask, mask.sum().item())


def _whole(learner) -> dict[str, torch.Tensor]:
    """The learner's adapters by name, whole (gathered over tp)."""
    from megatron_sparse_rl.lora.layers import gather_adapter

    return {n: gather_adapter(p, learner.groups.tp).clone() for n, p in learner.lora_params.items()}


def lora_save_worker(rank, world_size, model_dir, tokens, lora, path, steps_before, steps_after, fmt="adapter",
                     tp=1, pp=1):
    """A LoRA learner (tensor parallel `tp`, sequence parallel with it; pipeline parallel `pp`) with random adapters: `steps_before` scheduled SFT steps, saved to `path` (fmt 'adapter':
    its adapters alone, lora/checkpoint.py; 'learner': the run loop's torch_dist checkpoint, learner/checkpoint.py,
    which then also holds the adapters alone under adapter/), then `steps_after` more. Returns the logprobs at save
    and the adapters at the end (whole)."""
    from megatron_sparse_rl.learner.checkpoint import save_learner
    from megatron_sparse_rl.lora.checkpoint import save_adapter

    learner = W.make_learner(world_size, model_dir, tp=tp, pp=pp, lora=lora, lr=1e-2)
    _random_adapters(learner, seed=0)
    for _ in range(steps_before):
        learner.train_step(tokens, _sft_loss(tokens))
    logprobs = learner.forward_logprobs(tokens)["logprobs"]
    if fmt == "adapter":
        save_adapter(path, learner, lora, model_dir)
    else:
        save_learner(learner, path, hf_files=model_dir)
    for _ in range(steps_after):
        learner.train_step(tokens, _sft_loss(tokens))
    return dict(logprobs=logprobs, adapters=_whole(learner), step=learner.step)


def lora_resume_worker(rank, world_size, model_dir, tokens, lora, path, steps_after, fmt="adapter", tp=1, pp=1):
    """A fresh LoRA learner (tensor parallel `tp`, pipeline parallel `pp`; other random adapters) loading checkpoint `path` (fmt as
    lora_save_worker's): its logprobs, then the adapters (whole) after `steps_after` more scheduled SFT steps."""
    from megatron_sparse_rl.learner.checkpoint import load_learner
    from megatron_sparse_rl.lora.checkpoint import load_adapter

    learner = W.make_learner(world_size, model_dir, tp=tp, pp=pp, lora=lora, lr=1e-2)
    _random_adapters(learner, seed=1)
    if fmt == "adapter":
        load_adapter(path, learner, model_dir)
    else:
        load_learner(learner, path)
    logprobs = learner.forward_logprobs(tokens)["logprobs"]
    for _ in range(steps_after):
        learner.train_step(tokens, _sft_loss(tokens))
    return dict(logprobs=logprobs, adapters=_whole(learner), step=learner.step)


def lora_sync_worker(rank, world_size, model_dir, lora, tokens):
    """A TP1 LoRA learner with random adapters: what a weight sync sends (iter_hf_tensors: HF name -> tensor), its
    adapters by lora_key, and its logprobs of `tokens` before, inside and after holding a bf16 engine's weights
    (EngineWeights.held_by, the low-precision probe's reference)."""
    from megatron_sparse_rl.weight_sync import iter_hf_tensors
    from megatron_sparse_rl.weight_sync.engine_weights import EngineWeights

    learner = W.make_learner(world_size, model_dir, lora=lora)
    _random_adapters(learner, seed=0)
    sent = {name: t.detach().clone() for name, t in iter_hf_tensors(learner)}
    before = learner.forward_logprobs(tokens)["logprobs"]
    with EngineWeights(dtype=torch.bfloat16).held_by(learner):
        held = learner.forward_logprobs(tokens)["logprobs"]
    after = learner.forward_logprobs(tokens)["logprobs"]
    return dict(sent=sent, adapters={lora_key(n): p.detach().clone() for n, p in learner.lora_params.items()},
                before=before, held=held, after=after)


def lora_engine_sync_worker(rank, world_size, model_dir, lora, probe, tol):
    """A TP1 LoRA learner (random adapters, two SFT steps) synced into a vLLM-CPU engine of its base
    (sync_to_engine: the merged weights): the probe's |engine - learner| before and after (verify_logprobs, which
    raises above `tol`, so `before` is measured by hand) and the learner's LoRA logprobs."""
    from megatron_sparse_rl.config.rollout import RolloutConfig
    from megatron_sparse_rl.patches import vllm_cpu
    from megatron_sparse_rl.rollout import RolloutEngine
    from megatron_sparse_rl.weight_sync import sync_to_engine, verify_logprobs

    learner = W.make_learner(world_size, model_dir, lora=lora, lr=1e-2)
    _random_adapters(learner, seed=0)
    tokens = torch.tensor(probe)
    for _ in range(2):
        learner.train_step(tokens, _sft_loss(tokens))
    vllm_cpu.apply()
    engine = RolloutEngine(model_dir, RolloutConfig(max_model_len=256, max_num_seqs=4, kv_cache_gb=1))
    mine = learner.forward_logprobs(tokens)["logprobs"]
    before = (torch.stack(engine.prompt_logprobs(probe)) - mine).abs().max().item()
    stats = sync_to_engine(learner, engine, bucket_mb=0.1)
    after = verify_logprobs(learner, engine, probe, tol=tol)
    engine.shutdown()
    return dict(before=before, after=after, tensors=stats.tensors)


def lora_dp_worker(rank, world_size, model_dir, tokens, lora, ep=1):
    """A LoRA learner on `world_size` data-parallel ranks (experts split over `ep`) with the same random adapters on
    every rank: two scheduled SFT steps on `tokens` (the GLOBAL batch, split across data-parallel ranks); returns the
    adapters by lora_key, before and after."""
    learner = W.make_learner(world_size, model_dir, ep=ep, lora=lora, lr=1e-2)
    _random_adapters(learner, seed=0)
    before = {lora_key(n): p.detach().clone() for n, p in learner.lora_params.items()}
    dp, dp_rank = learner.layout.dp, learner.groups.dp_rank
    rows = torch.arange(tokens.shape[0]).chunk(dp)[dp_rank]
    mask = torch.ones(tokens.shape[0], tokens.shape[1] - 1)
    from megatron_sparse_rl.learner.sft import make_sft_loss

    for _ in range(2):
        learner.train_step(tokens[rows], make_sft_loss(mask[rows], mask.sum().item()))
    return before, {lora_key(n): p.detach().clone() for n, p in learner.lora_params.items()}


def lora_tp_worker(rank, world_size, model_dir, tokens, lora, adapters, tp, ep, sp, path, pp=1, vpp=1):
    """A LoRA learner at tensor parallel `tp` (sequence parallel `sp`; experts over `ep`; pipeline parallel `pp`, `vpp`
    model chunks per rank; data parallel the rest) with
    the whole `adapters` (by lora_key) sharded onto it: its logprobs of `tokens`; the adapters' gradients, gathered
    whole, of the summed-logprob SFT loss over `tokens` split across data-parallel ranks (a step at lr 0); the
    merged tensors a weight sync sends for the adapted modules; what an adapter checkpoint saved at `path` holds;
    after a scheduled step (lr 1e-2), a save + 1 more step, then a load of that save: the logprobs at save and after load, and
    the adapters after the step that followed each."""
    from megatron_sparse_rl.learner.sft import make_sft_loss
    from megatron_sparse_rl.lora.checkpoint import load_adapter, save_adapter
    from megatron_sparse_rl.lora.layers import adapter_count, gather_adapter, shard_adapter
    from megatron_sparse_rl.weight_sync import iter_hf_tensors
    from megatron_sparse_rl.weight_sync.scope import adapted_hf_names

    learner = W.make_learner(world_size, model_dir, tp=tp, ep=ep, pp=pp, sp=sp, lora=lora, clip=1e9, lr=1e-2, vpp=vpp)
    params, group = learner.lora_params, learner.groups.tp
    keys = {lora_key(n): n for n in params}  # this stage's
    assert set(keys) <= set(adapters), sorted(set(keys) - set(adapters))[:4]
    adapters = {k: v for k, v in adapters.items() if k in keys}
    with torch.no_grad():
        for key, value in adapters.items():
            params[keys[key]].copy_(shard_adapter(params[keys[key]], value, group))
    whole = lambda: {k: gather_adapter(params[n], group).clone() for k, n in keys.items()}  # noqa: E731
    out = dict(logprobs=learner.forward_logprobs(tokens)["logprobs"], count=adapter_count(params, group),
               stage=learner.groups.pp_rank)
    rows = torch.arange(tokens.shape[0]).chunk(learner.layout.dp)[learner.groups.dp_rank]
    mask = torch.ones(tokens.shape[0], tokens.shape[1] - 1)
    loss = make_sft_loss(mask[rows], mask.sum().item())
    learner.train_step(tokens[rows], loss, lr=0.0)
    out["grads"] = {k: gather_adapter(params[n], group, params[n].main_grad).clone() for k, n in keys.items()}
    adapted = adapted_hf_names(learner.adapter.tensor_maps(learner.spec), learner.lora_weights)
    out["sent"] = dict(iter_hf_tensors(learner, only=adapted))
    save_adapter(path / "start", learner, lora, model_dir)
    learner.train_step(tokens[rows], loss)  # scheduled: the step counts, so the save holds the Adam state
    out["saved_logprobs"] = learner.forward_logprobs(tokens)["logprobs"]
    save_adapter(path / "step2", learner, lora, model_dir)  # with the Adam state
    learner.train_step(tokens[rows], loss)
    out["after_step"] = whole()
    torch.distributed.barrier()
    load_adapter(path / "step2", learner, model_dir)
    out["loaded_logprobs"] = learner.forward_logprobs(tokens)["logprobs"]
    learner.train_step(tokens[rows], loss)
    out["after_resume"] = whole()
    return out

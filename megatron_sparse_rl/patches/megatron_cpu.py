"""CPU shims for Megatron-Core 0.16.1, so that its real GPTModel/MoE/optimizer/dist-checkpointing code runs
on a machine without CUDA (tests, the demo, development laptops).

Each shim covers one place where Megatron-Core assumes CUDA. `apply()` installs all of them; it checks the
upstream version it was written for, is idempotent, and is a no-op when CUDA is available (except
`megatron_mla_tp`, an upstream bug fix installed on every machine). Entry points call it explicitly (never at
import).
"""
from __future__ import annotations

import contextlib
import functools
import logging

import torch

from megatron_sparse_rl.patches import megatron_dsa_hadamard, megatron_mla_tp

log = logging.getLogger(__name__)

MEGATRON_VERSION = "0.16.1"
_APPLIED: set[str] = set()


def _once(name):
    def deco(fn):
        def wrapper():
            if name in _APPLIED:
                return
            fn()
            _APPLIED.add(name)
        wrapper.__doc__ = fn.__doc__
        wrapper.__name__ = fn.__name__
        return wrapper
    return deco


@_once("current_device")
def patch_current_device() -> None:
    """`torch.cuda.current_device()` is used as the device of every parameter, buffer and scratch tensor
    Megatron creates; without CUDA it raises. Return the CPU device instead."""
    torch.cuda.current_device = lambda: torch.device("cpu")


class CpuRNGStatesTracker:
    """Drop-in for Megatron's CudaRNGStatesTracker keeping named CPU generator states.

    Megatron forks named RNG states (data-parallel, tensor-parallel, expert-parallel) around dropout and
    weight init; its tracker stores CUDA generator states. This one stores CPU states with the same API.
    """

    def __init__(self, use_cudagraphable_rng=False, is_inference_rng_tracker=False):
        self.use_cudagraphable_rng = False
        self.is_inference_rng_tracker = is_inference_rng_tracker
        self.reset()

    def is_initialized(self):
        return self._is_initialized

    def reset(self):
        self._is_initialized = False
        self.states_ = {}
        self.seeds_ = set()
        self._current_state_name = "default-rng"

    def get_states(self):
        return dict(self.states_)

    def set_states(self, states):
        self._is_initialized = True
        self.states_ = states

    def add(self, name, seed):
        self._is_initialized = True
        if seed in self.seeds_:
            raise RuntimeError(f"seed {seed} already exists")
        if name in self.states_:
            raise RuntimeError(f"rng state {name} already exists")
        self.seeds_.add(seed)
        gen = torch.Generator(device="cpu")
        gen.manual_seed(seed)
        self.states_[name] = gen.get_state()

    @contextlib.contextmanager
    def fork(self, name="model-parallel-rng"):
        if name not in self.states_:
            raise RuntimeError(f"rng state {name} is not added")
        orig = torch.get_rng_state()
        orig_name = self._current_state_name
        if orig_name != "default-rng":
            self.states_[orig_name] = orig
        torch.set_rng_state(self.states_[name])
        self._current_state_name = name
        try:
            yield
        finally:
            self.states_[name] = torch.get_rng_state()
            if orig_name != "default-rng":
                orig = self.states_[orig_name]
            torch.set_rng_state(orig)
            self._current_state_name = orig_name


@_once("rng_tracker")
def patch_rng_tracker() -> None:
    """Megatron's RNG tracker stores and forks CUDA generator states (`torch.cuda.get_rng_state`), and
    activation recompute saves/restores the CUDA generator; both fail without CUDA. Swap in a tracker class
    with the same API over CPU generator states, and let the recompute save/restore the CPU generator."""
    from megatron.core.tensor_parallel import random as mrandom

    mrandom.CudaRNGStatesTracker = CpuRNGStatesTracker
    mrandom.initialize_rng_tracker(force_reset=True)
    # Activation recompute saves and restores "the CUDA generator" around the recomputed forward; on the
    # host that generator is the CPU one.
    mrandom._get_cuda_rng_state = lambda *args, **kwargs: torch.get_rng_state()
    mrandom._set_cuda_rng_state = lambda state, *args, **kwargs: torch.set_rng_state(state)


def _cpu_dtoh_and_synchronize(self, point, tokens_per_expert=None):
    """CPU body of MoEAlltoAllTokenDispatcher._maybe_dtoh_and_synchronize: the same host conversions of the
    split sizes, with no CUDA side stream or event (everything already lives on the host)."""
    if not self.drop_and_pad and point == self.cuda_dtoh_point:
        def as_np(t):
            return t.numpy() if torch.is_tensor(t) else t

        self.input_splits = as_np(self.input_splits)
        self.output_splits = as_np(self.output_splits)
        self.output_splits_tp = as_np(self.output_splits_tp)
    return tokens_per_expert


@_once("alltoall_dispatcher")
def patch_alltoall_dispatcher() -> None:
    """The alltoall token dispatcher creates a CUDA stream in __init__ and copies split sizes device->host
    on it. Give it a placeholder stream and a host-only copy step."""
    from megatron.core.transformer.moe.token_dispatcher import MoEAlltoAllTokenDispatcher

    MoEAlltoAllTokenDispatcher.cuda_dtoh_stream = "cpu"  # any non-None value skips torch.cuda.Stream()
    MoEAlltoAllTokenDispatcher._maybe_dtoh_and_synchronize = _cpu_dtoh_and_synchronize


@functools.lru_cache(maxsize=16)
def _cpu_causal_mask(sq: int) -> torch.Tensor:
    return torch.triu(torch.ones(sq, sq, dtype=torch.bool), diagonal=1)


@_once("causal_mask")
def patch_causal_mask() -> None:
    """`get_default_causal_mask` builds its mask with a hard-coded `device="cuda"`. Build it on the host."""
    from megatron.core.fusions import fused_softmax
    from megatron.core.transformer import utils

    utils.get_default_causal_mask = _cpu_causal_mask
    fused_softmax.get_default_causal_mask = _cpu_causal_mask


def _host_pos_emb_on_this_cp_rank(pos_emb, seq_dim, cp_group):
    """Host body of rope_utils.get_pos_emb_on_this_cp_rank: the rotary table rows of this context-parallel rank's
    chunks (r and 2cp - 1 - r of 2 x cp), as upstream computes them."""
    if cp_group is None:
        raise ValueError("cp_group must be provided to get positional embedding per CP rank")
    cp_size, cp_rank = cp_group.size(), cp_group.rank()
    index = torch.tensor([cp_rank, 2 * cp_size - cp_rank - 1], device=pos_emb.device)
    pos_emb = pos_emb.view(*pos_emb.shape[:seq_dim], 2 * cp_size, -1, *pos_emb.shape[seq_dim + 1:])
    pos_emb = pos_emb.index_select(seq_dim, index)
    return pos_emb.view(*pos_emb.shape[:seq_dim], -1, *pos_emb.shape[seq_dim + 2:])


@_once("cp_rotary")
def patch_cp_rotary() -> None:
    """`get_pos_emb_on_this_cp_rank` (RoPE at context_parallel_size > 1) builds its chunk index in pinned memory
    and moves it with `.cuda()`; both fail without CUDA. Index on the table's own device."""
    from megatron.core.models.common.embeddings import rope_utils, rotary_pos_embedding, yarn_rotary_pos_embedding

    for module in (rope_utils, rotary_pos_embedding, yarn_rotary_pos_embedding):
        module.get_pos_emb_on_this_cp_rank = _host_pos_emb_on_this_cp_rank


@_once("te_general_gemm")
def patch_te_general_gemm() -> None:
    """moe_utils references `te_general_gemm` in the router GEMM but only defines it when Transformer Engine
    imports; without TE the router forward raises NameError. Define it as None (the torch path)."""
    from megatron.core.transformer.moe import moe_utils

    if not hasattr(moe_utils, "te_general_gemm"):
        moe_utils.te_general_gemm = None


class _HostTorch:
    """Stands in for the `torch` name inside a few Megatron modules: forwards everything to torch, but tensor
    factories asked for `device="cuda"` get the host device."""

    _FACTORIES = ("tensor", "zeros", "ones", "empty", "full", "arange", "zeros_like", "ones_like", "empty_like")

    def __getattr__(self, name):
        attr = getattr(torch, name)
        if name in self._FACTORIES:
            def factory(*args, **kwargs):
                dev = kwargs.get("device")
                if dev is not None and torch.device(dev).type == "cuda":
                    kwargs["device"] = "cpu"
                return attr(*args, **kwargs)
            return factory
        return attr


def _host_clip_grad_by_total_norm_fp32(parameters, max_norm, total_norm, use_decoupled_grad=False):
    """CPU body of clip_grads.clip_grad_by_total_norm_fp32: scale every grad by max_norm / total_norm when
    that is below 1 (upstream asserts CUDA tensor types first)."""
    if isinstance(parameters, torch.Tensor):
        parameters = [parameters]
    attr = "decoupled_grad" if use_decoupled_grad else "grad"
    grads = [getattr(p, attr).detach() for p in parameters if getattr(p, attr, None) is not None]
    clip_coeff = max_norm / (total_norm + 1.0e-6)
    if clip_coeff < 1.0:
        torch._foreach_mul_(grads, clip_coeff)


def _host_multi_tensor_l2_norm(chunk_size, noop_flag, tensor_lists, per_tensor, *args):
    """Host body of utils.local_multi_tensor_l2_norm (upstream returns its result on `device="cuda"`)."""
    norms = [torch.linalg.vector_norm(t.float()) for tl in tensor_lists for t in tl]
    total = torch.linalg.vector_norm(torch.stack(norms)) if norms else torch.zeros(())
    return total.reshape(1), None


def _foreach_l2_norm(chunk_size, noop_flag, tensor_lists, per_tensor, *args):
    """amp_C.multi_tensor_l2norm on the device with no host sync: one `torch._foreach_norm` over the grads, the
    norms stacked and normed. (Megatron's local stand-in builds `torch.tensor([...])` from the per-tensor norms and
    `float()`s the result: a device-to-host copy per gradient tensor and another for the total.)"""
    tensors = [t for tl in tensor_lists for t in tl]
    norms = torch._foreach_norm(tensors)
    return torch.linalg.vector_norm(torch.stack([n.float() for n in norms])).reshape(1), None


def _foreach_scale(chunk_size, noop_flag, tensor_lists, scale):
    """amp_C.multi_tensor_scale (`dst = src * scale`) as `torch._foreach_*` calls: a few kernels for the whole
    list, where Megatron's local stand-in launches one multiply and one copy per tensor."""
    src, dst = tensor_lists
    if all(a is b for a, b in zip(src, dst)):
        torch._foreach_mul_(dst, scale)
    else:
        torch._foreach_copy_(dst, torch._foreach_mul(src, scale) if scale != 1.0 else src)


@_once("grad_norm_no_host_sync")
def patch_grad_norm_no_host_sync() -> None:
    """On CUDA without Transformer Engine and Apex, Megatron falls back to local multi-tensor kernels whose l2 norm
    syncs with the host once per gradient tensor (clip_grads.local_multi_tensor_l2_norm). Use the `_foreach`
    bodies above for the grad norm, the clip scaling and the optimizer's main <-> model copies: one `.item()` per
    step remains (get_grad_norm_fp32's total). The CPU path (patch_optimizer_devices) has its own host bodies."""
    from megatron.core.optimizer import clip_grads
    from megatron.core.optimizer import optimizer as moptimizer

    if clip_grads.multi_tensor_applier.__module__ != "megatron.core.utils":  # TE or Apex kernels: nothing to do
        return
    clip_grads.l2_norm_impl = _foreach_l2_norm
    clip_grads.multi_tensor_scale_impl = _foreach_scale
    moptimizer.multi_tensor_scale_impl = _foreach_scale


@_once("optimizer_devices")
def patch_optimizer_devices() -> None:
    """The optimizer, grad scaler, clip-grad and grad-buffer modules create scalars with `device='cuda'`
    literals, and grad clipping asserts `torch.cuda.FloatTensor` grads. Route those factories to the host
    and use a host clip-by-norm."""
    from megatron.core.distributed import finalize_model_grads, param_and_grad_buffer
    from megatron.core.pipeline_parallel import schedules
    from megatron.core.optimizer import clip_grads, grad_scaler
    from megatron.core.optimizer import optimizer as moptimizer

    for module in (moptimizer, clip_grads, grad_scaler, param_and_grad_buffer, schedules, finalize_model_grads):
        module.torch = _HostTorch()
    clip_grads.clip_grad_by_total_norm_fp32 = _host_clip_grad_by_total_norm_fp32
    if clip_grads.multi_tensor_applier.__module__ == "megatron.core.utils":  # no TE / apex kernels
        clip_grads.l2_norm_impl = _host_multi_tensor_l2_norm
    moptimizer.clip_grad_by_total_norm_fp32 = _host_clip_grad_by_total_norm_fp32


def _torch_norm_new(cls, config, hidden_size, eps=1e-5, persist_layer_norm=False, zero_centered_gamma=False,
                    normalization="LayerNorm"):
    if config.layernorm_zero_centered_gamma or config.persist_layer_norm or config.memory_efficient_layer_norm:
        raise ValueError("torch norms support neither zero-centered gamma, persist_layer_norm nor "
                         "memory_efficient_layer_norm")
    norm_cls = {"LayerNorm": torch.nn.LayerNorm, "RMSNorm": torch.nn.RMSNorm}.get(config.normalization)
    if norm_cls is None:
        raise ValueError(f"normalization {config.normalization!r} is not supported by torch norms")
    norm = norm_cls(normalized_shape=hidden_size, eps=eps, dtype=config.params_dtype)
    for p in norm.parameters():
        # finalize_model_grads all-reduces these over the TP group: each rank saw a different sequence chunk
        p.sequence_parallel = config.sequence_parallel
    return norm


@_once("torch_norm_sequence_parallel")
def patch_torch_norm_sequence_parallel() -> None:
    """Without Apex/TE, Megatron's `WrappedTorchNorm` refuses sequence parallelism, which Megatron requires
    for MoE training under TP. A norm needs nothing special under SP except marking its weights so their
    grads are all-reduced across the TP group; build the same torch norm and mark them."""
    from megatron.core.transformer.torch_norm import WrappedTorchNorm

    WrappedTorchNorm.__new__ = _torch_norm_new


@_once("dist_checkpointing")
def patch_dist_checkpointing() -> None:
    """dist_checkpointing calls `torch.cuda.synchronize()` before writing and builds exchange/verification
    buffers with `device="cuda"`. Without CUDA there is nothing to synchronise: make it a no-op, and route
    those buffers to the host."""
    from megatron.core.dist_checkpointing import exchange_utils
    from megatron.core.dist_checkpointing.strategies import async_utils, state_dict_saver

    torch.cuda.synchronize = lambda device=None: None
    for module in (exchange_utils, async_utils, state_dict_saver):
        module.torch = _HostTorch()


_CUDA_TYPE_NAMES = {"torch.FloatTensor": "torch.cuda.FloatTensor", "torch.HalfTensor": "torch.cuda.HalfTensor",
                    "torch.BFloat16Tensor": "torch.cuda.BFloat16Tensor"}


@contextlib.contextmanager
def _host_types_read_as_cuda():
    """While open, `tensor.type()` (no arguments) names a host float tensor as its CUDA type; conversions
    (`tensor.type(dtype)`) are untouched."""
    original = torch.Tensor.type

    def type_(self, dtype=None, non_blocking=False, **kwargs):
        if dtype is None and not kwargs:
            name = original(self)
            return _CUDA_TYPE_NAMES.get(name, name)
        return original(self, dtype, non_blocking, **kwargs)

    torch.Tensor.type = type_
    try:
        yield
    finally:
        torch.Tensor.type = original


@_once("mixed_precision_optimizer")
def patch_mixed_precision_optimizer() -> None:
    """The bf16/fp16 optimizer (fp32 main copies of half-precision parameters) sorts parameters by
    `param.type()` against CUDA type names and raises TypeError for host tensors ("Wrapped parameters must be one
    of torch.cuda.FloatTensor, ..."), so a bf16 learner cannot be built without CUDA. Run its constructor with
    host float tensors named as their CUDA types; the rest of it is device-agnostic."""
    from megatron.core.optimizer.optimizer import Float16OptimizerWithFloat16Params

    original = Float16OptimizerWithFloat16Params.__init__

    @functools.wraps(original)
    def __init__(self, *args, **kwargs):
        with _host_types_read_as_cuda():
            original(self, *args, **kwargs)

    Float16OptimizerWithFloat16Params.__init__ = __init__


def apply() -> None:
    """Install the shims this machine needs: the Transformer-Engine-absent one when TE is missing, and the
    CPU ones when CUDA is missing. Idempotent."""
    import megatron.core

    from megatron_sparse_rl._optional import has_te

    version = megatron.core.__version__
    if version != MEGATRON_VERSION:
        raise RuntimeError(
            f"megatron_sparse_rl's CPU shims were written for megatron-core {MEGATRON_VERSION}, "
            f"found {version}; install megatron-core=={MEGATRON_VERSION}"
        )
    megatron_mla_tp.apply()  # MLA's shared RoPE key gradient at tp > 1 on the local spec, TE or not
    if not has_te():
        from megatron_sparse_rl.patches import megatron_mla

        patch_te_general_gemm()
        patch_torch_norm_sequence_parallel()
        megatron_mla.apply()
    if torch.cuda.is_available():
        patch_grad_norm_no_host_sync()
        return
    patch_current_device()
    patch_rng_tracker()
    patch_alltoall_dispatcher()
    patch_causal_mask()
    patch_cp_rotary()
    patch_optimizer_devices()
    patch_mixed_precision_optimizer()
    patch_dist_checkpointing()
    megatron_dsa_hadamard.apply()  # DSA's indexer rotation: a torch transform, and fp32 allowed on CPU

"""LoRA: the linears a model can adapt and their adapter sizes (targets.py); adapters on Megatron's linears
(layers.py, imported from there: it needs the model adapters); adapter checkpoints in PEFT's format (checkpoint.py).
docs/lora.md says what exists.

    from megatron_sparse_rl.lora import ALL_LINEAR, adapter_params, lora_linears, resolve_targets
"""
from megatron_sparse_rl.lora.targets import ALL_LINEAR, AdapterCount, LoraLinear, adapter_params, config_problems, \
    lora_linears, resolve_targets, target_names

__all__ = ["ALL_LINEAR", "AdapterCount", "LoraLinear", "adapter_params", "config_problems", "lora_linears",
           "resolve_targets", "target_names"]

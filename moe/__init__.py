"""MoE routing machinery, importable on its own: route recording, compact route storage, replay into
Megatron-Core's RouterReplay (R2/R3), and routing agreement statistics."""

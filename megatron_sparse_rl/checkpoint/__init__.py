"""Checkpoint conversion between Hugging Face safetensors and Megatron-Core torch_dist (convert.py, `msrl convert`),
built on the learner's model shards (shard.py, gather.py) and the file formats of formats/. See docs/conversion.md."""

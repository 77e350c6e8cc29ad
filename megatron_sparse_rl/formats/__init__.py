"""Checkpoint files as they lie on disk, read and written without running code from them: Hugging Face
safetensors read lazily (hf_io.py; block-wise fp8 dequantised on read, fp8.py, which also quantises for fp8
rollouts) and written streaming (hf_writer.py), the conversion manifest (manifest.py), and the pickles of a torch
checkpoint read only through allowlists (safe_load.py). The learner's checkpoints (learner/), the conversion
(checkpoint/) and the patched torch_dist load (patches/) all read and write through these; nothing here builds a
model or joins a world."""

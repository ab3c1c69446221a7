"""graphrt.core: device-neutral batch, KV cache, models, runners, engine and CLI.

Importing this package imports no device library (torch_npu, triton,
intel_extension_for_pytorch); devices load theirs only when selected.
"""

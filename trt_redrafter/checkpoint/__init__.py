"""The artifacts: read HF Llama/Vicuna and Apple drafter directories, shard them by TensorRT-LLM's TP rules, write (or
read back) TensorRT-LLM ReDrafter checkpoints, and the schemas of both files this project writes, which the builders,
the runtime, serving and bench all read from here.

Modules: `hf` and `drafter` (readers), `sharding` (pure TP transforms and their inverses), `trtllm_config`
(a checkpoint's config.json as TensorRT-LLM writes it; `parse_checkpoint_config` for runtimes), `engine_config` (an
engine directory's config.json, shaped like TensorRT-LLM's; BACKENDS), `convert` (the pipeline), `tiny` (a tiny
random pair for tests).
"""

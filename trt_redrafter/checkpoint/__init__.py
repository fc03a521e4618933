"""Checkpoint conversion: read HF Llama/Vicuna and Apple drafter directories, shard them by TensorRT-LLM's TP rules,
and write (or read back) TensorRT-LLM ReDrafter checkpoints.

Modules: `hf` and `drafter` (readers), `sharding` (pure TP transforms and their inverses), `trtllm_config`
(config.json as TensorRT-LLM writes it; `parse_checkpoint_config` for runtimes), `convert` (the pipeline),
`tiny` (a tiny random pair for tests).
"""

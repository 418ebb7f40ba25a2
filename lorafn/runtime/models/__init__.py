"""Model implementations (the Llama family: Llama 2/3, Mistral, Qwen2, SmolLM2)."""

from lorafn.runtime.models.llama import ForwardBatch, LlamaModel, PrefillSpan

__all__ = ["ForwardBatch", "LlamaModel", "PrefillSpan"]

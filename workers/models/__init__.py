"""Model definitions; `ARCHITECTURES` lists the supported config.json architectures."""

from .llama import (
    ARCHITECTURES,
    LlamaForCausalLM,
    ModelArgs,
    build_model,
    parse_model_args,
)

__all__ = ["ARCHITECTURES", "LlamaForCausalLM", "ModelArgs", "build_model", "parse_model_args"]

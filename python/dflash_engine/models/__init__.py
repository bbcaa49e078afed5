"""Model definitions (targets, DFlash draft), configs and the safetensors loader."""
from .config import DraftConfig, ModelConfig, validate_draft_against_target
from .dflash import DFlashDraftModel
from .llama import LlamaForCausalLM
from .loader import load_draft
from .qwen3 import Qwen3ForCausalLM
from .targets import load_target

__all__ = [
    "DFlashDraftModel",
    "DraftConfig",
    "LlamaForCausalLM",
    "ModelConfig",
    "Qwen3ForCausalLM",
    "load_draft",
    "load_target",
    "validate_draft_against_target",
]

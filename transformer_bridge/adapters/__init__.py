"""Architecture adapters: one declarative record per HF family.

Open this folder to add a family: one small declarative file and a test. Adapters are data and import nothing else
of the package; `sites`, `config` and the core read them.
"""

from ..versions import in_range, installed
from .base import Adapter
from .deepseek import DEEPSEEK_V3
from .gemma import GEMMA, GEMMA2, GEMMA3, VAULTGEMMA
from .glm import GLM, GLM4
from .gpt2 import GPT2, GPT_BIGCODE, GPT_NEO
from .gpt_neox import GPT_NEOX, PERSIMMON
from .gpt_oss import GPT_OSS
from .granitemoe import GRANITEMOE, GRANITEMOE_BEFORE_5_21
from .hybrid import BAMBA, JAMBA, JAMBA_BEFORE_5_21, LFM2, NEMOTRON_H
from .layernorm_rotary import NEMOTRON, OLMO, STABLELM, STARCODER2
from .llama import APERTUS, ARCEE, GRANITE, HUNYUAN, LLAMA, QWEN3
from .llama4 import LLAMA4
from .mamba import FALCON_MAMBA, MAMBA, MAMBA2
from .mixtral import MIXTRAL, OLMOE, QWEN2_MOE, QWEN3_MOE
from .opt import OPT
from .parallel import COHERE, FALCON, GPTJ, GPTJ_BEFORE_5_24, PHI
from .phi3 import PHI3
from .post_norm import EXAONE4, OLMO2
from .variants import COHERE2, FLEX_OLMO, GLM4_MOE, JAIS2, LLAMA_NAMED, NANOCHAT, SARVAM_MLA, YOUTU

ADAPTERS: tuple[Adapter, ...] = (
    GPT2, LLAMA, QWEN3, GEMMA2, GPT_NEOX, PHI3, OPT,
    GEMMA, GEMMA3, GLM, GLM4, STABLELM, STARCODER2, OLMO, NEMOTRON, HUNYUAN, ARCEE, APERTUS,
    PHI, COHERE, GPTJ, GPTJ_BEFORE_5_24, FALCON, OLMO2, EXAONE4, GPT_BIGCODE, GPT_NEO, GRANITE,
    VAULTGEMMA, PERSIMMON,
)  # fmt: skip
ADAPTERS += (MIXTRAL, QWEN2_MOE, QWEN3_MOE, OLMOE, GPT_OSS, LLAMA4, DEEPSEEK_V3)  # mixture of experts
ADAPTERS += (GRANITEMOE, GRANITEMOE_BEFORE_5_21)  # mixture of experts: the router's output order per release
ADAPTERS += (LLAMA_NAMED, COHERE2, JAIS2, FLEX_OLMO, GLM4_MOE, SARVAM_MLA, YOUTU)  # known layouts, other names
ADAPTERS += (NANOCHAT,)  # one norm module for the embedding and the final norm
ADAPTERS += (MAMBA, FALCON_MAMBA, MAMBA2)  # state space
ADAPTERS += (BAMBA, JAMBA, JAMBA_BEFORE_5_21, LFM2, NEMOTRON_H)  # hybrids: attention and state-space / conv layers
SUPPORTED_MODEL_TYPES: tuple[str, ...] = tuple(dict.fromkeys(t for a in ADAPTERS for t in a.model_types))


class UnsupportedArchitectureError(ValueError):
    """The model's family has no adapter."""


def adapter_for(model_type: str) -> Adapter:
    """The adapter for a ``config.model_type`` on the installed transformers release; raises
    `UnsupportedArchitectureError` otherwise.

    Example:
        >>> adapter_for("gpt2").embed
        'transformer.wte'
    """
    known = [a for a in ADAPTERS if model_type in a.model_types]
    for adapter in known:
        if in_range(adapter.transformers):
            return adapter
    if known:
        ranges = ", ".join(a.transformers or "any" for a in known)
        raise UnsupportedArchitectureError(
            f"config.model_type={model_type!r} has adapters for transformers {ranges}, none for the installed "
            f"{installed()}. For this family install transformers {ranges}."
        )
    raise UnsupportedArchitectureError(
        f"Unsupported architecture: config.model_type={model_type!r}. Supported families: "
        f"{', '.join(SUPPORTED_MODEL_TYPES)}. Adding one is a short file in transformer_bridge/adapters/."
    )


__all__ = ["ADAPTERS", "SUPPORTED_MODEL_TYPES", "Adapter", "UnsupportedArchitectureError", "adapter_for"]

"""Model types transformers builds with the class of a family the whole per-family set covers (EXAONE 3, InternLM 3,
IQuest-Coder as ``LlamaForCausalLM``; Sarvam-MLA as ``DeepseekV3ForCausalLM``; Sarvam-MoE as ``Glm4MoeForCausalLM``).

The same HF code runs, so the family's tests hold for them; these check that the bridge serves each under its own
``model_type``: the same class and the same points as its twin, forward, cache and greedy generation against HF.
"""

import pytest
import torch
from conftest import ALIAS_CONFIGS, V, adapted_config, char_tokenizer, make_bridge
from transformers import AutoModelForCausalLM

from transformer_bridge import TransformerBridge

TOKENS = torch.randint(4, V, (2, 6), generator=torch.Generator().manual_seed(3))


@pytest.mark.parametrize("model_type", list(ALIAS_CONFIGS))
def test_alias_runs_its_twins_code_exactly(model_type):
    twin_family, config = ALIAS_CONFIGS[model_type]
    config = adapted_config(model_type, config)
    torch.manual_seed(0)
    hf = AutoModelForCausalLM.from_config(config).eval()
    model = TransformerBridge(hf, char_tokenizer())
    twin = make_bridge(twin_family)
    assert type(hf) is type(twin.hf_model) and model.cfg.model_type == model_type
    assert list(model.hook_dict) == list(twin.hook_dict)
    with torch.no_grad():
        theirs = hf(TOKENS).logits
        assert torch.equal(model(TOKENS), theirs)
        logits, cache = model.run_with_cache(TOKENS)
    every = {n for n in model.hook_dict if not n.endswith(".attn.hook_result")}  # head results on demand (TL's default)
    assert torch.equal(logits, theirs) and set(cache) == every
    prompts = TOKENS[:, :4]
    ours = model.generate(prompts, max_new_tokens=5, temperature=0, stop_at_eos=False)
    assert torch.equal(ours, hf.generate(prompts, max_new_tokens=5, do_sample=False, eos_token_id=None))

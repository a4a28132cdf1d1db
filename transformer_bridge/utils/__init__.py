"""What TransformerLens users import from ``transformer_lens.utils`` (``transformer_lens.utilities`` in 4.x),
with TransformerLens 4.3's signatures and behaviour on the bridge's inputs.

Which of TransformerLens' names are here, which are not and why, and how each was checked against
TransformerLens itself: docs/transformerlens.md ("utils").

- hook names: `get_act_name`
- tensors: `to_numpy`, `get_corner`, `remove_batch_dim`, `transpose`, `is_square`, `is_lower_triangular`,
  `check_structure`, `get_offset_position_ids`, `get_cumsum_along_dim`, `repeat_along_head_dimension`,
  `filter_dict_by_prefix`, `composition_scores`, `get_matrix_corner`, `Slice` / `SliceInput`
- language models: `lm_cross_entropy_loss`, `lm_accuracy`, `sample_logits`, `logits_to_df`, `test_prompt`
- tokens: `get_attention_mask`, `get_tokens_with_bos_removed`, `get_input_with_manually_prepended_bos`,
  `get_tokenizer_with_bos`, `tokenize_and_concatenate`, `keep_single_column`
- activations: `gelu_new`, `gelu_fast`, `solu`, `SUPPORTED_ACTIVATIONS`, `ActivationFunction`, `apply_softcap`,
  `softcap_enabled`, `SOFTCAP_DISABLED`
- defaults and attributes: `USE_DEFAULT_VALUE`, `override_or_use_default_value`, `LocallyOverridenDefaults`,
  `get_nested_attr`, `set_nested_attr`, `temporarily_swap_parameter`, `get_device`, `is_library_available`
- statistics: `derive_generator`, `standard_error`, `bootstrap_ci`, `sign_flip_permutation_pvalue`,
  `success_rate_ci`, `SuccessRateInterval`

It may import only `hooks` (the name grammar) and the top-level `checks` / `optional`, so every other folder may use
it.
"""

from .act_name import get_act_name
from .activations import (
    SOFTCAP_DISABLED,
    SUPPORTED_ACTIVATIONS,
    ActivationFunction,
    apply_softcap,
    gelu_fast,
    gelu_new,
    softcap_enabled,
    solu,
)
from .attributes import (
    USE_DEFAULT_VALUE,
    LocallyOverridenDefaults,
    get_device,
    get_nested_attr,
    is_library_available,
    override_or_use_default_value,
    set_nested_attr,
    temporarily_swap_parameter,
)
from .lm import lm_accuracy, lm_cross_entropy_loss, logits_to_df, sample_logits, test_prompt
from .slicing import Slice, SliceInput
from .statistics import (
    SuccessRateInterval,
    bootstrap_ci,
    derive_generator,
    sign_flip_permutation_pvalue,
    standard_error,
    success_rate_ci,
)
from .tensors import (
    check_structure,
    composition_scores,
    filter_dict_by_prefix,
    get_corner,
    get_cumsum_along_dim,
    get_matrix_corner,
    get_offset_position_ids,
    is_lower_triangular,
    is_square,
    remove_batch_dim,
    repeat_along_head_dimension,
    to_numpy,
    transpose,
)
from .tokenization import (
    get_attention_mask,
    get_input_with_manually_prepended_bos,
    get_tokenizer_with_bos,
    get_tokens_with_bos_removed,
    keep_single_column,
    tokenize_and_concatenate,
)

__all__ = [
    "SOFTCAP_DISABLED",
    "SUPPORTED_ACTIVATIONS",
    "USE_DEFAULT_VALUE",
    "ActivationFunction",
    "LocallyOverridenDefaults",
    "Slice",
    "SliceInput",
    "SuccessRateInterval",
    "apply_softcap",
    "bootstrap_ci",
    "check_structure",
    "composition_scores",
    "derive_generator",
    "filter_dict_by_prefix",
    "gelu_fast",
    "gelu_new",
    "get_act_name",
    "get_attention_mask",
    "get_corner",
    "get_cumsum_along_dim",
    "get_device",
    "get_input_with_manually_prepended_bos",
    "get_matrix_corner",
    "get_nested_attr",
    "get_offset_position_ids",
    "get_tokenizer_with_bos",
    "get_tokens_with_bos_removed",
    "is_library_available",
    "is_lower_triangular",
    "is_square",
    "keep_single_column",
    "lm_accuracy",
    "lm_cross_entropy_loss",
    "logits_to_df",
    "override_or_use_default_value",
    "remove_batch_dim",
    "repeat_along_head_dimension",
    "sample_logits",
    "set_nested_attr",
    "sign_flip_permutation_pvalue",
    "softcap_enabled",
    "solu",
    "standard_error",
    "success_rate_ci",
    "temporarily_swap_parameter",
    "test_prompt",
    "to_numpy",
    "tokenize_and_concatenate",
    "transpose",
]

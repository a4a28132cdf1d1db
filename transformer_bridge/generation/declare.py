"""Every `generate` option, declared once: name, default, where the name comes from, what it does, the loops
that honour it, its command-line type, and (for logits processors) its implementation.

What is derived from `OPTIONS`: the Args section of `generate`'s docstring (`render_args`), the options
`generate_stream` refuses and why (`not_streamed`), the HF generation-config fields resolved as HF resolves
them (`CONFIG_FIELDS`), the processors and their order in the one token chooser (`sampler.build_sampler`),
the command line's flags (`cli/options.py`), and the option table of docs/generation.md (`markdown_table`).
`generate`'s signature is written out (so editors see it) and a test keeps it equal to `OPTIONS`: names,
order and defaults.

Adding an option: one `Option` here, plus its implementation in one place (a processor class in
``processors.py`` / ``hf_processors.py`` built by its entry in ``builders.BUILDERS``, a warper in
``sampling.warp_logits``, or the loop feature it switches), plus the parameter in `generate`'s signature (the test
names what is missing). This module imports no torch: the command line reads it for its flags.

Paths (the loops and features an option combines with): ``eager`` (the plain KV-cached loop), ``compiled``
(``compile=True`` / a static cache), ``stream`` (`generate_stream`), ``lookup`` (``prompt_lookup_num_tokens``),
``assistant`` (``assistant_model``), ``controller`` (``controller=``), ``beams`` (``num_beams > 1``).
"""

import textwrap
from dataclasses import dataclass
from typing import Any

PATHS = ("eager", "compiled", "stream", "lookup", "assistant", "controller", "beams")
ALL = frozenset(PATHS)


@dataclass(frozen=True)
class Option:
    """One `generate` keyword.

    Attributes:
        name, default: as in `generate`'s signature.
        doc: what it does (the docstring's Args entry and the docs table).
        group: the heading it is listed under.
        source: where the name and meaning come from: ``hf`` (``model.generate`` / ``GenerationConfig``),
            ``tl`` (TransformerLens' ``generate``), ``openai``, ``bridge``.
        config: a ``GenerationConfig`` field, resolved as HF does: the keyword, else the caller's
            ``generation_config``, else the model's, else ``fallback`` (HF's default when nothing sets it).
        alias_of: another name for that option (both are accepted; passing both, different, raises).
        paths: where it is honoured (see the module docstring); elsewhere it is refused, with ``elsewhere``.
        elsewhere: what to do instead on the paths it lacks.
        cli: its command-line type (`cli/options.py`): ``int``, ``float``, ``bool``, ``str``, ``ints`` (a list of
            token ids), ``strs``, ``json``; None: no flag (tensors, callables, objects).
        order: for a logits processor (its builder is ``builders.BUILDERS[name]``): its place in HF's processor
            order; 0 for other options.
    """

    name: str
    default: Any
    doc: str
    group: str
    source: str = "hf"
    config: bool = False
    fallback: Any = None
    alias_of: str | None = None
    paths: frozenset[str] = ALL
    elsewhere: str = ""
    cli: str | None = None
    order: int = 0


_PROMPT, _LENGTH, _CACHE = "prompt", "lengths", "cache"
_PROCESS, _SAMPLE, _STOP = "logits processors", "sampling", "stopping"
_SEARCH, _OUT, _CONTROL, _FAST = "rows and beam search", "outputs", "controllers and speculative decoding", "speed"
_STREAM_RECORDS = "a stream yields tokens, not records; call `generate(..., return_dict=True)` for them."
_STREAM_CACHE = "call `generate(..., return_cache=True)` for the cache of a generation."
_NO_BEAM_STREAM = "beam search cannot stream (the best beam is known only at the end); call `generate`."
_NO_RECORDS_BEAMS = "beam search records `logprobs` and `sequences_scores` only."
_NO_SPEC = "speculative decoding runs in `generate`; call `generate(..., prompt_lookup_num_tokens=k)`."
_NO_STATIC = "the static-cache (compiled) loop runs in `generate`; call `generate(..., compile=True)`."
_NO_CONTROL = "a controller may backtrack tokens a stream has already yielded; call `generate(..., controller=...)`."
_NOT_STREAM = ALL - {"stream"}
_SPEC_PATHS = ALL - {"stream", "beams"}

OPTIONS: tuple[Option, ...] = (
    # -- the prompt ------------------------------------------------------------------------------------------------
    Option("input", None, "text, a list of texts (left-padded for you), token ids ``[batch, pos]``, a tokenizer's "
           "output, or embeddings ``[batch, pos, d_model]`` (a float tensor: HF's ``inputs_embeds``; processors "
           "and stopping rules then see the generated tokens only, as in HF); none at all starts from BOS (as HF).",
           _PROMPT, source="tl"),
    Option("max_new_tokens", None, "tokens to generate per row at most (prompt + this must fit the context). "
           "Default: the configs', else 20 (fewer if the context ends first).", _LENGTH, config=True, cli="int"),
    Option("inputs", None, "HF's name for ``input``.", _PROMPT, alias_of="input"),
    Option("input_ids", None, "HF's name for token ``input``.", _PROMPT, alias_of="input"),
    Option("attention_mask", None, "``[batch, pos]`` with token input: 0 marks padding. Right-padded rows (a "
           "tokenizer's default) are moved to left padding, which gives each row its tokens alone. Without it, "
           "bare ids get HF ``generate``'s mask (pad ids are padding when the pad id is not an EOS id), and its "
           "warning when some rows end in the pad id (right padding).", _PROMPT),
    Option("token_type_ids", None, "accepted (and ignored) only when all 0: these models have no segments.",
           _PROMPT),
    Option("generation_config", None, "an HF ``GenerationConfig``; its set fields override the model's, and "
           "keywords override it. Fields this loop does not implement raise (the model's own only warn).", _PROMPT),
    # -- lengths ---------------------------------------------------------------------------------------------------
    Option("max_length", None, "HF's total length (the padded prompt counts); ``max_new_tokens`` wins, with "
           "HF's warning.", _LENGTH, config=True, cli="int"),
    Option("min_new_tokens", None, "EOS is banned until this many tokens were generated.", _LENGTH, config=True,
           cli="int", order=60),
    Option("min_length", None, "HF's total minimum length (the padded prompt counts); ``min_new_tokens`` wins.",
           _LENGTH, config=True, cli="int"),
    # -- cache -----------------------------------------------------------------------------------------------------
    Option("use_cache", None, "``False`` recomputes the whole sequence at each step (a slow reference).", _CACHE,
           config=True, paths=ALL - {"compiled", "lookup", "assistant"}, cli="bool",
           elsewhere="a static cache and speculative decoding need the KV cache."),
    Option("use_past_kv_cache", None, "TransformerLens' name for ``use_cache``.", _CACHE, source="tl",
           alias_of="use_cache", paths=ALL - {"compiled", "lookup", "assistant"},
           elsewhere="a static cache and speculative decoding need the KV cache."),
    # -- logits processors, in HF's order (`order`) -------------------------------------------------------------
    Option("logit_bias", None, "``{token: bias}`` added to those tokens' scores at every step (``-inf`` bans).",
           _PROCESS, source="openai", cli="json", order=10),
    Option("sequence_bias", None, "HF's ``{(token, ...): bias}`` (or ``[[[tokens], bias], ...]``): the bias is added "
           "to a sequence's last token when the rest of it ends the row.", _PROCESS, config=True, cli="json",
           order=11),
    Option("repetition_penalty", None, "HF's repetition penalty over prompt and generated tokens (padding never): "
           "> 1 discourages repeats.", _PROCESS, config=True, cli="float", order=20),
    Option("frequency_penalty", None, "OpenAI's: ``penalty * count`` off each token's score, counting generated "
           "tokens.", _PROCESS, source="openai", cli="float", order=30),
    Option("presence_penalty", None, "OpenAI's: ``penalty`` off the score of each token generated at least once.",
           _PROCESS, source="openai", cli="float", order=31),
    Option("no_repeat_ngram_size", None, "ban tokens that would repeat an n-gram of this size (prompt included).",
           _PROCESS, config=True, cli="int", order=40),
    Option("bad_words_ids", None, "token sequences never generated: ``[[42], [7, 9]]`` bans 42, and 9 after 7.",
           _PROCESS, config=True, cli="json", order=50),
    Option("forced_bos_token_id", None, "HF's: the token forced as the first generated one when the prompt is one "
           "token long.", _PROCESS, config=True, cli="int", order=70),
    Option("forced_eos_token_id", None, "HF's: the token (or tokens) forced at the last position ``max_new_tokens`` "
           "allows.", _PROCESS, config=True, cli="ints", order=71),
    Option("remove_invalid_values", None, "HF's: NaN scores become 0 and ±inf the dtype's extremes (a guard for "
           "numerically unstable models).", _PROCESS, config=True, cli="bool", order=72),
    Option("exponential_decay_length_penalty", None, "HF's ``(start_index, decay_factor)``: after ``start_index`` "
           "new tokens, EOS scores grow by ``decay_factor`` per token.", _PROCESS, config=True, cli="json",
           order=73),
    Option("suppress_tokens", None, "HF's: token ids whose scores are ``-inf`` at every step.", _PROCESS,
           config=True, cli="ints", order=74),
    Option("begin_suppress_tokens", None, "HF's: token ids suppressed at the first generated position only.",
           _PROCESS, config=True, cli="ints", order=75),
    Option("logits_processor", None, "HF ``LogitsProcessor`` objects (or any ``f(input_ids, scores) -> scores``), "
           "run after the processors above.", _PROCESS, order=80),
    Option("freq_penalty", None, "TransformerLens' penalty when sampling: ``freq_penalty * count`` off each "
           "token's temperature-scaled logit, counting prompt and generated tokens (padding never).", _PROCESS,
           source="tl", cli="float", order=90),
    Option("renormalize_logits", None, "HF's: the final scores (after the warpers) are log-softmaxed, so "
           "``output_scores`` are log-probabilities.", _PROCESS, config=True, cli="bool"),
    # -- sampling ----------------------------------------------------------------------------------------------------
    Option("do_sample", None, "sample instead of taking the argmax. ``None``: sample exactly when a sampling "
           "argument (``temperature``, ``top_k``, ``top_p``, ``min_p``, ``typical_p``, ``epsilon_cutoff``, "
           "``eta_cutoff``, ``freq_penalty``) is given, else as the generation configs say (HF's default: greedy). "
           "``temperature=0`` is always greedy.", _SAMPLE, config=True, cli="bool"),
    Option("temperature", None, "divide the scores by it before the other warpers (HF's default 1; 0: greedy).",
           _SAMPLE, config=True, cli="float"),
    Option("top_k", None, "keep the k best tokens (HF's default 50 when sampling; 0 disables it).", _SAMPLE,
           config=True, cli="int"),
    Option("top_p", None, "keep the smallest set of best tokens with probability mass >= top_p.", _SAMPLE,
           config=True, cli="float"),
    Option("min_p", None, "remove tokens with probability < min_p × the best token's.", _SAMPLE, config=True,
           cli="float"),
    Option("typical_p", None, "locally typical sampling: keep the tokens closest to the entropy up to this mass.",
           _SAMPLE, config=True, cli="float"),
    Option("epsilon_cutoff", None, "remove tokens with probability < epsilon_cutoff (truncation sampling; "
           "3e-4 to 9e-4 are typical).", _SAMPLE, config=True, cli="float"),
    Option("eta_cutoff", None, "eta sampling: remove tokens with probability < min(eta, √eta · exp(-entropy)).",
           _SAMPLE, config=True, cli="float"),
    Option("seed", None, "a per-call random source (the global RNG is untouched).", _SAMPLE, source="bridge",
           cli="int"),
    Option("generator", None, "a ``torch.Generator`` as the per-call random source.", _SAMPLE, source="bridge"),
    # -- stopping ----------------------------------------------------------------------------------------------------
    Option("eos_token_id", None, "int or list; default: the model's (generation config, config, tokenizer).",
           _STOP, config=True, cli="ints"),
    Option("stop_at_eos", None, "``False`` ignores EOS; ``True`` requires one (an error when no EOS id is "
           "known); default: stop at EOS when one is known.", _STOP, source="tl", cli="bool"),
    Option("pad_token_id", None, "fills finished rows; default: the generation config's, else "
           "``model.pad_token_id``.", _STOP, config=True, cli="int"),
    Option("stop_strings", None, "stop a row once its generated text contains one of them (decoded with "
           "``tokenizer``, default the bridge's).", _STOP, config=True, cli="strs"),
    Option("tokenizer", None, "HF's keyword: the tokenizer ``stop_strings`` are decoded with.", _STOP),
    Option("max_time", None, "seconds; rows still running then stop (finish reason ``max_time``).", _STOP,
           config=True, cli="float"),
    Option("stopping_criteria", None, "HF ``StoppingCriteria`` objects or ``f(input_ids, scores) -> bool[batch]``.",
           _STOP),
    # -- rows and beams ----------------------------------------------------------------------------------------------
    Option("num_return_sequences", None, "rows per prompt (beam search: the best beams, at most ``num_beams``).",
           _SEARCH, config=True, fallback=1, cli="int"),
    Option("num_beams", None, "beam search with this many beams, as HF's.", _SEARCH, config=True, fallback=1, cli="int",
           paths=ALL - {"stream", "lookup", "assistant", "compiled"},
           elsewhere=_NO_BEAM_STREAM + " Speculative decoding and the static cache decode one sequence per row."),
    Option("length_penalty", None, "beam search: scores are divided by length ** length_penalty.", _SEARCH,
           config=True, fallback=1.0, cli="float", paths=_NOT_STREAM, elsewhere=_NO_BEAM_STREAM),
    Option("early_stopping", None, "beam search: True, False or ``\"never\"`` (HF's meanings).", _SEARCH,
           config=True, fallback=False, cli="json", paths=_NOT_STREAM, elsewhere=_NO_BEAM_STREAM),
    # -- outputs -----------------------------------------------------------------------------------------------------
    Option("streamer", None, "an HF streamer (``TextStreamer``): gets the prompt, then each step's tokens.", _OUT,
           paths=ALL - {"stream", "beams", "controller"},
           elsewhere="`generate_stream` is the stream; beam search and controllers cannot stream (the best beam is "
           "known at the end; a controller may take tokens back)."),
    Option("verbose", False, "show a progress bar over decode steps.", _OUT, source="tl", cli="bool"),
    Option("return_type", "input", "``\"input\"``: text in → text out (prompt + completion), tokens in → tokens "
           "out, embeddings in → embeddings out; or force ``\"str\"``, ``\"tokens\"`` or ``\"embeds\"`` (the "
           "output's input embeddings, HF's ``inputs_embeds`` convention).", _OUT, source="tl", cli="str"),
    Option("return_dict", False, "return a `GenerationOutput` (sequences, mask, prompt lengths, finish reasons, "
           "per-step log-probabilities).", _OUT, source="bridge", paths=_NOT_STREAM, elsewhere=_STREAM_RECORDS),
    Option("return_dict_in_generate", None, "HF's ``return_dict``: the same `GenerationOutput`, with ``scores`` and "
           "``logits`` as HF lays them out (a tuple of ``[batch, d_vocab]`` per step).", _OUT, config=True,
           paths=_NOT_STREAM, elsewhere=_STREAM_RECORDS),
    Option("top_logprobs", 0, "with ``return_dict``: the k best alternatives per step.", _OUT, source="openai",
           paths=ALL - {"stream", "beams"}, elsewhere=_STREAM_RECORDS + " " + _NO_RECORDS_BEAMS),
    Option("output_logits", None, "with ``return_dict``: the raw logits ``[batch, new, d_vocab]``; alone "
           "(TransformerLens 4): the output of ``return_dict_in_generate=True``.", _OUT,
           config=True, paths=ALL - {"stream", "beams"}, elsewhere=_STREAM_RECORDS + " " + _NO_RECORDS_BEAMS),
    Option("output_scores", None, "with ``return_dict``: HF's ``scores`` (processed, and warped when sampling); "
           "alone: as ``output_logits``.",
           _OUT, config=True, paths=ALL - {"stream", "beams"}, elsewhere=_STREAM_RECORDS + " " + _NO_RECORDS_BEAMS),
    Option("return_input_tokens", False, "also return the prompt as fed to the model (left-padded ids, BOS "
           "handling done; or the embeddings): ``(output, input_tokens)``, ``(output, cache, input_tokens)`` with "
           "``return_cache``.", _OUT, source="tl", paths=_NOT_STREAM, elsewhere=_STREAM_RECORDS),
    Option("return_cache", False, "also return an `ActivationCache` of prompt + generated tokens: one extra "
           "forward under the active hooks, equal bitwise to ``run_with_cache`` on the output.", _OUT,
           source="bridge", paths=_NOT_STREAM, elsewhere=_STREAM_CACHE),
    Option("names_filter", None, "with ``return_cache``: which hook points, as in `run_with_cache`.", _OUT,
           source="bridge", paths=_NOT_STREAM, elsewhere=_STREAM_CACHE, cli="str"),
    Option("device", None, "with ``return_cache``: where the cache is stored.", _OUT, source="bridge",
           paths=_NOT_STREAM, elsewhere=_STREAM_CACHE),
    Option("prepend_bos", None, "for text input, as in `to_tokens`.", _PROMPT, source="tl", cli="bool"),
    Option("padding_side", None, "TransformerLens' keyword, accepted; generation always left-pads.", _PROMPT,
           source="tl"),
    # -- controllers and speculative decoding ------------------------------------------------------------------------
    Option("controller", None, "between forwards, decides each row's next tokens: an object with "
           "``mid_process(view) -> list[Branch]`` or a callable ``f(view)`` (or one per prompt); see docs/control.md.",
           _CONTROL, source="bridge", paths=_NOT_STREAM, elsewhere=_NO_CONTROL),
    Option("max_steps", None, "the forwards after the prompt a controlled generation may run (default 4 × "
           "``max_new_tokens``).", _CONTROL, source="bridge", paths=_NOT_STREAM, elsewhere=_NO_CONTROL, cli="int"),
    Option("prompt_lookup_num_tokens", None, "speculative decoding with drafts from the row itself (up to this many "
           "tokens that followed the latest earlier occurrence of its last n-gram); greedy tokens are the plain "
           "loop's, sampling keeps its distribution.", _CONTROL, paths=_SPEC_PATHS,
           elsewhere=_NO_SPEC, cli="int"),
    Option("assistant_model", None, "a bridge with the same vocabulary drafting ``num_assistant_tokens`` greedy "
           "tokens per round.", _CONTROL, paths=_SPEC_PATHS, elsewhere=_NO_SPEC),
    Option("num_assistant_tokens", None, "draft length of ``assistant_model`` (default 5; HF's config default of 20 "
           "is not read).", _CONTROL, source="bridge", paths=_SPEC_PATHS, elsewhere=_NO_SPEC),
    # -- speed -------------------------------------------------------------------------------------------------------
    Option("cache_implementation", "dynamic", "``\"static\"`` decodes over a preallocated KV cache, the host "
           "looking at finished rows only every few steps.", _FAST, paths=ALL - {"stream", "beams"},
           elsewhere=_NO_STATIC, cli="str"),
    Option("compile", False, "also compile the one-token decode step with ``torch.compile`` (implies a static "
           "cache), once per batch size and cache bucket; hooks and `steer` run inside it.", _FAST, source="bridge",
           paths=ALL - {"stream", "beams"}, elsewhere=_NO_STATIC, cli="bool"),
)  # fmt: skip

BY_NAME: dict[str, Option] = {o.name: o for o in OPTIONS}
# Options resolved as HF resolves a GenerationConfig field (keyword, caller's config, model's config, default).
CONFIG_FIELDS: tuple[str, ...] = tuple(o.name for o in OPTIONS if o.config)
# The logits processors, in HF's order.
PROCESSORS: tuple[Option, ...] = tuple(sorted((o for o in OPTIONS if o.order), key=lambda o: o.order))


def not_streamed() -> dict[str, str]:
    """``{option: why}`` for the options `generate_stream` refuses (their paths lack ``stream``)."""
    return {o.name: o.elsewhere for o in OPTIONS if "stream" not in o.paths}


def render_args(width: int = 108) -> str:
    """The Args section of `generate`'s docstring, one entry per option, grouped as declared."""
    lines: list[str] = []
    for option in OPTIONS:
        origin = {"tl": " (TransformerLens)", "openai": " (OpenAI)"}.get(option.source, "")
        text = f"{option.name}{origin}: {option.doc}"
        lines += textwrap.wrap(text, width, initial_indent="    ", subsequent_indent="        ")
    return "\n".join(lines)


def markdown_table() -> str:
    """The option table of docs/generation.md: option, default, source, GenerationConfig field, paths."""
    rows = ["| option | default | from | config field | not with | what it does |", "|---|---|---|:-:|---|---|"]
    for option in OPTIONS:
        missing = ", ".join(p for p in PATHS if p not in option.paths) or "—"
        doc = option.doc.replace("|", "\\|")
        rows.append(
            f"| `{option.name}` | `{option.default!r}` | {option.source} | {'✓' if option.config else ''} | "
            f"{missing} | {doc} |"
        )
    return "\n".join(rows)


__all__ = ["ALL", "BY_NAME", "CONFIG_FIELDS", "OPTIONS", "PATHS", "PROCESSORS", "Option",
           "markdown_table", "not_streamed", "render_args"]  # fmt: skip

"""TransformerLens' ``evals`` module: rough evaluations of a model, on the bridge.

``from transformer_lens import evals`` keeps working when ``transformer_lens`` becomes ``transformer_bridge``. The
evaluations that build their own data are here with TransformerLens 4.3's signatures and numbers: `sanity_check`
(the loss on one fixed paragraph), `induction_loss` (random tokens repeated twice, the loss on the repeat),
`IOIDataset` and `ioi_eval` (indirect-object identification from templates), and `evaluate_on_dataset` (the mean
loss over batches you load). Those that download a hub dataset (`make_wiki_data_loader` … `make_code_data_loader`,
`make_mmlu_data_loader`, `evaluate`, `mmlu_eval`) raise `DatasetDownloadError`, which says what to load with
``datasets`` and how to evaluate it here. ``device`` defaults to the model's device (TransformerLens: ``"cuda"``).

Example:
    >>> from transformer_bridge import evals
    >>> torch.manual_seed(0)
    >>> evals.induction_loss(model, batch_size=2, subseq_len=20)       # low on a model with induction heads
    >>> evals.ioi_eval(model, num_samples=20)                          # {"Logit Difference": ..., "Accuracy": ...}
"""

import random
from collections.abc import Iterable, Mapping
from typing import Any

import torch
from jaxtyping import Float
from torch import Tensor
from torch.utils.data import DataLoader, Dataset

from .checks import ArgumentValueError, check_int
from .utils import lm_cross_entropy_loss, override_or_use_default_value

__all__ = [
    "DATASET_LOADERS",
    "DATASET_NAMES",
    "MMLU_ANSWER_LETTERS",
    "MMLU_SUBJECTS",
    "DatasetDownloadError",
    "IOIDataset",
    "evaluate",
    "evaluate_on_dataset",
    "induction_loss",
    "ioi_eval",
    "make_code_data_loader",
    "make_mmlu_data_loader",
    "make_owt_data_loader",
    "make_pile_data_loader",
    "make_wiki_data_loader",
    "mmlu_eval",
    "sanity_check",
]

# The opening paragraph of Olah et al., "Zoom In: An Introduction to Circuits" (Distill, 2020), the passage
# TransformerLens' sanity check reads, so that the loss is the same number.
_ZOOM_IN = (
    "Many important transition points in the history of science have been moments when science 'zoomed in.' At "
    "these points, we develop a visualization or tool that allows us to see the world in a new level of detail, and "
    "a new field of science develops to study the world through this lens."
)


class DatasetDownloadError(RuntimeError):
    """An evaluation that needs a hub dataset: the bridge downloads nothing. The message names the dataset and how
    to run the same evaluation on data you load."""


def sanity_check(model: Any) -> Float[Tensor, ""]:
    """The model's mean next-token loss on a fixed paragraph (TransformerLens' quick check: below 5 is fine,
    above 7 something is wrong).

    Example:
        >>> float(sanity_check(model)) < 5
        True
    """
    return model(_ZOOM_IN, return_type="loss")


@torch.inference_mode()
def induction_loss(
    model: Any,
    tokenizer: Any = None,
    batch_size: int = 4,
    subseq_len: int = 384,
    prepend_bos: bool | None = None,
    device: str | torch.device | None = None,
) -> Float[Tensor, ""]:
    """Mean loss on the second copy of ``batch_size`` random sequences of ``subseq_len`` tokens, each repeated
    twice: low when the model has induction heads. Tokens are drawn from torch's global generator in
    ``[100, 20000)`` as in TransformerLens (capped at the vocabulary), so a seed gives TransformerLens' tokens;
    with ``prepend_bos`` (default ``model.cfg.default_prepend_bos``) the first token becomes BOS.

    Example:
        >>> torch.manual_seed(0)
        >>> induction_loss(model, batch_size=2, subseq_len=20)
    """
    check_int("batch_size", batch_size, minimum=1)
    check_int("subseq_len", subseq_len, minimum=1)
    device = model.device if device is None else device
    high = min(20000, model.cfg.d_vocab)
    first = torch.randint(min(100, high - 1), high, (batch_size, subseq_len)).to(device)
    tokens = first.repeat(1, 2)
    if override_or_use_default_value(model.cfg.default_prepend_bos, override=prepend_bos):
        bos = (tokenizer if tokenizer is not None else model.tokenizer).bos_token_id
        if bos is None:
            raise ArgumentValueError(
                "`prepend_bos`: the tokenizer has no BOS token; pass prepend_bos=False (or set "
                "model.cfg.default_prepend_bos = False)."
            )
        tokens[:, 0] = bos
    logits = model(tokens, return_type="logits")
    per_token = lm_cross_entropy_loss(logits, tokens, per_token=True)
    return per_token[:, subseq_len + 1 :].mean()


@torch.inference_mode()
def evaluate_on_dataset(
    model: Any, data_loader: Iterable[Mapping[str, Tensor]], truncate: int = 100, device: Any = None
) -> float:
    """Mean of the model's loss over the batches of ``data_loader`` (dicts with ``"tokens"``), stopping after
    ``truncate + 1`` batches, as TransformerLens counts them.

    Example:
        >>> loader = [{"tokens": torch.randint(0, model.cfg.d_vocab, (2, 16))} for _ in range(3)]
        >>> evaluate_on_dataset(model, loader)
    """
    device = model.device if device is None else device
    running, total = 0.0, 0
    for batch in data_loader:
        running += model(batch["tokens"].to(device), return_type="loss").mean().item()
        total += 1
        if total > truncate:
            break
    if total == 0:
        raise ArgumentValueError("`data_loader` yielded no batch; give it at least one {'tokens': ...} batch.")
    return running / total


class IOIDataset(Dataset):
    """Indirect-object identification prompts from templates (TransformerLens' ``evals.IOIDataset``).

    A template's ``[A]`` / ``[B]`` become two distinct names and each ``[NOUN]`` one of ``nouns[NOUN]``; the
    indirect object (IO) is ``" " + A``, the subject (S) ``" " + B``; ``symmetric`` adds the prompt with the names
    swapped. Items are dicts of token tensors: ``prompt`` (BOS first when ``prepend_bos``), ``IO`` and ``S``.
    The choices follow TransformerLens' (each sample drawn from a generator seeded with 42), so the prompts are
    TransformerLens'.

    Example:
        >>> ds = IOIDataset(model.tokenizer, num_samples=4, names=["Alice", "Bob"])
        >>> sorted(ds[0])
        ['IO', 'S', 'prompt']
    """

    def __init__(
        self,
        tokenizer: Any,
        templates: list[str] | None = None,
        names: list[str] | None = None,
        nouns: dict[str, list[str]] | None = None,
        num_samples: int = 1000,
        symmetric: bool = False,
        prepend_bos: bool = True,
    ) -> None:
        self.tokenizer = tokenizer
        self.prepend_bos = prepend_bos
        self.templates = templates if templates is not None else self.get_default_templates()
        self.names = names if names is not None else self.get_default_names()
        self.nouns = nouns if nouns is not None else self.get_default_nouns()
        if len(self.names) < 2:
            raise ArgumentValueError(f"`names` needs at least two names (A and B), got {self.names!r}.")
        self.samples: list[dict[str, str]] = []
        for _ in range(num_samples // 2 if symmetric else num_samples):
            self.samples.extend(self.get_sample(symmetric=symmetric))

    def __len__(self) -> int:
        return len(self.samples)

    def __getitem__(self, idx: int) -> dict[str, Tensor]:
        sample = self.samples[idx]
        prompt = self.tokenizer.encode(sample["text"])
        if self.prepend_bos:
            prompt = [self.tokenizer.bos_token_id, *prompt]
        encode = self.tokenizer.encode
        return {
            "prompt": torch.tensor(prompt, dtype=torch.long),
            "IO": torch.tensor(encode(sample["IO"]), dtype=torch.long),
            "S": torch.tensor(encode(sample["S"]), dtype=torch.long),
        }

    def get_sample(self, symmetric: bool = False) -> list[dict[str, str]]:
        """One prompt (two with ``symmetric``): ``{"text", "IO", "S"}``."""
        rng = random.Random(42)
        text = rng.choice(self.templates)
        for kind, options in self.nouns.items():
            text = text.replace(f"[{kind}]", rng.choice(options))
        a, b = rng.sample(self.names, 2)
        out = [{"text": text.replace("[A]", a).replace("[B]", b), "IO": " " + a, "S": " " + b}]
        if symmetric:
            out.append({"text": text.replace("[A]", b).replace("[B]", a), "IO": " " + b, "S": " " + a})
        return out

    @staticmethod
    def get_default_names() -> list[str]:
        return ["John", "Mary"]

    @staticmethod
    def get_default_templates() -> list[str]:
        return [
            "[A] and [B] went to the [LOCATION] to buy [OBJECT]. [B] handed the [OBJECT] to [A]",
            "Then, [B] and [A] went to the [LOCATION]. [B] gave the [OBJECT] to [A]",
        ]

    @staticmethod
    def get_default_nouns() -> dict[str, list[str]]:
        return {"LOCATION": ["store", "market"], "OBJECT": ["milk", "eggs", "bread"]}


@torch.inference_mode()
def ioi_eval(
    model: Any,
    dataset: Dataset | None = None,
    batch_size: int = 8,
    num_samples: int = 1000,
    tokenizer: Any = None,
    symmetric: bool = False,
) -> dict[str, float]:
    """Mean logit difference (IO minus S, at the first token where they differ) and accuracy on IOI prompts
    (``dataset``: items with ``prompt`` / ``IO`` / ``S`` token tensors; default `IOIDataset`). Prompts are
    right-padded with id 0 and run without a mask, as in TransformerLens: causal attention keeps the padding out
    of every real position.

    Example:
        >>> ioi_eval(model, num_samples=20)["Accuracy"]
    """
    tokenizer = model.tokenizer if tokenizer is None else tokenizer
    dataset = IOIDataset(tokenizer, num_samples=num_samples, symmetric=symmetric) if dataset is None else dataset
    items = [dataset[i] for i in range(len(dataset))]
    if not items:
        raise ArgumentValueError("`dataset` is empty; give it at least one prompt (or num_samples >= 1).")
    total_diff, correct = 0.0, 0
    for start in range(0, len(items), batch_size):
        batch = items[start : start + batch_size]
        prompts = [item["prompt"] for item in batch]
        padded = torch.nn.utils.rnn.pad_sequence(prompts, batch_first=True).to(model.device)
        logits = model(padded, return_type="logits")
        for row, item in enumerate(batch):
            io, s = item["IO"], item["S"]
            n = min(len(io), len(s))
            differ = torch.nonzero(io[:n] != s[:n])
            if len(differ) == 0:
                raise ArgumentValueError(f"`dataset` item {start + row}: IO and S tokenize alike ({io.tolist()}).")
            first = int(differ[0])
            at = len(prompts[row]) - len(io) + first - 1
            diff = logits[row, at, int(io[first])] - logits[row, at, int(s[first])]
            total_diff += diff.item()
            correct += int(diff.item() > 0)
    return {"Logit Difference": total_diff / len(items), "Accuracy": correct / len(items)}


MMLU_SUBJECTS: list[str] = [
    "abstract_algebra",
    "anatomy",
    "astronomy",
    "business_ethics",
    "clinical_knowledge",
    "college_biology",
    "college_chemistry",
    "college_computer_science",
    "college_mathematics",
    "college_medicine",
    "college_physics",
    "computer_security",
    "conceptual_physics",
    "econometrics",
    "electrical_engineering",
    "elementary_mathematics",
    "formal_logic",
    "global_facts",
    "high_school_biology",
    "high_school_chemistry",
    "high_school_computer_science",
    "high_school_european_history",
    "high_school_geography",
    "high_school_government_and_politics",
    "high_school_macroeconomics",
    "high_school_mathematics",
    "high_school_microeconomics",
    "high_school_physics",
    "high_school_psychology",
    "high_school_statistics",
    "high_school_us_history",
    "high_school_world_history",
    "human_aging",
    "human_sexuality",
    "international_law",
    "jurisprudence",
    "logical_fallacies",
    "machine_learning",
    "management",
    "marketing",
    "medical_genetics",
    "miscellaneous",
    "moral_disputes",
    "moral_scenarios",
    "nutrition",
    "philosophy",
    "prehistory",
    "professional_accounting",
    "professional_law",
    "professional_medicine",
    "professional_psychology",
    "public_relations",
    "security_studies",
    "sociology",
    "us_foreign_policy",
    "virology",
    "world_religions",
]  # fmt: skip  (MMLU's 57 subjects, cais/mmlu's configuration names)
MMLU_ANSWER_LETTERS = ["A", "B", "C", "D"]


def _needs_download(what: str, dataset: str, then: str) -> DatasetDownloadError:
    return DatasetDownloadError(
        f"{what} downloads the hub dataset {dataset!r}; the bridge downloads nothing. Load it yourself, e.g. "
        f"`datasets.load_dataset({dataset!r}, split='train')`, then {then}."
    )


_TOKENIZE = (
    "`utils.tokenize_and_concatenate(data, model.tokenizer)` and a `torch.utils.data.DataLoader` over it give "
    "the batches `evals.evaluate_on_dataset(model, loader)` reads"
)


def make_wiki_data_loader(tokenizer: Any, batch_size: int = 8) -> DataLoader:
    """Refused: needs WikiText-2 from the hub (`DatasetDownloadError` says how to run it on data you load)."""
    raise _needs_download("make_wiki_data_loader", "wikitext", _TOKENIZE)


def make_owt_data_loader(tokenizer: Any, batch_size: int = 8) -> DataLoader:
    """Refused: needs OpenWebText-10k from the hub (`DatasetDownloadError` says how to run it on data you load)."""
    raise _needs_download("make_owt_data_loader", "stas/openwebtext-10k", _TOKENIZE)


def make_pile_data_loader(tokenizer: Any, batch_size: int = 8) -> DataLoader:
    """Refused: needs Pile-10k from the hub (`DatasetDownloadError` says how to run it on data you load)."""
    raise _needs_download("make_pile_data_loader", "NeelNanda/pile-10k", _TOKENIZE)


def make_code_data_loader(tokenizer: Any, batch_size: int = 8) -> DataLoader:
    """Refused: needs CodeParrot from the hub (`DatasetDownloadError` says how to run it on data you load)."""
    raise _needs_download("make_code_data_loader", "codeparrot/codeparrot-valid-v2-near-dedup", _TOKENIZE)


DATASET_NAMES = ["wiki", "owt", "pile", "code"]
DATASET_LOADERS = [make_wiki_data_loader, make_owt_data_loader, make_pile_data_loader, make_code_data_loader]


def evaluate(model: Any, truncate: int = 100, batch_size: int = 8, tokenizer: Any = None) -> dict[str, float]:
    """Refused: evaluates on four hub datasets (`DatasetDownloadError` says how to run each on data you load)."""
    raise _needs_download("evaluate", "wikitext", _TOKENIZE + " (likewise for owt, pile and code)")


def make_mmlu_data_loader(subjects: str | list[str] | None = None, split: str = "test", num_samples: Any = None):
    """Refused: needs MMLU from the hub (`DatasetDownloadError` says how to load it)."""
    raise _needs_download("make_mmlu_data_loader", "cais/mmlu", "score each question's answer letters yourself")


def mmlu_eval(model: Any, tokenizer: Any = None, subjects: Any = None, split: str = "test", num_samples: Any = None,
              device: Any = None) -> dict[str, Any]:  # fmt: skip
    """Refused: needs MMLU from the hub (`DatasetDownloadError` says how to load it)."""
    raise _needs_download("mmlu_eval", "cais/mmlu", "score each question's answer letters yourself")

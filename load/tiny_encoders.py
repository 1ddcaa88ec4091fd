"""Small sentence-transformers model directories made on this machine, with random weights and real architectures:
the shapes of the encoders users bring (CLS, mean + Dense, several poolings at once, a decoder with last-token
pooling and left padding; prompts; Matryoshka sizes), for the local backend's tests and ``load.encoder_check``
to serve and compare with sentence-transformers' own ``encode`` on the same directory. No hub is reached: the BERTs
take the packaged MiniLM's tokenizer, the decoder a byte-level BPE trained here in milliseconds.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Sequence

from load.workload import pseudo_sentences

PROBES = ("hello", "The lighthouse keeper counted the ships.", "Ünïcödé, accents and 東京タワー", "a " * 400,
          "numbers 3.14159 and e-mail@example.com!", *pseudo_sentences(10, 150, seed=5))
HIDDEN = 32
MAX_SEQ_LENGTH = 64  # short, so that the long probes are truncated
QUERY_INSTRUCTION = "Represent this sentence for searching relevant passages: "  # bge's


@dataclass(frozen=True)
class TinyEncoder:
    """One directory to make: its architecture, pipeline and prompts, and what a model entry declares for it."""

    name: str
    architecture: str  # bert | qwen2
    pooling: str | tuple[str, ...]
    normalize: bool
    dense_features: int | None = None  # a Dense layer (Tanh) to this many values after pooling
    prompts: dict[str, str] = field(default_factory=dict)
    default_prompt_name: str | None = None
    matryoshka_dims: tuple[int, ...] = ()  # for the model entry: the sizes `dimensions` may ask for

    @property
    def dimension(self) -> int:
        pooled = HIDDEN * (1 if isinstance(self.pooling, str) else len(self.pooling))
        return self.dense_features or pooled


TINY_ENCODERS = (
    TinyEncoder("bert-cls-normalize", "bert", "cls", True, prompts={"query": QUERY_INSTRUCTION},
                matryoshka_dims=(16, 8)),
    TinyEncoder("bert-mean-dense", "bert", "mean", False, dense_features=24,
                prompts={"query": "query: ", "passage": "passage: "}, default_prompt_name="passage"),
    TinyEncoder("bert-max-sqrt-weighted", "bert", ("max", "mean_sqrt_len_tokens", "weightedmean"), False),
    TinyEncoder("qwen2-lasttoken-left", "qwen2", "lasttoken", True,
                prompts={"query": "Instruct: find the answer\nQuery:", "document": ""}),
)


def make(spec: TinyEncoder, root: Path, seed: int = 0) -> Path:
    """``spec`` saved as a sentence-transformers directory ``root / spec.name`` (its parts built in ``root``)."""
    import torch
    from sentence_transformers import SentenceTransformer
    from sentence_transformers.base.modules import Transformer
    from sentence_transformers.sentence_transformer.modules import Dense, Normalize, Pooling

    torch.manual_seed(seed)
    source = root / f".{spec.name}-transformer"
    _transformer(spec.architecture, source)
    modules: list[Any] = [Transformer(str(source), max_seq_length=MAX_SEQ_LENGTH), Pooling(HIDDEN, spec.pooling)]
    if spec.dense_features:
        modules.append(Dense(HIDDEN, spec.dense_features, activation_function=torch.nn.Tanh()))
    if spec.normalize:
        modules.append(Normalize())
    target = root / spec.name
    SentenceTransformer(modules=modules, prompts=spec.prompts, default_prompt_name=spec.default_prompt_name,
                        device="cpu").save(str(target))
    return target


def make_all(root: Path) -> dict[str, Path]:
    """Every ``TINY_ENCODERS`` directory under ``root``, by name."""
    return {spec.name: make(spec, root, seed) for seed, spec in enumerate(TINY_ENCODERS)}


def tokens_embedded(reference: Any, texts: Sequence[str]) -> list[int]:
    """What sentence-transformers model ``reference`` feeds its transformer for each text (truncated), less the
    tokens its tokenizer adds to any text ([CLS] and [SEP], an end-of-text token): what ``usage`` counts."""
    tokenizer = reference.tokenizer
    added = len(tokenizer("")["input_ids"])
    ids = tokenizer(list(texts), truncation=True, max_length=reference.max_seq_length)["input_ids"]
    return [len(row) - added for row in ids]


def _transformer(architecture: str, target: Path) -> None:
    # A wide initialisation, so that random weights still give texts clearly different vectors.
    shape = dict(hidden_size=HIDDEN, num_hidden_layers=2, num_attention_heads=2, intermediate_size=64,
                 max_position_embeddings=128, initializer_range=0.5)
    if architecture == "bert":
        from transformers import AutoTokenizer, BertConfig, BertModel

        from deployments.model.backends.model_dir import packaged_model_path

        tokenizer = AutoTokenizer.from_pretrained(packaged_model_path(), local_files_only=True)
        model = BertModel(BertConfig(vocab_size=tokenizer.vocab_size, **shape))
    else:
        from transformers import Qwen2Config, Qwen2Model

        tokenizer = _byte_level_tokenizer()
        model = Qwen2Model(Qwen2Config(vocab_size=len(tokenizer), num_key_value_heads=1, **shape))
    model.save_pretrained(str(target))
    tokenizer.save_pretrained(str(target))


def _byte_level_tokenizer() -> Any:
    """A Qwen-style tokenizer: byte-level BPE, an end-of-text token after every input, padding on the left."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, processors, trainers
    from transformers import PreTrainedTokenizerFast

    eos = "<|endoftext|>"
    bpe = Tokenizer(models.BPE())
    bpe.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    bpe.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(vocab_size=600, special_tokens=[eos],
                                  initial_alphabet=pre_tokenizers.ByteLevel.alphabet())
    bpe.train_from_iterator(pseudo_sentences(400, 120, seed=11), trainer)
    bpe.post_processor = processors.TemplateProcessing(single=f"$A {eos}", special_tokens=[(eos, bpe.token_to_id(eos))])
    return PreTrainedTokenizerFast(tokenizer_object=bpe, eos_token=eos, pad_token=eos, padding_side="left")

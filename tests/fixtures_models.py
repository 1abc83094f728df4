"""Tiny randomly initialised models of each supported architecture, saved in the sentence-transformers
layout a user would hand us (no download: `transformers` and `sentence-transformers` build them).

`tiny_st_folder(...)` writes a Hugging Face folder (config.json, model.safetensors, tokenizer.json)
and wraps it in real sentence-transformers modules (Transformer, Pooling, optional Dense and
Normalize, prompts), saved with `SentenceTransformer.save`: exactly the files a fine-tuned model has.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

CORPUS = [
    "best marathon training shoes for women", "running shoes", "organic gluten free pasta sauce",
    "wireless noise cancelling headphones with long battery life", "baby formula", "greek yogurt",
    "low sodium chicken broth for soup", "fresh strawberries and cream", "whole milk", "green tea",
    "query: passage: represent this sentence for searching", "family size under 5 dollars travel office",
]
ARCHITECTURES = ("bert", "roberta", "xlm-roberta", "mpnet", "distilbert", "modernbert")
HIDDEN = 32


def tokenizer_files(out: Path, arch: str = "bert", corpus: list[str] | None = None) -> int:
    """A WordPiece tokenizer trained on CORPUS (or `corpus`), saved as a fast tokenizer (tokenizer.json and its
    config) with [PAD]=0, [UNK]=1, [CLS]=2, [SEP]=3, [MASK]=4. Returns the vocabulary size."""
    import transformers
    from tokenizers import Tokenizer, models, normalizers, pre_tokenizers, processors, trainers

    special = ["[PAD]", "[UNK]", "[CLS]", "[SEP]", "[MASK]"]
    tok = Tokenizer(models.WordPiece(unk_token="[UNK]"))
    tok.normalizer = normalizers.BertNormalizer(lowercase=True)
    tok.pre_tokenizer = pre_tokenizers.BertPreTokenizer()
    texts = corpus or CORPUS
    vocab = 160 if corpus is None else 160 + len({w for t in texts for w in t.lower().split()})
    tok.train_from_iterator(texts * 4, trainers.WordPieceTrainer(vocab_size=vocab, special_tokens=special))
    tok.post_processor = processors.TemplateProcessing(
        single="[CLS] $A [SEP]", pair="[CLS] $A [SEP] $B:1 [SEP]:1",
        special_tokens=[("[CLS]", 2), ("[SEP]", 3)])
    # as the architectures' own tokenizers: only BERT's model takes token types
    names = ["input_ids", "token_type_ids", "attention_mask"] if arch == "bert" else ["input_ids", "attention_mask"]
    fast = transformers.PreTrainedTokenizerFast(  # type: ignore[no-untyped-call]
        tokenizer_object=tok, unk_token="[UNK]", pad_token="[PAD]", cls_token="[CLS]", sep_token="[SEP]",
        mask_token="[MASK]", model_max_length=64, model_input_names=names)
    fast.save_pretrained(str(out))
    return int(tok.get_vocab_size())


def _config(arch: str, vocab: int) -> Any:
    import transformers

    tf: Any = transformers  # untyped: its config classes are called with keywords only

    common: dict[str, Any] = {"vocab_size": vocab, "pad_token_id": 0}
    if arch == "bert":
        return tf.BertConfig(hidden_size=HIDDEN, num_hidden_layers=2, num_attention_heads=4, intermediate_size=64,
                             max_position_embeddings=128, **common)
    if arch in ("roberta", "xlm-roberta"):
        cls = tf.RobertaConfig if arch == "roberta" else tf.XLMRobertaConfig
        return cls(hidden_size=HIDDEN, num_hidden_layers=2, num_attention_heads=4, intermediate_size=64,
                   max_position_embeddings=130, type_vocab_size=1, bos_token_id=2, eos_token_id=3, **common)
    if arch == "mpnet":
        return tf.MPNetConfig(hidden_size=HIDDEN, num_hidden_layers=2, num_attention_heads=4, intermediate_size=64,
                              max_position_embeddings=130, bos_token_id=2, eos_token_id=3, **common)
    if arch == "distilbert":
        return tf.DistilBertConfig(dim=HIDDEN, n_layers=2, n_heads=4, hidden_dim=64, max_position_embeddings=128,
                                   **common)
    if arch == "modernbert":
        # >= 3 layers and a local window (8) shorter than the check texts: sliding-window attention
        # is exercised, with a global layer every third.
        return tf.ModernBertConfig(hidden_size=HIDDEN, num_hidden_layers=3, num_attention_heads=4,
                                   intermediate_size=64, max_position_embeddings=128, cls_token_id=2,
                                   sep_token_id=3, bos_token_id=2, eos_token_id=3, local_attention=8,
                                   global_attn_every_n_layers=3, **common)
    raise ValueError(arch)


def hf_folder(out: Path, arch: str, *, seed: int = 0, corpus: list[str] | None = None) -> Path:
    """A plain Hugging Face folder: config.json, model.safetensors, tokenizer files."""
    import torch
    from transformers import AutoModel

    out.mkdir(parents=True, exist_ok=True)
    vocab = tokenizer_files(out, arch, corpus)
    torch.manual_seed(seed)
    AutoModel.from_config(_config(arch, vocab)).save_pretrained(str(out))  # type: ignore[no-untyped-call]
    return out


def tiny_st_folder(out: Path, arch: str = "bert", *, pooling: str = "mean", dense: int | None = None,
                   activation: str = "Tanh", normalize: bool = True, prompts: dict[str, str] | None = None,
                   include_prompt: bool = True, similarity: str | None = None, seed: int = 0,
                   corpus: list[str] | None = None) -> Path:
    """A sentence-transformers folder around a tiny `arch` model; `dense`: a Dense layer to that width."""
    import torch
    from sentence_transformers import SentenceTransformer, models

    hf = hf_folder(out.parent / f"{out.name}-hf", arch, seed=seed, corpus=corpus)
    modules: list[Any] = [models.Transformer(str(hf), max_seq_length=64)]
    modules.append(models.Pooling(HIDDEN, pooling_mode=pooling, include_prompt=include_prompt))
    if dense is not None:
        torch.manual_seed(seed + 1)
        modules.append(models.Dense(HIDDEN, dense, activation_function=getattr(torch.nn, activation)()))
    if normalize:
        modules.append(models.Normalize())
    model = SentenceTransformer(modules=modules, device="cpu", prompts=prompts or {},
                                similarity_fn_name=similarity)
    model.save(str(out))
    return out


def st_reference(folder: Path, texts: list[str], prompt: str = "") -> Any:
    """sentence-transformers' own embeddings (numpy), the reference a user compares with."""
    from sentence_transformers import SentenceTransformer

    model = SentenceTransformer(str(folder), device="cpu", local_files_only=True)
    return model.encode(texts, prompt=prompt, convert_to_numpy=True)

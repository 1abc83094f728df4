"""Reading a user's model folder: what is read, and what is refused with the file and field named.

Pure file reading (no torch): folders are written by hand here, as their files look in the wild.
"""

from __future__ import annotations

import json
from collections.abc import Mapping
from pathlib import Path

import pytest

from inference.errors import ModelError
from inference.model_folder import read_model_folder

ST = "sentence_transformers.models."


def _folder(tmp: Path, *, model_type: str = "bert", pooling: Mapping[str, object] | None = None,
            modules: list[str] | None = None, st_config: dict[str, object] | None = None,
            dense: dict[str, object] | None = None, weights: bool = True) -> Path:
    d = tmp / "m"
    d.mkdir(parents=True)
    (d / "config.json").write_text(json.dumps({"model_type": model_type, "hidden_size": 32}))
    (d / "tokenizer.json").write_text("{}")
    if weights:
        (d / "model.safetensors").write_bytes(b"")
    if modules is not None:
        paths = {"Transformer": "", "Pooling": "1_Pooling", "Dense": "2_Dense", "Normalize": "3_Normalize"}
        (d / "modules.json").write_text(json.dumps([
            {"idx": i, "name": str(i), "path": paths.get(m, m), "type": ST + m} for i, m in enumerate(modules)]))
    if pooling is not None:
        (d / "1_Pooling").mkdir()
        (d / "1_Pooling" / "config.json").write_text(json.dumps({"word_embedding_dimension": 32, **pooling}))
    if st_config is not None:
        (d / "config_sentence_transformers.json").write_text(json.dumps(st_config))
    if dense is not None:
        (d / "2_Dense").mkdir()
        (d / "2_Dense" / "config.json").write_text(json.dumps(dense))
        (d / "2_Dense" / "model.safetensors").write_bytes(b"")
    return d


MEAN = {"pooling_mode_mean_tokens": True, "pooling_mode_cls_token": False}


def test_a_sentence_transformers_folder_is_read_whole(tmp_path: Path) -> None:
    d = _folder(tmp_path, pooling={"pooling_mode_cls_token": True, "include_prompt": False},
                modules=["Transformer", "Pooling", "Dense", "Normalize"],
                st_config={"prompts": {"query": "query: ", "passage": "passage: "}, "default_prompt_name": None,
                           "similarity_fn_name": "cosine"},
                dense={"in_features": 32, "out_features": 16, "bias": True,
                       "activation_function": "torch.nn.modules.activation.Tanh"})
    (d / "sentence_bert_config.json").write_text(json.dumps({"max_seq_length": 48}))
    f = read_model_folder(d)
    assert (f.kind, f.model_type, f.pooling, f.include_prompt, f.normalize) == ("hf", "bert", "cls", False, True)
    assert f.prompts == {"query": "query: ", "document": "passage: "}
    assert [(x.in_features, x.out_features, x.activation) for x in f.dense] == [(32, 16, "Tanh")]
    assert f.max_seq_length == 48 and f.pooling_from == "1_Pooling/config.json"


def test_no_pooling_file_is_refused_not_guessed(tmp_path: Path) -> None:
    d = _folder(tmp_path)
    with pytest.raises(ModelError, match=r"1_Pooling/config.json.*--pooling"):
        read_model_folder(d)
    assert read_model_folder(d, pooling="cls").pooling == "cls"  # said explicitly: fine


@pytest.mark.parametrize(("pooling", "match"), [
    ({"pooling_mode_mean_tokens": True, "pooling_mode_max_tokens": True}, "exactly one pooling flag"),
    ({"pooling_mode_weightedmean_tokens": True}, "pooling_mode_weightedmean_tokens is not supported"),
    ({"pooling_mode_mean_sqrt_len_tokens": True}, "pooling_mode_mean_sqrt_len_tokens is not supported"),
    ({}, "exactly one pooling flag"),
])
def test_pooling_configs_we_cannot_serve_are_refused_by_name(tmp_path: Path, pooling: dict[str, object],
                                                             match: str) -> None:
    with pytest.raises(ModelError, match=match) as info:
        read_model_folder(_folder(tmp_path, pooling={"word_embedding_dimension": 32, **pooling}))
    assert "1_Pooling/config.json" in str(info.value)


def test_unsupported_architecture_module_and_activation_name_the_file(tmp_path: Path) -> None:
    with pytest.raises(ModelError, match=r"config.json: model_type 'gpt2' is not supported"):
        read_model_folder(_folder(tmp_path / "a", model_type="gpt2", pooling=MEAN))
    with pytest.raises(ModelError, match=r"modules.json: module .*WordEmbeddings.* not supported"):
        read_model_folder(_folder(tmp_path / "b", pooling=MEAN, modules=["WordEmbeddings", "Pooling"]))
    with pytest.raises(ModelError, match=r"2_Dense/config.json: activation_function.*GELU"):
        read_model_folder(_folder(tmp_path / "c", pooling=MEAN, modules=["Transformer", "Pooling", "Dense"],
                                  dense={"in_features": 32, "out_features": 8,
                                         "activation_function": "torch.nn.modules.activation.GELU"}))


def test_prompts_by_role_and_explicit_choices(tmp_path: Path) -> None:
    d = _folder(tmp_path, pooling=MEAN, st_config={
        "prompts": {"search_query": "search_query: ", "search_document": "search_document: ", "classify": "c: "}})
    assert read_model_folder(d).prompts == {"query": "search_query: ", "document": "search_document: "}
    assert read_model_folder(d, query_prompt="classify", document_prompt="").prompts == {"query": "c: "}
    with pytest.raises(ModelError, match=r"config_sentence_transformers.json: no prompt named 'nope'"):
        read_model_folder(d, query_prompt="nope")


def test_without_normalize_a_dot_product_model_is_served_unnormalised(tmp_path: Path) -> None:
    dot = _folder(tmp_path / "a", pooling=MEAN, modules=["Transformer", "Pooling"],
                  st_config={"similarity_fn_name": "dot"})
    cos = _folder(tmp_path / "b", pooling=MEAN, modules=["Transformer", "Pooling"],
                  st_config={"similarity_fn_name": "cosine"})
    assert read_model_folder(dot).normalize is False
    assert read_model_folder(cos).normalize is True  # cosine: normalising changes no ranking
    with pytest.raises(ModelError, match=r"similarity_fn_name 'manhattan'"):
        read_model_folder(_folder(tmp_path / "c", pooling=MEAN, st_config={"similarity_fn_name": "manhattan"}))


def test_an_onnx_folder_and_a_folder_with_nothing_to_serve(tmp_path: Path) -> None:
    d = _folder(tmp_path / "a", model_type="", pooling=MEAN, weights=False)
    (d / "onnx").mkdir()
    (d / "onnx" / "model.onnx").write_bytes(b"")
    f = read_model_folder(d)
    assert f.kind == "onnx" and f.onnx_file == d / "onnx" / "model.onnx"
    with pytest.raises(ModelError, match="no weights"):
        read_model_folder(_folder(tmp_path / "b", pooling=MEAN, weights=False))
    bare = _folder(tmp_path / "c", pooling=MEAN)
    (bare / "tokenizer.json").unlink()
    with pytest.raises(ModelError, match=r"no tokenizer\.json"):
        read_model_folder(bare)

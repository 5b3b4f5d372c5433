"""tokenizer.py: the data's tokenizer behind one interface, its files carried with the data, and one
line for a tokenizer that cannot be read or reached."""
import pytest

from conftest import make_docs, train_sentencepiece
from data import tokenizer


def one_line(e):
    assert "\n" not in str(e) and str(e)
    return str(e)


def test_a_hub_name_offline_fails_in_one_line_that_says_how_to_use_a_local_file(hub_offline):
    with pytest.raises(tokenizer.TokenizerError) as e:
        tokenizer.load("meta-llama/Llama-2-7b-hf")
    assert "--tokenizer=path/to/tokenizer.model" in one_line(e.value)


def test_sample_names_a_missing_tokenizer_file_in_one_line(tmp_path):
    meta = {"tokenizer": "sentencepiece:tokenizer.model", "eot_token": 2, "vocab_size": 320}
    with pytest.raises(tokenizer.TokenizerError) as e:
        tokenizer.from_meta(meta, str(tmp_path))
    assert str(tmp_path / "tokenizer.model") in one_line(e.value) and "prepare the data again" in str(e.value)
    (tmp_path / "tokenizer.model").write_bytes(b"not a model")
    with pytest.raises(tokenizer.TokenizerError) as e:
        tokenizer.from_meta(meta, str(tmp_path))
    assert f"{tmp_path / 'tokenizer.model'} is not a SentencePiece model" in one_line(e.value)


def test_a_tokenizer_json_directory_separates_documents_with_its_eos(tmp_path):
    """A transformers tokenizer directory (tokenizer.json + tokenizer_config.json), as on the hub."""
    sp = train_sentencepiece(tmp_path / "tokenizer.model", make_docs(60, seed=3), vocab_size=300)
    files, why = tokenizer.load(str(tmp_path / "tokenizer.model")).hf_files()
    assert why is None
    (tmp_path / "dir").mkdir()
    for name in ("tokenizer.json", "tokenizer_config.json"):
        (tmp_path / "dir" / name).write_bytes(files[name])
    tok = tokenizer.load(str(tmp_path / "dir"))
    assert tok.kind == "tokenizers" and tok.eot == sp.eos_id() and tok.vocab_size == sp.get_piece_size()
    doc = "the river bank</s> is text"
    assert tok.encode(doc) == sp.encode(doc)  # "</s>" inside a document stays text
    assert tok.encode("a</s>b", special=True) == sp.encode("a") + [2] + sp.encode("b")  # prompts may name it
    assert tok.decode(sp.encode("a") + [2] + sp.encode("b")) == "a</s>b"

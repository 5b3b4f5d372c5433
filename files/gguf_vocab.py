"""The data's tokenizer as a GGUF vocabulary: the tokenizer fields llama.cpp (and transformers' GGUF
reader) read, made from the tokenizer the data was prepared with (meta.json; data/tokenizer.py).

    vocab = gguf_vocab.vocabulary(meta, data_dir, vocab_size)   # checked before any file is written
    gguf_vocab.add_vocabulary(writer, vocab)                     # into a gguf.GGUFWriter's header

tiktoken's GPT-2 pattern encodings become a byte-level BPE vocabulary with merges, a SentencePiece BPE
model llama.cpp's "llama" vocabulary, the default corpus's bytes 256 SentencePiece byte tokens with the
space spelled "▁" (_bytes_vocab says why). eos is the data's end-of-sequence token (NUL for the bytes,
which have none); no BOS is added: the data has none. A vocabulary smaller than the model's is padded
as llama.cpp's converter pads it. A tokenizer GGUF cannot hold is one line (ConfigError).
"""
import os

import gguf

from configurator import ConfigError
from data import tokenizer


def _padded(vocab, n):
    """The vocabulary grown to the model's n ids, as llama.cpp's converter pads: [PAD<i>], unused."""
    if len(vocab["tokens"]) > n:
        raise ConfigError(f"the data's tokenizer has {len(vocab['tokens'])} tokens, more than the model's "
                          f"vocab_size={n}")
    extra = range(len(vocab["tokens"]), n)
    vocab["tokens"] += [f"[PAD{i}]" for i in extra]
    vocab["types"] += [gguf.TokenType.UNUSED] * len(extra)
    vocab["scores"] += [-1000.0] * len(extra)
    return vocab


def _bytes_vocab():
    """The 256 UTF-8 bytes as SentencePiece byte tokens <0xNN>, the space as "▁": llama.cpp and transformers
    read spaces as "▁" (so the character U+2581 itself reads as a space), and a byte-level BPE vocabulary
    cannot hold bytes alone (llama.cpp needs a merge, transformers its merged token in the vocabulary).
    eos is NUL (byte 0), which text never holds, where llama.cpp would otherwise stop at byte 2."""
    tokens = ["\u2581" if b == 0x20 else f"<0x{b:02X}>" for b in range(256)]
    types = [gguf.TokenType.NORMAL if b == 0x20 else gguf.TokenType.BYTE for b in range(256)]
    return dict(model="llama", tokens=tokens, types=types, scores=[0.0] * 256, eos=0, bos=None,
                add_space_prefix=False, remove_extra_whitespaces=False, real=256)


def _tiktoken_vocab(tok):
    """tiktoken's ranks as a byte-level BPE vocabulary, its merges recovered as transformers does."""
    import tiktoken
    from tiktoken_ext.openai_public import r50k_pat_str
    from transformers.convert_slow_tokenizer import TikTokenConverter
    enc = tiktoken.get_encoding(tok.name)  # tok.backend loaded it (or said why it cannot)
    if enc._pat_str != r50k_pat_str:
        raise ConfigError(f"the data's tiktoken encoding {tok.name!r} splits text with a pattern other than "
                          f"GPT-2's; GGUF export knows llama.cpp's pre-tokenizer for GPT-2's (gpt2, r50k_base, "
                          f"p50k_base) only")
    ranks = {b: enc.encode_single_token(b) for b in enc.token_byte_values()}
    converter = TikTokenConverter()
    converter.load_tiktoken_bpe = lambda _: ranks  # it reads a file; the ranks are at hand
    spelled, merges = converter.extract_vocab_merges_from_model(None)
    n = enc.n_vocab
    tokens, types = [f"[PAD{i}]" for i in range(n)], [gguf.TokenType.UNUSED] * n
    for text, i in spelled.items():
        tokens[i], types[i] = text, gguf.TokenType.NORMAL
    for text in enc.special_tokens_set:
        i = enc.encode_single_token(text)
        tokens[i], types[i] = text, gguf.TokenType.CONTROL
    return dict(model="gpt2", pre="gpt-2", tokens=tokens, types=types, scores=[0.0] * n,
                merges=[f"{a} {b}" for a, b in merges], eos=tok.eot, bos=tok.eot, real=n)


def _sentencepiece_vocab(tok):
    """A SentencePiece BPE model's pieces, scores and types, as gguf's SentencePieceVocab reads them."""
    import tempfile
    from pathlib import Path
    from sentencepiece import sentencepiece_model_pb2
    proto = sentencepiece_model_pb2.ModelProto()
    proto.ParseFromString(tok.files[tok.name])
    if proto.trainer_spec.model_type != proto.trainer_spec.BPE:
        raise ConfigError(f"{tok.source}: GGUF export reads SentencePiece BPE models (as Llama 2's); this one is "
                          f"{proto.trainer_spec.ModelType.Name(proto.trainer_spec.model_type)}")
    with tempfile.TemporaryDirectory() as d:
        with open(os.path.join(d, "tokenizer.model"), "wb") as f:
            f.write(tok.files[tok.name])
        pieces = list(gguf.vocab.SentencePieceVocab(Path(d)).all_tokens())
    return dict(model="llama", tokens=[p.decode("utf-8") for p, _, _ in pieces], types=[t for _, _, t in pieces],
                scores=[s for _, s, _ in pieces], eos=tok.eot, bos=None,
                add_space_prefix=proto.normalizer_spec.add_dummy_prefix,
                remove_extra_whitespaces=proto.normalizer_spec.remove_extra_whitespaces, real=len(pieces),
                normalization=proto.normalizer_spec.name)


def vocabulary(meta, data_dir, vocab_size):
    """The GGUF tokenizer fields of the data's tokenizer (meta.json), padded to the model's vocab_size."""
    try:
        tok = tokenizer.from_meta(meta, data_dir)
        tok.backend  # a tiktoken encoding that cannot be loaded fails here, in one line
    except tokenizer.TokenizerError as e:
        raise ConfigError(str(e)) from None
    if tok.kind == "bytes":
        vocab = _bytes_vocab()
    elif tok.kind == "tiktoken":
        vocab = _tiktoken_vocab(tok)
    elif tok.kind == "sentencepiece":
        vocab = _sentencepiece_vocab(tok)
    else:
        raise ConfigError(f"the data's tokenizer is {meta.get('tokenizer')!r}; GGUF export writes tiktoken, "
                          f"SentencePiece and byte vocabularies: prepare the data with a SentencePiece "
                          f"tokenizer.model (--tokenizer=path/to/tokenizer.model) to export it")
    if meta.get("eot_token") is not None:
        vocab["eos"] = meta["eot_token"]
    return _padded(vocab, vocab_size)



def add_vocabulary(writer, vocab):
    """vocabulary()'s fields into a gguf.GGUFWriter: the tokenizer model, tokens, scores, types, merges,
    the SentencePiece normalizer's settings, eos (and bos where the tokenizer has one)."""
    writer.add_tokenizer_model(vocab["model"])
    if "pre" in vocab:
        writer.add_tokenizer_pre(vocab["pre"])
    writer.add_token_list(vocab["tokens"])
    writer.add_token_scores(vocab["scores"])
    writer.add_token_types(vocab["types"])
    if "merges" in vocab:
        writer.add_token_merges(vocab["merges"])
    if "add_space_prefix" in vocab:
        writer.add_add_space_prefix(vocab["add_space_prefix"])
        writer.add_remove_extra_whitespaces(vocab["remove_extra_whitespaces"])
    writer.add_eos_token_id(vocab["eos"])
    if vocab["bos"] is not None:
        writer.add_bos_token_id(vocab["bos"])
    writer.add_add_bos_token(False)  # the data has no BOS: documents are separated by eos
    writer.add_add_eos_token(False)

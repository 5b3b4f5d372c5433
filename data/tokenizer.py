"""The data's tokenizer behind one interface: tiktoken encodings, UTF-8 bytes, SentencePiece models
(Llama 2's tokenizer.model) and Hugging Face tokenizers (a tokenizer.json).

meta.json's "tokenizer" names it: "bytes", "tiktoken:<encoding>", "sentencepiece:tokenizer.model"
or "tokenizers:tokenizer.json". The files of the last two are copied into the data directory
beside meta.json, so the data carries the tokenizer that sample.py and the Hugging Face export
(hf.py) need, wherever it came from. meta.json's "eot_token" is the id that ends every document:
the tokenizer's own end-of-sequence token (<|endoftext|> for tiktoken, </s> for Llama 2).

    tok = load("path/to/tokenizer.model")      # or a directory, a hub name, a tiktoken name
    tok.encode("text"), tok.decode(ids), tok.eot, tok.vocab_size, tok.meta()
"""
import json
import os

from util import UserError, reason

TIKTOKEN_EOT = "<|endoftext|>"
# the files a Hugging Face tokenizer directory may hold that we read; a hub download fetches these only
HF_TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json", "special_tokens_map.json", "tokenizer.model")


class TokenizerError(UserError, ValueError):
    """A tokenizer that cannot be used or reached: the message is one line for the user."""


class Tokenizer:
    """encode(text) -> ids, decode(ids) -> text, eot (the end-of-sequence id, None for bytes),
    eot_text (its text), vocab_size, meta() for meta.json, files {name: bytes} the data keeps.

    kind: "bytes", "tiktoken", "sentencepiece" or "tokenizers". Picklable (the backend is
    rebuilt from the files), so datasets can tokenize in several processes.
    """

    def __init__(self, kind, name, files=None, encoding=None, eos_token=None, source=None):
        self.kind, self.name, self.files, self.source = kind, name, dict(files or {}), source
        self._encoding, self._eos_token, self._backend = encoding, eos_token, None
        b = self.backend  # a bad file or a tokenizer without an end-of-sequence token fails here
        self.vocab_size, self.eot, self.eot_text = b["vocab_size"], b["eot"], b["eot_text"]

    def _where(self):
        """The file a message should name: the user's path, or the file inside the user's directory."""
        if self.source and not os.path.isdir(os.path.expanduser(self.source)):
            return self.source
        return os.path.join(self.source, self.name) if self.source else self.name

    def __getstate__(self):
        return {**self.__dict__, "_backend": None}

    @property
    def backend(self):
        if self._backend is None:
            self._backend = getattr(self, f"_{self.kind}")()
        return self._backend

    def _bytes(self):
        return dict(vocab_size=256, eot=None, eot_text=None,
                    encode=lambda texts: [list(t.encode("utf-8")) for t in texts],
                    decode=lambda ids: bytes(ids).decode("utf-8", errors="replace"))

    def _tiktoken(self):
        enc = self._encoding
        if enc is None:
            import tiktoken
            try:
                enc = tiktoken.get_encoding(self.name)
            except Exception as e:  # an unknown name, or BPE files that cannot be downloaded
                cache = (os.environ.get("TIKTOKEN_CACHE_DIR") or os.environ.get("DATA_GYM_CACHE_DIR")
                         or "/tmp/data-gym-cache")
                raise TokenizerError(f"could not load tiktoken's {self.name!r} BPE files ({reason(e)}); without "
                                     f"network, copy tiktoken's cache ({cache}) from a machine that has run "
                                     f"get_encoding({self.name!r})") from None
        if TIKTOKEN_EOT not in enc.special_tokens_set:
            raise TokenizerError(f"tokenizer {enc.name!r} has no {TIKTOKEN_EOT} token to separate documents")
        # encode_ordinary: "<|endoftext|>" inside a document stays text
        return dict(vocab_size=enc.n_vocab, eot=enc.eot_token, eot_text=TIKTOKEN_EOT,
                    encode=lambda texts: [enc.encode_ordinary(t) for t in texts], decode=enc.decode)

    def _sentencepiece(self):
        import sentencepiece as spm
        sp = spm.SentencePieceProcessor()
        try:
            sp.LoadFromSerializedProto(self.files[self.name])
        except Exception as e:
            raise TokenizerError(f"{self._where()} is not a SentencePiece model ({reason(e)})") from None
        if sp.eos_id() < 0:
            raise TokenizerError(f"the SentencePiece model {self._where()} has no end-of-sequence "
                                 f"token (eos_id=-1) to separate documents; train it with eos_id >= 0")
        # encode adds no BOS/EOS (SentencePiece's default); control symbols like </s> in a text stay text
        return dict(vocab_size=sp.get_piece_size(), eot=sp.eos_id(), eot_text=sp.id_to_piece(sp.eos_id()),
                    encode=lambda texts: sp.encode(list(texts)), decode=sp.decode)

    def _tokenizers(self):
        from tokenizers import Tokenizer as HFTokenizer
        try:
            tok = HFTokenizer.from_str(self.files[self.name].decode("utf-8"))
        except Exception as e:
            raise TokenizerError(f"{self._where()} is not a tokenizer.json of Hugging Face "
                                 f"tokenizers ({reason(e)})") from None
        tok.encode_special_tokens = True  # "</s>" inside a document stays text, as with SentencePiece
        eos = self._eos_token or _eos_from_config(self.files)
        eot = tok.token_to_id(eos) if eos else None
        if eot is None:
            why = f"{eos!r} is not in its vocabulary" if eos else "tokenizer_config.json names no eos_token"
            raise TokenizerError(f"{self._where()}: no end-of-sequence token to separate documents ({why})")
        return dict(vocab_size=tok.get_vocab_size(with_added_tokens=True), eot=eot, eot_text=eos,
                    encode=lambda texts: [e.ids for e in tok.encode_batch(list(texts), add_special_tokens=False)],
                    decode=lambda ids: tok.decode(ids, skip_special_tokens=False))

    def encode_batch(self, texts):
        """Token ids of each text, no special tokens added: the text "</s>" stays text."""
        return self.backend["encode"](texts)

    def encode(self, text, special=False):
        """Token ids of text; special=True reads the end-of-sequence token's text (eot_text) as that
        token (for prompts), where ordinary encoding leaves it text."""
        if not special or self.eot is None:
            return self.encode_batch([text])[0]
        ids = []
        for i, part in enumerate(text.split(self.eot_text)):
            ids += ([self.eot] if i else []) + (self.encode_batch([part])[0] if part else [])
        return ids

    def decode(self, ids):
        """Text of ids; each end-of-sequence token shows as its text (SentencePiece would drop it), and
        an id outside the vocabulary as U+FFFD: a model's vocab_size may be padded beyond the data's."""
        marks = {self.eot: self.eot_text} if self.eot is not None else {}
        parts, start = [], 0
        for i in [i for i, t in enumerate(ids) if t in marks or not 0 <= t < self.vocab_size] + [len(ids)]:
            parts.append(self.backend["decode"](ids[start:i]) if i > start else "")
            if i < len(ids):
                parts.append(marks.get(ids[i], "\ufffd"))
            start = i + 1
        return "".join(parts)

    def meta(self):
        """What meta.json records, all JSON."""
        meta = {"tokenizer": "bytes" if self.kind == "bytes" else f"{self.kind}:{self.name}", "eot_token": self.eot}
        if self.source:
            meta["tokenizer_source"] = self.source
        return meta

    def hf_files(self):
        """({name: bytes}, why) for a transformers tokenizer (AutoTokenizer) equal to this one: the
        files, or {} and why there are none (tiktoken, a model transformers converts otherwise)."""
        if self.kind == "tokenizers":
            return dict(self.files), None
        if self.kind == "sentencepiece":
            return _sentencepiece_hf_files(self)
        if self.kind == "bytes":
            return _bytes_hf_files(), None
        return {}, f"the data's tokenizer {self.meta()['tokenizer']!r} has no transformers files"


def _bytes_hf_files():
    """tokenizer.json of the byte tokens (id = the byte's value, 256 ids, no special tokens) as GPT-2's
    byte-level tokenizer without its merges: the ByteLevel pre-tokenizer writes each UTF-8 byte as one
    of 256 printable characters (GPT-2's bytes_to_unicode), each of which is a token of its own, and the
    ByteLevel decoder turns them back into bytes, decoded as UTF-8 with invalid bytes as U+FFFD, as
    bytes.decode("utf-8", errors="replace"). use_regex=False: no splitting, a leading space stays one."""
    from tokenizers import Tokenizer as HFTokenizer, decoders, models, pre_tokenizers
    from transformers.convert_slow_tokenizer import bytes_to_unicode
    char = bytes_to_unicode()
    backend = HFTokenizer(models.BPE(vocab={char[b]: b for b in range(256)}, merges=[]))
    backend.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False)
    backend.decoder = decoders.ByteLevel()
    config = {"tokenizer_class": "PreTrainedTokenizerFast", "add_bos_token": False, "add_eos_token": False,
              "clean_up_tokenization_spaces": False}
    return {"tokenizer.json": backend.to_str().encode(),
            "tokenizer_config.json": (json.dumps(config, indent=2) + "\n").encode()}


def _sentencepiece_hf_files(tok):
    """tokenizer.json for a SentencePiece BPE model as Llama 2's, checked against SentencePiece itself.

    transformers converts tokenizer.model (LlamaTokenizer), but its Metaspace pre-tokenizer merges
    a leading space into SentencePiece's dummy prefix; the normalizer of the Llama-2-hf
    tokenizer.json (prepend "▁", spaces to "▁") tokenizes as SentencePiece does. No BOS is added:
    the data has none, documents are separated by the end-of-sequence token.
    """
    import tempfile
    from tokenizers import normalizers, processors
    from transformers import AutoTokenizer
    import sentencepiece as spm
    sp = spm.SentencePieceProcessor(model_proto=tok.files[tok.name])
    piece = lambda i: sp.id_to_piece(i) if i >= 0 else None  # noqa: E731
    config = {"tokenizer_class": "PreTrainedTokenizerFast", "bos_token": piece(sp.bos_id()),
              "eos_token": piece(sp.eos_id()), "unk_token": piece(sp.unk_id()), "add_bos_token": False,
              "add_eos_token": False, "clean_up_tokenization_spaces": False}
    with tempfile.TemporaryDirectory() as d:
        with open(os.path.join(d, "tokenizer.model"), "wb") as f:
            f.write(tok.files[tok.name])
        with open(os.path.join(d, "tokenizer_config.json"), "w") as f:
            json.dump({**config, "tokenizer_class": "LlamaTokenizer", "legacy": True}, f)
        try:
            backend = AutoTokenizer.from_pretrained(d).backend_tokenizer
        except Exception as e:
            return {}, f"transformers cannot convert the SentencePiece model ({reason(e)})"
    backend.normalizer = normalizers.Sequence([normalizers.Prepend("▁"), normalizers.Replace(" ", "▁")])
    backend.pre_tokenizer = None
    backend.post_processor = processors.TemplateProcessing(single="$A", pair="$A $B")  # no BOS
    n = sp.get_piece_size()
    probe = ["Hello world", " leading space", "two  spaces", "line\nbreak\n\n", "tail ", "digits 12345",
             "héllo 数据 🙂"] + [sp.decode(list(range(i, min(i + 16, n)))) for i in range(0, n, 16)]
    for text in probe:
        if backend.encode(text).ids != sp.encode(text):
            return {}, f"transformers' conversion of the SentencePiece model tokenizes {text[:40]!r} otherwise"
    return {"tokenizer.json": backend.to_str().encode(), "tokenizer.model": tok.files[tok.name],
            "tokenizer_config.json": (json.dumps(config, indent=2) + "\n").encode()}, None


def _eos_from_config(files):
    """The eos_token that tokenizer_config.json (or special_tokens_map.json) names, or None."""
    for name in ("tokenizer_config.json", "special_tokens_map.json"):
        try:
            eos = json.loads(files[name]).get("eos_token")
        except (KeyError, ValueError, AttributeError):
            continue
        eos = eos.get("content") if isinstance(eos, dict) else eos  # an AddedToken written as a dict
        if isinstance(eos, str) and eos:
            return eos
    return None


def _read(path):
    try:
        with open(path, "rb") as f:
            return f.read()
    except OSError as e:
        raise TokenizerError(f"cannot read {path} ({reason(e)})") from None


def _from_path(path, source):
    """A tokenizer from a local file (a SentencePiece .model or a tokenizer.json) or a directory."""
    if os.path.isdir(path):
        have = [n for n in HF_TOKENIZER_FILES if os.path.isfile(os.path.join(path, n))]
        if "tokenizer.json" in have:  # what transformers itself reads, added tokens included
            files = {n: _read(os.path.join(path, n)) for n in have if n.endswith(".json")}
            return Tokenizer("tokenizers", "tokenizer.json", files, source=source)
        if "tokenizer.model" in have:
            return Tokenizer("sentencepiece", "tokenizer.model",
                             {"tokenizer.model": _read(os.path.join(path, "tokenizer.model"))}, source=source)
        raise TokenizerError(f"{source}: the directory holds neither tokenizer.json nor tokenizer.model")
    if path.endswith(".json"):
        files = {"tokenizer.json": _read(path)}
        config = os.path.join(os.path.dirname(path), "tokenizer_config.json")
        if os.path.isfile(config):
            files["tokenizer_config.json"] = _read(config)
        return Tokenizer("tokenizers", "tokenizer.json", files, source=source)
    return Tokenizer("sentencepiece", "tokenizer.model", {"tokenizer.model": _read(path)}, source=source)


def _looks_like_path(spec):
    """A hub repo id is NAME or OWNER/NAME; anything else with a path's shape is a missing file."""
    return (spec.startswith((os.sep, ".", "~")) or spec.count("/") > 1 or os.sep != "/" and os.sep in spec
            or spec.endswith((".model", ".json")))


def load(spec):
    """The tokenizer that --tokenizer=SPEC names, in this order:
    a tiktoken encoding name (gpt2, cl100k_base, ...); a local SentencePiece model (Llama 2's
    tokenizer.model); a tokenizer.json; a directory holding tokenizer.json or tokenizer.model; else
    a Hugging Face hub repository (e.g. meta-llama/Llama-2-7b-hf), whose tokenizer files are
    downloaded. A Tokenizer or a tiktoken.Encoding is returned as one."""
    if isinstance(spec, Tokenizer):
        return spec
    import tiktoken
    if isinstance(spec, tiktoken.Encoding):
        return Tokenizer("tiktoken", spec.name, encoding=spec)
    spec = str(spec)
    if spec in tiktoken.list_encoding_names():
        return Tokenizer("tiktoken", spec)
    path = os.path.expanduser(spec)
    if os.path.exists(path):
        return _from_path(path, spec)
    if _looks_like_path(spec):
        raise TokenizerError(f"tokenizer {spec!r}: no such file or directory; give a SentencePiece tokenizer.model, "
                             f"a tokenizer.json, a directory holding one, a hub name, or one of tiktoken's "
                             f"{', '.join(tiktoken.list_encoding_names())}")
    from huggingface_hub import snapshot_download
    try:
        path = snapshot_download(spec, allow_patterns=list(HF_TOKENIZER_FILES))
    except Exception as e:
        encodings = ", ".join(tiktoken.list_encoding_names())
        raise TokenizerError(f"tokenizer {spec!r} is no tiktoken encoding ({encodings}) "
                             f"nor a local path, and the Hugging Face hub did not give it ({reason(e)}); offline, "
                             f"pass a local file: --tokenizer=path/to/tokenizer.model (SentencePiece, as Llama 2's) "
                             f"or a directory holding tokenizer.json") from None
    return _from_path(path, spec)


def from_meta(meta, data_dir=None):
    """The tokenizer that a data directory's meta.json names, its files read from data_dir."""
    spec = meta.get("tokenizer")
    kind, _, name = spec.partition(":") if isinstance(spec, str) else ("", "", "")
    if spec == "bytes":
        return Tokenizer("bytes", "bytes")
    if kind == "tiktoken" and name:
        return Tokenizer("tiktoken", name)
    if kind in ("sentencepiece", "tokenizers") and name:
        names = [name] + (["tokenizer_config.json", "special_tokens_map.json"] if kind == "tokenizers" else [])
        files = {}
        for n in names:
            path = os.path.join(data_dir or ".", n)
            if os.path.isfile(path):
                files[n] = _read(path)
            elif n == name:
                raise TokenizerError(f"{path} is missing: meta.json's tokenizer {spec!r} needs it; prepare the "
                                     f"data again")
        return Tokenizer(kind, name, files, source=os.path.join(data_dir or ".", name))
    raise TokenizerError(f"unknown tokenizer {spec!r} in meta.json; expected 'bytes', 'tiktoken:<encoding>', "
                         f"'sentencepiece:<file>' or 'tokenizers:<file>'")

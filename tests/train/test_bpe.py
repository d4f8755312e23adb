"""The trained BPE tokenizer, embedded in a GGUF, tokenizes exactly like the ``tokenizers`` object."""

from __future__ import annotations

import gguf

from splitspec.text.tokenizer import Tokenizer, write_gguf_tokenizer
from splitspec.train import bpe, corpus
from tests.tools import write_gguf


def test_training_is_deterministic_with_special_tokens_first(small_build):
    texts = corpus.read_texts(small_build.config.root, corpus.select_files(small_build.config), corpus.TRAIN)
    again = bpe.train_bpe(texts, 512)
    assert again.to_str() == small_build.backend().to_str()
    vocab = bpe.gguf_vocab(again)
    assert len(vocab.tokens) == 512 and vocab.special_ids == {bpe.EOT: 0, bpe.MASK: 1}
    assert vocab.token_types[:2] == [int(gguf.TokenType.CONTROL)] * 2
    assert set(vocab.token_types[2:]) == {int(gguf.TokenType.NORMAL)}
    assert len(vocab.merges) == 512 - 2 - 256 and all(len(m.split(" ")) == 2 for m in vocab.merges)


def test_gguf_tokenizer_encodes_and_decodes_like_tokenizers(small_build, tmp_path):
    backend = small_build.backend()
    vocab = bpe.gguf_vocab(backend)
    path = write_gguf(tmp_path / "tok.gguf", lambda w: write_gguf_tokenizer(w, vocab, eos=bpe.EOT, bos=bpe.EOT, pre=bpe.PRE))
    tok = Tokenizer.from_gguf(path)
    assert tok.vocab_size == 512 and tok.eos_token_ids == (0,) and tok.bos_token_id == 0
    texts = small_build.heldout_texts()
    texts += ["caf\u00e9 \u2603 \U0001f600\r\n\tx = '\\x00'\n", f"a{bpe.EOT}b{bpe.MASK}", "    " * 9 + "return 12345\n\n\n"]
    for text in texts:
        ids = backend.encode(text).ids
        assert tok.encode(text) == ids
        assert tok.decode(ids, skip_special_tokens=False) == backend.decode(ids, skip_special_tokens=False)
        assert tok.decode(ids) == backend.decode(ids) == text.replace(bpe.EOT, "").replace(bpe.MASK, "")
    assert tok.encode(f"a{bpe.EOT}")[-1] == 0
    assert sum(len(backend.encode(t).ids) for t in texts[:-3]) < 0.6 * sum(len(t.encode()) for t in texts[:-3])  # 512 tokens compress

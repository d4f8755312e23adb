"""Training text: reading files, directories and JSONL, the held-out split, packing."""

from __future__ import annotations

import json

import numpy as np
import pytest

from splitspec.text.tokenizer import Tokenizer
from splitspec.train.data import load_corpus, pack, read_documents, split_heldout


def test_reads_files_directories_recursively_and_jsonl(tmp_path):
    (tmp_path / "src" / "pkg").mkdir(parents=True)
    (tmp_path / "src" / "a.py").write_text("print(1)\n")
    (tmp_path / "src" / "pkg" / "b.md").write_text("# title\n")
    (tmp_path / "src" / "pkg" / "skip.bin").write_bytes(b"\xff\x00")
    (tmp_path / "src" / "blank.txt").write_text("  \n")
    records = tmp_path / "chat.jsonl"
    records.write_text(json.dumps({"text": "plain"}) + "\n\n" + json.dumps({"prompt": "Q: ", "completion": "A"}) + "\n")
    assert read_documents([tmp_path / "src", records]) == ["print(1)\n", "# title\n", "plain", "Q: A"]
    assert read_documents([tmp_path / "src"], glob="*.md") == ["# title\n"]


@pytest.mark.parametrize(
    "content,message",
    [
        ('{"text": "ok"}\n{"prompt": "only"}\n', r"bad\.jsonl:2: a record needs a string 'text', or 'prompt' and 'completion' \(found \['prompt'\]\)"),
        ('{"text": "ok"}\nnot json\n', r"bad\.jsonl:2: not valid JSON"),
    ],
)
def test_bad_jsonl_names_file_and_line(tmp_path, content, message):
    (tmp_path / "bad.jsonl").write_text(content)
    with pytest.raises(ValueError, match=message):
        read_documents([tmp_path / "bad.jsonl"])


def test_missing_paths_and_no_text_are_errors(tmp_path):
    with pytest.raises(FileNotFoundError, match=r"nope\.txt: no such file or directory"):
        read_documents([tmp_path / "nope.txt"])
    (tmp_path / "d").mkdir()
    (tmp_path / "d" / "x.rs").write_text("fn main() {}")
    with pytest.raises(ValueError, match=r"d: no files match --glob '\*\.py'"):
        read_documents([tmp_path / "d"], glob="*.py")
    (tmp_path / "empty.txt").write_text("\n\n")
    with pytest.raises(ValueError, match="no text in"):
        read_documents([tmp_path / "empty.txt"])
    (tmp_path / "latin1.txt").write_bytes("caf\xe9".encode("latin-1"))
    with pytest.raises(ValueError, match=r"latin1\.txt: not UTF-8 text \(bad byte at offset 3\)"):
        read_documents([tmp_path / "latin1.txt"])


def test_heldout_split_is_by_content_not_order():
    docs = [f"document {i} " * (i + 1) for i in range(20)]
    train, held = split_heldout(docs, 0.2)
    train_rev, held_rev = split_heldout(docs[::-1], 0.2)
    assert set(held) == set(held_rev) and set(train) == set(train_rev)
    assert set(train) | set(held) == set(docs) and not set(train) & set(held)
    assert sum(map(len, held)) >= 0.2 * sum(map(len, docs))
    assert split_heldout(["a", "b"], 0.99)[0]  # one document always stays for training
    with pytest.raises(ValueError, match="at least 2 documents, got 1"):
        split_heldout(["only"], 0.1)
    with pytest.raises(ValueError, match="--heldout-fraction 0: must be between 0 and 1"):
        split_heldout(docs, 0)


def test_pack_lays_documents_end_to_end_with_separators():
    rows = pack([[1, 2, 3], [4, 5], [6, 7, 8, 9]], 4, separator=0)
    np.testing.assert_array_equal(rows, [[1, 2, 3, 0], [4, 5, 0, 6], [7, 8, 9, 0]])
    assert pack([[1, 2, 3]], 4).shape == (0, 4)
    assert pack([[1, 2, 3], [4]], 2).tolist() == [[1, 2], [3, 4]]


def test_load_corpus_packs_with_the_target_tokenizer(tiny_pair, tmp_path):
    tokenizer = Tokenizer.load(tiny_pair.target)
    for i in range(6):
        (tmp_path / f"{i}.txt").write_text(f"text number {i} " * 20)
    corpus = load_corpus([tmp_path], tokenizer, 32, 0.2)
    eos = tokenizer.eos_token_ids[0]
    assert corpus.train.shape[1] == corpus.heldout.shape[1] == 32 and corpus.train.dtype == np.int64
    assert corpus.train_documents + corpus.heldout_documents == 6 and corpus.heldout_documents >= 1
    row = tokenizer.decode(corpus.train[0].tolist())
    assert any((f"text number {i} " * 20).startswith(row) for i in range(6)), row
    assert (corpus.train == eos).sum() >= 1  # the separator between documents
    with pytest.raises(ValueError, match=r"the held-out documents \(2\) hold fewer tokens than one sequence of --seq-len 600"):
        load_corpus([tmp_path], tokenizer, 600, 0.2)

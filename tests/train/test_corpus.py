"""The stdlib corpus: which files, which split, the manifest, and the packed token streams."""

from __future__ import annotations

import hashlib

import numpy as np
import pytest

from splitspec.train import corpus


def _write(root, relative: str, data: bytes) -> None:
    path = root / relative
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_bytes(data)


def test_selection_rules_on_a_fake_stdlib(tmp_path):
    kept = {
        "zlib_tools.py": b"def f():\n    return 1\n",
        "argparse.py": b"# held out\n",
        "json/__init__.py": b"# held out package\n",
        "json/decoder.py": b"x = 1\n",
        "email/parser.py": b"y = 2\n",
        "jsonish.py": b"# not the json package\n",
    }
    dropped = {
        "test/test_x.py": b"",
        "lib2to3/tests/data.py": b"",
        "idlelib/idle_test/t.py": b"",
        "site-packages/pkg/mod.py": b"",
        "pydoc_data/topics.py": b"",
        "config-3.11-x86_64-linux-gnu/python-config.py": b"",
        "_sysconfigdata__linux.py": b"",
        "encodings/cp437.py": b'""" Python Character Mapping Codec cp437 generated from \'VENDORS/CP437.TXT\' with gencodec.py.\n"""\n',
        "big.py": b"#" * 2000,
        "latin1.py": "# caf\u00e9\n".encode("latin-1"),
        "notes.txt": b"not python",
    }
    for relative, data in {**kept, **dropped}.items():
        _write(tmp_path, relative, data)
    config = corpus.CorpusConfig(root=tmp_path, max_file_bytes=1000)
    files = corpus.select_files(config)
    assert [f.path for f in files] == sorted(kept)
    splits = {f.path: f.split for f in files}
    assert {p for p, s in splits.items() if s == corpus.HELDOUT_SPLIT} == {"argparse.py", "json/__init__.py", "json/decoder.py"}
    for f in files:
        assert f.bytes == len(kept[f.path]) and f.sha256 == hashlib.sha256(kept[f.path]).hexdigest()
    only = corpus.select_files(corpus.CorpusConfig(root=tmp_path, only=("json/", "email/")))
    assert [f.path for f in only] == ["email/parser.py", "json/__init__.py", "json/decoder.py"]
    with pytest.raises(ValueError, match="no training files"):
        corpus.select_files(corpus.CorpusConfig(root=tmp_path, only=("json/",)))
    with pytest.raises(FileNotFoundError, match="does not exist"):
        corpus.select_files(corpus.CorpusConfig(root=tmp_path / "missing"))


def test_the_real_stdlib_selection_is_deterministic_and_holds_out_a_few_percent():
    config = corpus.CorpusConfig()
    files = corpus.select_files(config)
    assert files == corpus.select_files(config)
    paths = [f.path for f in files]
    assert paths == sorted(paths)
    assert not [p for p in paths if {"test", "tests", "idle_test", "site-packages"} & set(p.split("/"))]
    assert "pydoc_data/topics.py" not in paths and "encodings/cp437.py" not in paths
    assert "encodings/utf_8.py" in paths and "asyncio/events.py" in paths
    heldout = [f for f in files if f.split == corpus.HELDOUT_SPLIT]
    assert {f.path for f in heldout} >= {"argparse.py", "json/__init__.py", "textwrap.py", "string.py"}
    share = sum(f.bytes for f in heldout) / sum(f.bytes for f in files)
    assert 0.03 <= share <= 0.05, share
    listing = corpus.manifest(config, files)
    assert listing["licence"] == "PSF-2.0" and listing["licence_file"].endswith(("LICENSE.txt", "LICENSE"))
    assert listing["totals"]["heldout"]["files"] == len(heldout) and len(listing["files"]) == len(files)


def test_pack_separates_documents_and_round_trips(tmp_path):
    def encode_batch(texts):
        return [[ord(c) for c in t] for t in texts]

    stream = corpus.pack(encode_batch, ["ab", "", "c"], eot_id=0)
    assert stream.dtype == np.uint16 and stream.tolist() == [97, 98, 0, 0, 99, 0]
    corpus.save_packed(tmp_path / "c.npz", stream, stream[:2], {"eot_id": 0})
    train, heldout, info = corpus.load_packed(tmp_path / "c.npz")
    assert train.tolist() == stream.tolist() and heldout.tolist() == [97, 98] and info == {"eot_id": 0}
    with pytest.raises(ValueError, match="uint16"):
        corpus.pack(lambda texts: [[70_000]], ["x"], eot_id=0)
    np.savez(tmp_path / "bad.npz", train=stream)
    with pytest.raises(ValueError, match="bad.npz: packed corpus has no 'heldout' array"):
        corpus.load_packed(tmp_path / "bad.npz")


def test_build_corpus_keeps_held_out_text_out_of_training(small_build):
    train, heldout, info = corpus.load_packed(small_build.packed)
    files = corpus.select_files(small_build.config)
    eot = info["eot_id"]
    assert int((train == eot).sum()) == sum(f.split == corpus.TRAIN for f in files)
    assert int((heldout == eot).sum()) == sum(f.split == corpus.HELDOUT_SPLIT for f in files)
    backend = small_build.backend()
    # The first training document decodes to the first training file, the held-out one likewise.
    first_train = next(f for f in files if f.split == corpus.TRAIN)
    first_heldout = next(f for f in files if f.split == corpus.HELDOUT_SPLIT)
    assert backend.decode(train[: int(np.argmax(train == eot))].tolist()) == (small_build.config.root / first_train.path).read_text()
    assert backend.decode(heldout[: int(np.argmax(heldout == eot))].tolist()) == (small_build.config.root / first_heldout.path).read_text()
    assert info["vocab_size"] == small_build.counts["vocab_size"] == 512

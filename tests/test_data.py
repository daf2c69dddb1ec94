"""Tests of the trainer's data layer (elbowroom/train/data.py): CPU, fast."""

from __future__ import annotations

import importlib.util
import json
import os
import pickle
import stat
import sys
from pathlib import Path

import numpy as np
import pytest
import torch

from elbowroom.train import data as D
from elbowroom.train import tokens


def write_tokens(path: Path, tokens: list[int], dtype: str = "uint16", meta: dict | None = None) -> Path:
    """Writes a raw token file, and a sidecar (with prepare's format magic) when ``meta`` is given."""
    np.asarray(tokens, dtype=dtype).tofile(path)
    if meta is not None:
        D.sidecar_path(path).write_text(json.dumps({"format": D.TOKEN_FORMAT, "version": 1, **meta}))
    return path


def batches_equal(a: dict, b: dict) -> bool:
    return a.keys() == b.keys() and all(
        torch.equal(a[k], b[k]) if isinstance(a[k], torch.Tensor) else a[k] == b[k] for k in a
    )


def rng_unchanged(fn) -> bool:
    """Runs ``fn`` and tells whether the global torch RNG state is the same afterwards."""
    before = torch.random.get_rng_state()
    fn()
    return torch.equal(before, torch.random.get_rng_state())


# --------------------------------------------------------------------------------------------------
# Built-in corpus
# --------------------------------------------------------------------------------------------------


def test_default_corpus_is_deterministic_bytes_with_eos_separated_documents(tmp_path):
    first = D.load_tokens(None, cache_dir=tmp_path / "a")
    second = D.load_tokens(None, cache_dir=tmp_path / "b")
    assert first.path.read_bytes() == second.path.read_bytes()
    tokens = np.asarray(first.tokens)
    assert tokens.dtype == np.uint16
    assert 2 * 2**20 <= len(tokens) <= 8 * 2**20 + 10_000  # ~4-8 MB of text plus one eos per file
    assert tokens.max() < 256
    assert (first.vocab_size, first.eos_id, first.tokenizer) == (256, 0, "bytes")
    eos = np.flatnonzero(tokens == 0)
    assert len(eos) > 100  # many documents (files) ...
    assert eos[-1] == len(tokens) - 1  # ... each one terminated by eos
    assert np.all(np.diff(eos) > 1)  # no empty documents: NUL bytes were stripped from the sources
    meta = json.loads(D.sidecar_path(first.path).read_text())
    assert meta == {"format": "elbowroom-tokens", "version": 1, "dtype": "uint16", "vocab_size": 256,
                    "num_tokens": len(tokens), "eos_id": 0, "tokenizer": "bytes"}  # fmt: skip
    assert sorted(p.name for p in (tmp_path / "a").iterdir()) == [first.path.name, first.path.name + ".json"]


def test_default_corpus_is_loaded_from_the_cache(tmp_path, monkeypatch):
    path = D.build_default_corpus(tmp_path)

    def no_rebuild():
        raise AssertionError("the cached corpus should have been reused")

    monkeypatch.setattr(tokens, "_corpus_files", no_rebuild)
    token_file = D.load_tokens(None, cache_dir=tmp_path)
    assert token_file.path == path
    assert isinstance(token_file.tokens, np.memmap)


# --------------------------------------------------------------------------------------------------
# prepare()
# --------------------------------------------------------------------------------------------------


def test_prepare_bytes_round_trip(tmp_path):
    text = "héllo\x00 wörld\n".encode()
    (tmp_path / "in.txt").write_bytes(text)
    meta = D.prepare(tmp_path / "in.txt", tmp_path / "out" / "x.bin", progress=False)
    expected = list(text.replace(b"\x00", b"")) + [0]
    assert meta == {"format": "elbowroom-tokens", "version": 1, "dtype": "uint16", "vocab_size": 256,
                    "num_tokens": len(expected), "eos_id": 0, "tokenizer": "bytes"}  # fmt: skip
    token_file = D.load_tokens(tmp_path / "out" / "x.bin")
    assert token_file.tokens.tolist() == expected
    assert (token_file.vocab_size, token_file.eos_id) == (256, 0)
    assert bytes(token_file.tokens[:-1].astype(np.uint8)).decode() == "héllo wörld\n"
    assert sorted(p.name for p in (tmp_path / "out").iterdir()) == ["x.bin", "x.bin.json"]  # no temp files


def test_prepare_failing_midway_leaves_the_old_file_and_no_temp_file(tmp_path, monkeypatch):
    (tmp_path / "in.txt").write_text("abc")
    D.prepare(tmp_path / "in.txt", tmp_path / "x.bin", progress=False)
    old = (tmp_path / "x.bin").read_bytes()

    def failing_encoder(eos):
        def encode(block):
            raise RuntimeError("disk full")

        return encode

    monkeypatch.setattr(tokens, "_byte_encoder", failing_encoder)
    (tmp_path / "in.txt").write_text("something else")
    with pytest.raises(RuntimeError, match="disk full"):
        D.prepare(tmp_path / "in.txt", tmp_path / "x.bin", progress=False)
    assert (tmp_path / "x.bin").read_bytes() == old
    assert sorted(p.name for p in tmp_path.iterdir()) == ["in.txt", "x.bin", "x.bin.json"]


@pytest.mark.parametrize("umask, mode", [(0o022, 0o644), (0o077, 0o600)])
def test_prepare_writes_files_with_the_users_umask(tmp_path, umask, mode):
    """The token file and its sidecar get the mode of any file the user writes, not mkstemp's private 0600."""
    from elbowroom.cli import main

    (tmp_path / "in.txt").write_text("some text")
    old = os.umask(umask)
    try:
        assert main(["prepare", str(tmp_path / "in.txt"), str(tmp_path / "x.bin"), "--no-progress"]) == 0
    finally:
        os.umask(old)
    assert {p.name: stat.S_IMODE(p.stat().st_mode) for p in tmp_path.glob("x.bin*")} == {
        "x.bin": mode, "x.bin.json": mode}


@pytest.mark.parametrize("where", ["tokens", "sidecar"])
def test_ctrl_c_during_prepare_exits_130_and_leaves_no_partial_output(tmp_path, monkeypatch, capsys, caplog, where):
    """Ctrl-C while the tokens or the sidecar are written: one line, exit 130, no file of the output left."""
    from elbowroom.cli import main

    def interrupted(*args, **kwargs):
        raise KeyboardInterrupt

    if where == "tokens":
        monkeypatch.setattr(tokens, "_byte_encoder", lambda eos: interrupted)
    else:  # the token file is in place already: without its sidecar it must go too
        monkeypatch.setattr(tokens, "_write_sidecar", interrupted)
    (tmp_path / "in.txt").write_text("some text")
    try:
        code = main(["prepare", str(tmp_path / "in.txt"), str(tmp_path / "x.bin"), "--no-progress"])
    except KeyboardInterrupt:
        pytest.fail("the Ctrl-C ended `elbowroom prepare` in a traceback")
    assert code == 130
    assert [r.getMessage() for r in caplog.records if r.levelname != "INFO"] == [
        f"interrupted; {tmp_path / 'x.bin'} was not written"]
    assert capsys.readouterr().err == ""  # no traceback
    assert sorted(p.name for p in tmp_path.iterdir()) == ["in.txt"]


def test_prepare_directory_reads_txt_files_sorted_each_followed_by_eos(tmp_path):
    (tmp_path / "docs").mkdir()
    (tmp_path / "docs" / "b.txt").write_text("bb")
    (tmp_path / "docs" / "a.txt").write_text("a")
    (tmp_path / "docs" / "c.md").write_text("not text data")
    D.prepare(tmp_path / "docs", tmp_path / "x.bin", progress=False)
    assert D.load_tokens(tmp_path / "x.bin").tokens.tolist() == [ord("a"), 0, ord("b"), ord("b"), 0]


def test_prepare_eos_choices(tmp_path):
    (tmp_path / "in.txt").write_text("ab")
    assert D.prepare(tmp_path / "in.txt", tmp_path / "none.bin", eos_id=None, progress=False)["eos_id"] is None
    assert D.load_tokens(tmp_path / "none.bin").tokens.tolist() == [97, 98]
    meta = D.prepare(tmp_path / "in.txt", tmp_path / "big.bin", eos_id=300, progress=False)
    assert (meta["vocab_size"], meta["dtype"]) == (301, "uint16")
    assert D.load_tokens(tmp_path / "big.bin").tokens.tolist() == [97, 98, 300]
    with pytest.raises(D.DataError, match="eos_id must be"):
        D.prepare(tmp_path / "in.txt", tmp_path / "neg.bin", eos_id=-1, progress=False)


def test_prepare_with_tokenizer_without_the_package_names_the_install(tmp_path, monkeypatch):
    (tmp_path / "in.txt").write_text("hello")
    (tmp_path / "tokenizer.json").write_text("{}")
    monkeypatch.setitem(sys.modules, "tokenizers", None)  # makes `import tokenizers` fail
    with pytest.raises(ImportError, match="pip install tokenizers"):
        D.prepare(tmp_path / "in.txt", tmp_path / "x.bin", tokenizer=tmp_path / "tokenizer.json")
    assert not (tmp_path / "x.bin").exists()


@pytest.mark.skipif(importlib.util.find_spec("tokenizers") is None, reason="needs the tokenizers package")
def test_prepare_with_tokenizer(tmp_path):
    from tokenizers import Tokenizer, models, pre_tokenizers

    vocab = {"[UNK]": 0, "</s>": 1, "hello": 2, "world": 3, "again": 4}
    tok = Tokenizer(models.WordLevel(vocab, unk_token="[UNK]"))
    tok.pre_tokenizer = pre_tokenizers.Whitespace()
    tok.save(str(tmp_path / "tokenizer.json"))
    (tmp_path / "docs").mkdir()
    (tmp_path / "docs" / "1.txt").write_text("hello world\nhello again\n")
    (tmp_path / "docs" / "2.txt").write_text("world what")
    meta = D.prepare(tmp_path / "docs", tmp_path / "x.bin", tokenizer=tmp_path / "tokenizer.json", progress=False)
    assert (meta["vocab_size"], meta["eos_id"], meta["dtype"]) == (5, 1, "uint16")
    assert meta["tokenizer"] == str((tmp_path / "tokenizer.json").resolve())
    assert D.load_tokens(tmp_path / "x.bin").tokens.tolist() == [2, 3, 2, 4, 1, 3, 0, 1]


@pytest.mark.skipif(importlib.util.find_spec("tokenizers") is None, reason="needs the tokenizers package")
def test_a_tokenizer_file_that_is_not_one_exits_2(tmp_path, capsys):
    from elbowroom.cli import main

    (tmp_path / "in.txt").write_text("hello")
    (tmp_path / "plan.json").write_text('{"blocks": [], "budget_bytes": 1}')  # another JSON file
    args = ["prepare", str(tmp_path / "in.txt"), str(tmp_path / "x.bin"), "--tokenizer", str(tmp_path / "plan.json")]
    assert main(args) == 2
    err = capsys.readouterr().err
    assert f"tokenizer file {tmp_path / 'plan.json'} is not a Hugging Face tokenizer.json" in err, err
    assert err.count("\n") == 1 and not (tmp_path / "x.bin").exists()


# --------------------------------------------------------------------------------------------------
# Errors: each names the problem and the fix
# --------------------------------------------------------------------------------------------------


def test_missing_files_are_data_errors(tmp_path):
    with pytest.raises(D.DataError, match=r"does not exist; run `elbowroom prepare INPUT.txt .*nope.bin` first"):
        D.load_tokens(tmp_path / "nope.bin")
    with pytest.raises(D.DataError, match="does not exist"):
        D.prepare(tmp_path / "nope.txt", tmp_path / "x.bin")
    (tmp_path / "empty_dir").mkdir()
    with pytest.raises(D.DataError, match=r"no \*.txt files"):
        D.prepare(tmp_path / "empty_dir", tmp_path / "x.bin")


def test_empty_files_are_data_errors(tmp_path):
    (tmp_path / "x.bin").write_bytes(b"")
    with pytest.raises(D.DataError, match=r"x.bin is empty \(0 tokens\); run `elbowroom prepare"):
        D.load_tokens(tmp_path / "x.bin")
    (tmp_path / "in.txt").write_text("")
    with pytest.raises(D.DataError, match="is empty"):
        D.prepare(tmp_path / "in.txt", tmp_path / "y.bin")
    assert not (tmp_path / "y.bin").exists()


def test_bin_size_not_a_multiple_of_the_dtype_is_a_data_error(tmp_path):
    (tmp_path / "x.bin").write_bytes(b"\x01\x00\x02")
    with pytest.raises(D.DataError, match="3 bytes, not a multiple of 2.*pass the right dtype"):
        D.load_tokens(tmp_path / "x.bin")
    (tmp_path / "y.bin").write_bytes(b"\x01\x00\x02\x00\x03\x00")
    with pytest.raises(D.DataError, match="not a multiple of 4"):
        D.load_tokens(tmp_path / "y.bin", dtype="uint32")


def test_sidecar_disagreements_are_data_errors(tmp_path):
    meta = {"dtype": "uint16", "vocab_size": 10, "num_tokens": 5, "eos_id": None, "tokenizer": "bytes"}
    path = write_tokens(tmp_path / "x.bin", [1, 2, 3], meta=meta)
    with pytest.raises(D.DataError, match="holds 3 tokens but its sidecar .* says 5"):
        D.load_tokens(path)
    write_tokens(path, [1, 2, 3, 4, 5], meta=meta)
    with pytest.raises(D.DataError, match="sidecar .* says 'uint16'"):
        D.load_tokens(path, dtype="uint32")
    D.sidecar_path(path).write_text(json.dumps({"dtype": "uint16"}))
    with pytest.raises(D.DataError, match="lacks vocab_size"):
        D.load_tokens(path)


def test_too_few_tokens_for_one_sequence_is_a_data_error():
    with pytest.raises(D.DataError, match=r"validation split has 8 tokens, fewer than seq_len \+ 1 = 9"):
        D.ChunkDataset(np.arange(8, dtype=np.uint16), 8, name="validation split")
    assert len(D.ChunkDataset(np.arange(9, dtype=np.uint16), 8)) == 1
    with pytest.raises(D.DataError, match="no document of 2 or more tokens"):
        D.DocumentDataset(np.array([0, 0, 5], dtype=np.uint16), 8, 0)
    with pytest.raises(D.DataError, match="no eos_id"):
        D.DocumentDataset(np.arange(20, dtype=np.uint16), 8, None)


def test_check_vocab():
    D.check_vocab(256, 256)
    D.check_vocab(100, 256)
    with pytest.raises(D.DataError, match="data has vocab_size 300 but the model's vocab_size is 256.*at least 300"):
        D.check_vocab(300, 256)


# --------------------------------------------------------------------------------------------------
# Loading and splitting
# --------------------------------------------------------------------------------------------------


def test_load_without_sidecar_infers_dtype_and_vocab(tmp_path):
    write_tokens(tmp_path / "a.bin", [3, 70000, 2], dtype="uint32")
    token_file = D.load_tokens(tmp_path / "a.bin", dtype="uint32")
    assert token_file.tokens.tolist() == [3, 70000, 2]
    assert (token_file.vocab_size, token_file.eos_id, token_file.tokenizer) == (70001, None, None)
    write_tokens(tmp_path / "b.bin", [3, 9, 2])
    token_file = D.load_tokens(tmp_path / "b.bin", eos_id=2)  # uint16 by default
    assert token_file.tokens.dtype == np.uint16 and token_file.tokens.tolist() == [3, 9, 2]
    assert (token_file.vocab_size, token_file.eos_id) == (10, 2)
    assert D.load_tokens(tmp_path / "b.bin", vocab_size=512).vocab_size == 512


def test_split_holds_out_the_last_fraction(tmp_path):
    write_tokens(tmp_path / "x.bin", list(range(100)))
    token_file = D.load_tokens(tmp_path / "x.bin")
    train, val = D.split(token_file, 0.25)
    assert train.tolist() == list(range(75)) and val.tolist() == list(range(75, 100))
    assert isinstance(val, np.memmap)
    train, val = D.split(np.arange(10), 0.0)
    assert len(train) == 10 and len(val) == 0
    with pytest.raises(D.DataError, match=r"val_fraction must be in \[0, 1\)"):
        D.split(token_file, 1.0)


# --------------------------------------------------------------------------------------------------
# Datasets and collation
# --------------------------------------------------------------------------------------------------


def test_chunk_dataset_windows_are_next_token_shifted():
    tokens = np.arange(23, dtype=np.uint16)
    ds = D.ChunkDataset(tokens, 5)
    assert len(ds) == 4  # windows of 6 tokens starting at 0, 5, 10, 15; 20 would need token 25
    for i in range(len(ds)):
        item = ds[i]
        assert item["input_ids"].dtype == torch.long
        assert item["input_ids"].tolist() == list(range(5 * i, 5 * i + 5))
        assert item["targets"].tolist() == list(range(5 * i + 1, 5 * i + 6))
    with pytest.raises(IndexError):
        ds[4]


def test_datasets_on_a_memmap_pickle_by_file_name(tmp_path):
    write_tokens(tmp_path / "x.bin", list(range(1000)))
    train, val = D.split(D.load_tokens(tmp_path / "x.bin"), 0.5)
    ds = D.ChunkDataset(val, 10)
    blob = pickle.dumps(ds)
    assert len(blob) < 1000  # the 500 tokens were not copied into the pickle
    clone = pickle.loads(blob)
    assert isinstance(clone.tokens, np.memmap)
    assert clone[3]["input_ids"].tolist() == ds[3]["input_ids"].tolist() == list(range(530, 540))


def reference_pieces(tokens: list[int], seq_len: int, eos_id: int) -> list[list[int]]:
    """Document pieces computed the slow, obvious way."""
    docs, doc = [], []
    for t in tokens:
        doc.append(t)
        if t == eos_id:
            docs.append(doc)
            doc = []
    docs.append(doc)
    pieces = []
    for doc in docs:
        for start in range(0, len(doc) - 1, seq_len):
            pieces.append(doc[start : start + seq_len + 1])
    return pieces


def test_document_dataset_boundaries():
    tokens = np.array([5, 6, 0, 0, 7, 8, 9, 10, 11, 0, 12], dtype=np.uint16)
    ds = D.DocumentDataset(tokens, 2, eos_id=0)
    pieces = [ds[i]["input_ids"].tolist() + ds[i]["targets"].tolist()[-1:] for i in range(len(ds))]
    # [0] (empty document) and the trailing [12] have no target and are dropped; the long document is
    # cut into pieces of at most 3 tokens that share one token, so each of its 5 targets occurs once.
    assert pieces == [[5, 6, 0], [7, 8, 9], [9, 10, 11], [11, 0]]
    for i in range(len(ds)):
        assert ds[i]["targets"][:-1].tolist() == ds[i]["input_ids"][1:].tolist()

    rng = np.random.default_rng(0)
    tokens = rng.integers(0, 6, size=5000).astype(np.uint16)  # eos 0 about every 6 tokens, some runs of it
    tokens[1000:1100] = 3  # and one long document
    ds = D.DocumentDataset(tokens, 16, eos_id=0)
    got = [ds[i]["input_ids"].tolist() + ds[i]["targets"].tolist()[-1:] for i in range(len(ds))]
    assert got == reference_pieces(tokens.tolist(), 16, 0)
    assert max(len(p) for p in got) == 17


def test_pad_collate_masks_padding_and_counts_tokens():
    ds = D.DocumentDataset(np.array([1, 2, 3, 0, 4, 0, 5, 6, 0], dtype=np.uint16), 8, eos_id=0)
    batch = D.pad_collate([ds[0], ds[1], ds[2]], pad_id=7)
    assert batch["input_ids"].tolist() == [[1, 2, 3], [4, 7, 7], [5, 6, 7]]
    assert batch["targets"].tolist() == [[2, 3, 0], [0, -100, -100], [6, 0, -100]]
    assert batch["num_tokens"] == 6 == int((batch["targets"] != -100).sum())
    assert type(batch["num_tokens"]) is int


def test_collate_stacks_and_counts_tokens():
    ds = D.ChunkDataset(np.arange(13, dtype=np.uint16), 4)
    batch = D.collate([ds[0], ds[2]])
    assert batch["input_ids"].tolist() == [[0, 1, 2, 3], [8, 9, 10, 11]]
    assert batch["targets"].tolist() == [[1, 2, 3, 4], [9, 10, 11, 12]]
    assert batch["num_tokens"] == 8 and type(batch["num_tokens"]) is int


# --------------------------------------------------------------------------------------------------
# Sampling and loading
# --------------------------------------------------------------------------------------------------


def take(iterable, n: int) -> list:
    iterator = iter(iterable)
    return [next(iterator) for _ in range(n)]


def test_resumable_sampler_resumes_exactly_across_epochs():
    n = 7
    stream = take(D.ResumableSampler(n, seed=3), 5 * n)
    for epoch in range(5):
        assert sorted(stream[epoch * n : (epoch + 1) * n]) == list(range(n))  # each epoch is a permutation
    assert stream[:n] != stream[n : 2 * n]  # a new permutation every epoch
    for start in (0, 5, 7, 12, 20):  # mid-epoch, at and across epoch boundaries
        assert take(D.ResumableSampler(n, seed=3, start=start), 5 * n - start) == stream[start:]
    assert take(D.ResumableSampler(n, seed=4), n) != stream[:n]
    assert take(D.ResumableSampler(n, seed=3, start=5, shuffle=False), 4) == [5, 6, 0, 1]


def test_resumable_sampler_never_touches_the_global_rng():
    torch.manual_seed(123)
    assert rng_unchanged(lambda: take(D.ResumableSampler(50, seed=0, start=30), 200))


def make_loader(num_workers: int, start_sample: int = 0) -> torch.utils.data.DataLoader:
    ds = D.ChunkDataset(np.arange(200, dtype=np.uint16), 8)  # 24 samples
    return D.build_dataloader(
        ds, batch_size=5, seed=1, start_sample=start_sample, num_workers=num_workers, pin_memory=True,
        persistent_workers=True, collate_fn=D.collate,
    )  # fmt: skip


def test_build_dataloader_workers_resume_and_global_rng():
    torch.manual_seed(0)
    batches = []

    def iterate(num_workers: int, start: int, n: int) -> None:
        batches.append(take(make_loader(num_workers, start), n))

    assert rng_unchanged(lambda: iterate(0, 0, 12))  # 60 samples: crosses two epoch boundaries
    assert rng_unchanged(lambda: iterate(2, 0, 12))
    assert rng_unchanged(lambda: iterate(0, 5 * 7, 5))  # resumed after 7 batches
    plain, workers, resumed = batches
    assert all(batches_equal(a, b) for a, b in zip(plain, workers, strict=True))
    assert all(batches_equal(a, b) for a, b in zip(plain[7:], resumed, strict=True))
    assert plain[0]["num_tokens"] == 40 and type(workers[0]["num_tokens"]) is int
    assert not make_loader(0).persistent_workers and make_loader(2).persistent_workers
    assert make_loader(0).pin_memory == torch.cuda.is_available()
    epoch0 = torch.cat([b["input_ids"][:, 0] for b in plain[:5]])[:24] // 8
    assert sorted(epoch0.tolist()) == list(range(24)) and epoch0.tolist() != list(range(24))


def test_build_eval_loader_is_the_first_batches_in_order():
    ds = D.ChunkDataset(np.arange(200, dtype=np.uint16), 8)  # 24 samples
    loader = D.build_eval_loader(ds, 5, 3, D.collate)
    torch.manual_seed(0)
    first = []
    assert rng_unchanged(lambda: first.extend(loader))
    assert [b["input_ids"][:, 0].tolist() for b in first] == [[0, 8, 16, 24, 32], [40, 48, 56, 64, 72],
                                                              [80, 88, 96, 104, 112]]  # fmt: skip
    assert all(batches_equal(a, b) for a, b in zip(first, loader, strict=True))  # the same every evaluation
    short = list(D.build_eval_loader(ds, 10, 5, D.collate))  # asks for 50 samples of 24
    assert [len(b["input_ids"]) for b in short] == [10, 10, 4]


# --------------------------------------------------------------------------------------------------
# Device prefetch
# --------------------------------------------------------------------------------------------------


def test_device_prefetcher_on_cpu_yields_the_same_batches_and_stops():
    ds = D.DocumentDataset(np.tile(np.array([1, 2, 3, 0, 4, 0], dtype=np.uint16), 10), 8, eos_id=0)
    loader = D.build_eval_loader(ds, 3, 4, D.pad_collate)
    expected = list(loader)
    got = list(D.DevicePrefetcher(loader, "cpu"))
    assert len(got) == len(expected) == 4
    assert all(batches_equal(a, b) for a, b in zip(got, expected, strict=True))
    prefetcher = D.DevicePrefetcher([[torch.ones(2), 5]], torch.device("cpu"))
    assert next(prefetcher)[1] == 5
    with pytest.raises(StopIteration):
        next(prefetcher)


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
def test_device_prefetcher_on_cuda_matches_plain_copies():
    loader = make_loader(2)  # pinned batches
    expected = take(make_loader(2), 20)
    got = []
    for batch in take(D.DevicePrefetcher(loader, "cuda"), 20):
        assert batch["input_ids"].is_cuda and type(batch["num_tokens"]) is int
        torch.cuda._sleep(1_000_000)  # keep the stream busy so a copy that raced ahead would show
        got.append({k: v.cpu() if isinstance(v, torch.Tensor) else v for k, v in batch.items()})
    assert all(batches_equal(a, b) for a, b in zip(got, expected, strict=True))
    ds = D.ChunkDataset(np.arange(100, dtype=np.uint16), 8)
    finite = D.build_eval_loader(ds, 4, 2, D.collate, pin_memory=True)
    assert len(list(D.DevicePrefetcher(finite, "cuda"))) == 2


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
def test_pinning_loader_leaves_the_training_thread_its_threads():
    # the DataLoader's pinning thread sets torch's count to 1 for the process; the prefetcher gives it back
    n = torch.get_num_threads()
    torch.set_num_threads(4)
    try:
        loader = make_loader(2)  # pin_memory=True
        batches = iter(D.DevicePrefetcher(loader, "cuda"))
        next(batches)
        assert torch.get_num_threads() == 4
    finally:
        torch.set_num_threads(n)


def test_a_crash_with_loader_workers_alive_still_exits() -> None:
    """The workers ignore SIGTERM (the trainer stops them itself); an uncaught error while they run must still end
    the process (multiprocessing's exit handler would terminate them with SIGTERM and wait forever)."""
    import subprocess

    script = (
        "import torch\n"
        "from elbowroom.train import data as D\n"
        "ds = D.ChunkDataset((torch.arange(4000) % 256).numpy(), 16)\n"
        "loader = D.build_dataloader(ds, batch_size=4, seed=0, start_sample=0, num_workers=1, pin_memory=False,\n"
        "                            persistent_workers=True, collate_fn=D.collate)\n"
        "batches = iter(loader)\n"
        "next(batches)\n"
        "raise ValueError('a bug after the workers started')\n"
    )
    r = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, timeout=60)
    assert r.returncode == 1 and "a bug after the workers started" in r.stderr, r.stderr

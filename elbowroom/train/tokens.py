"""Token files and the built-in corpus: what ``elbowroom prepare`` writes and what the trainer reads.

Token files are nanoGPT-style: a raw ``.bin`` of ``uint16`` or ``uint32`` tokens, memory-mapped, with a
small JSON sidecar next to it (``runs/x.bin`` -> ``runs/x.bin.json``)::

    {"format": "elbowroom-tokens", "version": 1, "dtype": "uint16", "vocab_size": 256, "num_tokens": 123,
     "eos_id": 0, "tokenizer": "bytes"}

``format`` is the magic that says ``elbowroom prepare`` wrote the pair. The trainer reads only such
files: any other file (raw text, random bytes) would be read as tokens and trained on as noise. With no data
file the built-in corpus is used: byte-level Python standard-library source, built on first use and cached.
"""

from __future__ import annotations

import contextlib
import json
import logging
import mmap
import os
import sys
import sysconfig
import uuid
from collections.abc import Callable, Iterator, Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, BinaryIO, Literal

import numpy as np

logger = logging.getLogger("elbowroom.train.data")

BYTE_EOS_ID = 0
"""End-of-document token of byte-level data: byte 0 never occurs in text or source files."""

_DTYPES = {"uint16": np.uint16, "uint32": np.uint32}

TOKEN_FORMAT = "elbowroom-tokens"
"""The sidecar's ``format`` value: the magic of a token file written by ``prepare``."""
TOKEN_FORMAT_VERSION = 1
"""The sidecar's ``version``; readers refuse newer ones."""

# The built-in corpus: top-level stdlib modules plus these packages (tests excluded), sorted by relative
# path and capped, so that it is ~6-8 MB and the same on every machine with the same Python minor version.
# Bump _CORPUS_VERSION whenever the selection changes, so stale caches are not reused.
_CORPUS_VERSION = 3
_CORPUS_PACKAGES = (
    "asyncio", "collections", "concurrent", "email", "http", "importlib", "json", "logging", "re", "urllib",
)  # fmt: skip
_CORPUS_EXCLUDED_PARTS = frozenset({"test", "tests", "idle_test", "site-packages", "dist-packages"})
_CORPUS_MAX_BYTES = 8 * 2**20

# Text is read and written in blocks of this many bytes so that prepare() streams large inputs.
_BLOCK_BYTES = 16 * 2**20
# Inputs at least this large get a progress bar.
_PROGRESS_MIN_BYTES = 64 * 2**20
# Tokens scanned at once when searching a token file (max token, eos positions).
_SCAN_TOKENS = 2**24
# Special tokens tried, in order, as the end-of-document token of a Hugging Face tokenizer.
_EOS_CANDIDATES = ("<|endoftext|>", "</s>", "<|end_of_text|>", "<eos>", "<|eot_id|>", "<|im_end|>")


class DataError(ValueError):
    """A data file or data setting the trainer cannot use; the message says how to fix it."""


# --------------------------------------------------------------------------------------------------
# Token files
# --------------------------------------------------------------------------------------------------


def sidecar_path(path: str | os.PathLike[str]) -> Path:
    """The JSON sidecar of a token file: ``runs/x.bin`` -> ``runs/x.bin.json``."""
    path = Path(path)
    return path.with_name(path.name + ".json")


def default_cache_dir() -> Path:
    """``~/.cache/elbowroom``; the CLI lets ``ELBOWROOM_CACHE`` override it, the library never reads env vars."""
    return Path("~/.cache/elbowroom").expanduser()


@dataclass
class TokenFile:
    """A 1-D token array (usually a read-only memmap) and what is known about it.

    Attributes:
        tokens: The tokens, 1-D ``uint16`` or ``uint32``.
        path: The ``.bin`` file the tokens come from; None for in-memory tokens.
        eos_id: End-of-document token, or None when the data has no document separator.
        tokenizer: ``"bytes"``, the path of a ``tokenizer.json``, or None when unknown.
    """

    tokens: np.ndarray
    path: Path | None = None
    eos_id: int | None = None
    tokenizer: str | None = None
    _vocab_size: int | None = field(default=None, repr=False)

    @property
    def vocab_size(self) -> int:
        """From the sidecar if there is one; otherwise max token + 1, computed once (a full scan)."""
        if self._vocab_size is None:
            logger.info("computing vocab_size of %s as max token + 1 (no sidecar)", self.path or "tokens")
            self._vocab_size = _max_token(self.tokens) + 1
        return self._vocab_size

    @property
    def num_tokens(self) -> int:
        return len(self.tokens)


def load_tokens(
    path: str | os.PathLike[str] | None,
    *,
    cache_dir: str | os.PathLike[str] | None = None,
    dtype: str | None = None,
    vocab_size: int | None = None,
    eos_id: int | None = None,
    require_sidecar: bool = False,
) -> TokenFile:
    """Memory-maps a token file, or the built-in corpus when ``path`` is None.

    Args:
        path: A ``.bin`` token file, or None for the built-in byte-level corpus.
        cache_dir: Where the built-in corpus is cached; None means :func:`default_cache_dir`.
        dtype: ``"uint16"`` or ``"uint32"``, for files without a sidecar (default ``"uint16"``).
        vocab_size: For files without a sidecar; None means max token + 1, computed when first asked.
        eos_id: For files without a sidecar; None means the data has no document separator.
        require_sidecar: Refuse a file without the sidecar ``prepare`` writes (what the trainer does).

    Returns:
        The tokens (a read-only ``np.memmap``) and their metadata.

    Raises:
        DataError: The file is missing, empty, truncated, or disagrees with its sidecar or ``dtype``.
    """
    if path is None:
        path = build_default_corpus(cache_dir)
    path = Path(path)
    if not path.is_file():
        raise DataError(
            f"data file {path} does not exist; run `elbowroom prepare INPUT.txt {path}` first, "
            "or leave the data path unset to train on the built-in corpus"
        )
    meta = _read_sidecar(path)
    if meta is None and require_sidecar and path.stat().st_size > 0:
        raise DataError(
            f"data file {path} has no sidecar {sidecar_path(path).name}, so it was not written by `elbowroom "
            "prepare` (raw text or any other bytes would be read as tokens and train on noise); make a token "
            "file with `elbowroom prepare INPUT.txt OUT.bin` and pass OUT.bin as --data.path"
        )
    if meta is not None:
        if dtype is not None and dtype != meta["dtype"]:
            raise DataError(
                f"dtype={dtype!r} was given but the sidecar {sidecar_path(path)} says {meta['dtype']!r}; "
                "drop the dtype argument (the sidecar is authoritative) or fix the sidecar"
            )
        dtype = meta["dtype"]
    dtype = dtype or "uint16"
    if dtype not in _DTYPES:
        raise DataError(f"token dtype must be 'uint16' or 'uint32', got {dtype!r}")
    itemsize = np.dtype(_DTYPES[dtype]).itemsize
    size = path.stat().st_size
    if size == 0:
        raise DataError(f"data file {path} is empty (0 tokens); run `elbowroom prepare INPUT.txt {path}` first")
    if size % itemsize:
        raise DataError(
            f"data file {path} has {size} bytes, not a multiple of {itemsize} (the size of {dtype}): "
            f"it is truncated or holds another dtype; pass the right dtype ('uint16' or 'uint32') "
            f"or re-run `elbowroom prepare INPUT.txt {path}`"
        )
    num_tokens = size // itemsize
    if meta is not None and meta["num_tokens"] != num_tokens:
        raise DataError(
            f"data file {path} holds {num_tokens} tokens but its sidecar {sidecar_path(path)} says "
            f"{meta['num_tokens']}: the file was truncated or replaced; re-run `elbowroom prepare`"
        )
    tokens = np.memmap(path, dtype=_DTYPES[dtype], mode="r", shape=(num_tokens,))
    if meta is not None:
        # a cheap spot check of the first tokens: a file replaced by other bytes under an old sidecar
        head = int(tokens[:_SCAN_TOKENS].max())
        if head >= meta["vocab_size"]:
            raise DataError(
                f"data file {path} holds token id {head}, but its sidecar {sidecar_path(path)} says vocab_size "
                f"{meta['vocab_size']}: the file does not belong to this sidecar; re-run `elbowroom prepare`"
            )
        return TokenFile(tokens, path, meta["eos_id"], meta["tokenizer"], meta["vocab_size"])
    return TokenFile(tokens, path, eos_id, None, vocab_size)


def _read_sidecar(path: Path) -> dict[str, Any] | None:
    meta_path = sidecar_path(path)
    if not meta_path.is_file():
        return None
    try:
        meta = json.loads(meta_path.read_text())
    except (OSError, json.JSONDecodeError) as e:
        raise DataError(f"cannot read sidecar {meta_path}: {e}; delete it or re-run `elbowroom prepare`") from e
    if not isinstance(meta, dict):
        raise DataError(f"sidecar {meta_path} is not a JSON object; re-run `elbowroom prepare`")
    required = ("dtype", "vocab_size", "num_tokens", "eos_id", "tokenizer", "format")
    missing = [key for key in required if key not in meta]
    if missing:
        raise DataError(f"sidecar {meta_path} lacks {', '.join(missing)}; re-run `elbowroom prepare` or add them")
    if meta["format"] != TOKEN_FORMAT:
        raise DataError(
            f"sidecar {meta_path} has format {meta['format']!r}, not {TOKEN_FORMAT!r}: it was not written by "
            "`elbowroom prepare`; re-run `elbowroom prepare`"
        )
    if not isinstance(meta.get("version"), int) or meta["version"] > TOKEN_FORMAT_VERSION:
        raise DataError(
            f"sidecar {meta_path} has version {meta.get('version')!r}; this elbowroom reads version "
            f"{TOKEN_FORMAT_VERSION}: upgrade elbowroom or re-run `elbowroom prepare` with this one"
        )
    if meta["dtype"] not in _DTYPES:
        raise DataError(f"sidecar {meta_path} has dtype {meta['dtype']!r}, not uint16 or uint32; re-run prepare")
    vocab = meta["vocab_size"]
    limit = 2**16 if meta["dtype"] == "uint16" else 2**32
    if not isinstance(vocab, int) or isinstance(vocab, bool) or not 0 < vocab <= limit:
        raise DataError(
            f"sidecar {meta_path} has vocab_size {vocab!r}, not an int in [1, {limit}] for {meta['dtype']}; "
            "re-run `elbowroom prepare`"
        )
    eos = meta["eos_id"]
    if eos is not None and (not isinstance(eos, int) or not 0 <= eos < vocab):
        raise DataError(f"sidecar {meta_path} has eos_id {eos!r}, outside [0, {vocab}); re-run `elbowroom prepare`")
    return meta


def check_vocab(meta_vocab: int, model_vocab: int) -> None:
    """Raises DataError when the data holds token ids the model's embedding cannot look up.

    Args:
        meta_vocab: The data's vocab_size (``TokenFile.vocab_size``).
        model_vocab: The model's vocab_size.
    """
    if meta_vocab > model_vocab:
        raise DataError(
            f"the data has vocab_size {meta_vocab} but the model's vocab_size is {model_vocab}; "
            f"set the model's vocab_size to at least {meta_vocab} (--model.vocab_size {meta_vocab})"
        )


def split(token_file: TokenFile | np.ndarray, val_fraction: float) -> tuple[np.ndarray, np.ndarray]:
    """Splits tokens into (train, validation): the last ``val_fraction`` of them are validation.

    The split is contiguous and deterministic, like nanoGPT's. Parts of a file-backed ``TokenFile``
    are memmaps of their own, so datasets built on them pickle by file name into worker processes.

    Args:
        token_file: A ``TokenFile`` or a 1-D token array.
        val_fraction: Fraction in [0, 1) held out for validation (floored to whole tokens).

    Returns:
        ``(train_tokens, val_tokens)``; ``val_tokens`` is empty when ``val_fraction`` is 0.
    """
    if not 0.0 <= val_fraction < 1.0:
        raise DataError(f"val_fraction must be in [0, 1), got {val_fraction}")
    tokens = token_file.tokens if isinstance(token_file, TokenFile) else token_file
    num_val = int(len(tokens) * val_fraction)
    num_train = len(tokens) - num_val
    return _slice(tokens, 0, num_train), _slice(tokens, num_train, len(tokens))


def _slice(tokens: np.ndarray, start: int, stop: int) -> np.ndarray:
    if _is_whole_memmap(tokens) and stop > start:
        return np.memmap(
            tokens.filename, dtype=tokens.dtype, mode="r", offset=tokens.offset + start * tokens.itemsize,
            shape=(stop - start,),
        )  # fmt: skip
    return tokens[start:stop]


def _is_whole_memmap(tokens: np.ndarray) -> bool:
    # A memmap made by np.memmap() has the mmap as its base; a slice of one has the parent array as its
    # base, and its .offset is the parent's, so only the former can be re-opened from (filename, offset).
    return isinstance(tokens, np.memmap) and isinstance(tokens.base, mmap.mmap) and tokens.filename is not None


def _max_token(tokens: np.ndarray) -> int:
    if len(tokens) == 0:
        raise DataError("cannot infer vocab_size of an empty token array; pass vocab_size explicitly")
    return max(int(tokens[i : i + _SCAN_TOKENS].max()) for i in range(0, len(tokens), _SCAN_TOKENS))


def _eos_positions(tokens: np.ndarray, eos_id: int) -> np.ndarray:
    # Scanned in blocks so a memmap of billions of tokens never needs a full-size boolean mask.
    found = [np.flatnonzero(tokens[i : i + _SCAN_TOKENS] == eos_id) + i for i in range(0, len(tokens), _SCAN_TOKENS)]
    return np.concatenate(found).astype(np.int64) if found else np.empty(0, dtype=np.int64)


# --------------------------------------------------------------------------------------------------
# Writing token files: the built-in corpus and prepare()
# --------------------------------------------------------------------------------------------------


@contextlib.contextmanager
def _atomic_write(path: Path) -> Iterator[BinaryIO]:
    """Writes ``path`` under a temporary name in its directory and renames it into place on success."""
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.parent / f".{path.name}.{os.getpid()}-{uuid.uuid4().hex[:8]}.tmp"
    # not mkstemp, whose files are 0600: the umask applies, as to any file the user writes (0644 under 022)
    fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_EXCL | getattr(os, "O_BINARY", 0), 0o666)
    try:
        with os.fdopen(fd, "wb") as f:
            yield f
    except BaseException:
        os.unlink(tmp)
        raise
    os.replace(tmp, path)  # readers see the old file or the whole new one, never a part


def _write_sidecar(path: Path, meta: Mapping[str, Any]) -> None:
    with _atomic_write(sidecar_path(path)) as f:
        f.write((json.dumps(dict(meta), indent=2) + "\n").encode())


def _sidecar(**fields: Any) -> dict[str, Any]:
    """What a sidecar holds: the format magic and version first, then ``fields``."""
    return {"format": TOKEN_FORMAT, "version": TOKEN_FORMAT_VERSION, **fields}


def _corpus_files() -> list[Path]:
    stdlib = Path(sysconfig.get_paths()["stdlib"])
    files = list(stdlib.glob("*.py"))
    for package in _CORPUS_PACKAGES:
        files += [f for f in (stdlib / package).rglob("*.py") if not _CORPUS_EXCLUDED_PARTS & set(f.parts)]
    return sorted(files, key=lambda f: f.relative_to(stdlib).as_posix())


def build_default_corpus(cache_dir: str | os.PathLike[str] | None = None) -> Path:
    """Builds the built-in byte-level corpus into ``cache_dir`` unless it is cached there already.

    The corpus is this Python's standard-library source (top-level modules and a fixed set of packages,
    sorted by relative path, ~6-8 MB), one document per file, each followed by the eos byte 0. Nothing
    is downloaded; the bytes depend only on the Python minor version.

    Args:
        cache_dir: Directory of the cached ``.bin``; None means :func:`default_cache_dir`.

    Returns:
        The path of the cached ``.bin`` (with its sidecar beside it).
    """
    cache_dir = Path(cache_dir) if cache_dir is not None else default_cache_dir()
    version = f"{sys.version_info.major}.{sys.version_info.minor}"
    path = cache_dir / f"stdlib-py{version}-v{_CORPUS_VERSION}.bin"
    if path.is_file() and sidecar_path(path).is_file():
        return path
    files = _corpus_files()
    if not files:
        raise DataError(
            f"this Python ships no standard-library source under {sysconfig.get_paths()['stdlib']}, so the "
            "built-in corpus cannot be built; pass a data file made with `elbowroom prepare INPUT.txt OUT.bin`"
        )
    try:
        cache_dir.mkdir(parents=True, exist_ok=True)
    except OSError as e:  # a file in the way, no permission
        why = "a file is in the way" if isinstance(e, (FileExistsError, NotADirectoryError)) else e.strerror
        raise DataError(f"cannot make the corpus cache directory {cache_dir} ({why}); pass a writable directory as "
                        "--data.cache_dir or $ELBOWROOM_CACHE") from None
    logger.info("building the built-in corpus from %d stdlib files into %s", len(files), path)
    num_tokens = total = 0
    with _atomic_write(path) as out:
        for file in files:
            data = file.read_bytes().replace(b"\x00", b"")
            if not data:
                continue  # an empty __init__.py is no document
            if total + len(data) > _CORPUS_MAX_BYTES:
                break
            total += len(data)
            out.write(np.frombuffer(data + b"\x00", dtype=np.uint8).astype(np.uint16).tobytes())
            num_tokens += len(data) + 1
    meta = _sidecar(dtype="uint16", vocab_size=256, num_tokens=num_tokens, eos_id=BYTE_EOS_ID, tokenizer="bytes")
    _write_sidecar(path, meta)
    return path


def prepare(
    input_path: str | os.PathLike[str],
    output_path: str | os.PathLike[str],
    *,
    tokenizer: str | os.PathLike[str] | None = None,
    eos_id: int | None | Literal["auto"] = "auto",
    progress: bool = True,
) -> dict[str, Any]:
    """Turns a text file, or a directory of ``.txt`` files, into a token ``.bin`` and its sidecar.

    Each file is one document and is followed by ``eos_id``. Byte-level by default: tokens are the
    UTF-8 bytes, and the eos byte (0 by default) is removed from the text so it only separates
    documents. With ``tokenizer``, text is encoded by a local Hugging Face ``tokenizer.json`` (needs
    the ``tokenizers`` package), in chunks cut after newlines so large files stream. Both files are
    written atomically: an interrupted prepare (Ctrl-C included) leaves no partial file behind.

    Args:
        input_path: A text file, or a directory whose ``*.txt`` files (sorted by name) are the documents.
        output_path: The ``.bin`` to write; the sidecar goes to ``<output_path>.json``.
        tokenizer: Path of a ``tokenizer.json``; None means byte-level (vocab 256).
        eos_id: End-of-document token. ``"auto"``: 0 for bytes; for a tokenizer its ``<|endoftext|>``,
            ``</s>`` or similar special token. None writes no separator.
        progress: Show a progress bar for large inputs.

    Returns:
        The metadata written to the sidecar.

    Raises:
        DataError: The input is missing or empty, or ``eos_id`` does not fit the vocabulary.
        ImportError: ``tokenizer`` was given but the ``tokenizers`` package is not installed.
    """
    input_path, output_path = Path(input_path), Path(output_path)
    files = _input_files(input_path)
    total_bytes = sum(f.stat().st_size for f in files)
    if total_bytes == 0:
        raise DataError(f"input {input_path} is empty (0 bytes of text); nothing to prepare")

    if tokenizer is None:
        eos = BYTE_EOS_ID if eos_id == "auto" else eos_id
        vocab_size = 256 if eos is None else max(256, eos + 1)
        encode = _byte_encoder(eos)
        tokenizer_name = "bytes"
    else:
        tok = _load_tokenizer(Path(tokenizer))
        vocab_size = tok.get_vocab_size(with_added_tokens=True)
        eos = _tokenizer_eos(tok, tokenizer) if eos_id == "auto" else eos_id
        encode = _hf_encoder(tok)
        tokenizer_name = str(Path(tokenizer).resolve())
    if eos is not None and not 0 <= eos < max(vocab_size, 256 if tokenizer is None else 0):
        raise DataError(f"eos_id must be in [0, {vocab_size}) for this vocabulary, got {eos}")

    dtype = "uint16" if vocab_size < 2**16 else "uint32"
    np_dtype = _DTYPES[dtype]
    from tqdm.auto import tqdm  # imported here: only prepare() needs it

    bar = tqdm(total=total_bytes, unit="B", unit_scale=True, desc=f"prepare {output_path.name}",
               disable=not progress or total_bytes < _PROGRESS_MIN_BYTES)  # fmt: skip
    num_tokens = 0
    with bar, _atomic_write(output_path) as out:
        for file in files:
            for block in _read_blocks(file, split_after_newline=tokenizer is not None):
                ids = encode(block)
                out.write(ids.astype(np_dtype).tobytes())
                num_tokens += len(ids)
                bar.update(len(block))
            if eos is not None:
                out.write(np.array([eos], dtype=np_dtype).tobytes())
                num_tokens += 1
    if num_tokens == 0:
        output_path.unlink()
        raise DataError(f"input {input_path} produced 0 tokens; check that it holds text")
    meta = _sidecar(dtype=dtype, vocab_size=vocab_size, num_tokens=num_tokens, eos_id=eos, tokenizer=tokenizer_name)
    try:
        _write_sidecar(output_path, meta)
    except BaseException:  # (Ctrl-C included) a token file without its sidecar, or under an old one, is no output
        output_path.unlink()
        sidecar_path(output_path).unlink(missing_ok=True)
        raise
    logger.info("prepared %s: %d tokens, vocab %d, %s", output_path, num_tokens, vocab_size, dtype)
    return meta


def _input_files(input_path: Path) -> list[Path]:
    if input_path.is_dir():
        files = sorted(input_path.glob("*.txt"))
        if not files:
            raise DataError(f"directory {input_path} has no *.txt files; pass a text file or a directory of them")
        return files
    if not input_path.is_file():
        raise DataError(f"input {input_path} does not exist; pass a text file or a directory of *.txt files")
    return [input_path]


def _read_blocks(file: Path, *, split_after_newline: bool) -> Iterator[bytes]:
    """Yields the bytes of ``file`` in blocks; with ``split_after_newline`` each block ends after a newline
    (or at the end of the file), so no block cuts a UTF-8 character or a word in two."""
    carry = b""
    with open(file, "rb") as f:
        while block := f.read(_BLOCK_BYTES):
            block = carry + block
            if split_after_newline:
                cut = block.rfind(b"\n") + 1
                block, carry = (block[:cut], block[cut:]) if cut else (b"", block)
            if block:
                yield block
    if carry:
        yield carry


def _byte_encoder(eos: int | None) -> Callable[[bytes], np.ndarray]:
    def encode(block: bytes) -> np.ndarray:
        ids = np.frombuffer(block, dtype=np.uint8)
        if eos is not None and eos < 256:
            ids = ids[ids != eos]  # the eos byte must only ever mean "end of document"
        return ids

    return encode


def _load_tokenizer(path: Path) -> Any:
    try:
        from tokenizers import Tokenizer
    except ImportError as e:
        raise ImportError(
            "prepare(tokenizer=...) needs the Hugging Face `tokenizers` package: "
            "pip install tokenizers (or pip install 'elbowroom[tokenizers]')"
        ) from e
    if not path.is_file():
        raise DataError(f"tokenizer file {path} does not exist; pass the path of a local tokenizer.json")
    try:
        return Tokenizer.from_file(str(path))
    except Exception as e:  # noqa: BLE001 - the tokenizers package raises plain Exceptions
        raise DataError(f"tokenizer file {path} is not a Hugging Face tokenizer.json ({e}); pass the tokenizer.json "
                        "saved with the model") from None


def _tokenizer_eos(tok: Any, path: str | os.PathLike[str]) -> int:
    for token in _EOS_CANDIDATES:
        token_id = tok.token_to_id(token)
        if token_id is not None:
            return token_id
    raise DataError(
        f"tokenizer {path} has none of the end-of-document tokens {', '.join(_EOS_CANDIDATES)}; "
        "pass eos_id=<id> explicitly, or eos_id=None to write no document separator"
    )


def _hf_encoder(tok: Any) -> Callable[[bytes], np.ndarray]:
    def encode(block: bytes) -> np.ndarray:
        text = block.decode("utf-8", errors="replace")
        return np.asarray(tok.encode(text, add_special_tokens=False).ids, dtype=np.int64)

    return encode



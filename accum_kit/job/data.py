"""Data: the default real corpus, local files, the hub, tokenisation and collators.

The default corpus is real text that nobody on this project wrote and that
every machine with Python has: the CPython standard library sources of the
running interpreter (``sysconfig.get_paths()["stdlib"]``), leaving out
``site-packages`` and the test suites, one example per file, in sorted path
order. Training a code model on Python sources is what transformers'
CodeParrot example does.
"""

from __future__ import annotations

import logging
import os
import sysconfig
from itertools import chain
from pathlib import Path

from ..errors import UsageError
from .text_files import first_invalid_utf8, json_problem

DEFAULT_DATASET = "cpython-stdlib"
_SKIP_DIRS = {"site-packages", "dist-packages", "__pycache__", "test", "tests", "idle_test"}
_MIN_EXAMPLE_TOKENS = 8  # unpacked mode: shorter pieces carry almost no next-token signal


def stdlib_source_files(root: str | os.PathLike | None = None) -> list[Path]:
    """Sorted ``.py`` files of the standard library, without site-packages and tests.

    Args:
        root: the directory to scan; default ``sysconfig.get_paths()["stdlib"]``.
    """
    root = Path(root or sysconfig.get_paths()["stdlib"])
    files = []
    for dirpath, dirnames, filenames in os.walk(root):
        dirnames[:] = sorted(d for d in dirnames if d not in _SKIP_DIRS and not d.startswith("test"))
        files += [Path(dirpath, f) for f in sorted(filenames) if f.endswith(".py") and not f.startswith("test")]
    return sorted(files, key=lambda p: p.relative_to(root).as_posix())


def _read_sources(root: str, paths: list[str]):
    for rel in paths:
        yield {"text": Path(root, rel).read_text(encoding="utf-8", errors="replace"), "path": rel}


def load_default_corpus(root: str | os.PathLike | None = None):
    """The standard library sources as a ``datasets.Dataset`` with ``text`` and ``path`` columns.

    Built with ``Dataset.from_generator``, so it lands in the datasets cache
    (keyed by the file list) and later ``map`` calls are cached too: the second
    process of a run, and every later run, reuse the tokenised corpus.

    Raises:
        UsageError: no source file was found (names ``--dataset_name``).
    """
    import sys

    from datasets import Dataset

    root = Path(root or sysconfig.get_paths()["stdlib"])
    files = stdlib_source_files(root)
    if not files:
        raise UsageError("--dataset_name", f"no Python sources found under {root}", "pass --train_file with your own text")
    paths = [f.relative_to(root).as_posix() for f in files]
    # sys.version is part of the cache key: another interpreter has other sources.
    return Dataset.from_generator(
        _read_sources, gen_kwargs={"root": str(root), "paths": paths}, config_name=f"stdlib-{sys.version.split()[0]}"
    )


def _split_validation(train, percentage: int):
    """run_clm_no_trainer's split: the first ``percentage`` % is validation, the rest train."""
    from datasets import DatasetDict

    n_val = len(train) * percentage // 100
    if percentage > 0 and n_val == 0 and len(train) > 1:
        n_val = 1
    return DatasetDict(validation=train.select(range(n_val)), train=train.select(range(n_val, len(train))))


_BUILDERS = {"txt": "text", "text": "text", "json": "json", "jsonl": "json", "csv": "csv"}


def check_data_flags(train_file: str | None, validation_split_percentage: int,
                     validation_file: str | None = None) -> None:
    """The data flags' checks that need no data loaded (every process runs them before any collective).

    Every process runs these before any collective, so each one stops with the
    same message. Reads each file once (UTF-8 check, about 0.5 GB/s) and
    parses a ``.json``/``.jsonl`` file of up to 8 MiB with Python's ``json``.

    Raises:
        UsageError: percentage outside [0, 100); ``train_file`` or ``validation_file``
            missing, empty, of an unsupported type, not UTF-8 (see :func:`first_invalid_utf8`),
            or a small JSON file that does not parse (see :func:`json_problem`).
    """
    if not 0 <= validation_split_percentage < 100:
        raise UsageError(
            "--validation_split_percentage", f"must be in [0, 100) (got {validation_split_percentage})", "pass e.g. 5"
        )
    for flag, path in (("--train_file", train_file), ("--validation_file", validation_file)):
        if path is not None:
            check_data_file(path, flag)


def check_data_file(path: str, flag: str = "--train_file") -> None:
    """One local data file's checks (see :func:`check_data_flags`); errors name ``flag``."""
    if not os.path.isfile(path):
        raise UsageError(flag, f"no such file: {path}", "pass an existing .txt, .json or .csv file")
    if os.path.getsize(path) == 0:  # datasets raises DatasetGenerationError on an empty file
        raise UsageError(flag, f"{path} is empty", "pass a file with text in it")
    ext = path.rsplit(".", 1)[-1].lower()
    if ext not in _BUILDERS:
        raise UsageError(flag, f"unsupported extension .{ext}", "use a .txt, .json, .jsonl or .csv file")
    bad = first_invalid_utf8(path)
    if bad is not None:
        line, offset, seq = bad
        raise UsageError(
            flag,
            f"{path} is not UTF-8 text: byte 0x{seq[:1].hex()} at line {line} (byte offset {offset}) "
            "does not decode",
            f"convert it to UTF-8 (e.g. `iconv -f latin1 -t utf-8 {path} > converted{os.path.splitext(path)[1]}`) "
            "or pass another file",
        )
    # Small JSON files are checked here too, so that every process (not only the one that loads
    # the data first) stops with the same message; larger ones only where they fail to load.
    if _BUILDERS[ext] == "json" and os.path.getsize(path) <= _PRECHECK_JSON_BYTES:
        where = json_problem(path)
        if where:
            raise UsageError(flag, f"{path} cannot be read as JSON: {where}", _FILE_FIXES["json"])


_PRECHECK_JSON_BYTES = 8 << 20  # parsed by every process at start-up: about 0.25 s at this size (measured)


def _root_cause(exc: BaseException) -> BaseException:
    """The innermost exception of a ``raise ... from`` chain (datasets wraps the parser's error)."""
    while exc.__cause__ is not None or (exc.__context__ is not None and not exc.__suppress_context__):
        exc = exc.__cause__ or exc.__context__
    return exc


_FILE_FIXES = {
    "json": 'give one JSON object per line with a "text" string ({"text": "..."}) or one JSON list of such objects',
    "csv": "check the quoting near that row; the file needs a header row with a 'text' column",
    "text": "pass a plain UTF-8 text file",
}


def _load_data_file(path: str, flag: str = "--train_file", keep_linebreaks: bool = True):
    """``datasets.load_dataset`` of one local file as split ``train``; a parse failure becomes a :class:`UsageError`.

    A ``.txt`` file is read by datasets' ``text`` builder, one row per line,
    each line with its ``\\n`` when ``keep_linebreaks`` (run_clm_no_trainer's
    default) and without it otherwise (``--no_keep_linebreaks``).

    Raises:
        UsageError (naming ``flag``): the file cannot be parsed as its extension
            says; the message names the file, the position where Python's ``json``
            or the parser (pyarrow, pandas) reports one, and the parser's own words.
    """
    from datasets import load_dataset
    from datasets.exceptions import DatasetGenerationError

    builder = _BUILDERS[path.rsplit(".", 1)[-1].lower()]
    options = {"keep_linebreaks": keep_linebreaks} if builder == "text" else {}
    try:
        return load_dataset(builder, data_files={"train": path}, **options)
    except (DatasetGenerationError, ValueError) as exc:  # ValueError: pyarrow's ArrowInvalid, pandas' ParserError
        cause = _root_cause(exc)
        where = json_problem(path) if builder == "json" else None
        detail = str(cause).strip().splitlines()[0][:300] if str(cause).strip() else "no detail"
        problem = f"{path} cannot be read as {builder.upper() if builder != 'text' else 'text'}: "
        problem += where if where else f"{type(cause).__name__}: {detail}"
        raise UsageError(flag, problem, _FILE_FIXES[builder]) from exc


def _text_split(split, flag: str, verbatim: bool):
    """Check the ``text`` column of ``split`` and drop rows without text.

    ``verbatim`` (a ``.txt`` file read with its line breaks): only empty rows
    are dropped, so that the rows put together are the file itself, blank lines
    included, as run_clm_no_trainer tokenises it. Otherwise rows that are empty
    or whitespace only are dropped.

    Raises:
        UsageError (naming ``flag``): no ``text`` column, a non-string one, or no
            row with a non-whitespace character.
    """
    if "text" not in split.column_names:
        raise UsageError(flag, f"no 'text' column (columns: {split.column_names})", "provide a 'text' column")
    dtype = getattr(split.features["text"], "dtype", type(split.features["text"]).__name__)
    if dtype not in ("string", "large_string"):
        raise UsageError(flag, f"the 'text' column holds {dtype} values, not strings", "make every 'text' value a string")
    kept = split.filter((lambda t: bool(t)) if verbatim else (lambda t: bool(t and t.strip())), input_columns="text")
    # a verbatim file may still hold only blank lines (the scan stops at the first line with text)
    if len(kept) == 0 or (verbatim and not any(t.strip() for b in kept.iter(batch_size=1000) for t in b["text"])):
        raise UsageError(flag, "the dataset has no non-empty text", "pass a file with text in it")
    return kept


def load_raw_datasets(
    dataset_name: str | None = None,
    dataset_config_name: str | None = None,
    train_file: str | None = None,
    validation_split_percentage: int = 5,
    validation_file: str | None = None,
    keep_linebreaks: bool = True,
):
    """Raw text splits ``train`` and ``validation`` with a ``text`` column.

    Args:
        dataset_name: a hub dataset name, or None / ``"cpython-stdlib"`` for the
            embedded default corpus.
        dataset_config_name: the hub dataset's configuration, if any.
        train_file: a local ``.txt``, ``.json``/``.jsonl`` or ``.csv`` file
            (loaded with ``datasets.load_dataset``); needs a ``text`` column
            unless plain text.
        validation_split_percentage: percent of train used for validation when
            the source has no validation split and no ``validation_file`` is
            given (0 to 99).
        validation_file: a local file of the same kinds; it is the validation
            split (train then keeps all of its data), as in run_clm_no_trainer.
        keep_linebreaks: ``.txt`` files: keep each line's ``\\n`` (and blank
            lines); False drops them (``--no_keep_linebreaks``). Both as
            run_clm_no_trainer passes it to datasets' ``text`` builder.

    Returns:
        ``(DatasetDict, description)`` where description names the source.

    Raises:
        UsageError: missing file, unsupported extension, a file that is not
            UTF-8 or does not parse (naming the line where known), unreachable
            hub name, no ``text`` column or a non-string one, empty train or
            validation file, or a bad percentage.
    """
    from datasets import DatasetDict, load_dataset

    check_data_flags(train_file, validation_split_percentage, validation_file)
    if train_file is not None:
        raw = _load_data_file(train_file, "--train_file", keep_linebreaks)
        source = f"file:{train_file}"
    elif dataset_name in (None, DEFAULT_DATASET):
        raw = {"train": load_default_corpus()}
        source = DEFAULT_DATASET
    else:
        try:
            raw = load_dataset(dataset_name, dataset_config_name)
        except (ConnectionError, OSError, ValueError) as exc:  # datasets raises ConnectionError when offline
            raise UsageError(
                "--dataset_name",
                f"cannot load {dataset_name!r} ({type(exc).__name__}: {str(exc).splitlines()[0][:200]})",
                "check the name and your connection to the hub, or use --train_file, or omit it for the default corpus",
            ) from exc
        source = f"hub:{dataset_name}" + (f"/{dataset_config_name}" if dataset_config_name else "")

    def verbatim(path):  # a .txt file read with its line breaks
        return keep_linebreaks and path is not None and _BUILDERS[path.rsplit(".", 1)[-1].lower()] == "text"

    train = _text_split(raw["train"], "--train_file" if train_file else "--dataset_name", verbatim(train_file))
    if validation_file is not None:
        valid = _load_data_file(validation_file, "--validation_file", keep_linebreaks)["train"]
        valid = _text_split(valid, "--validation_file", verbatim(validation_file))
        return DatasetDict(train=train, validation=valid), f"{source}, validation file:{validation_file}"
    if "validation" in raw:
        return DatasetDict(train=train, validation=raw["validation"]), source
    return _split_validation(train, validation_split_percentage), source


def build_tokenizer(model_name_or_path: str | None = None, *, use_slow_tokenizer: bool = False,
                    trust_remote_code: bool = False, flag: str = "--model_name_or_path"):
    """The tokenizer: ``ByT5Tokenizer()`` (bytes, needs no files) or ``AutoTokenizer.from_pretrained``.

    Args:
        model_name_or_path: a directory written by ``save_pretrained`` (or a hub
            name): ``--tokenizer_name``, else ``--model_name_or_path``; None for bytes.
        use_slow_tokenizer: ask for the Python tokenizer (``use_fast=False``), as
            run_clm_no_trainer's ``--use_slow_tokenizer``. transformers 5 always
            loads the tokenizers-library backend and ignores it (logged).
        trust_remote_code: allow a tokenizer class defined by code in that directory.
        flag: the flag named in errors.

    Raises:
        UsageError: the tokenizer cannot be loaded, or loads empty (names ``flag``).
    """
    if model_name_or_path is None:
        from transformers import ByT5Tokenizer

        return ByT5Tokenizer()
    import transformers
    from transformers import AutoTokenizer

    if use_slow_tokenizer and int(transformers.__version__.split(".")[0]) >= 5:
        logging.getLogger(__name__).warning(
            "--use_slow_tokenizer: transformers %s always loads the fast (tokenizers) backend; the flag has no effect",
            transformers.__version__)
    fix = "save the tokenizer with the model (save_pretrained) or use --model_preset"
    try:
        # trust_remote_code=False, not None: None would prompt on a terminal before failing
        tok = AutoTokenizer.from_pretrained(model_name_or_path, use_fast=not use_slow_tokenizer,
                                            trust_remote_code=trust_remote_code)
    except (OSError, ValueError) as exc:
        if "trust_remote_code" in str(exc):
            flag, fix = "--trust_remote_code", f"read the code in {model_name_or_path} and pass --trust_remote_code if you trust it"
        elif not os.path.exists(model_name_or_path):
            fix = "pass an existing model directory (or a reachable hub name), or use --model_preset"
        raise UsageError(flag, f"cannot load a tokenizer from {model_name_or_path!r} ({exc})", fix) from exc
    # A folder without tokenizer files can yield an empty tokenizer instead of an error.
    if len(tok) <= 1 or not tok("def f():")["input_ids"]:
        raise UsageError(flag, f"no usable tokenizer in {model_name_or_path!r}", fix)
    return tok


def tokenize_datasets(raw, tokenizer, block_size: int, packing: bool = True, *,
                      num_proc: int | None = None, overwrite_cache: bool = False):
    """Tokenise raw text into causal-LM examples.

    Args:
        raw: ``DatasetDict`` with a ``text`` column.
        tokenizer: a transformers tokenizer; an end-of-sequence token separates documents.
        block_size: tokens per packed block, or the truncation length when unpacked.
        packing: True: concatenate the tokens of each group of 1000 rows (one
            ``Dataset.map`` batch) and cut blocks of exactly ``block_size``
            tokens, dropping each group's remainder (run_clm's ``group_texts``). False: one
            example per blank-line-separated piece of each text (a function, a
            class, a paragraph), truncated to ``block_size``; variable lengths,
            padded per batch by :func:`build_collator`.
        num_proc: worker processes of each ``Dataset.map`` (``--preprocessing_num_workers``);
            None: this process. Packing then groups each worker's shard on its
            own, so up to ``num_proc - 1`` more partial blocks are dropped (as in
            run_clm_no_trainer).
        overwrite_cache: recompute the maps instead of reusing datasets' cache
            files (``--overwrite_cache``; the new result replaces the cached one).

    Returns:
        ``DatasetDict`` with ``input_ids`` and ``attention_mask`` (lists of ints).
    """
    cols = raw["train"].column_names

    def encode(batch):
        texts = batch["text"] if packing else [p for t in batch["text"] for p in t.split("\n\n") if p.strip()]
        enc = tokenizer(texts, truncation=not packing, max_length=None if packing else block_size)
        if packing:
            return enc
        keep = [i for i, ids in enumerate(enc["input_ids"]) if len(ids) >= _MIN_EXAMPLE_TOKENS]
        return {k: [v[i] for i in keep] for k, v in enc.items()}

    def group(batch):
        concatenated = {k: list(chain(*batch[k])) for k in batch}
        total = len(concatenated["input_ids"]) // block_size * block_size
        return {k: [v[i : i + block_size] for i in range(0, total, block_size)] for k, v in concatenated.items()}

    cache = dict(num_proc=num_proc, load_from_cache_file=False if overwrite_cache else None)
    out = raw.map(encode, batched=True, remove_columns=cols, desc="tokenizing", **cache)
    if packing:
        out = out.map(group, batched=True, batch_size=1000, desc=f"packing into blocks of {block_size}", **cache)
    return out


def build_collator(tokenizer, packing: bool = True):
    """Batch collator: labels are the inputs (shifted in the loss), -100 on padding.

    Packed blocks all have the same length and carry no ``attention_mask``: every position attends to all
    before it, and with an all-ones mask transformers' SDPA path checks the mask on the device at every forward
    to drop it (``torch.all``, then a host read: a sync per micro-batch on a GPU); without one it goes straight
    to the causal kernel, with the same result. Unpacked examples are padded to the longest in the batch by
    ``DataCollatorForLanguageModeling(mlm=False)``, with their mask.
    """
    from transformers import DataCollatorForLanguageModeling, default_data_collator

    if packing:
        def collate(features):
            batch = default_data_collator(features)
            mask = batch.pop("attention_mask", None)
            if mask is not None and not bool(mask.all()):  # on the host, before the batch moves: no device read
                batch["attention_mask"] = mask
            batch["labels"] = batch["input_ids"].clone()
            return batch

        return collate
    return DataCollatorForLanguageModeling(tokenizer, mlm=False)

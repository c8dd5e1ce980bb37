"""Bad ``--train_file`` contents: a clear ``error: --train_file: ...`` naming the file and the line, exit 2.

Before, a file that is not UTF-8 ended in a raw ``UnicodeDecodeError`` traceback
and a malformed ``.json`` in a datasets/pyarrow one. Every file here is written
by the test with the fault at a known line, so the expected position comes from
the construction (or, for random bytes, from decoding the whole file at once
with ``bytes.decode``), not from the code under test. All in-process: no launch.
"""

from __future__ import annotations

import random

import pytest

import job_helpers as jh
from accum_kit import UsageError
from accum_kit.job.data import first_invalid_utf8, json_problem, load_raw_datasets


@pytest.fixture
def offline(tmp_path, monkeypatch):
    """No launcher variables, offline hub, a private datasets cache; Accelerate's singletons reset after."""
    jh.isolate_in_process(monkeypatch, tmp_path / "hf_datasets_cache")
    yield tmp_path
    jh.reset_accelerate_state()


def train_cli(capsys, train_file, output_dir):
    from accum_kit.cli import run

    argv = ["--model_preset", "tiny", "--block_size", "32", "--max_train_steps", "1",
            "--train_file", str(train_file), "--output_dir", str(output_dir)]
    code = run("train", argv)
    err = capsys.readouterr().err
    return code, [line for line in err.splitlines() if line.startswith("error: ")], err


def oracle_position(data: bytes) -> tuple[int, int] | None:
    """(line, byte offset) of the first undecodable byte, by decoding the whole thing at once."""
    try:
        data.decode("utf-8")
    except UnicodeDecodeError as exc:
        return data[: exc.start].count(b"\n") + 1, exc.start
    return None


# --------------------------------------------------------------------------- UTF-8


MULTIBYTE = "naïve café 中文 \N{SNAKE}\n".encode() * 5  # 2-, 3- and 4-byte characters, 5 lines


@pytest.mark.parametrize("chunk_bytes", [1, 2, 3, 5, 7, 64, 1 << 20])
@pytest.mark.parametrize("data", [
    MULTIBYTE + b"ok\nbad \xff here\n",  # an invalid start byte on line 7
    MULTIBYTE + b"caf\xc3(\n",  # a 2-byte character cut short on line 6
    MULTIBYTE + "中".encode()[:2],  # the file ends inside a character
    b"\n\n\n\x80",  # a lone continuation byte on line 4
    MULTIBYTE,  # all valid
], ids=["bad_start", "cut_short", "truncated_end", "continuation", "valid"])
def test_first_invalid_utf8_matches_whole_file_decode(tmp_path, chunk_bytes, data):
    path = tmp_path / "f.txt"
    path.write_bytes(data)
    found = first_invalid_utf8(path, chunk_bytes=chunk_bytes)  # chunk edges fall inside characters
    expected = oracle_position(data)
    assert (found[:2] if found else None) == expected
    if found:
        assert data[found[1]:].startswith(found[2])


def test_random_bytes_train_file_exits_2_naming_file_and_line(offline, capsys):
    data = b"A first line of real text.\n" + random.Random(0).randbytes(4000)
    bad = offline / "random_bytes.txt"
    bad.write_bytes(data)
    line, offset = oracle_position(data)
    assert line >= 2  # the first line is fine
    out = offline / "out"
    code, errors, err = train_cli(capsys, bad, out)
    assert code == 2, err[-3000:]
    assert len(errors) == 1, err[-3000:]
    assert errors[0].startswith("error: --train_file: ") and ". Fix: " in errors[0]
    assert str(bad) in errors[0] and "not UTF-8" in errors[0]
    assert f"line {line} (byte offset {offset})" in errors[0]
    assert "Traceback" not in err
    assert not out.exists() and jh.staging_leftovers(out) == []


def test_latin1_text_names_the_line(offline):
    path = offline / "latin1.txt"
    path.write_bytes("first line\nsecond line\nthird: café\n".encode("latin-1"))
    with pytest.raises(UsageError) as info:
        load_raw_datasets(train_file=str(path))
    assert info.value.flag == "--train_file"
    assert "line 3 (byte offset 33)" in info.value.problem  # 11 + 12 bytes of lines 1-2, then "third: caf" (10)
    assert "iconv" in info.value.fix


# --------------------------------------------------------------------------- JSON


JSONL_BAD_LINE_3 = '{"text": "one"}\n{"text": "two"}\n{"text": "three" "four"}\n{"text": "five"}\n'
JSON_ARRAY_BAD_LINE_4 = '[\n  {"text": "one"},\n  {"text": "two"},\n  {"text" "three"}\n]\n'


def test_malformed_jsonl_exits_2_naming_file_line_and_column(offline, capsys):
    bad = offline / "malformed.json"
    bad.write_text(JSONL_BAD_LINE_3)
    out = offline / "out"
    code, errors, err = train_cli(capsys, bad, out)
    assert code == 2, err[-3000:]
    assert len(errors) == 1, err[-3000:]
    assert errors[0].startswith("error: --train_file: ") and ". Fix: " in errors[0]
    # Column 18: the second string starts right after `{"text": "three" ` (17 characters).
    assert f"{bad} cannot be read as JSON: line 3, column 18: Expecting ',' delimiter" in errors[0]
    assert "Traceback" not in err
    assert not out.exists() and jh.staging_leftovers(out) == []


@pytest.mark.parametrize("name,content,where", [
    ("array.json", JSON_ARRAY_BAD_LINE_4, "line 4, column 11: Expecting ':' delimiter"),
    ("cut.jsonl", '{"text": "one"}\n{"text": "tw', "line 2, column 10: Unterminated string starting at"),
    ("strings.jsonl", '"one"\n"two"\n', "line 1: a str, not an object"),
    ("mixed.json", '[{"text": "a"}, 5]', "element 1 of the top-level list is a int, not an object"),
])
@pytest.mark.parametrize("precheck", [True, False], ids=["every_process_at_start", "where_it_fails_to_load"])
def test_malformed_json_names_the_position(offline, monkeypatch, name, content, where, precheck):
    import accum_kit.job.data

    if not precheck:  # a file above the start-up check's size: the error comes from the failed load
        monkeypatch.setattr(accum_kit.job.data, "_PRECHECK_JSON_BYTES", 0)
    path = offline / name
    path.write_text(content)
    with pytest.raises(UsageError) as info:
        load_raw_datasets(train_file=str(path))
    assert info.value.flag == "--train_file"
    assert info.value.problem == f"{path} cannot be read as JSON: {where}"


def test_small_json_is_checked_when_the_flags_are_parsed(tmp_path):
    """Every process parses the flags before any collective: all of them stop with the same error."""
    from accum_kit.job.config import TrainConfig

    bad = tmp_path / "malformed.jsonl"
    bad.write_text(JSONL_BAD_LINE_3)
    with pytest.raises(UsageError, match="line 3, column 18"):
        TrainConfig(train_file=str(bad))


def test_json_problem_accepts_valid_files(tmp_path):
    for name, content in [("l.jsonl", '{"text": "a"}\n\n{"text": "b"}\n'), ("a.json", '[{"text": "a"},\n {"text": "b"}]'),
                          ("one.json", '{"text": "a"}')]:
        (tmp_path / name).write_text(content)
        assert json_problem(tmp_path / name) is None, name


def test_non_string_text_column(offline):
    path = offline / "numbers.jsonl"
    path.write_text('{"text": "a"}\n{"text": 5}\n')
    with pytest.raises(UsageError, match="'text' column holds .* values, not strings") as info:
        load_raw_datasets(train_file=str(path))
    assert info.value.flag == "--train_file"


# --------------------------------------------------------------------------- CSV


def test_csv_with_an_open_quote_passes_the_parser_position(offline):
    path = offline / "open_quote.csv"
    path.write_text('text\n"never closed\nmore\n')
    with pytest.raises(UsageError) as info:
        load_raw_datasets(train_file=str(path))
    assert info.value.flag == "--train_file"
    assert str(path) in info.value.problem and "cannot be read as CSV" in info.value.problem
    assert "row 1" in info.value.problem  # pandas' own words: "EOF inside string starting at row 1"

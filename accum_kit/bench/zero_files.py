"""The files of the DeepSpeed bench: bench.json and bench.csv (one row per preset x K x ZeRO stage)."""

from __future__ import annotations

from pathlib import Path

from .files import csv_text, write_bench_files
from .zero_report import CSV_FIELDS


def write_zero_outputs(output_dir: str, result: dict) -> list[Path]:
    """Write bench.json and bench.csv into ``output_dir`` (staged, both or nothing); returns their paths."""
    return write_bench_files(output_dir, result, csv_text(result["rows"], CSV_FIELDS), None)

"""The documented ``accum-kit plan`` commands print what they printed before HSDP joined the cost table.

tests/data/plan_outputs.json holds each command of the README and docs/ that plans without a profile
(``plan``, ``plan --fsdp``), with its output as it was before the cost model grew a mesh (R x S) and
the several-machine engines comparison. Growing the table must not move any of those numbers: each
output today must be the pinned one, followed at most by the new ``Engines on ...`` section (printed
for several machines only). This is a regression pin, not a correctness check: the formulas themselves
are checked against simulations and measured runs in tests/test_fsdp_plan.py, test_fsdp.py and
test_hsdp.py.
"""

from __future__ import annotations

import contextlib
import io
import json
from pathlib import Path

import pytest

from accum_kit import cli

PINS = json.loads((Path(__file__).parent / "data" / "plan_outputs.json").read_text())["commands"]


@pytest.mark.parametrize("pin", PINS, ids=[" ".join(p["argv"][1:6]) for p in PINS])
def test_documented_plan_output_did_not_move(pin):
    out = io.StringIO()
    with contextlib.redirect_stdout(out):
        assert cli.main(pin["argv"]) in (0, None)
    text = out.getvalue()
    assert text.startswith(pin["stdout"].rstrip("\n")), "the plan's text changed"
    rest = text[len(pin["stdout"].rstrip("\n")):].strip()
    assert rest == "" or rest.startswith("Engines on "), rest[:200]

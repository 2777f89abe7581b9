"""FT_GC_FREEZE: importing ft_core, and then its Manager, moves the objects that exist out of the cyclic garbage
collector's scans (gc.freeze), in either import order; 0 turns it off; a bad value warns once and changes nothing.
Each case runs in a fresh interpreter, since the freeze is process-wide. (What it saves, a restarted worker's
full collections while torch._dynamo imports, is measured by benchmarks/heal.py, not asserted here.)
"""

from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest

TORCH_FIRST = """
import gc, json, torch
gc.collect()  # count the live objects only: torch's import leaves garbage that a collection may free later
before = len(gc.get_objects())
import ft_core
at_package = gc.get_freeze_count()
from ft_core.manager import Manager
print(json.dumps({"torch": before, "package": at_package, "manager": gc.get_freeze_count(),
                  "young": len(gc.get_objects())}))
"""

FT_CORE_FIRST = """
import gc, json
import ft_core
at_package = gc.get_freeze_count()
import torch
gc.collect()  # as above: the live objects only
with_torch = len(gc.get_objects()) + gc.get_freeze_count()
from ft_core import Manager
print(json.dumps({"package": at_package, "torch": with_torch, "manager": gc.get_freeze_count(),
                  "young": len(gc.get_objects())}))
"""

GARBAGE_AFTER = """
import gc, json, weakref, torch
import ft_core.manager

class Node:
    pass

a, b = Node(), Node()
a.other, b.other = b, a  # a cycle made after the freeze: still collected
ref = weakref.ref(a)
del a, b
gc.collect()
print(json.dumps({"collected": ref() is None}))
"""


def _run(code: str, **env: str) -> tuple[dict, str]:
    environ = {k: v for k, v in os.environ.items() if k != "FT_GC_FREEZE"}
    environ.update(env)
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120, env=environ)
    assert out.returncode == 0, out.stderr[-3000:]
    return json.loads(out.stdout.strip().splitlines()[-1]), out.stderr


@pytest.mark.timeout(180)
def test_importing_ft_core_after_torch_freezes_torchs_objects():
    got, _ = _run(TORCH_FIRST)
    assert got["package"] >= got["torch"] > 50_000  # torch alone makes well over 50,000 tracked objects
    assert got["manager"] >= got["package"]
    assert got["young"] < got["manager"] // 10  # what the collector still scans: the few objects made since


@pytest.mark.timeout(180)
def test_importing_torch_after_ft_core_is_frozen_by_the_managers_import():
    got, _ = _run(FT_CORE_FIRST)
    assert got["package"] < got["torch"] // 5  # ft_core alone is small and lazy
    assert got["manager"] >= got["torch"] > 50_000
    assert got["young"] < got["manager"] // 10


@pytest.mark.timeout(180)
@pytest.mark.parametrize("value, warned", [("0", False), ("off", False), ("maybe", True)])
def test_off_or_a_bad_value_freezes_nothing(value, warned):
    got, stderr = _run(TORCH_FIRST, FT_GC_FREEZE=value)
    assert got["package"] == got["manager"] == 0
    assert ("FT_GC_FREEZE='maybe' is not a valid boolean" in stderr) is warned
    assert stderr.count("UserWarning") == (1 if warned else 0)  # one warning, not one per call


@pytest.mark.timeout(180)
def test_cycles_made_after_the_freeze_are_still_collected():
    got, _ = _run(GARBAGE_AFTER)
    assert got["collected"]

"""Our stand-in `flash_attn` package (tests/fake_flash_attn, see its README) importable for one test, then gone again.
Its modules are imported once per process (they register torch custom ops) and put back into `sys.modules` for each
test that asks for them. A test file makes the fixture with

    @pytest.fixture
    def fake_flash(monkeypatch):
        yield from standin_flash_attn(monkeypatch)
"""

from __future__ import annotations

import importlib
import sys
from pathlib import Path

import pytest

from mmpg.grouping.backends import probe

STANDIN = Path(__file__).parent / "fake_flash_attn"
_MODULES: dict = {}


def _import_once() -> None:
    if _MODULES:
        return
    before = set(sys.modules)
    sys.path.insert(0, str(STANDIN))
    try:
        importlib.import_module("flash_attn.bert_padding")
    finally:
        sys.path.remove(str(STANDIN))
    for name in set(sys.modules) - before:
        if name == "flash_attn" or name.startswith("flash_attn."):
            _MODULES[name] = sys.modules.pop(name)


def standin_flash_attn(monkeypatch):
    """Generator for a fixture: yields the stand-in's `flash_attn_interface` (set its ALLOW_FP32 to run float32)."""
    if "flash_attn" in sys.modules and "flash_attn" not in _MODULES:
        pytest.skip("a real flash_attn is imported in this process")
    _import_once()
    for name, module in _MODULES.items():
        monkeypatch.setitem(sys.modules, name, module)
    interface = _MODULES["flash_attn.flash_attn_interface"]
    monkeypatch.setattr(interface, "ALLOW_FP32", False)
    monkeypatch.setattr(_MODULES["flash_attn"], "__version__", "2.8.3")
    probe.reset()
    yield interface
    probe.reset()

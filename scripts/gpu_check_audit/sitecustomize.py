"""Import audit for `bash scripts/gpu_check.sh --rehearse` (this folder goes first on PYTHONPATH, so every Python
process of the rehearsal, bench workers and pytest included, loads it at start-up).

Records the top-level package of every import statement that succeeds in a module under the checkout's mmpg/,
tests/, app/ or scripts/ and loads a package from outside the checkout (the tests' stand-in flash_attn is the
checkout's own), and appends them to $MMPG_IMPORT_AUDIT at exit, one `package<TAB>importer` line each.
`mmpg.grouping.gpu_bundle.audit_problems` then checks each against the image's packages and the bundle: an import
that only this machine's .venv can satisfy would fail on the GPU machine. Inactive without $MMPG_IMPORT_AUDIT.
"""

import atexit
import builtins
import os
import sys

_LOG = os.environ.get("MMPG_IMPORT_AUDIT")
_ROOT = os.environ.get("MMPG_IMPORT_AUDIT_ROOT", "")
if _LOG and _ROOT:
    _dirs = tuple(os.path.join(os.path.realpath(_ROOT), d) + os.sep for d in ("mmpg", "tests", "app", "scripts"))
    _seen = {}
    _import = builtins.__import__

    def _ours(path):
        return bool(path) and (path.startswith(_dirs) or os.path.realpath(path).startswith(_dirs))

    def _audited(name, globals=None, locals=None, fromlist=(), level=0):
        module = _import(name, globals, locals, fromlist, level)
        if level == 0 and globals and _ours(globals.get("__file__")):
            top = name.partition(".")[0]
            if top not in _seen and not _ours(getattr(sys.modules.get(top), "__file__", None) or ""):
                _seen[top] = globals.get("__name__", "?")
        return module

    def _write():
        if _seen:
            with open(_LOG, "a") as f:
                f.write("".join(f"{top}\t{importer}\n" for top, importer in sorted(_seen.items())))

    builtins.__import__ = _audited
    atexit.register(_write)

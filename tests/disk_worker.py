"""`mmpg train ARGV` in a forked process whose disk looks full from one save on (tests/test_checkpoint_disk.py):

    small N ARGV...    `mmpg.runs.disk.free_bytes` reports 1 MB free from the N-th save's space check on
    enospc N ARGV...   every torch.save into the N-th save's folder fails with ENOSPC, as a disk that filled up
                       after the check does (the space check itself sees the real free space)
"""

from __future__ import annotations

import errno


def main(argv: list[str]) -> int:
    mode, start, *args = argv
    import torch

    import mmpg.cli
    from mmpg.runs import disk

    calls = {"checks": 0}
    if mode == "small":
        real_free = disk.free_bytes

        def free_bytes(folder):
            calls["checks"] += 1
            free, where = real_free(folder)
            return (2 ** 20 if calls["checks"] >= int(start) else free), where

        disk.free_bytes = free_bytes
    elif mode == "enospc":
        real_save, target = torch.save, f".tmp-step_{int(start):08d}"

        def save(obj, f, *a, **kw):
            if target in str(f):
                raise OSError(errno.ENOSPC, "No space left on device", str(f))
            return real_save(obj, f, *a, **kw)

        torch.save = save
    else:
        raise ValueError(f"mode {mode!r}: small or enospc")
    return mmpg.cli.main(args)

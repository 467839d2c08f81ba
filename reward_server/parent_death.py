"""Child processes that end with the process that started them (Linux)."""

from __future__ import annotations

import os
import signal
import sys


def die_with_parent(parent: int) -> None:
    """SIGKILL this process when ``parent`` (the process that started it) dies, even mid-work:
    a killed server must not leave a child computing for hours (a math check) or exporting for
    minutes beside the export its restart begins. ``PR_SET_PDEATHSIG`` follows the *thread* that
    started the child: the thread must wait for it. Elsewhere than Linux nothing is set up.
    """
    if sys.platform.startswith("linux"):
        import ctypes

        pr_set_pdeathsig = 1
        ctypes.CDLL(None, use_errno=True).prctl(pr_set_pdeathsig, int(signal.SIGKILL))
    if os.getppid() != parent:  # the parent died before the line above took effect
        sys.exit(0)

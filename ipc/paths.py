"""tidal's cache folder, the one place its rule is written: what one process builds or measures
there, another finds (the step cost profiles `tidal tune profile` writes and the engine core
reads, the Hugging Face folders the GGUF converter makes for the workers, the C kernels'
builds, the OpenMP link every worker rank shares).

    $TIDAL_CACHE_DIR, else $XDG_CACHE_HOME/tidal, else ~/.cache/tidal

Standard library only: every folder may import it, `kernels/` too (its one import of ours,
docs/architecture.md §3.1).
"""

from __future__ import annotations

import os


def cache_dir() -> str:
    """$TIDAL_CACHE_DIR, else $XDG_CACHE_HOME/tidal, else ~/.cache/tidal (read each call: a
    test or a parent may set the variable after import)."""
    if os.environ.get("TIDAL_CACHE_DIR"):
        return os.environ["TIDAL_CACHE_DIR"]
    base = os.environ.get("XDG_CACHE_HOME") or os.path.join(os.path.expanduser("~"), ".cache")
    return os.path.join(base, "tidal")

"""Put first on ``PYTHONPATH`` by ``eagle3-compat run`` (see eagle3_compat.launcher).

At interpreter start: when ``EAGLE3_COMPAT_APPLIED`` is set, register the
post-import hook that applies eagle3_compat with those options once
speculators' generator is imported; then run the ``sitecustomize`` this file
shadows, if there is one.  Nothing else is imported here.
"""

import os
import sys


def _eagle3_compat_boot() -> None:
    if os.environ.get("EAGLE3_COMPAT_APPLIED"):
        try:
            from eagle3_compat._inherit import install
        except ImportError as exc:  # the launcher's folder outlived the package
            sys.stderr.write(f"eagle3_compat: cannot inherit apply(): {exc}\n")
        else:
            install()
    import importlib.machinery
    import importlib.util

    here = os.path.dirname(os.path.abspath(__file__))
    rest = [p for p in sys.path if os.path.abspath(p or os.curdir) != here]
    spec = importlib.machinery.PathFinder.find_spec("sitecustomize", rest)
    if spec is not None and spec.loader is not None:
        shadowed = importlib.util.module_from_spec(spec)
        spec.loader.exec_module(shadowed)


_eagle3_compat_boot()
del _eagle3_compat_boot

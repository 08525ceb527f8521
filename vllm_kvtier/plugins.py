"""Objects named by path, ``"package.module:Name"``: how an out-of-tree tier is found.

Who calls it: the config parser (an out-of-tree tier's section type) and the tier
registry (its spec), at start-up. It imports a module, so it may block briefly.
"""

from __future__ import annotations

import importlib
from typing import Any

__all__ = ["load_object"]


def load_object(path: str) -> Any:
    """The object ``path`` names (``"package.module:Name"``). ImportError naming ``path``
    when the module does not import or has no such name."""
    module_name, sep, attr = path.partition(":")
    if not sep or not module_name or not attr:
        raise ImportError(f"{path!r} is not 'package.module:Name'")
    module = importlib.import_module(module_name)
    try:
        return getattr(module, attr)
    except AttributeError as e:
        raise ImportError(f"{module_name} has no {attr}") from e

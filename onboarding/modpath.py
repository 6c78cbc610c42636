"""Dotted module paths, as ``nn.Module.named_modules`` names them: the one rule for "at or
inside". A path is inside a root when it is the root or names one of its submodules ("a.b" is
inside "a", "ab" is not); every path is inside the model itself, whose path is "".
"""

from __future__ import annotations


def inside(path: str, root: str) -> bool:
    """``path`` is ``root`` or a module below it (``root`` "" is the whole model)."""
    return root == "" or path == root or path.startswith(root + ".")


def related(a: str, b: str) -> bool:
    """One of the two paths is at or inside the other (a block and a patch that overlap)."""
    return inside(a, b) or inside(b, a)

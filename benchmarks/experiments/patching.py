"""What the make_exp scripts share: exact substitutions in a kernel module's source (each must
match the expected number of times, or the script stops: the tree moved under it)."""


def replace_once(src: str, old: str, new: str, count: int = 1) -> str:
    """``src`` with ``old`` replaced by ``new``; ``old`` must occur exactly ``count`` times."""
    assert src.count(old) == count, (old[:80], src.count(old))
    return src.replace(old, new)

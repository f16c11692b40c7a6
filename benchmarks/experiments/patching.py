"""What the make_exp scripts share: exact substitutions in a kernel module's source (each must
match the expected number of times, or the script stops: the tree moved under it), and since
session 30 one such edit the forward variants of exp99 / exp100 both make."""


def replace_once(src: str, old: str, new: str, count: int = 1) -> str:
    """``src`` with ``old`` replaced by ``new``; ``old`` must occur exactly ``count`` times."""
    assert src.count(old) == count, (old[:80], src.count(old))
    return src.replace(old, new)


def with_forward_locals(src: str, name: str, alloc: str) -> str:
    """``src`` (tilelang_kernels.py) with one more buffer per MMA warpgroup in
    ``sparse_mla_fwd_ws_kernel``: ``{name}0`` / ``{name}1`` allocated by ``alloc`` (e.g.
    ``"T.alloc_local([1], T.int32)"``) after ``m_blk1``, and handed to warpgroup 0 / 1 as ``w.{name}``."""
    src = replace_once(src, '''            m_blk1 = T.alloc_fragment([h_blk], acc)
            full0l''', f'''            m_blk1 = T.alloc_fragment([h_blk], acc)
            {name}0 = {alloc}
            {name}1 = {alloc}
            full0l''')
    for c in (0, 1):
        src = replace_once(src, f"blk_sum=blk_sum{c}, alpha=alpha{c}, m=m{c}, m_blk=m_blk{c}, **shared), {c})",
                           f"blk_sum=blk_sum{c}, alpha=alpha{c}, m=m{c}, m_blk=m_blk{c}, {name}={name}{c}, **shared), {c})")
    return src

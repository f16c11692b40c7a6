"""Writes glm5_dsa_plugin/ops/_exp63.py and _exp64.py (ignored by git), session 23, after exp60:
the persistent forwards with the fence once per row were still 4-5% slower than the tree's kernel
(the per-pair fence itself cost the tree 0.8-1.3%, exp62). In them a row's block count nb is an
expression on Extent[b, s, g] that TileLang inlines at each use: 10 global loads in the generated
CUDA (the tree's kernel computes nb once), one of them in every pair loop's condition, each an L2
round trip on the MMA warpgroups' critical path. Here each role keeps nb in a local, set once per
row. exp63 = exp60 + that, exp64 = exp61 + that. Run from the repository root."""
import runpy

from patching import replace_once

runpy.run_path("benchmarks/experiments/make_exp60.py")  # (writes _exp57 ... _exp62)

for base, name in (("_exp60", "_exp63"), ("_exp61", "_exp64")):
    src = open(f"glm5_dsa_plugin/ops/{base}.py").read()
    src = replace_once(src, '''    def row_at(b, g, Extent, item):
        # row item -> (query row s, first head h0, its blocks nb), last rows first
        s = NG - 1 - item // rep
        return dict(s=s, h0=g * hg + (item % rep) * h_blk, nb=T.min(slot_blocks(Extent[b, s, g], BI), NI))''',
                '''    def row_blocks(b, g, Extent, item):
        # row item's blocks (a global load: kept in a local once per row)
        return T.min(slot_blocks(Extent[b, NG - 1 - item // rep, g], BI), NI)

    def row_at(b, g, item, nbl):
        # row item -> (query row s, first head h0, its blocks nb from the local nbl), last rows first
        return dict(s=NG - 1 - item // rep, h0=g * hg + (item % rep) * h_blk, nb=nbl[0])''')
    src = replace_once(src, '''                w = SimpleNamespace(**regs, **shared, **row_at(b, g, Extent, sched.item[0]))''',
                '''                sched.nbl[0] = row_blocks(b, g, Extent, sched.item[0])
                w = SimpleNamespace(**regs, **shared, **row_at(b, g, sched.item[0], sched.nbl))''')
    src = replace_once(src, '''                        w = SimpleNamespace(**shared, **row_at(b, g, Extent, item[0]))''',
                '''                        nbl[0] = row_blocks(b, g, Extent, item[0])
                        w = SimpleNamespace(**shared, **row_at(b, g, item[0], nbl))''')
    src = replace_once(src, '''            prev = T.alloc_local([1], T.int32)
''', '''            prev = T.alloc_local([1], T.int32)
            nbl = T.alloc_local([1], T.int32)  # the current row's blocks
''')
    src = replace_once(src, '''jr=jr, run=run, item=item, prev=prev, pb=pb)''', '''jr=jr, run=run, item=item, prev=prev, pb=pb, nbl=nbl)''')
    open(f"glm5_dsa_plugin/ops/{name}.py", "w").write(src)
print("wrote glm5_dsa_plugin/ops/_exp63.py, _exp64.py")

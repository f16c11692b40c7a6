"""Writes glm5_dsa_plugin/ops/_exp97.py and _exp98.py (ignored by git), session 29 (prepared, not
run): which half of exp96 made it slower. exp96 changed two things at once: the free's semantics
(relaxed instead of release) and how it is issued (an asm block that ors one register of each of
the thread's four reads into the arrival count). exp97: a plain relaxed arrive, count 1, no
dependency on the reads (timing only: the memory model then leaves the reads unordered against
the free, so its results are only a measurement; exp96's race check is in exp97.py too). exp98:
exp96's asm block with release semantics (the count dependency kept): against v32, the cost of
the asm path alone. Runs make_exp96.py's source edit with another device function. Run from the
repository root."""
import runpy

from patching import replace_once

runpy.run_path("benchmarks/experiments/make_exp96.py")
exp96 = open("glm5_dsa_plugin/ops/_exp96.py").read()
relaxed_asm = ('mbarrier.arrive.relaxed.cta.shared::cta.b64 _, [%0], t;')
plain = replace_once(exp96, '''  asm volatile("{\\n\\t.reg .b32 t;\\n\\tor.b32 t, %1, %2;\\n\\tor.b32 t, t, %3;\\n\\tor.b32 t, t, %4;\\n\\t"
               "or.b32 t, t, 1;\\n\\tmin.u32 t, t, 1;\\n\\t"
               "''' + relaxed_asm + '''\\n\\t}"
               :: "r"(addr), "r"(__float_as_uint(a)), "r"(__float_as_uint(b)), "r"(__float_as_uint(c)),
                  "r"(__float_as_uint(d)) : "memory");''', '''  asm volatile("mbarrier.arrive.relaxed.cta.shared::cta.b64 _, [%0];" :: "r"(addr) : "memory");  // exp97''')
open("glm5_dsa_plugin/ops/_exp97.py", "w").write(plain)
release = replace_once(exp96, relaxed_asm, 'mbarrier.arrive.release.cta.shared::cta.b64 _, [%0], t;')
open("glm5_dsa_plugin/ops/_exp98.py", "w").write(release)
print("wrote glm5_dsa_plugin/ops/_exp97.py, _exp98.py")

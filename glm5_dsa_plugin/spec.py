"""``--spec glm5_dsa_plugin.spec get_glm5_dsa_spec``: the layer spec every Megatron client loads.

The public names of :mod:`glm5_dsa_plugin.megatron.spec`, where the spec is built:

* ``get_glm5_dsa_spec(args, config, vp_stage)`` / ``(config, vp_stage=...)``: the decoder block spec;
* ``get_glm5_dsa_mtp_spec``: the MTP block spec, same calling conventions;
* ``glm5_dsa_layer_spec``: a ``ModuleSpec`` of :class:`GLM5DSATransformerLayer` (the object form);
* ``glm5_dsa_hybrid_stack_spec``: the ``HybridModel`` stack spec (``pretrain_hybrid.py --spec
  glm5_dsa_plugin.spec glm5_dsa_hybrid_stack_spec --hybrid-layer-pattern ...``), from
  :mod:`glm5_dsa_plugin.megatron.hybrid_spec`.
"""

from .megatron.spec import (
    GLM5DSATransformerLayer,
    get_glm5_dsa_mtp_spec,
    get_glm5_dsa_spec,
    glm5_dsa_layer_spec,
    uses_transformer_engine,
)
from .megatron.hybrid_spec import glm5_dsa_hybrid_stack_spec

__all__ = ["GLM5DSATransformerLayer", "get_glm5_dsa_mtp_spec", "get_glm5_dsa_spec", "glm5_dsa_layer_spec",
           "glm5_dsa_hybrid_stack_spec", "uses_transformer_engine"]

"""Upstream Megatron-LM with our spec's MTP block: ``python -m glm5_dsa_plugin.megatron_lm SCRIPT ARGS...`` runs :func:`main`.

megatron-core 0.19.2's ``GPTModelBuilder`` (what Megatron-LM's ``pretrain_gpt.py`` builds through)
calls ``--spec`` for the decoder but builds the MTP block from megatron-core's own layer specs
(``megatron.training.models.gpt.mtp_block_spec``), which cannot hold our DSA attention: with
``--experimental-attention-variant dsa`` it asserts, without it the MLA core attention gets
arguments it does not take. No hook exists for a custom MTP spec, so this entry point installs one
(:func:`install_mtp_hook`) and then runs SCRIPT as ``__main__`` with ARGS, exactly as
``python SCRIPT ARGS`` would (``sys.argv``, ``sys.path[0]`` = the script's folder)::

    torchrun --nproc-per-node 8 -m glm5_dsa_plugin.megatron_lm /path/to/Megatron-LM/pretrain_gpt.py \\
        --spec glm5_dsa_plugin.spec get_glm5_dsa_spec --mtp-num-layers 1 ...

The hook is :func:`install_mtp_hook`; a launcher of one's own may call it before ``pretrain``.
It changes nothing for a decoder spec that is not ours.
"""

from __future__ import annotations

import runpy
import sys
from pathlib import Path

from .spec import MTP_HOOK_MARK, GLM5DSATransformerLayer, get_glm5_dsa_mtp_spec, mtp_hook_installed

__all__ = ["install_mtp_hook", "main", "mtp_hook_installed", "uninstall_mtp_hook"]


def _is_our_spec(spec) -> bool:
    if getattr(spec, "glm5_dsa", False):
        return True
    return getattr(spec, "module", None) is GLM5DSATransformerLayer


def install_mtp_hook() -> None:
    """Make megatron-core 0.19.2's ``GPTModelBuilder`` build the MTP block from our spec when the
    decoder spec is ours (``get_glm5_dsa_spec``'s result or ``glm5_dsa_layer_spec``). Idempotent."""
    import megatron.training.models.gpt as gpt

    if mtp_hook_installed():
        return
    original = gpt.mtp_block_spec

    def mtp_block_spec(config, transformer_layer_spec, vp_stage=None):
        if _is_our_spec(transformer_layer_spec):
            return get_glm5_dsa_mtp_spec(None, config.transformer, vp_stage=vp_stage)
        return original(config, transformer_layer_spec, vp_stage=vp_stage)

    setattr(mtp_block_spec, MTP_HOOK_MARK, original)
    gpt.mtp_block_spec = mtp_block_spec


def uninstall_mtp_hook() -> None:
    import megatron.training.models.gpt as gpt

    original = getattr(gpt.mtp_block_spec, MTP_HOOK_MARK, None)
    if original is not None:
        gpt.mtp_block_spec = original


def main(argv: list[str] | None = None) -> None:
    argv = list(sys.argv[1:] if argv is None else argv)
    if not argv or argv[0] in ("-h", "--help"):
        print(__doc__)
        raise SystemExit(0 if argv else 2)
    script = Path(argv[0])
    if not script.is_file():
        raise SystemExit(f"glm5_dsa_plugin.megatron_lm: no such script {script} (give the path of pretrain_gpt.py)")
    install_mtp_hook()
    sys.argv = [str(script)] + argv[1:]
    sys.path.insert(0, str(script.resolve().parent))
    runpy.run_path(str(script), run_name="__main__")


if __name__ == "__main__":
    main()

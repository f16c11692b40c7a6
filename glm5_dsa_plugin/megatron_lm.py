"""``python -m glm5_dsa_plugin.megatron_lm /path/to/pretrain_gpt.py ARGS...``: upstream Megatron-LM
with our spec's MTP block (see :mod:`glm5_dsa_plugin.megatron.upstream`)."""

from .megatron.upstream import install_mtp_hook, main, mtp_hook_installed, uninstall_mtp_hook

__all__ = ["install_mtp_hook", "main", "mtp_hook_installed", "uninstall_mtp_hook"]

if __name__ == "__main__":
    main()

"""glm5-dsa-plugin: exact, validated, fast GLM-5 DSA for Megatron-core / Megatron-Bridge."""

__all__ = ["__version__"]

__version__ = "0.5.0"

"""The config jfed/configs/fedtsa_fashion_mnist.py by its checkout path
(`--config=fedtsa_fashion_mnist` names it too)."""

from jfed.configs.fedtsa_fashion_mnist import get_config

__all__ = ['get_config']

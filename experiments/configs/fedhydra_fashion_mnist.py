"""The config jfed/configs/fedhydra_fashion_mnist.py by its checkout path
(`--config=fedhydra_fashion_mnist` names it too)."""

from jfed.configs.fedhydra_fashion_mnist import get_config

__all__ = ['get_config']

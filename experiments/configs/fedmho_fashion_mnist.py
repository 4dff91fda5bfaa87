"""The config jfed/configs/fedmho_fashion_mnist.py by its checkout path
(`--config=fedmho_fashion_mnist` names it too)."""

from jfed.configs.fedmho_fashion_mnist import get_config

__all__ = ['get_config']

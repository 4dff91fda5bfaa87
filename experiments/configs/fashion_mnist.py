"""The config jfed/configs/fashion_mnist.py by its checkout path
(`--config=fashion_mnist` names it too)."""

from jfed.configs.fashion_mnist import get_config

__all__ = ['get_config']

"""The config jfed/configs/hfldd_fashion_mnist.py by its checkout path
(`--config=hfldd_fashion_mnist` names it too)."""

from jfed.configs.hfldd_fashion_mnist import get_config

__all__ = ['get_config']

"""`--config=experiments/configs/fashion_mnist.py` from a checkout: the config is jfed/configs/fashion_mnist.py
(`--config=fashion_mnist` names it from an installed jfed)."""

from jfed.configs.fashion_mnist import get_config

__all__ = ['get_config']

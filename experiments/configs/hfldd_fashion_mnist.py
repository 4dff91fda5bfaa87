"""`--config=experiments/configs/hfldd_fashion_mnist.py` from a checkout: the config is jfed/configs/hfldd_fashion_mnist.py
(`--config=hfldd_fashion_mnist` names it from an installed jfed)."""

from jfed.configs.hfldd_fashion_mnist import get_config

__all__ = ['get_config']

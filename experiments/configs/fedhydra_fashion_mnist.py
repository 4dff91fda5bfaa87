"""`--config=experiments/configs/fedhydra_fashion_mnist.py` from a checkout: the config is jfed/configs/fedhydra_fashion_mnist.py
(`--config=fedhydra_fashion_mnist` names it from an installed jfed)."""

from jfed.configs.fedhydra_fashion_mnist import get_config

__all__ = ['get_config']

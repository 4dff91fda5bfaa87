"""`--config=experiments/configs/fedmho_fashion_mnist.py` from a checkout: the config is jfed/configs/fedmho_fashion_mnist.py
(`--config=fedmho_fashion_mnist` names it from an installed jfed)."""

from jfed.configs.fedmho_fashion_mnist import get_config

__all__ = ['get_config']

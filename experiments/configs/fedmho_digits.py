"""`--config=experiments/configs/fedmho_digits.py` from a checkout: the config is jfed/configs/fedmho_digits.py
(`--config=fedmho_digits` names it from an installed jfed)."""

from jfed.configs.fedmho_digits import get_config

__all__ = ['get_config']

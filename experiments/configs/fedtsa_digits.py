"""`--config=experiments/configs/fedtsa_digits.py` from a checkout: the config is jfed/configs/fedtsa_digits.py
(`--config=fedtsa_digits` names it from an installed jfed)."""

from jfed.configs.fedtsa_digits import get_config

__all__ = ['get_config']

"""`--config=experiments/configs/fedhydra_digits.py` from a checkout: the config is jfed/configs/fedhydra_digits.py
(`--config=fedhydra_digits` names it from an installed jfed)."""

from jfed.configs.fedhydra_digits import get_config

__all__ = ['get_config']

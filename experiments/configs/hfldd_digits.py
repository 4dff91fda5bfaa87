"""`--config=experiments/configs/hfldd_digits.py` from a checkout: the config is jfed/configs/hfldd_digits.py
(`--config=hfldd_digits` names it from an installed jfed)."""

from jfed.configs.hfldd_digits import get_config

__all__ = ['get_config']

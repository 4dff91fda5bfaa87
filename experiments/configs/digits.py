"""`--config=experiments/configs/digits.py` from a checkout: the config is jfed/configs/digits.py
(`--config=digits` names it from an installed jfed)."""

from jfed.configs.digits import get_config

__all__ = ['get_config']

"""`--config=experiments/configs/robustness.py` from a checkout: the config is jfed/configs/robustness.py
(`--config=robustness` names it from an installed jfed)."""

from jfed.configs.robustness import get_config

__all__ = ['get_config']

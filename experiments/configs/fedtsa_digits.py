"""jfed/configs/fedtsa_digits.py, by its checkout path.

`--config=fedtsa_digits` names it too. The module's names are copied here for the scripts
that read them (VARIANTS, ...).
"""

from jfed.configs import fedtsa_digits as _config

globals().update({k: v for k, v in vars(_config).items() if not k.startswith('__')})

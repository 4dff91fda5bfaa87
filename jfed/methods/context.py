"""What a method sees: the run context and the key purposes (defined in jfed.driver/jfed.keys)."""

from jfed.driver import RunContext
from jfed.keys import Purpose, ServerRoundPurpose

__all__ = ['Purpose', 'RunContext', 'ServerRoundPurpose']

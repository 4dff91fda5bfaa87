"""`python -m experiments.main --method=NAME --config=FILE` from a checkout: jfed's command line
(jfed/cli.py; `jfed` or `python -m jfed` once installed)."""

from jfed import cli

if __name__ == '__main__':
  cli.run()

"""`python -m jfed --method=NAME --config=FILE`: jfed's command line (jfed/cli.py)."""

from jfed import cli

if __name__ == '__main__':
  cli.run()

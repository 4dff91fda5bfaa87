"""What `python -m experiments.main` imports before it can answer: no library that only some runs
need. Each costs every command, every refused config and every subprocess its import time (scipy's
stats and signal modules, through dp-accounting and the KDE clustering, were about half of the CLI's
4 s of CPU before an error line), so they are imported where they are used."""

import subprocess
import sys

# Imported on first use only: DP accounting, FedTSA's KDE, plotting.
ON_FIRST_USE = ('dp_accounting', 'scipy', 'matplotlib')


def test_the_command_line_and_every_method_load_without_the_libraries_of_some_runs():
  probe = (
    'import sys\n'
    'from experiments import main\n'
    'from jfed import driver\n'
    'from jfed.methods import registry\n'
    'registry.available_methods()\n'
    f'print(sorted(m for m in sys.modules if m.split(".")[0] in {ON_FIRST_USE!r}))\n'
  )
  out = subprocess.run(
    [sys.executable, '-c', probe], capture_output=True, text=True, check=True, timeout=300
  )
  assert out.stdout.strip() == '[]', out.stdout

"""Do the generators produce usable data? Scores the synthetic sets that FedMHO, FedCVAE and FedTSA
runs wrote (workdir/synthetic.npz) with a classifier trained on real training images.

    python -m experiments.generator_check --runs=runs/fm_fedmho_md,runs/fm_fedcvae \
        [--reference_model=cnn_mnist] [--reference_epochs=3] [--out=runs/generator_check.md]

For the runs' dataset (from the first run's config.json: the same dataset, holdout and seed), a
reference classifier is trained centrally on the training split (the `centralized` method; the
test split only scores it). Each run's samples are then labelled by it, and the table gives, per
run, the share of kept samples it labels as their conditioned class (issue 36's precondition for
a table whose methods learn from generated data: at least 80 %), the same for the samples the
filter removed (FedMHO's Algorithm 2 should remove the worse ones), and the lowest class. The
reference's own test accuracy is the ceiling of what these shares can mean.
"""

import json
import pathlib
from typing import Dict, List, NamedTuple, Optional, Sequence

from absl import app, flags
import ml_collections
import numpy as np

from experiments import sweep
from jfed.workdir import atomic_write_text

FLAGS = flags.FLAGS
USABLE = 0.8


class SampleScore(NamedTuple):
  """How a reference classifier labels one run's synthetic set."""

  run: str
  generated: int
  kept: int
  kept_accuracy: float  # share of kept samples labelled as their conditioned class
  removed_accuracy: float  # the same for the samples the filter removed (NaN: none removed)
  per_class: List[float]  # kept samples, per conditioned class (NaN: class absent)


def load_synthetic(run: pathlib.Path):
  """(images in [0, 1], labels, kept indices) of a run's synthetic.npz."""
  path = run / 'synthetic.npz'
  if not path.exists():
    raise app.UsageError(
      f'{path} does not exist: only FedMHO, FedCVAE and FedTSA runs write their samples'
    )
  with np.load(path) as f:
    return f['images'].astype(np.float32) / 255.0, f['labels'], f['kept']


def score(run: str, predicted: np.ndarray, labels: np.ndarray, kept: np.ndarray, classes: int):
  """The SampleScore of a run from the reference's predicted classes of every sample."""
  correct = predicted == labels
  removed = np.setdiff1d(np.arange(len(labels)), kept)
  per_class = [
    float(correct[kept][labels[kept] == c].mean()) if np.any(labels[kept] == c) else float('nan')
    for c in range(classes)
  ]
  return SampleScore(
    run,
    len(labels),
    len(kept),
    float(correct[kept].mean()) if len(kept) else float('nan'),
    float(correct[removed].mean()) if len(removed) else float('nan'),
    per_class,
  )


def reference_classifier(config: ml_collections.ConfigDict, model: str, epochs: int):
  """Trains `model` on the training split of `config`'s dataset (its holdout and seed) with the
  `centralized` method; returns (predict(images) -> classes, its test accuracy)."""
  from jfed import engine  # pylint: disable=g-import-not-at-top
  from jfed.driver import build_algorithm, context_of_config  # pylint: disable=g-import-not-at-top

  config = config.copy_and_resolve_references()
  config.model, config.client_models = model, ''
  config.centralized.epochs = epochs
  algorithm = build_algorithm('centralized', config)
  ctx = context_of_config(config)
  aux = algorithm.setup(ctx)
  state = algorithm.init(ctx, aux)
  accuracy = float('nan')
  for i in range(epochs):
    state, records = algorithm.step(ctx, aux, state, i)
    accuracy = records[-1]['test_accuracy']
  params = engine.take(state.model, 0)
  return lambda x: np.argmax(aux.evaluator.logits(params, x), axis=-1), accuracy


class Labeller:
  """Scores runs' synthetic sets with one reference classifier (`reference_classifier`),
  trained when the first run with samples is scored: what the table commands put in their
  headers as the precondition that the generators produce usable data."""

  def __init__(self, config: ml_collections.ConfigDict, model: str, epochs: int):
    self.config, self.model, self.epochs = config, model, int(epochs)
    self.reference: Optional[Dict] = None  # model, epochs, test_accuracy once trained
    self._predict = None

  def score(self, workdir: pathlib.Path) -> Optional[SampleScore]:
    """The run's SampleScore; None with epochs 0 (off) or a run that wrote no samples."""
    if not self.epochs or not (workdir / 'synthetic.npz').exists():
      return None
    if self._predict is None:
      self._predict, accuracy = reference_classifier(self.config, self.model, self.epochs)
      self.reference = {'model': self.model, 'epochs': self.epochs, 'test_accuracy': accuracy}
    images, labels, kept = load_synthetic(workdir)
    return score(workdir.name, self._predict(images), labels, kept, int(labels.max()) + 1)


def open_sweep(
  out: pathlib.Path, seeds: Sequence[int], merge: Sequence[str], **meta
) -> sweep.Sweep:
  """`sweep.Sweep.open` that also restores the reference classifier's description (the first
  saved or merged results.json that has one), so that a resumed or merged table keeps its
  precondition line without training the reference again."""
  references = []

  def read(path: pathlib.Path) -> dict:
    saved = json.loads(path.read_text())
    references.append(saved['meta'].get('reference'))
    return saved

  s = sweep.Sweep.open(out, seeds, merge, read, **meta)
  if any(references):
    s.meta['reference'] = next(r for r in references if r)
  return s


def _share(fraction: float) -> str:
  """A share in %, or '— (none removed)' where no sample was removed (no filter)."""
  return '— (none removed)' if fraction != fraction else f'{100 * fraction:.1f} %'


def render(scores: List[SampleScore], reference: Dict) -> str:
  lines = [
    '# Generated samples labelled by a classifier trained on real data',
    '',
    f'Reference: {reference["model"]}, {reference["epochs"]} epochs on the {reference["dataset"]} '
    f'training split, test accuracy {100 * reference["test_accuracy"]:.2f} %. A run passes when '
    f'at least {100 * USABLE:.0f} % of its kept samples are labelled as their conditioned class.',
    '',
    '| run | generated | kept | kept labelled right | removed labelled right | lowest class '
    '| usable |',
    '|---|---:|---:|---:|---:|---|---|',
  ]
  for s in scores:
    present = [(a, c) for c, a in enumerate(s.per_class) if a == a]
    low = min(present) if present else (float('nan'), -1)
    lines.append(
      f'| {s.run} | {s.generated} | {s.kept} | {100 * s.kept_accuracy:.1f} % | '
      f'{_share(s.removed_accuracy)} | class {low[1]}: {100 * low[0]:.1f} % | '
      f'{"yes" if s.kept_accuracy >= USABLE else "no"} |'
    )
  return '\n'.join(lines) + '\n'


def main(argv):
  del argv
  runs = [pathlib.Path(r) for r in FLAGS.runs]
  samples = [load_synthetic(r) for r in runs]  # a run without samples fails before training
  config_path = runs[0] / 'config.json'
  if not config_path.exists():
    raise app.UsageError(f'{config_path} does not exist: --runs must be run directories')
  config = ml_collections.ConfigDict(json.loads(config_path.read_text()))
  predict, accuracy = reference_classifier(config, FLAGS.reference_model, FLAGS.reference_epochs)
  classes = int(max(labels.max() for _, labels, _ in samples)) + 1
  scores = [
    score(str(r), predict(images), labels, kept, classes)
    for r, (images, labels, kept) in zip(runs, samples)
  ]
  reference = {
    'model': FLAGS.reference_model,
    'epochs': FLAGS.reference_epochs,
    'dataset': config.dataset.name,
    'test_accuracy': accuracy,
  }
  text = render(scores, reference)
  print(text)
  if FLAGS.out:
    atomic_write_text(pathlib.Path(FLAGS.out), text)


if __name__ == '__main__':
  flags.DEFINE_list(
    'runs', None, 'Run directories of FedMHO, FedCVAE or FedTSA runs (synthetic.npz).'
  )
  flags.DEFINE_string('reference_model', 'cnn_mnist', 'The reference classifier (a model spec).')
  flags.DEFINE_integer('reference_epochs', 3, 'Its epochs on the training split.')
  flags.DEFINE_string('out', None, 'Also write the table here (Markdown).')
  flags.mark_flags_as_required(['runs'])
  app.run(main)

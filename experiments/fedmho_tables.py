"""FedMHO Tables 3 and 4 and Fig. 9 (Yao et al., WWW 2026): every method on every Dirichlet
α, over seeds.

    python -m experiments.fedmho_tables --config=experiments/configs/fedmho_fashion_mnist.py \
        --out=runs/fedmho_tables [--budget=paper] [--alphas=0.5,0.3,0.1] [--seeds=0,1,2] \
        [--runs=fedavg_vote,feddf_vote,...]

`--config` is a FedMHO config file (fedmho_fashion_mnist.py, fedmho_digits.py); the command calls
its `get_config` with the `--budget` words plus, per run, the client-set word and `dir=α`.
Each (α, seed, run) goes through `jfed.driver.run_experiment` into OUT/dir<α>/seed<s>/<run>/
(metrics, summary, plots, checkpoints): rerunning the command resumes an interrupted run and
skips finished ones, so the sweep can be stopped at any point and continued later.

FedMHO (Yao et al., WWW 2026) Table 1 gives the methods different clients; per (α, seed) each
client set trains once and its runs share it (`local_models_dir` / `local_cvaes_dir` =
OUT/dir<α>/seed<s>/<set>/, or under `--clients_root` instead of OUT, which sweeps of the same
config and budget share, e.g. the GPU queue's chunks of one seed on one machine):
- 'fedmho' (the config's default clients: VGG-9 + CVAE-small): fedmho, fedmho_md, fedmho_sd
  and the Table 4 ablation runs fedmho_md_nofilter / fedmho_sd_nofilter (R_th = 1, N_syn the
  number the filter keeps, 0.8 · N_syn: the paper's "same number of samples");
- 'baselines' (VGG-9 + small CNN, variant word 'baselines'): fedavg_vote, feddf_vote, dense,
  coboosting;
- 'fedcvae' (CVAE-large + CVAE-small, variant word 'fedcvae'): fedcvae_ens, run as the FedMHO
  reference runs its FEDCVAE row (`fedcvae.protocol='fedmho'`: FedMHO's per-class generation and
  filter, FedMHO's server optimiser, batch and epochs);
- 'fedcvae_kd' (CVAE-large + CVAE-small at one latent size, variant word 'fedcvae_kd'):
  fedcvae_kd, whose server decoder is fed the users' latents (the paper has no FEDCVAE-KD row).
Every run of a config holds out the same `dataset.holdout_size` training samples (FedDF's
distillation and validation images), so all methods' clients hold the same data, and every run
is scored on the whole test split. The seed changes the partition, every initialisation and
every draw. Before an α's first run (`--batch_seeds`, on by default) the baseline set's local
models of every seed that has none yet train as one client group of all those seeds' clients
(`jfed.methods.seed_batch`: each client with its own seed's data, init and keys, so the models
are those its own run would train), written where the runs look for them.

Writes OUT/tables.md — Table 3 (runs × α, "mean ± std over seeds" of the final and of the best
test accuracy in %, the paper's number beside ours), Table 4 (with and without the filter) and
reference rows (FedMHO's initial global model, the teacher ensemble) — with the budget and the
backend in its header; OUT/table3.png (Table 3 as bars with std error bars, the paper's beside);
OUT/results.json (every run's numbers); OUT/synthetic_samples.png, the
Fig. 9 grid of the first FedMHO-MD run (five kept and five removed samples per class). A run
that fails is counted as 'error' (its message in results.json) and the sweep goes on.

The header also shows whether the generators produce usable data (issue 36's precondition): a
reference classifier (`--reference_model`, default cnn_mnist, `--reference_epochs` on the real
training images, once per sweep; 0 turns it off) labels each FedMHO-MD and FEDCVAE (Ens) run's
generated samples (`experiments.generator_check`), and the line gives the share of the kept and
of the removed samples labelled as their conditioned class, mean ± std over seeds. It also shows
the classifier clients' precondition: the config file's measured evidence for the budget's words
(its `EVIDENCE`, e.g. fedmho_digits.py's `plateau`: the local client curve of
`experiments.client_curve`) and, from run 'fedmho', the mean and lowest test accuracy of this
sweep's FedMHO classifier clients.

The tables end with a verdict for every ordering the paper gives at each α (Table 3's pairs and
Table 4's "the filter helps"): holds / fails / within noise, a two-sided t-test over the seeds
paired by seed. On a dataset the paper does not report (digits) the orderings tested are those
of its Fashion-MNIST tables.
"""

import pathlib
import shutil
from typing import Dict, List, NamedTuple, Optional, Sequence

from absl import flags
import numpy as np

from experiments import generator_check, sweep
from experiments.seed_tables import (
  evidence_lines,
  load_config_module,
  mean_std,
  ordering_lines,
  paper_orderings,
  percent_stats_each,
  pretrain_seeds,
)
from jfed.figures import save_png

FLAGS = flags.FLAGS


def define_flags() -> None:
  """The command's flags; defined only when it runs as a command, so that importing the module
  (tests) does not clash with the flags of the other comparison commands."""
  sweep.define_flags('runs/fedmho_tables', config='A FedMHO config file, FILE[:budget words].')
  flags.DEFINE_string('budget', '', "More budget words for the config (e.g. 'paper', 'smoke').")
  flags.DEFINE_list('alphas', ['0.5', '0.3', '0.1'], 'Dirichlet α (columns).')
  flags.DEFINE_list('runs', None, 'Runs (rows); default: all of RUNS.')
  flags.DEFINE_integer(
    'reference_epochs',
    3,
    'Epochs of the reference classifier (trained on real training images) that labels the '
    "generated samples of the runs that generate (the table's precondition line); 0: none.",
  )
  flags.DEFINE_string('reference_model', 'cnn_mnist', 'The reference classifier (a model spec).')
  flags.DEFINE_bool(
    'batch_seeds',
    True,
    "Before an α's runs: train the baseline client set's local models of its seeds that have "
    'none yet in one program (jfed.methods.seed_batch), which the runs then read.',
  )
  flags.DEFINE_string(
    'clients_root',
    None,
    'Where the client sets (their trained local models and CVAEs) live, as '
    '<root>/dir<α>/seed<s>/<set>; default: beside the runs under --out. Sweeps of the same '
    'config and budget that name the same root train each set once (the GPU queue: chunks of '
    'one seed).',
  )


class Run(NamedTuple):
  method: str  # the registered method
  clients: str  # the client set: '' (the config's default), 'baselines', 'fedcvae', 'fedcvae_kd'
  name: str  # Table 3 / 4 row
  ablation: bool = False  # Table 4: R_th = 1 with the filtered sample count


RUNS: Dict[str, Run] = {
  'fedavg_vote': Run('fedavg_vote', 'baselines', 'FedAvg'),
  'feddf_vote': Run('feddf_vote', 'baselines', 'FedDF'),
  'dense': Run('dense', 'baselines', 'DENSE'),
  'coboosting': Run('coboosting', 'baselines', 'Co-Boosting'),
  'fedcvae_ens': Run('fedcvae_ens', 'fedcvae', 'FEDCVAE (Ens)'),
  'fedcvae_kd': Run('fedcvae_kd', 'fedcvae_kd', 'FEDCVAE-KD'),
  'fedmho': Run('fedmho', '', 'FedMHO'),
  'fedmho_md': Run('fedmho_md', '', 'FedMHO-MD'),
  'fedmho_sd': Run('fedmho_sd', '', 'FedMHO-SD'),
  'fedmho_md_nofilter': Run('fedmho_md', '', 'FedMHO-MD w/o data optimisation', True),
  'fedmho_sd_nofilter': Run('fedmho_sd', '', 'FedMHO-SD w/o data optimisation', True),
}

# FedMHO (Yao et al., WWW 2026) Table 3, Fashion-MNIST, top-1 test accuracy (%) mean ±
# std, and Table 4 (Fashion-MNIST, without the unsupervised data optimisation).
PAPER = {
  'fedavg_vote': {0.5: (60.24, 1.47), 0.3: (47.36, 0.21), 0.1: (30.37, 0.79)},
  'feddf_vote': {0.5: (65.66, 1.36), 0.3: (59.21, 2.20), 0.1: (42.21, 2.80)},
  'dense': {0.5: (72.29, 2.63), 0.3: (68.14, 0.97), 0.1: (56.12, 3.94)},
  'coboosting': {0.5: (72.98, 1.61), 0.3: (69.50, 0.64), 0.1: (61.73, 1.36)},
  'fedcvae_ens': {0.5: (69.11, 1.35), 0.3: (68.39, 0.49), 0.1: (64.01, 2.47)},
  'fedmho': {0.5: (75.30, 0.62), 0.3: (72.36, 0.92), 0.1: (62.14, 1.45)},
  'fedmho_md': {0.5: (77.27, 0.48), 0.3: (75.69, 0.93), 0.1: (71.04, 0.50)},
  'fedmho_sd': {0.5: (77.73, 0.59), 0.3: (76.45, 0.53), 0.1: (69.65, 0.99)},
  'fedmho_md_nofilter': {0.5: (74.56, None), 0.3: (73.15, None), 0.1: (65.13, None)},
  'fedmho_sd_nofilter': {0.5: (75.11, None), 0.3: (74.12, None), 0.1: (65.42, None)},
}
TABLE3 = (
  'fedavg_vote',
  'feddf_vote',
  'dense',
  'coboosting',
  'fedcvae_ens',
  'fedcvae_kd',
  'fedmho',
  'fedmho_md',
  'fedmho_sd',
)
TABLE4 = (('fedmho_md', 'fedmho_md_nofilter'), ('fedmho_sd', 'fedmho_sd_nofilter'))
CLIENT_KEY = 'client_mean_test_accuracy'  # a run's classifier clients, mean test accuracy
SUMMARY_KEYS = (
  'final_test_accuracy',
  'best_test_accuracy',
  'initial_test_accuracy',
  'teacher_ensemble_test_accuracy',
  'synthetic_kept',
  'seconds',
)


def run_config(module, budget: str, run: Run, alpha: float, seed: int, cell: pathlib.Path):
  """The config of one run: the budget, its client set and α; seed; the set's shared clients,
  in `cell` (the (α, seed) folder of the client sets: `cell_dir(clients_root or out, ...)`)."""
  words = [w for w in (budget, run.clients, f'dir={alpha}') if w]
  c = module.get_config(','.join(words))
  c.seed = seed
  clients = cell / (run.clients or 'fedmho')
  c.local_models_dir = str((clients / 'local_models').absolute())
  c.local_cvaes_dir = str((clients / 'local_cvaes').absolute())
  if run.ablation:
    c.fedmho.num_synthetic = int(round(c.fedmho.clean_rate * c.fedmho.num_synthetic))
    c.fedmho.clean_rate = 1.0
  return c


def client_record(summary) -> dict:
  """The mean and lowest test accuracy of a FedMHO run's classifier clients (its summary's
  `classifier_client_test_accuracy`); empty for a run that reports none."""
  clients = summary.get('classifier_client_test_accuracy')
  if not clients:
    return {}
  values = [float(v) for v in clients.values()]
  return {CLIENT_KEY: float(np.mean(values)), 'client_lowest_test_accuracy': min(values)}


def cell_dir(out: pathlib.Path, alpha: float, seed: int) -> pathlib.Path:
  return out / f'dir{alpha}' / f'seed{seed}'


def gather(results: dict, run: str, alpha: float, key: str) -> List[float]:
  cells = results.get(str(alpha), {})
  return [
    r[run][key]
    for r in cells.values()
    if isinstance(r.get(run), dict) and r[run].get(key) is not None
  ]


def errors(results: dict, run: str, alpha: float) -> int:
  cells = results.get(str(alpha), {})
  return sum(1 for r in cells.values() if r.get(run, {}).get('status') == 'error')


def paper_cell(run: str, alpha: float) -> str:
  p = PAPER.get(run, {}).get(alpha)
  if p is None:
    return '—'
  return f'{p[0]:.2f}' + (f' ± {p[1]:.2f}' if p[1] is not None else '')


def ours_cell(results: dict, run: str, alpha: float, key: str) -> str:
  values = gather(results, run, alpha, key)
  text = mean_std(values) or '—'
  n_err = errors(results, run, alpha)
  note = f' (n={len(values)})' if values else ''
  return text + note + (f', {n_err} error' if n_err else '')


def budget_lines(c) -> List[str]:
  m, cv, d, cb, df = c.fedmho, c.fedcvae, c.dense, c.coboosting, c.feddf
  return [
    f'- data: {c.dataset.name}, {c.partition.num_clients} clients, '
    f'{c.partition.scheme} partition; batch {c.batch_size}',
    f'- FedMHO clients {c.client_models}; classifiers {m.local_epochs} local epochs of '
    f'{c.optimizer.name} lr {c.optimizer.lr} (paper: 200), CVAEs {m.cvae_epochs} epochs of '
    f'{m.cvae_optimizer} {m.cvae_lr} (paper: 40)',
    f'- FedMHO server: N_syn {m.num_synthetic}, R_th {m.clean_rate}, {m.epochs} epochs of '
    f'Adam {m.lr}, batch {m.batch}, λ {m.lam}',
    f'- FedCVAE ({cv.protocol} protocol): CVAE-large + CVAE-small clients, {cv.cvae_epochs} '
    f'epochs of {cv.cvae_optimizer} {cv.cvae_lr} (CVAE-small {cv.cvae_small_lr or cv.cvae_lr}); '
    f'{cv.num_synthetic} samples'
    + (f', R_th {cv.clean_rate}' if cv.protocol == 'fedmho' else '')
    + f', classifier {cv.epochs} epochs of Adam {cv.lr}, batch {cv.batch}',
    f'- baselines (VGG-9 + small CNN clients, {c.fedavg_vote.local_epochs} local epochs): DENSE '
    f'{d.epochs} epochs x {d.g_steps} generator steps on {d.synthesis_batch}, student '
    f'{d.kd_optimizer} {d.kd_lr}; Co-Boosting {cb.epochs} x {cb.g_steps} on '
    f'{cb.synthesis_batch}, student {cb.kd_optimizer} {cb.kd_lr}; FedDF {df.total_steps} steps of '
    f'{df.kd_batch} on {df.source_size} unlabelled held-out training images per prototype '
    f'student',
    f'- every method: {c.dataset.get("holdout_size", 0)} training samples held out of the '
    'clients; scored on the whole test split',
  ]


# The runs whose server learns from generated samples; the runs of one client set share them.
GENERATING = ('fedmho_md', 'fedcvae_ens')


def client_lines(results: dict, runs: List[str], alphas: List[float]) -> List[str]:
  """The classifier clients' own test accuracy in this sweep (FedMHO's VGG-9 clients, from run
  'fedmho'), mean ± std over seeds of the clients' mean, and the lowest client."""
  if 'fedmho' not in runs or not any(gather(results, 'fedmho', a, CLIENT_KEY) for a in alphas):
    return []
  cells = []
  for a in alphas:
    values = gather(results, 'fedmho', a, CLIENT_KEY)
    lows = gather(results, 'fedmho', a, 'client_lowest_test_accuracy')
    low = f' (lowest client {100 * min(lows):.2f})' if lows else ''
    cells.append(f'α={a}: {mean_std(values) or "—"}{low}')
  return [
    '',
    "FedMHO's classifier clients in these runs, mean client test accuracy (%), mean ± std over "
    'seeds: ' + '; '.join(cells) + '.',
  ]


def precondition_lines(results: dict, runs: List[str], alphas: List[float], meta: dict):
  """Issue 36's precondition for the generating runs: the share of the kept (and of the removed)
  generated samples that a classifier trained on real training images labels as their class."""
  reference = meta.get('reference')
  shown = [r for r in GENERATING if r in runs]
  if not reference or not shown:
    return []
  lines = [
    '',
    f'Generated samples labelled as their conditioned class by a reference {reference["model"]} '
    f'({reference["epochs"]} epochs on the training split, test accuracy '
    f'{100 * reference["test_accuracy"]:.2f} %; `experiments.generator_check`), kept / removed by '
    'the filter, mean ± std over seeds (usable at ≥ 80 % kept):',
  ]
  for run in shown:
    cells = []
    for a in alphas:
      kept = mean_std(gather(results, run, a, 'kept_labelled_right'))
      removed = mean_std(gather(results, run, a, 'removed_labelled_right'))
      cells.append(f'α={a}: {kept or "—"} / {removed or "—"}')
    lines.append(f'- {RUNS[run].name}: ' + '; '.join(cells))
  return lines


def render(config, results: dict, runs: List[str], alphas: List[float], meta: dict) -> str:
  paper = config.dataset.name == 'fashion_mnist'
  head = (
    '| Method | '
    + ' | '.join(f'α={a} ours' + (f' | α={a} paper' if paper else '') for a in alphas)
    + ' |'
  )
  rule = '|---|' + '---:|' * (len(alphas) * (2 if paper else 1))

  def row(run: str, key: str) -> str:
    cells = []
    for a in alphas:
      cells.append(ours_cell(results, run, a, key))
      if paper:
        cells.append(paper_cell(run, a))
    return f'| {RUNS[run].name} | ' + ' | '.join(cells) + ' |'

  lines = [
    f'# FedMHO Table 3 on {config.dataset.name}: jfed vs the paper',
    '',
    'Top-1 test accuracy (%), mean ± std over seeds (n = the seeds finished). Paper: '
    'FedMHO (Yao et al., WWW 2026) '
    'Table 3 (and Table 4), Fashion-MNIST, Dir(α) of FedDF, 10 clients.'
    if paper
    else 'Top-1 test accuracy (%), mean ± std over seeds, in the layout of FedMHO '
    '(Yao et al., WWW 2026) Table 3 '
    '(the paper reports no numbers for this dataset).',
    '',
    f'Backend {meta["backend"]}, jax {meta["jax_version"]}, {meta["date"]}, seeds '
    f'{meta["seeds"]}. Budget ({meta["budget"] or "the config default"}):',
  ]
  lines += budget_lines(config)
  if meta.get('evidence'):
    lines += ['', 'Precondition evidence for this budget (measured before the sweep):']
    lines += meta['evidence']
  lines += client_lines(results, runs, alphas)
  lines += precondition_lines(results, runs, alphas, meta)
  for title, key in (
    ('final model', 'final_test_accuracy'),
    ('best epoch', 'best_test_accuracy'),
  ):
    lines += ['', f'## Table 3: {title}', '', head, rule]
    lines += [row(r, key) for r in TABLE3 if r in runs]
    if key == 'final_test_accuracy':
      for label, run, k in (
        ('*FedMHO initial global model (Eq. 4)*', 'fedmho', 'initial_test_accuracy'),
        ('*Teacher ensemble of the baseline clients*', 'dense', 'teacher_ensemble_test_accuracy'),
      ):
        if run in runs:
          cells = [ours_cell(results, run, a, k) + (' | —' if paper else '') for a in alphas]
          lines.append(f'| {label} | ' + ' | '.join(cells) + ' |')
  pairs = [p for p in TABLE4 if p[0] in runs and p[1] in runs]
  if pairs:
    lines += [
      '',
      '## Table 4: without the unsupervised data optimisation (R_th = 1, same sample count)',
      '',
      head,
      rule,
    ]
    for with_filter, without in pairs:
      lines += [row(with_filter, 'final_test_accuracy'), row(without, 'final_test_accuracy')]
  for a in alphas:
    column = {r: PAPER[r][a][0] for r in TABLE3 if r in runs and a in PAPER.get(r, {})}
    if not column:
      continue
    lines += [
      '',
      f'## Orderings the paper gives, α={a}, our final model',
      '',
      'Every pair of Table 3 rows that the paper ranks apart'
      + ('' if paper else " (its Fashion-MNIST Table 3's order at this α, tested here)")
      + ', and each Table 4 pair (the filter helps); a two-sided t-test over our seeds, '
      'paired by seed (one partition per seed), at 5 %: holds / fails when our seeds tell them '
      'apart, within noise when they do not.',
      '',
    ]
    orderings = paper_orderings(results, str(a), column)
    for pair in pairs:
      if all(a in PAPER[r] for r in pair):
        orderings += paper_orderings(results, str(a), {r: PAPER[r][a][0] for r in pair})
    names = {r: RUNS[r].name for r in RUNS}
    lines += ordering_lines(orderings, names, paper_column=paper)
  lines += [
    '',
    'FedAvg and FedDF report the vote of the model prototypes (the argmax of the mean logits of '
    'the per-architecture models); DENSE and Co-Boosting distil one VGG-9. Per run: '
    'OUT/dir<α>/seed<s>/<run>/ (metrics.jsonl, summary.json, plots). Table 3 as bars: '
    'table3.png; Fig. 9: synthetic_samples.png.',
  ]
  return '\n'.join(lines) + '\n'


def plot_table(
  path: pathlib.Path, results: dict, runs: List[str], alphas: List[float], paper: bool
):
  """Table 3 as grouped bars: per α, every method's mean final accuracy over seeds with its std
  as an error bar, and the paper's as a hollow bar beside it (Fashion-MNIST only)."""
  from matplotlib.backends.backend_agg import FigureCanvasAgg  # pylint: disable=g-import-not-at-top
  from matplotlib.figure import Figure  # pylint: disable=g-import-not-at-top

  rows = [r for r in TABLE3 if r in runs]
  fig = Figure(figsize=(4 + 1.6 * len(rows), 4), dpi=120)
  FigureCanvasAgg(fig)
  ax = fig.add_subplot(1, 1, 1)
  width = 0.8 / max(1, len(alphas))
  for j, a in enumerate(alphas):
    x = np.arange(len(rows)) + (j - (len(alphas) - 1) / 2) * width
    mean, std = percent_stats_each([gather(results, r, a, 'final_test_accuracy') for r in rows])
    bars = ax.bar(x, mean, width * (0.5 if paper else 0.9), yerr=std, capsize=2, label=f'α={a}')
    if paper:
      ref = [PAPER.get(r, {}).get(a, (np.nan,))[0] for r in rows]
      ax.bar(x + width / 2, ref, width * 0.4, fill=False, edgecolor=bars.patches[0].get_facecolor())
  ax.set_xticks(np.arange(len(rows)))
  ax.set_xticklabels([RUNS[r].name for r in rows], rotation=20, ha='right', fontsize=8)
  ax.set_ylabel('test accuracy (%)')
  ax.set_title('final accuracy, mean ± std over seeds' + (' (hollow: paper)' if paper else ''))
  ax.legend(fontsize=8)
  fig.tight_layout()
  save_png(fig, path)


# The client sets whose local models `pretrain_seeds` trains for all seeds at once: the
# baselines' (every client a classifier, shared in OUT/dir<α>/seed<s>/baselines/). FedMHO's own
# set shares its classifiers inside the workdir of run 'fedmho' (written there first, they would
# make that run refuse its workdir as one of an unknown run), and the FedCVAE sets have no
# classifier clients.
BATCHED_CLIENTS = ('baselines',)


def batched_plan(
  module,
  budget: str,
  out: pathlib.Path,
  runs: List[str],
  alpha: float,
  seeds: List[int],
  clients_root: Optional[pathlib.Path] = None,
):
  """Per seed of the α, the `seed_batch.PlannedRun`s of the runs of the client sets of
  `BATCHED_CLIENTS` (what `seed_tables.pretrain_seeds` trains in one program)."""
  from jfed.methods import seed_batch  # pylint: disable=g-import-not-at-top

  return [
    [
      seed_batch.PlannedRun(
        RUNS[name].method,
        run_config(
          module, budget, RUNS[name], alpha, seed, cell_dir(clients_root or out, alpha, seed)
        ),
        cell_dir(out, alpha, seed) / name,
      )
      for name in runs
      if RUNS[name].clients in BATCHED_CLIENTS
    ]
    for seed in seeds
  ]


def run_sweep(
  config_path: str,
  budget: str,
  out: pathlib.Path,
  runs: List[str],
  alphas: List[float],
  seeds: List[int],
  reference_epochs: int = 0,
  reference_model: str = 'cnn_mnist',
  batch_seeds: bool = True,
  merge: Sequence[str] = (),
  clients_root: Optional[pathlib.Path] = None,
) -> str:
  """Runs every (α, seed, run) not finished yet (or, with `merge`, only merges those
  directories' results); writes results.json and tables.md after each; returns the tables'
  text. With `reference_epochs`, a classifier trained on the real training images (once, on the
  first generating run) labels each generating run's samples. With `batch_seeds`, before an
  α's first run, the local models of its seeds' baseline client set (`BATCHED_CLIENTS`) that
  have none yet train in one program (`pretrain_seeds`)."""
  from jfed.driver import run_experiment  # pylint: disable=g-import-not-at-top

  sweep.check_known('runs', runs, RUNS)
  # In RUNS order: run 'fedmho' must claim its workdir before the runs of its client set put
  # their shared clients there (OUT/dir<α>/seed<s>/fedmho/local_models).
  runs = [r for r in RUNS if r in runs]
  module = load_config_module(config_path, 'fedmho_tables_config')
  base = module.get_config(budget)
  out.mkdir(parents=True, exist_ok=True)
  s = generator_check.open_sweep(out, seeds, merge, budget=budget)
  s.meta['evidence'] = evidence_lines(module, budget)
  paper = base.dataset.name == 'fashion_mnist'
  s.render = lambda s: {'tables.md': render(base, s.results, runs, alphas, s.meta)}
  s.after_save = lambda s: plot_table(out / 'table3.png', s.results, runs, alphas, paper)
  labeller = generator_check.Labeller(base, reference_model, reference_epochs)

  def label_samples(workdir: pathlib.Path, record: dict) -> None:
    score = labeller.score(workdir)
    if score is None:
      return
    s.meta['reference'] = labeller.reference
    record['kept_labelled_right'] = score.kept_accuracy
    record['removed_labelled_right'] = (
      None if score.removed_accuracy != score.removed_accuracy else (score.removed_accuracy)
    )

  def execute(name: str, alpha: float, seed: int, workdir: pathlib.Path) -> sweep.Record:
    clients = cell_dir(clients_root or out, alpha, seed)
    c = run_config(module, budget, RUNS[name], alpha, seed, clients)
    summary = run_experiment(RUNS[name].method, c, workdir)
    record = sweep.summary_record(summary, SUMMARY_KEYS)
    record.update(client_record(summary))
    if name in GENERATING:
      label_samples(workdir, record)
    return record

  for alpha in [] if merge else alphas:
    if batch_seeds:
      pretrain_seeds(
        lambda: batched_plan(module, budget, out, runs, alpha, seeds, clients_root), f'α={alpha}'
      )
    for seed in seeds:
      for name in runs:
        workdir = cell_dir(out, alpha, seed) / name
        s.run_one(
          str(alpha),
          seed,
          name,
          lambda: execute(name, alpha, seed, workdir),  # pylint: disable=cell-var-from-loop
          f'α={alpha} seed={seed} {name} -> {workdir}',
        )
        figure = workdir / 'synthetic_samples.png'
        if name == 'fedmho_md' and figure.exists() and not (out / figure.name).exists():
          shutil.copy(figure, out / figure.name)
  s.save()
  return s.text('tables.md')


def main(argv):
  del argv
  runs = FLAGS.runs or list(RUNS)
  alphas = [float(a) for a in FLAGS.alphas]
  seeds = [int(s) for s in FLAGS.seeds]
  path, words = sweep.config_flag()
  print(
    run_sweep(
      path,
      ','.join(w for w in (words, FLAGS.budget) if w),
      pathlib.Path(FLAGS.out),
      runs,
      alphas,
      seeds,
      FLAGS.reference_epochs,
      FLAGS.reference_model,
      FLAGS.batch_seeds,
      FLAGS.merge,
      pathlib.Path(FLAGS.clients_root) if FLAGS.clients_root else None,
    )
  )


if __name__ == '__main__':
  sweep.run_command(main, define_flags)

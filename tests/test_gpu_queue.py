"""The GPU queue (experiments/dev/gpu_queue.py): chunks that name real commands, what comes back
of a chunk (results, never checkpoints), the ledger, the time limit and hostile archives."""

import importlib.util
import io
import json
import pathlib
import subprocess
import tarfile

from absl import app
import pytest

from experiments.dev import gpu_queue as q

ROOT = pathlib.Path(__file__).resolve().parents[1]
FAKE = q.Chunk('fake_s0', 'fake', 'experiments.fedhydra_tables', ('--seeds=0',))
META = {'backend': 'gpu', 'device_kind': 'Test GPU', 'jax_version': '0.0'}


def test_chunks_are_unique_and_name_real_commands_and_configs():
  chunks = q.chunks()
  assert len({c.name for c in chunks}) == len(chunks)
  for c in chunks:
    assert importlib.util.find_spec(c.module) is not None, c.module
    for arg in c.args + c.merge_args:
      if arg.startswith('--config='):
        assert (ROOT / arg.split('=', 1)[1].split(':')[0]).is_file(), arg
  # the parity chunks first (seed 0's before the others), then issue 36's order: the headline
  # FedHydra Dir(0.5) cell of seed 0
  parity = [c for c in chunks if c.module == 'experiments.parity']
  assert parity and chunks[: len(parity)] == parity and parity[0].name.endswith('_s0')
  first = chunks[len(parity)]
  assert first.group == 'fedhydra_t1t2_fmnist_dir0.5_paper' and first.name.endswith('s0_dense')
  # a parity chunk names a method the harness knows and a budget of its reference's keys
  from experiments.parity import references
  from experiments.parity.references import parse_budget

  for c in parity:
    args = dict(a.removeprefix('--').split('=', 1) for a in c.args)
    ref, _ = references.find_method(args['method'])
    parse_budget(ref.default_budget, args['budget'].split(','))
    assert args['reference_dir'] == f'{q.PARITY_REF_ROOT}/{ref.name}' and c.alone


def test_fedhydra_runs_with_a_bounded_pool_in_groups_of_its_own_beside_the_papers_chunks():
  """Each FedHydra cell and seed has, after its paper chunks (which keep the paper's unbounded
  pool, unchanged), one chunk of FedHydra with `fedhydra.pool_limit` in a group of its own."""
  from jfed.configs import fedhydra_fashion_mnist

  chunks = q.chunks()
  names = [c.name for c in chunks]
  bounded = [c for c in chunks if c.group.endswith(f'_paper_pool{q.FEDHYDRA_POOL_LIMIT}')]
  assert len(bounded) == 2 * len(q.SEEDS)
  key = 'fedhydra.pool_limit'
  assert fedhydra_fashion_mnist.get_config('paper').fedhydra.pool_limit == 0  # the paper's
  for c in bounded:
    paper_group = c.group.removesuffix(f'_pool{q.FEDHYDRA_POOL_LIMIT}')
    seed = c.name.rsplit('_s', 1)[1].split('_')[0]
    paper = [n for n in names if n.startswith(f'{paper_group}_s{seed}_')]
    assert len(paper) == len(q.FEDHYDRA_METHODS)
    assert max(map(names.index, paper)) < names.index(c.name)
    assert f'--config.{key}={q.FEDHYDRA_POOL_LIMIT}' in c.args
    assert f'--config.{key}={q.FEDHYDRA_POOL_LIMIT}' in c.merge_args
    assert '--methods=fedhydra' in c.args and f'--seeds={seed}' in c.args
  # the paper's chunks keep the paper's config: no other chunk overrides a key
  others = [c for c in chunks if c not in bounded]
  assert not any(a.startswith('--config.') for c in others for a in c.args)


def _fake_run(folder: pathlib.Path) -> None:
  run = folder / 'run' / 'seed0' / 'dir0.5' / 'dense'
  (run / 'checkpoints' / '3').mkdir(parents=True)
  (run / 'checkpoints' / '3' / 'state.json').write_text('{}')
  (run / 'metrics.jsonl').write_text(
    '{"step": 0, "seconds": 1.0}\n{"step": 1, "test_accuracy": 0.5}\nnot json\n'
  )
  (run / 'weights.npy').write_bytes(b'\0' * 16)
  (folder / 'run' / 'results.json').write_text('{"results": {}}')


def test_pack_keeps_results_and_progress_but_no_checkpoints(tmp_path):
  folder = tmp_path / 'scratch' / FAKE.name
  _fake_run(folder)
  (folder / 'chunk.log').write_text(''.join(f'line {i}\n' for i in range(500)))
  assert q.run_progress(folder / 'run') == 'seed0/dir0.5/dense: step 1 (0.5000)'
  archive = q.pack(FAKE, folder, {'status': 'done'}, tmp_path)
  with tarfile.open(archive) as tar:
    names = set(tar.getnames())
    log = tar.extractfile('chunk.log').read().decode().splitlines()
  assert log[0] == 'line 300' and log[-1] == 'line 499'  # the end of the log only
  assert 'entry.json' in names and 'run/results.json' in names
  assert 'run/seed0/dir0.5/dense/metrics.jsonl' in names
  assert not any('checkpoints' in n or n.endswith('.npy') for n in names)


def test_ingest_records_the_ledger_and_the_next_chunk(tmp_path, monkeypatch):
  other = q.Chunk('fake_s1', 'fake', FAKE.module, ('--seeds=1',))
  monkeypatch.setattr(q, 'chunks', lambda: [FAKE, other])
  folder, back, results = tmp_path / 'scratch' / FAKE.name, tmp_path / 'back', tmp_path / 'res'
  _fake_run(folder)
  (folder / 'run' / 'tables.md').write_text('| table |\n')
  back.mkdir()
  q.pack(FAKE, folder, {'status': 'done', 'seconds': 12, 'device': 'Test GPU'}, back)
  assert q.ingest(back, results, tmp_path / 'raw') == [FAKE.name]
  ledger = q.read_ledger(results)
  assert ledger[FAKE.name]['seconds'] == 12
  kept = sorted(p.relative_to(results).as_posix() for p in results.rglob('*') if p.is_file())
  assert kept == [
    f'{FAKE.name}/entry.json',
    f'{FAKE.name}/run/results.json',
    f'{FAKE.name}/run/tables.md',
    'ledger.json',
  ]
  raw = tmp_path / 'raw' / FAKE.name
  assert (raw / 'run' / 'seed0' / 'dir0.5' / 'dense' / 'metrics.jsonl').exists()
  assert [c.name for c in q.pending(q.chunks(), ledger)] == ['fake_s1']
  text = q.listing(q.chunks(), ledger)
  assert '| fake_s0 | done | 12 | Test GPU' in text and '| fake_s1 | not run (next)' in text
  assert q.ingest(back, results, tmp_path / 'raw') == []  # a done chunk is not overwritten


def test_ingest_refuses_a_member_outside_the_chunk(tmp_path, monkeypatch, capsys):
  monkeypatch.setattr(q, 'chunks', lambda: [FAKE])
  back = tmp_path / 'back'
  back.mkdir()
  with tarfile.open(back / f'{FAKE.name}.tar.gz', 'w:gz') as tar:
    data = b'{}'
    info = tarfile.TarInfo('../../escaped.json')
    info.size = len(data)
    tar.addfile(info, io.BytesIO(data))
  with pytest.raises(app.UsageError, match='not a file inside the chunk'):
    q.ingest(back, tmp_path / 'res', tmp_path / 'raw')
  assert not (tmp_path / 'escaped.json').exists()
  # another archive beside the chunks (the device script's mutation.tar.gz) is left alone
  (back / 'mutation.tar.gz').write_bytes(b'')
  (back / f'{FAKE.name}.tar.gz').unlink()
  assert q.ingest(back, tmp_path / 'res', tmp_path / 'raw') == []
  assert "'mutation' is not a chunk of this queue, left alone" in capsys.readouterr().out
  assert not (tmp_path / 'res' / 'mutation').exists()


def test_a_chunk_stopped_before_its_first_step_shows_its_phase_progress(tmp_path, monkeypatch):
  """A FedMHO chunk stopped in its local training has no metrics yet: `--list` shows the last
  progress line of its log, so the chunk's cost can be sized from it."""
  monkeypatch.setattr(q, 'chunks', lambda: [FAKE])
  folder, back, results = tmp_path / 'scratch' / FAKE.name, tmp_path / 'back', tmp_path / 'res'
  folder.mkdir(parents=True)
  (folder / 'chunk.log').write_text(
    'dense on fashion_mnist (gpu): 10 clients\n'
    'local training [vgg9 x5] 1/200 epochs    0.05 epoch/s     19s eta  3742s \n'
    'local training [vgg9 x5] 54/200 epochs    0.45 epoch/s    119s eta   323s \n'
    'I1127 01:29:01 some library line\n'
  )
  assert q.run_progress(folder / 'run') == ''
  progress = 'local training [vgg9 x5] 54/200 epochs after 119 s (eta 323 s)'
  assert q.log_progress(folder / 'chunk.log') == progress
  back.mkdir()
  q.pack(FAKE, folder, {'status': 'partial', 'seconds': '>135', 'progress': ''}, back)
  q.ingest(back, results, tmp_path / 'raw')
  assert q.read_ledger(results)[FAKE.name]['progress'] == progress
  assert progress in q.listing(q.chunks(), q.read_ledger(results))


def test_skip_needs_a_reason_and_takes_the_chunk_out_of_the_queue(tmp_path, monkeypatch):
  monkeypatch.setattr(q, 'chunks', lambda: [FAKE])
  with pytest.raises(app.UsageError, match='--reason'):
    q.skip([FAKE.name], '', tmp_path)
  with pytest.raises(app.UsageError, match='not chunks'):
    q.skip(['nope'], 'r', tmp_path)
  q.skip([FAKE.name], 'measured: too long', tmp_path)
  ledger = q.read_ledger(tmp_path)
  assert ledger[FAKE.name]['status'] == 'skipped' and q.pending([FAKE], ledger) == []
  (tmp_path / q.LEDGER).write_text('{broken')
  with pytest.raises(app.UsageError, match='not JSON'):
    q.read_ledger(tmp_path)


@pytest.mark.parametrize(
  'command, limit_s, status',
  [(['true'], 30, 'done'), (['sleep', '60'], 1, 'partial'), (['false'], 30, 'failed')],
)
def test_run_next_packs_each_chunk_with_its_status(tmp_path, monkeypatch, command, limit_s, status):
  monkeypatch.setattr(q, 'chunks', lambda: [FAKE])
  monkeypatch.setattr(q, 'RESULTS', tmp_path / 'res')
  monkeypatch.setattr(q, 'machine', lambda: META)
  monkeypatch.setattr(q, 'POLL_S', 0.05)

  def start(chunk, folder, memory_fraction):
    del chunk, memory_fraction
    folder.mkdir(parents=True)
    return subprocess.Popen(command, start_new_session=True)

  monkeypatch.setattr(q, 'start', start)
  assert q.run_next(tmp_path / 'out', 2, limit_s, tmp_path / 'scratch') == [FAKE.name]
  with tarfile.open(tmp_path / 'out' / f'{FAKE.name}.tar.gz') as tar:
    entry = json.load(tar.extractfile('entry.json'))
  assert entry['status'] == status and entry['device'] == 'Test GPU'
  assert (entry['seconds'] == f'>{limit_s}') == (status == 'partial')


def test_a_chunk_that_must_run_alone_gets_the_machine_to_itself():
  a, b = (q.Chunk(f'{n}_s0', n, 'experiments.fedhydra_tables', ()) for n in 'ab')
  solo = q.Chunk('solo_s0', 'solo', 'experiments.fedmho_tables', (), alone=True)
  assert q.next_batch([a, b, solo], 3) == [a, b]
  assert q.next_batch([a, solo, b], 3) == [a]
  assert q.next_batch([solo, a, b], 3) == [solo]
  assert q.next_batch([a, b], 1) == [a] and q.next_batch([], 3) == []
  fedmho = [c for c in q.chunks() if c.module == 'experiments.fedmho_tables']
  assert fedmho and all(c.alone for c in fedmho)


def test_run_next_runs_batch_after_batch_while_time_is_left(tmp_path, monkeypatch):
  """An alone chunk, then the next batch in the time it left; at most max_chunks in all."""
  alone = q.Chunk('alone_s0', 'g', 'experiments.fedmho_tables', (), alone=True)
  pair = [q.Chunk(f'c{i}_s0', 'g', 'experiments.fedhydra_tables', ()) for i in range(3)]
  monkeypatch.setattr(q, 'chunks', lambda: [alone, *pair])
  monkeypatch.setattr(q, 'RESULTS', tmp_path / 'res')
  monkeypatch.setattr(q, 'machine', lambda: META)
  monkeypatch.setattr(q, 'POLL_S', 0.05)
  started = []

  def start(chunk, folder, memory_fraction):
    started.append((chunk.name, round(memory_fraction, 2)))
    folder.mkdir(parents=True)
    return subprocess.Popen(['true'])

  monkeypatch.setattr(q, 'start', start)
  ran = q.run_next(tmp_path / 'out', 2, 600, tmp_path / 'scratch', max_chunks=3)
  assert ran == ['alone_s0', 'c0_s0', 'c1_s0']
  assert started == [('alone_s0', 0.9), ('c0_s0', 0.45), ('c1_s0', 0.45)]
  assert sorted(p.name for p in (tmp_path / 'out').iterdir()) == [
    f'{n}.tar.gz' for n in sorted(ran)
  ]
  # with less than MIN_START_S left after a batch, no next one starts
  monkeypatch.setattr(q, 'MIN_START_S', 1e6)
  assert q.run_next(tmp_path / 'out2', 2, 600, tmp_path / 'scratch2') == ['alone_s0']


def test_fedmho_chunks_of_a_group_share_their_client_sets(tmp_path, monkeypatch):
  chunk = next(c for c in q.chunks() if c.module == 'experiments.fedmho_tables')
  assert chunk.shared_clients and chunk.alone
  argv = []
  monkeypatch.setattr(q.subprocess, 'Popen', lambda args, **kw: argv.extend(args))
  q.start(chunk, tmp_path / chunk.name, 0.9)
  assert f'--clients_root={tmp_path / "clients" / chunk.group}' in argv
  assert f'--out={tmp_path / chunk.name / "run"}' in argv

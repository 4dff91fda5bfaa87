"""A multi-process run whose peer dies ends in one `error:` line naming the process that stopped
and the checkpoint to resume from, with exit status 1 and none of JAX's C++ abort output
(issue 85): the filter on runtime lines recorded from real failures, then two processes on
digits with one of them killed are `experiments.dev.probes`' dead_peer and dead_coordinator
(tests/test_probes.py, the slow set)."""

import io
import pathlib

from jfed import supervise

ROOT = pathlib.Path(__file__).resolve().parents[1]

# What process 0's stderr held when process 1 was killed (jax 0.10.2, abridged only in length).
PEER_DIED = [
  'E1207 20:25:55.764771    3091 coordination_service.cc:1520] [163] Shutdown barrier in '
  'coordination service has failed:\n',
  'INTERNAL: Barrier failed because: task is set to ERROR: UNAVAILABLE: Task 1 heartbeat timeout. '
  'This indicates that the remote task has failed\n',
  'This suggests that the workers are out of sync.\n',
  'F1207 20:25:55.764479    3076 client.h:80] Terminating process because the JAX distributed '
  'service detected fatal errors.\n',
  '*** Check failure stack trace: ***\n',
  '    @     0x7fb41e840634  absl::log_internal::LogMessage::SendToLog()\n',
  'Fatal Python error: Aborted\n',
]
# ... and process 1's when process 0, the coordinator, was killed.
COORDINATOR_DIED = [
  'W1207 20:28:46.265393    6640 preemption_sync_manager.cc:147] Failed to retrieve preemption '
  'notice from coordination service: UNAVAILABLE: Socket closed\n',
  'Additional GRPC error information from remote target coordination_service while calling '
  '/xla.coordination.CoordinationService/GetKeyValue:\n',
  ':UNKNOWN:Error received from peer  {grpc_status:14, grpc_message:"Socket closed"}.\n',
  'E1207 20:28:46.265577    6640 coordination_service_agent.cc:289] Polled an error from '
  'coordination service (this can be an error from this or another task).\n',
  'F1207 20:28:46.265584    6640 client.h:80] Terminating process because the JAX distributed '
  'service detected fatal errors.\n',
  '*** Check failure stack trace: ***\n',
]


def _filtered(lines, hold_s=60.0):
  out = io.StringIO()
  f = supervise._StderrFilter(out, hold_s=hold_s)
  for line in lines:
    f.feed(line)
    f.tick()
  f.finish()
  return f, out.getvalue()


def test_a_fatal_runtime_failure_is_held_back_with_the_lines_before_it():
  progress = 'round 3/300 [cnn_mnist x5] 2/2 epochs\n'
  f, shown = _filtered([progress, *COORDINATOR_DIED])
  assert f.fatal and shown == progress
  assert 'process 0 of the multi-process run (its coordinator at h:1) stopped' in (
    supervise.describe_stop(f.held, 1, 2, 'h:1')
  )
  f, shown = _filtered([progress, *PEER_DIED])
  assert f.fatal and shown == progress
  assert supervise.describe_stop(f.held, 0, 2, 'h:1').startswith(
    'process 1 of the multi-process run stopped (this is process 0 of 2)'
  )


def test_runtime_lines_without_a_fatal_one_are_shown_in_order():
  lines = [
    'round 1/3\n',
    'W1207 20:28:46.265393    6640 some_file.cc:147] a warning\n',
    'Additional information\n',
    'round 2/3\n',
  ]
  f, shown = _filtered(lines)
  assert not f.fatal and shown == ''.join(lines)
  f, shown = _filtered(lines, hold_s=0.0)  # released after its time, before the run ends
  assert shown == ''.join(lines)


def test_a_collective_that_lost_its_peer_is_recognised():
  gloo = (
    'UNKNOWN: Gloo AllGather failed: [external/gloo/gloo/transport/tcp/pair.cc:547] '
    'Connection closed by peer [127.0.0.1]:19354'
  )
  assert supervise.peer_failure(RuntimeError(gloo))
  assert not supervise.peer_failure(ValueError('training loss became non-finite'))
  assert supervise.describe_stop([gloo], 0, 3, None).startswith(
    'another process of the multi-process run stopped'
  )
  # process 0 hosts the coordinator: named so however its death was reported (a probe under
  # load saw the collective's error before the coordinator's)
  assert supervise.describe_stop([gloo], 1, 2, 'h:1').startswith(
    'process 0 of the multi-process run (its coordinator at h:1) stopped (this is process 1 of 2)'
  )
  heartbeat = 'E1207 coordination_service.cc:1] Task 0 heartbeat timeout'
  assert supervise.describe_stop([heartbeat], 1, 2, None).startswith(
    'process 0 of the multi-process run (its coordinator) stopped'
  )
  assert supervise.describe_stop([heartbeat.replace('Task 0', 'Task 2')], 1, 3, None).startswith(
    'process 2 of the multi-process run stopped (this is process 1 of 3)'
  )


def test_the_resume_hint_names_the_newest_committed_checkpoint(tmp_path):
  assert 'no checkpoint yet' in supervise.resume_hint(str(tmp_path), 2)
  for name in ('3', '12', '13.orbax-checkpoint-tmp-5'):
    (tmp_path / 'checkpoints' / name).mkdir(parents=True)
  hint = supervise.resume_hint(str(tmp_path), 2)
  assert f'resume from checkpoint 12 in {tmp_path / "checkpoints"}' in hint
  assert 'all 2 processes' in hint

"""SyncMaster/SlavePipe: the seed's master/slave protocol with threads, bounded waits, failures, pickle."""

import functools
import pickle
import threading
import time

import pytest

from distsync import SyncError
from distsync.parallel import SlavePipe, SyncMaster
from distsync.testing import run_threads

_run = functools.partial(run_threads, timeout=10.0)  # protocol rounds are quick


def _sum_to_all(intermediates):
    total = sum(msg for _, msg in intermediates)
    return [(identifier, (total, identifier)) for identifier, _ in intermediates]


def test_master_callback_sees_master_first_and_replies_reach_each_slave():
    seen = []

    def callback(intermediates):
        seen.append(list(intermediates))
        return _sum_to_all(intermediates)

    master = SyncMaster(callback)
    pipes = [master.register_slave(i) for i in (1, 2, 3)]
    assert master.nr_slaves == 3
    assert [pipe.identifier for pipe in pipes] == [1, 2, 3]
    assert all(isinstance(pipe, SlavePipe) for pipe in pipes)

    for round_ in range(3):  # the same pipes serve several rounds
        fns = [lambda r=round_: master.run_master(100 + r)]
        fns += [lambda p=pipe, r=round_: p.run_slave(10 * p.identifier + r) for pipe in pipes]
        results, errors = _run(fns)
        assert not errors
        total = 100 + 10 + 20 + 30 + 4 * round_
        assert results == {0: (total, 0), 1: (total, 1), 2: (total, 2), 3: (total, 3)}
        assert seen[-1][0] == (0, 100 + round_)
        assert sorted(seen[-1][1:]) == [(1, 10 + round_), (2, 20 + round_), (3, 30 + round_)]


def test_replies_are_routed_by_identifier_not_arrival_order():
    master = SyncMaster(lambda msgs: [(0, "m")] + [(i, f"to {i}") for i, _ in reversed(msgs[1:])])
    pipes = [master.register_slave(i) for i in ("a", "b")]
    results, errors = _run([lambda: master.run_master(None)] + [lambda p=p: p.run_slave(None) for p in pipes])
    assert not errors and results == {0: "m", 1: "to a", 2: "to b"}


def test_registering_after_a_round_starts_a_new_replication():
    master = SyncMaster(_sum_to_all)
    pipe = master.register_slave(1)
    _run([lambda: master.run_master(1), lambda: pipe.run_slave(2)])
    pipe = master.register_slave(1)  # the next replication registers again
    assert master.nr_slaves == 1
    results, errors = _run([lambda: master.run_master(5), lambda: pipe.run_slave(6)])
    assert not errors and results == {0: (11, 0), 1: (11, 1)}


def test_master_without_slaves_runs_the_callback_alone():
    assert SyncMaster(_sum_to_all).run_master(7) == (7, 0)


def test_identifier_zero_is_reserved_for_the_master():
    with pytest.raises(ValueError, match="master"):
        SyncMaster(_sum_to_all).register_slave(0)


def test_a_failing_master_callback_raises_on_every_copy():
    def callback(intermediates):
        raise RuntimeError("boom")

    master = SyncMaster(callback, timeout=5.0)
    pipes = [master.register_slave(i) for i in (1, 2)]
    _, errors = _run([lambda: master.run_master(0)] + [lambda p=p: p.run_slave(0) for p in pipes])
    assert isinstance(errors[0], RuntimeError)
    assert all(isinstance(errors[i], SyncError) and "boom" in str(errors[i]) for i in (1, 2))


def test_a_missing_slave_fails_every_copy_within_the_timeout():
    master = SyncMaster(_sum_to_all, timeout=0.3)
    pipes = [master.register_slave(i) for i in (1, 2)]  # slave 2 never arrives
    start = time.monotonic()
    _, errors = _run([lambda: master.run_master(0), lambda: pipes[0].run_slave(0)])
    assert time.monotonic() - start < 3.0
    assert isinstance(errors[0], SyncError) and "[2]" in str(errors[0])
    assert isinstance(errors[1], SyncError)
    with pytest.raises(SyncError):  # the late slave fails at once instead of waiting
        pipes[1].run_slave(0)


def test_a_missing_master_fails_the_slaves_within_the_timeout():
    master = SyncMaster(_sum_to_all, timeout=0.3)
    pipes = [master.register_slave(i) for i in (1, 2)]
    start = time.monotonic()
    _, errors = _run([lambda p=p: p.run_slave(0) for p in pipes])
    assert time.monotonic() - start < 3.0
    assert all(isinstance(errors[i], SyncError) for i in (0, 1))
    with pytest.raises(SyncError):  # a master arriving late learns the round failed
        master.run_master(0)


def test_slow_master_callback_is_not_cut_short_by_the_slave_timeout():
    def slow(intermediates):  # e.g. a cross-process all-reduce after the local rendezvous
        time.sleep(0.5)
        return _sum_to_all(intermediates)

    master = SyncMaster(slow, timeout=0.2)
    pipe = master.register_slave(1)
    results, errors = _run([lambda: master.run_master(1), lambda: pipe.run_slave(2)])
    assert not errors and results == {0: (3, 0), 1: (3, 1)}


def test_abort_releases_waiting_copies():
    master = SyncMaster(_sum_to_all)  # no timeout: only the abort can release them
    pipes = [master.register_slave(i) for i in (1, 2)]
    aborter = threading.Timer(0.2, master.abort, args=(RuntimeError("replica 2 failed"),))
    aborter.start()
    _, errors = _run([lambda: master.run_master(0), lambda: pipes[0].run_slave(0)])
    assert all(isinstance(errors[i], SyncError) and "replica 2 failed" in str(errors[i]) for i in (0, 1))


def test_sync_master_pickles_without_its_queue_and_works_after():
    master = SyncMaster(_sum_to_all, timeout=4.0)
    master.register_slave(1)
    clone = pickle.loads(pickle.dumps(master))
    assert clone.nr_slaves == 0 and clone._timeout == 4.0
    pipe = clone.register_slave(1)
    results, errors = _run([lambda: clone.run_master(1), lambda: pipe.run_slave(1)])
    assert not errors and results == {0: (2, 0), 1: (2, 1)}

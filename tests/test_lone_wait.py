"""The negotiation thread's wait for a lone call's agreement (designs/negotiated.py): the
compiled wait's spin (comm.progress.wait_polling's spin_us) ends with the request, in one
process (MPI.COMM_SELF, a message a thread sends later); the spin's rules (where it applies,
how it adapts to waits that outlast it, off while the machine has no core to spare). The
sums of lone calls whose bet the thread completes last: test_repeat, on every design.
"""
import threading
import time
import types

import numpy as np
import pytest

from mpi_kvstore.designs.spin import (
    AGREEMENT_SPIN_US,
    SPIN_FLOOR_US,
    SPIN_LOAD_S,
    Spin,
    spin_of,
)


def _late_message(delay_s, values, spin_us):
    """Wait with ``spin_us`` for a message this process sends itself ``delay_s`` later."""
    from mpi4py import MPI

    from mpi_kvstore.comm.progress import wait_polling
    comm = MPI.COMM_SELF.Dup()
    try:
        got = np.zeros_like(values)
        request = comm.Irecv(got, source=0, tag=7)
        sender = threading.Timer(delay_s, lambda: comm.Send(values, dest=0, tag=7))
        began = time.monotonic()
        sender.start()
        wait_polling(request, 50, spin_us=spin_us)
        took = time.monotonic() - began
        sender.join()
        assert request.Test()     # mpi4py sees it complete, as after its own wait
        return got, took
    finally:
        comm.Free()


@pytest.mark.parametrize('spin_us', [0, 1, 200, 20_000])
def test_the_spun_wait_ends_with_its_request_and_delivers_its_data(spin_us):
    values = np.arange(1024, dtype=np.float32) * 3 + 1
    got, took = _late_message(0.05, values, spin_us)
    np.testing.assert_array_equal(got, values)
    assert took >= 0.05      # it did not return before the message was sent
    got, _ = _late_message(0.0, values[:7] - 2, spin_us)   # there almost at once
    np.testing.assert_array_equal(got, values[:7] - 2)


def test_the_spin_applies_where_the_store_busy_polls_its_data_and_ranks_are_several():
    config = types.SimpleNamespace
    assert spin_of(config(progress_sleep_us=0.0), 2, cores=16) == AGREEMENT_SPIN_US
    assert spin_of(config(progress_sleep_us=0), 4, cores=8) == AGREEMENT_SPIN_US
    assert spin_of(config(progress_sleep_us=200.0), 2) == 0      # across hosts, oversubscribed
    assert spin_of(config(progress_sleep_us=0.0), 1) == 0        # nobody to wait for
    assert spin_of(config(progress_sleep_us='auto'), 2) == 0     # not decided: no spin


def test_a_wait_that_outlasts_the_spin_halves_it_to_nothing_and_short_waits_bring_it_back():
    spin = Spin(200.0, spare=lambda: True)
    assert spin.us(0.0) == 200.0
    spin.waited(150e-6)                 # ended within the spin: it stays
    assert spin.us(0.0) == 200.0
    seen = []
    for _ in range(5):                  # the peer comes late, again and again
        spin.waited(5e-3)
        seen.append(spin.us(0.0))
    assert seen == [100.0, 50.0, 25.0, 0.0, 0.0]
    spin.waited(1e-3)                   # still long: no spin
    assert spin.us(0.0) == 0.0
    assert spin.us(SPIN_LOAD_S) == SPIN_FLOOR_US     # a while later it tries again
    spin.waited(1e-3)
    assert spin.us(SPIN_LOAD_S) == 0.0
    seen = []
    for _ in range(5):                  # short waits again
        spin.waited(SPIN_FLOOR_US * 1e-6 / 2)
        seen.append(spin.us(0.0))
    assert seen == [25.0, 50.0, 100.0, 200.0, 200.0]
    spin.set_top(0.0)                   # autotune chose polled data: no spin at all
    spin.waited(1e-6)
    assert spin.us(0.0) == 0.0


def test_the_spin_applies_only_where_each_rank_of_the_host_has_a_second_core():
    config = types.SimpleNamespace(progress_sleep_us=0.0)
    assert spin_of(config, 2, cores=2) == 0                       # 2 ranks on 2 cores
    assert spin_of(config, 2, cores=3) == 0
    assert spin_of(config, 2, cores=4) == AGREEMENT_SPIN_US
    assert spin_of(config, 8, cores=16) == AGREEMENT_SPIN_US
    assert spin_of(config, 8, cores=1) == 0                       # a rank bound to one core
    # the launcher's count of this host's ranks, where it is less than the job's
    assert spin_of(config, 8, cores=4, local=2) == AGREEMENT_SPIN_US
    assert spin_of(config, 8, cores=4, local=4) == 0


def test_the_hosts_ranks_are_the_launchers_count_else_the_jobs(monkeypatch):
    config = types.SimpleNamespace(progress_sleep_us=0.0)
    for name in ('MPI_LOCALRANKID', 'MPI_LOCALNRANKS', 'OMPI_COMM_WORLD_LOCAL_RANK',
                 'OMPI_COMM_WORLD_LOCAL_SIZE', 'SLURM_LOCALID', 'SLURM_NTASKS_PER_NODE'):
        monkeypatch.delenv(name, raising=False)
    assert spin_of(config, 4, cores=4) == 0                       # 4 ranks taken as one host's
    monkeypatch.setenv('MPI_LOCALRANKID', '0')
    monkeypatch.setenv('MPI_LOCALNRANKS', '2')
    assert spin_of(config, 4, cores=4) == AGREEMENT_SPIN_US       # 2 of them on this host


def test_no_spin_while_the_machine_has_no_core_to_spare_looked_at_once_a_period():
    answers = [False, True]
    looks = []

    def spare():
        looks.append(1)
        return answers[min(len(looks), len(answers)) - 1]

    spin = Spin(200.0, spare=spare)
    assert spin.us(10.0) == 0.0 and len(looks) == 1
    spin.waited(5e-3)                   # a wait without a spin tells nothing of the spin
    assert spin.us(10.0 + SPIN_LOAD_S / 2) == 0.0 and len(looks) == 1
    assert spin.us(10.0 + SPIN_LOAD_S) == 200.0 and len(looks) == 2


def test_a_core_to_spare_is_read_from_the_cpu_pressure_that_linux_keeps(tmp_path):
    from mpi_kvstore.designs.spin import SPIN_PRESSURE, _spare_cores
    path = tmp_path / 'cpu'
    for some, spare in ((0.0, True), (SPIN_PRESSURE - 0.5, True), (SPIN_PRESSURE, False),
                        (99.2, False)):
        path.write_text('some avg10=%.2f avg60=1.00 avg300=0.50 total=123\n'
                        'full avg10=0.00 avg60=0.00 avg300=0.00 total=0\n' % some)
        assert _spare_cores(str(path)) is spare, some
